"""The training data stream: shards -> per-reader shuffle buffer -> micro-batches of scaled latents.

Reading goes through `shards.iter_shard` only (WebDataset's url opener underneath, so local folders,
`file:`, `pipe:` commands and object stores all work); nothing here parses tar files. The shard set is a
`train.shard_source.ShardSource` (`open_shards`). Which reader reads which shards, and how many batches it
yields, is decided by `train.partition` (pure functions of integers), so the stream of every rank is a
deterministic function of (seed, epoch, rank, data layout):

- each reader (rank x loader worker) is a chain of iterator -> iterator stages (webdataset's style; the
  generic ones in train/stages.py, `EpochStream.reader` lists them): `read_shard` (train/shard_samples.py: one
  shard, its sha256 checked against the manifest unless --no-verify-shards; with --skip-bad-shards an unreadable
  or mismatching one ends in a `SkippedShard` event) -> `interleave` (several of its shards at once, each sample
  from a seeded random one of them) -> the one view of each sample it will use (still float16 or as stored; with
  --repa its encoded pixels too) -> `shuffle_buffer` (seeded from (seed, epoch, reader)) -> `micro_batches`
  (exactly its quota; the events met are attached to the next batch) -> `resume_skip` ->
  `batches_and_events` (the float32 latents of a whole batch at once, and its pixels decoded in the
  orientation of each latent's view) -> `errors_as_events`. Events travel in-band, through the stages, never
  through shared state;
- per-sample randomness (which view, the posterior noise) and the latent formula are in `train.latents`:
  they depend only on (seed, epoch, sample key), not on the number of workers, the batch or an interruption;
- text (issue 37): with a text sibling set (`text=(folder, manifest)`, shards/siblings.read_text_sibling) each
  sample's text shard is read in lockstep and one of its captions' stored features is kept; with
  `captions=True` the caption strings themselves travel (for a trainer that encodes online with
  common.text_encoders). Which caption a sample uses is `train.shard_samples.caption_index(seed, epoch, key, K)`:
  a pure function of (seed, epoch, key), so cached and online runs draw the same caption. A batch pads the
  features to its longest caption (`Batch.text` [B, L, D] in the text set's stored dtype, bfloat16 for Qwen3,
  never widened here: the network's text norm rounds as NanoGen's does on its encoder's output; zero past each
  length; `Batch.text_mask` [B, L] bool, True = a real token), in a slot of the epoch's TextPool when the
  batch's latents have one (train/pool.py);
- resuming at rank micro-batch k replays the readers and drops their first batches without batching them,
  and rotates the DataLoader workers so batch k still comes from worker k % W;
- in loader workers a batch is made directly in shared memory, in an output slot the worker reuses once the
  trainer has dropped the batch (`train.pool`), so handing it over copies nothing and touches no fresh
  pages; for the GPU it is copied into pinned memory (`pin_memory`).
"""
from __future__ import annotations

import math
from typing import Any, Callable, Iterator, NamedTuple

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from dit_pipeline.common.workers import worker_context
from dit_pipeline.shards import Manifest, ShardRecord
from dit_pipeline.shards.siblings import sibling_shard
from dit_pipeline.train.latents import (LatentSpec, Pending, Scratch, build_latents, build_pixels, build_teacher,
                                        epoch_seed, pending)
from dit_pipeline.train.partition import EpochPlan, interleave_seed, loader_seed, shuffle_seed
from dit_pipeline.train.pool import BatchPool, PooledBatch, TextPool, longest_caption, shared_empty, text_batch
from dit_pipeline.train.shard_samples import Joined, TextPending, WithText, read_shard, text_pending
from dit_pipeline.train.shard_source import ShardSource
from dit_pipeline.train.signals import ignore_in_worker, workers_start_blocked
from dit_pipeline.train.stages import (ReaderEvent, SkippedShard, batches_and_events, errors_as_events, interleave,
                                       micro_batches, resume_skip, shuffle_buffer)


