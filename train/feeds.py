"""Where the trainer's batches come from: one shard set (`--shards`: train.partition's plan, train.data's reader) or
a data mix (`--source` / `--mix`: train.mixplan's plan, train.mixstream's lanes), behind one interface, so the loop
asks `feed.plan(epoch, bad)` and `feed.loader(plan, start_step)` and never which it is:

- `plan(epoch, bad_shards)`: the epoch's plan (`.epoch`, `.steps`, `.samples_total`), bad shards (by their names
  in the checkpoint) left out;
- `loader(plan, start_step, prefetch_factor=, pin_memory=)`: `accum` items per step from `start_step` on, each a
  `train.data.Batch` or a `train.stages.ReaderEvent`;
- `shard_name(url)`: a skipped shard's name in logs and checkpoints;
- `step_values(items)` / `step_done(totals, epoch, step_in_epoch, plan)`: named per-step counts the pre-step
  all-reduce carries (a mix's samples per source) and what the feed does with their sums;
- `log_fields(plan)`, `log_line(plan)`: what a log interval adds to metrics.jsonl and the log.

One shard set's feed is exactly what the trainer did before mixes existed, so such a run is unchanged bit for bit.
"""
from __future__ import annotations

from typing import Any, Iterator, Mapping, Sequence

from dit_pipeline.train.data import Batch, EpochStream, make_loader
from dit_pipeline.train.partition import DataLayout, EpochPlan, plan_epoch
from dit_pipeline.train.shard_source import ShardSource
from dit_pipeline.train.stages import ReaderEvent


class SingleFeed:
    """One shard set (module docstring): train.partition's plan and train.data's EpochStream."""

    def __init__(self, source: ShardSource, *, seed: int, world: int, rank: int, workers: int, micro_batch: int,
                 accum: int, num_workers: int, buffer: int, shards_in_flight: int, skip_bad_shards: bool = False,
                 sha256: str | None = None, pixels: bool = False, sibling: Any = None, text: Any = None,
                 captions: bool = False, latent_sample: str = "sample"):
        self.source, self.seed, self.world, self.rank = source, seed, world, rank
        self.workers, self.micro_batch, self.accum, self.num_workers = workers, micro_batch, accum, num_workers
        self.buffer, self.shards_in_flight, self.skip_bad, self.sha256 = buffer, shards_in_flight, skip_bad_shards, sha256
        self.pixels, self.sibling, self.text, self.captions = pixels, sibling, text, captions
        self.latent_sample = latent_sample  # the posterior's draw or its mean (train/latents.py)

    def plan(self, epoch: int, bad: Sequence[str] = (), layout: DataLayout | None = None) -> EpochPlan:
        """Shards skipped as bad count as empty, so an epoch is a full pass over the remaining ones. `layout`: the
        layout that reads the epoch when it is not this run's (an epoch a resume at another layout began in:
        train.handover)."""
        gone = set(bad)
        sizes = [0 if rec.name in gone else rec.samples for rec in self.source.manifest.shards]
        if layout is not None:
            return plan_epoch(sizes, seed=layout.seed, epoch=epoch, world_size=layout.world_size,
                              workers=layout.workers, micro_batch=layout.micro_batch, accum=layout.accum)
        return plan_epoch(sizes, seed=self.seed, epoch=epoch, world_size=self.world, workers=self.workers,
                          micro_batch=self.micro_batch, accum=self.accum)

    def loader(self, plan: EpochPlan, start_step: int, *, bad: Sequence[str] = (), prefetch_factor: int = 2,
               pin_memory: bool = False, rank: int | None = None,
               layout: DataLayout | None = None) -> Iterator[Batch | ReaderEvent]:
        """Rank `rank`'s (this one's) batches of `plan` from `start_step` on, read as `layout` (this run's) reads
        them."""
        seed, buffer, in_flight, accum, workers = self.seed, self.buffer, self.shards_in_flight, self.accum, \
            self.num_workers
        if layout is not None:  # the saved run's readers (train.handover); 1 reader runs in process too
            seed, buffer, in_flight, accum = layout.seed, layout.shuffle_buffer, layout.shards_in_flight, layout.accum
            workers = layout.workers if layout.workers > 1 or self.num_workers else 0
        stream = EpochStream(self.source, plan, self.rank if rank is None else rank, seed=seed, buffer=buffer,
                             shards_in_flight=in_flight, start_batch=start_step * accum,
                             skip_bad_shards=self.skip_bad, sha256=self.sha256,
                             exclude=frozenset(self.source.index_of(n) for n in bad), pixels=self.pixels,
                             sibling=self.sibling, text=self.text, captions=self.captions,
                             latent_sample=self.latent_sample)
        return make_loader(stream, num_workers=workers, prefetch_factor=prefetch_factor, pin_memory=pin_memory)

    def shard_name(self, url: str) -> str:
        return self.source.manifest.shards[self.source.urls.index(url)].name

    def step_values(self, items: Sequence[Any]) -> dict[str, float]:
        return {}

    def step_done(self, totals: Mapping[str, float], epoch: int, step_in_epoch: int, plan: Any) -> None:
        return None

    def log_fields(self, plan: Any) -> dict[str, Any]:
        return {}

    def log_line(self, plan: Any) -> str | None:
        return None

    def start_notes(self, p0: EpochPlan) -> list[str]:
        """Warnings at the start: an epoch that leaves out more than 5% of the samples."""
        if p0.samples_used >= 0.95 * p0.samples_total:
            return []
        return [f"each epoch leaves out {p0.samples_total - p0.samples_used:,} of {p0.samples_total:,} samples so that "
                f"all {self.world} rank(s) x {self.workers} reader(s) yield the same number of batches (shards are "
                "read whole, and they are few or uneven for this many readers); use fewer --num-workers or re-extract "
                "with a smaller --samples-per-shard"]

    @staticmethod
    def same_stream(saved: DataLayout, current: DataLayout) -> bool:
        """Whether a checkpoint's data layout continues the very same sample stream: all of it (a shard set's
        readers are ranks x workers)."""
        return saved == current


