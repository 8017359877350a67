"""Benchmark: the trainer's shard loader beside a one-.npy-file-per-sample loader, on the same latents, in one run.

Both read the same N ImageNet-256-like latents (4x32x32, 2 views) from the page cache of the same disk:

  shards    the dit-train pipeline: train.data.EpochStream over WebDataset tar shards (posterior mean + std,
            float16, as dit-extract writes them) through a DataLoader with W workers: streaming tar reads,
            validation against the manifest, per-reader shuffle buffer, per-sample view choice and fresh
            posterior noise, scaling, batching in the workers
  npy       the fast-DiT layout, written here from its description: one float32 .npy holding a fixed scaled
            latent [1, 4, 32, 32] and one .npy holding the label per sample; a map-style Dataset that
            np.loads both files, shuffled by a DataLoader with W workers and default collation
  decode    shards.iter_shard alone in one process (the reading + validation part of one worker): float32
            arrays (the default) and raw=True (the stored float16 arrays, what the trainer reads)
  before    with --compare-with TREE: the shard loader of another checkout of this repository (e.g. an older
            commit: `git worktree add /tmp/before <rev>`), on the same shards, interleaved with this one

Reported: latents/s (wall clock) per loader and worker count, the ratio shards / npy, and the CPU time per
latent summed over the main process and its workers (independent of other load on the machine: 1e6 / that
is the rate one free core sustains). The npy loader does less work
per sample (no noise, no view choice, no validation); the shard loader wins on syscalls and metadata (two
opens per sample vs. one per shard), which matters most on network file systems (not measured here).

    python bench/loader.py                       # 16384 latents, workers 1 2 4
    python bench/loader.py --latents 65536 --workers 4 8 16
    python bench/loader.py --compare-with /tmp/before --repeat 3

Every shard-loader measurement runs in a fresh Python process (imports outside the timed part); with
--repeat N each row is the best of N interleaved rounds (the wall-clock rate on a shared machine only
ever loses to other load), with the CPU time of that round.
"""
from __future__ import annotations

import argparse
import os
import platform
import resource
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _checkout import use_checkout  # noqa: E402

use_checkout()  # run from a checkout without installing

from dit_pipeline.shards import FORMAT_VERSION, Manifest, ShardWriter, iter_shard, sample_key, shard_name, write_manifest  # noqa: E402
from dit_pipeline.train.data import EpochStream, make_loader  # noqa: E402
from dit_pipeline.train.shard_source import open_shards  # noqa: E402
from dit_pipeline.train.partition import plan_epoch  # noqa: E402

SCALE = 0.18215


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--latents", type=int, default=16384)
    p.add_argument("--per-shard", type=int, default=1024, help="samples per shard")
    p.add_argument("--size", type=int, default=32, help="latent height/width (32 = 256px images)")
    p.add_argument("--views", type=int, default=2)
    p.add_argument("--batch", type=int, default=256, help="batch per loader step (a GPU's micro-batch)")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--buffer", type=int, default=1000, help="shuffle buffer per reader")
    p.add_argument("--dir", default=None, help="where to write the data [a temp folder]")
    p.add_argument("--repeat", type=int, default=1, help="rounds; each row reports the best")
    p.add_argument("--compare-with", default=None, metavar="TREE",
                   help="another checkout of this repository whose shard loader to time beside this one")
    return p.parse_args(argv)


