"""A data mix's feed (train/feeds.py: the interface of one shard set's): `MixFeed` plans each epoch
(train/mixplan.py), reads the rank's lanes (train/mixstream.py's MixStream, in process or by DataLoader workers)
into its micro-batches, and keeps the mix's accounting (issue 46; docs/data-mix.md).

What the run shows: every step's samples per source are all-reduced with the pre-step flags (`MixFeed.step_values`),
kept per epoch and for the run (`train.mixpart.MixState`, in the checkpoint's `mix`), written to metrics.jsonl
(`seen_<source>`, `share_<source>` against `asked_<source>`), logged, and a source exhausted early in an epoch is
warned about.
"""
from __future__ import annotations

from typing import Any, Iterator, Mapping, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader

from dit_pipeline.common.log import get_logger
from dit_pipeline.common.workers import worker_context
from dit_pipeline.train.data import Batch
from dit_pipeline.train.mix import OpenMix
from dit_pipeline.train.mixdraws import loader_seed
from dit_pipeline.train.mixpart import MixState
from dit_pipeline.train.mixplan import MixEpoch, lane_workers, plan_mix_epoch, rank_lanes
from dit_pipeline.train.mixstream import MixStream, regroup
from dit_pipeline.train.pool import BatchPool, PooledBatch
from dit_pipeline.train.signals import ignore_in_worker, workers_start_blocked
from dit_pipeline.train.stages import ReaderEvent

EARLY = 0.95  # a source whose epoch share is all seen before this fraction of the epoch is "exhausted early"


def _unpooled(items: Iterator[Any], pool: BatchPool) -> Iterator[Any]:
    """A worker's PooledBatches as Batches over their pool slots (the slot is free again once the step's pieces are
    joined and dropped)."""
    for item in items:
        if isinstance(item, PooledBatch):
            item = Batch(pool.take(item.slot), torch.from_numpy(item.labels), torch.from_numpy(item.keys), item.skipped,
                         item.pixels, item.teacher, item.text, item.text_mask, item.captions,
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
                 sha256: str | None = None, text: bool = False, captions: bool = False, latent_sample: str = "sample",
                 tokens: bool = False, pixels: bool = False):
        self.mix, self.seed, self.lanes, self.global_batch, self.accum = mix, seed, lanes, global_batch, accum
        self.latent_sample = latent_sample  # every source's posterior drawn or taken at its mean (train/latents.py)
        self.world, self.rank, self.buffer, self.in_flight = world, rank, buffer, shards_in_flight
        self.skip_bad, self.sha256, self.text, self.captions = skip_bad_shards, sha256, text, captions
        self.tokens = tokens  # REG's class tokens or REPA's cached teacher tokens of each source (Batch.teacher)
        self.pixels = pixels  # REPA: each sample's crop in its latent's view (Batch.pixels)
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
                           latent_sample=self.latent_sample, tokens=self.tokens, pixels=self.pixels)
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


__all__ = ["MixFeed"]
