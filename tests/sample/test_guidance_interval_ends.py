"""--guidance-interval's ends are included on every sampler (issue #34, defect 2): the interval is compared with the
sampler's own grid time in float64, never the network's float32 time (0.8 in float32 is 0.80000001, whose noise
level 0.19999999 fell below an end at 0.2, where REPA's sampler, float64 grid time, guides). Each network call's
time is mapped to its grid point, whose noise level is computed exactly (fractions) and compared with the ends."""
from __future__ import annotations

from fractions import Fraction

import pytest
import torch

from dit_pipeline.sample.generate import guided_model_fn, make_diffusion, noise_level_fn, sample_latents
from dit_pipeline.sample.plan import noise_generators
from tests.sample.conftest import random_dit


def _calls(sampler, steps, interval, *, objective="flow", convention="sit"):
    """[(network time, guided?)] of one sampling run with the interval."""
    model = random_dit(5, learn_sigma=objective == "ddpm")
    seen, forward = [], model.forward

    def counting(x, t, *args, **kwargs):  # forward_with_cfg calls self.forward too: every pass is seen
        seen.append((float(t[0]), x.shape[0] == 4))
        return forward(x, t, *args, **kwargs)

    model.forward = counting
    fn = guided_model_fn(model, cfg_scale=2.0, cfg_channels="all", guidance_interval=interval,
                         noise_level=noise_level_fn(objective, convention))
    loop = (make_diffusion(sampler, steps, convention=convention) if objective == "flow"
            else make_diffusion(sampler, steps))
    sample_latents(model, loop, torch.tensor([1, 2]), noise_generators(0, [0, 1]), sampler=sampler, model_fn=fn)
    return seen


def _exact(grid: list[Fraction], t: float) -> Fraction:
    return min(grid, key=lambda g: abs(g - Fraction(t)))  # the grid point this float time stands for


@pytest.mark.parametrize("sampler,steps,convention,interval", [
    ("euler", 10, "sit", (0.2, 0.6)), ("euler", 10, "repa", (0.2, 0.6)), ("heun", 10, "sit", (0.3, 0.8)),
    ("heun", 5, "repa", (0.2, 0.4)), ("euler-maruyama", 7, "sit", (0.2, 0.68)),
    ("euler-maruyama", 7, "repa", (0.36, 0.84))])
def test_flow_samplers_include_ends_on_grid_times(sampler, steps, convention, interval):
    if sampler == "euler-maruyama":  # SiT's grid: steps points on [0, 1 - 0.04], then the last step at 0.96
        grid = [Fraction(24, 25) * Fraction(i, steps - 1) for i in range(steps)]
    else:
        grid = [Fraction(i, steps) for i in range(steps + 1)]
    repa = convention == "repa"  # the network runs REPA's time 1 - t; the noise level is that time itself
    calls = _calls(sampler, steps, list(interval), convention=convention)
    low, high = Fraction(str(interval[0])), Fraction(str(interval[1]))
    want = []
    for t, _ in calls:
        level = _exact([1 - g for g in grid], t) if repa else 1 - _exact(grid, t)
        want.append(low <= level <= high)
    assert [g for _, g in calls] == want
    ends = {1 - _exact(grid, t) if not repa else _exact([1 - g for g in grid], t) for t, g in calls if g}
    assert low in ends and high in ends  # both ends fall on grid times here, and both are guided


@pytest.mark.parametrize("sampler,interval", [("ddpm", (0.208, 0.583)), ("ddim", (0.2, 0.6))])
def test_ddpm_samplers_include_ends_on_grid_times(sampler, interval):
    calls = _calls(sampler, 25, list(interval), objective="ddpm")
    low, high = Fraction(str(interval[0])), Fraction(str(interval[1]))
    assert [g for _, g in calls] == [low <= Fraction(round(t), 1000) <= high for t, _ in calls]
    assert {Fraction(round(t), 1000) for t, g in calls if g} >= {low, high}
