"""The samplers of flow matching: the probability-flow ODE and SiT's SDE, integrating the velocity from noise
(t = 0) to data (t = 1) in dit/flow.py's convention, the network's output turned into that velocity by its
prediction (dit/flow_predictions.py).

Samplers:
- "euler", "heun": the probability-flow ODE from 0 to 1 in `steps` intervals of a uniform grid (1 and 2
  velocity evaluations per interval; Heun is the explicit trapezoid rule, its corrector evaluating the field
  at the interval's end, t = 1 included: a velocity field is finite on all of [0, 1]).
- "euler-maruyama": the SDE dx = [v + D(t) s(x, t)] dt + sqrt(2 D(t)) dW with the score recovered from the
  velocity, s = (t v - x) / (1 - t), on SiT's grid: `steps` is SiT's `num_steps`, the number of grid points
  from t0 to 1 - last_step_size, so steps - 1 Euler-Maruyama steps, then one noise-free "Mean" step of size
  last_step_size: `steps` velocity evaluations in all, as SiT's (and REPA's) 250-step setting. D(t) is one of
  SiT's diffusion forms (norm w): constant w; SBDM w (1 - t) / t (t0 = sample_eps so that it is finite);
  sigma w (1 - t); linear w (1 - t); decreasing 0.25 (w cos(pi t) + 1)^2; increasing-decreasing w sin(pi t)^2.
All noise comes from the generators given (one per sample: each sample's draws come from its own only).

Networks trained in REPA's convention (x_t = (1 - t) x_data + t eps, t = 1 noise, predicting eps - x_data;
Yu et al. 2024, the released REPA checkpoints) sample with `convention="repa"`: the field calls the network at
1 - t and negates its output, so every sampler above runs unchanged in SiT's time. With D = sigma (norm 1),
last_step_size 0.04 and `steps` 250 the SDE is then exactly REPA's Euler-Maruyama sampler (time reversed).
"""
from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch

from .flow_predictions import Prediction, VelocityPrediction, bcast, velocity_of
from .shift import shifted_grid

Model = Callable[..., torch.Tensor]
Generators = torch.Generator | Sequence[torch.Generator] | None

ODE_SAMPLERS = ("euler", "heun")
SDE_SAMPLERS = ("euler-maruyama",)
FLOW_SAMPLERS = ODE_SAMPLERS + SDE_SAMPLERS
FLOW_CONVENTIONS = ("sit", "repa")  # the network's time direction and sign (module docstring)
DIFFUSION_FORMS = ("sigma", "SBDM", "constant", "linear", "decreasing", "increasing-decreasing")
SAMPLE_EPS = 1e-3       # SiT's default start of the SDE grid (used by the SBDM form only)
LAST_STEP_SIZE = 0.04   # SiT's default size of the final noise-free SDE step


