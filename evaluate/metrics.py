"""FID, sFID, Inception Score and k-NN precision/recall from Inception features, defined as the ADM evaluator
(openai/guided-diffusion `evaluations/evaluator.py`) defines them.

- Statistics: mean and covariance (`np.cov`, unbiased, float64) of the features.
- Fréchet distance (Heusel et al. 2017): |mu1 - mu2|^2 + tr(S1) + tr(S2) - 2 tr((S1 S2)^(1/2)). The reference
  takes scipy's `sqrtm(S1 @ S2)` and the trace of its real part. Here the same trace is computed in float64 as
  tr((R S2 R)^(1/2)) with R = S1^(1/2), from two symmetric eigendecompositions: equal in exact arithmetic (S1 S2
  is similar to R S2 R), and stable when a covariance is singular (fewer samples than dimensions). The
  reference's guard is kept: when the result is not finite, 1e-6 is added to both diagonals and it is retried;
  a clearly non-positive-semidefinite product (the reference's "imaginary component") is an error.
- Inception Score (Salimans et al. 2016): the softmax of the bias-free logits, cut into consecutive splits of
  5000 samples (the last one shorter); per split exp(mean_i KL(p_i || mean p)); the mean over splits. With
  50,000 samples that is the usual 10 splits.
- Precision and recall (Kynkäänniemi et al. 2019) on the pool features with k = 3: the radius of a point is
  its squared Euclidean distance to its 3rd nearest neighbour in its own set (itself not counted); precision is
  the fraction of samples within the radius of some reference point, recall the fraction of reference points
  within the radius of some sample. The reference computes the distances in float16 (float32 if that
  overflows); here they are float32, so only points within float16 rounding of a radius can decide differently.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import torch

IS_SPLIT_SIZE = 5000
NEIGHBOURHOOD_K = 3
FID_EPS = 1e-6
_BLOCK = 2048


@dataclass
class Statistics:
    """Mean [D] and covariance [D, D] of a feature set (float64)."""

    mu: np.ndarray
    sigma: np.ndarray


def statistics(features: np.ndarray) -> Statistics:
    """Mean and unbiased covariance of features [N, D] (N >= 2), in float64."""
    feats = np.asarray(features, dtype=np.float64)
    if feats.ndim != 2 or len(feats) < 2:
        raise ValueError(f"statistics need features [N >= 2, D], got shape {list(feats.shape)}")
    return Statistics(feats.mean(axis=0), np.cov(feats, rowvar=False))


def _psd_sqrt(a: np.ndarray) -> np.ndarray:
    w, v = np.linalg.eigh((a + a.T) / 2)
    return (v * np.sqrt(np.clip(w, 0, None))) @ v.T


def trace_sqrt_product(s1: np.ndarray, s2: np.ndarray) -> float:
    """tr((S1 S2)^(1/2)) for positive semi-definite S1, S2 (float64); NaN when the inputs are not finite."""
    s1, s2 = np.asarray(s1, np.float64), np.asarray(s2, np.float64)
    if not (np.isfinite(s1).all() and np.isfinite(s2).all()):
        return float("nan")
    r = _psd_sqrt(s1)
    m = r @ s2 @ r
    w = np.linalg.eigvalsh((m + m.T) / 2)
    scale = max(float(np.abs(w).max()), 1e-300)
    if w.min() < -1e-3 * scale:
        raise ValueError(f"covariance product is not positive semi-definite (eigenvalue {w.min():.3g} of "
                         f"largest {scale:.3g}): the statistics are not covariances of real features")
    return float(np.sqrt(np.clip(w, 0, None)).sum())


def nonnegative(distance: float) -> float:
    """A distance as a float, clamped at 0: identical statistics give a difference of rounding errors (-6.9e-18),
    never a negative distance."""
    return max(float(distance), 0.0)


def frechet_distance(a: Statistics, b: Statistics, eps: float = FID_EPS) -> float:
    """Fréchet distance between two Gaussians (see the module docstring)."""
    mu1, mu2 = np.atleast_1d(np.asarray(a.mu, np.float64)), np.atleast_1d(np.asarray(b.mu, np.float64))
    s1, s2 = np.atleast_2d(np.asarray(a.sigma, np.float64)), np.atleast_2d(np.asarray(b.sigma, np.float64))
    if mu1.shape != mu2.shape or s1.shape != s2.shape or s1.shape != (len(mu1), len(mu1)):
        raise ValueError(f"statistics of different dimensions: mean {list(mu1.shape)} vs {list(mu2.shape)}, "
                         f"covariance {list(s1.shape)} vs {list(s2.shape)}")
    diff = mu1 - mu2
    try:
        tr_covmean = trace_sqrt_product(s1, s2)
    except np.linalg.LinAlgError:
        tr_covmean = float("nan")
    if not np.isfinite(tr_covmean):
        warnings.warn(f"FID: singular covariance product; adding {eps} to the diagonal of both covariances")
        offset = np.eye(len(mu1)) * eps
        tr_covmean = trace_sqrt_product(s1 + offset, s2 + offset)
        if not np.isfinite(tr_covmean):
            raise ValueError("FID is not finite: the statistics contain NaN or Inf")
    return nonnegative(diff @ diff + np.trace(s1) + np.trace(s2) - 2 * tr_covmean)


def frechet_distance_of_features(x: np.ndarray, y: np.ndarray) -> float:
    """Fréchet distance between the Gaussians fitted to features x [N1, D] and y [N2, D].

    tr((S1 S2)^(1/2)) equals the nuclear norm of A B^T / sqrt((N1-1)(N2-1)) for the centred features A, B: with
    fewer samples than dimensions (N < D: covariances singular, e.g. small evaluations during training) an
    N1 x N2 problem; otherwise, with the triangular factors of A = Q_A R_A and B = Q_B R_B, the nuclear norm of the
    D x D matrix R_A R_B^T. Neither takes the square root of an eigenvalue, so a covariance that is singular or
    nearly so (a normed token's, e.g. DINOv2's for FD_DINOv2) costs no accuracy: the result is exact to float64
    rounding, where square roots of near-zero eigenvalues would move it by about sqrt(eps).
    """
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    if x.ndim != 2 or y.ndim != 2 or x.shape[1] != y.shape[1] or min(len(x), len(y)) < 2:
        raise ValueError(f"features [N >= 2, D] of equal D needed, got {list(x.shape)} and {list(y.shape)}")
    a, b = x - x.mean(0), y - y.mean(0)
    n1, n2 = len(x) - 1, len(y) - 1
    if min(len(x), len(y)) >= x.shape[1]:
        cross = np.linalg.qr(a, mode="r") @ np.linalg.qr(b, mode="r").T  # [D, D]: A B^T's singular values
    else:
        cross = a @ b.T
    tr_covmean = np.linalg.svd(cross, compute_uv=False).sum() / np.sqrt(n1 * n2)
    diff = x.mean(0) - y.mean(0)
    return nonnegative(diff @ diff + np.sum(a * a) / n1 + np.sum(b * b) / n2 - 2 * tr_covmean)


def frechet_distance_to_statistics(x: np.ndarray, ref: Statistics) -> float:
    """Fréchet distance between features x [N, D] and precomputed statistics. With N <= D the covariance of x is
    A^T A / (N-1) for the centred features A, and tr((S1 S2)^(1/2)) is the sum of the square roots of the
    eigenvalues of A S2 A^T / (N-1), an N x N problem; otherwise `frechet_distance` of the statistics."""
    x = np.asarray(x, np.float64)
    if x.ndim != 2 or len(x) < 2:
        raise ValueError(f"features [N >= 2, D] needed, got {list(x.shape)}")
    if len(x) > x.shape[1]:
        return frechet_distance(statistics(x), ref)
    mu2, s2 = np.asarray(ref.mu, np.float64), np.asarray(ref.sigma, np.float64)
    if mu2.shape != (x.shape[1],) or s2.shape != (x.shape[1],) * 2:
        raise ValueError(f"statistics of different dimensions: features {x.shape[1]}, mean {list(mu2.shape)}, "
                         f"covariance {list(s2.shape)}")
    if not (np.isfinite(mu2).all() and np.isfinite(s2).all()):
        raise ValueError("FID is not finite: the statistics contain NaN or Inf")
    a = x - x.mean(0)
    n1 = len(x) - 1
    m = a @ s2 @ a.T / n1
    w = np.linalg.eigvalsh((m + m.T) / 2)
    diff = x.mean(0) - mu2
    return nonnegative(diff @ diff + np.sum(a * a) / n1 + np.trace(s2) - 2 * np.sqrt(np.clip(w, 0, None)).sum())


def inception_score(logits: np.ndarray, split_size: int = IS_SPLIT_SIZE) -> float:
    """Inception Score of bias-free logits [N, 1008] (softmax in float64; splits of `split_size`)."""
    logits = np.asarray(logits, np.float64)
    if logits.ndim != 2 or len(logits) == 0:
        raise ValueError(f"inception_score needs logits [N >= 1, C], got shape {list(logits.shape)}")
    logp = logits - logits.max(axis=1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(axis=1, keepdims=True))
    scores = []
    for start in range(0, len(logp), split_size):
        part = logp[start:start + split_size]
        p = np.exp(part)
        with np.errstate(divide="ignore", invalid="ignore"):
            log_marginal = np.log(p.mean(axis=0, keepdims=True))
            terms = np.where(p > 0, p * (part - log_marginal), 0.0)  # p log p -> 0 as p -> 0
        scores.append(np.exp(np.mean(np.sum(terms, axis=1))))
    return float(np.mean(scores))


def inception_score_permuted(logits: np.ndarray, *, num_splits: int = 10, seed: int = 0, eps: float = 1e-10,
                             dtype: str = "float64") -> float:
    """Inception Score as NanoGen (seed 0, float32) and iMF (seed 2020, float64) compute it (evaluate/protocols.py):
    the softmax of the logits in float32, its rows permuted by np.random.RandomState(seed), `num_splits` splits of
    N // num_splits rows (the remainder dropped), per split exp(mean_i sum_c p log((p + eps) / (mean p + eps)))
    in `dtype`, the mean over splits."""
    logits = np.asarray(logits, np.float32)
    n = len(logits)
    if logits.ndim != 2 or n < num_splits:
        raise ValueError(f"the Inception Score in {num_splits} splits needs logits [N >= {num_splits}, C], got shape "
                         f"{list(logits.shape)}")
    probs = torch.softmax(torch.from_numpy(logits), dim=1).numpy().astype(dtype)
    probs = probs[np.random.RandomState(seed).permutation(n)]
    size = n // num_splits
    scores = []
    for i in range(num_splits):
        part = probs[i * size:(i + 1) * size]
        marginal = part.mean(axis=0, keepdims=True)
        kl = part * (np.log(part + eps) - np.log(marginal + eps))
        scores.append(float(np.exp(kl.sum(axis=1).mean())))
    return float(np.mean(scores))


def frechet_distance_eigvals(a: Statistics, b: Statistics) -> float:
    """iMF's Fréchet distance (Lyy-iiis/imeanflow utils/fid_util.py `compute_fid`): tr((S1 S2)^(1/2)) as the sum
    of the real parts of the complex square roots of `np.linalg.eigvals(S1 S2)`, float64, no retry and no clamp."""
    mu1, mu2 = np.atleast_1d(np.asarray(a.mu, np.float64)), np.atleast_1d(np.asarray(b.mu, np.float64))
    s1, s2 = np.atleast_2d(np.asarray(a.sigma, np.float64)), np.atleast_2d(np.asarray(b.sigma, np.float64))
    if mu1.shape != mu2.shape or s1.shape != s2.shape:
        raise ValueError(f"statistics of different dimensions: mean {list(mu1.shape)} vs {list(mu2.shape)}")
    diff = mu1 - mu2
    tr_covmean = np.sum(np.sqrt(np.linalg.eigvals(s1 @ s2).astype(np.complex128)).real)
    return float(diff @ diff + np.trace(s1) + np.trace(s2) - 2 * tr_covmean)


def _sq_dists(u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Pairwise squared Euclidean distances [len(u), len(v)], clamped at 0 (the reference's formula)."""
    return ((u * u).sum(1)[:, None] - 2 * (u @ v.T) + (v * v).sum(1)[None, :]).clamp_min_(0)


