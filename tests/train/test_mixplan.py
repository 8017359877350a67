"""The mix's epoch plan as pure functions of integers (train/mixplan.py, its draws train/mixdraws.py), over many
combinations: the samples each source gives per epoch follow MosaicML Streaming's proportion / repeat / choose rule
(the expected counts worked out here by hand, not by the module), each pass over a source is exact, and the plan
does not depend on anything but its inputs."""
from __future__ import annotations

import itertools
from collections import Counter

import pytest

from dit_pipeline.common.errors import UserError
import numpy as np

from dit_pipeline.train.mixdraws import choose_subset, held_out, held_out_mask
from dit_pipeline.train.mixplan import (ShardKeys, SourceShape, Weight, choose_per_source, default_lanes, lane_workers,
                                        lanes_problem, plan_mix_epoch, rank_lanes, weights_problems)


def source(name, shard_sizes, *, first=0, sps=None, weight=Weight(), holdout=0.0, bad=()):
    sps = sps or max(shard_sizes)
    shards = tuple(ShardKeys(n, first + i * sps if n else None, first + i * sps + n - 1 if n else None)
                   for i, n in enumerate(shard_sizes))
    return SourceShape(name, shards, weight, holdout, frozenset(), frozenset(bad))


def epoch_multiset(plan, sources):
    """(source, key) -> how often the epoch's visits read it."""
    out: Counter = Counter()
    for lane in plan.lanes:
        for v in lane:
            keys = v.keys if v.keys is not None else sources[v.source].keys_of(v.shard).tolist()
            assert len(keys) == v.samples
            out.update((v.source, int(k)) for k in keys)
    return out


@pytest.mark.parametrize("sizes, weights, epoch_size, expected", [
    # Streaming's docs ("Mixing Datasets"): A 100 and B 200 samples, proportions 0.25 / 0.75 -> 75 + 225 of 300
    ((100, 200), (Weight(proportion=0.25), Weight(proportion=0.75)), None, [75, 225]),
    # the same with epoch_size 400 -> 100 + 300
    ((100, 200), (Weight(proportion=0.25), Weight(proportion=0.75)), 400, [100, 300]),
    # proportions normalised: 2 and 6 are 0.25 and 0.75
    ((100, 200), (Weight(proportion=2), Weight(proportion=6)), None, [75, 225]),
    # 0.7 / 0.3 of 100: 70 and 30 (not 69 by 0.7's binary rounding)
    ((60, 40), (Weight(proportion=0.7), Weight(proportion=0.3)), None, [70, 30]),
    # repeat 3 and 0.25, choose 250, none
    ((100, 200), (Weight(repeat=3), Weight(repeat=0.25)), None, [300, 50]),
    ((100, 200), (Weight(choose=250), Weight()), None, [250, 200]),
    ((10, 20, 30), (Weight(), Weight(repeat=2), Weight(choose=7)), None, [10, 40, 7]),
    # no weights with an epoch size: shares in proportion to the sizes (100/300 and 200/300 of 150)
    ((100, 200), (Weight(), Weight()), 150, [50, 100]),
])
def test_samples_per_source_follow_streamings_rule(sizes, weights, epoch_size, expected):
    assert choose_per_source(sizes, weights, epoch_size, seed=0) == expected


def test_the_shortfall_of_proportions_goes_one_each_to_seeded_sources():
    # 3 equal thirds of 100: floor gives 33 each, the 1 missing goes to one source, the same every call
    for seed in range(20):
        got = choose_per_source((50, 50, 50), [Weight(proportion=1)] * 3, 100, seed)
        assert sum(got) == 100 and sorted(got) == [33, 33, 34]
        assert got == choose_per_source((50, 50, 50), [Weight(proportion=1)] * 3, 100, seed)
    # a source with proportion 0 never receives the shortfall
    for seed in range(20):
        assert choose_per_source((50, 50, 50), [Weight(proportion=1), Weight(proportion=1), Weight(proportion=0)],
                                 101, seed)[2] == 0


