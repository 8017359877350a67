"""The flow options of the recipes against values computed here: SD3's time shift (dit/shift.py) on known values
and in both time directions, LightningDiT's shifted sampling grid written out from its formula (RAE's, which stops
short of data, is its protocol's: tests/dit/test_protocols.py),
training times drawn with the shift (their mean against the closed form), the samplers' grids, and LightningDiT's
cosine-direction loss."""
from __future__ import annotations

import math

import pytest
import torch

from dit_pipeline import dit
from dit_pipeline.dit import flow, flow_predictions, flow_samplers
from dit_pipeline.dit.shift import shift_for_dim, shift_noise_level, shift_time, shifted_grid


def test_the_sd3_shift_on_known_values_and_in_sits_time():
    assert shift_noise_level(0.5, 3.0) == 0.75                      # 1.5 / (1 + 2 x 0.5)
    assert shift_noise_level(0.25, 3.0) == pytest.approx(0.5)       # 0.75 / 1.5
    assert shift_for_dim(768 * 16 * 16) == math.sqrt(48) == pytest.approx(6.928203230275509)  # RAE, DINOv2-B
    assert shift_for_dim(32 * 16 * 16, 4096) == math.sqrt(2)
    s = math.sqrt(48)
    assert shift_noise_level(0.5, s) == pytest.approx(s / (1 + s), rel=1e-15)  # sigma = 1/2: s / (s + 1)
    for t in (0.0, 0.1, 0.5, 0.9, 1.0):  # SiT's t: its noise level 1 - t is what moves
        assert shift_time(t, s) == pytest.approx(1 - shift_noise_level(1 - t, s), abs=1e-15)
    assert (shift_time(0.0, s), shift_time(1.0, s)) == (0.0, 1.0)  # the ends stay
    assert shift_time(0.5, 3.0) == 0.25 and shift_time(0.5, 1.0) == 0.5  # s > 1: toward noise (t = 0)
    with pytest.raises(ValueError, match="must be positive"):
        shift_for_dim(0)


def test_lightningdits_grid_is_the_shifted_grid():
    # LightningDiT (transport/integrators.py l.94-101): linspace(0, 1, 250) then a t / (1 + (a - 1) t), a = 0.3, in
    # SiT's t: 249 Euler steps, and the same map as an SD3 shift of 1 / 0.3
    a = 0.3
    ours = shifted_grid(0.0, 1.0, 249, 1 / a)
    theirs = [a * (i / 249) / (1 + (a - 1) * (i / 249)) for i in range(250)]
    assert max(abs(x - y) for x, y in zip(ours, theirs)) < 1e-15
    # RAE's grid is not this one: it stops at t = 1 - 1/1000 before the shift (bytetriper/RAE
    # src/stage2/transport/transport.py l.136-137 check_interval); its protocol: tests/dit/test_protocols.py
    s = math.sqrt(48)
    rae_last = 1 - s * (1 - 0.999) / (1 + (s - 1) * (1 - 0.999))  # noise level 0.0069 in SiT's t
    assert shifted_grid(0.0, 1.0, 49, s)[-1] - rae_last > 6e-3
    assert shifted_grid(0.1, 0.9, 4, 1.0) == flow_samplers.time_grid(0.1, 0.9, 4)  # unshifted: the grid as before
    assert shifted_grid(0.1, 0.9, 4, 1.0) == [0.1 + 0.8 * i / 4 for i in range(5)]
    g = shifted_grid(0.001, 0.96, 10, 3.0)  # the SDE's grid keeps its ends
    assert (g[0], g[-1]) == (0.001, 0.96) and all(x < y for x, y in zip(g, g[1:]))


