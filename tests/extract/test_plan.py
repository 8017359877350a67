"""The work split is a pure function of integers: every image exactly once, every shard one rank."""
from __future__ import annotations

import itertools

import pytest

from dit_pipeline.extract import plan


@pytest.mark.parametrize("n, s, world", list(itertools.product([1, 2, 7, 10, 97, 1000, 1001], [1, 3, 10, 256],
                                                                [1, 2, 3, 8, 64])))
def test_every_index_exactly_once_and_each_shard_one_rank(n, s, world):
    total = plan.num_shards(n, s)
    assert (total - 1) * s < n <= total * s
    owner = {}
    seen = []
    for rank in range(world):
        for shard in plan.shards_of_rank(total, rank, world):
            assert shard not in owner
            owner[shard] = rank
            span = plan.shard_span(shard, s, n)
            assert span.start == shard * s and len(span) <= s
            for batch in plan.batches_of(span, 4):
                assert batch.start >= span.start and batch.stop <= span.stop  # never crosses a shard
                seen.extend(batch)
    assert sorted(owner) == list(range(total))
    assert sorted(seen) == list(range(n))
    assert len(seen) == n


def test_shard_content_does_not_depend_on_world_size():
    n, s = 1001, 10
    by_world = {}
    for world in (1, 2, 3, 7):
        by_world[world] = {shard: list(plan.shard_span(shard, s, n))
                           for rank in range(world) for shard in plan.shards_of_rank(plan.num_shards(n, s), rank,
                                                                                      world)}
    assert all(v == by_world[1] for v in by_world.values())


def test_rank_order_and_batches():
    assert list(plan.shards_of_rank(10, 1, 3)) == [1, 4, 7]
    assert list(plan.shards_of_rank(2, 3, 4)) == []          # more ranks than shards: nothing to do
    assert plan.batches_of(range(10, 17), 3) == [range(10, 13), range(13, 16), range(16, 17)]
    assert plan.shard_span(3, 10, 35) == range(30, 35)
    with pytest.raises(ValueError):
        plan.shard_span(4, 10, 35)
    with pytest.raises(ValueError):
        plan.shards_of_rank(10, 3, 3)
    with pytest.raises(ValueError):
        plan.num_shards(10, 0)
    with pytest.raises(ValueError):
        plan.batches_of(range(3), 0)


def test_default_samples_per_shard():
    # SD-VAE at 256 px: 2 views x [4, 32, 32] float16, mean + std: 16 KiB + 128 B per array -> 3 tar blocks
    # of header + 33 blocks of data per array, plus .cls and .json.
    per = plan.bytes_per_sample(2, 2, (4, 32, 32), 2)
    assert per == 2 * (512 + 512 * 33) + 2048
    s = plan.default_samples_per_shard(per)
    assert s % 100 == 0 and s * per <= plan.TARGET_SHARD_BYTES < (s + 100) * per
    assert s == 7200  # ImageNet: 178 shards of ~253 MiB
    assert plan.default_samples_per_shard(10**9) == 1
    assert plan.default_samples_per_shard(plan.TARGET_SHARD_BYTES // 42) == 42