def test_weight_refusals():
    names = ["a", "b"]
    assert weights_problems([Weight(proportion=0.5), Weight(repeat=2)], names, None) == [
        "proportion (relative) and repeat/choose (absolute) weights do not mix: give every source a proportion, or "
        "none of them (MosaicML Streaming's rule)"]
    assert weights_problems([Weight(proportion=0.5, repeat=2), Weight()], names, None)[0] == \
        "source a: give at most one of proportion, repeat, choose (got proportion, repeat)"
    assert "source b: repeat must be a number >= 0, got -1" in weights_problems([Weight(), Weight(repeat=-1)], names,
                                                                                  None)
    assert "source a: choose is a number of samples, got 2.5" in weights_problems([Weight(choose=2.5), Weight()],
                                                                                   names, None)
    assert weights_problems([Weight(repeat=2), Weight()], names, 100) == [
        "epoch_size sets the length of an epoch of proportions; with repeat/choose the epoch is their sum: drop "
        "epoch_size"]


def _splitmix(base, i):
    """SplitMix64's output number i + 1 from `base` (Steele, Lea & Flood 2014), written out in Python integers."""
    m = (1 << 64) - 1
    z = (base + (i + 1) * 0x9E3779B97F4A7C15) & m
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    return z ^ (z >> 31)


