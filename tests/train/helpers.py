"""Synthetic shard sets for the trainer tests, written through the real shards API (ShardWriter +
write_manifest), with known latents so tests can assert on values."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from dit_pipeline.shards import Manifest, ShardWriter, format_version_for, sample_key, shard_name, write_manifest

VAE_IDENTITY = {"source": "tests/tiny-vae", "kind": "folder", "weights_sha256": "0" * 64,
                "scaling_factor": 0.5, "shift_factor": None, "latent_channels": 4, "downsample_factor": 8,
                "class": "AutoencoderKL"}


def class_mean(label: int, shape: Sequence[int], pattern: str = "ramp") -> np.ndarray:
    """A distinct mean latent per class: a ramp (class 0 rising, class 1 falling, ...) or a constant level
    (class 0 at +1, class 1 at -1, ...)."""
    c, h, w = shape
    sign = 1.0 if label % 2 == 0 else -1.0
    if pattern == "constant":
        return np.full((c, h, w), sign * (1.0 + 0.5 * (label // 2)), dtype=np.float32)
    ramp = np.linspace(-1.0, 1.0, h * w, dtype=np.float32).reshape(1, h, w)
    return (sign * (1.0 + 0.5 * (label // 2)) * np.broadcast_to(ramp, (c, h, w))).astype(np.float32)


def make_shard_set(folder: Path, *, samples: Sequence[int], num_classes: int = 2,
                   latent_shape: Sequence[int] = (4, 8, 8), views: int = 1, store: str = "posterior",
                   dtype: str = "float32", scaling_factor: float = 0.5, shift_factor: float | None = None,
                   samples_per_shard: int | None = None, std: float = 0.1, seed: int = 0,
                   pattern: str = "ramp", normalization: dict | None = None) -> Manifest:
    """Shard i holds samples[i] samples with keys from i * samples_per_shard; label = key % num_classes;
    mean = class_mean(label) + small per-sample offset, std constant. `normalization`: a per-channel record
    (common/latent_norm.py; format version 3)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    sps = samples_per_shard or max(samples)
    rng = np.random.default_rng(seed)
    records = []
    for i, n in enumerate(samples):
        with ShardWriter(folder / shard_name(i), dtype=dtype) as w:
            for j in range(n):
                key = i * sps + j
                label = key % num_classes
                base = class_mean(label, latent_shape, pattern)
                mean = np.stack([base + 0.05 * rng.standard_normal(base.shape).astype(np.float32)
                                 for _ in range(views)])
                if store == "posterior":
                    w.write(sample_key(key), label=label, meta={"src": f"img{key}"}, mean=mean,
                            std=np.full_like(mean, std))
                else:
                    w.write(sample_key(key), label=label, meta={"src": f"img{key}"}, latent=mean)
            records.append(w.close())
    m = Manifest(format_version=format_version_for(pixels=False, normalization=normalization is not None),
                 tool_version="test", extraction={"vae": VAE_IDENTITY}, normalization=normalization,
                 scaling_factor=scaling_factor, shift_factor=shift_factor, image_size=8 * latent_shape[1],
                 views=views, store=store, dtype=dtype, latent_shape=list(latent_shape),
                 class_names=[f"c{k:03d}" for k in range(num_classes)], num_classes=num_classes,
                 total_samples=sum(samples), samples_per_shard=sps, shards=records, skipped=[])
    write_manifest(folder, m)
    return m


IMAGENET = 1_281_167  # ImageNet-1k train images


def hub_vae(hub: str, channels: int = 4, factor: int = 8) -> dict:
    """A VAE identity as dit-extract records a hub id (common/vae.py), "owner/name/subfolder" split into source and
    subfolder."""
    parts = hub.split("/")
    return {"source": "/".join(parts[:2]), "kind": "hub", **({"subfolder": parts[2]} if len(parts) == 3 else {}),
            "revision": "main", "scaling_factor": 0.18215, "shift_factor": None, "latent_channels": channels,
            "downsample_factor": factor, "class": "AutoencoderKL"}


def recipe_manifest(folder: Path, latent: Sequence[int], *, pixels: bool = False, views: int = 2,
                    normalization: str = "scalar", encoder: dict | None = None, vae: dict | None = None,
                    image_size: int = 256, total: int = IMAGENET, per_shard: int = 1000,
                    num_classes: int = 1000) -> Path:
    """A manifest of `total` samples (ImageNet-1k's size by default: 1282 shards of up to 1000) for a URL-list dry run
    of a recipe, of the extraction it requires (latent shape, views, stored pixels, normalization, the VAE's or feature
    encoder's identity; 3 x S x S with vae "pixels": a pixel-space set, whose crops are the latents). No shard is
    written: the plan reads the manifest only. Returns the manifest's path."""
    from dit_pipeline.common.latent_stats import mean_var_record, stats_record
    from dit_pipeline.common.pixels import pixel_identity
    from dit_pipeline.shards import ShardRecord
    from dit_pipeline.shards.pixels import pixels_entry

    norm = None
    if normalization == "per-channel":
        norm = stats_record([0.0] * latent[0], [1.0] * latent[0], {"kind": "stats"})
    elif normalization == "per-position":
        norm = mean_var_record(np.zeros(latent, np.float32), np.ones(latent, np.float32), {"kind": "stats"})
    space = vae == "pixels"
    pixels = pixels or space  # a pixel-space set keeps its latents in the pixels member
    extraction = {"vae": None, "encoder": encoder} if encoder else \
        {"vae": pixel_identity(image_size) if space else (vae or VAE_IDENTITY)}
    records, n = [], 0
    while n < total:
        k = min(per_shard, total - n)
        records.append(ShardRecord(shard_name(len(records)), k, sample_key(n), sample_key(n + k - 1), 1 << 20,
                                   "0" * 64))
        n += k
    m = Manifest(format_version=format_version_for(pixels=pixels, normalization=norm is not None), tool_version="test",
                 extraction=extraction, normalization=norm, scaling_factor=1.0 if space else 0.18215,
                 shift_factor=None, image_size=image_size, views=views, store="pixels" if space else "posterior",
                 dtype="uint8" if space else "float16", latent_shape=list(latent),
                 class_names=[f"n{c:08d}" for c in range(num_classes)], num_classes=num_classes, total_samples=total,
                 samples_per_shard=per_shard, shards=records, skipped=[],
                 pixels=pixels_entry(image_size, 1) if pixels else None)
    folder.mkdir(parents=True)
    write_manifest(folder, m)
    return folder / "manifest.json"
