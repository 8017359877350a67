"""NanoGen's in-context DiT-DH (dit/incontext.py): files in NanoGen's layout load unchanged through
dit.load_dit_weights and give the outputs of NanoGen's network, transcribed below from its code (github
End2End-Diffusion/diffusion-bench, src/stage2/models/DDT.py and src/stage2/models/model_utils.py, lines named at
each step) independently of dit/incontext.py, on the same random weights and inputs: class tokens (t4c8), text
tokens with a padding mask, and the MeanFlow variant."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from dit_pipeline import dit
from dit_pipeline.dit.family import create_model
from tests._util import assert_close_at_scale

FP32_EPS = 2.0 ** -23
TINY = {"input_size": 8, "in_channels": 4, "depth": 2, "hidden_size": 32, "num_heads": 2, "head_depth": 1,
        "head_hidden_size": 48, "head_num_heads": 4, "num_classes": 5}


# ---- NanoGen's network, transcribed ------------------------------------------------------------------------------

def _rmsnorm(x, weight, eps=1e-6):  # model_utils.py 50-60: float32 norm, cast back, times the weight
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).type_as(x) * weight


def _rope_table(dim, vis_len, cond_len, theta=10000.0):  # model_utils.py 14-30 (RoPE.__init__), extra_tokens 0
    d, side = dim // 2, int(vis_len ** 0.5)
    freqs = 1.0 / (theta ** (torch.arange(0, d, 2).float() / d))
    base = torch.outer(torch.arange(side).float(), freqs)
    vis = torch.cat([base[:, None].expand(-1, side, -1), base[None, :].expand(side, -1, -1)], dim=-1).reshape(vis_len, d)
    angles = torch.cat([vis, torch.zeros(cond_len, dim // 2)], dim=0).repeat_interleave(2, dim=-1)
    return angles.cos(), angles.sin()


def _rope(t, cos, sin):  # model_utils.py 7-11 (rotate_half) and 32-33 (RoPE.forward)
    pairs = t.reshape(*t.shape[:-1], -1, 2)
    half = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).reshape(t.shape)
    return t * cos + half * sin


def _attention(sd, p, x, heads, cos, sin, attn_mask):  # model_utils.py 63-86 (NormAttention)
    b, n, dim = x.shape
    hd = dim // heads

    def proj(name):
        return F.linear(x, sd[f"{p}.{name}.weight"], sd[f"{p}.{name}.bias"]).reshape(b, n, heads, hd).permute(0, 2, 1, 3)

    q, k, v = proj("q"), proj("k"), proj("v")
    q, k = _rmsnorm(q, sd[f"{p}.q_norm.weight"]), _rmsnorm(k, sd[f"{p}.k_norm.weight"])
    q, k = _rope(q, cos, sin), _rope(k, cos, sin)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask).permute(0, 2, 1, 3).reshape(b, n, dim)
    return F.linear(out, sd[f"{p}.proj.weight"], sd[f"{p}.proj.bias"])


def _mlp(sd, p, x):  # model_utils.py 36-47 (SwiGLUFFN)
    w = {k: (sd[f"{p}.{k}.weight"], sd[f"{p}.{k}.bias"]) for k in ("w1", "w2", "w3")}
    return F.linear(F.silu(F.linear(x, *w["w1"])) * F.linear(x, *w["w2"]), *w["w3"])


def _linear(sd, p, x):
    return F.linear(x, sd[f"{p}.weight"], sd[f"{p}.bias"])


def _fourier(sd, p, t):  # model_utils.py 89-108 (GaussianFourierEmbedding.forward with return_base_embed)
    t = t[:, None] * sd[f"{p}.W"][None, :] * 2 * torch.pi
    emb = torch.cat([torch.sin(t), torch.cos(t)], dim=-1)
    emb = _linear(sd, f"{p}.mlp.2", F.silu(_linear(sd, f"{p}.mlp.0", emb))).unsqueeze(1)
    return emb, sd[f"{p}.learnable_tokens"] + emb


def _patch(sd, p, x, patch):  # timm PatchEmbed: conv, flatten(2), transpose(1, 2)
    return F.conv2d(x, sd[f"{p}.proj.weight"], sd[f"{p}.proj.bias"], stride=patch).flatten(2).transpose(1, 2)


def nanogen_forward(sd, x, t, *, patch, enc_heads, dec_heads, depth, head_depth, label=None, text=None,
                    text_mask=None, t_abs=None):
    """DDT.py 198-226 (DiTwDDTHead.forward) with _build_sequence (173-186) and _build_attn_mask (188-196)."""
    n_vis = (x.shape[-1] // patch) ** 2
    seq = [_patch(sd, "s_embedder", x, patch)]
    t_base, t_tokens = _fourier(sd, "t_embedder", t)
    seq.append(t_tokens)
    if t_abs is not None:
        seq.append(_fourier(sd, "t_abs_embedder", t_abs)[1])
    if label is not None:  # ConditionEmbedder "label" (model_utils.py 126-128)
        seq.append(sd["ctx_embedder.learnable_tokens"] + sd["ctx_embedder.embedding_table.weight"][label].unsqueeze(1))
    else:  # "text" (129-130)
        seq.append(_linear(sd, "ctx_embedder.proj", _rmsnorm(text, sd["ctx_embedder.norm.weight"])))
    seq = torch.cat(seq, dim=1)
    mask = torch.ones((seq.shape[0], seq.shape[1]))
    if text_mask is not None:
        mask[:, -text_mask.shape[1]:] = text_mask
    attn_mask = (1.0 - mask[:, None, None, :]) * torch.finfo(seq.dtype).min
    d, dh = seq.shape[-1], sd["x_embedder.proj.weight"].shape[0]
    enc_cos, enc_sin = _rope_table(d // enc_heads, n_vis, seq.shape[1] - n_vis)
    dec_cos, dec_sin = _rope_table(dh // dec_heads, n_vis, 0)
    for i in range(depth):  # DDTEncoderBlock (DDT.py 13-24)
        p = f"blocks.{i}"
        seq = seq + _attention(sd, f"{p}.attn", _rmsnorm(seq, sd[f"{p}.norm1.weight"]), enc_heads, enc_cos, enc_sin,
                               attn_mask)
        seq = seq + _mlp(sd, f"{p}.mlp", _rmsnorm(seq, sd[f"{p}.norm2.weight"]))
    s = F.silu(t_base + seq[:, :n_vis, :])
    s = _linear(sd, "s_projector", s) if "s_projector.weight" in sd else s
    h = _patch(sd, "x_embedder", x, patch)
    for i in range(depth, depth + head_depth):  # DDTDecoderBlock (DDT.py 27-40)
        p = f"blocks.{i}"
        mod = _linear(sd, f"{p}.adaln_modulation.1", F.silu(s)).chunk(6, dim=-1)
        h = h + mod[2] * _attention(sd, f"{p}.attn", _rmsnorm(h, sd[f"{p}.norm1.weight"]) * (1 + mod[1]) + mod[0],
                                    dec_heads, dec_cos, dec_sin, None)
        h = h + mod[5] * _mlp(sd, f"{p}.mlp", _rmsnorm(h, sd[f"{p}.norm2.weight"]) * (1 + mod[4]) + mod[3])
    shift, scale = _linear(sd, "final_layer.adaln_modulation.1", F.silu(s)).chunk(2, dim=-1)  # DDTFinalLayer 55-63
    out = _linear(sd, "final_layer.linear", _rmsnorm(h, sd["final_layer.norm.weight"]) * (1 + scale) + shift)
    side, c = int(out.shape[1] ** 0.5), x.shape[1]  # unpatchify, DDT.py 167-171
    out = out.reshape(out.shape[0], side, side, patch, patch, c).permute(0, 5, 1, 3, 2, 4)
    return out.reshape(out.shape[0], c, side * patch, side * patch)


# ---- the tests ---------------------------------------------------------------------------------------------------

def _random_model(seed, **overrides):
    """A tiny NanoGen-layout model with every trained tensor random (no zero-initialised layer left)."""
    torch.manual_seed(seed)
    model = create_model("ddt-en28d1152hd72-dn2d2048hd128", **{**TINY, **overrides})
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm1.weight") or name.endswith("norm2.weight") or "norm." in name or "_norm." in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif p.requires_grad:
                p.copy_(0.3 * torch.randn_like(p))
    return model.eval()


def _nanogen_file(model, tmp_path, extra=None):
    """The model's weights in NanoGen's container (src/utils/checkpoint.py save_stage2_checkpoint)."""
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    sd.update(extra or {})
    path = tmp_path / "ep-0000080.pt"
    torch.save({"step": 1000, "epoch": 80, "model": {k: v + 1 for k, v in sd.items()}, "ema": sd,
                "optimizer": {"state": {}, "param_groups": []}, "scheduler": None}, path)
    return path, sd


def _loaded(path):
    sd, info = dit.load_dit_weights(path)
    return dit.build_model_from_weights(sd, info), info


HEADS = {"patch": 2, "enc_heads": 2, "dec_heads": 4, "depth": 2, "head_depth": 1}


def test_a_nanogen_class_file_loads_and_gives_nanogen_outputs(tmp_path):
    ours, info = _loaded(_nanogen_file(_random_model(0), tmp_path)[0])
    assert info["family"] == "DiT-DH-IC" and info["release"] == "NanoGen" and info["weights"] == "ema"
    assert info["flow_convention"] == "repa" and info["objective"] == "flow" and info["step"] == 1000
    c = info["model_config"]
    assert (c["num_t_tokens"], c["num_c_tokens"], c["num_classes"], c["num_heads"], c["head_num_heads"]) == (4, 8, 5, 2, 4)
    sd = {k: v for k, v in ours.state_dict().items()}
    g = torch.Generator().manual_seed(1)
    x, t = torch.randn(4, 4, 8, 8, generator=g), torch.rand(4, generator=g)
    y = torch.tensor([0, 3, 4, 5])  # 5 = the null label
    want = nanogen_forward(sd, x, t, label=y, **HEADS)
    with torch.no_grad():
        got = ours(x, t, y)
    assert want.abs().max() > 1.0  # every layer carries signal
    assert_close_at_scale(got, want, rel=64 * FP32_EPS)
    # the null label through forward_with_cfg: guided = uncond + s (cond - uncond) of NanoGen's two passes
    null = nanogen_forward(sd, x, t, label=torch.full_like(y, 5), **HEADS)
    with torch.no_grad():
        guided = ours.forward_with_cfg(torch.cat([x, x]), torch.cat([t, t]), torch.cat([y, torch.full_like(y, 5)]),
                                       cfg_scale=2.5, guide_channels="all")[:4]
    assert_close_at_scale(guided, null + 2.5 * (want - null), rel=256 * FP32_EPS)


def test_a_nanogen_text_file_loads_and_masks_padding_as_nanogen(tmp_path):
    path, _ = _nanogen_file(_random_model(2, conditioning="text", text_dim=12, num_c_tokens=6), tmp_path)
    ours, info = _loaded(path)
    c = info["model_config"]
    assert (c["conditioning"], c["text_dim"], c["num_c_tokens"]) == ("text", 12, 6)
    sd = ours.state_dict()
    g = torch.Generator().manual_seed(3)
    x, t = torch.randn(3, 4, 8, 8, generator=g), torch.rand(3, generator=g)
    text = torch.randn(3, 6, 12, generator=g)  # NanoGen pads every prompt to its max length (here 6 tokens)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0]])  # the last: the empty prompt
    want = nanogen_forward(sd, x, t, text=text, text_mask=mask, **HEADS)
    with torch.no_grad():
        got = ours(x, t, text=text, text_mask=mask.bool())
        # shorter padding (the batch's longest caption, 2 tokens) and other features under the mask change nothing
        short = ours(x[1:2], t[1:2], text=text[1:2, :2], text_mask=mask[1:2, :2].bool())
        other = ours(x, t, text=torch.where(mask.bool()[..., None], text, 7.0), text_mask=mask.bool())
    assert_close_at_scale(got, want, rel=64 * FP32_EPS)
    assert_close_at_scale(short, want[1:2], rel=64 * FP32_EPS)
    assert_close_at_scale(other, want, rel=64 * FP32_EPS)
    unmasked = nanogen_forward(sd, x, t, text=text, text_mask=torch.ones_like(mask), **HEADS)
    assert (unmasked - want)[1:].abs().max() > 1e-2 * want.abs().max()  # the mask matters where it masks
    with pytest.raises(ValueError, match="at most 6 tokens"):
        ours(x, t, text=torch.zeros(3, 7, 12), text_mask=torch.ones(3, 7, dtype=torch.bool))


def test_the_meanflow_variant_takes_h_and_t_as_nanogen(tmp_path):
    model = _random_model(4)
    model.set_conditions("meanflow")
    with torch.no_grad():
        for p in model.t_abs_embedder.parameters():
            if p.requires_grad:
                p.copy_(0.3 * torch.randn_like(p))
    ours, info = _loaded(_nanogen_file(model, tmp_path)[0])
    assert info["model_config"]["conditions"] == "meanflow"
    g = torch.Generator().manual_seed(5)
    x, t, r = torch.randn(2, 4, 8, 8, generator=g), torch.rand(2, generator=g), torch.rand(2, generator=g) * 0.5
    y = torch.tensor([1, 2])
    # TransportMF.u_fn (transport.py 167-169): model(x, h, t_abs=t) with h = t - r; ours: time input (t, h)
    want = nanogen_forward(ours.state_dict(), x, t - r, label=y, t_abs=t, **HEADS)
    with torch.no_grad():
        got = ours(x, torch.stack([t, t - r], dim=1), y)
    assert_close_at_scale(got, want, rel=64 * FP32_EPS)


def test_unbuilt_heads_are_dropped(tmp_path):
    """REPA's projector, and internal guidance's base head where the file records no depth; REG files load
    (tests/dit/test_reg_nanogen.py)."""
    model = _random_model(6)
    extra = {"repa_projector.weight": torch.zeros(7, 32), "repa_projector.bias": torch.zeros(7),
             "base_final_layer.linear.weight": torch.zeros(16, 32)}
    sd, info = dit.load_dit_weights(_nanogen_file(model, tmp_path, extra)[0])
    assert info["dropped"] == ["base_final_layer", "repa_projector"] and "repa_projector.weight" not in sd


def test_presets_and_config_round_trip():
    with torch.device("meta"):
        m = create_model("ddt-en28d1152hd72-dn2d2048hd128", input_size=32)
    c = m.config
    assert c["model"] == "ddt-en28d1152hd72-dn2d2048hd128" and c["hidden_size"] // c["num_heads"] == 72
    assert c["head_hidden_size"] // c["head_num_heads"] == 128 and (c["num_t_tokens"], c["num_c_tokens"]) == (4, 8)
    # 28 encoder blocks on 256 + 12 tokens (q, k, v, proj; scores and values; SwiGLU's 3 products of width 3072), 2 head
    # blocks on 256 tokens (per-token adaLN 6 D^2 and SwiGLU width 5461), the patch embeddings, s_projector, the time
    # MLP, the final layer's per-token adaLN and linear
    t, d, dh = 256, 1152, 2048
    enc = 28 * ((t + 12) * 4 * d * d + 2 * (t + 12) ** 2 * d + (t + 12) * 3 * d * 3072)
    head = 2 * (t * 6 * dh * dh + t * 4 * dh * dh + 2 * t * t * dh + t * 3 * dh * 5461)
    rest = t * 4 * 4 * (d + dh) + d * dh * t + 2 * 256 * d + d * d + t * 2 * dh * dh + t * dh * 4 * 4
    assert dit.forward_macs(c) == enc + head + rest  # 166.1 G
    with torch.device("meta"):  # NanoGen's jit-ddt: the same 256 tokens, each a 16 x 16 x 3 patch of the image
        pix = create_model("ddt-en28d1152hd72-dn2d2048hd128", input_size=256, in_channels=3, patch_size=16)
    rest = t * 768 * (d + dh) + d * dh * t + 2 * 256 * d + d * d + t * 2 * dh * dh + t * dh * 768
    assert dit.forward_macs(pix.config) == enc + head + rest == 167_112_278_016  # BENCHMARKS.md "Pixel space"
    with torch.device("meta"):
        big = create_model("ddt-en28d1584hd72-dn2d2048hd128", input_size=64, in_channels=16)
    assert big.config["num_heads"] == 22 and dit.model_from_config(big.config).config == big.config
    with pytest.raises(ValueError, match="DiT is conditioned on class, not text"):
        create_model("DiT-S/2", conditioning="text")