@pytest.mark.parametrize("n, seed", list(itertools.product((1, 2, 7, 50, 333), (0, 1, 12345, 2**62 + 5))))
def test_choose_subset_takes_the_indices_of_the_smallest_hashes(n, seed):
    by_hash = sorted(range(n), key=lambda i: _splitmix(seed, i))
    for r in (0, 1, n // 2, n):
        assert choose_subset(n, r, seed).tolist() == sorted(by_hash[:r])


def test_the_vectorized_hold_out_is_the_scalar_one():
    keys = np.arange(0, 50000, 7, dtype=np.int64)
    for f in (0.0, 0.01, 0.3):
        assert held_out_mask(keys, f).tolist() == [held_out(int(k), f) for k in keys]


def test_held_out_keys_are_a_fixed_fraction_independent_of_anything_else():
    keys = range(20000)
    picked = [k for k in keys if held_out(k, 0.1)]
    assert 0.09 < len(picked) / 20000 < 0.11
    assert picked == [k for k in keys if held_out(k, 0.1)]          # a function of the key alone
    assert set(picked) <= {k for k in keys if held_out(k, 0.2)}     # a larger fraction holds out a superset
    assert not any(held_out(k, 0.0) for k in keys) and all(held_out(k, 1.0) for k in keys)


@pytest.mark.parametrize("lanes, seed, epoch", list(itertools.product((1, 2, 4, 8), (0, 3), (0, 1, 5))))
def test_an_epoch_reads_each_source_exactly_as_its_weight_says(lanes, seed, epoch):
    """Three sources with repeat 2, proportionless 1 and choose: every key of the repeat-2 source exactly twice, of
    the plain one once, and the chosen source's count exactly, drawn without replacement."""
    a = source("a", (16, 16, 16, 12), weight=Weight(repeat=2))
    b = source("b", (10, 10), first=1000, weight=Weight())
    c = source("c", (8, 8, 8), first=5000, weight=Weight(choose=13))
    plan = plan_mix_epoch([a, b, c], seed=seed, epoch=epoch, lanes=lanes, global_batch=8)
    got = epoch_multiset(plan, [a, b, c])
    assert {k: n for (s, k), n in got.items() if s == 0} == {k: 2 for i in range(4) for k in a.keys_of(i).tolist()}
    assert {k: n for (s, k), n in got.items() if s == 1} == {k: 1 for k in range(1000, 1010)} | \
        {k: 1 for k in range(1010, 1020)}
    chosen = [k for (s, k), n in got.items() if s == 2]
    assert len(chosen) == 13 and all(got[(2, k)] == 1 for k in chosen)
    assert plan.asked == (120, 20, 13) and sum(plan.lane_samples) == 153
    assert plan.full == (2, 1, 0) and plan.partial == (0, 0, 13)
    assert max(plan.lane_samples) - min(plan.lane_samples) <= 16  # dealt by load: within one shard of each other
    assert plan == plan_mix_epoch([a, b, c], seed=seed, epoch=epoch, lanes=lanes, global_batch=8)  # pure


def test_proportions_over_sources_larger_and_smaller_than_their_share():
    """0.7 / 0.3 of an epoch of 100 from sources of 40 and 60: the first repeats (1 full pass + 30 drawn), the
    second gives half of itself, a different half each epoch."""
    a = source("a", (20, 20), weight=Weight(proportion=0.7))
    b = source("b", (30, 30), first=100, weight=Weight(proportion=0.3))
    picks = []
    for epoch in range(3):
        plan = plan_mix_epoch([a, b], seed=0, epoch=epoch, lanes=2, global_batch=10)
        got = epoch_multiset(plan, [a, b])
        assert plan.asked == (70, 30) and plan.full == (1, 0) and plan.partial == (30, 30)
        assert sum(n for (s, _), n in got.items() if s == 0) == 70
        assert sorted(Counter(n for (s, _), n in got.items() if s == 0).items()) == [(1, 10), (2, 30)]
        assert sum(n for (s, _), n in got.items() if s == 1) == 30
        picks.append(frozenset(k for (s, k) in got if s == 1))
    assert len(set(picks)) == 3  # drawn anew each epoch


def test_held_out_keys_and_bad_shards_are_never_in_a_visit():
    a = source("a", (50, 50, 50), holdout=0.2, bad=(1,))
    plan = plan_mix_epoch([a], seed=0, epoch=0, lanes=2, global_batch=4)
    keys = {k for (_, k) in epoch_multiset(plan, [a])}
    assert keys == {k for k in list(range(0, 50)) + list(range(100, 150)) if not held_out(k, 0.2)}
    assert plan.available == (len(keys),)


def test_each_source_is_spread_over_the_epoch():
    """A source of 2 shards beside one of 40: its visits sit near 1/4 and 3/4 of the epoch, not both at the start."""
    small = source("small", (10, 10))
    big = source("big", (10,) * 40, first=1000)
    for seed in range(10):
        plan = plan_mix_epoch([small, big], seed=seed, epoch=0, lanes=1, global_batch=2)
        order = [v.source for v in plan.lanes[0]]
        at = [i / len(order) for i, s in enumerate(order) if s == 0]
        assert len(at) == 2 and at[0] < 0.5 <= at[1] + 0.03


def test_a_source_with_nothing_left_is_refused_by_name():
    a = source("a", (4, 4), bad=(0, 1), weight=Weight(proportion=1))
    b = source("b", (4, 4), first=100, weight=Weight(proportion=1))
    with pytest.raises(UserError, match="source a: the mix takes 4 samples per epoch from it and it has none"):
        plan_mix_epoch([a, b], seed=0, epoch=0, lanes=1, global_batch=4)


def test_steps_are_what_every_lane_can_supply():
    a = source("a", (16, 16, 16, 12))
    for lanes, batch in ((1, 8), (2, 8), (4, 8), (3, 9)):
        plan = plan_mix_epoch([a], seed=0, epoch=0, lanes=lanes, global_batch=batch)
        assert plan.piece == batch // lanes
        assert plan.steps == min(n // plan.piece for n in plan.lane_samples)
        assert plan.samples_used == plan.steps * batch <= 60


@pytest.mark.parametrize("world, workers, batch", list(itertools.product((1, 2, 4, 8), (0, 1, 3, 4), (8, 16, 24))))
def test_lanes_ranks_and_workers(world, workers, batch):
    if batch % world:
        return
    lanes = default_lanes(world, workers, batch)
    assert lanes % world == 0 and batch % lanes == 0 and lanes_problem(lanes, world, batch) is None
    covered = [lane for r in range(world) for lane in rank_lanes(lanes, world, r)]
    assert covered == list(range(lanes))  # contiguous blocks, in rank order
    m = lanes // world
    w = lane_workers(m, max(1, workers))
    assert m % w == 0 and 1 <= w <= max(1, workers)


def test_lanes_refuse_a_world_size_that_cannot_share_them():
    assert lanes_problem(4, 3, 12) == ("the mix is read by 4 lanes (fixed when it started, so the sample sequence "
                                       "never changes), which 3 rank(s) cannot share evenly: use a world size among "
                                       "[1, 2, 4]")
