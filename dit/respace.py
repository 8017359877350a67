"""Timestep respacing (IDDPM, Nichol & Dhariwal 2021, as used by DiT's samplers).

A respaced process keeps a subset S of the original steps. Its betas are re-derived so that its
alphas_cumprod equal the original ones at the kept steps; the model is always called with the ORIGINAL
step index (see `GaussianDiffusion.timestep_map`).
"""
from __future__ import annotations

import numpy as np

TRAIN_TIMESTEPS = 1000  # DiT's diffusion has 1000 training steps; respacing keeps a subset of them


def space_timesteps(num_timesteps: int, section_counts: str | list[int]) -> list[int]:
    """The kept steps (sorted) for "250", "10,20" (per equal section of the process) or "ddimN".

    Sections split `num_timesteps` into equal parts, the first `num_timesteps % k` one step longer; a
    section of L steps keeps `count` steps at positions round(i * (L-1) / (count-1)). The position is
    accumulated by repeated float addition of the stride, exactly as the reference sampler does, so
    that at exact halves (e.g. "21": 499.5) the rounding lands where the reference's does (499).
    "ddimN": the steps range(0, num_timesteps, s) for the integer stride s giving exactly N of them.
    """
    if isinstance(section_counts, str):
        text = section_counts.strip()
        if text.startswith("ddim"):
            return _ddim_steps(num_timesteps, text[len("ddim"):])
        try:
            counts = [int(part) for part in text.split(",")]
        except ValueError:
            raise ValueError(f"timestep respacing {section_counts!r} must be comma-separated step counts "
                             f"(e.g. '250' or '10,20') or 'ddimN' (e.g. 'ddim50')") from None
    else:
        counts = [int(c) for c in section_counts]
    if not counts or any(c < 1 for c in counts):
        raise ValueError(f"timestep respacing {section_counts!r}: every section needs >= 1 step")
    size_per, extra = divmod(num_timesteps, len(counts))
    steps: list[int] = []
    start = 0
    for i, count in enumerate(counts):
        size = size_per + (1 if i < extra else 0)
        if count > size:
            raise ValueError(f"timestep respacing {section_counts!r}: a section of {size} steps cannot "
                             f"hold {count}")
        stride = 1.0 if count == 1 else (size - 1) / (count - 1)
        position = 0.0
        for _ in range(count):
            steps.append(start + round(position))
            position += stride
        start += size
    return sorted(set(steps))


def ddim_stride(steps: int, total: int = TRAIN_TIMESTEPS) -> int | None:
    """The integer stride s with len(range(0, total, s)) == steps ("ddimN" respacing), or None."""
    for s in range(1, total):
        n = len(range(0, total, s))  # non-increasing in s: once below `steps`, no later stride fits
        if n == steps:
            return s
        if n < steps:
            return None
    return None


def valid_ddim_steps(total: int = TRAIN_TIMESTEPS) -> list[int]:
    """Every step count "ddimN" accepts, ascending."""
    return sorted({len(range(0, total, s)) for s in range(1, total)})


def nearest_ddim_steps(steps: int, k: int = 4, total: int = TRAIN_TIMESTEPS) -> list[int]:
    """The `k` valid DDIM step counts nearest to `steps` (ties: the smaller first), ascending."""
    return sorted(sorted(valid_ddim_steps(total), key=lambda v: (abs(v - steps), v))[:k])


def _ddim_steps(num_timesteps: int, count_text: str) -> list[int]:
    try:
        count = int(count_text)
    except ValueError:
        raise ValueError(f"'ddim{count_text}': expected 'ddim' followed by a step count, e.g. 'ddim50'") \
            from None
    stride = ddim_stride(count, num_timesteps)
    if stride is not None:
        return list(range(0, num_timesteps, stride))
    valid = valid_ddim_steps(num_timesteps)[::-1]
    raise ValueError(f"'ddim{count}': no integer stride gives exactly {count} of {num_timesteps} steps; "
                     f"possible counts include {valid[:12]}")


def respaced_betas(alphas_cumprod: np.ndarray, use_timesteps: list[int]) -> np.ndarray:
    """float64 betas of the respaced process: beta'_j = 1 - abar[s_j] / abar[s_{j-1}] (abar[s_-1] = 1)."""
    keep = set(use_timesteps)
    betas, last = [], 1.0
    for i, abar in enumerate(alphas_cumprod):
        if i in keep:
            betas.append(1.0 - abar / last)
            last = abar
    return np.array(betas, dtype=np.float64)