def manifold_radii(features: np.ndarray, k: int = NEIGHBOURHOOD_K, device: str | torch.device = "cpu") -> np.ndarray:
    """Squared distance of each point to its k-th nearest other point in the same set, float32 [N]."""
    feats = torch.as_tensor(np.asarray(features, np.float32), device=device)
    if len(feats) <= k:
        raise ValueError(f"k-NN radii with k = {k} need more than {k} points, got {len(feats)}")
    radii = []
    for start in range(0, len(feats), _BLOCK):
        d = _sq_dists(feats[start:start + _BLOCK], feats)
        # the k+1 smallest include the point itself (distance 0): take the (k+1)-th, as the reference does
        radii.append(d.topk(k + 1, dim=1, largest=False).values[:, k])
    return torch.cat(radii).cpu().numpy()


def _covered(points: torch.Tensor, centres: torch.Tensor, radii: torch.Tensor) -> torch.Tensor:
    """For each point: is it within radius of some centre (distance <= radius)? bool [len(points)]."""
    out = torch.zeros(len(points), dtype=torch.bool, device=points.device)
    for start in range(0, len(points), _BLOCK):
        block = points[start:start + _BLOCK]
        hit = torch.zeros(len(block), dtype=torch.bool, device=points.device)
        for c0 in range(0, len(centres), _BLOCK):
            d = _sq_dists(block, centres[c0:c0 + _BLOCK])
            hit |= (d <= radii[None, c0:c0 + _BLOCK]).any(dim=1)
        out[start:start + _BLOCK] = hit
    return out


def precision_recall(ref: np.ndarray, samples: np.ndarray, k: int = NEIGHBOURHOOD_K,
                     device: str | torch.device = "cpu") -> tuple[float, float]:
    """(precision, recall) of sample pool features against reference pool features (see module docstring)."""
    r = torch.as_tensor(np.asarray(ref, np.float32), device=device)
    s = torch.as_tensor(np.asarray(samples, np.float32), device=device)
    ref_radii = torch.as_tensor(manifold_radii(ref, k, device), device=device)
    sample_radii = torch.as_tensor(manifold_radii(samples, k, device), device=device)
    precision = _covered(s, r, ref_radii).double().mean().item()
    recall = _covered(r, s, sample_radii).double().mean().item()
    return float(precision), float(recall)
