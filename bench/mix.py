"""Benchmark: a data mix's loader with 1, 2 and 4 sources against one shard set's, and the validation pass's cost.

Loader: the same N ImageNet-256-like latents (2 views of 4x32x32, posterior mean + std in float16, 1024-sample
shards, as dit-extract writes them) split into 1, 2 or 4 shard sets of N / k samples (the same total bytes), read
for one epoch by

  shards    one shard set (`--shards`): train.data's EpochStream, W loader workers (the trainer's loader today)
  mix-k     k sources, each sample once (train.mixdata's MixFeed, W lanes read by W workers, pieces of
            batch / W samples joined into the rank's batches in the main process)

each in a fresh process (imports outside the timed part), the configurations interleaved, each row the best of
--repeat rounds. Reported: latents/s (wall clock), the ratio to mix-1 and to shards, CPU microseconds per latent
(main process + workers), and the readers' memory: how much the resident set grows while the epoch is read in one
process by one reader (one lane for a mix: its shuffle buffer, its open shards and its batches).

Validation: the wall time of one validation pass (train.validation.val_losses of the EMA and the raw weights,
--val-samples samples in chunks of --val-batch) against one training step of --global-batch samples (forward,
backward, AdamW) of the same model, as a fraction; the expected fraction is weights x samples / (3 x global batch)
(a forward costs about a third of a training step).

Plan: the seconds of one epoch's plan of a mix of 4.3M samples (pure functions of integers, on every rank).

    python bench/mix.py                            # 8192 latents, 2 workers, 3 rounds
    python bench/mix.py --latents 16384 --workers 4 --repeat 3
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _checkout import use_checkout  # noqa: E402

use_checkout()

from dit_pipeline.shards import FORMAT_VERSION, Manifest, ShardWriter, sample_key, shard_name, write_manifest  # noqa: E402

SCALE = 0.18215


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--latents", type=int, default=8192)
    p.add_argument("--per-shard", type=int, default=1024)
    p.add_argument("--batch", type=int, default=256, help="global batch (one rank)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--buffer", type=int, default=1000)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--dir", default=None)
    p.add_argument("--val-samples", type=int, default=128)
    p.add_argument("--val-batch", type=int, default=32)
    p.add_argument("--global-batch", type=int, default=64, help="the training step the validation pass is compared to")
    p.add_argument("--one", nargs=3, metavar=("KIND", "K", "ROOT"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


def write_set(folder: Path, first: int, n: int, per_shard: int, rng: np.random.Generator) -> None:
    folder.mkdir(parents=True)
    records = []
    for s, i in enumerate(range(0, n, per_shard)):
        with ShardWriter(folder / shard_name(s), dtype="float16") as w:
            for k in range(first + i, first + min(n, i + per_shard)):
                mean = rng.standard_normal((2, 4, 32, 32), dtype=np.float32) * 5
                std = np.abs(rng.standard_normal((2, 4, 32, 32), dtype=np.float32)) * 0.1
                w.write(sample_key(k), label=k % 1000, meta={"i": k}, mean=mean, std=std)
            records.append(w.close())
    m = Manifest(format_version=FORMAT_VERSION, tool_version="bench", extraction={"vae": {"source": "bench"}},
                 scaling_factor=SCALE, shift_factor=None, image_size=256, views=2, store="posterior", dtype="float16",
                 latent_shape=[4, 32, 32], class_names=[f"n{c:08d}" for c in range(1000)], num_classes=1000,
                 total_samples=n, samples_per_shard=per_shard, shards=records, skipped=[])
    write_manifest(folder, m)


def write_data(root: Path, n: int, per_shard: int) -> None:
    rng = np.random.default_rng(0)
    for k in (1, 2, 4):
        for j in range(k):
            write_set(root / f"k{k}" / f"s{j}", j * (n // k), n // k, per_shard, rng)


def _cpu_s() -> float:
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def one(kind: str, k: int, root: Path, a: argparse.Namespace) -> dict[str, float]:
    """One epoch of one loader, in this (fresh) process."""
    torch.set_num_threads(1)
    folders = [root / f"k{k}" / f"s{j}" for j in range(k)]
    if kind == "shards":
        from dit_pipeline.train.data import EpochStream, make_loader
        from dit_pipeline.train.shard_source import open_shards
        from dit_pipeline.train.partition import plan_epoch

        src = open_shards(str(folders[0]))
        plan = plan_epoch(src.sizes, seed=0, epoch=0, world_size=1, workers=a.workers, micro_batch=a.batch, accum=1)
        items = make_loader(EpochStream(src, plan, 0, seed=0, buffer=a.buffer), num_workers=a.workers,
                            prefetch_factor=4, pin_memory=False)
    else:
        from dit_pipeline.train.mix import mix_spec, open_mix
        from dit_pipeline.train.mixdata import MixFeed

        mix = open_mix(mix_spec([str(f) for f in folders], None))  # type: ignore[arg-type]
        feed = MixFeed(mix, seed=0, lanes=max(1, a.workers), global_batch=a.batch, accum=1, world=1, rank=0,
                       workers=a.workers, buffer=a.buffer, shards_in_flight=16)
        items = feed.loader(feed.plan(0), 0, prefetch_factor=4)
    before = _rss_mb()
    t0, c0 = time.perf_counter(), _cpu_s()
    n = sum(len(b.keys) for b in items)
    wall, cpu = time.perf_counter() - t0, _cpu_s() - c0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"rate": n / wall, "cpu_us": cpu / n * 1e6, "growth_mb": peak - before, "n": n}


def _rss_mb() -> float:
    """This process's resident set now (MB), from /proc/self/statm."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def _run_one(kind: str, k: int, root: Path, a: argparse.Namespace, workers: int) -> dict[str, float]:
    out = subprocess.run([sys.executable, "-W", "ignore", __file__, "--one", kind, str(k), str(root),
                          "--workers", str(workers), "--batch", str(a.batch), "--buffer", str(a.buffer)],
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def loader_bench(a: argparse.Namespace, root: Path) -> None:
    configs = [("shards", 1), ("mix", 1), ("mix", 2), ("mix", 4)]
    best: dict[tuple[str, int], dict[str, float]] = {}
    memory: dict[tuple[str, int], float] = {}
    for _ in range(a.repeat):
        for kind, k in configs:
            r = _run_one(kind, k, root, a, a.workers)
            if (kind, k) not in best or r["rate"] > best[(kind, k)]["rate"]:
                best[(kind, k)] = r
    for kind, k in configs:  # the readers' memory: one reader (one lane) read in one process
        memory[(kind, k)] = _run_one(kind, k, root, a, 0)["growth_mb"]
    ref, single = best[("mix", 1)]["rate"], best[("shards", 1)]["rate"]
    print(f"\n{a.latents} latents in 1, 2 or 4 sets, batch {a.batch}, {a.workers} workers (mix: {a.workers} lanes), "
          f"best of {a.repeat}; memory: growth of the resident set while reading the epoch in one process\n")
    print("| loader | sources | latents/s | vs mix-1 | vs shards | CPU us/latent | readers' memory MB |")
    print("|---|---|---|---|---|---|---|")
    for (kind, k), r in best.items():
        print(f"| {kind} | {k} | {r['rate']:,.0f} | {r['rate'] / ref:.2f} | {r['rate'] / single:.2f} | "
              f"{r['cpu_us']:.0f} | {memory[(kind, k)]:.0f} |")


def val_bench(a: argparse.Namespace) -> None:
    """One validation pass (both weights) against one training step, same model, CPU."""
    from dit_pipeline import dit
    from dit_pipeline.dit.conditioning import ClassLabels
    from dit_pipeline.dit.objectives import build_objective
    from dit_pipeline.train.validation import ValSet, val_losses

    torch.manual_seed(0)
    model = dit.create_model("DiT-S/2", input_size=32, num_classes=1000, in_channels=4, depth=4, hidden_size=192,
                             num_heads=3)
    ema = dit.create_model("DiT-S/2", input_size=32, num_classes=1000, in_channels=4, depth=4, hidden_size=192,
                           num_heads=3)
    obj, cond = build_objective("ddpm", {}), ClassLabels(1000, 0.1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    n = a.val_samples
    val = ValSet("bench", torch.randn(n, 4, 32, 32), torch.arange(n) % 1000, torch.randn(n, 4, 32, 32), {"bench": n})
    x, y = torch.randn(a.global_batch, 4, 32, 32), torch.arange(a.global_batch) % 1000

    def step() -> None:
        t = torch.randint(0, 1000, (a.global_batch,))
        loss = obj.training_losses(model, x, t, model_kwargs={"y": y})["loss"].mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def val_pass() -> None:
        for m in (ema, model):
            val_losses(m, obj, cond, val, k=8, batch=a.val_batch, device=torch.device("cpu"))

    step()
    val_pass()  # warm-up
    steps, vals = [], []
    for _ in range(a.repeat):  # interleaved
        t0 = time.perf_counter()
        step()
        steps.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        val_pass()
        vals.append(time.perf_counter() - t0)
    s, v = min(steps), min(vals)
    print(f"\nvalidation pass: {n} samples x 2 weights in chunks of {a.val_batch}: {v:.2f} s; training step of "
          f"{a.global_batch} samples: {s:.2f} s; ratio {v / s:.2f} steps (expected 2 x {n} / (3 x "
          f"{a.global_batch}) = {2 * n / (3 * a.global_batch):.2f}); model DiT-S/2 depth 4 hidden 192 on 4x32x32 "
          f"latents, {torch.get_num_threads()} thread(s), best of {a.repeat}")


def plan_bench(a: argparse.Namespace) -> None:
    """The cost of one epoch's plan (train.mixplan.plan_mix_epoch, every rank computes it): an ImageNet-sized source
    (1251 shards of 1024, 1% held out) at proportion 0.7 beside one of 3000 shards at 0.3, 64 lanes."""
    from dit_pipeline.train.mixplan import ShardKeys, SourceShape, Weight, plan_mix_epoch

    in1k = SourceShape("in1k", tuple(ShardKeys(1024, i * 1024, i * 1024 + 1023) for i in range(1251)),
                       Weight(proportion=0.7), 0.01)
    web = SourceShape("web", tuple(ShardKeys(1024, i * 1024, i * 1024 + 1023) for i in range(3000)),
                      Weight(proportion=0.3))
    t0 = time.perf_counter()
    plan = plan_mix_epoch([in1k, web], seed=0, epoch=0, lanes=64, global_batch=1024)
    first = time.perf_counter() - t0
    times = []
    for e in range(1, a.repeat + 1):
        t0 = time.perf_counter()
        plan_mix_epoch([in1k, web], seed=0, epoch=e, lanes=64, global_batch=1024)
        times.append(time.perf_counter() - t0)
    print(f"\nepoch plan of {sum(plan.asked):,} samples ({len(plan.lanes)} lanes, {plan.steps:,} steps of 1024): first "
          f"{first:.2f} s (lists the held-out keys once), then {min(times):.2f} s per epoch (best of {a.repeat})")


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    if a.one:
        print(json.dumps(one(a.one[0], int(a.one[1]), Path(a.one[2]), a)))
        return
    torch.set_num_threads(1)
    root = Path(a.dir) if a.dir else Path(tempfile.mkdtemp(prefix="bench-mix-"))
    if not (root / "k4").is_dir():
        write_data(root, a.latents, a.per_shard)
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
          f"{time.strftime('%Y-%m-%d')}, load average {os.getloadavg()[0]:.1f}")
    loader_bench(a, root)
    val_bench(a)
    plan_bench(a)
    print(f"# load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