def test_training_times_are_drawn_with_the_shift():
    s, n = 3.0, 200_000
    plain = dit.create_flow().draw_timesteps(n, generator=torch.Generator().manual_seed(1))
    shifted = dit.create_flow(time_shift=s).draw_timesteps(n, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(shifted, plain / (s + (1 - s) * plain), rtol=0, atol=0)  # the same draws, mapped
    # sigma = 1 - t ~ U(0, 1): E[s sigma / (1 + (s - 1) sigma)] = s / (s - 1) (1 - ln(s) / (s - 1)) = 0.67604
    mean = s / (s - 1) * (1 - math.log(s) / (s - 1))
    assert (1 - shifted.double()).mean().item() == pytest.approx(mean, abs=3e-3)
    lognormal = dit.create_flow("logit-normal", time_shift=s).draw_timesteps(
        4, generator=torch.Generator().manual_seed(2))
    z = torch.randn(4, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(lognormal, shift_time(torch.sigmoid(z), s), rtol=0, atol=0)
    with pytest.raises(ValueError, match="time shift must be > 0"):
        dit.create_flow(time_shift=0.0)


def test_the_samplers_integrate_on_the_shifted_grid():
    seen: list[float] = []

    def field(x: torch.Tensor, t: float) -> torch.Tensor:
        seen.append(t)
        return torch.ones_like(x)

    x = flow_samplers.ode_solve(field, torch.zeros(1, 1), steps=4, method="euler", time_shift=3.0)
    grid = [i / 4 / (3 - 2 * i / 4) for i in range(5)]  # t / (s + (1 - s) t)
    assert seen == pytest.approx(grid[:-1], abs=1e-15) and x.item() == pytest.approx(1.0)  # steps sum to 1
    seen.clear()
    flow_samplers.sde_solve(field, torch.zeros(1, 1), steps=5, generator=torch.Generator().manual_seed(0),
                            time_shift=3.0, last_step_size=0.04)
    inner = [0.96 * (i / 4) / (3 - 2 * i / 4) for i in range(4)]
    assert seen == pytest.approx([*inner, 0.96], abs=1e-15)  # 4 shifted steps, then the last step from 0.96
    # a whole sampler call: Heun on the model, shifted, equals ode_solve on its velocity field
    model = lambda x, t, y: x * 0.5 + t.reshape(-1, 1, 1, 1)  # noqa: E731
    noise = torch.randn(2, 3, 2, 2, generator=torch.Generator().manual_seed(3))
    out = dit.create_flow().sample_loop(model, noise, sampler="heun", steps=6, model_kwargs={"y": None},
                                        time_shift=2.5)
    want = flow_samplers.ode_solve(flow_samplers.velocity_field(model, 3, {"y": None}), noise, steps=6, method="heun",
                                   time_shift=2.5)
    assert torch.equal(out, want)
    assert not torch.equal(out, dit.create_flow().sample_loop(model, noise, sampler="heun", steps=6,
                                                             model_kwargs={"y": None}))


def test_the_cosine_direction_loss_is_lightningdits():
    g = torch.Generator().manual_seed(0)
    v, target = torch.randn(3, 4, 2, 5, generator=g), torch.randn(3, 4, 2, 5, generator=g)
    dot = (v * target).sum(1)
    cos = dot / (v.norm(dim=1) * target.norm(dim=1))     # over the channels at each of the 2 x 5 positions
    torch.testing.assert_close(flow.cosine_direction_loss(v, target), (1 - cos).mean(dim=(1, 2)), rtol=1e-6, atol=1e-7)
    assert torch.allclose(flow.cosine_direction_loss(2 * target, target), torch.zeros(3), atol=1e-6)
    assert torch.allclose(flow.cosine_direction_loss(-target, target), torch.full((3,), 2.0), atol=1e-6)
    x1, x0, t = torch.randn(2, 4, 2, 2, generator=g), torch.randn(2, 4, 2, 2, generator=g), torch.tensor([0.3, 0.8])
    model = lambda x, tt, y: 0.5 * x  # noqa: E731
    terms = dit.create_flow(cosine_loss=True).training_losses(model, x1, t, model_kwargs={"y": None}, noise=x0)
    plain = dit.create_flow().training_losses(model, x1, t, model_kwargs={"y": None}, noise=x0)
    assert set(terms) == {"loss", "mse", "cos"} and torch.equal(terms["mse"], plain["mse"])
    xt = flow_predictions.interpolate(x1, x0, t)
    torch.testing.assert_close(terms["cos"], flow.cosine_direction_loss(0.5 * xt, x1 - x0), rtol=0, atol=0)
    torch.testing.assert_close(terms["loss"], terms["mse"] + terms["cos"], rtol=0, atol=0)


def test_a_shift_below_one_is_said_to_move_toward_data():
    """Issue 41: `--time-shift auto` of 0.25 (a small latent) was described as "toward noise"; s < 1 moves the
    levels toward data (shift_time(0.5, 0.25) > 0.5 in SiT's time, t = 1 data)."""
    from dit_pipeline.dit.shift import direction
    from dit_pipeline.train.config import TrainConfig
    from dit_pipeline.train.plan import objective_line

    assert shift_time(0.5, 0.25) > 0.5 and shift_time(0.5, 4.0) < 0.5
    assert (direction(0.25), direction(4.0), direction(1.0)) == ("toward data", "toward noise", "nowhere (no shift)")
    line = objective_line(TrainConfig(shards="s", run_dir="r", objective="flow", time_shift=0.25))
    assert "shifted by 0.25 toward data" in line and "toward noise" not in line
