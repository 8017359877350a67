"""Shared-memory output slots that DataLoader workers reuse for their batches, instead of fresh memory per batch.

A loader worker normally makes each batch in fresh shared memory (torch's default_collate does the same): a
new /dev/shm file whose pages are zeroed, faulted in by the worker and again by the trainer, and a file
descriptor sent through a socket, every batch. On the 2-core benchmark VM that cost about 20 of the 100 us of
CPU per latent. A BatchPool is allocated by the main process once per epoch, before the workers start (they
inherit it), with a few slots per worker:

- a worker takes a free slot of its own (`acquire`), marks it busy, writes the batch into it and sends only
  the slot number (`PooledBatch`);
- the main process wraps the slot in a tensor (`take`) whose storage holds a numpy view of the slot; when the
  last tensor or view of that storage is gone, a weakref finalizer marks the slot free again;
- a worker that finds no free slot (the trainer holds many batches, e.g. a test keeping all of them) makes the
  batch in fresh shared memory as before, so it never waits and never overwrites a batch still in use.
"""
from __future__ import annotations

import math
import weakref
from typing import NamedTuple, Sequence

import numpy as np
import torch


def shared_empty(shape: Sequence[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An uninitialised CPU tensor in shared memory, as torch's default_collate allocates batches in loader
    workers: the DataLoader then hands it to the main process without copying it."""
    t = torch.empty(0, dtype=dtype)
    storage = torch.UntypedStorage._new_shared(math.prod(shape) * t.element_size())
    return t.set_(storage, 0, tuple(shape))  # type: ignore[call-overload]  # (storage, offset, size) exists


class PooledBatch(NamedTuple):
    """A batch a worker wrote into pool slot `slot`; labels and keys travel by value."""

    slot: int
    labels: np.ndarray         # [B] int64
    keys: np.ndarray           # [B] int64
    skipped: list
    pixels: torch.Tensor | None = None  # [B, H, W, 3] uint8 in shared memory (the trainer asked for pixels)
    teacher: torch.Tensor | None = None  # [B, N, D] float32 cached teacher tokens in shared memory (--repa FOLDER)
    text: torch.Tensor | None = None     # [B, L, D] float32 text features in shared memory (train.data.Batch.text)
    text_mask: torch.Tensor | None = None  # [B, L] bool
    captions: list | None = None         # [B] caption strings
    sources: np.ndarray | None = None    # [B] int64: a data mix's source of each sample (train/mixdata.py)


def _release(busy: torch.Tensor, slot: int) -> None:
    busy[slot] = 0


class BatchPool:
    """`slots` output buffers of `shape` (one batch) per worker, in shared memory, with busy flags."""

    def __init__(self, workers: int, slots: int, shape: Sequence[int], dtype: torch.dtype = torch.float32):
        self.workers, self.slots, self.shape = workers, slots, tuple(shape)
        self.data = shared_empty((workers * slots, *self.shape), dtype)
        self.busy = shared_empty((workers * slots,), torch.int32).zero_()  # 1: the main process holds it
        self._cursor = 0  # per process: where a worker looks first

    def acquire(self, worker: int) -> int | None:
        """Worker side: a free slot of `worker`, now marked busy, or None when all of them are in use."""
        busy = self.busy.numpy()
        for j in range(self.slots):
            k = worker * self.slots + (self._cursor + j) % self.slots
            if busy[k] == 0:
                busy[k] = 1
                self._cursor = (self._cursor + j + 1) % self.slots
                return k
        return None

    def take(self, slot: int) -> torch.Tensor:
        """Main side: the batch in `slot` as a tensor; the slot is free again once the tensor and every view
        of it are gone (the storage keeps the numpy view alive, and its finalizer releases the slot)."""
        view = self.data[slot].numpy()
        weakref.finalize(view, _release, self.busy, slot)
        return torch.from_numpy(view)

    def free_slots(self) -> int:
        return int((self.busy == 0).sum())
