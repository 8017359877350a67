"""The loader's iterator -> iterator stages (train.stages): events (a skipped shard) travel in-band."""
from dit_pipeline.train.stages import SkippedShard, interleave, micro_batches, shuffle_buffer

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


def test_resume_skip_replays_groups_and_carries_their_events():
    from dit_pipeline.train.stages import resume_skip

    a, b = SkippedShard("a", "bad"), SkippedShard("b", "bad")
    groups = [([1, 2], [a]), ([3, 4], []), ([5, 6], [b]), (None, [])]
    assert list(resume_skip(iter(groups), 0)) == groups
    assert list(resume_skip(iter(groups), 2)) == [([5, 6], [a, b]), (None, [])]  # a rides on with the next
    assert list(resume_skip(iter(groups), 4)) == []


def test_missing_groups_become_exhaustion_events_and_errors_fill_the_quota():
    from dit_pipeline.shards import ShardError
    from dit_pipeline.train.stages import ReaderEvent, batches_and_events, errors_as_events

    a = SkippedShard("a", "bad")
    out = list(batches_and_events(iter([([1], []), (None, [a]), (None, [])]), lambda c, e: ("batch", c, e),
                                  "out of samples ({} skipped)"))
    assert out == [("batch", [1], []), ReaderEvent("exhausted", "out of samples (1 skipped)", [a]),
                   ReaderEvent("exhausted", "out of samples (1 skipped)", [])]

    def failing(n):
        yield from range(n)
        raise ShardError("u", None, "truncated")

    got = list(errors_as_events(failing(2), 5))
    assert got[:2] == [0, 1] and [e.kind for e in got[2:]] == ["error"] * 3 and "truncated" in got[2].message
    assert [e.kind for e in list(errors_as_events(failing(5), 5))[5:]] == ["error"]  # at least one, so it is seen
    assert list(errors_as_events(iter(range(3)), 3)) == [0, 1, 2]
