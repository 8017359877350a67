"""Benchmark: the cost of the trainer's per-shard sha256 check (`--verify-shards`, on by default), side by side.

One reader (train.data.EpochStream in this process, as one loader worker runs it) reads one epoch of N
ImageNet-256-like latents (4x32x32, 2 views, posterior mean + std in float16, as dit-extract writes them)
from the page cache, three ways, interleaved round by round:

  off       no hash (--no-verify-shards)
  whole     each shard read into memory and hashed before its first sample is parsed (the default when the
            shards read at once fit in a quarter of the host memory)
  stream    each shard hashed as it is parsed, checked at its end (the fallback)

Reported per mode: latents/s (wall clock, best of the rounds), CPU microseconds per latent (this process),
and the ratio to `off`; also hashlib's sha256 rate on this machine and the bytes per latent, from which the
hash's share follows.

    python bench/shard_hash.py                        # 8192 latents in 8 shards, 3 rounds
    python bench/shard_hash.py --latents 16384 --repeat 5
"""
from __future__ import annotations

import argparse
import hashlib
import platform
import resource
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _checkout import use_checkout  # noqa: E402

use_checkout()  # run from a checkout without installing

from dit_pipeline.shards import FORMAT_VERSION, Manifest, ShardWriter, sample_key, shard_name, write_manifest  # noqa: E402
from dit_pipeline.train.data import EpochStream  # noqa: E402
from dit_pipeline.train.shard_source import open_shards  # noqa: E402
from dit_pipeline.train.partition import plan_epoch  # noqa: E402

MODES = (None, "whole", "stream")


def write_shards(folder: Path, n: int, per_shard: int) -> int:
    """N random posterior latents in shards of `per_shard`; returns the total shard bytes."""
    rng = np.random.default_rng(0)
    folder.mkdir(parents=True)
    records = []
    for i in range(0, n, per_shard):
        with ShardWriter(folder / shard_name(i // per_shard), dtype="float16") as w:
            for k in range(i, min(n, i + per_shard)):
                mean = rng.standard_normal((2, 4, 32, 32), dtype=np.float32) * 5
                std = np.abs(rng.standard_normal((2, 4, 32, 32), dtype=np.float32)) * 0.1
                w.write(sample_key(k), label=k % 1000, meta={"path": f"img{k}.JPEG"}, mean=mean, std=std)
            records.append(w.close())
    write_manifest(folder, Manifest(
        format_version=FORMAT_VERSION, tool_version="bench", extraction={"vae": {"source": "bench"}},
        scaling_factor=0.18215, shift_factor=None, image_size=256, views=2, store="posterior", dtype="float16",
        latent_shape=[4, 32, 32], class_names=[f"n{c:08d}" for c in range(1000)], num_classes=1000,
        total_samples=n, samples_per_shard=per_shard, shards=records, skipped=[]))
    return sum(r.bytes for r in records)


def _cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def time_epoch(folder: Path, mode: str | None, batch: int) -> tuple[float, float]:
    """(latents/s wall clock, CPU us per latent) of one reader's epoch with the given sha256 mode."""
    src = open_shards(str(folder))
    plan = plan_epoch(src.sizes, seed=0, epoch=0, world_size=1, workers=1, micro_batch=batch, accum=1)
    stream = EpochStream(src, plan, 0, seed=0, buffer=1000, sha256=mode)
    t0, c0, n = time.perf_counter(), _cpu_s(), 0
    for b in stream:
        n += len(b.keys)
    wall, cpu = time.perf_counter() - t0, _cpu_s() - c0
    return n / wall, cpu / n * 1e6


def hash_rate(mib: int = 256) -> float:
    """hashlib's sha256 in GiB per CPU second (CPU time: independent of other load on a shared machine)."""
    data = np.random.default_rng(0).bytes(mib << 20)
    c0 = _cpu_s()
    hashlib.sha256(data).hexdigest()
    return mib / 1024 / (_cpu_s() - c0)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--latents", type=int, default=8192)
    ap.add_argument("--per-shard", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="bench-hash-") as tmp:
        folder = Path(tmp) / "shards"
        total = write_shards(folder, args.latents, args.per_shard)
        rounds: dict[str | None, list[tuple[float, float]]] = {m: [] for m in MODES}
        time_epoch(folder, None, args.batch)  # warm the page cache
        for _ in range(args.repeat):
            for mode in MODES:
                rounds[mode].append(time_epoch(folder, mode, args.batch))
    best = {m: max(r) for m, r in rounds.items()}
    cpu = {m: min(c for _, c in r) for m, r in rounds.items()}
    print(f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, {args.latents} latents "
          f"({total / args.latents / 1024:.1f} KiB each) in {len(range(0, args.latents, args.per_shard))} shards, "
          f"best of {args.repeat} interleaved rounds; hashlib sha256 {hash_rate():.2f} GiB per CPU second")
    print("| sha256 check | latents/s (one reader) | ratio to off | CPU us/latent | ratio to off |")
    print("|---|---|---|---|---|")
    for m in MODES:
        print(f"| {m or 'off'} | {best[m][0]:,.0f} | {best[m][0] / best[None][0]:.3f} | {cpu[m]:.1f} | "
              f"{cpu[m] / cpu[None]:.3f} |")


if __name__ == "__main__":
    main()
