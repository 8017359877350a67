"""MeanFlow's parity on CPU in float32 with tiny models (dit/meanflow.py, dit/conditions.py): the JVP is the total
derivative (finite differences), the loss is the papers' formulas evaluated directly, and a network returning the
exact average velocity of a Gaussian data law maps noise to that law in one step (and in two)."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from dit_pipeline import dit
from dit_pipeline.dit.meanflow import MeanFlow, MeanFlowLoop, time_input


def _tiny(conditions: str = "meanflow", family: str = "DiT-S/2", seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    kw = dict(input_size=8, depth=2, hidden_size=32, num_heads=2, in_channels=4, learn_sigma=False,
              conditions=conditions)
    kw.update(_small(family))
    m = dit.create_model(family, **kw)
    with torch.no_grad():  # leave the zero initialisation: every path (h embedder, gates, output) non-trivial
        g = torch.Generator().manual_seed(seed + 1)
        for p in m.parameters():
            if p.requires_grad:
                p.add_(0.1 * torch.randn(p.shape, generator=g))
    return m.train()


def _small(family: str) -> dict:
    """The family's own size options, small."""
    if family.startswith("DDT"):
        return {"encoder_depth": 1}
    if family.startswith("DiT-DH"):
        return {"head_depth": 1, "head_hidden_size": 32, "head_num_heads": 2}
    return {}


def _batch(n: int = 4, seed: int = 2):
    g = torch.Generator().manual_seed(seed)
    x, e = torch.randn(n, 4, 8, 8, generator=g), torch.randn(n, 4, 8, 8, generator=g)
    t = torch.tensor([0.9, 0.7, 0.5, 0.3])[:n]
    r = torch.tensor([0.9, 0.2, 0.1, 0.0])[:n]
    return x, e, torch.stack([t, r], dim=1), torch.arange(n) % 3


@pytest.mark.parametrize("family", ["DiT-S/2", "LightningDiT-B/1", "DDT-XL/2", "DiT-DH-XL"])
def test_every_family_takes_the_second_time_input_and_records_it(family):
    m = _tiny(family=family)
    assert m.config["conditions"] == "meanflow" and hasattr(m, "h_embedder")
    x, _, tr, y = _batch()
    tin = time_input("meanflow", tr[:, 0], tr[:, 1])
    keep = torch.zeros_like(y)
    out = m(x, tin, y, force_drop_ids=keep)
    other = m(x, time_input("meanflow", tr[:, 0], tr[:, 0]), y, force_drop_ids=keep)  # another h: another output
    assert not torch.allclose(out, other)
    again = dit.model_from_config(m.config)
    again.load_state_dict(m.state_dict())
    torch.testing.assert_close(again.train()(x, tin, y, force_drop_ids=keep), out)
    plain = dit.create_model(family, input_size=8, depth=2, hidden_size=32, num_heads=2, in_channels=4,
                             **_small(family))
    assert "conditions" not in plain.config and "h_embedder.mlp.0.weight" not in plain.state_dict()
    with pytest.raises(ValueError, match=r"conditions 'meanflow' takes a time input of shape \[4, 2\]"):
        m(x, tr[:, 0], y)


def test_the_jvp_is_the_total_derivative_along_the_flow():
    m = _tiny()
    mf = MeanFlow()
    mf.attach(m)
    x, e, tr, y = _batch()
    z = (1 - tr[:, :1, None, None]) * x + tr[:, :1, None, None] * e
    tangent = e - x
    drop = torch.zeros_like(y)
    u, dudt = mf.jvp(z, tr, y, drop, tangent)

    def u_at(eps: float) -> torch.Tensor:  # u(z + eps v, t + eps, r): r fixed, so h grows with t
        with torch.no_grad(), sdpa_kernel([SDPBackend.MATH]):
            return m(z + eps * tangent, time_input("meanflow", tr[:, 0] + eps, tr[:, 1]), y, force_drop_ids=drop)
    eps = 1e-2
    fd = (u_at(eps) - u_at(-eps)) / (2 * eps)
    torch.testing.assert_close(u, u_at(0.0), rtol=1e-5, atol=1e-5)
    assert dudt.abs().max() > 0.1  # a real derivative, not a zero
    torch.testing.assert_close(dudt, fd, rtol=2e-3, atol=2e-3)


