"""Which sample gets which noise, which class, and which rank: pure functions of integers.

Every sample has a global index i in [0, N). Its noise comes from a torch.Generator seeded with
`derive_seed(seed, STREAM_SAMPLING, i)` and, when classes are drawn, its class from
`derive_seed(seed, STREAM_SAMPLING, i, LABEL_SUBSTREAM)` (uniform draws) or, with equal-label sampling, from
the permutation of the C classes seeded by `derive_seed(seed, STREAM_SAMPLING, i // C, EQUAL_SUBSTREAM)`,
whatever the batch size, the number of ranks or how often the run was interrupted. The batches are fixed
global chunks of the index range, so the float computation of a sample, and hence its bits, is the same for
any number of ranks and after a kill (for one batch size; another batch size changes kernel shapes:
common/determinism.py).
(STYLE.md: reproducible decisions are pure functions of integers; streaming's partitioning.)
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from dit_pipeline.common.seeding import STREAM_SAMPLING, derive_seed

# Appended to (seed, STREAM_SAMPLING, index) for the class draw, so it never shares a seed with the noise.
LABEL_SUBSTREAM = 1
# Appended to (seed, STREAM_SAMPLING, block) for equal-label sampling's permutation of block `index // C`.
EQUAL_SUBSTREAM = 2
# How classes are chosen when not given: "uniform" draws each independently (DiT's and ADM's FID samplers);
# "equal" gives every class N / C samples (counts differ by at most 1), as newer papers (e.g. RAE) evaluate.
LABEL_SAMPLINGS = ("uniform", "equal")


def noise_seed(seed: int, index: int) -> int:
    """Seed of sample `index`'s noise generator (initial latent and every sampler step)."""
    return derive_seed(seed, STREAM_SAMPLING, index)


def noise_generators(seed: int, indices: Sequence[int], device: str | torch.device = "cpu") -> list[torch.Generator]:
    """One freshly seeded torch.Generator per sample index, in the order given."""
    gens = []
    for i in indices:
        g = torch.Generator(device=device)
        g.manual_seed(noise_seed(seed, int(i)))
        gens.append(g)
    return gens


def drawn_label(seed: int, index: int, num_classes: int) -> int:
    """The class of sample `index` when classes are drawn uniformly (exactly uniform, no modulo bias)."""
    rng = np.random.default_rng(derive_seed(seed, STREAM_SAMPLING, index, LABEL_SUBSTREAM))
    return int(rng.integers(num_classes))


def _block_classes(seed: int, block: int, num_classes: int) -> np.ndarray:
    rng = np.random.default_rng(derive_seed(seed, STREAM_SAMPLING, block, EQUAL_SUBSTREAM))
    return rng.permutation(num_classes).astype(np.int64)


def equal_label(seed: int, index: int, num_classes: int) -> int:
    """The class of sample `index` under equal-label sampling.

    The indices [k*C, (k+1)*C) hold every one of the C classes once, in the order of a permutation seeded by
    (seed, k). Hence the first N samples hold each class floor(N / C) or ceil(N / C) times, for any N, and a
    sample's class depends only on (seed, index, C), never on N, the batch size or the number of ranks.
    """
    block, pos = divmod(int(index), int(num_classes))
    return int(_block_classes(seed, block, num_classes)[pos])


def class_labels(*, num_samples: int, seed: int, num_classes: int, given: Sequence[int] | None = None,
                 sampling: str = "uniform") -> np.ndarray:
    """The class of every sample, int64 [num_samples].

    given: labels from --class-labels, repeated cyclically to num_samples; None chooses them by `sampling`:
    "uniform" (`drawn_label`) or "equal" (`equal_label`).
    """
    if given:
        reps = -(-num_samples // len(given))
        return np.tile(np.asarray(given, dtype=np.int64), reps)[:num_samples]
    if sampling == "equal":
        blocks = [_block_classes(seed, k, num_classes) for k in range(-(-num_samples // num_classes))]
        return np.concatenate(blocks or [np.zeros(0, np.int64)])[:num_samples]
    if sampling != "uniform":
        raise ValueError(f"label sampling must be one of {LABEL_SAMPLINGS}, got {sampling!r}")
    return np.array([drawn_label(seed, i, num_classes) for i in range(num_samples)], dtype=np.int64)


def rank_batches(remaining: Sequence[int], batch_size: int, rank: int, world_size: int) -> list[list[int]]:
    """This rank's batches of the still-missing sample indices.

    Batches are fixed global chunks: chunk k holds the missing indices of [k*B, (k+1)*B), and the k-th
    non-empty chunk goes to rank k % world_size. A chunk is the same tensor shape whatever the number of
    ranks, and a killed run (which commits whole chunks) redoes whole chunks, so every sample is computed
    in the same batch as in an uninterrupted one-process run with the same batch size
    (common/determinism.py); ranks stay within one batch of each other.
    """
    if batch_size < 1 or world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"bad split: batch_size={batch_size}, rank={rank}, world_size={world_size}")
    chunks: dict[int, list[int]] = {}
    for i in sorted(int(i) for i in remaining):
        chunks.setdefault(i // batch_size, []).append(i)
    return list(chunks.values())[rank::world_size]
