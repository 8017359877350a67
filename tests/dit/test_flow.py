"""Flow matching (SiT's linear interpolant) against closed forms for Gaussian data.

For data x1 ~ N(mu, s^2) per coordinate and noise x0 ~ N(0, 1), x_t = t x1 + (1 - t) x0 is Gaussian with
mean t mu and variance S(t)^2 = t^2 s^2 + (1 - t)^2; the exact velocity field is the regression of
v = x1 - x0 on x_t: E[v | x] = mu + (t s^2 - (1 - t)) / S(t)^2 (x - t mu); the ODE's exact flow maps x0 to
mu + s x0 (an affine Gaussian flow keeps the standardised coordinate). Everything below is derived here,
independently of dit/flow.py, dit/flow_predictions.py and dit/flow_samplers.py.
"""
from __future__ import annotations

import math

import pytest
import torch

from dit_pipeline import dit
from dit_pipeline.dit import flow_predictions, flow_samplers

MU = torch.tensor([1.5, -0.5]).reshape(1, 2, 1, 1)
S = torch.tensor([0.5, 2.0]).reshape(1, 2, 1, 1)


def exact_velocity(x: torch.Tensor, t: torch.Tensor, **_) -> torch.Tensor:
    tb = t.double().reshape(-1, 1, 1, 1)
    mu, s = MU.double(), S.double()
    var = tb ** 2 * s ** 2 + (1 - tb) ** 2
    return (mu + (tb * s ** 2 - (1 - tb)) / var * (x.double() - tb * mu)).float()


def gaussian_noise(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, 2, 1, 1, generator=torch.Generator().manual_seed(seed))


def test_interpolant_endpoints_and_velocity_is_its_time_derivative():
    x1, x0 = torch.randn(3, 4, 2, 2, dtype=torch.float64), torch.randn(3, 4, 2, 2, dtype=torch.float64)
    t = torch.tensor([0.2, 0.5, 0.9], dtype=torch.float64)
    assert torch.equal(flow_predictions.interpolate(x1, x0, torch.zeros(3, dtype=torch.float64)), x0)  # t = 0: noise
    assert torch.equal(flow_predictions.interpolate(x1, x0, torch.ones(3, dtype=torch.float64)), x1)   # t = 1: data
    h = 1e-6
    fd = (flow_predictions.interpolate(x1, x0, t + h) - flow_predictions.interpolate(x1, x0, t - h)) / (2 * h)
    assert torch.allclose(fd, flow_predictions.target_velocity(x1, x0), atol=1e-8)
    tb = t.reshape(-1, 1, 1, 1)
    assert torch.allclose(flow_predictions.interpolate(x1, x0, t), tb * x1 + (1 - tb) * x0, atol=1e-15)


def test_training_loss_equals_hand_computed_mse():
    fm = dit.create_flow()
    x1, x0 = torch.randn(4, 2, 3, 3), torch.randn(4, 2, 3, 3)
    t = torch.tensor([0.1, 0.4, 0.6, 0.95])
    seen = {}

    def model(x, tt, y):
        seen["x"], seen["t"], seen["y"] = x, tt, y
        return torch.cat([0.7 * x, torch.full_like(x, 99.0)], dim=1)  # learn_sigma: second half ignored

    terms = fm.training_losses(model, x1, t, model_kwargs={"y": torch.arange(4)}, noise=x0)
    xt = t.reshape(-1, 1, 1, 1) * x1 + (1 - t.reshape(-1, 1, 1, 1)) * x0
    want = ((0.7 * xt - (x1 - x0)) ** 2).mean(dim=(1, 2, 3))
    assert torch.equal(seen["t"], t)  # continuous t goes to the network unscaled
    assert torch.allclose(seen["x"], xt, atol=1e-6)
    assert torch.allclose(terms["loss"], want, rtol=1e-5) and torch.equal(terms["mse"], terms["loss"])
    assert set(terms) == {"loss", "mse"}  # no variational bound: nothing to report or log


