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

    python bench/loader_text.py                               # 512 samples, workers 1 2
    python bench/loader_text.py --samples 2048 --workers 1 2 4 --repeat 3
"""
from __future__ import annotations

import argparse
import itertools
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _checkout import use_checkout  # noqa: E402

use_checkout()

from text_storage import caption_lengths  # noqa: E402

from dit_pipeline.shards import (FORMAT_VERSION, FORMAT_VERSION_TEXT, Manifest, ShardWriter, read_manifest,  # noqa: E402
                                 sample_key, shard_name, write_manifest)
from dit_pipeline.shards.text import encode_null, length_edges, length_histogram  # noqa: E402
from dit_pipeline.train.data import EpochStream, make_loader, open_shards  # noqa: E402
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


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=512)
    p.add_argument("--per-shard", type=int, default=128)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--gpu-rate", type=float, default=700.0, help="samples/s one GPU consumes")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="bench-loader-text-"))
    n, per = a.samples, a.per_shard
    try:
        write_latents(root / "latents", n, per, shape=(4, 32, 32), store="posterior")
        write_text(root / "clip", n, per, dim=768, max_length=77, kind="short")
        write_text(root / "qwen3", n, per, dim=1024, max_length=256, kind="long")
        write_latents(root / "dinov2", n, per, shape=(768, 16, 16), store="sample")
        write_latents(root / "rae", n, per, shape=(768, 16, 16), store="sample")
        rows = {"latents (SD-VAE posterior)": dict(primary=root / "latents", sets=["latents"]),
                "latents + CLIP-L text (77 tokens)": dict(primary=root / "latents", text=root / "clip",
                                                          sets=["latents", "clip"]),
                "latents + Qwen3 text (256 tokens)": dict(primary=root / "latents", text=root / "qwen3",
                                                          sets=["latents", "qwen3"]),
                "latents + DINOv2 teacher tokens (REPA cached)": dict(primary=root / "latents",
                                                                      sibling=root / "dinov2",
                                                                      sets=["latents", "dinov2"]),
                "RAE DINOv2-B features as latents": dict(primary=root / "rae", sets=["rae"])}
        per_sample = {name: sum(read_manifest(root / s).total_bytes for s in spec["sets"]) / n
                      for name, spec in rows.items()}
        for spec in rows.values():  # warm the page cache
            time_loader(spec["primary"], 0, a.batch, text=spec.get("text"), sibling=spec.get("sibling"))
        best: dict[tuple[str, int], tuple[float, float]] = {}
        for _ in range(a.repeat):
            for w in a.workers:
                for name, spec in rows.items():
                    r = time_loader(spec["primary"], w, a.batch, text=spec.get("text"), sibling=spec.get("sibling"))
                    if r[0] > best.get((name, w), (0.0, 0.0))[0]:
                        best[name, w] = r
        print(f"# {n} samples, batch {a.batch}, {per} per shard; torch {torch.__version__}")
        print("| stream | bytes/sample | workers | samples/s | MB/s | CPU us/sample | per worker / GPU need |\n"
              "|---|---|---|---|---|---|---|")
        for name in rows:
            for w in a.workers:
                rate, cpu = best[name, w]
                print(f"| {name} | {per_sample[name]:,.0f} | {w} | {rate:,.0f} | {rate * per_sample[name] / 1e6:,.0f} | "
                      f"{cpu:,.0f} | {rate / w / a.gpu_rate:.2f}x |", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