class Batch(NamedTuple):
    latents: torch.Tensor      # [B, C, h, w] float32, scaled
    labels: torch.Tensor       # [B] int64
    keys: torch.Tensor         # [B] int64 global sample indices
    skipped: list              # [SkippedShard(url, problem)] left out (--skip-bad-shards) since the last batch
    pixels: torch.Tensor | None = None  # [B, H, W, 3] uint8, each in its latent's view (when asked for)
    teacher: torch.Tensor | None = None  # [B, N, D] float32 cached teacher tokens of each latent's view (--repa FOLDER)
    # Text (issue 37, contract 2): the drawn caption's features from a text sibling set, padded to the batch's
    # longest caption (zero past each length), and which tokens are real; or the drawn caption strings, for a
    # trainer that encodes them online (common.text_encoders.TextEncoder.encode(...).as_batch() gives the same
    # layout). The null condition is the text set's manifest.null_text() (or the encoder's null()).
    text: torch.Tensor | None = None       # [B, L, D] in the text set's stored dtype (bfloat16 for Qwen3)
    text_mask: torch.Tensor | None = None  # [B, L] bool, True = a real token
    captions: list[str] | None = None      # [B] the caption each sample uses this epoch
    sources: torch.Tensor | None = None    # [B] int64: a data mix's source of each sample (train/mixstream.py)

    def __reduce__(self):
        # Sent from a loader worker: labels and keys travel by value (a few KB); as tensors each would cost
        # a shared-memory file and a file descriptor passed through a socket, per batch.
        return (_rebuild_batch, (self.latents, self.labels.numpy(), self.keys.numpy(), self.skipped, self.pixels,
                                 self.teacher, self.text, self.text_mask, self.captions,
                                 None if self.sources is None else self.sources.numpy()))


def _rebuild_batch(latents: torch.Tensor, labels: np.ndarray, keys: np.ndarray, skipped: list,
                   pixels: torch.Tensor | None = None, teacher: torch.Tensor | None = None,
                   text: torch.Tensor | None = None, text_mask: torch.Tensor | None = None,
                   captions: list[str] | None = None, sources: np.ndarray | None = None) -> Batch:
    return Batch(latents, torch.from_numpy(labels), torch.from_numpy(keys), skipped, pixels, teacher, text, text_mask,
                 captions, None if sources is None else torch.from_numpy(sources))


