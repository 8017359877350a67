"""NanoGen's REG and internal guidance (issue 44 item 4), each compared with NanoGen's code transcribed below from
End2End-Diffusion/diffusion-bench (file and lines at each step), independently of dit/, on tiny random models:
- the network with REG's class token and internal guidance's base head (src/stage2/models/DDT.py), loaded from a
  NanoGen file unchanged;
- the REG and base-head loss (src/stage2/transport/transport.py, src/stage2/engine.py), with velocity and x
  prediction;
- the sampler evolving and guiding the class token (src/stage2/transport/sampler.py, src/utils/guidance_utils.py
  forward_with_cfg, src/eval/generation.py);
- internal guidance alone and with classifier-free guidance (src/utils/guidance_utils.py).
The helpers of the plain network's transcription come from tests/dit/test_incontext.py."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from dit_pipeline import dit
from dit_pipeline.dit.family import create_model
from dit_pipeline.dit.internal_guidance import InternalGuidance
from dit_pipeline.dit.protocols import PROTOCOLS
from dit_pipeline.dit.reg import REG_NOISE, REG_TARGET, initial_token
from dit_pipeline.sample.generate import (guided_model_fn, initial_noise, noise_level_fn, protocol_loop,
                                          protocol_model_fn, sample_latents)
from dit_pipeline.sample.plan import noise_generators
from tests._util import assert_close_at_scale
from tests.dit.test_incontext import (_attention, _fourier, _linear, _mlp, _nanogen_file, _patch, _rmsnorm,
                                      _random_model)

FP32_EPS = 2.0 ** -23
Z = 12  # the class token's width (DINOv2-B's 768)
HEADS = {"patch": 2, "enc_heads": 2, "dec_heads": 4, "depth": 2, "head_depth": 1}


# ---- NanoGen's network with REG and the base head, transcribed -----------------------------------------------------

def _rope_table(dim, vis_len, cond_len, extra, theta=10000.0):  # model_utils.py 14-30: extra_tokens rows in front
    d, side = dim // 2, int(vis_len ** 0.5)
    freqs = 1.0 / (theta ** (torch.arange(0, d, 2).float() / d))
    base = torch.outer(torch.arange(side).float(), freqs)
    vis = torch.cat([base[:, None].expand(-1, side, -1), base[None, :].expand(side, -1, -1)], dim=-1).reshape(vis_len, d)
    angles = torch.cat([torch.zeros(extra, dim // 2), vis, torch.zeros(cond_len, dim // 2)]).repeat_interleave(2, -1)
    return angles.cos(), angles.sin()


def _final(sd, p, h, c):  # DDTFinalLayer.forward (DDT.py 55-63)
    shift, scale = _linear(sd, f"{p}.adaln_modulation.1", F.silu(c)).chunk(2, dim=-1)
    m = _rmsnorm(h, sd[f"{p}.norm.weight"]) * (1 + scale) + shift
    if f"{p}.cls_linear.weight" in sd:
        return _linear(sd, f"{p}.linear", m[:, 1:]), _linear(sd, f"{p}.cls_linear", m[:, 0])
    return _linear(sd, f"{p}.linear", m)


def _unpatchify(out, c, patch):  # DDT.py 167-171
    side = int(out.shape[1] ** 0.5)
    out = out.reshape(out.shape[0], side, side, patch, patch, c).permute(0, 5, 1, 3, 2, 4)
    return out.reshape(out.shape[0], c, side * patch, side * patch)


def nanogen_forward(sd, x, t, *, patch, enc_heads, dec_heads, depth, head_depth, label=None, text=None,
                    text_mask=None, cls_t=None, base_depth=None):
    """DiTwDDTHead.forward (DDT.py 198-226) / DiTwDDTHeadIG.forward (240-274), _build_sequence (173-186),
    _build_attn_mask (188-196); returns (x, [x_base], [cls_pred]) as NanoGen's."""
    n_vis, s = (x.shape[-1] // patch) ** 2, int(cls_t is not None)
    seq = []
    if cls_t is not None:  # 176-178: cls_in_norm_enc(cls_in_proj_enc(cls_t)) in front
        seq.append(_rmsnorm(_linear(sd, "cls_in_proj_enc", cls_t), sd["cls_in_norm_enc.weight"]).unsqueeze(1))
    seq.append(_patch(sd, "s_embedder", x, patch))
    t_base, t_tokens = _fourier(sd, "t_embedder", t)
    seq.append(t_tokens)
    if label is not None:
        seq.append(sd["ctx_embedder.learnable_tokens"] + sd["ctx_embedder.embedding_table.weight"][label].unsqueeze(1))
    else:
        seq.append(_linear(sd, "ctx_embedder.proj", _rmsnorm(text, sd["ctx_embedder.norm.weight"])))
    seq = torch.cat(seq, dim=1)
    mask = torch.ones((seq.shape[0], seq.shape[1]))
    if text_mask is not None:
        mask[:, -text_mask.shape[1]:] = text_mask
    attn_mask = (1.0 - mask[:, None, None, :]) * torch.finfo(seq.dtype).min
    d, dh = seq.shape[-1], sd["x_embedder.proj.weight"].shape[0]
    enc = _rope_table(d // enc_heads, n_vis, seq.shape[1] - n_vis - s, s)  # RoPE(..., extra_tokens=int(enable_reg))
    dec = _rope_table(dh // dec_heads, n_vis, 0, s)
    x_base = None
    for i in range(depth):
        p = f"blocks.{i}"
        seq = seq + _attention(sd, f"{p}.attn", _rmsnorm(seq, sd[f"{p}.norm1.weight"]), enc_heads, *enc, attn_mask)
        seq = seq + _mlp(sd, f"{p}.mlp", _rmsnorm(seq, sd[f"{p}.norm2.weight"]))
        if base_depth is not None and i + 1 == base_depth:  # 250-251
            x_base = seq[:, s:s + n_vis, :]
    c = F.silu(t_base + seq[:, :s + n_vis, :])
    c = _linear(sd, "s_projector", c) if "s_projector.weight" in sd else c
    h = _patch(sd, "x_embedder", x, patch)
    if cls_t is not None:  # 210-212
        h = torch.cat([_rmsnorm(_linear(sd, "cls_in_proj_dec", cls_t), sd["cls_in_norm_dec.weight"]).unsqueeze(1), h], 1)
    for i in range(depth, depth + head_depth):
        p = f"blocks.{i}"
        mod = _linear(sd, f"{p}.adaln_modulation.1", F.silu(c)).chunk(6, dim=-1)
        h = h + mod[2] * _attention(sd, f"{p}.attn", _rmsnorm(h, sd[f"{p}.norm1.weight"]) * (1 + mod[1]) + mod[0],
                                    dec_heads, *dec, None)
        h = h + mod[5] * _mlp(sd, f"{p}.mlp", _rmsnorm(h, sd[f"{p}.norm2.weight"]) * (1 + mod[4]) + mod[3])
    out = _final(sd, "final_layer", h, c)
    out, cls_pred = out if cls_t is not None else (out, None)
    result = [_unpatchify(out, x.shape[1], patch)]
    if x_base is not None:  # 267-269: the base head conditioned on its own input
        xb = F.silu(t_base + x_base)
        result.append(_unpatchify(_final(sd, "base_final_layer", xb, xb), x.shape[1], patch))
    if cls_pred is not None:
        result.append(cls_pred)
    return tuple(result)


def _heads_model(seed, **overrides):
    model = _random_model(seed, reg_dim=Z, **overrides)
    with torch.no_grad():  # the zero-initialised REG and base layers random too
        for name, p in model.named_parameters():
            if name.startswith(("final_layer.cls_linear", "base_final_layer")) and "norm" not in name:
                p.copy_(0.3 * torch.randn_like(p))
    return model.eval()


def test_a_nanogen_reg_file_loads_and_gives_nanogens_outputs_with_the_base_head(tmp_path):
    model = _heads_model(0, base_model_depth=1)
    g = torch.Generator().manual_seed(1)
    x, t, cls = torch.randn(4, 4, 8, 8, generator=g), torch.rand(4, generator=g), torch.randn(4, Z, generator=g)
    y = torch.tensor([0, 3, 4, 5])
    sd = model.state_dict()
    want = nanogen_forward(sd, x, t, label=y, cls_t=cls, base_depth=1, **HEADS)
    with torch.no_grad():
        got = model(x, t, y, cls_t=cls, return_base=True)
        plain = model(x, t, y, cls_t=cls)
    assert min(w.abs().max() for w in want) > 1.0  # every output carries signal
    for a, b in zip(got, want):
        assert_close_at_scale(a, b, rel=64 * FP32_EPS)
    assert len(plain) == 2 and torch.equal(plain[0], got[0]) and torch.equal(plain[1], got[2])

    # NanoGen's own file: REG's width from its tensors; the base head (its depth unrecorded) dropped
    ours, info = _loaded(_nanogen_file(model, tmp_path)[0])
    assert info["model_config"]["reg_dim"] == Z and "base_model_depth" not in info["model_config"]
    assert info["dropped"] == ["base_final_layer"] and info["flow_convention"] == "repa"
    with torch.no_grad():
        again = ours(x, t, y, cls_t=cls)
    assert torch.equal(again[0], got[0]) and torch.equal(again[1], got[2])
    with pytest.raises(ValueError, match=r"takes cls_t of shape \[4, 12\]"):
        ours(x, t, y)


def test_a_text_reg_model_masks_padding_as_nanogen():
    model = _heads_model(2, conditioning="text", text_dim=10, num_c_tokens=5)
    g = torch.Generator().manual_seed(3)
    x, t, cls = torch.randn(2, 4, 8, 8, generator=g), torch.rand(2, generator=g), torch.randn(2, Z, generator=g)
    text, mask = torch.randn(2, 5, 10, generator=g), torch.tensor([[1, 1, 1, 0, 0], [1, 0, 0, 0, 0]])
    want = nanogen_forward(model.state_dict(), x, t, text=text, text_mask=mask, cls_t=cls, **HEADS)
    with torch.no_grad():
        got = model(x, t, text=text, text_mask=mask.bool(), cls_t=cls)
    for a, b in zip(got, want):
        assert_close_at_scale(a, b, rel=64 * FP32_EPS)


def _loaded(path):
    sd, info = dit.load_dit_weights(path)
    return dit.build_model_from_weights(sd, info).eval(), info


# ---- the loss --------------------------------------------------------------------------------------------------

def nanogen_loss(net, x1, t, x0, cls_clean, cls_x0, *, reg_coeff, prediction, base_coeff=None, t_eps=0.05):
    """Transport.training_losses (transport.py 45-100: sample 36-40, the cls noising 54-59, the loss 80-92,
    convert_model_pred 105-111) and the total of engine.py 151-160, in NanoGen's time (t = 1 noise)."""
    def e(v):
        return v.view(v.shape[0], *[1] * (x1.dim() - 1))

    def convert(out, xt, tt):
        return out if prediction == "velocity" else (xt - out) / tt.view(-1, *[1] * (xt.dim() - 1)).clamp_min(t_eps)

    xt = (1 - e(t)) * x1 + e(t) * x0
    vt = (xt - x1) / e(t).clamp_min(t_eps)
    cls_t = (1 - t[:, None]) * cls_clean + t[:, None] * cls_x0
    v_cls = (cls_t - cls_clean) / t[:, None].clamp_min(t_eps)
    outs = net(xt, t, cls_t)
    loss = (convert(outs[0], xt, t) - vt) ** 2
    loss_base = None
    if base_coeff is not None:
        loss_base = (convert(outs[1], xt, t) - vt) ** 2
        loss = loss + base_coeff * loss_base
    loss_reg = reg_coeff * F.mse_loss(convert(outs[-1], cls_t, t), v_cls)
    return loss.mean() + loss_reg, loss_reg, None if loss_base is None else loss_base.mean()


@pytest.mark.parametrize("prediction", ["velocity", "x"])
def test_the_reg_and_base_losses_are_nanogens(prediction):
    model = _heads_model(4, base_model_depth=1)
    g = torch.Generator().manual_seed(5)
    x1, x0 = torch.randn(6, 4, 8, 8, generator=g), torch.randn(6, 4, 8, 8, generator=g)
    cls, cls_x0 = torch.randn(6, Z, generator=g), torch.randn(6, Z, generator=g)
    t_ng = torch.rand(6, generator=g) * 0.9 + 0.05
    t_ng[0] = 0.01  # below t_eps: the clamped target
    y = torch.tensor([0, 1, 2, 3, 4, 5])

    def nanogen_net(xt, t, cls_t):  # NanoGen's network: its time, its outputs (x, x_base, cls)
        return model(xt, t, y, cls_t=cls_t, return_base=True)

    sign = -1.0 if prediction == "velocity" else 1.0  # a velocity flips with the time direction, a clean image not

    def ours_net(xt, t, y=None, cls_t=None, return_base=False):  # the same network in SiT's time (t = 1 data)
        return tuple(sign * o for o in model(xt, 1 - t, y, cls_t=cls_t, return_base=return_base))

    with torch.no_grad():
        total, reg, base = nanogen_loss(nanogen_net, x1, t_ng, x0, cls, cls_x0, reg_coeff=0.03,
                                        prediction=prediction, base_coeff=0.5)
        flow = dit.create_flow(prediction="v" if prediction == "velocity" else "x",
                               v_target="clamped" if prediction == "velocity" else "plain",
                               reg_coeff=0.03, base_model_coeff=0.5)
        terms = flow.training_losses(ours_net, x1, 1 - t_ng, {"y": y, REG_TARGET: cls, REG_NOISE: cls_x0}, noise=x0)
    assert set(terms) == {"loss", "mse", "base", "reg"} and reg > 1e-3 and base > 1e-3
    assert_close_at_scale(terms["loss"].mean(), total, rel=1e-5)
    assert_close_at_scale(0.03 * terms["reg"].mean(), reg, rel=1e-5)  # NanoGen logs reg_coeff x mse as loss_reg
    assert_close_at_scale(terms["base"].mean(), base, rel=1e-5)


# ---- the sampler -------------------------------------------------------------------------------------------------

def nanogen_forward_with_cfg(model, x, t, cfg_scale, cfg_interval, **kw):
    """guidance_utils.py 14-45 for a REG model: x and the class token guided where t_min <= t <= t_max."""
    half = x[: len(x) // 2]
    out, cls_out = model(torch.cat([half, half]), t, kw["context"], cls_t=kw["cls_t"])
    cond, uncond = torch.split(out, len(out) // 2)
    th = t[: len(t) // 2]
    inside = ((th >= cfg_interval[0]) & (th <= cfg_interval[1]))
    g = torch.where(inside.view(-1, 1, 1, 1), uncond + cfg_scale * (cond - uncond), cond)
    cc, cu = torch.split(cls_out, len(cls_out) // 2)
    gc = torch.where(inside.view(-1, 1), cu + cfg_scale * (cc - cu), cc)
    return torch.cat([g, g]), torch.cat([gc, gc])


def nanogen_sample(model, z, cls_init, y, null, *, steps, shift, cfg_scale, cfg_interval):
    """Sampler.sample_ode (sampler.py 10-34) with the drift of transport.py 118-122 (velocity: as it is) on the
    doubled batch of generation.py 150-166 (z, cls_init doubled; context [y; null]); the conditional half."""
    t_grid = torch.linspace(1.0, 0.0, steps + 1)
    t_grid = shift * t_grid / (1 + (shift - 1) * t_grid)
    x, cls = torch.cat([z, z]), torch.cat([cls_init, cls_init])
    context = torch.cat([y, torch.full_like(y, null)])
    for i in range(steps):
        h = t_grid[i] - t_grid[i + 1]
        tb = torch.full((x.shape[0],), t_grid[i].item())
        d_x, d_cls = nanogen_forward_with_cfg(model, x, tb, cfg_scale, cfg_interval, context=context, cls_t=cls)
        x, cls = x - h * d_x, cls - h * d_cls
    return x[: len(z)]


def test_the_sampler_evolves_and_guides_the_class_token_as_nanogen(tmp_path):
    ours, info = _loaded(_nanogen_file(_heads_model(6), tmp_path)[0])
    p = PROTOCOLS["nanogen"].with_overrides(count=6, scale=2.5)  # cfg on noise levels [0, 0.9]
    shape, idx = (4, 8, 8), [0, 1, 2]
    y = torch.tensor([0, 2, 4])
    loop = protocol_loop(p, latent_shape=shape, convention="repa")
    fn = protocol_model_fn(p, ours, objective="flow", convention="repa")
    with torch.no_grad():
        got = sample_latents(ours, loop, y, noise_generators(7, idx), model_fn=fn)
        gens = noise_generators(7, idx)  # the same draws: each sample's image noise, then its class token
        z = initial_noise(gens, shape, torch.device("cpu"))
        cls_init = initial_token(gens, Z, torch.device("cpu"))
        want = nanogen_sample(ours, z, cls_init, y, 5, steps=6, shift=(256 / 4096) ** 0.5, cfg_scale=2.5,
                              cfg_interval=(0.0, 0.9))
        without = nanogen_sample(ours, z, torch.zeros_like(cls_init), y, 5, steps=6, shift=(256 / 4096) ** 0.5,
                                 cfg_scale=2.5, cfg_interval=(0.0, 0.9))
    assert_close_at_scale(got, want, rel=1e-4)  # NanoGen's float32 grid and steps against ours in float64
    assert (without - want).abs().max() > 1e-2 * want.abs().max()  # the class token matters


# ---- internal guidance -----------------------------------------------------------------------------------------

def nanogen_ig(model, x, t, ig_scale, ig_interval, **kw):
    """forward_with_internalguidance (guidance_utils.py 56-80): the conditional half, the class token unguided."""
    half, th = x[: len(x) // 2], t[: len(t) // 2]
    full, base, cls = model(half, th, kw["context"][: len(half)], cls_t=kw["cls_t"][: len(half)], return_base=True)
    inside = ((th >= ig_interval[0]) & (th <= ig_interval[1])).view(-1, 1, 1, 1)
    out = torch.where(inside, base + ig_scale * (full - base), full)
    return torch.cat([out, out]), torch.cat([cls, cls])


def nanogen_ig_and_cfg(model, x, t, ig_scale, cfg_scale, ig_interval, cfg_interval, uncond_ig_scale=None, **kw):
    """forward_with_ig_and_cfg (guidance_utils.py 83-140)."""
    uncond_ig_scale = ig_scale if uncond_ig_scale is None else uncond_ig_scale
    full, base, cls = model(x, t, kw["context"], cls_t=kw["cls_t"], return_base=True)
    full_c, full_u = full.chunk(2)
    base_c, base_u = base.chunk(2)
    th = t[: len(t) // 2]
    ig_in = ((th >= ig_interval[0]) & (th <= ig_interval[1])).view(-1, 1, 1, 1)
    ig_c = torch.where(ig_in, base_c + ig_scale * (full_c - base_c), full_c)
    ig_u = torch.where(ig_in, base_u + uncond_ig_scale * (full_u - base_u), full_u)
    cfg_in = ((th >= cfg_interval[0]) & (th <= cfg_interval[1]))
    out = torch.where(cfg_in.view(-1, 1, 1, 1), ig_u + cfg_scale * (ig_c - ig_u), ig_c)
    cc, cu = cls.chunk(2)
    gc = torch.where(cfg_in.view(-1, 1), cu + cfg_scale * (cc - cu), cc)
    return torch.cat([out, out]), torch.cat([gc, gc])


@pytest.mark.parametrize("level", [0.5, 0.95, 0.1])  # inside both intervals; outside CFG's; outside IG's
def test_internal_guidance_is_nanogens_rule(level):
    model = _heads_model(8, base_model_depth=1)
    g = torch.Generator().manual_seed(9)
    x, cls = torch.randn(3, 4, 8, 8, generator=g), torch.randn(3, Z, generator=g)
    y, null = torch.tensor([1, 2, 3]), torch.full((3,), 5)
    t = torch.full((3,), level, dtype=torch.float64)  # REPA's time: the noise level itself
    ig = InternalGuidance(scale=1.8, interval=(0.2, 1.0), uncond_scale=1.3)
    level_of = noise_level_fn("flow", "repa")
    kw2 = {"context": torch.cat([y, null]), "cls_t": torch.cat([cls, cls])}
    with torch.no_grad():
        both = guided_model_fn(model, cfg_scale=2.5, guidance_interval=(0.0, 0.9), noise_level=level_of,
                               internal=ig, cfg_channels="all")(x, t, y, cls_t=cls)
        alone = guided_model_fn(model, cfg_scale=1.0, noise_level=level_of, internal=ig)(x, t, y, cls_t=cls)
        want_both = nanogen_ig_and_cfg(model, torch.cat([x, x]), torch.cat([t, t]).float(), 1.8, 2.5, (0.2, 1.0),
                                       (0.0, 0.9), 1.3, **kw2)
        want_alone = nanogen_ig(model, torch.cat([x, x]), torch.cat([t, t]).float(), 1.8, (0.2, 1.0), **kw2)
        plain = model(x, t.float(), y, cls_t=cls)
    for got, want in ((both, want_both), (alone, want_alone)):
        assert_close_at_scale(got[0], want[0][:3], rel=64 * FP32_EPS)
        assert_close_at_scale(got[1], want[1][:3], rel=64 * FP32_EPS)
    if level >= 0.2:
        assert (alone[0] - plain[0]).abs().max() > 1e-2 * plain[0].abs().max()  # the rule acted
    else:
        assert torch.equal(alone[0], plain[0])
    # the same rule as protocol data: a protocol row's internal guidance
    row = dataclasses.replace(PROTOCOLS["nanogen"], guidance=dataclasses.replace(
        PROTOCOLS["nanogen"].guidance, scale=2.5, internal=ig))
    with torch.no_grad():
        from_row = protocol_model_fn(row, model, objective="flow", convention="repa")(x, t, y, cls_t=cls)
    assert torch.equal(from_row[0], both[0]) and torch.equal(from_row[1], both[1])
    assert row.record()["guidance"]["internal"] == {"scale": 1.8, "interval": (0.2, 1.0), "uncond_scale": 1.3}


def test_internal_guidance_needs_the_base_head():
    with pytest.raises(ValueError, match="internal guidance needs a model with its base head"):
        guided_model_fn(_heads_model(10), cfg_scale=1.0, noise_level=noise_level_fn("flow"),
                        internal=InternalGuidance(2.0))
    with pytest.raises(ValueError, match="low < high"):
        InternalGuidance(2.0, (0.5, 0.5))
    assert not InternalGuidance(1.0).active and InternalGuidance(1.0, uncond_scale=0.5).active  # NanoGen's use_ig
    with torch.device("meta"):
        m = create_model("ddt-en28d1152hd72-dn2d2048hd128", input_size=32, reg_dim=768, base_model_depth=8)
    base = {k: v for k, v in m.config.items() if k not in ("reg_dim", "base_model_depth")}
    # one more token in both sequences (28 encoder blocks on 256 + 1 + 12 tokens, 2 head blocks on 257, as
    # tests/dit/test_incontext.py counts a block), s_projector and the final adaLN on it, its two input projections
    # and cls_linear; the base head's adaLN and linear on the 256 image tokens
    t, d, dh, z = 256, 1152, 2048, 768

    def enc(n):
        return n * 4 * d * d + 2 * n * n * d + n * 3 * d * 3072

    def head(n):
        return n * 6 * dh * dh + n * 4 * dh * dh + 2 * n * n * dh + n * 3 * dh * 5461

    delta = (28 * (enc(t + 13) - enc(t + 12)) + 2 * (head(t + 1) - head(t)) + d * dh + 2 * dh * dh
             + z * (d + 2 * dh) + t * (2 * d * d + d * 2 * 2 * 4))
    assert dit.forward_macs(m.config) - dit.forward_macs(base) == delta


def test_a_row_may_write_internal_guidance_as_a_tuple():
    from dit_pipeline.dit.internal_guidance import as_internal

    assert as_internal((1.8, 0.2, 1.0)) == InternalGuidance(1.8, (0.2, 1.0))
    assert as_internal((1.8, 0.2, 1.0, 1.3)) == InternalGuidance(1.8, (0.2, 1.0), 1.3)
    assert as_internal(None) is None
