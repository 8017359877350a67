"""The building blocks every model family is made of (diffusers' shared `attention_processor.py` /
`normalization.py` idea): attention with optional QK-norm and RoPE, norms, MLPs, the adaLN-Zero block and final
layer, patch, timestep and label embeddings. Parameter names are the ones the DiT, LightningDiT, DDT and RAE
releases use, so each family's state_dict matches its release's.

- adaLN modulation (Peebles & Xie 2023): a Linear of the conditioning, preceded by a SiLU (`silu=True`: DiT,
  LightningDiT, DiT-DH: `adaLN_modulation.1`) or not (DDT, which applies its SiLU once to the condition:
  `adaLN_modulation.0`). The condition is one vector per sample [N, D] or one per token [N, T, D] (DDT's and
  DiT-DH's decoders are conditioned on the encoder's tokens). `shift=False` is LightningDiT's `wo_shift`.
- `RMSNorm`: learned scale, computed in float32 and cast back before the scale (LightningDiT's and RAE's
  `RMSNorm`, DDT's LLaMA-style one: the same formula).
- MLPs: DiT's GELU(tanh) `Mlp` (fc1, fc2); `SwiGLU` (dit/blocks.py: w12 fused, w3, with biases) at any hidden
  width; DDT's LLaMA-style `LlamaFFN` w2(silu(w1 x) * w3 x) without biases; NanoGen's `SplitSwiGLU` (w1, w2, w3).
- Attention with separate q, k, v and QK RMSNorm (`SplitAttention`, NanoGen's) and a key padding mask
  (`key_padding_mask`: text tokens); cross-attention to condition tokens (`CrossAttention`) and PixArt's block of
  self-attention, cross-attention and MLP under adaLN-single (`CrossAttentionBlock`).
- Timestep features: DiT's sinusoid (max_period 10000; DDT uses 10) or RAE's Gaussian Fourier features
  sin/cos(2 pi t W) with a fixed random W (`t_embedder.W`).
"""
from __future__ import annotations

import math
from typing import Any, Callable, Iterable, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .blocks import NORM_EPS, SwiGLU, make_norm
from .embed import FREQUENCY_EMBEDDING_SIZE, timestep_embedding

Rope = Callable[[torch.Tensor], torch.Tensor]  # q or k [N, heads, T, head_dim] -> rotated
NormFactory = Callable[[int], nn.Module]


class RMSNorm(nn.Module):
    """x / rms(x) * weight over the last axis, computed in float32 and cast back before the learned scale."""

    def __init__(self, dim: int, eps: float = NORM_EPS):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def modulate(x: torch.Tensor, shift: torch.Tensor | None, scale: torch.Tensor) -> torch.Tensor:
    """adaLN: x [N, T, D] * (1 + scale) + shift, scale and shift [N, 1, D] or [N, T, D] (no shift: wo_shift)."""
    return x * (1 + scale) if shift is None else x * (1 + scale) + shift


