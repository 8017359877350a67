"""The time shift of flow matching: more training times and sampling steps at high noise.

SD3's shift (Esser et al. 2024, "Scaling Rectified Flow Transformers", arXiv:2403.03206, section 5.3.2) maps a
noise level sigma in [0, 1] (1 = pure noise) to

    sigma' = s sigma / (1 + (s - 1) sigma),        s > 0,

which keeps both ends and, for s > 1, moves every interior level toward noise (s < 1: toward data; `direction`). RAE (Zheng et al. 2025,
arXiv:2510.11690; bytetriper/RAE stage2/transport) applies it to its training times and to its Euler grid
(its t is the noise level: t = 1 noise) with s = sqrt(dim / base), dim = C x H x W of the latent and base 4096
(sqrt(768 x 16 x 16 / 4096) = sqrt(48) for DINOv2-B features).

This project's flow time is SiT's (dit/flow.py): t = 0 is noise, t = 1 data, so sigma = 1 - t and

    t' = 1 - sigma'(1 - t) = t / (s + (1 - s) t).

LightningDiT's sampler (hustvl/LightningDiT transport/integrators.py, `timestep_shift`) shifts SiT's t itself,
t' = a t / (1 + (a - 1) t) with a = 0.3 in its configs: that is the formula above with s = 1 / a (3.33...), the
same map written in the other direction. Every shift here is given as s in SD3's sense (noise direction).
"""
from __future__ import annotations

import math
from typing import TypeVar

import torch

T = TypeVar("T", float, torch.Tensor)

DIM_BASE = 4096  # RAE's time_dist_shift_base: the latent size (C x H x W) whose shift is 1


def shift_noise_level(sigma: T, s: float) -> T:
    """sigma' = s sigma / (1 + (s - 1) sigma): SD3's shift of a noise level in [0, 1] (1 = noise)."""
    return s * sigma / (1 + (s - 1) * sigma)


def shift_time(t: T, s: float) -> T:
    """SiT's time t (0 = noise, 1 = data) with its noise level 1 - t shifted by s: t / (s + (1 - s) t)."""
    return t / (s + (1 - s) * t)


def shift_for_dim(dim: int, base: int = DIM_BASE) -> float:
    """RAE's dimension-dependent shift sqrt(dim / base), dim = C x H x W of the latent."""
    if dim < 1 or base < 1:
        raise ValueError(f"the latent size and the base must be positive, got {dim} and {base}")
    return math.sqrt(dim / base)


def shifted_grid(t0: float, t1: float, steps: int, s: float = 1.0) -> list[float]:
    """steps + 1 times from t0 to t1 (float64): the uniform grid u_i = i / steps mapped through shift_time
    and stretched onto [t0, t1], so both ends stay where they are. With t0 = 0, t1 = 1 it is exactly the
    shifted uniform grid of LightningDiT's Euler sampler; RAE's stops at t = 0.001 before its shift (its protocol,
    dit/protocols.py, shifts the linspace's points themselves)."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if not s > 0:
        raise ValueError(f"the time shift must be > 0, got {s}")
    if s == 1.0:  # the unshifted grid, computed exactly as dit.flow_samplers.time_grid always has
        return [t0 + (t1 - t0) * i / steps for i in range(steps + 1)]
    return [t0 + (t1 - t0) * shift_time(i / steps, s) for i in range(steps + 1)]


def direction(s: float) -> str:
    """Where a shift s moves the interior noise levels, in words: "toward noise" (s > 1), "toward data" (s < 1)."""
    return "toward noise" if s > 1 else ("toward data" if s < 1 else "nowhere (no shift)")
