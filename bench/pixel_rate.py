"""Benchmark: how many 256 px training crops one loader core delivers for a pixel-space model (issue #39), side by
side in one run, against the per-step JPEG decode + resize + crop that JiT's and PixNerd's loaders do.

Every row ends in what the trainer consumes: a batch of float32 [B, 3, 256, 256] latents in [-1, 1]
(common.pixels.to_latent: NanoGen's (p / 255) * 2 - 1), each sample in a random left-right orientation.

  jpeg        per step: the JPEG file's bytes -> Pillow decode -> ADM center crop (extract.images.adm_center_crop:
              BOX halvings, BICUBIC resize, center crop) -> random flip -> batch
  shards      the trainer's own loader on a pixel-space shard set (`dit-extract --encoder pixels`: store "pixels",
              lossless WebP): train.data.EpochStream in this one process (tar streaming, manifest checks, per-reader
              shuffle buffer, the view of each sample, WebP decode, batch; --no-verify-shards' setting)
  shards-raw  the same loader on the same crops stored uncompressed (`--pixel-encoding npy-uint8`)
  webp        the WebP members alone from memory: decode + view + batch (the shards row without the tar reader)
  raw         uncompressed uint8 [256, 256, 3] from memory (an NPY member would be this plus a 128-byte header):
              a zero-copy view + view + batch
  qoi         the QOI format (qoiformat.org) through the `qoi` package, when it is installed (it is not a
              dependency): decode + view + batch

Cost per crop is the CPU time of this one process (every codec here is single-threaded), so 1 / cost is what one
free core sustains whatever else runs on the machine; rounds are interleaved and the median is reported.
Crops are bench/pixels.py's synthetic natural-image stand-ins (dead leaves through JPEG quality 90, 500 x 375).

    python bench/pixel_rate.py                    # 256 crops, 3 rounds
    python bench/pixel_rate.py --crops 512 --repeat 5 --json rate.json
"""
from __future__ import annotations

import argparse
import io
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _checkout import use_checkout  # noqa: E402

use_checkout()  # run from a checkout without installing

import numpy as np  # noqa: E402
import torch  # noqa: E402
from PIL import Image, features  # noqa: E402

from pixels import dead_leaves  # noqa: E402

from dit_pipeline.common.pixels import to_latent  # noqa: E402
from dit_pipeline.extract.images import adm_center_crop  # noqa: E402
from dit_pipeline.shards import Manifest, ShardWriter, shard_name, write_manifest  # noqa: E402
from dit_pipeline.shards.pixels import decode_pixels, encode_pixels, pixels_entry  # noqa: E402

IMAGENET_IMAGES = 1_281_167


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--crops", type=int, default=256, help="distinct images (and crops)")
    p.add_argument("--size", type=int, default=256)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--repeat", type=int, default=3, help="interleaved rounds; the median is reported")
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def jpeg_files(n: int) -> list[bytes]:
    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        buf = io.BytesIO()
        dead_leaves(rng).save(buf, "JPEG", quality=90)
        out.append(buf.getvalue())
    return out


def batches(decode: Callable[[bytes], np.ndarray], data: list[bytes], size: int, batch: int) -> int:
    """Decode every item, flip every other one, batch to [-1, 1] float32; returns the crops made."""
    rng = np.random.default_rng(1)
    crops = np.empty((batch, size, size, 3), dtype=np.uint8)
    out = torch.empty(batch, 3, size, size)
    done = 0
    for start in range(0, len(data) - batch + 1, batch):
        for row, b in enumerate(data[start:start + batch]):
            a = decode(b)
            crops[row] = a[:, ::-1] if rng.random() < 0.5 else a
        to_latent(crops, out)
        done += batch
    return done


def jpeg_decode(size: int) -> Callable[[bytes], np.ndarray]:
    def decode(b: bytes) -> np.ndarray:
        with Image.open(io.BytesIO(b)) as im:
            return adm_center_crop(im.convert("RGB"), size)
    return decode


