"""The building blocks of NanoGen's in-context DiT-DH (dit/incontext.py; github End2End-Diffusion/diffusion-bench,
src/stage2/models/model_utils.py and DDT.py), in the release's parameter names so its checkpoints load strictly: the
embedders of the encoder's sequence (time, class and text tokens), the encoder block, the head's block and the final
layer, over the shared layers of dit/layers.py (learned RMSNorm, attention, SwiGLU).

Facts of the release:
- time tokens (`GaussianFourierEmbedding`): `learnable_tokens` [n_t, D] + MLP(sin, cos of 2 pi t W), W ~ N(0, 1)
  fixed (`t_embedder.W`);
- class tokens (`ConditionEmbedder`, "label"): `learnable_tokens` [n_c, D] + the label's row of `embedding_table`
  [num_classes + 1, D] (its last row, label num_classes, is the null label); text tokens (`ConditionEmbedder`,
  "text"): proj(RMSNorm(features)) of every text token;
- encoder blocks (`DDTEncoderBlock`): no modulation at all, x + attn(norm1 x), x + mlp(norm2 x); learned RMSNorm,
  attention with separate q, k, v and a learned RMSNorm of q and k (`NormAttention`), SwiGLU of hidden width
  int(2/3 x D x 4) with w1, w2, w3 (`SwiGLUFFN`);
- head blocks (`DDTDecoderBlock`): the same with adaLN (SiLU, Linear 6 D: `adaln_modulation.1`) of a per-token
  condition; final layer (`DDTFinalLayer`): learned RMSNorm `norm`, adaLN shift and scale `adaln_modulation.1`,
  `linear`; with REG, `cls_linear` reads the first token (the class token) after the shared modulation.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .layers import FourierTimestepEmbedder, LabelEmbedder, RMSNorm, SplitAttention, SplitSwiGLU, _chunks, modulate

MLP_RATIO = 4.0


def swiglu_width(dim: int) -> int:
    """NanoGen's SwiGLU hidden width: int(2/3 x hidden_size x mlp_ratio), the float expression as written."""
    return int(2 / 3 * dim * MLP_RATIO)


class TimeTokens(FourierTimestepEmbedder):
    """`n_tokens` time tokens: learnable tokens + the Fourier time embedding (module docstring)."""

    def __init__(self, hidden_size: int, n_tokens: int):
        super().__init__(hidden_size)
        self.learnable_tokens = nn.Parameter(torch.normal(0.0, 1 / hidden_size ** 0.5, (n_tokens, hidden_size)))

    def tokens(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the embedding [N, 1, D], the tokens [N, n_tokens, D])."""
        base = self(t)[:, None]
        return base, self.learnable_tokens + base


class ClassTokens(LabelEmbedder):
    """`n_tokens` class tokens: learnable tokens + the label's row of a table with the null row (NanoGen keeps it
    whatever the dropout); dropout by `force_drop_ids` as DiT's LabelEmbedder."""

    def __init__(self, num_classes: int, hidden_size: int, dropout_prob: float, n_tokens: int):
        super().__init__(num_classes, hidden_size, dropout_prob)
        self.embedding_table = nn.Embedding(num_classes + 1, hidden_size)
        self.learnable_tokens = nn.Parameter(torch.normal(0.0, 1 / hidden_size ** 0.5, (n_tokens, hidden_size)))

    def forward(self, labels: torch.Tensor, force_drop_ids: torch.Tensor | None = None,
                generator: torch.Generator | None = None) -> torch.Tensor:
        return self.learnable_tokens + super().forward(labels, force_drop_ids, generator)[:, None]


class TextTokensEmbedder(nn.Module):
    """proj(RMSNorm(features)): text features [N, L, text_dim] -> tokens [N, L, D]. The features enter in the text
    encoder's dtype (bfloat16 for Qwen3-0.6B), as NanoGen's ConditionEmbedder gets them (src/stage2/models/
    model_utils.py l.129-130 with RMSNorm l.59-60): the norm is computed in float32 and rounded back to that dtype
    before the weight, so widening them first would skip NanoGen's rounding."""

    def __init__(self, text_dim: int, hidden_size: int):
        super().__init__()
        self.norm = RMSNorm(text_dim)
        self.proj = nn.Linear(text_dim, hidden_size)

    def forward(self, text: torch.Tensor) -> torch.Tensor:
        normed = self.norm(text)  # RMSNorm(x).type_as(x) * weight: float32 for float32 weights, as NanoGen's
        return self.proj(normed.to(self.proj.weight.dtype))


class EncoderBlock(nn.Module):
    """Pre-norm block without modulation: x + attn(norm1 x), x + mlp(norm2 x)."""

    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.norm1 = RMSNorm(dim)
        self.norm2 = RMSNorm(dim)
        self.attn = SplitAttention(dim, num_heads)
        self.mlp = SplitSwiGLU(dim, swiglu_width(dim))
        self.grad_checkpointing = False

    def forward(self, x: torch.Tensor, rope: nn.Module | None, keep: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), rope, keep)
        return x + self.mlp(self.norm2(x))


class DecoderBlock(EncoderBlock):
    """The encoder block with adaLN-Zero modulation by a per-token condition c [N, T, D]."""

    def __init__(self, dim: int, num_heads: int):
        super().__init__(dim, num_heads)
        self.adaln_modulation = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))

    def forward(self, x: torch.Tensor, c: torch.Tensor,  # type: ignore[override]
                rope: nn.Module | None = None) -> torch.Tensor:
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = _chunks(self.adaln_modulation, c, 6)
        x = x + gate_msa * self.attn(modulate(self.norm1(x), shift_msa, scale_msa), rope)
        return x + gate_mlp * self.mlp(modulate(self.norm2(x), shift_mlp, scale_mlp))


class TokenFinalLayer(nn.Module):
    """linear(modulate(norm x)) with adaLN shift and scale of a per-token condition; with `cls_dim` (REG) the first
    token is read by `cls_linear` instead: (linear of the others, cls_linear of the first) (`DDTFinalLayer`)."""

    def __init__(self, dim: int, out_features: int, cls_dim: int = 0):
        super().__init__()
        self.norm = RMSNorm(dim)
        self.linear = nn.Linear(dim, out_features)
        self.adaln_modulation = nn.Sequential(nn.SiLU(), nn.Linear(dim, 2 * dim))
        if cls_dim:
            self.cls_linear = nn.Linear(dim, cls_dim)

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> Any:
        shift, scale = _chunks(self.adaln_modulation, c, 2)
        x = modulate(self.norm(x), shift, scale)
        if hasattr(self, "cls_linear"):
            return self.linear(x[:, 1:]), self.cls_linear(x[:, 0])
        return self.linear(x)
