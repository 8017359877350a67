"""NanoGen's MeanFlow (`--objective meanflow --mf-rule nanogen --v-target clamped`, dit/meanflow.py) against NanoGen's
own TransportMF, transcribed here from its code (End2End-Diffusion/diffusion-bench at 4848f0c, lines named at each
step) independently of dit/meanflow.py, on the same in-context DiT-DH, noise, times and dropout: the flow-matching
step and the MeanFlow step, kappa 0.0 and 0.5, class labels and text features; its one coin per step; and its
one-step sampling (the protocol rows nanogen/mf-*) against NanoGen's sampler loop.

NanoGen's time t is the noise level (t = 1 noise; x1 the data, x0 the noise), as our MeanFlow's. Its MeanFlow network
is called as model(x, h, t_abs=t, context=..., attn_mask=...) (src/stage2/models/DDT.py l.173-185: the first time
input embeds h = t - r, `t_abs_embedder` the absolute t); ours takes the time input (t, h) (dit/conditions.py).
`nano_net` calls the same network with NanoGen's signature; that our network is NanoGen's on NanoGen's weights is
tests/dit/test_incontext.py's.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from dit_pipeline.dit.family import create_model
from dit_pipeline.dit.meanflow import MeanFlow
from dit_pipeline.dit.protocols import PROTOCOLS
from dit_pipeline.sample.generate import protocol_loop, protocol_model_fn, sample_latents
from tests._util import FP32_EPS, assert_close_at_scale

T_EPS, NORM_P, NORM_EPS = 0.05, 1.0, 0.01  # src/configs/stage2.py l.22-31 (MeanflowConfig), l.39 (t_eps)
N, CPU = 4, torch.device("cpu")
TEXT_DIM, TEXT_LEN = 6, 5


def _net(text: bool):
    torch.manual_seed(0)
    kw = {"conditioning": "text", "text_dim": TEXT_DIM, "num_c_tokens": TEXT_LEN} if text else {"num_classes": 5}
    m = create_model("ddt-en28d1152hd72-dn2d2048hd128", input_size=8, in_channels=4, depth=1, hidden_size=32,
                     num_heads=2, head_depth=1, head_hidden_size=32, head_num_heads=2, num_t_tokens=2,
                     conditions="meanflow", **kw)
    with torch.no_grad():  # zero-initialised adaLN and output layers: give every path a value
        g = torch.Generator().manual_seed(1)
        for p in m.parameters():
            if p.requires_grad:
                p.add_(0.1 * torch.randn(p.shape, generator=g))
    return m.train()


def _conditions(text: bool):
    """(our kwargs builder, NanoGen's model_kwargs, NanoGen's model_kwargs_null) of one batch."""
    g = torch.Generator().manual_seed(2)
    if not text:
        y = torch.tensor([0, 3, 1, 4])
        cond = SimpleNamespace(batch=SimpleNamespace(labels=y))
        return cond, {"context": y, "attn_mask": None}, {"context": torch.full((N,), 5), "attn_mask": None}
    feats = torch.randn(N, TEXT_LEN, TEXT_DIM, generator=g)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 0, 0, 0]], dtype=torch.bool)
    # the empty prompt, padded to the encoder's max length as NanoGen's tokenizer pads it (src/stage2/utils.py
    # get_null_cond l.60-68: encode_text([""]) expanded to the batch)
    null, null_mask = torch.randn(TEXT_LEN, TEXT_DIM, generator=g), torch.tensor([True, False, False, False, False])
    cond = SimpleNamespace(batch=SimpleNamespace(text=feats, text_mask=mask), null=(null, null_mask))
    return cond, {"context": feats, "attn_mask": mask}, {"context": null.expand(N, -1, -1),
                                                          "attn_mask": null_mask.expand(N, -1)}


def nano_net(net, text: bool):
    """model(x, h, t_abs=t, context, attn_mask): NanoGen's call (transport.py l.169) of our network."""
    def call(x, h, t_abs, context, attn_mask):
        tin = torch.stack([t_abs, h], dim=1)
        if text:
            return net(x, tin, text=context, text_mask=attn_mask)
        return net(x, tin, context, force_drop_ids=torch.zeros_like(context))
    return call