def write_shards(root: Path, crops: list[np.ndarray], size: int, encoding: str, per_shard: int = 64) -> Path:
    """A pixel-space shard set of the crops, as dit-extract --encoder pixels writes one."""
    from dit_pipeline.common.pixels import pixel_identity

    folder = root / encoding
    records, total = [], 0
    for s in range(0, len(crops), per_shard):
        with ShardWriter(folder / shard_name(s // per_shard), store="pixels", pixels_encoding=encoding) as w:
            for i in range(s, min(s + per_shard, len(crops))):
                w.write(f"{i:09d}", label=i % 10, meta={}, pixels=encode_pixels(crops[i], encoding))
            records.append(w.close())
            total += w.pixel_bytes
    m = Manifest(format_version=2, tool_version="bench", extraction={"vae": pixel_identity(size)},
                 pixels=pixels_entry(size, total, encoding), scaling_factor=1.0, shift_factor=None, image_size=size, views=2,
                 store="pixels", dtype="uint8", latent_shape=[3, size, size], class_names=[str(c) for c in range(10)],
                 num_classes=10, total_samples=len(crops), samples_per_shard=per_shard, shards=records, skipped=[])
    write_manifest(folder, m)
    return folder


def shard_loader(folder: Path, batch: int) -> Callable[[], int]:
    from dit_pipeline.train.data import EpochStream
    from dit_pipeline.train.shard_source import open_shards
    from dit_pipeline.train.partition import plan_epoch

    source = open_shards(str(folder))

    def run() -> int:
        plan = plan_epoch(source.sizes, seed=0, epoch=0, world_size=1, workers=1, micro_batch=batch, accum=1)
        stream = EpochStream(source, plan, 0, seed=0, buffer=256, shards_in_flight=4)
        return sum(int(b.latents.shape[0]) for b in stream.reader(0) if hasattr(b, "latents"))
    return run


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(1)
    size, batch = args.size, args.batch
    jpegs = jpeg_files(args.crops)
    crops = [jpeg_decode(size)(b) for b in jpegs]
    webp = [encode_pixels(c) for c in crops]
    raw = [c.tobytes() for c in crops]
    rows: dict[str, Callable[[], int]] = {
        "jpeg": lambda: batches(jpeg_decode(size), jpegs, size, batch),
        "webp": lambda: batches(lambda b: decode_pixels(b, size), webp, size, batch),
        "raw": lambda: batches(lambda b: np.frombuffer(b, np.uint8).reshape(size, size, 3), raw, size, batch),
    }
    sizes = {"jpeg": np.mean([len(b) for b in jpegs]), "webp": np.mean([len(b) for b in webp]),
             "raw": float(size * size * 3)}
    try:
        import qoi  # type: ignore[import-not-found]

        q = [qoi.encode(np.ascontiguousarray(c)) for c in crops]
        assert all(np.array_equal(qoi.decode(b), c) for b, c in zip(q, crops))
        rows["qoi"] = lambda: batches(qoi.decode, q, size, batch)
        sizes["qoi"] = np.mean([len(b) for b in q])
    except ImportError:
        print("qoi not installed: its row is skipped (pip install qoi)")
    tmp = Path(tempfile.mkdtemp(prefix="pixel-rate-"))
    rows["shards"] = shard_loader(write_shards(tmp, crops, size, "webp-lossless"), batch)
    sizes["shards"] = sizes["webp"]
    rows["shards-raw"] = shard_loader(write_shards(tmp, crops, size, "npy-uint8"), batch)
    sizes["shards-raw"] = float(size * size * 3 + 128)
    costs: dict[str, list[float]] = {k: [] for k in rows}
    for _ in range(args.repeat):
        for name, run in rows.items():
            t0 = time.process_time()
            n = run()
            costs[name].append((time.process_time() - t0) / n)
    res = {}
    print(f"{platform.machine()}, Python {platform.python_version()}, torch {torch.__version__}, libwebp "
          f"{features.version('webp')}; {args.crops} crops of {size} px, batch {batch}, median of {args.repeat} rounds")
    print(f"{'row':10s} {'bytes/crop':>11s} {'ms/crop':>8s} {'crops/s/core':>13s} {'ImageNet view':>14s}")
    for name in ("jpeg", "shards", "shards-raw", "webp", "raw", "qoi"):
        if name not in costs:
            continue
        ms = statistics.median(costs[name]) * 1e3
        gib = sizes[name] * IMAGENET_IMAGES / 2 ** 30
        res[name] = {"bytes": float(sizes[name]), "ms": ms, "per_s": 1e3 / ms, "imagenet_gib": gib}
        print(f"{name:10s} {sizes[name]:11,.0f} {ms:8.3f} {1e3 / ms:13,.0f} {gib:11.0f} GiB")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    return res


if __name__ == "__main__":
    main()
