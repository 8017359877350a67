"""`dit-shards stats`: statistics of the model latents and the class balance of a shard set.

DiT trains on latents normalized to roughly unit variance: latent = (z - shift) * scale, with z a posterior
sample (mean + std * noise) or the stored `latent.npy`, and the manifest's normalization (common/latent_norm.py:
the VAE config's scalar `scaling_factor` / `shift_factor`, diffusers' convention, or per-channel statistics).
The command reports per-channel mean and std of those latents and of the raw z, whether their overall std is
near 1, and the scaling factor that would make it exactly 1; `--write` turns the statistics into a new manifest
revision (shards/revision.py).

Latent statistics use up to --max-samples samples spread evenly over all shards (a shard holds
consecutive images, i.e. a few classes, so reading only the first shards would be biased); the class
histogram counts every sample (reading only the tiny `cls` members, other members are skipped).
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from dit_pipeline.common.errors import UserError
from dit_pipeline.common.latent_stats import mean_var_record, stats_record
from dit_pipeline.common.seeding import numpy_rng
from dit_pipeline.shards.format import ShardError, shard_index
from dit_pipeline.shards.manifest import Manifest, read_manifest, require_latents
from dit_pipeline.shards.npy import widen
from dit_pipeline.shards.reader import iter_members
from dit_pipeline.shards.sample_checks import Expect, check_sample, parse_label
from dit_pipeline.shards.tario import TarReader

STREAM_STATS = 101  # derive_seed stream for the posterior noise drawn by `stats`
NEAR_ONE = 0.1  # |std - 1| within this counts as "unit variance"


class _Moments:
    """Per-channel count, sum and sum of squares in float64 (exact enough for millions of samples)."""

    def __init__(self, channels: int):
        self.n = 0
        self.sum = np.zeros(channels)
        self.sq = np.zeros(channels)

    def add(self, x: np.ndarray) -> None:  # x: [V, C, h, w]
        x = x.astype(np.float64)
        self.n += x.size // x.shape[1]
        self.sum += x.sum(axis=(0, 2, 3))
        self.sq += np.square(x).sum(axis=(0, 2, 3))

    def result(self) -> dict[str, Any]:
        mean = self.sum / self.n
        std = np.sqrt(np.maximum(self.sq / self.n - mean ** 2, 0.0))
        all_mean = self.sum.sum() / (self.n * len(self.sum))
        all_std = math.sqrt(max(self.sq.sum() / (self.n * len(self.sum)) - all_mean ** 2, 0.0))
        return {"channel_mean": mean.tolist(), "channel_std": std.tolist(), "mean": all_mean, "std": all_std}


def _raw(sample: dict[str, np.ndarray], m: Manifest, rng: np.random.Generator) -> np.ndarray:
    """z: the stored latent, or a posterior sample mean + std * noise."""
    if m.store == "sample":
        return sample["latent.npy"]
    mean, std = sample["mean.npy"], sample["std.npy"]
    return mean + std * rng.standard_normal(mean.shape, dtype=np.float32)


def _shard_pass(path: Path, m: Manifest, expect: Expect, quota: int, stride: int, seed: int,
                counts: np.ndarray, moments: _Moments, raw: _Moments) -> int:
    """One pass over a shard: every label into `counts`, every stride-th sample (up to quota) into
    `moments` (normalized) and `raw` (z). Returns the number of samples whose latents were used."""
    rng = numpy_rng(seed, STREAM_STATS, shard_index(path.name) or 0)
    norm = m.norm  # built once: a per-channel one keeps its float32 vectors
    current: list[Any] = [None, -1]  # the key of the member being read, and that sample's ordinal

    def want(name: str) -> bool:  # decide per member: the label always, arrays only for picked samples
        key = name.split(".", 1)[0]
        if key != current[0]:
            current[0], current[1] = key, current[1] + 1
        if name.endswith(".cls"):
            return True
        if name.endswith((".json", ".pixels.webp", ".pixels.npy")):
            return False
        o = int(current[1])
        return o % stride == 0 and o // stride < quota

    used = 0
    with open(path, "rb") as f:
        for key, fields in iter_members(TarReader(f, seekable=True, chunk=1 << 16), str(path), want):
            try:
                if fields.get("mean.npy", fields.get("latent.npy")) is None:
                    label = parse_label(fields["cls"] or b"")
                    if label >= expect.num_classes:
                        raise ValueError(f"label {label} out of range [0, {expect.num_classes})")
                else:
                    label, arrays, _ = check_sample(key, fields, expect, parse_meta=False)
                    wide = {f: widen(a, m.dtype) for f, a in arrays.items()}
                    if not all(np.isfinite(a).all() for a in wide.values()):
                        raise ValueError("NaN or Inf in the latents")
                    z = _raw(wide, m, rng)
                    raw.add(z)
                    moments.add(norm.apply(z))
                    used += 1
            except (ValueError, KeyError) as e:
                raise ShardError(str(path), key, str(e)) from None
            counts[label] += 1
    return used


def compute_stats(folder: str | Path, *, max_samples: int = 10_000, seed: int = 0) -> dict[str, Any]:
    """Latent statistics and class histogram of a shard folder (see the module docstring)."""
    if max_samples < 1:
        raise ValueError(f"max_samples must be >= 1, got {max_samples}")
    folder = Path(folder)
    m = require_latents(read_manifest(folder), folder, "dit-shards stats")
    if m.store == "pixels":  # nothing to normalize: the crops map to [-1, 1] by a fixed formula
        raise UserError(f"{folder}: a pixel-space set (store pixels) holds no latent arrays; its latents are the "
                        "crops mapped to [-1, 1] (common/pixels.py), which no statistics rescale")
    expect = Expect.from_manifest(m)
    counts = np.zeros(m.num_classes, np.int64)
    moments, raw = _Moments(m.latent_shape[0]), _Moments(m.latent_shape[0])
    nonempty = [s for s in m.shards if s.samples > 0]
    quota = math.ceil(max_samples / max(len(nonempty), 1))
    used = 0
    for rec in nonempty:
        take = max(0, min(quota, max_samples - used))  # 0: latents done, labels still counted
        stride = max(1, rec.samples // take) if take else 1
        used += _shard_pass(folder / rec.name, m, expect, take, stride, seed, counts, moments, raw)
    out: dict[str, Any] = {"samples_used": used, "total_samples": int(counts.sum()),
                           "scaling_factor": m.scaling_factor, "shift_factor": m.shift_factor,
                           "normalization": m.norm.describe(), "per_channel": m.norm.is_per_channel,
                           "store": m.store, "seed": seed, "max_samples": max_samples}
    if used:
        out.update(moments.result())
        out.update({f"raw_{k}": v for k, v in raw.result().items()})
        out["near_unit_std"] = abs(out["std"] - 1.0) <= NEAR_ONE
        # scalar: the factor that scales the current latents to unit std (as Stable Diffusion's 0.18215 was
        # found); a per-channel set: the scalar factor that would replace its normalization
        std = out["raw_std"] if m.norm.is_per_channel else out["std"]
        base = 1.0 if m.norm.is_per_channel else m.scaling_factor
        out["suggested_scaling_factor"] = base / std if std > 0 else None
    empty = [m.class_names[i] for i in np.nonzero(counts == 0)[0]]
    out["classes"] = {"counts": counts.tolist(), "min": int(counts.min()), "max": int(counts.max()),
                      "argmin": m.class_names[int(counts.argmin())], "argmax": m.class_names[int(counts.argmax())],
                      "empty": empty}
    return out


def first_samples_std(folder: str | Path, m: Manifest, max_samples: int = 64) -> tuple[float, int, str] | None:
    """(std of the model latents, samples used, shard name) over the first `max_samples` samples of the first
    non-empty shard: the trainer's quick look at the scale it is about to train on (a shard holds a few classes,
    so this is rough; `dit-shards stats` spreads its samples). None when the shard cannot be read here (the
    trainer's own checks name such a shard)."""
    nonempty = [s for s in m.shards if s.samples > 0]
    if not nonempty:
        return None
    moments, raw = _Moments(m.latent_shape[0]), _Moments(m.latent_shape[0])
    counts = np.zeros(m.num_classes, np.int64)
    try:
        used = _shard_pass(Path(folder) / nonempty[0].name, m, Expect.from_manifest(m), max_samples, 1, 0, counts,
                           moments, raw)
    except Exception:  # noqa: BLE001 - a quick look never stops the plan; the trainer's checks name a bad shard
        return None
    return (float(moments.result()["std"]), used, nonempty[0].name) if used else None


def fix_hint(folder: str | Path) -> str:
    """The commands that normalize a shard set to unit std (shards/revision.py)."""
    return (f"dit-shards stats {folder} --write scalar (one factor), --write per-channel (each channel's mean "
            "and std) or --write per-position (each channel and position: feature spaces) records it as a new "
            "manifest revision")


def _position_partial(path: Path, m: Manifest, expect: Expect) -> tuple[int, np.ndarray, np.ndarray]:
    """One shard's (count, sum, sum of squares) of the raw z per channel and position, float64 [C, h, w]; every
    sample and view. A stored latent only (a posterior would need noise: not exact)."""
    n, total, sq = 0, np.zeros(m.latent_shape), np.zeros(m.latent_shape)
    with open(path, "rb") as f:
        for key, fields in iter_members(TarReader(f, seekable=True, chunk=1 << 16), str(path),
                                        lambda name: not name.endswith((".json", ".pixels.webp", ".pixels.npy"))):
            try:
                _, arrays, _ = check_sample(key, fields, expect, parse_meta=False)
                z = widen(arrays["latent.npy"], m.dtype).astype(np.float64)
                if not np.isfinite(z).all():
                    raise ValueError("NaN or Inf in the latents")
            except (ValueError, KeyError) as e:
                raise ShardError(str(path), key, str(e)) from None
            n += z.shape[0]
            total += z.sum(axis=0)
            sq += np.square(z).sum(axis=0)
    return n, total, sq


def position_stats(folder: str | Path) -> dict[str, Any]:
    """The exact mean and (population) variance of z per channel and position over every sample and view of the
    set: float64 partial sums per shard, added in shard order, so the result does not depend on how the shards
    are read (any split of the shards gives the same partials and the same bits). Raw z: a set of stored latents
    (`--store sample`; features are stored so)."""
    folder = Path(folder)
    m = require_latents(read_manifest(folder), folder, "dit-shards stats")
    if m.store != "sample":
        raise UserError(f"{folder}: --write per-position needs stored latents (store sample, e.g. dit-extract "
                        "--encoder); this set stores a posterior, whose samples are drawn fresh every epoch")
    expect = Expect.from_manifest(m)
    n, total, sq = 0, np.zeros(m.latent_shape), np.zeros(m.latent_shape)
    for rec in m.shards:
        if rec.samples:
            k, t, q = _position_partial(folder / rec.name, m, expect)
            n, total, sq = n + k, total + t, sq + q
    if not n:
        raise UserError(f"{folder}: the shard set holds no samples; there are no statistics to write")
    mean = total / n
    var = np.maximum(sq / n - mean ** 2, 0.0)
    return {"views_used": n, "samples_used": n // m.views, "mean": mean, "var": var, "shape": list(m.latent_shape)}


def format_stats(s: dict[str, Any], folder: str | Path | None = None) -> str:
    if s["per_channel"]:
        head = f"normalized {s['normalization']}"
    else:
        head = ("scaled as " + ("(z - shift_factor) * scaling_factor" if s["shift_factor"] is not None
                                else "z * scaling_factor") + f", scaling_factor {s['scaling_factor']:g}"
                + (f", shift_factor {s['shift_factor']:g}" if s["shift_factor"] is not None else ""))
    lines = [f"latents: {s['samples_used']} samples used (of {s['total_samples']}), {head}"]
    if s["samples_used"]:
        for c, (mu, sd, rmu, rsd) in enumerate(zip(s["channel_mean"], s["channel_std"], s["raw_channel_mean"],
                                                   s["raw_channel_std"])):
            lines.append(f"  channel {c}: mean {mu:+.4f}  std {sd:.4f}   (raw z: mean {rmu:+.4f}  std {rsd:.4f})")
        verdict = "near 1, as DiT assumes" if s["near_unit_std"] else f"NOT near 1 (DiT assumes ~1, within {NEAR_ONE:g})"
        lines.append(f"  all channels: mean {s['mean']:+.4f}  std {s['std']:.4f}  -> {verdict}")
        lines.append(f"  suggested scaling_factor for unit std: {s['suggested_scaling_factor']:.5g}")
        if not s["near_unit_std"]:
            lines.append(f"  to train on unit std: {fix_hint(folder or 'FOLDER')}")
    c = s["classes"]
    lines.append(f"classes: {len(c['counts'])}, samples per class min {c['min']} ({c['argmin']}), "
                 f"max {c['max']} ({c['argmax']}), empty: {len(c['empty'])}"
                 + (f" ({', '.join(c['empty'][:10])}{' ...' if len(c['empty']) > 10 else ''})" if c["empty"] else ""))
    return "\n".join(lines)



def computed_normalization(s: dict[str, Any], mode: str, revision: int) -> tuple[dict[str, Any] | None, float | None]:
    """What `dit-shards stats --write MODE` records from statistics `s`: ("per-channel") a mean/std record of the
    raw z, or ("scalar") no record and the suggested scaling factor. (normalization record, scaling_factor)."""
    if not s["samples_used"]:
        raise ValueError("no latents were read: the shard set holds no samples")
    if mode == "per-channel":
        source = {"kind": "stats", "samples_used": s["samples_used"], "max_samples": s["max_samples"],
                  "seed": s["seed"], "store": s["store"], "revision": revision}
        return stats_record(s["raw_channel_mean"], s["raw_channel_std"], source), None
    if mode == "scalar":
        return None, s["suggested_scaling_factor"]
    if mode == "per-position":  # s: position_stats
        source = {"kind": "stats", "samples_used": s["samples_used"], "views_used": s["views_used"], "seed": None,
                  "exact": True, "revision": revision}
        return mean_var_record(s["mean"], s["var"], source), None
    raise ValueError(f"unknown --write mode {mode!r}")
