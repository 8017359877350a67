"""A data mix's epoch as pure functions of integers: how many samples each source gives, which ones, and which
lane reads them (issue 46; docs/data-mix.md).

Nothing here opens a file or reads a clock: the plan of an epoch depends only on (seed, epoch, the sources' shard
records and weights, the lane count, the global batch), as train/partition.py's plan does for one shard set.

**Weights** follow MosaicML Streaming's `Stream(proportion=, repeat=, choose=)` (streaming/base/stream.py,
`Stream.apply_weights`; its docs "Mixing Datasets"), each source giving at most one:
- `proportion` (relative; then every source gives one): the source's share of the epoch. The epoch holds
  `epoch_size` samples (default: the sources' samples together), and source s takes floor(E x p_s / sum p) of
  them; the samples still missing to E go one each to the first sources (with a share) of a seeded order, fixed
  for the run;
- `repeat` (absolute): floor(repeat x n_s) samples per epoch, n_s the source's samples (2: each sample twice,
  0.5: half of them);
- `choose` (absolute): exactly that many samples per epoch;
- none of them: n_s, every sample once (with `epoch_size` and no weights: shares in proportion to n_s).
Relative and absolute weights do not mix (Streaming refuses it too).

**Repeat semantics** (Streaming's `resample_streams`): a source that gives c samples per epoch from n_s holds
floor(c / n_s) full passes over all its samples plus c mod n_s samples drawn without replacement, anew each epoch
(`choose_subset`); so a source asked for more than it holds is exhausted after n_s / c of each epoch and repeats,
and one asked for less shows a different part of itself each epoch.

**Order.** Each pass (and the partial pass) over a shard is a *visit*. Every source's visits are put in a seeded
order and spread evenly over the epoch (visit j of m_s sits at (j + u_s) / m_s, u_s a seeded offset in [0, 1)),
so that no source is read out early; the visits, in that order, are dealt to `lanes` readers (each to the lane
with the fewest samples so far). A lane reads its visits through the loader's stages (several shards at once, a
seeded shuffle buffer: train/mixstream.py), a deterministic stream; global step k takes `G / lanes` samples of
each lane, lanes in order. The global sequence of samples is thus a function of (seed, epoch, mix, lanes, G) and
of nothing else: not of the world size (rank r reads lanes [r L / W, (r + 1) L / W)), the loader workers or an
interruption, which is what lets a run resume at another world size without a sample seen twice or skipped.

The seeds of these draws, the subset drawn for a partial pass (`choose_subset`) and the held-out key rule
(`holdout`: held-out keys are never in a visit) are train/mixdraws.py's.
"""
from __future__ import annotations

import functools
import heapq
import math
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import numpy as np

from dit_pipeline.common.errors import UserError
from dit_pipeline.train.mixdraws import (choose_subset, held_out_mask, order_seed, shortfall_seed, spread_seed,
                                         subset_seed)

WEIGHT_KINDS = ("proportion", "repeat", "choose")
_EPS = 1e-9  # floor(x + eps): a share written as 0.7 is 70 of 100, not 69 by its binary rounding


# ----------------------------------------------------------------------------------------------------------
# Weights -> samples per source and epoch

@dataclass(frozen=True)
class Weight:
    """One source's weight: at most one of proportion, repeat, choose (all None: every sample once)."""

    proportion: float | None = None
    repeat: float | None = None
    choose: int | None = None

    @property
    def kind(self) -> str | None:
        given = [k for k in WEIGHT_KINDS if getattr(self, k) is not None]
        return given[0] if given else None

    def problems(self, name: str) -> list[str]:
        given = [k for k in WEIGHT_KINDS if getattr(self, k) is not None]
        out = [f"source {name}: give at most one of proportion, repeat, choose (got {', '.join(given)})"] \
            if len(given) > 1 else []
        for k in given:
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                out.append(f"source {name}: {k} must be a number >= 0, got {v!r}")
            elif k == "choose" and int(v) != v:
                out.append(f"source {name}: choose is a number of samples, got {v!r}")
        return out

    def describe(self) -> str:
        k = self.kind
        return "every sample once" if k is None else f"{k} {getattr(self, k):g}"


