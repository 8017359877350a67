"""Benchmark: the training loader's rate per worker with the big cached fields beside today's latents (issue 37).

The trainer's loader (train.data.EpochStream through a DataLoader, exactly as dit-train reads) over synthetic shard
sets written by our own writers, read from the page cache:

  latents     ImageNet-256 SD-VAE posteriors (mean + std, 2 views of 4x32x32, float16: 37 KB per sample), today's
              class-conditional stream
  + CLIP-L    the same with a text sibling set of a 77-token encoder (768 wide, short captions: bench/text_storage.py's
              "short" lengths), Batch.text / text_mask padded to the batch's longest caption
  + Qwen3     the same with a 256-token encoder's text set (1024 wide, the "long" recaption lengths)
  + DINOv2    the same with REPA's cached teacher tokens as a sibling set (768x16x16, 2 views, float16: 786 KB per
              sample; Batch.teacher)
  RAE         RAE's DINOv2-B features as the latents themselves (--store sample, 2 views of 768x16x16, float16:
              789,760 B per sample)

Reported per row and loader-worker count: samples/s (wall clock), MB/s of shard bytes read (every set the batch
comes from), CPU microseconds per sample summed over the main process and its workers (the portable number:
1e6 / it is what one free core sustains), and how many times the rate per worker covers what one GPU consumes
(--gpu-rate samples/s; 700: DiT-XL/2 at 50% MFU on an H200, BENCHMARKS.md "Training").

With --compare TREE the same rows are timed from another checkout too (e.g. the main branch before a loader
change), each round alternating between the two trees in fresh processes over the same shard sets, so both share
the machine's load; the table then gives the median round of each and the ratio of their CPU time per sample. The load average
(os.getloadavg) is printed with every run: on a shared machine the CPU time per sample depends on it, so compare
rows of one run only.

    python bench/loader_text.py                               # 512 samples, workers 1 2
    python bench/loader_text.py --samples 2048 --workers 1 2 4 --repeat 3
    python bench/loader_text.py --rows latents qwen3 clip --compare /path/to/other/checkout --repeat 3
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _checkout import use_checkout  # noqa: E402


def _tree_arg(argv: list[str]) -> Path | None:
    """--tree PATH, read before dit_pipeline is imported (the checkout it is imported from)."""
    return Path(argv[argv.index("--tree") + 1]) if "--tree" in argv else None


use_checkout(_tree_arg(sys.argv))

from text_storage import caption_lengths  # noqa: E402

from dit_pipeline.shards import (FORMAT_VERSION, FORMAT_VERSION_TEXT, Manifest, ShardWriter, read_manifest,  # noqa: E402
                                 sample_key, shard_name, write_manifest)
from dit_pipeline.shards.text import encode_null, length_edges, length_histogram  # noqa: E402
from dit_pipeline.train.data import EpochStream, make_loader  # noqa: E402
from dit_pipeline.train.shard_source import open_shards  # noqa: E402
from dit_pipeline.train.partition import plan_epoch  # noqa: E402


def _manifest(records: list, n: int, per_shard: int, **kw: Any) -> Manifest:
    base = dict(tool_version="bench", extraction={"vae": {"source": "bench"}}, scaling_factor=0.18215,
                shift_factor=None, image_size=256, views=2, class_names=[f"c{i}" for i in range(1000)],
                num_classes=1000, total_samples=n, samples_per_shard=per_shard, shards=records, skipped=[])
    return Manifest(**{**base, **kw})


def write_latents(folder: Path, n: int, per_shard: int, *, shape: tuple[int, ...], store: str) -> None:
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    records = []
    for s in range(0, n, per_shard):
        with ShardWriter(folder / shard_name(s // per_shard), dtype="float16") as w:
            for k in range(s, min(n, s + per_shard)):
                x = rng.standard_normal((2, *shape), dtype=np.float32)
                arrays = ({"mean": x, "std": np.abs(x) * 0.1} if store == "posterior" else {"latent": x})
                w.write(sample_key(k), label=k % 1000, meta={}, **arrays)
            records.append(w.close())
    write_manifest(folder, _manifest(records, n, per_shard, format_version=FORMAT_VERSION, store=store,
                                     dtype="float16", latent_shape=list(shape)))


def write_text(folder: Path, n: int, per_shard: int, *, dim: int, max_length: int, kind: str) -> None:
    folder.mkdir(parents=True)
    rng = np.random.default_rng(1)
    lengths, _ = caption_lengths(kind, n, sigma=0.35, special=0, max_length=max_length)
    records = []
    for s in range(0, n, per_shard):
        with ShardWriter(folder / shard_name(s // per_shard), dtype="bfloat16") as w:
            for k in range(s, min(n, s + per_shard)):
                w.write_text(sample_key(k), [rng.standard_normal((int(lengths[k]), dim), dtype=np.float32)])
            records.append(w.close())
    text = {"encoder": {"kind": "text", "name": "bench"}, "dim": dim, "max_length": max_length, "captions": n,
            "tokens": int(lengths.sum()), "truncated": 0,
            "length_histogram": {"edges": length_edges(max_length), "counts": length_histogram(lengths, max_length)},
            "null": encode_null(np.zeros((0, dim), np.float32), "bfloat16")}
    write_manifest(folder, _manifest(records, n, per_shard, format_version=FORMAT_VERSION_TEXT, store="text",
                                     dtype="bfloat16", latent_shape=[dim], scaling_factor=1.0, text=text))


def _cpu_s() -> float:
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def time_loader(primary: Path, workers: int, batch: int, *, text: Path | None = None,
                sibling: Path | None = None) -> tuple[float, float]:
    """(samples/s, CPU us per sample) of one epoch of the trainer's loader."""
    src = open_shards(str(primary))
    plan = plan_epoch(src.sizes, seed=0, epoch=0, world_size=1, workers=max(1, workers), micro_batch=batch, accum=1)
    stream = EpochStream(src, plan, 0, seed=0, buffer=256,
                         text=(str(text), read_manifest(text)) if text else None,
                         sibling=(str(sibling), read_manifest(sibling)) if sibling else None)
    t0, c0 = time.perf_counter(), _cpu_s()
    loader = make_loader(stream, num_workers=workers, prefetch_factor=4, pin_memory=False)
    n = sum(len(b.keys) for b in itertools.islice(loader, plan.micro_batches))
    del loader
    wall, cpu = time.perf_counter() - t0, _cpu_s() - c0
    return n / wall, cpu / n * 1e6


