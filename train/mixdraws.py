"""A data mix's seeded draws and its held-out key rule, as pure functions of integers (issue 46;
docs/data-mix.md): every seed the mix derives from the run's (its derive_seed stream, each sub-stream named once
here: the plan's of train/mixplan.py, and those of each pass's samples, captions, lanes and loader workers that
train/mixstream.py and train/mixdata.py read with), the SplitMix64 hash of keys, the subset of a source drawn for
a partial pass, and which keys a source holds out.

**Held-out keys** (`holdout`, the validation set of train/validation.py): a key k of a source with fraction f is
held out when its hash (SplitMix64 of k, a fixed function: the same split for every seed and run) is below
f x 2^64; held-out keys are never in a visit.
"""
from __future__ import annotations

import numpy as np

from dit_pipeline.common.seeding import derive_seed

STREAM_MIX = 46  # the derive_seed stream of the mix (its sub-streams below)
_SHORTFALL, _SUBSET, _ORDER, _SPREAD, _INTERLEAVE, _SHUFFLE, _SAMPLE, _CAPTION, _LOADER = range(9)
_MASK64 = (1 << 64) - 1
_HOLDOUT_SALT = 0x46D17A5E  # fixed: the held-out split of a set never changes with the run's seed


# ----------------------------------------------------------------------------------------------------------
# The SplitMix64 hash of keys: the subset of a partial pass and the held-out keys

def _mix64(base: int, values: np.ndarray) -> np.ndarray:
    """SplitMix64 output number v + 1 from `base`, for every v of `values` (uint64, wrapping arithmetic): a
    bijection of v, so distinct values give distinct 64-bit outputs (train.latents.mix_seed's finaliser)."""
    with np.errstate(over="ignore"):
        z = np.uint64(base & _MASK64) + (values.astype(np.uint64) + np.uint64(1)) * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _mix64_one(base: int, value: int) -> int:
    z = (base + (int(value) + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def choose_subset(n: int, r: int, seed: int) -> np.ndarray:
    """`r` of range(n) without replacement, sorted: the r indices whose SplitMix64 hash from `seed` is smallest
    (the hashes of distinct indices are distinct, so the choice is exact and, all integer arithmetic, the same on
    every platform); vectorized, a few tens of milliseconds for millions of samples."""
    if not 0 <= r <= n:
        raise ValueError(f"cannot draw {r} of {n}")
    if r == 0:
        return np.zeros(0, dtype=np.int64)
    if r == n:
        return np.arange(n, dtype=np.int64)
    h = _mix64(seed, np.arange(n, dtype=np.uint64))
    return np.sort(np.argpartition(h, r - 1)[:r]).astype(np.int64)


def held_out(key: int, fraction: float) -> bool:
    """Whether key `key` of a source holding out `fraction` of its keys is a validation key (module docstring)."""
    return fraction > 0 and _mix64_one(_HOLDOUT_SALT, key) < int(fraction * 2**64)


def held_out_mask(keys: np.ndarray, fraction: float) -> np.ndarray:
    """held_out of every key of `keys` at once."""
    if fraction <= 0:
        return np.zeros(len(keys), dtype=bool)
    return _mix64(_HOLDOUT_SALT, keys) < np.uint64(int(fraction * 2**64))


# ----------------------------------------------------------------------------------------------------------
# Seeds (the run's seed -> the mix's sub-streams)

def shortfall_seed(seed: int) -> int:
    """The order in which the samples an epoch of proportions still misses go to the sources (every epoch alike;
    train.mixplan.choose_per_source)."""
    return derive_seed(seed, STREAM_MIX, _SHORTFALL)


def subset_seed(seed: int, epoch: int, source: int) -> int:
    """The draw of source `source`'s partial pass in `epoch` (choose_subset; train.mixplan.source_visits)."""
    return derive_seed(seed, STREAM_MIX, epoch, _SUBSET, source)


def order_seed(seed: int, epoch: int, source: int) -> int:
    """The order of source `source`'s visits in `epoch` (train.mixplan.spread)."""
    return derive_seed(seed, STREAM_MIX, epoch, _ORDER, source)


def spread_seed(seed: int, epoch: int, source: int) -> int:
    """The offset of source `source`'s visits over `epoch` (train.mixplan.spread)."""
    return derive_seed(seed, STREAM_MIX, epoch, _SPREAD, source)


def sample_base(seed: int, epoch: int, source: int, copy: int) -> int:
    """The per-sample seed base (train.latents.mix_seed(base, key): the view and the posterior noise) of copy
    `copy` of source `source`'s samples in `epoch`: two passes over a sample in one epoch differ."""
    return derive_seed(seed, STREAM_MIX, epoch, _SAMPLE, source, copy)


def caption_seed(seed: int, epoch: int, source: int, copy: int) -> int:
    """The base of the caption draw (which of a sample's captions, train.mixstream.caption_choice) for that
    pass."""
    return derive_seed(seed, STREAM_MIX, epoch, _CAPTION, source, copy)


def lane_seeds(seed: int, epoch: int, lane: int) -> tuple[int, int]:
    """(interleave, shuffle buffer) seeds of lane `lane` in `epoch`."""
    return (derive_seed(seed, STREAM_MIX, epoch, _INTERLEAVE, lane),
            derive_seed(seed, STREAM_MIX, epoch, _SHUFFLE, lane))


def loader_seed(seed: int, epoch: int, rank: int) -> int:
    """The generator of rank `rank`'s DataLoader in `epoch` (train.mixdata.MixFeed.loader)."""
    return derive_seed(seed, STREAM_MIX, epoch, _LOADER, rank)
