"""The metric math against independent computations: closed forms, numpy eigenvalues, direct loops."""
from __future__ import annotations

import math

import numpy as np
import pytest

from dit_pipeline.evaluate.metrics import (Statistics, frechet_distance, frechet_distance_of_features,
                                           frechet_distance_to_statistics, inception_score, manifold_radii,
                                           precision_recall, statistics, trace_sqrt_product)


def _random_psd(rng, d, rank=None):
    a = rng.normal(size=(d, rank or d))
    return a @ a.T / d


def test_fid_of_diagonal_gaussians_is_the_closed_form():
    rng = np.random.default_rng(0)
    mu1, mu2 = rng.normal(size=6), rng.normal(size=6)
    v1, v2 = rng.uniform(0.1, 3, 6), rng.uniform(0.1, 3, 6)
    expected = np.sum((mu1 - mu2) ** 2) + np.sum((np.sqrt(v1) - np.sqrt(v2)) ** 2)
    got = frechet_distance(Statistics(mu1, np.diag(v1)), Statistics(mu2, np.diag(v2)))
    assert got == pytest.approx(expected, rel=1e-12, abs=1e-12)


def test_fid_of_identical_statistics_is_zero_and_of_a_shift_is_its_squared_length():
    rng = np.random.default_rng(1)
    s = _random_psd(rng, 8)
    mu = rng.normal(size=8)
    assert abs(frechet_distance(Statistics(mu, s), Statistics(mu, s))) < 1e-12 * np.trace(s)  # at its scale
    shift = np.arange(8.0)
    assert frechet_distance(Statistics(mu, s), Statistics(mu + shift, s)) == pytest.approx(shift @ shift, rel=1e-10)


@pytest.mark.parametrize("d", [3, 16, 64])
def test_trace_sqrt_product_matches_the_eigenvalues_of_the_product(d):
    """Independent route: the eigenvalues of S1 S2 (non-symmetric, numpy's general eig) are real and >= 0."""
    rng = np.random.default_rng(d)
    s1, s2 = _random_psd(rng, d), _random_psd(rng, d)
    expected = np.sqrt(np.clip(np.linalg.eigvals(s1 @ s2).real, 0, None)).sum()
    assert trace_sqrt_product(s1, s2) == pytest.approx(expected, rel=1e-9)


def test_singular_covariances_of_few_samples_match_the_nuclear_norm_form():
    """With N < D the covariances are singular; tr((S1 S2)^1/2) then equals the nuclear norm of
    A B^T / sqrt((n1-1)(n2-1)) for the centred feature matrices A, B (an independent formula)."""
    rng = np.random.default_rng(2)
    x, y = rng.normal(size=(5, 40)), rng.normal(size=(7, 40)) + 0.3
    a, b = x - x.mean(0), y - y.mean(0)
    nuclear = np.linalg.svd(a @ b.T / math.sqrt(4 * 6), compute_uv=False).sum()
    sx, sy = statistics(x), statistics(y)
    # The ~35 zero eigenvalues come out as +-eps*|S| and their square roots as up to sqrt(eps*|S|) each.
    tol = 40 * math.sqrt(np.finfo(np.float64).eps * np.linalg.norm(sx.sigma @ sy.sigma, 2))
    assert trace_sqrt_product(sx.sigma, sy.sigma) == pytest.approx(nuclear, abs=tol)
    expected = np.sum((sx.mu - sy.mu) ** 2) + np.trace(sx.sigma) + np.trace(sy.sigma) - 2 * nuclear
    assert frechet_distance(sx, sy) == pytest.approx(expected, abs=2 * tol)
    assert frechet_distance_of_features(x, y) == pytest.approx(frechet_distance(sx, sy), abs=2 * tol)
    assert frechet_distance_to_statistics(x, sy) == pytest.approx(frechet_distance(sx, sy), abs=2 * tol)
    big_x, big_y = rng.normal(size=(50, 3)), rng.normal(size=(60, 3))  # N >= D: through the statistics
    assert frechet_distance_of_features(big_x, big_y) == frechet_distance(statistics(big_x), statistics(big_y))


def test_fid_of_sampled_gaussians_approaches_the_closed_form():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(200_000, 2)) * [1.0, 2.0]
    y = rng.normal(size=(200_000, 2)) * [3.0, 0.5] + [1.0, 0.0]
    expected = 1.0 + (1 - math.sqrt(9)) ** 2 + (2 - 0.5) ** 2
    assert frechet_distance(statistics(x), statistics(y)) == pytest.approx(expected, abs=0.05)


