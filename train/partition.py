"""Which reader reads which shards in which epoch, and how many batches each yields: pure functions of integers.

Every decision that must agree across ranks, and be reproduced exactly after a restart, lives here and
depends only on integers (seed, epoch, shard sizes from the manifest, world size, workers, batch sizes), in
the spirit of mosaicml/streaming's partitioning. No I/O, no clocks, no global RNG.

Layout of one epoch:
- shard order: a permutation of the shards from (seed, epoch) (Fisher-Yates over PCG64 raw output, whose
  stream numpy guarantees across versions);
- readers ("slots"): rank r's loader worker w is slot r * W + w (W = max(1, num_workers)); shards are dealt
  in that order to the slot holding the fewest samples so far (ties: lowest slot), which balances slots and
  therefore ranks even when shards differ in size;
- batches: each reader yields micro-batches from its own shuffle buffer; torch's DataLoader hands a rank its
  workers' batches round-robin (batch i from worker i % W), so worker w must supply `worker_quota(M, w, W)`
  of the rank's M micro-batches. M is the largest count every rank can supply, rounded down to whole
  optimizer steps: all ranks run the same number of steps (no DDP hang) and no sample is used twice.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from dit_pipeline.common.errors import ConfigError
from dit_pipeline.common.seeding import STREAM_SHARD_ORDER, derive_seed

# Sub-streams of STREAM_SHARD_ORDER. Seeds are always derived from tuples of one fixed length per use
# (derive_seed hashes the length too, so (.., x) and (.., x, 0) differ; fixed-length tuples stay clearer).
_ORDER = 0
_SHUFFLE = 1
_INTERLEAVE = 2
_LOADER = 3


def stable_permutation(n: int, seed: int) -> list[int]:
    """A permutation of range(n) that depends only on (n, seed), on every platform and numpy version."""
    raw = np.random.PCG64(seed).random_raw(max(n - 1, 0)) if n > 1 else np.zeros(0, np.uint64)
    perm = list(range(n))
    # Fisher-Yates from the top; modulo bias is below 2**-40 for any realistic shard count.
    for k, i in enumerate(range(n - 1, 0, -1)):
        j = int(raw[k]) % (i + 1)
        perm[i], perm[j] = perm[j], perm[i]
    return perm


def shard_order(num_shards: int, seed: int, epoch: int) -> list[int]:
    """The order in which the shards are dealt to readers in `epoch`."""
    return stable_permutation(num_shards, derive_seed(seed, STREAM_SHARD_ORDER, epoch, _ORDER))


def shuffle_seed(seed: int, epoch: int, slot: int) -> int:
    """Seed of reader `slot`'s shuffle buffer in `epoch`."""
    return derive_seed(seed, STREAM_SHARD_ORDER, epoch, _SHUFFLE, slot)


def interleave_seed(seed: int, epoch: int, slot: int) -> int:
    """Seed of the choice, sample by sample, of which of reader `slot`'s open shards to read next."""
    return derive_seed(seed, STREAM_SHARD_ORDER, epoch, _INTERLEAVE, slot)


def loader_seed(seed: int, epoch: int, rank: int) -> int:
    """Seed of rank `rank`'s DataLoader in `epoch` (its workers' base seed): the loader then draws nothing
    from the global torch generator, whose saved state therefore resumes exactly too."""
    return derive_seed(seed, STREAM_SHARD_ORDER, epoch, _LOADER, rank)


def assign_shards(sizes: Sequence[int], order: Sequence[int], num_slots: int) -> list[list[int]]:
    """Deal shards (in `order`) to `num_slots` readers, each to the reader with the fewest samples so far."""
    heap = [(0, slot) for slot in range(num_slots)]
    slots: list[list[int]] = [[] for _ in range(num_slots)]
    for shard in order:
        load, slot = heapq.heappop(heap)
        slots[slot].append(shard)
        heapq.heappush(heap, (load + int(sizes[shard]), slot))
    return slots


def worker_quota(micro_batches: int, worker: int, workers: int) -> int:
    """How many of a rank's first `micro_batches` batches come from `worker` (batch i from worker i % W)."""
    return 0 if micro_batches <= worker else (micro_batches - worker + workers - 1) // workers


