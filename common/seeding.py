"""Reproducible randomness as pure functions of integers.

Anything that must not depend on batch size, worker count, world size or interruptions (the view and
posterior noise of a training sample, the noise of a sampled image) takes its seed from
`derive_seed(seed, *ints)`, a well-mixed 63-bit value from numpy's SeedSequence (hash-based, stable across
platforms and numpy versions).
"""
from __future__ import annotations

import numpy as np
import torch

# Distinct streams so e.g. (seed, epoch) for shard order and (seed, epoch, key) for noise never collide.
STREAM_SHARD_ORDER = 1
STREAM_SAMPLE = 2
STREAM_DROPOUT = 3
STREAM_SAMPLING = 4
STREAM_TIMESTEP = 5


def derive_seed(*ints: int) -> int:
    """A 63-bit seed that depends only on the given non-negative integers (and their order)."""
    if any(int(i) < 0 for i in ints):
        raise ValueError(f"derive_seed takes non-negative integers, got {ints}")
    # The length goes first: SeedSequence pads its entropy with zeros, so (a, b) and (a, b, 0) would collide.
    state = np.random.SeedSequence([len(ints), *(int(i) for i in ints)]).generate_state(2, np.uint32)
    return int((int(state[0]) << 31) ^ int(state[1])) & ((1 << 63) - 1)


def generator(*ints: int, device: str | torch.device = "cpu") -> torch.Generator:
    """A torch.Generator seeded with derive_seed(*ints)."""
    g = torch.Generator(device=device)
    g.manual_seed(derive_seed(*ints))
    return g


def numpy_rng(*ints: int) -> np.random.Generator:
    return np.random.default_rng(derive_seed(*ints))
