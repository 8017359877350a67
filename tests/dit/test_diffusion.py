"""Gaussian diffusion against closed forms and independent float64 computations."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dit_pipeline import dit
from dit_pipeline.dit.respace import space_timesteps
from tests.dit._reference import calm_model, tiny_model


def abar_closed(t: int, steps: int = 1000) -> float:
    """prod_{s<=t} (1 - beta_s), beta_s = 1e-4 + s * (0.02 - 1e-4) / (steps - 1), via math.fsum of logs."""
    return math.exp(math.fsum(math.log1p(-(1e-4 + s * (0.02 - 1e-4) / (steps - 1))) for s in range(t + 1)))


def toy_model(x, t, **kwargs):
    """A smooth deterministic 'network': eps and v depend on x and the original step index."""
    s = t.double().reshape(-1, 1, 1, 1) / 1000.0
    eps = 0.3 * torch.sin(3 * x + s) + 0.1 * s
    v = torch.tanh(x * (1 - s))
    return torch.cat([eps, v], dim=1).to(x.dtype)


def test_betas_and_tables_match_closed_forms():
    d = dit.create_diffusion("")
    assert d.num_timesteps == 1000 and d.timestep_map == list(range(1000))
    assert d.betas.dtype == np.float64 and d.betas[0] == 1e-4
    assert d.betas[-1] == pytest.approx(0.02, abs=1e-17)
    assert d.betas[500] == pytest.approx(1e-4 + 500 * 0.0199 / 999, rel=1e-14)
    for t in (0, 1, 10, 500, 999):
        abar = abar_closed(t)
        abar_prev = abar_closed(t - 1) if t else 1.0
        beta = 1e-4 + t * 0.0199 / 999
        assert d.alphas_cumprod[t] == pytest.approx(abar, rel=1e-12)
        assert d.posterior_variance[t] == pytest.approx(beta * (1 - abar_prev) / (1 - abar), rel=1e-10, abs=0)
        assert d.posterior_mean_coef1[t] == pytest.approx(beta * math.sqrt(abar_prev) / (1 - abar), rel=1e-10)
        assert d.posterior_mean_coef2[t] == pytest.approx((1 - abar_prev) * math.sqrt(1 - beta) / (1 - abar),
                                                          rel=1e-10)
    assert d.posterior_variance[0] == 0.0
    assert d.posterior_log_variance_clipped[0] == d.posterior_log_variance_clipped[1] \
        == pytest.approx(math.log(d.posterior_variance[1]), rel=1e-14)
    # fewer steps scale the schedule by 1000 / steps
    assert dit.create_diffusion("", diffusion_steps=500).betas[-1] == pytest.approx(0.04, rel=1e-14)


def test_respacing_selections():
    assert space_timesteps(1000, "250") == [round(i * 999 / 249) for i in range(250)]
    assert space_timesteps(1000, "25") == [round(i * 999 / 24) for i in range(25)]
    assert space_timesteps(1000, "10,20") == [round(i * 499 / 9) for i in range(10)] + \
        [500 + round(i * 499 / 19) for i in range(20)]
    assert space_timesteps(1000, "ddim50") == list(range(0, 1000, 20))
    assert space_timesteps(1000, "ddim25")[:3] == [0, 40, 80]
    assert space_timesteps(1000, "1000") == list(range(1000))
    assert space_timesteps(1000, "1") == [0]
    # 11 = sections of 6 (one extra) and 5; stride 2.5 rounds half to even: 0, 2, 5
    assert space_timesteps(11, "3,2") == [0, 2, 5, 6, 10]
    # the reference accumulates the stride in floating point: at exact halves its rounding decides
    assert space_timesteps(1000, "21")[10] == 499  # round(10 * 49.95) would be 500
    for bad, msg in (("ddim333", "no integer stride"), ("abc", "comma-separated"), ("2000", "cannot hold"),
                     ("0", ">= 1 step")):
        with pytest.raises(ValueError, match=msg):
            space_timesteps(1000, bad)


def test_respaced_process_keeps_alphas_cumprod_and_calls_original_steps():
    base = dit.create_diffusion("")
    d = dit.create_diffusion("10,20")
    kept = space_timesteps(1000, "10,20")
    assert d.num_timesteps == 30 and d.timestep_map == kept
    assert np.allclose(d.alphas_cumprod, base.alphas_cumprod[kept], rtol=1e-12, atol=0)
    seen = []

    def spy(x, t, **kw):
        seen.append(t.tolist())
        return torch.zeros(x.shape[0], 8, *x.shape[2:])

    d.p_mean_variance(spy, torch.zeros(2, 4, 2, 2), torch.tensor([0, 29]))
    assert seen == [[0, 999]]


def test_q_sample_and_p_mean_variance_match_float64():
    d = dit.create_diffusion("")
    g = torch.Generator().manual_seed(0)
    x0, noise = torch.randn(3, 4, 4, 4, generator=g), torch.randn(3, 4, 4, 4, generator=g)
    t = torch.tensor([0, 400, 999])
    ab = torch.tensor([abar_closed(int(s)) for s in t], dtype=torch.float64).reshape(-1, 1, 1, 1)
    xt = d.q_sample(x0, t, noise)
    assert torch.allclose(xt.double(), ab.sqrt() * x0.double() + (1 - ab).sqrt() * noise.double(),
                          rtol=1e-6, atol=1e-6)
    out = d.p_mean_variance(toy_model, xt, t)
    want = ref_p_mean_variance(toy_model(xt.double(), t), xt.double(), t)
    for key in ("mean", "variance", "log_variance", "pred_xstart"):
        assert out[key].dtype == torch.float32
        err = ((out[key].double() - want[key]).abs() / (want[key].abs() + 1e-3)).max()
        assert err < 1e-5, (key, err)


def ref_p_mean_variance(out, x, t):
    """float64 closed forms: learned-range log variance, eps -> x0, posterior mean."""
    res = {k: torch.zeros_like(x) for k in ("mean", "variance", "log_variance", "pred_xstart")}
    for i, s in enumerate(t.tolist()):
        beta = 1e-4 + s * 0.0199 / 999
        abar, abar_prev = abar_closed(s), (abar_closed(s - 1) if s else 1.0)
        u = max(s, 1)  # the clipped posterior log variance uses t = 1 at t = 0
        min_log = math.log((1e-4 + u * 0.0199 / 999) * (1 - abar_closed(u - 1)) / (1 - abar_closed(u)))
        frac = (out[i, 4:] + 1) / 2
        logv = frac * math.log(beta) + (1 - frac) * min_log
        x0 = (x[i] - math.sqrt(1 - abar) * out[i, :4]) / math.sqrt(abar)
        res["mean"][i] = (beta * math.sqrt(abar_prev) * x0 + (1 - abar_prev) * math.sqrt(1 - beta) * x[i]) \
            / (1 - abar)
        res["log_variance"][i], res["variance"][i], res["pred_xstart"][i] = logv, logv.exp(), x0
    return res


def test_vb_term_matches_independent_computation():
    d = dit.create_diffusion("")
    g = torch.Generator().manual_seed(1)
    x0 = torch.randn(4, 4, 4, 4, generator=g).clamp(-1, 1)
    x0[0, 0, 0, :2] = torch.tensor([-1.0, 1.0])  # exercise both open edge bins
    noise = torch.randn(4, 4, 4, 4, generator=g)
    out = torch.randn(4, 8, 4, 4, generator=g) * 0.5
    t = torch.tensor([0, 0, 1, 742])
    losses = d.training_losses(lambda x, tt, **k: out, x0, t, noise=noise)
    xt = d.q_sample(x0, t, noise).double()
    p = ref_p_mean_variance(out.double(), xt, t)
    want_vb = []
    for i, s in enumerate(t.tolist()):
        if s == 0:  # discretized Gaussian NLL, bins of width 2/255, tanh CDF, open edges
            x, mu, std = x0[i].double(), p["mean"][i], (0.5 * p["log_variance"][i]).exp()
            cdf = lambda z: 0.5 * (1 + torch.tanh(math.sqrt(2 / math.pi) * (z + 0.044715 * z ** 3)))  # noqa
            upper = torch.where(x > 0.999, torch.ones_like(x), cdf((x - mu + 1 / 255) / std))
            lower = torch.where(x < -0.999, torch.zeros_like(x), cdf((x - mu - 1 / 255) / std))
            want_vb.append(-torch.log((upper - lower).clamp(min=1e-12)).mean() / math.log(2))
        else:  # KL between the true posterior and the model's Gaussian, via torch.distributions
            abar, abar_prev = abar_closed(s), abar_closed(s - 1)
            beta = 1e-4 + s * 0.0199 / 999
            mean_q = (beta * math.sqrt(abar_prev) * x0[i].double()
                      + (1 - abar_prev) * math.sqrt(1 - beta) * xt[i]) / (1 - abar)
            var_q = beta * (1 - abar_prev) / (1 - abar)
            kl = torch.distributions.kl_divergence(
                torch.distributions.Normal(mean_q, math.sqrt(var_q)),
                torch.distributions.Normal(p["mean"][i], p["variance"][i].sqrt()))
            want_vb.append(kl.mean() / math.log(2))
    want_vb = torch.stack(want_vb)
    assert torch.allclose(losses["vb"].double(), want_vb, rtol=2e-5, atol=1e-6), (losses["vb"], want_vb)
    want_mse = ((noise - out[:, :4]).double() ** 2).mean(dim=(1, 2, 3))
    assert torch.allclose(losses["mse"].double(), want_mse, rtol=1e-6)
    assert torch.equal(losses["loss"], losses["mse"] + losses["vb"])


def test_vb_trains_only_the_variance_channels():
    d = dit.create_diffusion("")
    out = torch.randn(2, 8, 4, 4, requires_grad=True)
    x0, t = torch.randn(2, 4, 4, 4), torch.tensor([0, 300])
    losses = d.training_losses(lambda x, tt, **k: out, x0, t)
    (grad_vb,) = torch.autograd.grad(losses["vb"].sum(), out, retain_graph=True)
    assert grad_vb[:, :4].abs().max() == 0 and grad_vb[:, 4:].abs().max() > 0
    (grad_mse,) = torch.autograd.grad(losses["mse"].sum(), out)
    assert grad_mse[:, 4:].abs().max() == 0 and grad_mse[:, :4].abs().max() > 0


def test_fixed_variance_without_learned_sigma():
    d = dit.create_diffusion("", learn_sigma=False)
    x, t = torch.randn(2, 4, 2, 2), torch.tensor([0, 5])
    out = d.p_mean_variance(lambda x, tt, **k: torch.zeros_like(x), x, t)
    assert out["variance"][0].unique().item() == pytest.approx(d.posterior_variance[1], rel=1e-6)
    assert out["variance"][1].unique().item() == pytest.approx(d.betas[5], rel=1e-6)
    losses = d.training_losses(lambda x, tt, **k: torch.zeros_like(x), x, t, noise=torch.ones_like(x))
    assert torch.equal(losses["loss"], torch.ones(2)) and torch.equal(losses["vb"], torch.zeros(2))
    with pytest.raises(ValueError, match="learn_sigma=False"):
        d.p_mean_variance(toy_model, x, t)


def test_ddim_loop_matches_float64_and_is_deterministic():
    d = dit.create_diffusion("ddim25")
    z = torch.randn(2, 4, 4, 4, generator=torch.Generator().manual_seed(5))
    a = d.ddim_sample_loop(toy_model, z.shape, noise=z)
    torch.manual_seed(123)
    b = d.ddim_sample_loop(toy_model, z.shape, noise=z)
    assert torch.equal(a, b)
    steps = space_timesteps(1000, "ddim25")
    x = z.double()
    for j in reversed(range(len(steps))):  # x_{t-1} = x0 sqrt(abar_prev) + sqrt(1 - abar_prev) eps
        s = steps[j]
        abar, abar_prev = abar_closed(s), (abar_closed(steps[j - 1]) if j else 1.0)
        eps = toy_model(x, torch.full((2,), s))[:, :4]
        x0 = (x - math.sqrt(1 - abar) * eps) / math.sqrt(abar)
        eps = (x - math.sqrt(abar) * x0) / math.sqrt(1 - abar)
        x = x0 * math.sqrt(abar_prev) + math.sqrt(1 - abar_prev) * eps
    assert (a.double() - x).abs().max() < 1e-4 * x.abs().max()


def test_ddpm_loop_follows_the_reference_draw_order():
    d = dit.create_diffusion("5")
    torch.manual_seed(11)
    got = d.p_sample_loop(toy_model, (2, 4, 3, 3))
    torch.manual_seed(11)
    x = torch.randn(2, 4, 3, 3)
    for i in reversed(range(5)):
        t = torch.full((2,), i)
        out = d.p_mean_variance(toy_model, x, t)
        noise = torch.randn_like(x)
        x = out["mean"] + (0.0 if i == 0 else 1.0) * torch.exp(0.5 * out["log_variance"]) * noise
    assert torch.allclose(got, x, atol=1e-6)


@pytest.mark.parametrize("ddim", [False, True])
def test_per_sample_generators_make_samples_independent_of_batch_size(ddim):
    d = dit.create_diffusion("ddim4" if ddim else "4")
    loop = (lambda *a, **k: d.ddim_sample_loop(*a, eta=0.5, **k)) if ddim else d.p_sample_loop
    dit_model = calm_model()

    def sample(model, ids):
        gens = [torch.Generator().manual_seed(1000 + i) for i in ids]
        return loop(model, (len(ids), 4, 8, 8), model_kwargs={"y": torch.tensor(ids) % 5}, generator=gens)

    # a per-element model: every draw and every step is bitwise the same whatever the batch
    three, one = sample(toy_model, [0, 1, 2]), sample(toy_model, [1])
    assert torch.equal(three[1], one[0]) and not torch.allclose(three[0], three[1])
    # the DiT's batched matmuls may round differently per batch size; the trajectories stay together
    three, one = sample(dit_model, [0, 1, 2]), sample(dit_model, [1])
    assert torch.allclose(three[1], one[0], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="list of 3"):
        d.p_sample_loop(dit_model, (3, 4, 8, 8), model_kwargs={"y": torch.zeros(3, dtype=torch.long)},
                        generator=[torch.Generator()])


def test_cfg_sampling_at_scale_one_equals_conditional_sampling():
    model = calm_model()
    d = dit.create_diffusion("3")
    z = torch.randn(1, 4, 8, 8)
    gens = lambda n: [torch.Generator().manual_seed(9 + i) for i in range(n)]  # noqa: E731
    guided = d.p_sample_loop(model.forward_with_cfg, (2, 4, 8, 8), noise=torch.cat([z, z]),
                             model_kwargs={"y": torch.tensor([1, 5]), "cfg_scale": 1.0}, generator=gens(2))
    plain = d.p_sample_loop(model, (1, 4, 8, 8), noise=z, model_kwargs={"y": torch.tensor([1])},
                            generator=gens(1))
    assert torch.allclose(guided[:1], plain, atol=1e-5)
    with pytest.raises(ValueError, match="noise has shape"):
        d.p_sample_loop(model, (3, 4, 8, 8), noise=z)