class EpochStream(IterableDataset):
    """One rank's micro-batches of one epoch, read by `plan.workers` DataLoader workers (or in-process).

    Each reader is a chain of iterator -> iterator stages (webdataset's style), see `reader`; a skipped
    shard travels through them in-band, as a SkippedShard item.
    """

    def __init__(self, source: ShardSource, plan: EpochPlan, rank: int, *, seed: int, buffer: int,
                 shards_in_flight: int = 16, start_batch: int = 0, skip_bad_shards: bool = False,
                 sha256: str | None = None, exclude: frozenset[int] = frozenset(), pixels: bool = False,
                 sibling: tuple[str, Manifest] | None = None, text: tuple[str, Manifest] | None = None,
                 captions: bool = False, latent_sample: str = "sample"):
        self.source, self.plan, self.rank = source, plan, rank
        self.seed, self.buffer, self.start_batch = seed, buffer, start_batch
        self.shards_in_flight = shards_in_flight
        self.skip_bad_shards = skip_bad_shards
        self.exclude = exclude  # shards skipped as bad in an earlier epoch (--skip-bad-shards): never opened
        self.sha256 = sha256  # each shard's check against the manifest: whole | stream | None (train.preflight)
        self.pixels = pixels  # also each sample's crop, in its latent's view (Batch.pixels; sets with pixels)
        self.sibling = sibling  # (folder, manifest) of the sibling set whose tokens each batch carries (Batch.teacher)
        self.text = text  # (folder, manifest) of the text sibling set whose features each batch carries (Batch.text)
        self.captions = captions  # each batch carries its caption strings (Batch.captions; a set with captions)
        self.spec = LatentSpec.from_manifest(source.manifest, latent_sample)  # a posterior's draw or its mean
        self.pool: BatchPool | None = None  # set by make_loader before its workers start
        self.text_pool: TextPool | None = None  # likewise, with a text set: its features' slots

    def __iter__(self) -> Iterator[Batch | ReaderEvent]:
        info = get_worker_info()
        loader_worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        if workers != self.plan.workers:
            raise RuntimeError(f"plan made for {self.plan.workers} readers, DataLoader has {workers}")
        # Rotate so the DataLoader's first worker serves rank batch start_batch (see module docstring).
        return self.reader((loader_worker + self.start_batch) % workers)

    def _samples(self, slot: int) -> Iterator[Pending | TextPending | SkippedShard]:
        """Stages 1-3: the slot's samples, each with its view chosen (still in the stored dtype).

        Extraction writes shards in sorted image order, so one shard holds a few classes only. The reader
        therefore keeps up to `shards_in_flight` of its shards open and takes each next sample from a random
        one of them (seeded, so the order is reproducible); the shuffle buffer then mixes further. Shards are
        read raw (no float32 copy of every view): a sample's view depends only on (seed, epoch, key), so it
        is chosen as soon as the sample is read and the buffer holds that view alone; the noise and the
        float32 arithmetic run once per batch.
        """
        spec, base, src = self.spec, epoch_seed(self.seed, self.plan.epoch), self.source
        sib = self.sibling

        def joined(i: int, other: tuple[str, Manifest] | None) -> tuple[str, Manifest, ShardRecord] | None:
            return None if other is None else sibling_shard(other[0], other[1], i)

        shards = (read_shard(src.urls[i], src.manifest, self.skip_bad_shards, record=src.manifest.shards[i],
                             sha256=self.sha256, pixels=self.pixels or spec.from_pixels, sibling=joined(i, sib),
                             text=joined(i, self.text), captions=self.captions)
                  for i in self.plan.slot_shards[slot] if i not in self.exclude)
        for item in interleave(shards, self.shards_in_flight, interleave_seed(self.seed, self.plan.epoch, slot)):
            if isinstance(item, SkippedShard):
                yield item
            elif isinstance(item, WithText):  # stage 3: the view, and the caption of this epoch
                inner = item.sample
                p = (pending(inner.sample, spec, base, inner.teacher) if isinstance(inner, Joined)
                     else pending(inner, spec, base))
                yield text_pending(p, item, self.seed, self.plan.epoch)
            elif isinstance(item, Joined):
                yield pending(item.sample, spec, base, item.teacher)  # stage 3: the view (of both sets)
            else:
                yield pending(item, spec, base)  # stage 3: the view

    def _text_fields(self, items: list[TextPending], in_worker: bool, worker: int, pooled: bool
                     ) -> tuple[torch.Tensor | None, torch.Tensor | None, list[str] | None, int | None,
                                np.ndarray | None]:
        """(text [B, L, D] in the stored dtype zero past each caption's length, text_mask [B, L], captions, TextPool
        slot, lengths) of a micro-batch's drawn captions: the stored values copied as they are, into a TextPool slot
        when the batch's latents have one (`pooled`; then text and mask are None, the lengths travel), else into
        fresh memory (shared memory in a worker)."""
        text = mask = lengths = None
        slot: int | None = None
        if self.text is not None:
            m = self.text[1]
            rows = [it.text for it in items if it.text is not None]
            if pooled and self.text_pool is not None and (slot := self.text_pool.acquire(worker)) is not None:
                lengths = self.text_pool.write(slot, rows)
                slot = slot if lengths is not None else None
            if slot is None:
                text, mask = text_batch(rows, m.latent_shape[0], m.dtype, shared=in_worker)
        caps = [it.caption for it in items if it.caption is not None] if self.captions else None
        return text, mask, caps, slot, lengths

    def _batch(self, items: list[Any], skipped: list, scratch: Scratch, worker: int) -> Batch | PooledBatch:
        """Stage 6: one micro-batch. In a loader worker the latents are made in shared memory, so they reach
        the main process without a copy: in a free slot of the epoch's BatchPool when there is one, else in
        fresh shared memory."""
        in_worker = get_worker_info() is not None
        slot = self.pool.acquire(worker) if in_worker and self.pool is not None else None
        text = mask = caps = lengths = None
        text_slot: int | None = None
        if items and isinstance(items[0], TextPending):
            text, mask, caps, text_slot, lengths = self._text_fields(items, in_worker, worker, slot is not None)
            items = [it.item for it in items]
        labels = np.array([it.label for it in items], dtype=np.int64)
        keys = np.array([it.key for it in items], dtype=np.int64)
        pixels = None
        if self.pixels:  # decoded here, in the loader worker; [B, H, W, 3] uint8
            size = self.source.manifest.image_size
            pixels = build_pixels(items, size, shared_empty((len(items), size, size, 3), torch.uint8)
                                  if in_worker else None, self.spec.pixels_encoding)
        teacher = None
        if self.sibling is not None:  # the cached tokens, [B, N, D] float32
            c, h, w = self.sibling[1].latent_shape
            teacher = build_teacher(items, self.sibling[1].dtype, shared_empty((len(items), h * w, c))
                                    if in_worker else None)
        if slot is not None and self.pool is not None:
            build_latents(items, self.spec, self.pool.data[slot], scratch)
            return PooledBatch(slot, labels, keys, skipped, pixels, teacher, text, mask, caps, text_slot, lengths)
        out = shared_empty((len(items), *self.spec.shape)) if in_worker else None
        return Batch(build_latents(items, self.spec, out, scratch), torch.from_numpy(labels),
                     torch.from_numpy(keys), skipped, pixels, teacher, text, mask, caps)

    def reader(self, worker: int) -> Iterator[Batch | ReaderEvent]:
        """Batches of logical worker `worker` with rank batch index >= start_batch, exactly its quota: a chain
        of stages, read + interleave + view (`_samples`) -> shuffle -> micro-batches -> resume skip -> batches
        and exhaustion events, with an unreadable shard turned into error events for the rest of the quota."""
        plan = self.plan
        slot = plan.slot(self.rank, worker)
        first, quota = plan.quota(worker, upto=self.start_batch), plan.quota(worker)
        scratch = Scratch()
        exhausted = (f"rank {self.rank} reader {worker} ran out of samples in epoch {plan.epoch} "
                     "({} shard(s) skipped as unreadable)")
        stages: list[Callable[[Iterator[Any]], Iterator[Any]]] = [
            lambda items: shuffle_buffer(items, self.buffer, shuffle_seed(self.seed, plan.epoch, slot)),
            lambda items: micro_batches(items, plan.micro_batch, quota),
            lambda groups: resume_skip(groups, first),
            lambda groups: batches_and_events(groups, lambda chunk, events: self._batch(chunk, events, scratch,
                                                                                        worker), exhausted),
        ]
        stream: Iterator[Any] = self._samples(slot)
        for stage in stages:
            stream = stage(stream)
        return errors_as_events(stream, quota - first)


