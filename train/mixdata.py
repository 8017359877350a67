"""A data mix's loader: lanes of visits (train/mixplan.py) read through the loader's stages, assembled into each
rank's micro-batches, and the mix's accounting (issue 46; docs/data-mix.md).

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

What the run shows: every step's samples per source are all-reduced with the pre-step flags (`MixFeed.step_values`),
kept per epoch and for the run (`train.mixpart.MixState`, in the checkpoint's `mix`), written to metrics.jsonl (`seen_<source>`,
`share_<source>` against `asked_<source>`), logged, and a source exhausted early in an epoch is warned about.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, NamedTuple, Sequence, cast

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from dit_pipeline.common.log import get_logger
from dit_pipeline.common.workers import worker_context
from dit_pipeline.shards import LatentSample, ShardError, key_index
from dit_pipeline.train.data import Batch
from dit_pipeline.train.latents import LatentSpec, Pending, Scratch, build_latents, mix_seed, pending
from dit_pipeline.train.mix import OpenMix, OpenSource
from dit_pipeline.train.mixpart import MixState
from dit_pipeline.train.mixplan import (MixEpoch, Visit, caption_seed, held_out, lane_seeds, lane_workers, loader_seed,
                                        plan_mix_epoch, rank_lanes, sample_base)
from dit_pipeline.train.pool import BatchPool, PooledBatch, shared_empty, text_batch
from dit_pipeline.train.shard_samples import WithText, read_shard
from dit_pipeline.train.signals import ignore_in_worker, workers_start_blocked
from dit_pipeline.train.stages import (ReaderEvent, SkippedShard, batches_and_events, errors_as_events, interleave,
                                       micro_batches, resume_skip, shuffle_buffer)

EARLY = 0.95  # a source whose epoch share is all seen before this fraction of the epoch is "exhausted early"


class MixItem(NamedTuple):
    """A sample between reading and batching: its view (Pending), its source, and its drawn caption's stored
    features [L, D] (cached text) and/or string (online)."""

    item: Pending
    source: int
    text: np.ndarray | None
    caption: str | None


def caption_choice(o: OpenSource, seed: int, key: int, count: int, url: str) -> int:
    """Which of a sample's `count` captions it uses: the source's fixed index, or one drawn from (seed, key) (seed:
    train.mixplan.caption_seed of the epoch, source and pass), the same for cached and online features."""
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
                 latent_sample: str = "sample"):
        self.mix, self.plan, self.lanes = mix, plan, list(lanes)
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
        text = None
        if self.text and o.text is not None:
            text = (str(Path(str(o.spec.text)).expanduser() / o.text.shards[v.shard].name), o.text,
                    o.text.shards[v.shard])
        strings = self.captions and o.captions is None  # a template source makes its captions from the label
        keep = frozenset(v.keys) if v.keys is not None else None
        holdout = float(o.spec.holdout)
        base = sample_base(self.seed, self.plan.epoch, v.source, v.copy)
        cseed = caption_seed(self.seed, self.plan.epoch, v.source, v.copy)
        for it in read_shard(url, m, self.skip_bad, record=rec, sha256=self.sha256, pixels=spec.from_pixels,
                             text=text, captions=strings):
            if isinstance(it, SkippedShard):
                yield it
                continue
            joined = it if isinstance(it, WithText) else None
            sample = cast(LatentSample, joined.sample if joined is not None else it)  # no REPA sibling in a mix
            k = key_index(sample.key)
            if (keep is not None and k not in keep) or (keep is None and holdout > 0 and held_out(k, holdout)):
                continue
            p = pending(sample, spec, base)
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
        if slot is not None:
            return PooledBatch(slot, labels, keys, skipped, None, None, text, mask, caps, sources=srcs)
        return Batch(latents, torch.from_numpy(labels), torch.from_numpy(keys), skipped, None, None, text, mask, caps,
                     torch.from_numpy(srcs))

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
        batches.append(Batch(latents[sl], labels[sl], keys[sl], skipped if i == 0 else [], None, None, t, tm,
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


def _unpooled(items: Iterator[Any], pool: BatchPool) -> Iterator[Any]:
    """A worker's PooledBatches as Batches over their pool slots (the slot is free again once the step's pieces are
    joined and dropped)."""
    for item in items:
        if isinstance(item, PooledBatch):
            item = Batch(pool.take(item.slot), torch.from_numpy(item.labels), torch.from_numpy(item.keys), item.skipped,
                         None, None, item.text, item.text_mask, item.captions,
                         None if item.sources is None else torch.from_numpy(item.sources))
        yield item


def _closing(items: Iterator[Any]) -> Iterator[Any]:
    """Closing this generator shuts the loader workers down at once (as train.data's loader does)."""
    try:
        yield from items
    finally:
        shutdown = getattr(items, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()


class MixFeed:
    """The trainer's data for a mix (train/feeds.py: the same interface as one shard set's)."""

    def __init__(self, mix: OpenMix, *, seed: int, lanes: int, global_batch: int, accum: int, world: int,
                 rank: int, workers: int, buffer: int, shards_in_flight: int, skip_bad_shards: bool = False,
                 sha256: str | None = None, text: bool = False, captions: bool = False, latent_sample: str = "sample"):
        self.mix, self.seed, self.lanes, self.global_batch, self.accum = mix, seed, lanes, global_batch, accum
        self.latent_sample = latent_sample  # every source's posterior drawn or taken at its mean (train/latents.py)
        self.world, self.rank, self.buffer, self.in_flight = world, rank, buffer, shards_in_flight
        self.skip_bad, self.sha256, self.text, self.captions = skip_bad_shards, sha256, text, captions
        self.mine = rank_lanes(lanes, world, rank)
        self.workers = lane_workers(len(self.mine), workers) if workers > 0 else 0
        self.state = MixState([s.name for s in mix.sources])
        self._plans: dict[tuple[int, tuple[str, ...]], MixEpoch] = {}
        self.log = get_logger()

    @property
    def names(self) -> list[str]:
        return self.state.names

    def plan(self, epoch: int, bad: Sequence[str] = (), layout: Any = None) -> MixEpoch:
        assert layout is None, "a mix resumes its own global sequence at any world size (same_stream)"
        key = (epoch, tuple(sorted(bad)))
        if key not in self._plans:
            self._plans = {k: v for k, v in self._plans.items() if k[0] >= epoch - 1}
            self._plans[key] = plan_mix_epoch(self.mix.shapes(bad), seed=self.seed, epoch=epoch, lanes=self.lanes,
                                              global_batch=self.global_batch, epoch_size=self.mix.spec.epoch_size)
        return self._plans[key]

    @staticmethod
    def same_stream(saved: Any, current: Any) -> bool:
        """A mix's sample sequence depends on the seed, the readers' buffers and the lanes (its part checks those),
        not on the world size, the loader workers or the micro-batch: a resume on other ranks continues it."""
        return all(getattr(saved, k) == getattr(current, k) for k in ("seed", "shuffle_buffer", "shards_in_flight"))

    def loader(self, plan: MixEpoch, start_step: int, *, bad: Sequence[str] = (), prefetch_factor: int = 2,
               pin_memory: bool = False, rank: int | None = None,
               layout: Any = None) -> Iterator[Batch | ReaderEvent]:
        assert rank is None and layout is None, "a mix resumes its own global sequence at any world size"
        stream = MixStream(self.mix, plan, self.mine, seed=self.seed, buffer=self.buffer,
                           shards_in_flight=self.in_flight, start_step=start_step, workers=self.workers,
                           skip_bad_shards=self.skip_bad, sha256=self.sha256, text=self.text, captions=self.captions,
                           latent_sample=self.latent_sample)
        shape = tuple(stream.specs[0].shape)
        # the step's joined batch: a few reused slots (the trainer holds one step's batches while the next arrives)
        out = BatchPool(1, 4, (plan.piece * len(self.mine), *shape))
        if self.workers == 0:
            return regroup(iter(stream), len(self.mine), self.accum, pin_memory, out)
        # each worker's pieces: what it has queued (prefetch), its share of one step, the one being joined and written
        stream.pool = pool = BatchPool(self.workers, prefetch_factor + 2 + len(self.mine) // self.workers,
                                       (plan.piece, *shape))
        loader = DataLoader(stream, batch_size=None, collate_fn=_as_is, num_workers=self.workers,
                            prefetch_factor=prefetch_factor, pin_memory=False, persistent_workers=False, in_order=True,
                            worker_init_fn=ignore_in_worker, multiprocessing_context=worker_context(),
                            generator=torch.Generator().manual_seed(loader_seed(self.seed, plan.epoch, self.rank)))
        with workers_start_blocked():
            items = iter(loader)
        return _closing(regroup(_unpooled(_closing(items), pool), len(self.mine), self.accum, pin_memory, out))

    def shard_name(self, url: str) -> str:
        """A shard's name in logs and the checkpoint: "source/shard-000003.tar"."""
        for o in self.mix.sources:
            if url in o.source.urls:
                return f"{o.name}/{o.manifest.shards[o.source.urls.index(url)].name}"
        return url

    # -- accounting ---------------------------------------------------------------------------------------------
    def step_values(self, items: Sequence[Any]) -> dict[str, float]:
        """This rank's samples per source in a step's items (summed over ranks by the pre-step all-reduce)."""
        counts = [0] * len(self.names)
        for it in items:
            src = getattr(it, "sources", None)
            if src is not None:
                for s, c in zip(*np.unique(src.numpy(), return_counts=True)):
                    counts[int(s)] += int(c)
        return {f"mix_{i}": float(c) for i, c in enumerate(counts)}

    def step_done(self, totals: Mapping[str, float], epoch: int, step_in_epoch: int, plan: MixEpoch) -> None:
        """Count a step's samples (all ranks); warn once per source and epoch when its share of the epoch is all
        seen before EARLY of the epoch (Streaming's repeat rule: it then gives no more samples this epoch)."""
        st = self.state
        if epoch != st.epoch:
            st.epoch, st.seen_epoch = epoch, [0] * len(self.names)
        for i in range(len(self.names)):
            n = int(totals.get(f"mix_{i}", 0))
            st.seen[i] += n
            st.seen_epoch[i] += n
            asked = plan.asked[i]
            if n and asked and st.seen_epoch[i] >= asked and step_in_epoch < EARLY * plan.steps \
                    and (epoch, i) not in st.warned:
                st.warned.add((epoch, i))
                self.log.warning(
                    f"source {self.names[i]} is exhausted at step {step_in_epoch} of {plan.steps} of epoch {epoch}: "
                    f"all {asked:,} of its samples this epoch are seen (by the mix's repeat rule, floor(asked / "
                    f"held) full passes plus a drawn part: {plan.full[i]} x {plan.available[i]:,} + "
                    f"{plan.partial[i]:,}), so the rest of the epoch draws from the other sources only and the "
                    "realised proportions drift from the asked ones")

    def asked_shares(self, plan: MixEpoch) -> list[float]:
        total = sum(plan.asked) or 1
        return [a / total for a in plan.asked]

    def log_fields(self, plan: MixEpoch) -> dict[str, Any]:
        """metrics.jsonl values: per source its samples seen in the run, its realised and its asked share."""
        st, total = self.state, max(1, sum(self.state.seen))
        out: dict[str, Any] = {}
        for name, n, asked in zip(self.names, st.seen, self.asked_shares(plan)):
            out[f"seen_{name}"] = n
            out[f"share_{name}"] = n / total
            out[f"asked_{name}"] = asked
        return out

    def log_line(self, plan: MixEpoch) -> str:
        st, total = self.state, max(1, sum(self.state.seen))
        parts = [f"{name} {n:,} ({n / total:.1%}, asked {a:.1%})"
                 for name, n, a in zip(self.names, st.seen, self.asked_shares(plan))]
        return "mix   samples seen: " + ", ".join(parts)

    def plan_lines(self, plan: MixEpoch) -> list[str]:
        """The plan's lines on the mix (train.plan.format_plan) and the repeat rule of each source."""
        lines = [f"  mix         {len(self.names)} sources, {self.lanes} lanes of {plan.piece} samples per step "
                 f"(rank {self.rank} reads lanes {self.mine.start}-{self.mine.stop - 1} with "
                 f"{max(1, self.workers)} reader process(es){'' if self.workers else ', in process'})"]
        shares = self.asked_shares(plan)
        for i, o in enumerate(self.mix.sources):
            held = plan.available[i]
            rule = (f"{plan.full[i]} full pass(es)" + (f" + {plan.partial[i]:,} drawn anew each epoch"
                                                       if plan.partial[i] else ""))
            lines.append(f"    {o.name:<12} {o.spec.shards}: {held:,} samples, {o.spec.weight.describe()} -> "
                         f"{plan.asked[i]:,} per epoch ({shares[i]:.1%}; {rule})"
                         + (f"; holds out {o.spec.holdout:g} of its keys" if o.spec.holdout else ""))
        lines.append(f"  epoch 0     {plan.steps:,} optimizer steps; {plan.samples_used:,} of {plan.samples_total:,} "
                     f"samples used ({plan.samples_total - plan.samples_used:,} left out so every lane gives the same "
                     "number of pieces)")
        return lines

    def start_notes(self, plan: MixEpoch) -> list[str]:
        """Warnings at the start: an epoch that leaves out more than 5% of its samples, and each source the mix
        asks more of than it holds (it repeats within each epoch)."""
        out = []
        if plan.samples_used < 0.95 * plan.samples_total:
            out.append(f"each epoch of the mix leaves out {plan.samples_total - plan.samples_used:,} of "
                       f"{plan.samples_total:,} samples so that its {self.lanes} lanes give the same number of pieces "
                       "(a lane reads whole shards, and they are few or uneven for this many lanes); a new run with "
                       "fewer --mix-lanes or smaller shards leaves out less")
        for i, o in enumerate(self.mix.sources):
            held, asked = plan.available[i], plan.asked[i]
            if held and asked > held:
                out.append(f"source {o.name} holds {held:,} samples and the mix takes {asked:,} per epoch "
                           f"({o.spec.weight.describe()}): it is exhausted after {held / asked:.0%} of each epoch "
                           f"and repeats (MosaicML Streaming's repeat rule: {plan.full[i]} full pass(es) over all its "
                           f"samples + {plan.partial[i]:,} drawn without replacement, anew each epoch), so each of its "
                           f"samples is seen {asked / held:.2f} times per epoch on average")
        return out


def _as_is(item: Any) -> Any:
    return item


__all__ = ["MixFeed", "MixStream", "join_pieces", "regroup"]