def weights_problems(weights: Sequence[Weight], names: Sequence[str], epoch_size: int | None) -> list[str]:
    """What is wrong with a mix's weights as a whole (each one's own problems first)."""
    out = [p for w, n in zip(weights, names) for p in w.problems(n)]
    relative = [w.kind == "proportion" for w in weights]
    if any(relative) and not all(relative):
        out.append("proportion (relative) and repeat/choose (absolute) weights do not mix: give every source a "
                   "proportion, or none of them (MosaicML Streaming's rule)")
    if epoch_size is not None:
        if isinstance(epoch_size, bool) or not isinstance(epoch_size, int) or epoch_size < 1:
            out.append(f"epoch_size must be a positive number of samples, got {epoch_size!r}")
        elif any(w.kind in ("repeat", "choose") for w in weights):
            out.append("epoch_size sets the length of an epoch of proportions; with repeat/choose the epoch is "
                       "their sum: drop epoch_size")
    if all(relative) and weights and sum(float(w.proportion or 0) for w in weights) <= 0:
        out.append("the proportions add up to 0: give at least one source a proportion > 0")
    return out


def choose_per_source(sizes: Sequence[int], weights: Sequence[Weight], epoch_size: int | None, seed: int
                      ) -> list[int]:
    """Samples each source gives per epoch (module docstring; Streaming's Stream.apply_weights)."""
    n = [int(s) for s in sizes]
    kinds = {w.kind for w in weights}
    if kinds == {"proportion"} or (kinds == {None} and epoch_size is not None):
        props = [float(w.proportion) if w.kind == "proportion" else float(s)  # type: ignore[arg-type]
                 for w, s in zip(weights, n)]
        total = sum(props)
        size = int(epoch_size) if epoch_size is not None else sum(n)
        out = [math.floor(size * p / total + _EPS) if total > 0 else 0 for p in props]
        short = size - sum(out)
        if short > 0:  # one each, to the first sources (of those with a share) in a seeded order, every epoch alike
            order = [s for s in stable_permutation(len(n), shortfall_seed(seed)) if props[s] > 0]
            for s in order[:short]:
                out[s] += 1
        return out
    out = []
    for w, s in zip(weights, n):
        if w.kind == "repeat":
            out.append(math.floor(float(w.repeat) * s + _EPS))  # type: ignore[arg-type]
        elif w.kind == "choose":
            out.append(int(w.choose))  # type: ignore[arg-type]
        else:
            out.append(s)
    return out


# ----------------------------------------------------------------------------------------------------------
# Seeded orders (PCG64's raw stream: the same on every platform and numpy version)

def stable_permutation(n: int, seed: int) -> list[int]:
    """train.partition.stable_permutation (Fisher-Yates from the top over PCG64 raw output)."""
    from dit_pipeline.train.partition import stable_permutation as perm

    return perm(n, seed)


# ----------------------------------------------------------------------------------------------------------
# Sources as the planner sees them: shards with their keys

@dataclass(frozen=True)
class ShardKeys:
    """One shard of a source as its manifest records it: its keys are first..last minus the skipped ones."""

    samples: int
    first: int | None
    last: int | None

    def keys(self, skipped: frozenset[int]) -> np.ndarray:
        """int64 [samples]: its keys in order (first..last less the skipped ones)."""
        if self.first is None or self.last is None:
            return np.zeros(0, dtype=np.int64)
        keys = np.arange(self.first, self.last + 1, dtype=np.int64)
        if skipped:
            keys = keys[~np.isin(keys, np.fromiter(skipped, dtype=np.int64, count=len(skipped)))]
        return keys


@dataclass(frozen=True)
class SourceShape:
    """What the planner needs of one source: its shards, the keys skipped at extraction, the held-out fraction,
    the shards left out (skipped as unreadable with --skip-bad-shards), its weight and its name."""

    name: str
    shards: tuple[ShardKeys, ...]
    weight: Weight = Weight()
    holdout: float = 0.0
    skipped: frozenset[int] = frozenset()
    bad: frozenset[int] = frozenset()   # shard indices never read again

    def count(self, shard: int) -> int:
        """The samples of `shard` a visit reads (the held-out keys and a bad shard's left out)."""
        if shard in self.bad:
            return 0
        if self.holdout <= 0:
            return self.shards[shard].samples
        return _trainable_count(self.shards[shard], self.skipped, self.holdout, self.name, shard)

    def keys_of(self, shard: int) -> np.ndarray:
        """Those keys, in key order (int64)."""
        if shard in self.bad:
            return np.zeros(0, dtype=np.int64)
        return _trainable_keys(self.shards[shard], self.skipped, self.holdout, self.name, shard)


