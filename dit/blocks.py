"""Optional DiT block features, each off by default (off = DiT exactly: same modules, names, outputs).

The choices LightningDiT (Yao et al. 2025, "Reconstruction vs. Generation", arXiv:2501.01423) reports
to speed up and stabilise DiT training:
- `qk_norm`: RMSNorm (learned scale, per head) on queries and keys before attention (Dehghani et al. 2023,
  ViT-22B); parameters `attn.q_norm.weight`, `attn.k_norm.weight` [head_dim].
- `rms_norm`: `torch.nn.RMSNorm` (no affine, eps 1e-6) in place of the blocks' and final layer's
  LayerNorm (Zhang & Sennrich 2019); no parameters either way.
- `swiglu`: the MLP becomes SwiGLU (Shazeer 2020), fc2(silu(a) * b) with [a; b] = fc1(x), its hidden width
  2/3 of GELU-MLP's so parameters and FLOPs stay about equal; parameters `mlp.w12`, `mlp.w3`.
- `rope`: 2-D rotary position embedding (Su et al. 2021; axial 2-D variant as in Heo et al. 2024) on
  queries and keys, added to DiT's absolute sin-cos table: the first half of each head's features rotates
  with the patch column, the second half with the patch row, frequencies 10000^(-k / (head_dim / 4)),
  consecutive feature pairs rotated together. No parameters.

Numerics: every normalization (the blocks' LayerNorm / RMSNorm, QK-norm) runs in float32 whatever the autocast
(`float32_norm`; the norm modules here are `LayerNorm32` / `RMSNorm32`, parameter names unchanged) and returns
its input's dtype. CPU autocast runs LayerNorm and RMSNorm of a bf16 input in bf16, and QK-norm's input (the
qkv projection's output) is bf16 on every device; the reduction over the features is where bf16 loses the
digits (RAE #26 and LightningDiT #23 report NaN with bf16 norms; REPA #46 the same for its normalize in fp16).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

BLOCK_OPTIONS = ("qk_norm", "rms_norm", "swiglu", "rope")
NORM_EPS = 1e-6
ROPE_THETA = 10000.0


def float32_norm(norm: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """`norm(x)` computed in float32 with autocast off (its parameters are float32), returned in x's dtype: the
    one rule for every normalization of every model family (module docstring)."""
    with torch.autocast(x.device.type, enabled=False):
        return norm(x.float()).to(x.dtype)


class LayerNorm32(nn.LayerNorm):
    """nn.LayerNorm run by `float32_norm` (same parameters and state_dict names)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return float32_norm(super().forward, x)


class RMSNorm32(nn.RMSNorm):
    """nn.RMSNorm run by `float32_norm` (same parameters and state_dict names)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return float32_norm(super().forward, x)


def make_norm(dim: int, rms_norm: bool) -> nn.Module:
    """The non-affine token norm of adaLN: LayerNorm (DiT) or RMSNorm, in float32 (`float32_norm`)."""
    if rms_norm:
        return RMSNorm32(dim, eps=NORM_EPS, elementwise_affine=False)
    return LayerNorm32(dim, elementwise_affine=False, eps=NORM_EPS)


def swiglu_hidden(dim: int, mlp_ratio: int) -> int:
    """2/3 of the GELU MLP's hidden width, rounded up to a multiple of 8."""
    return -(-int(2 * mlp_ratio * dim / 3) // 8) * 8


class SwiGLU(nn.Module):
    """x -> w3(silu(a) * b), [a; b] = w12(x)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w12 = nn.Linear(dim, 2 * hidden)
        self.w3 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.w12(x).chunk(2, dim=-1)
        return self.w3(F.silu(a) * b)


_ROPE_CACHE: dict[tuple[int, int, str, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}


def rope_2d_tables(grid: int, head_dim: int, device: torch.device,
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, head_dim / 2] for T = grid^2 row-major tokens (one angle per rotated pair)."""
    if head_dim % 4:
        raise ValueError(f"2-D RoPE needs a head dimension divisible by 4, got {head_dim}")
    key = (grid, head_dim, str(device), dtype)
    if key not in _ROPE_CACHE:
        quarter = head_dim // 4
        freqs = ROPE_THETA ** (-torch.arange(quarter, dtype=torch.float64) / quarter)  # [hd/4]
        rows, cols = torch.meshgrid(torch.arange(grid, dtype=torch.float64),
                                    torch.arange(grid, dtype=torch.float64), indexing="ij")
        angles = torch.cat([cols.reshape(-1, 1) * freqs, rows.reshape(-1, 1) * freqs], dim=1)  # [T, hd/2]
        _ROPE_CACHE[key] = (angles.cos().to(device, dtype), angles.sin().to(device, dtype))
    return _ROPE_CACHE[key]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate consecutive feature pairs of x [N, heads, T, head_dim] by the angles of cos/sin [T, hd/2]."""
    pairs = x.reshape(*x.shape[:-1], -1, 2)
    a, b = pairs[..., 0], pairs[..., 1]
    return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).reshape(x.shape)
