"""The loader's iterator -> iterator stages (webdataset's style), each a small generator: `interleave` (several
shards at once), `shuffle_buffer`, `micro_batches` (a reader's quota of groups), `resume_skip` (the groups before
the resume point replayed, not batched), `batches_and_events` and `errors_as_events` (what the trainer takes:
batches, or typed events that keep the number of items fixed). Events travel in-band, through the stages:
`SkippedShard` (a shard left out with --skip-bad-shards) and `ReaderEvent` ("exhausted", "error"). Randomness
comes from seeds (train.partition), so each stage's output is a function of its input and its seed.
train/data.py composes them into one reader (`EpochStream.reader`).
"""
from __future__ import annotations

from typing import Any, Callable, Iterator, NamedTuple, TypeVar

import numpy as np

from dit_pipeline.shards import ShardError

T = TypeVar("T")
_RAW_BLOCK = 4096


class _Picker:
    """Uniform random indices from PCG64's raw stream (stable across numpy versions), in blocks."""

    def __init__(self, seed: int):
        self._bits = np.random.PCG64(seed)
        self._raw: Iterator[int] = iter(())

    def __call__(self, n: int) -> int:
        r = next(self._raw, None)
        if r is None:
            self._raw = iter(self._bits.random_raw(_RAW_BLOCK).tolist())
            r = next(self._raw)
        return r % n  # modulo bias below 2**-40 for any buffer size in use


class SkippedShard(NamedTuple):
    """In-band event (--skip-bad-shards): a shard turned out unreadable and was left out. It is the last item
    its shard's stream yields; the stages pass it on at once, and the batcher attaches it to the next batch."""

    url: str
    problem: str


def interleave(streams: Iterator[Iterator[T]], in_flight: int, seed: int) -> Iterator[T | SkippedShard]:
    """Stage 2: read up to `in_flight` streams at once, each next item from a seeded random one of them,
    refilling from `streams` as they end (a SkippedShard ends its stream)."""
    pick = _Picker(seed)
    active: list[Iterator[T]] = []

    def refill() -> None:
        for stream in streams:
            active.append(stream)
            if len(active) >= in_flight:
                return

    refill()
    try:
        while active:
            j = pick(len(active))
            item = next(active[j], _END)
            if item is _END:
                active.pop(j)
                refill()
                continue
            if isinstance(item, SkippedShard):  # the last item of its stream
                _close(active.pop(j))
                refill()
            yield item
    finally:
        for stream in active:
            _close(stream)


def _close(stream: Iterator[Any]) -> None:
    """Close a generator (its open shard file) early; other iterators hold nothing to close."""
    close = getattr(stream, "close", None)
    if close is not None:
        close()


def shuffle_buffer(items: Iterator[T], size: int, seed: int) -> Iterator[T]:
    """Stage 4: reservoir-style shuffle: hold `size` items, emit a random one as each new item arrives, then
    drain. The order is a function of (input order, size, seed) only; size 1 keeps the input order. Events
    (SkippedShard) are not shuffled: they pass on as they arrive."""
    pick = _Picker(seed)
    buf: list[T] = []
    for item in items:
        if isinstance(item, SkippedShard):
            yield item
            continue
        if len(buf) < size:
            buf.append(item)
            continue
        j = pick(size)
        out, buf[j] = buf[j], item
        yield out
    while buf:
        j = pick(len(buf))
        buf[j], buf[-1] = buf[-1], buf[j]
        yield buf.pop()


def micro_batches(items: Iterator[T | SkippedShard], micro: int, quota: int
                  ) -> Iterator[tuple[list[T] | None, list[SkippedShard]]]:
    """Stage 5: `quota` groups of `micro` items, each with the events met since the previous group; a group
    is None once the items ran out (one None per missing group, so the count stays fixed)."""
    events: list[SkippedShard] = []
    for b in range(quota):
        chunk: list[T] = []
        while len(chunk) < micro and (item := next(items, _END)) is not _END:
            if isinstance(item, SkippedShard):
                events.append(item)
            else:
                chunk.append(item)
        if len(chunk) < micro:
            for _ in range(b, quota):
                yield None, events
                events = []
            return
        yield chunk, events
        events = []


_END: Any = object()  # the end of a stream, for next(it, _END)


class ReaderEvent(NamedTuple):
    kind: str                  # "exhausted" (out of samples before the quota) | "error" (unreadable shard)
    message: str
    skipped: list


def resume_skip(groups: Iterator[tuple[list[T] | None, list[SkippedShard]]], first: int
                ) -> Iterator[tuple[list[T] | None, list[SkippedShard]]]:
    """Stage: the groups from index `first` on. Earlier ones were consumed before the resume point: replayed
    (so the reading state is where it was), never batched, no noise drawn; their events ride on with the next."""
    carried: list[SkippedShard] = []
    for b, (chunk, events) in enumerate(groups):
        if b < first:
            carried += events
            continue
        yield chunk, carried + events
        carried = []


def batches_and_events(groups: Iterator[tuple[list[T] | None, list[SkippedShard]]],
                       batch: Callable[[list[T], list], Any], exhausted: str) -> Iterator[Any]:
    """Stage: a batch of each full group; for each missing one (the items ran out) a ReaderEvent
    "exhausted", so the number of items stays fixed. `exhausted`: its message, formatted with the number of
    shards skipped by then."""
    skipped = 0
    message = None
    for chunk, events in groups:
        skipped += len(events)
        if chunk is None:
            message = message or exhausted.format(skipped)
            yield ReaderEvent("exhausted", message, events)
        else:
            yield batch(chunk, events)


def errors_as_events(items: Iterator[Any], count: int) -> Iterator[Any]:
    """Stage: `items`, until a ShardError (an unreadable shard without --skip-bad-shards); then one
    ReaderEvent "error" for each of the `count` items still due (at least one), so the item count stays fixed:
    the trainer takes a step's micro-batches before it looks at them. (No SkippedShard events can be pending
    then: with --skip-bad-shards a bad shard is an event, never an error.)"""
    done = 0
    try:
        for item in items:
            done += 1
            yield item
    except ShardError as e:
        for _ in range(max(count - done, 1)):
            yield ReaderEvent("error", str(e), [])


