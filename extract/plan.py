"""Who encodes what: the extraction work split as pure functions of integers (docs/ARCHITECTURE.md).

Global index g = position in the sorted image list. Shard i holds the indices [i*S, (i+1)*S) (S = samples
per shard), rank r of W writes the shards with i % W == r, and inside a shard the images are encoded in
batches of B consecutive indices. None of this depends on the number of DataLoader workers, and the
content of a shard does not depend on W, so every image is encoded exactly once, each shard is written by
exactly one rank, and the shard bytes are the same for any world size.
"""
from __future__ import annotations

import math

# Aim for shards of a few hundred MB: big enough that per-file overhead vanishes, small enough that
# ImageNet (1.28M images) still makes ~180 shards for many GPUs and data-loader workers to share.
TARGET_SHARD_BYTES = 256 * 1024 * 1024
_TAR_BLOCK = 512
_NPY_HEADER = 128
# Stored pixels (--pixels) per pixel of the crop, for sizing shards only: bench/pixels.py measured about
# 1.4 bytes per pixel for lossless WebP on photographs, 1.7 on synthetic images (BENCHMARKS.md, "Pixels").
PIXEL_BYTES_PER_PIXEL = 1.5


def num_shards(num_items: int, samples_per_shard: int) -> int:
    """How many shards `num_items` global indices make."""
    if samples_per_shard < 1:
        raise ValueError(f"samples_per_shard must be >= 1, got {samples_per_shard}")
    return math.ceil(num_items / samples_per_shard)


def shard_span(shard: int, samples_per_shard: int, num_items: int) -> range:
    """The global indices of shard `shard`."""
    start = shard * samples_per_shard
    if not 0 <= start < num_items:
        raise ValueError(f"shard {shard} is outside 0..{num_shards(num_items, samples_per_shard) - 1}")
    return range(start, min(start + samples_per_shard, num_items))


def shards_of_rank(total_shards: int, rank: int, world_size: int) -> range:
    """The shards that rank `rank` of `world_size` writes, in increasing order."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside 0..{world_size - 1}")
    return range(rank, total_shards, world_size)


def batches_of(span: range, batch_size: int) -> list[range]:
    """Consecutive chunks of at most `batch_size` indices; batches never cross a shard boundary."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    return [span[i:i + batch_size] for i in range(0, len(span), batch_size)]


def bytes_per_sample(views: int, arrays: int, latent_shape: tuple[int, int, int], itemsize: int) -> int:
    """Approximate tar bytes of one sample: `arrays` .npy members of [views, C, h, w] plus .cls and .json."""
    payload = views * math.prod(latent_shape) * itemsize + _NPY_HEADER
    padded = _TAR_BLOCK * math.ceil(payload / _TAR_BLOCK)
    return arrays * (_TAR_BLOCK + padded) + 2 * (2 * _TAR_BLOCK)


def pixel_bytes_estimate(image_size: int, encoding: str = "webp-lossless") -> int:
    """Approximate tar bytes of one sample's pixels member at `image_size` (an estimate for WebP: the real size
    depends on the image content; exact for "npy-uint8": 3 bytes a pixel and the 128-byte NPY header)."""
    per_pixel = 3 if encoding == "npy-uint8" else PIXEL_BYTES_PER_PIXEL
    payload = math.ceil(per_pixel * image_size * image_size) + (128 if encoding == "npy-uint8" else 0)
    return _TAR_BLOCK + _TAR_BLOCK * math.ceil(payload / _TAR_BLOCK)


def default_samples_per_shard(per_sample_bytes: int, target_bytes: int = TARGET_SHARD_BYTES) -> int:
    """Samples per shard giving about `target_bytes` per shard, rounded down to a multiple of 100."""
    n = target_bytes // max(1, per_sample_bytes)
    return max(1, n // 100 * 100) if n >= 100 else max(1, n)
