"""The loader's iterator -> iterator stages (train.data): events (a skipped shard) travel in-band."""
from dit_pipeline.train.data import SkippedShard, interleave, micro_batches, shuffle_buffer

BAD = SkippedShard("shard-1.tar", "truncated")


def test_interleave_ends_a_stream_at_its_event_and_keeps_the_others():
    streams = iter([iter([1, 2, BAD]), iter([10, 11, 12])])
    out = list(interleave(streams, in_flight=2, seed=0))
    assert sorted(x for x in out if not isinstance(x, SkippedShard)) == [1, 2, 10, 11, 12]
    assert out.count(BAD) == 1 and out.index(BAD) > max(out.index(1), out.index(2))
    assert list(interleave(iter([iter([1, 2]), iter([3])]), in_flight=1, seed=5)) == [1, 2, 3]  # one at a time


def test_shuffle_buffer_passes_events_on_at_once_and_shuffles_only_items():
    items = [0, 1, 2, BAD, 3, 4, 5]
    out = list(shuffle_buffer(iter(items), size=3, seed=1))
    assert out[0] == BAD  # the buffer holds the first 3 items when the event arrives: it is out first
    assert [x for x in out if x != BAD] == list(shuffle_buffer(iter([0, 1, 2, 3, 4, 5]), size=3, seed=1))


def test_micro_batches_attach_events_to_the_next_group_and_keep_the_count():
    groups = list(micro_batches(iter([1, BAD, 2, 3, 4, 5]), micro=2, quota=4))
    assert groups == [([1, 2], [BAD]), ([3, 4], []), (None, []), (None, [])]
    assert list(micro_batches(iter([BAD]), micro=2, quota=2)) == [(None, [BAD]), (None, [])]