def test_the_jvp_refuses_a_fused_attention_kernel():
    m = _tiny()
    mf = MeanFlow(jvp_attention="flash")
    mf.attach(m)
    x, e, tr, y = _batch()
    with pytest.raises(ValueError, match="forward-mode AD"):
        mf.jvp(x, tr, y, torch.zeros_like(y), e)


def _direct_loss(m, x, e, tr, y, drop, omega, kappa, t_start, t_end, norm_p, norm_eps):
    """The formulas of the issue / the release, written out with an independent derivative (double backward)."""
    t, r = tr[:, 0], tr[:, 1]
    b = lambda s: s[:, None, None, None]  # noqa: E731
    z = (1 - b(t)) * x + b(t) * e
    v = e - x
    null = torch.full_like(y, m.num_classes)
    with torch.no_grad(), sdpa_kernel([SDPBackend.MATH]):
        u_null = m(z, time_input("meanflow", t, t), null, force_drop_ids=torch.zeros_like(y))
        u_cls = m(z, time_input("meanflow", t, t), y, force_drop_ids=torch.zeros_like(y))
    v_g = omega * v + (1 - omega - kappa) * u_null + kappa * u_cls
    use = (t >= t_start) & (t <= t_end) & (drop == 0)
    v_g = torch.where(b(use), v_g, v)

    def f(z_, t_, r_):
        return m(z_, time_input("meanflow", t_, r_), y, force_drop_ids=drop)
    with sdpa_kernel([SDPBackend.MATH]):
        _, dudt = torch.autograd.functional.jvp(f, (z, t, r), (v_g, torch.ones_like(t), torch.zeros_like(r)))
    u_tgt = (v_g - b((t - r).clamp(0, 1)) * dudt).detach()
    with sdpa_kernel([SDPBackend.MATH]):
        u = f(z, t, r)
    err = ((u - u_tgt) ** 2).sum(dim=(1, 2, 3))
    return (err / (err.detach() + norm_eps) ** norm_p).mean()


@pytest.mark.parametrize("norm_p", [1.0, 0.0])
def test_the_loss_and_its_gradient_are_the_formulas(norm_p):
    settings = dict(omega=0.6, kappa=0.3, t_start=0.0, t_end=0.8)
    x, e, tr, y = _batch()
    drop = torch.tensor([1, 0, 0, 0])
    m = _tiny()
    mf = MeanFlow(norm_p=norm_p, norm_eps=0.01, **settings)
    mf.attach(m)
    ours = mf.training_losses(lambda *a, **k: m(*a, **k), x, tr, {"y": y, "force_drop_ids": drop}, noise=e)
    ours["loss"].mean().backward()
    g_ours = [p.grad.clone() for p in m.parameters() if p.grad is not None]
    m.zero_grad()
    ref = _direct_loss(m, x, e, tr, y, drop, norm_p=norm_p, norm_eps=0.01, **settings)
    ref.backward()
    g_ref = [p.grad.clone() for p in m.parameters() if p.grad is not None]
    torch.testing.assert_close(ours["loss"].mean(), ref, rtol=1e-4, atol=1e-5)
    assert len(g_ours) == len(g_ref) and max(g.abs().max() for g in g_ref) > 1e-3
    for a, b in zip(g_ours, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5)
    if norm_p == 1.0:  # the adaptive weight: every sample's loss is about 1
        assert torch.allclose(ours["loss"], torch.ones(4), atol=0.05)