def test_a_learn_sigma_dit_trains_as_a_c_channel_one():
    """SiT's train.py builds DiT's 2C-channel output layer (learn_sigma=True) and uses the first C channels: the
    other half gets exactly zero gradient, and with the shared weights equal the loss and every other
    gradient are those of our C-channel model (docs/objectives.md)."""
    kw = dict(input_size=4, num_classes=5, depth=1, hidden_size=32, num_heads=2)
    # eval(): a training-mode DiT drops labels (class_dropout_prob) with draws from the global RNG, which would
    # differ between the two models' forwards
    wide, narrow = (dit.create_model("DiT-S/2", learn_sigma=ls, **kw).eval() for ls in (True, False))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in wide.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
        c, p2 = 4, 4  # latent channels; patch 2 x 2 positions per token
        rows = torch.tensor([pos * 2 * c + ch for pos in range(p2) for ch in range(c)])  # out (a*p+b)*Cout + c
        for name, v in narrow.state_dict().items():
            w = wide.state_dict()[name]
            v.copy_(w[rows] if name.startswith("final_layer.linear") else w)
    x1, x0 = torch.randn(3, 4, 4, 4, generator=g), torch.randn(3, 4, 4, 4, generator=g)
    t, y = torch.tensor([0.2, 0.5, 0.9]), torch.tensor([0, 3, 4])
    fm = dit.create_flow()
    losses = [fm.training_losses(m, x1, t, model_kwargs={"y": y}, noise=x0)["loss"] for m in (wide, narrow)]
    for m, loss in zip((wide, narrow), losses):
        loss.sum().backward()
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-7)
    unused = torch.ones(p2 * 2 * c, dtype=torch.bool)
    unused[rows] = False
    assert wide.final_layer.linear.weight.grad[unused].abs().max() == 0
    assert wide.final_layer.linear.bias.grad[unused].abs().max() == 0
    for (name, a), b in zip(wide.named_parameters(), narrow.parameters()):
        if a.grad is None:
            continue
        ga = a.grad[rows] if name.startswith("final_layer.linear") else a.grad
        torch.testing.assert_close(ga, b.grad, rtol=1e-4, atol=1e-7, msg=name)


def test_exact_field_attains_the_irreducible_loss():
    """E||v_exact - v||^2 = Var(v) - Cov(v, x_t)^2 / Var(x_t) per coordinate (law of total variance)."""
    fm = dit.create_flow()
    n, tv = 200_000, 0.3
    g = torch.Generator().manual_seed(1)
    x1 = MU + S * torch.randn(n, 2, 1, 1, generator=g)
    x0 = torch.randn(n, 2, 1, 1, generator=g)
    loss = fm.training_losses(exact_velocity, x1, torch.full((n,), tv), noise=x0)["loss"].double().mean()
    s2 = S.double().flatten() ** 2
    floor = (s2 + 1) - (tv * s2 - (1 - tv)) ** 2 / (tv ** 2 * s2 + (1 - tv) ** 2)
    assert loss.item() == pytest.approx(floor.mean().item(), rel=0.02)  # MC error ~ 0.5% at n = 2e5


@pytest.mark.parametrize("method,steps,tol", [("euler", 400, 1e-2), ("heun", 50, 1e-3)])
def test_ode_maps_noise_to_data_within_solver_error(method, steps, tol):
    x0 = gaussian_noise(1000)
    out = dit.create_flow().sample_loop(exact_velocity, x0, sampler=method, steps=steps)
    # global error O(h) resp. O(h^2), proportional to the distance travelled (~ 1 + |x0|)
    assert ((out - (MU + S * x0)).abs() / (1 + x0.abs())).max().item() < tol


def test_solver_orders():
    """Halving the step: Euler's error halves (order 1), Heun's quarters (order 2)."""
    x0 = gaussian_noise(200)
    exact = MU.double() + S.double() * x0.double()
    err = {(m, k): (dit.create_flow().sample_loop(exact_velocity, x0, sampler=m, steps=k).double() - exact)
           .abs().max().item() for m in ("euler", "heun") for k in (20, 40)}
    assert 1.7 < err["euler", 20] / err["euler", 40] < 2.3
    assert 3.3 < err["heun", 20] / err["heun", 40] < 4.7
    assert err["heun", 40] < err["euler", 40] / 10


def test_score_from_velocity_is_the_gaussian_score():
    x, t = gaussian_noise(50) * 2, torch.full((50,), 0.4)
    tb = 0.4
    var = tb ** 2 * S ** 2 + (1 - tb) ** 2
    score = -(x - tb * MU) / var
    assert torch.allclose(flow_samplers.score_from_velocity(exact_velocity(x, t), x, t), score, atol=1e-5)