# The keys of a shard do not depend on the epoch: listed once per process, not again by every epoch's plan.
@functools.lru_cache(maxsize=None)
def _trainable_keys(rec: ShardKeys, skipped: frozenset[int], holdout: float, name: str, shard: int) -> np.ndarray:
    keys = rec.keys(skipped)
    if len(keys) != rec.samples:
        raise UserError(f"source {name}: shard {shard} records {rec.samples} samples but its keys "
                        f"{rec.first}..{rec.last} less the skipped ones are {len(keys)}; its keys cannot be "
                        "listed from the manifest (needed to hold keys out or to draw part of a source)")
    return keys[~held_out_mask(keys, holdout)] if holdout > 0 else keys


@functools.lru_cache(maxsize=None)
def _trainable_count(rec: ShardKeys, skipped: frozenset[int], holdout: float, name: str, shard: int) -> int:
    return len(_trainable_keys(rec, skipped, holdout, name, shard))


class Visit(NamedTuple):
    """One pass of a lane over one shard: all its trainable keys (`keys` None) or the listed ones."""

    source: int
    shard: int
    copy: int                         # which pass over the source in this epoch (0, 1, ...; the partial one last)
    samples: int
    keys: tuple[int, ...] | None


@dataclass(frozen=True)
class MixEpoch:
    """The plan of one epoch of a mix (identical on every rank)."""

    epoch: int
    lanes: tuple[tuple[Visit, ...], ...]
    lane_samples: tuple[int, ...]
    piece: int                        # samples each lane gives per global step (global batch / lanes)
    steps: int                        # global steps of the epoch: the largest count every lane can supply
    asked: tuple[int, ...]            # samples per source of the epoch (choose_per_source)
    available: tuple[int, ...]        # trainable samples per source
    full: tuple[int, ...]             # full passes per source
    partial: tuple[int, ...]          # samples of the partial pass per source

    @property
    def samples_total(self) -> int:
        return sum(self.lane_samples)

    @property
    def samples_used(self) -> int:
        return self.steps * self.piece * len(self.lanes)