def test_the_defaults_are_the_releases():
    """Gsunshine/meanflow configs/default.py (method.*: P_mean -0.4, P_std 1.0, data_proportion 0.75,
    class_dropout_prob 0.1, omega 1.0, kappa 0.5, t_start 0.0, t_end 1.0, norm_p 1.0, norm_eps 0.01), which
    configs/run_b4.yml leaves unchanged: the objective and `dit-train --objective meanflow` train guided,
    v_g = v + 0.5 (v_c - v_u). Lyy-iiis/imeanflow configs/default.py: data_proportion 0.5, s_max 7 (imf.py 141)."""
    from dit_pipeline.train import merge_config

    release = {"t_mean": -0.4, "t_scale": 1.0, "data_proportion": 0.75, "omega": 1.0, "kappa": 0.5, "t_start": 0.0,
               "t_end": 1.0, "norm_p": 1.0, "norm_eps": 0.01}
    cfg = merge_config({}, {"shards": "s", "run_dir": "r", "objective": "meanflow"})
    for built in (MeanFlow(), cfg.make_objective()):
        assert {k: getattr(built, k) for k in release} == release and built.guided
    assert cfg.class_dropout_prob == 0.1
    imf = merge_config({}, {"shards": "s", "run_dir": "r", "model": "iMF-B/2"}).make_objective()
    assert (imf.variant, imf.data_proportion, imf.s_max, imf.t_mean, imf.norm_eps) == ("imf", 0.5, 7.0, -0.4, 0.01)


def test_the_h_embedder_starts_as_the_releases():
    """models/models_dit.py TimestepEmbedder (38-44): both Linear weights normal(0.02), biases zero, for h as for t."""
    torch.manual_seed(0)
    m = dit.create_model("DiT-S/2", input_size=8, depth=1, hidden_size=384, num_heads=6, conditions="meanflow")
    for layer in (m.h_embedder.mlp[0], m.h_embedder.mlp[2]):
        assert layer.weight.std().item() == pytest.approx(0.02, rel=0.05) and not layer.bias.any()
    assert not torch.equal(m.h_embedder.mlp[2].weight, m.t_embedder.mlp[2].weight)  # its own draw


def test_time_pairs_and_label_dropout_follow_the_release():
    mf = MeanFlow()
    tr = mf.draw_timesteps(1000, generator=torch.Generator().manual_seed(0))
    t, r = tr[:, 0], tr[:, 1]
    assert (t >= r).all() and (t[:750] == r[:750]).all() and (t[750:] > r[750:]).all()
    drop = mf.drop_labels(torch.tensor([0, 1, 0, 1, 1, 0, 0, 0]))
    assert drop.tolist() == [1, 1, 1, 0, 0, 0, 0, 0]  # k = 3 draws fell below p: the FIRST 3 samples
    imf = MeanFlow(variant="imf")
    tr = imf.draw_timesteps(1000, generator=torch.Generator().manual_seed(0))
    assert torch.equal(tr, MeanFlow(variant="imf-adaln").draw_timesteps(1000, generator=torch.Generator().manual_seed(0)))
    t, r, omega, lo, hi = tr.unbind(1)
    assert (t[:500] == r[:500]).all() and (lo[:500] == 0).all() and (hi[:500] == 1).all()
    assert omega.min() >= 1.0 and omega.max() <= 8.0 and (lo[500:] <= 0.5).all() and (hi[500:] >= 0.5).all()
    # the power law on [1, 1 + s_max]: log(omega) / log(8) is uniform
    assert (torch.log(omega) / math.log(8.0)).mean().item() == pytest.approx(0.5, abs=0.03)
    assert imf.drop_labels(torch.tensor([0, 1, 0])).tolist() == [1, 0, 0]  # the release's first k (test_imf.py)
    assert MeanFlow(variant="imf-adaln").drop_labels(torch.tensor([0, 1, 0])).tolist() == [0, 1, 0]  # ours


class GaussianMeanFlow(nn.Module):
    """The exact average velocity of the path z_t = (1 - t) x + t e, x ~ N(mu, s^2), e ~ N(0, 1) per element: the
    flow moves quantiles, z_r = m_r + (sd_r / sd_t)(z_t - m_t), so u = (z_t - z_r) / (t - r)."""

    conditions = "meanflow"
    num_classes = 1

    def __init__(self, mu: float, s: float):
        super().__init__()
        self.mu, self.s = mu, s

    def stats(self, t):
        return (1 - t) * self.mu, torch.sqrt((1 - t) ** 2 * self.s ** 2 + t ** 2)

    def forward(self, z, tin, y, force_drop_ids=None):
        t, h = tin[:, 0, None, None, None], tin[:, 1, None, None, None]
        r = t - h
        m_t, sd_t = self.stats(t)
        m_r, sd_r = self.stats(r)
        avg = (z - (m_r + sd_r / sd_t * (z - m_t))) / torch.where(h > 1e-6, h, torch.ones_like(h))
        dsd = ((1 - t) * -self.s ** 2 + t) / sd_t  # d sd_t / dt
        inst = -self.mu + dsd / sd_t * (z - m_t)
        return torch.where(h > 1e-6, avg, inst)


