"""Reproducible randomness as pure functions of integers.

Anything that must not depend on batch size, worker count, world size or interruptions (the view and
posterior noise of a training sample, the noise of a sampled image) takes its seed from
`derive_seed(seed, *ints)`, a well-mixed 63-bit value from numpy's SeedSequence (hash-based, stable across
platforms and numpy versions).
"""
from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

# Distinct streams so e.g. (seed, epoch) for shard order and (seed, epoch, key) for noise never collide.
STREAM_SHARD_ORDER = 1
STREAM_SAMPLE = 2
STREAM_DROPOUT = 3
STREAM_SAMPLING = 4
STREAM_TIMESTEP = 5
STREAM_STEP = 6  # a step's decisions every rank shares (NanoGen's MeanFlow: whether the step is flow matching)


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


# ----------------------------------------------------------------------------------------------------------
# The global generators' states, as values a weights_only checkpoint holds (tensors, ints, floats, lists)

def rng_state() -> dict[str, Any]:
    """The torch, numpy, Python (and CUDA) global generator states."""
    np_state: tuple[Any, ...] = np.random.get_state(legacy=True)  # type: ignore[assignment]  # the tuple form
    py_state = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {"keys": torch.from_numpy(np_state[1].astype(np.int64)), "pos": int(np_state[2]),
                  "has_gauss": int(np_state[3]), "cached_gaussian": float(np_state[4])},
        "python": {"version": int(py_state[0]), "state": [int(x) for x in py_state[1]],
                   "gauss": py_state[2]},
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Any) -> None:
    torch.set_rng_state(state["torch"])
    np_s = state["numpy"]
    np.random.set_state(("MT19937", np_s["keys"].numpy().astype(np.uint32), np_s["pos"], np_s["has_gauss"],
                         np_s["cached_gaussian"]))
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss"]))
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])
