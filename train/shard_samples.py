"""One shard's samples as a trainer's reader takes them (stages 1 and 3 of train.data's chain).

`read_shard` (stage 1) reads one shard through `shards.iter_shard` (raw, stored dtype; its sha256 checked against
the manifest unless --no-verify-shards); with --skip-bad-shards an unreadable or mismatching shard ends in a
`SkippedShard` event instead of an error. With a sibling set of the same images (`--repa FOLDER`,
shards/siblings.py) each sample is joined with its sibling's stored tokens (`Joined`); with a text sibling set
(issue 37, shards/siblings.read_text_sibling) with its text shard's sample (`WithText`). Siblings hold the same
keys in the same order, so they are read in lockstep; a key that differs anyway is a ShardError of the sibling.

Text: with a text set one of each sample's captions' stored features is kept; with `captions=True` the caption
strings themselves travel (for a trainer that encodes online with common.text_encoders). Which caption a sample
uses is `caption_index(seed, epoch, key, K)`: a pure function of (seed, epoch, key), so cached and online runs
draw the same caption; `text_pending` keeps only that one (stage 3, beside the view train.latents chooses).
"""
from __future__ import annotations

from typing import Any, Iterator, NamedTuple

import numpy as np

from dit_pipeline.common.seeding import derive_seed
from dit_pipeline.shards import (LatentSample, Manifest, ShardError, ShardRecord, TextSample, iter_shard,
                                 iter_text_shard)
from dit_pipeline.train.latents import Pending, mix_seed
from dit_pipeline.train.stages import SkippedShard


class Joined(NamedTuple):
    """A sample with its sibling set's stored latent (all views) of the same key (shards/siblings.py)."""

    sample: LatentSample
    teacher: np.ndarray


def join_sibling(samples: Iterator[LatentSample], url: str, manifest: Manifest,
                 record: ShardRecord) -> Iterator[Joined]:
    """Each sample of a shard with the sibling shard's sample of the same key: the siblings hold the same keys
    in the same order (checked on the manifests before training), so they are read in lockstep; a key that
    differs anyway is a ShardError of the sibling shard."""
    other = iter_shard(url, manifest, raw=True, record=record)
    try:
        for s in samples:
            t = next(other, None)
            if t is None or t.key != s.key:
                raise ShardError(url, s.key, f"the sibling shard has {'no sample' if t is None else t.key} here")
            assert t.latent is not None, "a sibling set of tokens stores latents"
            yield Joined(s, t.latent)
    finally:
        other.close()


class WithText(NamedTuple):
    """A sample with its text (issue 37): the text sibling's sample of the same key, and/or its caption strings."""

    sample: LatentSample | Joined
    text: TextSample | None


def join_text(samples: Iterator[LatentSample | Joined], url: str, manifest: Manifest,
              record: ShardRecord) -> Iterator[WithText]:
    """Each sample with the text sibling shard's sample of the same key, read in lockstep (as join_sibling);
    a caption count that differs from the sample's is a ShardError of the text shard."""
    other = iter_text_shard(url, manifest, record=record)
    try:
        for s in samples:
            base = s.sample if isinstance(s, Joined) else s
            t = next(other, None)
            if t is None or t.key != base.key:
                raise ShardError(url, base.key, f"the text shard has {'no sample' if t is None else t.key} here")
            if base.captions is not None and len(base.captions) != len(t.lengths):
                raise ShardError(url, base.key, f"{len(t.lengths)} captions' features for {len(base.captions)} "
                                 "captions")
            yield WithText(s, t)
    finally:
        other.close()


def read_shard(url: str, manifest: Manifest, skip_bad: bool, *, record: ShardRecord | None = None,
               sha256: str | None = None, pixels: bool = False,
               sibling: tuple[str, Manifest, ShardRecord] | None = None,
               text: tuple[str, Manifest, ShardRecord] | None = None, captions: bool = False
               ) -> Iterator[LatentSample | Joined | WithText | SkippedShard]:
    """Stage 1: one shard's samples (raw, stored dtype); on a ShardError a SkippedShard when `skip_bad`.

    sha256 ("whole" | "stream" | None): shards.iter_shard's check of the shard's bytes against `record` (its
    manifest record): "whole" before any sample is yielded, "stream" at the shard's end (a mismatch is a
    ShardError like any other, naming the shard)."""
    samples = iter_shard(url, manifest, raw=True, record=record, sha256=sha256, pixels="bytes" if pixels else None,
                         captions=captions)
    try:
        stream: Iterator[Any] = samples if sibling is None else join_sibling(samples, *sibling)
        if text is not None:
            stream = join_text(stream, *text)
        elif captions:
            stream = (WithText(s, None) for s in stream)
        yield from stream
    except ShardError as e:
        if not skip_bad:
            raise
        yield SkippedShard(url, str(e))
    finally:
        samples.close()


# The seed stream of the caption a sample uses in an epoch (its own, so that it is independent of the view and the
# noise, which use common.seeding.STREAM_SAMPLE).
STREAM_CAPTION = 37


def caption_index(seed: int, epoch: int, key: int, captions: int) -> int:
    """Which of a sample's `captions` captions it uses in `epoch`: a pure function of (seed, epoch, key), the same
    for the cached features and the online captions (contract 2 of issue 37)."""
    if captions <= 1:
        return 0
    return mix_seed(derive_seed(seed, STREAM_CAPTION, epoch), key) % captions


class TextPending(NamedTuple):
    """A sample between reading and batching with its text: the drawn caption's stored features [L, D] (a text
    sibling set) and/or its string (captions=True)."""

    item: Pending
    text: np.ndarray | None
    caption: str | None


def text_pending(item: Pending, joined: WithText, seed: int, epoch: int) -> TextPending:
    """Draw the sample's caption for `epoch` (caption_index) and keep only it."""
    base = joined.sample.sample if isinstance(joined.sample, Joined) else joined.sample
    count = len(joined.text.lengths) if joined.text is not None else len(base.captions or ())
    i = caption_index(seed, epoch, item.key, count)
    feats = np.array(joined.text.caption(i)) if joined.text is not None else None
    return TextPending(item, feats, base.captions[i] if base.captions is not None else None)
