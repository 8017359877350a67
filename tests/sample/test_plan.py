"""sample/plan.py: noise seeds, drawn classes and the rank split are pure functions of integers."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from dit_pipeline.common.seeding import STREAM_SAMPLING, derive_seed
from dit_pipeline.sample import plan


def test_noise_seed_is_derive_seed_of_seed_stream_index():
    assert plan.noise_seed(7, 123) == derive_seed(7, STREAM_SAMPLING, 123)
    assert plan.noise_seed(7, 123) != plan.noise_seed(7, 124) != plan.noise_seed(8, 124)


def test_generators_depend_only_on_seed_and_index():
    a = plan.noise_generators(3, [5, 6, 7])
    b = plan.noise_generators(3, [7, 5])
    draws_a = [torch.randn(4, generator=g) for g in a]
    draws_b = [torch.randn(4, generator=g) for g in b]
    assert torch.equal(draws_a[2], draws_b[0]) and torch.equal(draws_a[0], draws_b[1])
    assert not torch.equal(draws_a[0], draws_a[1])


def test_drawn_labels_are_pure_uniform_and_independent_of_noise_stream():
    labels = plan.class_labels(num_samples=20000, seed=1, num_classes=10)
    assert labels.dtype == np.int64 and labels.shape == (20000,)
    assert np.array_equal(labels[100:110], [plan.drawn_label(1, i, 10) for i in range(100, 110)])
    counts = np.bincount(labels, minlength=10)
    # 20000 draws over 10 classes: expected 2000 each, sd ~42; 6 sd bounds
    assert counts.min() > 1750 and counts.max() < 2250
    assert not np.array_equal(labels, plan.class_labels(num_samples=20000, seed=2, num_classes=10))
    # the label stream is not the noise stream: label seed differs from the noise seed of the same index
    assert derive_seed(1, STREAM_SAMPLING, 5, plan.LABEL_SUBSTREAM) != plan.noise_seed(1, 5)


def test_given_labels_repeat_cyclically():
    assert plan.class_labels(num_samples=5, seed=0, num_classes=1000, given=[207, 360]).tolist() == \
        [207, 360, 207, 360, 207]
    assert plan.class_labels(num_samples=2, seed=0, num_classes=1000, given=[1, 2, 3]).tolist() == [1, 2]


@pytest.mark.parametrize("n,batch,world", list(itertools.product([0, 1, 7, 50, 101], [1, 3, 32], [1, 2, 3, 8])))
def test_rank_batches_cover_every_index_once(n, batch, world):
    remaining = list(range(n))
    per_rank = [plan.rank_batches(remaining, batch, r, world) for r in range(world)]
    flat = [i for batches in per_rank for b in batches for i in b]
    assert sorted(flat) == remaining
    counts = [sum(len(b) for b in batches) for batches in per_rank]
    assert max(counts) - min(counts) <= batch  # ranks are within one batch of each other
    for batches in per_rank:
        assert all(1 <= len(b) <= batch for b in batches)


@pytest.mark.determinism
@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_batches_are_fixed_global_chunks(world):
    """The same batches (tensor shapes) for any number of ranks, and after a kill that kept whole chunks."""
    whole = [list(range(k, min(k + 4, 30))) for k in range(0, 30, 4)]
    got = [b for r in range(world) for b in plan.rank_batches(range(30), 4, r, world)]
    assert sorted(got) == whole
    kept = {0, 3, 6}  # chunks finished before a kill
    remaining = [i for k, b in enumerate(whole) if k not in kept for i in b]
    again = [b for r in range(world) for b in plan.rank_batches(remaining, 4, r, world)]
    assert sorted(again) == [b for k, b in enumerate(whole) if k not in kept]


def test_rank_batches_with_holes_after_resume():
    remaining = [0, 1, 2, 10, 11, 40, 41, 42, 43]
    got = [plan.rank_batches(remaining, 2, r, 2) for r in range(2)]
    assert got == [[[0, 1], [10, 11], [42, 43]], [[2], [40, 41]]]  # the global chunks [2k, 2k+2)
    with pytest.raises(ValueError):
        plan.rank_batches(remaining, 0, 0, 1)
    with pytest.raises(ValueError):
        plan.rank_batches(remaining, 2, 2, 2)


@pytest.mark.parametrize("num_classes", [1, 3, 10, 1000])
def test_equal_labels_balance_every_prefix_and_are_pure_functions_of_the_index(num_classes):
    """Equal-label sampling: any first N samples hold every class floor(N/C) or ceil(N/C) times (counts differ
    by at most 1), a sample's class is `equal_label(seed, index, C)` whatever N, and 50,000 samples of 1000
    classes are exactly 50 per class (RAE's FID setting)."""
    total = 3 * num_classes + 7
    labels = plan.class_labels(num_samples=total, seed=5, num_classes=num_classes, sampling="equal")
    assert labels.dtype == np.int64 and labels.shape == (total,)
    for n in sorted({0, 1, 2, num_classes - 1, num_classes, num_classes + 1, 2 * num_classes + 3, total}):
        counts = np.bincount(labels[:n], minlength=num_classes)
        assert counts.max() - counts.min() <= 1 and counts.sum() == n, (n, counts)
        assert np.array_equal(plan.class_labels(num_samples=n, seed=5, num_classes=num_classes, sampling="equal"),
                              labels[:n])
    picks = sorted({0, num_classes - 1, num_classes, total - 1})
    assert [plan.equal_label(5, i, num_classes) for i in picks] == labels[picks].tolist()
    if num_classes > 2:  # seeded: another seed orders the classes differently; whole blocks hold each once
        other = plan.class_labels(num_samples=total, seed=6, num_classes=num_classes, sampling="equal")
        assert not np.array_equal(other, labels)
        assert np.bincount(other[:3 * num_classes], minlength=num_classes).tolist() == [3] * num_classes
    if num_classes == 1000:
        fifty_k = plan.class_labels(num_samples=50_000, seed=0, num_classes=1000, sampling="equal")
        assert np.bincount(fifty_k, minlength=1000).tolist() == [50] * 1000


@pytest.mark.parametrize("n,batch,world", list(itertools.product([1, 9, 10, 11, 57], [1, 4, 32], [1, 2, 3, 8])))
def test_equal_labels_of_each_rank_do_not_depend_on_world_or_batch_size(n, batch, world):
    """What each rank samples, (index, class) of its batches, assembled over the ranks, is the one-process
    labelling for every world size and batch size (10 classes)."""
    labels = plan.class_labels(num_samples=n, seed=2, num_classes=10, sampling="equal")
    got = {i: int(labels[i]) for r in range(world) for b in plan.rank_batches(range(n), batch, r, world) for i in b}
    assert [got[i] for i in range(n)] == [plan.equal_label(2, i, 10) for i in range(n)]
    counts = np.bincount(list(got.values()), minlength=10)
    assert counts.max() - counts.min() <= 1


def test_equal_labels_use_their_own_seed_stream_and_uniform_stays_as_it_was():
    # the permutation of block k is seeded apart from sample k's uniform draw and its noise
    assert derive_seed(1, STREAM_SAMPLING, 5, plan.EQUAL_SUBSTREAM) not in (
        derive_seed(1, STREAM_SAMPLING, 5, plan.LABEL_SUBSTREAM), plan.noise_seed(1, 5))
    assert np.array_equal(plan.class_labels(num_samples=50, seed=1, num_classes=10),
                          plan.class_labels(num_samples=50, seed=1, num_classes=10, sampling="uniform"))
    assert plan.class_labels(num_samples=3, seed=0, num_classes=10, given=[4], sampling="equal").tolist() == [4] * 3
    with pytest.raises(ValueError, match="label sampling must be one of \\('uniform', 'equal'\\), got 'balanced'"):
        plan.class_labels(num_samples=3, seed=0, num_classes=10, sampling="balanced")