def source_visits(src: SourceShape, index: int, choose: int, seed: int, epoch: int) -> tuple[list[Visit], int, int]:
    """The visits of one source in `epoch`, with its number of full passes and the size of its partial pass."""
    counts = [src.count(i) for i in range(len(src.shards))]
    n = sum(counts)
    if choose and not n:
        raise UserError(f"source {src.name}: the mix takes {choose} samples per epoch from it and it has none "
                        "(every shard skipped or held out)")
    full, rest = (choose // n, choose % n) if n else (0, 0)
    visits = [Visit(index, i, c, counts[i], None) for c in range(full) for i in range(len(counts)) if counts[i]]
    if rest:
        picked = choose_subset(n, rest, subset_seed(seed, epoch, index))  # sorted
        starts = np.cumsum([0, *counts])
        shard_of = np.searchsorted(starts, picked, side="right") - 1
        bounds = np.flatnonzero(np.diff(shard_of)) + 1
        for part in np.split(np.arange(len(picked)), bounds):
            sh = int(shard_of[part[0]])
            keys = src.keys_of(sh)[picked[part] - starts[sh]]
            visits.append(Visit(index, sh, full, len(part), tuple(keys.tolist())))
    return visits, full, rest


def spread(visits_per_source: Sequence[Sequence[Visit]], seed: int, epoch: int) -> list[Visit]:
    """All visits in epoch order: each source's in a seeded order, spread evenly over the epoch (module docstring):
    visit j of source s's m_s at (j + u_s) / m_s, u_s = U_s / 2^32 a seeded offset; compared exactly as the
    integers (j 2^32 + U_s) x (M / m_s), M the least common multiple of the m_s (ties: lower source first)."""
    sizes = [len(v) for v in visits_per_source if len(v)]
    common = math.lcm(*sizes) if sizes else 1
    timed: list[tuple[int, int, int, Visit]] = []
    for s, visits in enumerate(visits_per_source):
        m = len(visits)
        if not m:
            continue
        order = stable_permutation(m, order_seed(seed, epoch, s))
        u = int(np.random.PCG64(spread_seed(seed, epoch, s)).random_raw()) >> 32
        scale = common // m
        for j, v in enumerate(order):
            timed.append((((j << 32) + u) * scale, s, j, visits[v]))
    timed.sort(key=lambda x: x[:3])
    return [v for *_, v in timed]


def deal(visits: Sequence[Visit], lanes: int) -> list[list[Visit]]:
    """Visits (in order) to `lanes` lanes, each to the lane with the fewest samples so far (ties: lowest lane)."""
    heap = [(0, lane) for lane in range(lanes)]
    out: list[list[Visit]] = [[] for _ in range(lanes)]
    for v in visits:
        load, lane = heapq.heappop(heap)
        out[lane].append(v)
        heapq.heappush(heap, (load + v.samples, lane))
    return out


def plan_mix_epoch(sources: Sequence[SourceShape], *, seed: int, epoch: int, lanes: int, global_batch: int,
                   epoch_size: int | None = None) -> MixEpoch:
    """The deterministic plan of one epoch of a mix (module docstring)."""
    if lanes < 1 or global_batch % lanes:
        raise ValueError(f"the lanes ({lanes}) must divide the global batch ({global_batch})")
    available = [sum(src.count(i) for i in range(len(src.shards))) for src in sources]
    asked = choose_per_source(available, [s.weight for s in sources], epoch_size, seed)
    per_source, full, partial = [], [], []
    for i, (src, c) in enumerate(zip(sources, asked)):
        v, f, r = source_visits(src, i, c, seed, epoch)
        per_source.append(v)
        full.append(f)
        partial.append(r)
    dealt = deal(spread(per_source, seed, epoch), lanes)
    lane_samples = tuple(sum(v.samples for v in lane) for lane in dealt)
    piece = global_batch // lanes
    steps = min(n // piece for n in lane_samples)
    return MixEpoch(epoch, tuple(tuple(lane) for lane in dealt), lane_samples, piece, steps, tuple(asked),
                    tuple(available), tuple(full), tuple(partial))


# ----------------------------------------------------------------------------------------------------------
# Lanes, ranks and loader workers

def default_lanes(world_size: int, workers: int, global_batch: int) -> int:
    """The lane count of a new mix: world size x readers per rank, the readers lowered until it divides the global
    batch (the lanes give G / lanes samples each per step)."""
    per_rank = global_batch // world_size
    w = max(1, workers)
    while w > 1 and per_rank % w:
        w -= 1
    return world_size * w


def lanes_problem(lanes: int, world_size: int, global_batch: int) -> str | None:
    """Why `lanes` cannot be read by `world_size` ranks (None: they can)."""
    if global_batch % lanes:
        return f"the mix's {lanes} lanes do not divide the global batch {global_batch}"
    if lanes % world_size:
        ok = [w for w in range(1, lanes + 1) if lanes % w == 0]
        return (f"the mix is read by {lanes} lanes (fixed when it started, so the sample sequence never changes), "
                f"which {world_size} rank(s) cannot share evenly: use a world size among {ok}")
    return None


def rank_lanes(lanes: int, world_size: int, rank: int) -> range:
    """The lanes rank `rank` reads: a contiguous block, so its samples are its slice of each global batch."""
    m = lanes // world_size
    return range(rank * m, (rank + 1) * m)


def lane_workers(lanes_per_rank: int, workers: int) -> int:
    """Loader workers per rank for a mix: the most, up to `workers`, that divide the rank's lanes (worker w reads
    its lanes i with i % W == w, so the DataLoader's round robin over workers meets the lanes in order)."""
    w = max(1, min(workers, lanes_per_rank))
    while lanes_per_rank % w:
        w -= 1
    return w