@pytest.mark.parametrize("steps", [1, 2])
def test_the_exact_average_velocity_maps_noise_to_the_data_law(steps):
    model = GaussianMeanFlow(mu=1.5, s=0.5)
    noise = torch.randn(4096, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    labels = torch.zeros(4096, dtype=torch.long)
    x = MeanFlowLoop(steps).bind("meanflow")(model, noise, labels)
    assert x.mean().item() == pytest.approx(1.5, abs=0.01) and x.std().item() == pytest.approx(0.5, abs=0.01)
    torch.testing.assert_close(x, 1.5 + 0.5 * noise, rtol=1e-4, atol=1e-4)  # the transport itself


def test_the_exact_average_velocity_satisfies_the_meanflow_identity():
    """u = v(z, t) - (t - r) du/dt with du/dt along the marginal velocity: our JVP on the exact field."""
    model = GaussianMeanFlow(mu=1.5, s=0.5)
    mf = MeanFlow()
    mf.attach(model)
    z = torch.randn(8, 4, 8, 8, generator=torch.Generator().manual_seed(1))
    t = torch.tensor([0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.95])
    r = torch.tensor([0.1, 0.0, 0.3, 0.2, 0.1, 0.0, 0.1, 0.5])
    tr = torch.stack([t, r], dim=1)
    y = torch.zeros(8, dtype=torch.long)
    v = model(z, time_input("meanflow", t, t), y)
    u, dudt = mf.jvp(z, tr, y, torch.zeros_like(y), v)
    torch.testing.assert_close(u, v - (t - r)[:, None, None, None] * dudt, rtol=1e-4, atol=1e-4)


def test_our_imf_variant_trains_and_samples_with_its_conditions():
    m = _tiny("imf")
    assert m.config["conditions"] == "imf" and not hasattr(m, "h_embedder")
    imf = MeanFlow(variant="imf-adaln")
    imf.attach(m)
    x, e, _, y = _batch()
    tr = imf.draw_timesteps(4, generator=torch.Generator().manual_seed(3))
    out = imf.training_losses(lambda *a, **k: m(*a, **k), x, tr, {"y": y, "force_drop_ids": None}, noise=e)
    out["loss"].mean().backward()
    assert all(p.grad is not None for n, p in m.named_parameters() if p.requires_grad and "y_embedder" not in n)
    m.eval()
    seen = []
    loop = MeanFlowLoop(2, interval=(0.1, 0.9)).bind("imf", cfg_scale=3.0)
    loop(lambda z, tin, y: seen.append(tin) or m(z, tin, y), e, y)
    assert len(seen) == 2 and seen[0][0].tolist() == pytest.approx([1.0, 0.5, 3.0, 0.1, 0.9])
    with pytest.raises(ValueError, match="needs a MeanFlow model"):
        MeanFlowLoop(1).bind("t")


def test_compiled_blocks_and_activation_checkpointing_give_the_same_loss_and_gradient():
    """The JVP pass runs the compiled blocks eager (torch.compiler.set_stance) and skips checkpointing (no
    autograd); the gradient pass goes through both: the same loss and gradients as the plain model."""
    from dit_pipeline.train.speed import regional_compile

    x, e, tr, y = _batch()
    kw = {"y": y, "force_drop_ids": torch.tensor([1, 0, 0, 0])}
    results = []
    for variant in ("plain", "compiled", "checkpointed"):
        m = _tiny()
        if variant == "compiled":
            regional_compile(m, backend="eager")
        if variant == "checkpointed":
            m.set_grad_checkpointing(True)
        mf = MeanFlow(omega=0.6, kappa=0.3)
        mf.attach(m)
        loss = mf.training_losses(m, x, tr, kw, noise=e)["loss"]
        loss.mean().backward()
        results.append((loss.detach(), [p.grad for p in m.parameters() if p.grad is not None]))
    for loss, grads in results[1:]:
        torch.testing.assert_close(loss, results[0][0], rtol=1e-5, atol=1e-6)
        for a, b in zip(grads, results[0][1]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