# ---- NanoGen's TransportMF, transcribed ---------------------------------------------------------------------------

def _e(t, x):  # transport.py l.10-11 _expand_t
    return t.view(t.size(0), *([1] * (x.dim() - 1)))


def nano_cfg_dropout(kw, kw_null, mask):  # src/stage2/utils.py l.52-57, the mask given
    return {k: torch.where(mask.view(-1, *([1] * (v.ndim - 1))), kw_null[k], v) if v is not None else None
            for k, v in kw.items()}


def nano_guided_velocity(net, z_t, t, v_t, kw, kw_null, omega, kappa, t_start=0.0, t_end=1.0):
    """transport.py l.150-165 (u_fn l.167-181: the output as it is for prediction 'velocity', l.105-108)."""
    if omega == 1.0 and kappa == 0.0:
        return v_t
    h = torch.zeros_like(t)
    with torch.no_grad():
        v_u = net(z_t, h, t, **kw_null)
        if kappa == 0.0:
            v_g = v_u + omega * (v_t - v_u)
        else:
            v_c = net(z_t, h, t, **kw)
            v_g = omega * v_t + (1.0 - omega - kappa) * v_u + kappa * v_c
    active = (t >= t_start) & (t <= t_end)
    return torch.where(_e(active, v_t), v_g, v_t)


def nano_adaptive_weight(loss):  # transport.py l.147-148
    return loss / (loss.detach() + NORM_EPS) ** NORM_P


def nano_fm_loss(net, x1, x0, t, kw, kw_null, mask, omega, kappa):
    """transport.py l.195-226 and l.244 (`_training_losses_fm`): t one draw, h = 0; (the per-sample loss, its
    unweighted error `orig_mf_loss`)."""
    z_t = (1 - _e(t, x1)) * x1 + _e(t, x1) * x0
    v_t = (z_t - x1) / _e(t, z_t).clamp_min(T_EPS)
    v_g = nano_guided_velocity(net, z_t, t, v_t, kw, kw_null, omega, kappa)
    kw_dropped = nano_cfg_dropout(kw, kw_null, mask)
    v_g = torch.where(_e(mask, v_t), v_t, v_g)
    output = net(z_t, torch.zeros_like(t), t, **kw_dropped)
    loss = ((output - v_g.detach()) ** 2).sum(dim=(1, 2, 3))
    return nano_adaptive_weight(loss), loss.detach()


def nano_mf_loss(net, x1, x0, t, r, kw, kw_null, mask, omega, kappa):
    """transport.py l.251-294 and l.315 (`_training_losses_mf`): t, r the max and min of two draws (l.258-262; shift
    1), the JVP along (v_g, 1, 0) under the math kernel, V = u + (t - r) sg(du/dt); (the per-sample loss, its
    unweighted error)."""
    z_t = (1 - _e(t, x1)) * x1 + _e(t, x1) * x0
    v_t = (z_t - x1) / _e(t, z_t).clamp_min(T_EPS)
    v_g = nano_guided_velocity(net, z_t, t, v_t, kw, kw_null, omega, kappa)
    kw_dropped = nano_cfg_dropout(kw, kw_null, mask)
    v_g = torch.where(_e(mask, v_t), v_t, v_g)

    def u_fn(z, t_, r_):
        return net(z, t_ - r_, t_, **kw_dropped)
    with sdpa_kernel(SDPBackend.MATH):
        u_pred, du_dt = torch.func.jvp(u_fn, (z_t, t, r), (v_g, torch.ones_like(t), torch.zeros_like(r)))
    V = u_pred + _e(t - r, z_t) * du_dt.detach()
    loss = ((V - v_g.detach()) ** 2).sum(dim=(1, 2, 3))
    return nano_adaptive_weight(loss), loss.detach()


# ---------------------------------------------------------------------------------------------------------------

def _batch():
    g = torch.Generator().manual_seed(3)
    x1, x0 = 1.5 * torch.randn(N, 4, 8, 8, generator=g), torch.randn(N, 4, 8, 8, generator=g)
    # noise levels: one below t_eps (the clamp acts), one dropped sample (the second)
    t = torch.tensor([0.9, 0.62, 0.3, 0.04])
    r = torch.tensor([0.2, 0.1, 0.3, 0.01])  # the third pair a tie: h = 0 inside a MeanFlow step
    mask = torch.tensor([False, True, False, False])
    return x1, x0, t, r, mask