def score_from_velocity(v: torch.Tensor, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """grad log p_t(x) from the velocity: E[noise | x_t] = x - t v, score = -E[noise | x_t] / (1 - t)."""
    tb = bcast(t, x)
    return (tb * v - x) / (1 - tb)


def diffusion_coefficient(form: str, t: torch.Tensor, norm: float = 1.0) -> torch.Tensor:
    """SiT's D(t) (the SDE's noise is sqrt(2 D) dW); t [N] -> [N]."""
    if form == "constant":
        return torch.full_like(t, float(norm))
    if form == "SBDM":
        return norm * (1 - t) / t
    if form in ("sigma", "linear"):  # sigma_t = 1 - t on the linear path: the two forms coincide
        return norm * (1 - t)
    if form == "decreasing":
        return 0.25 * (norm * torch.cos(math.pi * t) + 1) ** 2
    if form == "increasing-decreasing":
        return norm * torch.sin(math.pi * t) ** 2
    raise ValueError(f"unknown diffusion form {form!r}; choose one of: {', '.join(DIFFUSION_FORMS)}")


def _randn(shape: Sequence[int], device: torch.device, generator: Generators) -> torch.Tensor:
    """Standard normal [N, ...]; with a list of generators row i is drawn from generator i only."""
    if generator is None:
        return torch.randn(*shape, device=device)
    if isinstance(generator, torch.Generator):
        return torch.randn(*shape, generator=generator, device=generator.device).to(device)
    if len(generator) != shape[0]:
        raise ValueError(f"generator must be a torch.Generator or a list of {shape[0]} (one per sample), "
                         f"got {len(generator)}")
    rows = [torch.randn(*shape[1:], generator=g, device=g.device) for g in generator]
    return torch.stack(rows).to(device)


# The attribute of a model function that takes the sampler's float64 grid time (and casts it for its network).
GRID_TIME_ATTR = "takes_grid_time"


def velocity_field(model: Model, channels: int, model_kwargs: dict[str, Any] | None,
                   convention: str = "sit", prediction: Prediction | None = None
                   ) -> Callable[[torch.Tensor, float], torch.Tensor]:
    """(x [N, C, ...], t float) -> float32 v(x, t) in SiT's convention, calling model(x, t [N], **model_kwargs);
    a "repa" network is called at 1 - t (computed in float64 before the float32 cast) and its output negated.
    `prediction` turns the network's output into the velocity (an x-predicting network's clean image: at the
    float32 time t, as the releases convert it)."""
    pred = prediction if prediction is not None else VelocityPrediction()
    if convention not in FLOW_CONVENTIONS:
        raise ValueError(f"unknown flow convention {convention!r}; choose one of: {', '.join(FLOW_CONVENTIONS)}")
    reverse = convention == "repa"

    # A model function that compares the time itself (a guidance interval: sample/generate.py) is given the grid's
    # float64 time and casts it for the network; any other model gets the float32 time (the same rounding).
    dtype = torch.float64 if getattr(model, GRID_TIME_ATTR, False) else torch.float32

    def field(x: torch.Tensor, t: float) -> torch.Tensor:
        tt = torch.full((x.shape[0],), 1.0 - float(t) if reverse else float(t), device=x.device, dtype=dtype)
        out = velocity_of(model(x, tt, **(model_kwargs or {})), channels).float()
        return pred.sit_velocity(out, x, torch.full((x.shape[0],), float(t), device=x.device), reverse)
    return field


def time_grid(t0: float, t1: float, steps: int, time_shift: float = 1.0) -> list[float]:
    """steps + 1 times from t0 to t1, computed in float64: equally spaced, or shifted (dit/shift.py)."""
    return shifted_grid(t0, t1, steps, time_shift)


def ode_solve(field: Callable[[torch.Tensor, float], torch.Tensor], x: torch.Tensor, *, steps: int,
              method: str = "euler", t0: float = 0.0, t1: float = 1.0, time_shift: float = 1.0,
              grid: Sequence[float] | None = None) -> torch.Tensor:
    """Fixed-step Euler or Heun (explicit trapezoid) for dx/dt = field(x, t) from t0 to t1 on time_grid, or on
    `grid` (float64 times, e.g. a release's: dit/protocols.py) when given."""
    if method not in ODE_SAMPLERS:
        raise ValueError(f"unknown ODE method {method!r}; choose one of: {', '.join(ODE_SAMPLERS)}")
    ts = [float(t) for t in grid] if grid is not None else time_grid(t0, t1, steps, time_shift)
    x = x.float()
    for a, b in zip(ts[:-1], ts[1:]):
        h = b - a
        d1 = field(x, a)
        if method == "euler":
            x = x + h * d1
        else:
            d2 = field(x + h * d1, b)
            x = x + 0.5 * h * (d1 + d2)
    return x


def sde_solve(field: Callable[[torch.Tensor, float], torch.Tensor], x: torch.Tensor, *, steps: int,
              generator: Generators = None, form: str = "sigma", norm: float = 1.0,
              last_step_size: float = LAST_STEP_SIZE, sample_eps: float = SAMPLE_EPS,
              time_shift: float = 1.0, grid: Sequence[float] | None = None,
              mean_last: bool = True) -> torch.Tensor:
    """Euler-Maruyama for dx = [v + D s] dt + sqrt(2 D) dW on SiT's grid of `steps` points (steps - 1 steps),
    then the "Mean" last step: `steps` field evaluations (steps - 1 when last_step_size is 0), as SiT's. With
    time_shift the grid's points move as the ODE's (dit/shift.shifted_grid; its ends and the last step stay).
    `grid`: the times themselves (float64; a release's, dit/protocols.py): Euler-Maruyama over every interval but
    the last, which is the noise-free Mean step (`mean_last`; otherwise Euler-Maruyama over every interval)."""
    if grid is not None:
        ts = [float(t) for t in grid]
        if len(ts) < 2:
            raise ValueError(f"the SDE needs a grid of >= 2 times, got {len(ts)}")
        t1, last_step_size = (ts[-2], ts[-1] - ts[-2]) if mean_last else (ts[-1], 0.0)
        ts = ts[:-1] if mean_last else ts
    else:
        if not 0 <= last_step_size < 1:
            raise ValueError(f"last_step_size must be in [0, 1), got {last_step_size}")
        if steps < 2:
            raise ValueError(f"the SDE needs steps >= 2 (SiT's num_steps: points of its time grid), got {steps}")
        t0 = sample_eps if form == "SBDM" else 0.0
        t1 = 1.0 - last_step_size
        ts = time_grid(t0, t1, steps - 1, time_shift)
    x = x.float()

    def drift(x: torch.Tensor, t: float) -> tuple[torch.Tensor, torch.Tensor]:
        tt = torch.full((x.shape[0],), t, device=x.device, dtype=torch.float32)
        d = bcast(diffusion_coefficient(form, tt, norm), x)
        v = field(x, t)
        return v + d * score_from_velocity(v, x, tt), d

    for a, b in zip(ts[:-1], ts[1:]):
        h = b - a
        dw = _randn(x.shape, x.device, generator) * math.sqrt(h)
        mu, d = drift(x, a)
        x = x + mu * h + torch.sqrt(2 * d) * dw
    if last_step_size > 0:
        mu, _ = drift(x, t1)
        x = x + mu * last_step_size
    return x