class Attention(nn.Module):
    """Multi-head self-attention; qkv features laid out [3, heads, head_dim]; SDPA (flash on GPU). `qk_norm`
    builds the per-head norm of queries and keys (None: none); `rope` (forward) rotates them after it."""

    def __init__(self, dim: int, num_heads: int, qk_norm: NormFactory | None = None, qkv_bias: bool = True):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"hidden size {dim} is not divisible by num_heads {num_heads}")
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)
        self.qk_norm = qk_norm is not None
        if qk_norm is not None:
            self.q_norm = qk_norm(dim // num_heads)
            self.k_norm = qk_norm(dim // num_heads)

    def forward(self, x: torch.Tensor, rope: Rope | None = None) -> torch.Tensor:
        n, tokens, dim = x.shape
        qkv = self.qkv(x).reshape(n, tokens, 3, self.num_heads, dim // self.num_heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each [N, heads, T, head_dim]
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:  # a float32 table may promote q and k; attention runs in v's dtype
            q, k = rope(q).to(v.dtype), rope(k).to(v.dtype)
        out = F.scaled_dot_product_attention(q, k, v)  # default scale head_dim^-0.5
        return self.proj(out.transpose(1, 2).reshape(n, tokens, dim))


def key_padding_mask(keep: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """[N, L] bool (True = attend to this key) -> the additive mask [N, 1, 1, L] SDPA takes: 0 where kept, the
    dtype's most negative finite value elsewhere (NanoGen's `_build_attn_mask`); None stays None (no mask)."""
    if keep is None:
        return None
    return (1.0 - keep[:, None, None, :].to(dtype)) * torch.finfo(dtype).min


class SplitAttention(nn.Module):
    """Multi-head self-attention with separate q, k, v projections and a per-head learned RMSNorm of q and k
    (NanoGen's `NormAttention`); `rope` rotates q and k after the norm; `keep` [N, T] bool masks the keys that are
    False (padding), as an additive mask in the attention's dtype (key_padding_mask), or None."""

    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"hidden size {dim} is not divisible by num_heads {num_heads}")
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.proj = nn.Linear(dim, dim)
        self.q_norm = RMSNorm(self.head_dim)
        self.k_norm = RMSNorm(self.head_dim)

    def forward(self, x: torch.Tensor, rope: Rope | None = None, keep: torch.Tensor | None = None) -> torch.Tensor:
        n, tokens, dim = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:  # [N, T, D] -> [N, heads, T, head_dim]
            return t.reshape(n, tokens, self.num_heads, self.head_dim).transpose(1, 2)

        q, k, v = self.q_norm(heads(self.q(x))), self.k_norm(heads(self.k(x))), heads(self.v(x))
        if rope is not None:
            q, k = rope(q), rope(k)
        if q.dtype != v.dtype:  # a float32 norm scale or RoPE table promoted q and k; attention runs in v's dtype
            q, k = q.to(v.dtype), k.to(v.dtype)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=key_padding_mask(keep, v.dtype))
        return self.proj(out.transpose(1, 2).reshape(n, tokens, dim))


class SplitSwiGLU(nn.Module):
    """w3(silu(w1 x) * w2 x) with biases, the gate and value as two Linears (NanoGen's `SwiGLUFFN`)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden)
        self.w2 = nn.Linear(dim, hidden)
        self.w3 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w3(F.silu(self.w1(x)) * self.w2(x))


class Mlp(nn.Module):
    """fc2(GELU_tanh(fc1(x))), DiT's (timm's) MLP; `out` features (default: dim)."""

    def __init__(self, dim: int, hidden: int, out: int | None = None):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU(approximate="tanh")
        self.fc2 = nn.Linear(hidden, dim if out is None else out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class LlamaFFN(nn.Module):
    """w2(silu(w1 x) * w3 x), no biases (LLaMA's, DDT's `FeedForward`)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def adaln_modulation(dim: int, chunks: int, silu: bool) -> nn.Sequential:
    """Linear(dim, chunks * dim) of the condition, after a SiLU when `silu` (its index then 1, else 0)."""
    linear = nn.Linear(dim, chunks * dim)
    return nn.Sequential(nn.SiLU(), linear) if silu else nn.Sequential(linear)


def _chunks(modulation: nn.Module, c: torch.Tensor, n: int) -> tuple[torch.Tensor, ...]:
    mod = modulation(c)
    return (mod.unsqueeze(1) if mod.dim() == 2 else mod).chunk(n, dim=-1)  # each [N, 1 or T, D]


class AdaLNBlock(nn.Module):
    """adaLN-Zero transformer block: x + gate * attn(modulate(norm1 x)), then the same with the MLP.
    `grad_checkpointing` recomputes it in the backward pass (run_block)."""

    def __init__(self, dim: int, num_heads: int, *, norm: NormFactory, mlp: Callable[[int], nn.Module],
                 qk_norm: NormFactory | None = None, qkv_bias: bool = True, silu: bool = True, shift: bool = True):
        super().__init__()
        self.norm1 = norm(dim)
        self.attn = Attention(dim, num_heads, qk_norm=qk_norm, qkv_bias=qkv_bias)
        self.norm2 = norm(dim)
        self.mlp = mlp(dim)
        self.shift = shift
        self.adaLN_modulation = adaln_modulation(dim, 6 if shift else 4, silu)
        self.grad_checkpointing = False

    def forward(self, x: torch.Tensor, c: torch.Tensor, rope: Rope | None = None) -> torch.Tensor:
        shift_msa: torch.Tensor | None
        shift_mlp: torch.Tensor | None
        if self.shift:
            shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = _chunks(self.adaLN_modulation, c, 6)
        else:
            scale_msa, gate_msa, scale_mlp, gate_mlp = _chunks(self.adaLN_modulation, c, 4)
            shift_msa = shift_mlp = None
        x = x + gate_msa * self.attn(modulate(self.norm1(x), shift_msa, scale_msa), rope)
        return x + gate_mlp * self.mlp(modulate(self.norm2(x), shift_mlp, scale_mlp))


class CrossAttention(nn.Module):
    """Multi-head attention of the tokens x [N, T, D] (queries) to condition tokens c [N, L, D] (keys and values):
    PixArt's `MultiHeadCrossAttention` (q_linear, kv_linear laid out [2, heads, head_dim], proj); `keep` [N, L]
    bool masks the padding keys (PixArt packs the real tokens with xformers' block-diagonal mask: the same)."""

    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"hidden size {dim} is not divisible by num_heads {num_heads}")
        self.num_heads = num_heads
        self.q_linear = nn.Linear(dim, dim)
        self.kv_linear = nn.Linear(dim, 2 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, c: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        n, tokens, dim = x.shape
        hd = dim // self.num_heads
        q = self.q_linear(x).reshape(n, tokens, self.num_heads, hd).transpose(1, 2)  # [N, heads, T, hd]
        k, v = self.kv_linear(c).reshape(n, c.shape[1], 2, self.num_heads, hd).permute(2, 0, 3, 1, 4).unbind(0)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=key_padding_mask(keep, v.dtype))
        return self.proj(out.transpose(1, 2).reshape(n, tokens, dim))