def _ours(net, text: bool, cond, kappa: float, mask):
    mf = MeanFlow(rule="nanogen", v_target="clamped", t_eps=T_EPS, omega=1.0, kappa=kappa, norm_p=NORM_P,
                  norm_eps=NORM_EPS)
    conditioning = net.conditioning(*cond.null) if text else net.conditioning()
    mf.attach(net, conditioning)
    return mf, conditioning.batch_kwargs(cond.batch, mask.long(), CPU)


@pytest.mark.parametrize("text", [False, True], ids=["class", "text"])
@pytest.mark.parametrize("kappa", [0.0, 0.5])
@pytest.mark.parametrize("step", ["fm", "mf"])
def test_our_loss_and_gradient_are_nanogens_transport_mf(step, kappa, text):
    net = _net(text)
    cond, kw, kw_null = _conditions(text)
    x1, x0, t, r, mask = _batch()
    if step == "fm":
        r = t  # a flow-matching step: one draw of t, h = 0
    nano = nano_net(net, text)
    want, err = (nano_fm_loss(nano, x1, x0, t, kw, kw_null, mask, 1.0, kappa) if step == "fm" else
                 nano_mf_loss(nano, x1, x0, t, r, kw, kw_null, mask, 1.0, kappa))
    want.mean().backward()  # engine.py l.151: loss_dict["loss"].mean()
    g_want = {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}
    net.zero_grad()
    mf, kwargs = _ours(net, text, cond, kappa, mask)
    got = mf.training_losses(net, x1, torch.stack([t, r], dim=1), kwargs, noise=x0)
    got["loss"].mean().backward()
    g_got = {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}
    # the error before the adaptive weight (NanoGen's orig_mf_loss; our mse is it per element), then the weighted
    # loss, near 1 for every sample (err / (err + 0.01)); a chain of float32 network passes on either side
    assert_close_at_scale(got["mse"] * x1[0].numel(), err, rel=1e-5, what="the error")
    assert_close_at_scale(got["loss"], want, rel=1e-5, what="per-sample loss")
    assert err.min() > 1.0 and err.max() - err.min() > 0.05 * err.max()  # the samples differ
    assert g_got.keys() == g_want.keys() and max(float(g.abs().max()) for g in g_want.values()) > 1e-3
    for name, g in g_want.items():
        assert_close_at_scale(g_got[name], g, rel=1e-3, what=f"gradient of {name}")


def test_the_release_rule_differs_only_where_nanogens_target_is_clamped():
    """The same MeanFlow step under our default rule (the JAX release's target e - x): NanoGen's loss for the pairs
    whose noise level is at least t_eps, another one for the pair below it, so the comparison above is not vacuous."""
    net = _net(False)
    cond, kw, kw_null = _conditions(False)
    x1, x0, t, r, mask = _batch()
    _, want = nano_mf_loss(nano_net(net, False), x1, x0, t, r, kw, kw_null, mask, 1.0, 0.5)
    mf, kwargs = _ours(net, False, cond, 0.5, mask)
    release = MeanFlow(kappa=0.5, norm_p=NORM_P, norm_eps=NORM_EPS)
    release.attach(net)
    with torch.no_grad():
        got = release.training_losses(net, x1, torch.stack([t, r], 1), kwargs, noise=x0)["mse"] * x1[0].numel()
    above = t >= T_EPS
    assert_close_at_scale(got[above], want[above], rel=1e-5, what="at least t_eps")
    assert abs(float(got[~above] - want[~above])) > 0.1 * float(want[~above]), (got, want)


