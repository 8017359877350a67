"""Resuming at another world size (or another loader layout) in the middle of an epoch, without seeing a sample twice
or skipping one: the rest of that epoch is read as the saved run planned it.

A checkpoint records the data layout its epoch is read under (train.partition.DataLayout: world size, loader
workers, micro-batch, accumulation, shuffle buffer). Each optimizer step of that epoch consumes one global batch:
old rank j's `P = micro x accum` samples of the step, for j = 0..W-1 in rank order. A run resumed with W' ranks
(the same global batch G = W x P = W' x P', which train.setting_parts.ConfigPart enforces) gives new rank i the samples
[i P', (i + 1) P') of that concatenation: it reads the old ranks' streams that hold them (`sources`; each exactly
as the old rank would have, from the resume position on, with the old plan's readers and seeds) and cuts its
share out of each step (`HandoverLoader`). Every step then trains on exactly the samples the uninterrupted run's
step would have; only the per-rank noise draws and the reduction order differ (they are functions of the rank).
From the next epoch on the run plans for its own layout. 8 -> 4 ranks: new rank i reads old ranks 2i and 2i + 1
whole; 2 -> 4: new rank i reads half of each step of old rank i // 2 (and drops the other half).
"""
from __future__ import annotations

from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch

from dit_pipeline.train.data import Batch
from dit_pipeline.train.partition import DataLayout
from dit_pipeline.train.stages import ReaderEvent


def sources(old: DataLayout, new_world: int, new_rank: int) -> list[tuple[int, int, int]]:
    """(old rank, start, stop): the slices of each step's samples of the old ranks that new rank `new_rank` of
    `new_world` trains on, in order (old rank j's step holds old.micro_batch x old.accum samples)."""
    per_old = old.micro_batch * old.accum
    total = per_old * old.world_size
    if total % new_world:
        raise ValueError(f"a global batch of {total} does not split over {new_world} ranks")
    per_new = total // new_world
    lo, hi = new_rank * per_new, (new_rank + 1) * per_new
    out = []
    for j in range(lo // per_old, (hi - 1) // per_old + 1):
        start, stop = max(lo, j * per_old) - j * per_old, min(hi, (j + 1) * per_old) - j * per_old
        out.append((j, start, stop))
    return out


def _cat(values: Sequence[Any]) -> Any:
    """Per-sample values of several batches joined: tensors along dim 0 (a ragged dim 1, e.g. text padded to each
    batch's longest caption, zero-padded to the longest), lists concatenated, None stays None."""
    if values[0] is None:
        return None
    if isinstance(values[0], torch.Tensor):
        if values[0].ndim >= 2 and len({v.shape[1] for v in values}) > 1:
            width = max(v.shape[1] for v in values)
            values = [torch.nn.functional.pad(v, (0, 0) * (v.ndim - 2) + (0, width - v.shape[1])) for v in values]
        return torch.cat(list(values))
    if isinstance(values[0], np.ndarray):
        return np.concatenate(list(values))
    return [x for v in values for x in v]


def join(batches: Sequence[Batch]) -> Batch:
    """One batch of every sample of `batches`, in order; the shards skipped on the way ride along once."""
    fields: dict[str, Any] = {name: _cat([getattr(b, name) for b in batches]) for name in Batch._fields
                              if name != "skipped"}
    return Batch(**fields, skipped=[s for b in batches for s in b.skipped])


def cut(batch: Batch, start: int, stop: int) -> Batch:
    """Samples [start, stop) of a batch (its skipped shards kept)."""
    n = len(batch.keys)
    fields: dict[str, Any] = {name: (v[start:stop] if v is not None and name != "skipped" and len(v) == n else v)
                              for name, v in zip(Batch._fields, batch)}
    return Batch(**fields)


class HandoverLoader:
    """New rank `new_rank`'s micro-batches of an epoch begun under `old` (module docstring): an iterator of
    `accum` items per optimizer step, each a Batch of `micro` samples, or a ReaderEvent where an old stream
    stopped (every item of that step then carries it, so the trainer's pre-step agreement sees it)."""

    def __init__(self, old: DataLayout, new_world: int, new_rank: int, micro: int, accum: int,
                 open_loader: Callable[[int], Iterator[Batch | ReaderEvent]]):
        self.old, self.micro, self.accum = old, micro, accum
        self.parts = sources(old, new_world, new_rank)
        self.loaders = [open_loader(j) for j, _, _ in self.parts]
        self._pending: list[Batch | ReaderEvent] = []

    def __iter__(self) -> "HandoverLoader":
        return self

    def __next__(self) -> Batch | ReaderEvent:
        if not self._pending:
            self._pending = self._step()
        return self._pending.pop(0)

    def _step(self) -> list[Batch | ReaderEvent]:
        shares: list[Batch] = []
        read: list[Batch | ReaderEvent] = []
        for (_, start, stop), loader in zip(self.parts, self.loaders):
            items = [next(loader) for _ in range(self.old.accum)]
            read += items
            if not any(isinstance(it, ReaderEvent) for it in items):
                shares.append(cut(join(items), start, stop))  # type: ignore[arg-type]
        events = [it for it in read if isinstance(it, ReaderEvent)]
        if events:  # every shard skipped on the way rides with it
            return [events[0]._replace(skipped=[s for it in read for s in it.skipped])] * self.accum
        step = join(shares)
        return [cut(step, i * self.micro, (i + 1) * self.micro)._replace(skipped=step.skipped if i == 0 else [])
                for i in range(self.accum)]

    def close(self) -> None:
        for loader in self.loaders:
            getattr(loader, "close", lambda: None)()
