"""The pure data-partition functions over many (ranks x workers x shards x epochs x batch) combinations:
every sample at most once per epoch, identical batch counts on every rank, maximal use, determinism."""
from __future__ import annotations

import itertools
import random

import pytest

from dit_pipeline.common.errors import ConfigError
from dit_pipeline.train.partition import (DataLayout, assign_shards, check_readers, map_position, plan_epoch, rank_capacity,
                             shard_order, stable_permutation, total_steps, worker_quota)


def test_stable_permutation_is_pinned():
    # Pinned values: the shard order of a run must not change between library versions, or a resumed run
    # would read a different stream.
    assert stable_permutation(10, 5) == [1, 5, 9, 7, 4, 8, 6, 0, 3, 2]
    assert stable_permutation(1, 3) == [0] and stable_permutation(0, 3) == []
    for n in (2, 7, 100):
        assert sorted(stable_permutation(n, 11)) == list(range(n))


def test_shard_order_depends_on_seed_and_epoch():
    base = shard_order(50, seed=0, epoch=0)
    assert shard_order(50, seed=0, epoch=0) == base
    assert shard_order(50, seed=0, epoch=1) != base
    assert shard_order(50, seed=1, epoch=0) != base


@pytest.mark.parametrize("m,w", [(0, 3), (1, 3), (5, 3), (6, 3), (7, 1), (10, 4)])
def test_worker_quota_partitions_round_robin(m, w):
    quotas = [worker_quota(m, k, w) for k in range(w)]
    assert sum(quotas) == m
    assert quotas == [sum(1 for i in range(m) if i % w == k) for k in range(w)]


def test_assign_shards_balances_and_is_complete():
    sizes = [10, 10, 10, 10, 3, 10, 10]
    slots = assign_shards(sizes, range(len(sizes)), 3)
    assert sorted(s for slot in slots for s in slot) == list(range(7))
    loads = [sum(sizes[s] for s in slot) for slot in slots]
    assert max(loads) - min(loads) <= 10
    # each shard goes to the reader with the fewest samples so far (ties: lowest reader)
    assert slots == [[0, 3], [1, 4, 6], [2, 5]] and loads == [20, 23, 20]


def _simulate(plan, sizes):
    """Consume each rank's batches as the DataLoader does (batch i from worker i % W); returns, per rank,
    the list of (shard, index-in-shard) sample ids used, and checks every worker's quota fits its shards."""
    per_rank = []
    for r in range(plan.world_size):
        pools = []
        for w in range(plan.workers):
            slot = plan.slot_shards[plan.slot(r, w)]
            pools.append([(s, j) for s in slot for j in range(sizes[s])])
        used, taken = [], [0] * plan.workers
        for i in range(plan.micro_batches):
            w = i % plan.workers
            batch = pools[w][taken[w]:taken[w] + plan.micro_batch]
            assert len(batch) == plan.micro_batch, "a worker ran out before its quota"
            taken[w] += plan.micro_batch
            used += batch
        assert taken == [plan.quota(w) * plan.micro_batch for w in range(plan.workers)]
        per_rank.append(used)
    return per_rank


def test_exactly_once_and_equal_counts_over_many_combinations():
    rng = random.Random(1234)
    checked = 0
    for world, workers, n_shards, micro, accum in itertools.product((1, 2, 3, 4), (1, 2, 3), (4, 7, 12, 25),
                                                                    (1, 3, 4), (1, 2)):
        if n_shards < world * workers:
            with pytest.raises(ConfigError):
                plan_epoch([5] * n_shards, seed=0, epoch=0, world_size=world, workers=workers,
                           micro_batch=micro, accum=accum)
            continue
        sizes = [rng.choice((5, 8, 8, 8, 13)) for _ in range(n_shards)]
        for epoch in range(3):
            plan = plan_epoch(sizes, seed=7, epoch=epoch, world_size=world, workers=workers, micro_batch=micro,
                              accum=accum)
            assert plan.micro_batches % accum == 0
            assert sorted(s for slot in plan.slot_shards for s in slot) == list(range(n_shards))
            used = _simulate(plan, sizes)
            flat = [x for rank in used for x in rank]
            assert len(flat) == len(set(flat)), "a sample is used twice in one epoch"
            assert {len(u) for u in used} == {plan.micro_batches * micro}, "ranks got different counts"
            assert plan.samples_used == len(flat) and plan.samples_total == sum(sizes)
            # maximal: one more optimizer step would not fit on some rank
            caps = [rank_capacity(plan.slot_samples[r * plan.workers:(r + 1) * plan.workers], micro)
                    for r in range(world)]
            assert plan.micro_batches + accum > min(caps)
            # deterministic
            assert plan == plan_epoch(sizes, seed=7, epoch=epoch, world_size=world, workers=workers,
                                      micro_batch=micro, accum=accum)
            checked += 1
    assert checked > 300


def test_epochs_reorder_shards():
    sizes = [10] * 12
    plans = [plan_epoch(sizes, seed=0, epoch=e, world_size=2, workers=2, micro_batch=2, accum=1)
             for e in range(3)]
    assert len({p.slot_shards for p in plans}) == 3
    assert total_steps(sizes, 3, seed=0, world_size=2, workers=2, micro_batch=2, accum=1) == \
        sum(p.steps for p in plans)


def test_too_few_shards_names_the_numbers():
    with pytest.raises(ConfigError) as e:
        check_readers(3, world_size=2, workers=4)
    msg = str(e.value)
    assert "3 shard(s)" in msg and "2 rank(s) x 4 loader worker(s) = 8 readers" in msg
    assert "--num-workers 1" in msg
    with pytest.raises(ConfigError, match="use at most 1 ranks"):
        check_readers(1, world_size=2, workers=1)
    check_readers(8, world_size=2, workers=4)  # enough: no error


def test_map_position():
    a = DataLayout(seed=0, world_size=2, workers=2, micro_batch=4, accum=1, shuffle_buffer=10, shards_in_flight=4)
    b = DataLayout(seed=0, world_size=4, workers=2, micro_batch=2, accum=1, shuffle_buffer=10, shards_in_flight=4)
    same = map_position(3, 5, a, a, steps_in_epoch=10)
    assert (same.epoch, same.step_in_epoch, same.exact) == (3, 5, True)
    moved = map_position(3, 5, a, b, steps_in_epoch=10)
    assert (moved.epoch, moved.step_in_epoch, moved.exact) == (3, 5, False)
    past = map_position(3, 12, a, b, steps_in_epoch=10)
    assert (past.epoch, past.step_in_epoch) == (4, 0)
    end = map_position(3, 10, a, a, steps_in_epoch=10)
    assert (end.epoch, end.step_in_epoch, end.exact) == (4, 0, True)