class CrossAttentionBlock(nn.Module):
    """PixArt's block (Chen et al. 2023, PixArt-alpha, `PixArtBlock`): self-attention, cross-attention to the text
    tokens, MLP, with adaLN-single: the six modulations are the block's learned `scale_shift_table` [6, D] plus the
    model's one shared projection of the time embedding t0 [N, 6 D]; the cross-attention is neither normed nor gated.
    x + gate_msa * attn(norm1(x) * (1 + scale_msa) + shift_msa); x + cross_attn(x, text); x + gate_mlp * mlp(...)."""

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float = 4.0):
        super().__init__()
        self.norm1 = make_norm(dim, rms_norm=False)
        self.attn = Attention(dim, num_heads)
        self.cross_attn = CrossAttention(dim, num_heads)
        self.norm2 = make_norm(dim, rms_norm=False)
        self.mlp = Mlp(dim, int(dim * mlp_ratio))
        self.scale_shift_table = nn.Parameter(torch.randn(6, dim) / dim ** 0.5)
        self.grad_checkpointing = False

    def forward(self, x: torch.Tensor, text: torch.Tensor, t0: torch.Tensor,
                keep: torch.Tensor | None = None) -> torch.Tensor:
        mods = (self.scale_shift_table[None] + t0.reshape(x.shape[0], 6, -1)).chunk(6, dim=1)  # each [N, 1, D]
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = mods
        x = x + gate_msa * self.attn(modulate(self.norm1(x), shift_msa, scale_msa))
        x = x + self.cross_attn(x, text, keep)
        return x + gate_mlp * self.mlp(modulate(self.norm2(x), shift_mlp, scale_mlp))


class FinalLayer(nn.Module):
    """linear(modulate(norm_final x)) with adaLN shift and scale, no gate."""

    def __init__(self, dim: int, out_features: int, norm: nn.Module, silu: bool = True):
        super().__init__()
        self.norm_final = norm
        self.linear = nn.Linear(dim, out_features)
        self.adaLN_modulation = adaln_modulation(dim, 2, silu)

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shift, scale = _chunks(self.adaLN_modulation, c, 2)
        return self.linear(modulate(self.norm_final(x), shift, scale))


def run_block(block: nn.Module, *args: Any) -> torch.Tensor:
    """block(*args), recomputed in the backward pass when the block's `grad_checkpointing` is set."""
    if getattr(block, "grad_checkpointing", False) and torch.is_grad_enabled():
        return cast(torch.Tensor, checkpoint(block, *args, use_reentrant=False))
    return block(*args)