ROWS = {  # name: (label, primary set, text set, sibling set)
    "latents": ("latents (SD-VAE posterior)", "latents", None, None),
    "clip": ("latents + CLIP-L text (77 tokens)", "latents", "clip", None),
    "qwen3": ("latents + Qwen3 text (256 tokens)", "latents", "qwen3", None),
    "dinov2": ("latents + DINOv2 teacher tokens (REPA cached)", "latents", None, "dinov2"),
    "rae": ("RAE DINOv2-B features as latents", "rae", None, None),
}


def write_sets(root: Path, rows: list[str], n: int, per: int) -> None:
    needed = {s for r in rows for s in ROWS[r][1:] if s is not None}
    if "latents" in needed:
        write_latents(root / "latents", n, per, shape=(4, 32, 32), store="posterior")
    if "clip" in needed:
        write_text(root / "clip", n, per, dim=768, max_length=77, kind="short")
    if "qwen3" in needed:
        write_text(root / "qwen3", n, per, dim=1024, max_length=256, kind="long")
    for name in ("dinov2", "rae"):
        if name in needed:
            write_latents(root / name, n, per, shape=(768, 16, 16), store="sample")


def time_rows(root: Path, rows: list[str], workers: list[int], batch: int, repeat: int, warm: bool
              ) -> dict[str, tuple[float, float]]:
    """{"row/workers": (samples/s, CPU us per sample)}: the best of `repeat` rounds."""
    def run(name: str, w: int) -> tuple[float, float]:
        _, primary, text, sibling = ROWS[name]
        return time_loader(root / primary, w, batch, text=root / text if text else None,
                           sibling=root / sibling if sibling else None)
    if warm:  # the page cache
        for name in rows:
            run(name, 0)
    best: dict[str, tuple[float, float]] = {}
    for _ in range(repeat):
        for w in workers:
            for name in rows:
                r = run(name, w)
                if r[0] > best.get(f"{name}/{w}", (0.0, 0.0))[0]:
                    best[f"{name}/{w}"] = r
    return best


