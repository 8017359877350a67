"""Benchmark: the trainer's loader with and without the pixels a REPA teacher needs, side by side in one run.

Two shard sets of the same N ImageNet-256-like samples (4x32x32 latents, 2 views, posterior mean + std in
float16, as dit-extract writes them): one as `dit-extract` writes it by default, one with each sample's 256 px
crop as lossless WebP (`--pixels`: shards/pixels.py; the crops are bench/pixels.py's synthetic natural-image
stand-ins, "dead leaves" through JPEG). Each is read by train.data.EpochStream through a DataLoader with W
workers exactly as dit-train reads it (`pixels=True`: the WebP bytes read, decoded in the worker and turned
into the orientation of each latent's view, `Batch.pixels` uint8 [B, 256, 256, 3]).

Reported per worker count: samples/s (wall clock) of both, their ratio, and the CPU time per sample summed over
the main process and its workers (independent of other load: 1e6 / that is what one free core sustains).

    python bench/loader_pixels.py                         # 4096 samples, workers 1 2
    python bench/loader_pixels.py --samples 8192 --workers 1 2 4 --repeat 3
"""
from __future__ import annotations

import argparse
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _checkout import use_checkout  # noqa: E402

use_checkout()  # run from a checkout without installing

from loader import _best, _cpu_s  # noqa: E402
from pixels import synthetic_crops  # noqa: E402

from dit_pipeline.shards import (FORMAT_VERSION, FORMAT_VERSION_PIXELS, Manifest, ShardWriter, sample_key,  # noqa: E402
                                 shard_name, write_manifest)
from dit_pipeline.shards.pixels import pixels_entry  # noqa: E402
from dit_pipeline.train.data import EpochStream, make_loader  # noqa: E402
from dit_pipeline.train.shard_source import open_shards  # noqa: E402
from dit_pipeline.train.partition import plan_epoch  # noqa: E402

SCALE = 0.18215


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=4096)
    p.add_argument("--per-shard", type=int, default=512)
    p.add_argument("--batch", type=int, default=32, help="batch per loader step (a GPU's micro-batch)")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--crops", type=int, default=64, help="distinct synthetic crops (cycled over the samples)")
    p.add_argument("--repeat", type=int, default=1, help="rounds; each row reports the best")
    p.add_argument("--dir", default=None, help="where to write the data [a temp folder]")
    return p.parse_args(argv)


def write_sets(root: Path, n: int, per_shard: int, crops: list[np.ndarray]) -> tuple[Path, Path]:
    """The same latents as two shard sets: without pixels, and with each sample's crop."""
    rng = np.random.default_rng(0)
    out = []
    for with_pixels in (False, True):
        folder = root / ("pixels" if with_pixels else "plain")
        folder.mkdir(parents=True)
        records, pixel_bytes = [], 0
        gen = np.random.default_rng(0)
        for i in range(0, n, per_shard):
            with ShardWriter(folder / shard_name(i // per_shard), dtype="float16", pixels=with_pixels) as w:
                for k in range(i, min(n, i + per_shard)):
                    mean = gen.standard_normal((2, 4, 32, 32), dtype=np.float32) * 5
                    std = np.abs(gen.standard_normal((2, 4, 32, 32), dtype=np.float32)) * 0.1
                    kw = {"pixels": crops[k % len(crops)]} if with_pixels else {}
                    w.write(sample_key(k), label=k % 1000, meta={"path": f"c/{k}.JPEG"}, mean=mean, std=std, **kw)
                records.append(w.close())
                pixel_bytes += w.pixel_bytes if with_pixels else 0
        m = Manifest(format_version=FORMAT_VERSION_PIXELS if with_pixels else FORMAT_VERSION, tool_version="bench",
                     extraction={"vae": {"source": "bench"}}, scaling_factor=SCALE, shift_factor=None,
                     image_size=256, views=2, store="posterior", dtype="float16", latent_shape=[4, 32, 32],
                     class_names=[f"n{c:08d}" for c in range(1000)], num_classes=1000, total_samples=n,
                     samples_per_shard=per_shard, shards=records, skipped=[],
                     pixels=pixels_entry(256, pixel_bytes) if with_pixels else None)
        write_manifest(folder, m)
        out.append(folder)
    del rng
    return out[0], out[1]


def time_loader(folder: Path, workers: int, batch: int, pixels: bool) -> tuple[float, float]:
    """(samples/s wall clock, CPU microseconds per sample over all processes) of one epoch."""
    src = open_shards(str(folder))
    plan = plan_epoch(src.sizes, seed=0, epoch=0, world_size=1, workers=max(1, workers), micro_batch=batch, accum=1)
    stream = EpochStream(src, plan, 0, seed=0, buffer=256, pixels=pixels)
    t0, c0 = time.perf_counter(), _cpu_s()
    n = 0
    for b in make_loader(stream, num_workers=workers, prefetch_factor=4, pin_memory=False):
        assert (b.pixels is not None) == pixels
        n += len(b.keys)
    wall, cpu = time.perf_counter() - t0, _cpu_s() - c0
    return n / wall, cpu / n * 1e6


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    torch.set_num_threads(1)
    root = Path(a.dir) if a.dir else Path(tempfile.mkdtemp(prefix="bench-loader-pixels-"))
    try:
        crops = synthetic_crops(a.crops, 256)
        plain, pixels = write_sets(root, a.samples, a.per_shard, crops)
        size = sum(p.stat().st_size for p in pixels.glob("*.tar")) / a.samples
        base = sum(p.stat().st_size for p in plain.glob("*.tar")) / a.samples
        print(f"# {a.samples} samples, {base / 1e3:.1f} KB/sample without pixels, {size / 1e3:.1f} KB with; "
              f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}")
        time_loader(plain, 0, a.batch, False)  # warm the page cache
        time_loader(pixels, 0, a.batch, True)
        res: dict[tuple[bool, int], list[tuple[float, float]]] = {}
        for _ in range(a.repeat):
            for w in a.workers:
                for px in (False, True):
                    res.setdefault((px, w), []).append(time_loader(pixels if px else plain, w, a.batch, px))
        print("| workers | latents samples/s | latents+pixels samples/s | ratio | latents CPU us/sample | "
              "latents+pixels CPU us/sample |\n|---|---|---|---|---|---|")
        for w in a.workers:
            (s, s_cpu), (p, p_cpu) = _best(res[(False, w)]), _best(res[(True, w)])
            print(f"| {w} | {s:,.0f} | {p:,.0f} | {p / s:.3f} | {s_cpu:.0f} | {p_cpu:.0f} |", flush=True)
    finally:
        if not a.dir:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