@pytest.mark.parametrize("form", ["sigma", "SBDM", "decreasing", "increasing-decreasing"])
def test_sde_reaches_the_data_distribution(form):
    """Forms whose D(t) vanishes towards t = 1 (the noise-free last step then loses nothing)."""
    n = 20_000
    gens = torch.Generator().manual_seed(5)
    out = dit.create_flow().sample_loop(exact_velocity, gaussian_noise(n, 7), sampler="euler-maruyama",
                                        steps=100, generator=gens, diffusion_form=form)
    mean, std = out.double().mean(dim=0).flatten(), out.double().std(dim=0).flatten()
    # sampling error of the moments at n = 2e4 is < 2% of s; the discretisation adds a few percent
    assert torch.allclose(mean, MU.double().flatten(), atol=0.06 * S.double().flatten().max())
    assert torch.allclose(std, S.double().flatten(), rtol=0.06)


def test_diffusion_forms_match_sit_definitions():
    t = torch.tensor([0.1, 0.5, 0.8])
    assert torch.allclose(flow_samplers.diffusion_coefficient("SBDM", t, 2.0), 2.0 * (1 - t) / t)
    assert torch.allclose(flow_samplers.diffusion_coefficient("sigma", t), 1 - t)
    assert torch.allclose(flow_samplers.diffusion_coefficient("decreasing", t, 1.0),
                          0.25 * (torch.cos(math.pi * t) + 1) ** 2)
    assert torch.allclose(flow_samplers.diffusion_coefficient("increasing-decreasing", t), torch.sin(math.pi * t) ** 2)
    with pytest.raises(ValueError, match="unknown diffusion form 'cubic'; choose one of: sigma, SBDM"):
        flow_samplers.diffusion_coefficient("cubic", t)


def test_per_sample_generators_make_sde_samples_batch_independent():
    x0 = gaussian_noise(4, 3)

    def run(rows):
        gens = [torch.Generator().manual_seed(100 + i) for i in rows]
        return dit.create_flow().sample_loop(exact_velocity, x0[rows], sampler="euler-maruyama", steps=10,
                                             generator=gens)

    whole = run([0, 1, 2, 3])
    assert torch.equal(torch.cat([run([0, 1]), run([2, 3])]), whole)
    assert torch.equal(run([2]), whole[2:3])
    assert not torch.equal(run([0, 1]), run([1, 0]))  # the noise follows the generator, not the row


def test_t_sampling_distributions():
    n = 100_000
    g = torch.Generator().manual_seed(0)
    u = dit.create_flow("uniform").draw_timesteps(n, generator=g)
    assert torch.equal(u, torch.rand(n, generator=torch.Generator().manual_seed(0)))
    ln = dit.create_flow("logit-normal", t_mean=0.5, t_scale=0.8).draw_timesteps(n, generator=g)
    logit = torch.log(ln / (1 - ln)).double()
    assert logit.mean().item() == pytest.approx(0.5, abs=0.01)
    assert logit.std().item() == pytest.approx(0.8, rel=0.01)
    with pytest.raises(ValueError, match="unknown t sampling 'beta'; choose one of: uniform, logit-normal"):
        dit.create_flow("beta")
    with pytest.raises(ValueError, match="logit-normal scale must be > 0, got 0.0"):
        dit.create_flow("logit-normal", t_scale=0.0)


def test_ddpm_draw_timesteps_is_todays_randint():
    d = dit.create_diffusion("")
    got = d.draw_timesteps(16, generator=torch.Generator().manual_seed(3))
    assert torch.equal(got, torch.randint(0, 1000, (16,), generator=torch.Generator().manual_seed(3)))


def test_unknown_sampler_and_bad_output_are_rejected():
    with pytest.raises(ValueError, match="unknown flow sampler 'ddim'; choose one of: euler, heun, euler-maruyama"):
        dit.create_flow().sample_loop(exact_velocity, gaussian_noise(2), sampler="ddim")
    with pytest.raises(ValueError, match="model output has 3 channels; expected 2 or 4"):
        dit.create_flow().sample_loop(lambda x, t: torch.zeros(2, 3, 1, 1), gaussian_noise(2), steps=1)
