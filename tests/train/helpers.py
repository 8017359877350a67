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