def make_loader(stream: EpochStream, *, num_workers: int, prefetch_factor: int, pin_memory: bool
                ) -> Iterator[Batch | ReaderEvent]:
    """An iterator over the stream's items through a DataLoader with `num_workers` workers (batches are
    formed by the readers: batch_size=None), or in this process when num_workers is 0.

    Each worker gets enough BatchPool slots for the batches it has queued (prefetch_factor), the trainer's
    share of one optimizer step (accum micro-batches round-robin over the workers), the one being consumed
    and the one being written; beyond that it falls back to fresh shared memory.
    """
    if num_workers == 0:
        return iter(stream)
    slots = prefetch_factor + 2 + math.ceil(stream.plan.accum / num_workers)
    stream.pool = pool = BatchPool(num_workers, slots, (stream.plan.micro_batch, *stream.spec.shape))
    if stream.text is not None:  # the text set's features, in its stored dtype (train/pool.py TextPool)
        m = stream.text[1]
        stream.text_pool = TextPool(num_workers, slots, stream.plan.micro_batch, longest_caption(m),
                                    int(m.latent_shape[0]), m.dtype)
    loader = DataLoader(stream, batch_size=None, collate_fn=_as_is, num_workers=num_workers,
                        prefetch_factor=prefetch_factor, pin_memory=pin_memory, persistent_workers=False,
                        in_order=True, worker_init_fn=ignore_in_worker, multiprocessing_context=worker_context(),
                        generator=torch.Generator().manual_seed(loader_seed(stream.seed, stream.plan.epoch,
                                                                            stream.rank)))
    with workers_start_blocked():  # the workers are forked here
        items = iter(loader)
    return _from_pool(items, pool, pin_memory, stream.text_pool)


def _as_is(item: Any) -> Any:
    """The workers' items are final: no default_convert (it would turn the numpy labels of a PooledBatch into
    tensors, each sent through its own shared-memory file)."""
    return item


def _from_pool(items: Iterator[Any], pool: BatchPool, pin_memory: bool,
               text_pool: TextPool | None = None) -> Iterator[Batch | ReaderEvent]:
    """Turn PooledBatches into Batches (a pinned copy for the GPU, which frees the slot at once).

    Closing this generator shuts the loader workers down at once (not whenever the DataLoader iterator
    happens to be collected): a stopped run must not leave workers waiting on their index queues."""
    try:
        for item in items:
            if isinstance(item, PooledBatch):
                latents = pool.take(item.slot)
                pixels = item.pixels.pin_memory() if pin_memory and item.pixels is not None else item.pixels
                teacher = item.teacher.pin_memory() if pin_memory and item.teacher is not None else item.teacher
                text, text_mask = item.text, item.text_mask
                if item.text_slot is not None and text_pool is not None and item.text_lengths is not None:
                    text, text_mask = text_pool.take_text(item.text_slot, item.text_lengths)
                text = text.pin_memory() if pin_memory and text is not None else text
                item = Batch(latents.pin_memory() if pin_memory else latents, torch.from_numpy(item.labels),
                             torch.from_numpy(item.keys), item.skipped, pixels, teacher, text, text_mask,
                             item.captions)
            yield item
    finally:
        shutdown = getattr(items, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()
