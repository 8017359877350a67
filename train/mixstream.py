"""A data mix's lanes: each rank's lanes of visits (train/mixplan.py) read through the loader's stages into pieces,
and a step's pieces joined into the rank's micro-batches (issue 46; docs/data-mix.md). train/mixdata.py's MixFeed
runs them, in process or in DataLoader workers.

Each lane is a chain of the stages of train/stages.py, as a reader of one shard set is in train/data.py: its visits
read one by one (`read_shard`: the sha256 check, --skip-bad-shards; with the source's text set joined, or its caption
strings kept for online encoding) and filtered to the visit's keys (held-out keys never pass) -> the view, the
posterior noise seed and the caption of each sample, from (seed, epoch, source, pass, key) -> `interleave` (several
visits at once, seeded) -> `shuffle_buffer` (seeded per lane) -> pieces of G / lanes samples, exactly the epoch's
steps of them -> `resume_skip` -> batches and in-band events. Rank r reads the lanes of its block
(train.mixplan.rank_lanes); a loader worker w reads the rank's lanes i with i % W == w and yields, step by step, a
piece of each of them in lane order, so that the DataLoader's round robin over its workers hands the rank its lanes'
pieces in lane order; the main process joins a step's pieces (its slice of the global batch) and cuts them into
the step's micro-batches (`regroup`).

So the global batch of step k is lane 0's piece k, then lane 1's, ..., whatever the world size and the workers:
a run resumed at another world size (one that divides the lanes) continues the same global sequence.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator, NamedTuple, Sequence, cast

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from dit_pipeline.shards import LatentSample, ShardError, key_index
from dit_pipeline.train.data import Batch
from dit_pipeline.train.latents import (LatentSpec, Pending, Scratch, build_latents, build_pixels, build_teacher,
                                       mix_seed, pending)
from dit_pipeline.train.mix import OpenMix, OpenSource
from dit_pipeline.train.mixdraws import caption_seed, held_out, lane_seeds, sample_base
from dit_pipeline.train.mixplan import MixEpoch, Visit
from dit_pipeline.train.pool import BatchPool, PooledBatch, shared_empty, text_batch
from dit_pipeline.train.shard_samples import Joined, WithText, read_shard
from dit_pipeline.train.stages import (ReaderEvent, SkippedShard, batches_and_events, errors_as_events, interleave,
                                       micro_batches, resume_skip, shuffle_buffer)


class MixItem(NamedTuple):
    """A sample between reading and batching: its view (Pending), its source, and its drawn caption's stored
    features [L, D] (cached text) and/or string (online)."""

    item: Pending
    source: int
    text: np.ndarray | None
    caption: str | None


def caption_choice(o: OpenSource, seed: int, key: int, count: int, url: str) -> int:
    """Which of a sample's `count` captions it uses: the source's fixed index, or one drawn from (seed, key) (seed:
    train.mixdraws.caption_seed of the epoch, source and pass), the same for cached and online features."""
    fixed = o.spec.caption_index
    if fixed is not None:
        if fixed >= count:
            raise ShardError(url, f"{key:09d}", f"caption={fixed} asked and the sample has {count} caption(s)")
        return fixed
    return mix_seed(seed, key) % count if count > 1 else 0


class MixStream(IterableDataset):
    """One rank's pieces of one epoch of a mix: its lanes, read by `workers` DataLoader workers (0: in process)."""

    def __init__(self, mix: OpenMix, plan: MixEpoch, lanes: Sequence[int], *, seed: int, buffer: int,
                 shards_in_flight: int, start_step: int = 0, workers: int = 0, skip_bad_shards: bool = False,
                 sha256: str | None = None, text: bool = False, captions: bool = False,
                 latent_sample: str = "sample", tokens: bool = False, pixels: bool = False):
        self.mix, self.plan, self.lanes = mix, plan, list(lanes)
        # each source's cached tokens joined (Batch.teacher): REG's class tokens [B, 1, z] (train/reg.py) or REPA's
        # teacher tokens [B, h * w, c] (train/repa.py), whichever the source names (train.mix.OpenSource.tokens)
        self.tokens = tokens
        self.pixels = pixels  # REPA's online teacher: each sample's crop in its latent's view (Batch.pixels)
        self.seed, self.buffer, self.in_flight, self.start = seed, buffer, shards_in_flight, start_step
        self.workers, self.skip_bad, self.sha256 = max(1, workers), skip_bad_shards, sha256
        self.text, self.captions = text, captions  # cached features joined / caption strings kept (online)
        self.specs = [LatentSpec.from_manifest(o.manifest, latent_sample) for o in mix.sources]
        self.pool: BatchPool | None = None  # pieces' output slots, set by MixFeed.loader before its workers start
        # sources whose stored arrays become latents alike are built together (the usual case: one extraction setup)
        keys = [(sp.store, sp.shape, sp.norm.key(), sp.pixels_encoding, o.manifest.dtype)
                for sp, o in zip(self.specs, mix.sources)]
        self.build_group = [keys.index(k) for k in keys]

    def __iter__(self) -> Iterator[Batch | PooledBatch | ReaderEvent]:
        info = get_worker_info()
        w, n = (info.id, info.num_workers) if info is not None else (0, 1)
        if n != self.workers:
            raise RuntimeError(f"mix stream made for {self.workers} workers, DataLoader has {n}")
        mine = [self.lane(lane, w) for i, lane in enumerate(self.lanes) if i % n == w]
        for _ in range(self.start, self.plan.steps):
            for it in mine:
                yield next(it)

    # -- one lane ---------------------------------------------------------------------------------------------
    def lane(self, lane: int, worker: int = 0) -> Iterator[Batch | PooledBatch | ReaderEvent]:
        """Lane `lane`'s pieces from step `start` on, exactly steps - start items (module docstring)."""
        plan, scratch = self.plan, Scratch()
        il, sh = lane_seeds(self.seed, plan.epoch, lane)
        exhausted = f"lane {lane} ran out of samples in epoch {plan.epoch} ({{}} shard(s) skipped as unreadable)"
        in_worker = get_worker_info() is not None
        stages: list[Callable[[Iterator[Any]], Iterator[Any]]] = [
            lambda streams: interleave(streams, self.in_flight, il),
            lambda items: shuffle_buffer(items, self.buffer, sh),
            lambda items: micro_batches(items, plan.piece, plan.steps),
            lambda groups: resume_skip(groups, self.start),
            lambda groups: batches_and_events(groups, lambda chunk, ev: self.piece(chunk, ev, scratch, in_worker,
                                                                                    worker), exhausted),
        ]
        stream: Iterator[Any] = (self.visit(v) for v in plan.lanes[lane])
        for stage in stages:
            stream = stage(stream)
        return errors_as_events(stream, plan.steps - self.start)

    def visit(self, v: Visit) -> Iterator[MixItem | SkippedShard]:
        """One visit's samples (its keys only), each with its view, noise seed and caption of this pass."""
        o = self.mix.sources[v.source]
        m, spec = o.manifest, self.specs[v.source]
        rec, url = m.shards[v.shard], o.source.urls[v.shard]
        text = o.text_shard(v.shard) if self.text else None
        tokens = o.tokens_shard(v.shard) if self.tokens else None  # its cached tokens, read in lockstep
        strings = self.captions and o.captions is None  # a template source makes its captions from the label
        keep = frozenset(v.keys) if v.keys is not None else None
        holdout = float(o.spec.holdout)
        base = sample_base(self.seed, self.plan.epoch, v.source, v.copy)
        cseed = caption_seed(self.seed, self.plan.epoch, v.source, v.copy)
        for it in read_shard(url, m, self.skip_bad, record=rec, sha256=self.sha256,
                             pixels=spec.from_pixels or self.pixels, sibling=tokens, text=text, captions=strings):
            if isinstance(it, SkippedShard):
                yield it
                continue
            joined = it if isinstance(it, WithText) else None
            inner = joined.sample if joined is not None else it
            token = inner.teacher if isinstance(inner, Joined) else None
            sample = cast(LatentSample, inner.sample if isinstance(inner, Joined) else inner)
            k = key_index(sample.key)
            if (keep is not None and k not in keep) or (keep is None and holdout > 0 and held_out(k, holdout)):
                continue
            p = pending(sample, spec, base, token)  # the token of the latent's own view
            feats, cap = None, None
            if joined is not None and joined.text is not None:
                i = caption_choice(o, cseed, k, len(joined.text.lengths), url)
                feats = np.array(joined.text.caption(i))
            if self.captions:
                caps = list(o.captions[sample.label:sample.label + 1]) if o.captions is not None \
                    else list(sample.captions or [])
                cap = caps[caption_choice(o, cseed, k, len(caps), url)]
            yield MixItem(p, v.source, feats, cap)

    def piece(self, items: list[MixItem], skipped: list, scratch: Scratch, in_worker: bool, worker: int = 0
              ) -> Batch | PooledBatch:
        """One lane's samples of one step as a Batch: in a worker, in a free slot of the epoch's BatchPool when there
        is one (train.pool: no fresh shared memory per piece), else in fresh shared memory; sources that make their
        latents differently (store, dtype) are built each with its own LatentSpec."""
        n = len(items)
        shape = (n, *self.specs[items[0].source].shape)
        slot = self.pool.acquire(worker) if in_worker and self.pool is not None else None
        if slot is not None:
            assert self.pool is not None
            latents = self.pool.data[slot]
        else:
            latents = shared_empty(shape) if in_worker else torch.empty(shape)
        srcs = np.array([it.source for it in items], dtype=np.int64)
        groups = np.array([self.build_group[s] for s in srcs], dtype=np.int64)
        for g in np.unique(groups):
            rows = np.nonzero(groups == g)[0]
            chosen = [items[i].item for i in rows]
            if len(rows) == n:
                build_latents(chosen, self.specs[g], latents, scratch)
            else:
                latents[torch.from_numpy(rows)] = build_latents(chosen, self.specs[g], None, scratch)
        text = mask = None
        if self.text:
            text, mask = self._text(items, in_worker)
        caps = [str(it.caption) for it in items] if self.captions else None
        labels = np.array([it.item.label for it in items], dtype=np.int64)
        keys = np.array([it.item.key for it in items], dtype=np.int64)
        pixels = self._pixels(items, srcs, in_worker) if self.pixels else None
        tokens = None
        if self.tokens:  # [n, h * w, c] float32 (REG's: [n, 1, z]), in shared memory from a worker
            sibling = self.mix.sources[items[0].source].tokens()
            assert sibling is not None, "train.mix.open_mix gives every source its tokens"
            c, h, w = sibling[1].latent_shape
            tokens = build_teacher([it.item for it in items], sibling[1].dtype,
                                   shared_empty((n, h * w, c)) if in_worker else None)
        if slot is not None:
            return PooledBatch(slot, labels, keys, skipped, pixels, tokens, text, mask, caps, sources=srcs)
        return Batch(latents, torch.from_numpy(labels), torch.from_numpy(keys), skipped, pixels, tokens, text, mask,
                     caps, torch.from_numpy(srcs))

    def _pixels(self, items: list[MixItem], srcs: np.ndarray, in_worker: bool) -> torch.Tensor:
        """[n, H, W, 3] uint8: each sample's crop in its latent's view, decoded as its source stores them (one
        latent space: one image size)."""
        size = int(self.mix.sources[items[0].source].manifest.image_size)
        out = shared_empty((len(items), size, size, 3), torch.uint8) if in_worker else \
            torch.empty((len(items), size, size, 3), dtype=torch.uint8)
        for s in np.unique(srcs):
            rows = np.nonzero(srcs == s)[0]
            out[torch.from_numpy(rows)] = build_pixels([items[i].item for i in rows], size, None,
                                                       self.specs[int(s)].pixels_encoding)
        return out

    def _text(self, items: list[MixItem], in_worker: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(text [B, L, D] in the text sets' stored dtype, zero past each caption's length, mask): the stored values
        copied as they are, never widened (as one shard set's loader gives them: train.pool.text_batch)."""
        rows = [it.text for it in items]
        assert all(r is not None for r in rows), "every source of a cached-text mix has a text set"
        first = self.mix.sources[items[0].source].text
        assert first is not None
        return text_batch(rows, int(rows[0].shape[1]), first.dtype, shared=in_worker)  # type: ignore[arg-type,union-attr]


# ----------------------------------------------------------------------------------------------------------
# Pieces -> a rank's micro-batches

def _pad_cat(parts: list[torch.Tensor], masks: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    lmax = max(p.shape[1] for p in parts)
    text = torch.zeros((sum(p.shape[0] for p in parts), lmax, parts[0].shape[2]), dtype=parts[0].dtype)
    mask = torch.zeros((text.shape[0], lmax), dtype=torch.bool)
    row = 0
    for p, m in zip(parts, masks):
        text[row:row + p.shape[0], :p.shape[1]] = p
        mask[row:row + p.shape[0], :p.shape[1]] = m
        row += p.shape[0]
    return text, mask


def join_pieces(pieces: Sequence[Batch], accum: int, pin: bool = False, out: BatchPool | None = None) -> list[Batch]:
    """A rank's pieces of one step (its lanes in order) -> its `accum` micro-batches, in order: views of one
    tensor, made in a free slot of `out` when there is one (train.pool: no fresh pages per step), or pinned for
    the GPU."""
    slot = out.acquire(0) if out is not None and not pin else None
    if slot is not None:
        assert out is not None
        torch.cat([p.latents for p in pieces], out=out.data[slot])
        latents = out.take(slot)
    else:
        latents = torch.cat([p.latents for p in pieces])
    if pin:
        latents = latents.pin_memory()
    labels, keys = torch.cat([p.labels for p in pieces]), torch.cat([p.keys for p in pieces])
    tokens = torch.cat([p.teacher for p in pieces if p.teacher is not None]) if pieces[0].teacher is not None \
        else None  # cached tokens: REG's class tokens or REPA's teacher tokens
    pixels = torch.cat([p.pixels for p in pieces if p.pixels is not None]) if pieces[0].pixels is not None \
        else None  # REPA's crops
    if pin:
        tokens, pixels = (None if x is None else x.pin_memory() for x in (tokens, pixels))
    sources = torch.cat([p.sources for p in pieces if p.sources is not None])
    text = mask = None
    if pieces[0].text is not None:
        text, mask = _pad_cat([p.text for p in pieces if p.text is not None],
                              [p.text_mask for p in pieces if p.text_mask is not None])
    caps = [c for p in pieces for c in (p.captions or [])] if pieces[0].captions is not None else None
    skipped = [s for p in pieces for s in p.skipped]
    micro = latents.shape[0] // accum
    batches = []
    for i in range(accum):
        sl = slice(i * micro, (i + 1) * micro)
        t, tm = (None, None) if text is None or mask is None else (text[sl], mask[sl])
        if t is not None and tm is not None and tm.shape[1]:  # trim the padding this micro-batch does not use
            used = int(tm.any(0).nonzero().max()) + 1 if tm.any() else 0
            t, tm = t[:, :used], tm[:, :used]
        batches.append(Batch(latents[sl], labels[sl], keys[sl], skipped if i == 0 else [],
                             None if pixels is None else pixels[sl], None if tokens is None else tokens[sl], t, tm,
                             caps[sl] if caps is not None else None, sources[sl]))
    return batches


def regroup(pieces: Iterator[Batch | ReaderEvent], per_step: int, accum: int, pin: bool = False,
            out: BatchPool | None = None) -> Iterator[Batch | ReaderEvent]:
    """`per_step` pieces per step -> `accum` items per step: its micro-batches, or (a lane ran out or could not
    be read) its first event `accum` times, carrying every skipped shard once, so the item count stays fixed."""
    while True:
        step = []
        for _ in range(per_step):
            item = next(pieces, None)
            if item is None:
                return
            step.append(item)
        events = [p for p in step if isinstance(p, ReaderEvent)]
        if events:
            first = events[0]
            skipped = [s for p in step for s in p.skipped]
            yield ReaderEvent(first.kind, first.message, skipped)
            for _ in range(accum - 1):
                yield ReaderEvent(first.kind, first.message, [])
            continue
        yield from join_pieces([p for p in step if isinstance(p, Batch)], accum, pin, out)


__all__ = ["MixStream", "join_pieces", "regroup"]