def write_data(root: Path, n: int, per_shard: int, size: int, views: int) -> tuple[Path, Path]:
    """The same latents twice: as tar shards (mean/std float16) and as fast-DiT .npy files."""
    rng = np.random.default_rng(0)
    shards, npy = root / "shards", root / "npy"
    (npy / "features").mkdir(parents=True)
    (npy / "labels").mkdir(parents=True)
    shards.mkdir()
    records = []
    for i in range(0, n, per_shard):
        with ShardWriter(shards / shard_name(i // per_shard), dtype="float16") as w:
            for k in range(i, min(n, i + per_shard)):
                mean = rng.standard_normal((views, 4, size, size), dtype=np.float32) * 5
                std = np.abs(rng.standard_normal((views, 4, size, size), dtype=np.float32)) * 0.1
                label = k % 1000
                w.write(sample_key(k), label=label, meta={"path": f"n{label:08d}/img{k}.JPEG"}, mean=mean, std=std)
                fixed = (mean[:1] + std[:1] * rng.standard_normal(std[:1].shape, dtype=np.float32)) * SCALE
                np.save(npy / "features" / f"{k}.npy", fixed.astype(np.float32))
                np.save(npy / "labels" / f"{k}.npy", np.array([label], dtype=np.int64))
            records.append(w.close())
    m = Manifest(format_version=FORMAT_VERSION, tool_version="bench", extraction={"vae": {"source": "bench"}},
                 scaling_factor=SCALE, shift_factor=None, image_size=8 * size, views=views, store="posterior",
                 dtype="float16", latent_shape=[4, size, size], class_names=[f"n{c:08d}" for c in range(1000)],
                 num_classes=1000, total_samples=n, samples_per_shard=per_shard, shards=records, skipped=[])
    write_manifest(shards, m)
    return shards, npy


class NpyDataset(Dataset):
    """fast-DiT's layout: features/<i>.npy + labels/<i>.npy, one pair per sample."""

    def __init__(self, root: Path):
        self.features = sorted(os.listdir(root / "features"))
        self.labels = sorted(os.listdir(root / "labels"))
        self.root = root

    def __len__(self) -> int:
        return len(self.features)

    def __getitem__(self, i: int):
        x = np.load(self.root / "features" / self.features[i])
        y = np.load(self.root / "labels" / self.labels[i])
        return torch.from_numpy(x), torch.from_numpy(y)


def _cpu_s() -> float:
    """CPU seconds of this process and its reaped children (DataLoader workers are joined at the end)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def _timed(batches) -> tuple[float, float]:
    """(latents/s wall clock, CPU microseconds per latent, all processes) of iterating `batches`."""
    t0, c0 = time.perf_counter(), _cpu_s()
    n = 0
    for b in batches:
        n += len(b[0])
    del batches
    wall, cpu = time.perf_counter() - t0, _cpu_s() - c0
    return n / wall, cpu / n * 1e6


def time_shards(folder: Path, workers: int, batch: int, buffer: int) -> tuple[float, float]:
    src = open_shards(str(folder))
    plan = plan_epoch(src.sizes, seed=0, epoch=0, world_size=1, workers=max(1, workers), micro_batch=batch, accum=1)
    stream = EpochStream(src, plan, 0, seed=0, buffer=buffer)
    return _timed(make_loader(stream, num_workers=workers, prefetch_factor=4, pin_memory=False))


_IN_TREE = """
import json, sys
from pathlib import Path
tree = Path(sys.argv[1])
sys.path[:0] = [str(tree), str(tree / "bench")]
if (tree / "bench" / "_checkout.py").exists():  # trees with the dit_pipeline namespace
    import _checkout
    _checkout.use_checkout(tree)
import torch
torch.set_num_threads(1)
import loader
print(json.dumps(loader.time_shards(Path(sys.argv[2]), *map(int, sys.argv[3:]))))
"""


def time_shards_in(tree: Path, folder: Path, workers: int, batch: int, buffer: int) -> tuple[float, float]:
    """time_shards of the checkout `tree`, in a fresh process."""
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", _IN_TREE, str(tree), str(folder), str(workers),
                          str(batch), str(buffer)], cwd=tree, check=True, capture_output=True, text=True)
    rate, cpu = json.loads(out.stdout.strip().splitlines()[-1])
    return rate, cpu


def time_npy(folder: Path, workers: int, batch: int) -> tuple[float, float]:
    loader = DataLoader(NpyDataset(folder), batch_size=batch, shuffle=True, num_workers=workers, drop_last=True,
                        prefetch_factor=4 if workers else None, generator=torch.Generator().manual_seed(0))
    return _timed(iter(loader))


def time_decode(folder: Path, raw: bool) -> float:
    src = open_shards(str(folder))
    t0 = time.perf_counter()
    n = sum(1 for url in src.urls for _ in iter_shard(url, src.manifest, raw=raw))
    return n / (time.perf_counter() - t0)


def _best(rounds: list[tuple[float, float]]) -> tuple[float, float]:
    return max(rounds, key=lambda r: r[0])


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    torch.set_num_threads(1)
    root = Path(a.dir) if a.dir else Path(tempfile.mkdtemp(prefix="bench-loader-"))
    try:
        t0 = time.perf_counter()
        shards, npy = write_data(root, a.latents, a.per_shard, a.size, a.views)
        print(f"# {a.latents} latents [{a.views}, 4, {a.size}, {a.size}] written in {time.perf_counter() - t0:.1f}s; "
              f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}")
        time_shards(shards, 0, a.batch, a.buffer)  # warm the page cache for both layouts
        time_npy(npy, 0, a.batch)
        for raw in (False, True):
            rate = max(time_decode(shards, raw) for _ in range(a.repeat))
            print(f"decode only (iter_shard{', raw=True' if raw else ''}, 1 process): {rate:,.0f} latents/s")
        here, other = Path(__file__).resolve().parent.parent, a.compare_with and Path(a.compare_with).resolve()
        results: dict[tuple[str, int], list[tuple[float, float]]] = {}
        for _ in range(a.repeat):
            for w in a.workers:
                results.setdefault(("shards", w), []).append(time_shards_in(here, shards, w, a.batch, a.buffer))
                if other:
                    results.setdefault(("before", w), []).append(time_shards_in(other, shards, w, a.batch, a.buffer))
                results.setdefault(("npy", w), []).append(time_npy(npy, w, a.batch))
        head = "| workers | shards latents/s | npy latents/s | ratio | shards CPU us/latent | npy CPU us/latent |"
        if other:
            head += f" before ({other.name}) latents/s | before CPU us/latent | speed-up (CPU) |"
        print(head + "\n" + "|---" * (head.count("|") - 1) + "|")
        for w in a.workers:
            (s, s_cpu), (f, f_cpu) = _best(results[("shards", w)]), _best(results[("npy", w)])
            row = f"| {w} | {s:,.0f} | {f:,.0f} | {s / f:.2f} | {s_cpu:.0f} | {f_cpu:.0f} |"
            if other:
                b, b_cpu = _best(results[("before", w)])
                row += f" {b:,.0f} | {b_cpu:.0f} | {s / b:.2f}x ({b_cpu / s_cpu:.2f}x) |"
            print(row, flush=True)
    finally:
        if not a.dir:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