def _child(a: argparse.Namespace, tree: Path) -> dict[str, tuple[float, float]]:
    cmd = [sys.executable, __file__, "--child", "--tree", str(tree), "--data", str(a.data), "--samples",
           str(a.samples), "--batch", str(a.batch), "--rows", *a.rows, "--workers", *map(str, a.workers)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return {k: tuple(v) for k, v in json.loads(out.strip().splitlines()[-1]).items()}  # type: ignore[misc]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=512)
    p.add_argument("--per-shard", type=int, default=128)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--gpu-rate", type=float, default=700.0, help="samples/s one GPU consumes")
    p.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    p.add_argument("--compare", type=Path, default=None, help="another checkout, timed in alternation with this one")
    p.add_argument("--tree", type=Path, default=None, help="the checkout to import dit_pipeline from")
    p.add_argument("--data", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    if a.child:  # one round of one tree over existing sets: JSON on the last line
        print(json.dumps(time_rows(a.data, a.rows, a.workers, a.batch, 1, warm=False)))
        return
    root = Path(tempfile.mkdtemp(prefix="bench-loader-text-"))
    n, per = a.samples, a.per_shard
    load0 = os.getloadavg()
    try:
        write_sets(root, a.rows, n, per)
        per_sample = {name: sum(read_manifest(root / s).total_bytes for s in ROWS[name][1:] if s) / n
                      for name in a.rows}
        if a.compare is None:
            results = {"this": time_rows(root, a.rows, a.workers, a.batch, a.repeat, warm=True)}
        else:
            a.data = root
            time_rows(root, a.rows, [0], a.batch, 1, warm=False)  # warm the page cache
            here = ROOT_TREE
            rounds: dict[str, dict[str, list[tuple[float, float]]]] = {"this": {}, "other": {}}
            for i in range(a.repeat):  # alternate (and swap the order), so both trees share the load of each moment
                order = (("other", a.compare), ("this", here))
                for key, tree in (order if i % 2 == 0 else order[::-1]):
                    for k, r in _child(a, tree).items():
                        rounds[key].setdefault(k, []).append(r)
            # the median round of each (rate and CPU time separately): robust to a burst of load in one round
            results = {key: {k: (float(np.median([r[0] for r in v])), float(np.median([r[1] for r in v])))
                             for k, v in per.items()} for key, per in rounds.items()}
        load1 = os.getloadavg()
        print(f"# {n} samples, batch {a.batch}, {per} per shard; torch {torch.__version__}; load average "
              f"{load0[0]:.1f} at the start, {load1[0]:.1f} at the end ({os.cpu_count()} CPUs)")
        if a.compare is None:
            print("| stream | bytes/sample | workers | samples/s | MB/s | CPU us/sample | per worker / GPU need |\n"
                  "|---|---|---|---|---|---|---|")
        else:
            print(f"# this: {ROOT_TREE}; other: {a.compare}\n"
                  "| stream | workers | samples/s this (median) | other | CPU us/sample this (median) | other | other / this |\n"
                  "|---|---|---|---|---|---|---|")
        for name in a.rows:
            label = ROWS[name][0]
            for w in a.workers:
                rate, cpu = results["this"][f"{name}/{w}"]
                if a.compare is None:
                    print(f"| {label} | {per_sample[name]:,.0f} | {w} | {rate:,.0f} | "
                          f"{rate * per_sample[name] / 1e6:,.0f} | {cpu:,.0f} | {rate / w / a.gpu_rate:.2f}x |", flush=True)
                else:
                    orate, ocpu = results["other"][f"{name}/{w}"]
                    print(f"| {label} | {w} | {rate:,.0f} | {orate:,.0f} | {cpu:,.0f} | {ocpu:,.0f} | "
                          f"{ocpu / cpu:.2f}x |", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)


ROOT_TREE = Path(__file__).resolve().parent.parent


if __name__ == "__main__":
    main()