def test_statistics_are_the_mean_and_unbiased_covariance_in_float64():
    x = np.array([[1, 2], [3, 5], [4, 4]], np.float32)
    s = statistics(x)
    assert s.mu.dtype == np.float64 and s.sigma.dtype == np.float64
    np.testing.assert_allclose(s.mu, [8 / 3, 11 / 3])
    d = x - x.mean(0)
    np.testing.assert_allclose(s.sigma, d.T.astype(np.float64) @ d / 2, rtol=1e-6)
    with pytest.raises(ValueError, match=r"N >= 2"):
        statistics(x[:1])


def test_fid_rejects_bad_statistics():
    s = Statistics(np.zeros(3), np.eye(3))
    with pytest.raises(ValueError, match="different dimensions"):
        frechet_distance(s, Statistics(np.zeros(4), np.eye(4)))
    with pytest.warns(UserWarning, match="singular"), pytest.raises(ValueError, match="NaN or Inf"):
        frechet_distance(s, Statistics(np.zeros(3), np.full((3, 3), np.nan)))
    with pytest.raises(ValueError, match="not positive semi-definite"):
        frechet_distance(s, Statistics(np.zeros(3), -np.eye(3)))


def _direct_is(logits, split):
    scores = []
    for start in range(0, len(logits), split):
        rows = []
        for row in logits[start:start + split]:
            m = max(row)
            z = sum(math.exp(v - m) for v in row)
            rows.append([math.exp(v - m) / z for v in row])
        marginal = [sum(r[c] for r in rows) / len(rows) for c in range(len(rows[0]))]
        kl = [sum(p * (math.log(p) - math.log(q)) for p, q in zip(r, marginal)) for r in rows]
        scores.append(math.exp(sum(kl) / len(kl)))
    return sum(scores) / len(scores)


@pytest.mark.parametrize("split", [3, 5000])
def test_inception_score_matches_a_direct_computation(split):
    logits = np.random.default_rng(4).normal(scale=3, size=(10, 7)).astype(np.float32)
    assert inception_score(logits, split) == pytest.approx(_direct_is(logits.tolist(), split), rel=1e-10)


def test_inception_score_known_answers():
    assert inception_score(np.zeros((6, 5))) == pytest.approx(1.0)  # every prediction uniform
    confident = np.full((4, 10), -1e4)
    confident[np.arange(4), [0, 1, 2, 3]] = 0  # 4 samples, 4 different certain classes
    assert inception_score(confident) == pytest.approx(4.0)
    assert inception_score(confident, split_size=2) == pytest.approx(2.0)  # each split holds 2 classes


def _naive_pr(ref, samples, k=3):
    def radii(points):
        out = []
        for i, p in enumerate(points):
            d = sorted(float(np.sum((p - q) ** 2)) for j, q in enumerate(points) if j != i)
            out.append(d[k - 1])
        return out

    def inside(points, centres, r):
        return [any(np.sum((p - c) ** 2) <= rc for c, rc in zip(centres, r)) for p in points]

    return float(np.mean(inside(samples, ref, radii(ref)))), float(np.mean(inside(ref, samples, radii(samples))))


def test_precision_recall_known_answer_on_a_line():
    ref = np.array([[0.0], [1.0], [2.0], [3.0], [4.0]])
    # 3rd-nearest squared distances of ref: 0 -> 9 (from 3), 1 -> 4, 2 -> 4, ...; sample 0.5 is inside, 10 is not
    samples = np.array([[0.5], [10.0], [10.5], [11.0], [12.0]])
    np.testing.assert_allclose(manifold_radii(ref), [9, 4, 4, 4, 9])
    precision, recall = precision_recall(ref, samples)
    assert precision == pytest.approx(1 / 5)
    # sample radii: 0.5 -> 3rd nearest of {10,10.5,11,12} = 10.5 -> 100; ref points within 100 of 0.5: 0..4 -> all
    assert recall == pytest.approx(1.0)
    assert (precision, recall) == pytest.approx(_naive_pr(ref, samples))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_precision_recall_match_a_straightforward_numpy_implementation(seed):
    rng = np.random.default_rng(seed)
    ref = rng.normal(size=(30, 4))
    samples = rng.normal(size=(25, 4)) * 1.3 + 0.4
    assert precision_recall(ref, samples) == pytest.approx(_naive_pr(ref, samples), abs=1e-12)


def test_precision_recall_need_more_points_than_k():
    with pytest.raises(ValueError, match=r"k = 3 need more than 3 points, got 3"):
        manifold_radii(np.zeros((3, 2)))