def test_one_coin_per_step_shared_by_every_rank():
    """transport.py l.142, l.187: one draw per step from a generator every rank seeds alike; a flow-matching step
    draws t once per sample (l.199, Transport.sample l.36-40), a MeanFlow step two (l.258-260)."""
    mf = MeanFlow(rule="nanogen", data_proportion=0.75)
    kinds = []
    for step in range(400):
        shared = [torch.Generator().manual_seed(10_000 + step) for _ in range(2)]
        ranks = [mf.draw_timesteps(64, generator=torch.Generator().manual_seed(step * 2 + k), shared=shared[k])
                 for k in range(2)]
        fm = [bool((tr[:, 0] == tr[:, 1]).all()) for tr in ranks]
        assert fm[0] == fm[1] and (fm[0] or all(bool((tr[:, 0] > tr[:, 1]).all()) for tr in ranks))
        kinds.append(fm[0])
    assert 0.68 < sum(kinds) / len(kinds) < 0.82  # fm_ratio 0.75
    fm_t = torch.cat([mf.draw_timesteps(4096, generator=torch.Generator().manual_seed(1),
                                        shared=torch.Generator().manual_seed(s)) for s in range(8)])
    one = fm_t[fm_t[:, 0] == fm_t[:, 1]][:, 0]
    logit = torch.log(one / (1 - one))  # one logit-normal draw: location -0.4 (the max of two would be above it)
    assert abs(float(logit.mean()) + 0.4) < 0.05 and abs(float(logit.std()) - 1.0) < 0.05
    assert mf.drop_labels(torch.tensor([0, 1, 0, 1])).tolist() == [0, 1, 0, 1]  # per sample (utils.py l.53)


# ---- sampling: the rows nanogen/mf-* -------------------------------------------------------------------------------

def nano_sample_ode(net, x, num_steps, shift, **kw):
    """src/stage2/transport/sampler.py l.10-34 (sample_ode, no REG token), the MeanFlow drift transport.py
    l.326-330 (u_fn: model(x, h, t_abs=t)), guidance disabled for MeanFlow (src/configs/stage2.py l.169-170)."""
    t_grid = torch.linspace(1.0, 0.0, num_steps + 1)
    t_grid = shift * t_grid / (1 + (shift - 1) * t_grid)
    for i in range(num_steps):
        h = t_grid[i] - t_grid[i + 1]
        h_batch = torch.full((x.shape[0],), h.item())
        t_batch = torch.full((x.shape[0],), t_grid[i].item())
        x = x - h * net(x, h_batch, t_batch, **kw)
    return x


@pytest.mark.parametrize("row, text", [
    ("nanogen/mf-ddt-en28d1152hd72-dn2d2048hd128-sdvae-mse-vpred-t4c8-kappa0.0", False),
    ("nanogen/mf-ddt-en28d1152hd72-dn2d2048hd128-sdvae-mse-vpred-t4c8-kappa0.5", False),
    ("nanogen/mf-t2i-ddt-en28d1152hd72-dn2d2048hd128-sdvae-mse-vpred-t4-kappa0.5", True)])
def test_the_protocol_rows_sample_as_nanogens_one_step_loop(row, text):
    """dit-sample's path for the row (its loop and network function, sample/generate.py) against NanoGen's sampler
    on the same initial noise: one step from noise level 1 to 0, unshifted for SD-VAE's 4x32x32 latents."""
    net = _net(text).eval()
    cond, kw, _ = _conditions(text)
    p = PROTOCOLS[row]

    def gens():  # sample b's noise from its own generator
        return [torch.Generator().manual_seed(4 + i) for i in range(N)]
    x = torch.stack([torch.randn(4, 8, 8, generator=g) for g in gens()])
    labels = {"text": kw["context"], "text_mask": kw["attn_mask"]} if text else kw["context"]
    conditioning = net.conditioning(*cond.null) if text else net.conditioning()
    loop = protocol_loop(p, latent_shape=(4, 32, 32))
    fn = protocol_model_fn(p, net, objective="meanflow", conditioning=conditioning)
    with torch.no_grad():
        ours = sample_latents(net, loop, labels, gens(), sampler="meanflow", model_fn=fn)
        want = nano_sample_ode(nano_net(net, text), x, 1, 1.0, context=kw["context"], attn_mask=kw["attn_mask"])
    assert (p.count, p.guidance.kind, p.grid.resolve_shift((4, 32, 32), None)) == (1, "none", 1.0)
    assert_close_at_scale(ours, want, rel=64 * FP32_EPS, what=row)
    assert (want - x).abs().max() > 0.1  # the network moved the noise