def choose_blocks(enable: bool | int | Iterable[int], count: int) -> set[int]:
    """The block indices `set_grad_checkpointing(enable)` means: True = all, False/0 = none, an int n = the first
    n, or an iterable of indices; ValueError for what is out of range."""
    if isinstance(enable, bool):
        return set(range(count)) if enable else set()
    if isinstance(enable, int):
        if not 0 <= enable <= count:
            raise ValueError(f"grad checkpointing block count must be in 0..{count}, got {enable}")
        return set(range(enable))
    chosen = {int(i) for i in enable}
    if not chosen <= set(range(count)):
        raise ValueError(f"block indices must be in 0..{count - 1}, got {sorted(chosen)}")
    return chosen


class PatchEmbed(nn.Module):
    """[N, C, H, W] -> [N, T, D] tokens (row-major over the patch grid); a Conv2d named `proj` as in the releases."""

    def __init__(self, patch_size: int, in_channels: int, hidden_size: int):
        super().__init__()
        self.proj = nn.Conv2d(in_channels, hidden_size, kernel_size=patch_size, stride=patch_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).flatten(2).transpose(1, 2)


class TimestepEmbedder(nn.Module):
    """Sinusoidal features (dit/embed.py) -> Linear -> SiLU -> Linear."""

    def __init__(self, hidden_size: int, max_period: float = 10000.0):
        super().__init__()
        self.max_period = float(max_period)
        self.mlp = nn.Sequential(nn.Linear(FREQUENCY_EMBEDDING_SIZE, hidden_size), nn.SiLU(),
                                 nn.Linear(hidden_size, hidden_size))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        # Cast to the weights' dtype so a model converted with .to(bfloat16) runs without autocast.
        features = timestep_embedding(t, max_period=self.max_period)
        return self.mlp(features.to(cast(nn.Linear, self.mlp[0]).weight.dtype))


class FourierTimestepEmbedder(nn.Module):
    """RAE's Gaussian Fourier features: concat(sin(2 pi t W), cos(2 pi t W)), W ~ N(0, 1) fixed (a parameter that
    is never trained, `W`), then Linear(2 x 256, D) -> SiLU -> Linear."""

    def __init__(self, hidden_size: int, size: int = FREQUENCY_EMBEDDING_SIZE, scale: float = 1.0):
        super().__init__()
        self.W = nn.Parameter(torch.normal(0.0, scale, (size,)), requires_grad=False)
        self.mlp = nn.Sequential(nn.Linear(2 * size, hidden_size), nn.SiLU(), nn.Linear(hidden_size, hidden_size))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        args = t[:, None].float() * self.W.float()[None] * 2 * math.pi  # [N, size]
        features = torch.cat([torch.sin(args), torch.cos(args)], dim=-1)
        return self.mlp(features.to(cast(nn.Linear, self.mlp[0]).weight.dtype))


class LabelEmbedder(nn.Module):
    """Class table with a last "null" row (id = num_classes) when class dropout is enabled."""

    def __init__(self, num_classes: int, hidden_size: int, dropout_prob: float):
        super().__init__()
        self.num_classes = num_classes
        self.dropout_prob = dropout_prob
        self.embedding_table = nn.Embedding(num_classes + int(dropout_prob > 0), hidden_size)

    def forward(self, labels: torch.Tensor, force_drop_ids: torch.Tensor | None = None,
                generator: torch.Generator | None = None) -> torch.Tensor:
        if force_drop_ids is not None:
            if self.dropout_prob <= 0:
                raise ValueError("force_drop_ids needs the null class row: build the model with "
                                 "class_dropout_prob > 0")
            labels = torch.where(force_drop_ids.to(labels.device) == 1, self.num_classes, labels)
        elif self.training and self.dropout_prob > 0:
            u = torch.rand(labels.shape[0], generator=generator,
                           device=labels.device if generator is None else generator.device)
            labels = torch.where(u.to(labels.device) < self.dropout_prob, self.num_classes, labels)
        return self.embedding_table(labels)
