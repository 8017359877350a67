"""PixArt-alpha's cross-attention block and network (dit/layers.py CrossAttentionBlock, dit/pixart.py) against its code
transcribed here (github PixArt-alpha/PixArt-alpha, diffusion/model/nets/PixArt.py and PixArt_blocks.py, lines named
at each step) independently of ours, on the same random weights: each sample's text tokens packed without their
padding as PixArt packs them (masked_select, then xformers' block-diagonal mask over the per-sample lengths)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from dit_pipeline import dit
from dit_pipeline.dit.family import create_model
from dit_pipeline.dit.pixart import text_macs
from tests._util import assert_close_at_scale

FP32_EPS = 2.0 ** -23


def _timestep(t, dim=256, max_period=10000):  # PixArt_blocks.py 248-266 (TimestepEmbedder.timestep_embedding)
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(0, half, dtype=torch.float32) / half)
    args = t[:, None].float() * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


def _lin(sd, p, x):
    return F.linear(x, sd[f"{p}.weight"], sd[f"{p}.bias"])


def _ln(x):  # nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
    return F.layer_norm(x, x.shape[-1:], eps=1e-6)


def pixart_forward(sd, x, timestep, y, mask, *, heads, patch):
    """PixArt.forward (PixArt.py 108-137) with PixArtBlock.forward (46-55), WindowAttention (PixArt_blocks.py
    109-123, no window, no mask), MultiHeadCrossAttention (44-58), T2IFinalLayer (184-188), unpatchify (157-169)."""
    b = x.shape[0]
    h = F.conv2d(x, sd["x_embedder.proj.weight"], sd["x_embedder.proj.bias"], stride=patch).flatten(2).transpose(1, 2)
    h = h + sd["pos_embed"]
    t = _lin(sd, "t_embedder.mlp.2", F.silu(_lin(sd, "t_embedder.mlp.0", _timestep(timestep))))
    t0 = _lin(sd, "t_block.1", F.silu(t))
    yy = _lin(sd, "y_embedder.y_proj.fc2", F.gelu(_lin(sd, "y_embedder.y_proj.fc1", y), approximate="tanh"))
    y_lens = mask.sum(dim=1).tolist()  # 126-129: the real tokens of every sample, packed
    packed = yy.masked_select(mask.unsqueeze(-1) != 0).view(-1, yy.shape[-1])
    n, c = h.shape[1], h.shape[2]
    hd = c // heads
    depth = len({k.split(".")[1] for k in sd if k.startswith("blocks.")})
    for i in range(depth):
        p = f"blocks.{i}"
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = (
            sd[f"{p}.scale_shift_table"][None] + t0.reshape(b, 6, -1)).chunk(6, dim=1)
        a = _ln(h) * (1 + scale_msa) + shift_msa  # t2i_modulate (PixArt_blocks.py 25-26)
        qkv = _lin(sd, f"{p}.attn.qkv", a).reshape(b, n, 3, heads, hd)
        q, k, v = (z.transpose(1, 2) for z in qkv.unbind(2))
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, c)
        h = h + gate_msa * _lin(sd, f"{p}.attn.proj", a)
        q = _lin(sd, f"{p}.cross_attn.q_linear", h).reshape(b, n, heads, hd)
        kv = _lin(sd, f"{p}.cross_attn.kv_linear", packed).reshape(-1, 2, heads, hd)
        out, start = [], 0
        for s, length in enumerate(y_lens):  # the block-diagonal mask: sample s sees only its own tokens
            ks, vs = kv[start:start + length].unbind(1)
            out.append(F.scaled_dot_product_attention(q[s:s + 1].transpose(1, 2), ks[None].transpose(1, 2),
                                                      vs[None].transpose(1, 2)).transpose(1, 2).reshape(1, n, c))
            start += length
        h = h + _lin(sd, f"{p}.cross_attn.proj", torch.cat(out))
        m = _ln(h) * (1 + scale_mlp) + shift_mlp
        h = h + gate_mlp * _lin(sd, f"{p}.mlp.fc2", F.gelu(_lin(sd, f"{p}.mlp.fc1", m), approximate="tanh"))
    shift, scale = (sd["final_layer.scale_shift_table"][None] + t[:, None]).chunk(2, dim=1)
    out = _lin(sd, "final_layer.linear", _ln(h) * (1 + scale) + shift)
    side, co = int(n ** 0.5), out.shape[-1] // (patch * patch)
    out = torch.einsum("nhwpqc->nchpwq", out.reshape(b, side, side, patch, patch, co))
    return out.reshape(b, co, side * patch, side * patch)


def test_pixart_blocks_give_pixarts_outputs_with_padded_text():
    torch.manual_seed(0)
    model = create_model("PixArt-XL/2", input_size=8, depth=2, hidden_size=32, num_heads=4, conditioning="text",
                         text_dim=12).eval()
    with torch.no_grad():  # no zero-initialised layer left
        for name, p in model.named_parameters():
            if p.requires_grad:
                p.copy_(0.3 * torch.randn_like(p))
    g = torch.Generator().manual_seed(1)
    x, t = torch.randn(3, 4, 8, 8, generator=g), torch.tensor([10, 500, 999])
    text = torch.randn(3, 5, 12, generator=g)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 0, 0, 0, 0]])
    want = pixart_forward(model.state_dict(), x, t, text, mask, heads=4, patch=2)
    with torch.no_grad():
        got = model(x, t, text=text, text_mask=mask.bool())
        junk = model(x, t, text=torch.where(mask.bool()[..., None], text, 5.0), text_mask=mask.bool())
    assert want.abs().max() > 1.0
    assert_close_at_scale(got, want, rel=64 * FP32_EPS)
    assert_close_at_scale(junk, want, rel=64 * FP32_EPS)  # padding never reaches the image tokens
    # the same network loads back from its weights alone (family and text width from the keys)
    config = dit.infer_model_config(model.state_dict(), hints={"num_heads": 4})
    assert config["family"] == "PixArt" and config["text_dim"] == 12 and config["num_heads"] == 4


def test_a_fresh_pixart_outputs_zero_and_its_cost_counts_the_text():
    model = create_model("PixArt-XL/2", input_size=8, depth=2, hidden_size=32, num_heads=4, conditioning="text",
                         text_dim=12)
    out = model(torch.randn(2, 4, 8, 8), torch.tensor([1, 2]), text=torch.randn(2, 3, 12),
                text_mask=torch.ones(2, 3, dtype=torch.bool))
    assert torch.equal(out, torch.zeros_like(out))  # PixArt zeroes the cross-attention outputs and the final linear
    c = model.config
    # per text token: the caption MLP (12 x 32 + 32 x 32) and, in each of 2 blocks, its keys and values (2 x 32 x 32)
    # and its share of the two attention products (2 x 16 image tokens x 32)
    assert text_macs(c, 10) == 10 * (12 * 32 + 32 * 32) + 2 * (10 * 2 * 32 * 32 + 2 * 16 * 10 * 32)


def test_pixart_is_a_text_family_of_ddpm():
    from dit_pipeline.train.model_options import implied_objective

    assert implied_objective("PixArt-XL/2") is None  # DiT's ddpm, PixArt-alpha's objective (the default)
    with pytest.raises(ValueError, match="a PixArt is conditioned on text, not class"):
        create_model("PixArt-XL/2")