def rank_capacity(slot_samples: Sequence[int], micro_batch: int) -> int:
    """Most micro-batches one rank can supply round-robin from its readers' sample counts.

    Worker w holds b_w full batches; serving batch i from worker i % W works for M batches iff
    worker_quota(M, w, W) <= b_w for all w, i.e. M <= b_w * W + w.
    """
    workers = len(slot_samples)
    return min((n // micro_batch) * workers + w for w, n in enumerate(slot_samples))


@dataclass(frozen=True)
class EpochPlan:
    """Everything a rank needs to read its share of one epoch."""

    epoch: int
    world_size: int
    workers: int                              # readers per rank, >= 1
    micro_batch: int
    accum: int
    slot_shards: tuple[tuple[int, ...], ...]  # shard indices per slot, in reading order
    slot_samples: tuple[int, ...]
    micro_batches: int                        # per rank, identical on every rank; a multiple of accum

    @property
    def steps(self) -> int:
        return self.micro_batches // self.accum

    @property
    def samples_total(self) -> int:
        return sum(self.slot_samples)

    @property
    def samples_used(self) -> int:
        return self.micro_batches * self.micro_batch * self.world_size

    def slot(self, rank: int, worker: int) -> int:
        return rank * self.workers + worker

    def quota(self, worker: int, upto: int | None = None) -> int:
        """Batches worker `worker` yields in this epoch (or among the rank's first `upto` batches)."""
        return worker_quota(self.micro_batches if upto is None else upto, worker, self.workers)


def check_readers(num_shards: int, world_size: int, workers: int) -> None:
    """Every reader (rank x loader worker) needs at least one shard; otherwise say what to change."""
    readers = world_size * workers
    if num_shards >= readers:
        return
    fix = []
    if num_shards >= world_size:
        fix.append(f"use --num-workers {num_shards // world_size} or fewer")
    else:
        fix.append(f"use at most {num_shards} ranks")
    fix.append("or re-extract with a smaller --samples-per-shard so there are at least "
               f"{readers} shards")
    raise ConfigError([f"the shard set has {num_shards} shard(s), fewer than {world_size} rank(s) x "
                       f"{workers} loader worker(s) = {readers} readers, and each reader needs at least one "
                       f"shard: {'; '.join(fix)}"], "data layout")


def plan_epoch(shard_sizes: Sequence[int], *, seed: int, epoch: int, world_size: int, workers: int,
               micro_batch: int, accum: int) -> EpochPlan:
    """The deterministic reading plan of `epoch` (identical on every rank)."""
    workers = max(1, workers)
    check_readers(len(shard_sizes), world_size, workers)
    slots = assign_shards(shard_sizes, shard_order(len(shard_sizes), seed, epoch), world_size * workers)
    samples = [sum(int(shard_sizes[s]) for s in slot) for slot in slots]
    capacity = min(rank_capacity(samples[r * workers:(r + 1) * workers], micro_batch)
                   for r in range(world_size))
    return EpochPlan(epoch=epoch, world_size=world_size, workers=workers, micro_batch=micro_batch,
                     accum=accum, slot_shards=tuple(tuple(s) for s in slots), slot_samples=tuple(samples),
                     micro_batches=capacity // accum * accum)


@dataclass(frozen=True)
class DataLayout:
    """The settings that, with the shard set, determine the sample stream (stored in checkpoints)."""

    seed: int
    world_size: int
    workers: int
    micro_batch: int
    accum: int
    shuffle_buffer: int
    shards_in_flight: int

    def to_dict(self) -> dict[str, int]:
        return {k: int(v) for k, v in self.__dict__.items()}


@dataclass(frozen=True)
class Position:
    epoch: int
    step_in_epoch: int
    exact: bool          # False: the stream differs from the saved run's (different layout)


def map_position(epoch: int, step_in_epoch: int, saved: DataLayout, current: DataLayout,
                 steps_in_epoch: int) -> Position:
    """Where a resumed run continues reading.

    Same layout: exactly where the saved run stopped (the continued stream is identical). Different layout
    (e.g. another world size with the same global batch): the epoch's reading plan changes, so the position
    is mapped by optimizer steps into the new plan of the same epoch (the same fraction of the epoch is
    skipped; samples seen before and after the change may overlap or be missed within that one epoch).
    """
    exact = saved == current
    if step_in_epoch >= steps_in_epoch:
        return Position(epoch + 1, 0, exact)
    return Position(epoch, step_in_epoch, exact)


def total_steps(shard_sizes: Sequence[int], epochs: int, *, seed: int, world_size: int, workers: int,
                micro_batch: int, accum: int) -> int:
    """Optimizer steps in the first `epochs` epochs (steps per epoch can differ by a few across epochs)."""
    return sum(plan_epoch(shard_sizes, seed=seed, epoch=e, world_size=world_size, workers=workers,
                          micro_batch=micro_batch, accum=accum).steps for e in range(epochs))