def make_feed(prep: Any, *, rank: int = 0, teacher: Any = None, online: bool = False) -> Any:
    """The feed of a prepared run (train.preflight.Preflight): a mix's (train.mixdata.MixFeed) or one shard set's.
    `teacher`: --repa's (pixels, or a CachedTeacher's sibling set); `online`: the captions are encoded while
    training (the batches carry caption strings instead of the text set's features)."""
    from dit_pipeline.train.repa import CachedTeacher

    cfg, batch = prep.cfg, prep.batch
    cached, reg = isinstance(teacher, CachedTeacher), getattr(prep, "reg", None)
    common: dict[str, Any] = dict(rank=rank, buffer=cfg.shuffle_buffer, shards_in_flight=cfg.shards_in_flight,
                  skip_bad_shards=cfg.skip_bad_shards, sha256=prep.sha256, captions=online)
    if prep.mix is not None:
        from dit_pipeline.train.mixdata import MixFeed

        return MixFeed(prep.mix, seed=cfg.seed, lanes=prep.lanes, global_batch=batch.global_batch, accum=batch.accum,
                       world=prep.world_size, workers=int(cfg.num_workers or 0), text=prep.text is not None
                       and not online, latent_sample=cfg.latent_sample, tokens=reg is not None or cached,
                       # REPA's online teacher sees each source's pixels; --repa cached reads each source's tokens
                       pixels=teacher is not None and not cached, **common)
    return SingleFeed(prep.source, seed=cfg.seed, world=prep.world_size, workers=prep.layout.workers,
                      micro_batch=batch.micro_batch, accum=batch.accum, num_workers=int(cfg.num_workers or 0),
                      pixels=teacher is not None and not cached,
                      # a sibling set's tokens: --repa FOLDER's, or REG's class tokens (train/reg.py)
                      sibling=((teacher.folder, teacher.manifest) if cached else
                               (reg.folder, reg.manifest) if reg is not None else None),
                      text=(prep.text.folder, prep.text.manifest) if prep.text is not None and not online else None,
                      latent_sample=cfg.latent_sample, **common)


def shard_set_part(prep: Any) -> Any:
    """The checkpoint's `manifest_fingerprint` and `latent` (train.setting_parts.ShardSetPart): one shard set's, or a
    mix's (its first source's latent record, every source being in that space; its fingerprint, whose sources the
    mix's own part compares by name)."""
    from dit_pipeline.train.setting_parts import ShardSetPart

    if prep.mix is None:
        return ShardSetPart.of(prep.source.manifest, prep.source.fingerprint)
    part = ShardSetPart.of(prep.source.manifest, prep.mix.fingerprint)
    part.mixed = True
    return part


def mix_part(prep: Any, feed: Any = None, state: Any = None) -> Any:
    """A mix's checkpoint part (train.mixpart.MixPart; None for one shard set): its record, and (in a run) the
    feed's counts and the progress a --new-mix moves."""
    if prep.mix is None:
        return None
    from dit_pipeline.train.mixpart import MixPart, MixState

    counts = feed.state if feed is not None else MixState([o.name for o in prep.mix.sources])
    return MixPart(dict(prep.cfg.data_mix or prep.mix.record(prep.lanes)), counts, state, bool(prep.cfg.new_mix))
