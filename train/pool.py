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

A text set's features (`Batch.text`) go through a `TextPool` of their own beside the latents' slots (issue 47:
without one they cost a fresh shared-memory segment per batch and a widening to float32, most of the loader's
1.3-1.5 ms per Qwen3 sample): a slot holds micro_batch x the set's longest caption x D values in the stored dtype
(bfloat16 as its 16 bits), written by the worker that holds the batch's latent slot; the batch's [B, L, D] is the
slot's first B L D values, and its mask travels as the B lengths.
"""
from __future__ import annotations

import math
import weakref
from typing import Any, NamedTuple, Sequence

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
    text: torch.Tensor | None = None     # [B, L, D] text features in shared memory, stored dtype (Batch.text)
    text_mask: torch.Tensor | None = None  # [B, L] bool
    captions: list | None = None         # [B] caption strings
    text_slot: int | None = None         # the features are in this TextPool slot instead (text is None) ...
    text_lengths: np.ndarray | None = None  # ... [B] int64 tokens per caption (the mask)
    sources: np.ndarray | None = None    # [B] int64: a data mix's source of each sample (train/mixstream.py)


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


# A text set's stored dtype -> the dtype its values reach the model in, and the slot storage of its bits
TEXT_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_SLOT_DTYPES = {"bfloat16": torch.int16, "float16": torch.float16, "float32": torch.float32}


def longest_caption(manifest: Any) -> int:
    """A text set's longest caption in tokens, bounded by its length histogram (the upper edge of its last
    non-empty bin, shards/text.py length_edges) and the encoder's max length."""
    text = manifest.text
    limit = int(text["max_length"])
    hist = text.get("length_histogram") or {}
    edges, counts = hist.get("edges") or [], hist.get("counts") or []
    used = [i for i, c in enumerate(counts) if c]
    return limit if not used or len(edges) <= used[-1] + 1 else min(limit, int(edges[used[-1] + 1]) - 1)


def write_text_rows(out: np.ndarray, rows: Sequence[np.ndarray]) -> np.ndarray:
    """Rows of stored features ([length_i, D], storage dtype) into `out` [B, Lmax, D] of the same width, zero past
    each length, bits unchanged (no widening); returns the lengths [B] int64."""
    lengths = np.array([r.shape[0] for r in rows], dtype=np.int64)
    for i, r in enumerate(rows):
        n = r.shape[0]
        out[i, :n] = r.view(out.dtype)  # bfloat16's stored uint16 bits into the int16 view
        out[i, n:] = 0
    return lengths


def lengths_mask(lengths: np.ndarray) -> torch.Tensor:
    """[B, Lmax] bool, True at the first lengths[i] tokens of row i."""
    lmax = int(lengths.max()) if len(lengths) else 0
    return torch.arange(lmax)[None, :] < torch.from_numpy(lengths)[:, None]


def text_batch(rows: Sequence[np.ndarray], dim: int, stored: str, shared: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(text [B, Lmax, D] in the stored dtype, mask) in fresh memory (shared memory in a loader worker): the
    fallback when no TextPool slot is free, and the in-process loader."""
    lmax = max((r.shape[0] for r in rows), default=0)
    shape = (len(rows), lmax, dim)
    text = shared_empty(shape, TEXT_DTYPES[stored]) if shared else torch.empty(shape, dtype=TEXT_DTYPES[stored])
    lengths = write_text_rows(text.view(_SLOT_DTYPES[stored]).numpy(), rows)
    return text, lengths_mask(lengths)


class TextPool(BatchPool):
    """BatchPool slots for a batch's text features in their stored dtype (module docstring)."""

    def __init__(self, workers: int, slots: int, micro_batch: int, tokens: int, dim: int, stored: str):
        super().__init__(workers, slots, (micro_batch * tokens * dim,), _SLOT_DTYPES[stored])
        self.dim, self.stored = dim, stored

    def write(self, slot: int, rows: Sequence[np.ndarray]) -> np.ndarray | None:
        """Worker side: the rows into `slot` as [B, Lmax, D]; their lengths, or None (slot released) when they do
        not fit (a caption longer than the set's histogram says)."""
        lmax = max((r.shape[0] for r in rows), default=0)
        size = len(rows) * lmax * self.dim
        if size > self.shape[0]:
            self.busy[slot] = 0
            return None
        return write_text_rows(self.data[slot, :size].numpy().reshape(len(rows), lmax, self.dim), rows)

    def take_text(self, slot: int, lengths: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Main side: (text [B, Lmax, D] in the stored dtype, mask) of `slot`, which is free again once the text
        tensor and its views are gone."""
        lmax = int(lengths.max()) if len(lengths) else 0
        flat = self.take(slot)[: len(lengths) * lmax * self.dim]
        return flat.view(TEXT_DTYPES[self.stored]).view(len(lengths), lmax, self.dim), lengths_mask(lengths)
