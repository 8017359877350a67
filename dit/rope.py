"""Two-dimensional rotary position embeddings (Su et al. 2021, "RoFormer"; axial 2-D form as in Heo et al. 2024)
in the three layouts the model families use. Each rotates consecutive feature pairs (2j, 2j+1) of a query or key
head by an angle that depends on the token's patch row or column:

    (a, b) -> (a cos w - b sin w, a sin w + b cos w)

They differ only in which pair gets which angle:
- `rope_2d_tables` (this project's DiT option, dit/blocks.py): pairs 0 .. hd/4-1 turn with the patch column,
  the rest with the row; frequency of pair k within its half 10000^(-k / (hd/4)); integer positions.
- `EvaRope` (LightningDiT, RAE's DiT-DH: EVA-02's `VisionRotaryEmbeddingFast`, Fang et al. 2023): the first half
  of the head's features turns with the patch **row**, the second half with the column, same frequencies;
  positions arange(g) / g * g in float32. Its tables are buffers (`freqs_cos`, `freqs_sin`, [T, head_dim], each
  pair's angle written to both of its features), so they are in the releases' state_dicts.
- `TokenRope` (NanoGen's in-context DiT-DH, dit/incontext.py): EVA's layout on integer positions (arange(g) as
  float32), its buffers [image tokens + condition tokens, head_dim] with angle 0 for the condition tokens that
  follow the image tokens (they get no position); only the image tokens are rotated (angle 0 is the identity).
- `ddt_rope_tables` (DDT, Wang et al. 2025): positions scaled to [0, 16] (linspace over the grid, both axes),
  frequencies 10000^(-4k / hd), k < hd/4, and the pairs interleave the axes: pair 2k turns with the column,
  pair 2k+1 with the row; applied in float32 (the release rotates in complex float32).
"""
from __future__ import annotations

from typing import cast

import torch
from torch import nn

from .blocks import ROPE_THETA, apply_rope, rope_2d_tables

DDT_POSITION_SCALE = 16.0  # DDT's positions run from 0 to 16 along each axis, whatever the grid


def eva_angles(grid: int, head_dim: int, theta: float = ROPE_THETA, integer_positions: bool = False) -> torch.Tensor:
    """[T, head_dim / 2] float32 angles of EVA's layout (row half, then column half), T = grid^2 row-major;
    `integer_positions`: arange(grid) itself (NanoGen's RoPE) rather than EVA's arange(g) / g * g."""
    if head_dim % 4:
        raise ValueError(f"2-D RoPE needs a head dimension divisible by 4, got {head_dim}")
    half = head_dim // 2  # EVA's `dim`: features per axis
    freqs = 1.0 / (theta ** (torch.arange(0, half, 2)[: half // 2].float() / half))  # [hd/4]
    pos = torch.arange(grid).float() if integer_positions else torch.arange(grid) / grid * grid  # float32
    per_axis = torch.outer(pos, freqs)  # [g, hd/4]
    rows = per_axis[:, None, :].expand(grid, grid, -1)
    cols = per_axis[None, :, :].expand(grid, grid, -1)
    return torch.cat([rows, cols], dim=-1).reshape(grid * grid, half)


class EvaRope(nn.Module):
    """EVA-style 2-D RoPE with its tables as buffers `freqs_cos` / `freqs_sin` [T, head_dim] (every pair's angle
    on both of its features), the names and shapes LightningDiT's and RAE's checkpoints hold."""

    def __init__(self, grid: int, head_dim: int):
        super().__init__()
        angles = eva_angles(grid, head_dim).repeat_interleave(2, dim=-1)  # [T, hd]
        self.register_buffer("freqs_cos", angles.cos())
        self.register_buffer("freqs_sin", angles.sin())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, heads, T, head_dim] -> x cos + rotate_half(x) sin (pairs (a, b) -> (-b, a)); float32 tables, so
        a 16-bit x comes back in float32, as in the releases."""
        pairs = x.reshape(*x.shape[:-1], -1, 2)
        turned = torch.stack([-pairs[..., 1], pairs[..., 0]], dim=-1).reshape(x.shape)
        cos, sin = cast(torch.Tensor, self.freqs_cos), cast(torch.Tensor, self.freqs_sin)
        return x * cos + turned * sin


class TokenRope(nn.Module):
    """RoPE of the image tokens of a sequence [prefix tokens; image tokens; condition tokens] (NanoGen's `RoPE`):
    buffers `freqs_cos` / `freqs_sin` [prefix + grid^2 + extra, head_dim], EVA's layout on integer positions for the
    image tokens and angle 0 (cos 1, sin 0) for the `prefix` tokens before them (REG's class token: NanoGen's
    `extra_tokens`) and the `extra` condition tokens after them, the names and shapes of NanoGen's files. Only the
    grid^2 image tokens of q or k are rotated: the rest is left as it is, which is what angle 0 does."""

    def __init__(self, grid: int, head_dim: int, extra: int = 0, prefix: int = 0):
        super().__init__()
        self.tokens, self.prefix = grid * grid, int(prefix)
        angles = torch.cat([torch.zeros(prefix, head_dim // 2), eva_angles(grid, head_dim, integer_positions=True),
                            torch.zeros(extra, head_dim // 2)]).repeat_interleave(2, dim=-1)  # [P + T + extra, hd]
        self.register_buffer("freqs_cos", angles.cos())
        self.register_buffer("freqs_sin", angles.sin())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, heads, L, head_dim] with the prefix tokens, then L >= grid^2 image tokens; float32 tables (a 16-bit
        x's image tokens come back in float32, the rest is cast alike)."""
        a, n = self.prefix, self.prefix + self.tokens
        head, image, rest = x[..., :a, :], x[..., a:n, :], x[..., n:, :]
        pairs = image.reshape(*image.shape[:-1], -1, 2)
        turned = torch.stack([-pairs[..., 1], pairs[..., 0]], dim=-1).reshape(image.shape)
        cos, sin = cast(torch.Tensor, self.freqs_cos)[a:n], cast(torch.Tensor, self.freqs_sin)[a:n]
        image = image * cos + turned * sin
        parts = [t.to(image.dtype) for t in (head, image, rest) if t.shape[-2]]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-2)


def ddt_rope_tables(grid: int, head_dim: int, theta: float = ROPE_THETA) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, head_dim / 2] float32 of DDT's layout (positions 0..16, axes interleaved pair by pair)."""
    if head_dim % 4:
        raise ValueError(f"2-D RoPE needs a head dimension divisible by 4, got {head_dim}")
    pos = torch.linspace(0, DDT_POSITION_SCALE, grid)
    rows, cols = torch.meshgrid(pos, pos, indexing="ij")
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 4)[: head_dim // 4].float() / head_dim))  # [hd/4]
    x_angles = torch.outer(cols.reshape(-1), freqs)  # [T, hd/4]
    y_angles = torch.outer(rows.reshape(-1), freqs)
    angles = torch.stack([x_angles, y_angles], dim=-1).reshape(grid * grid, head_dim // 2)
    return angles.cos(), angles.sin()


class DDTRope(nn.Module):
    """DDT's RoPE as a callable of q or k [N, heads, T, head_dim]: rotated in float32, returned in x's dtype. No
    state (the release recomputes its table for every input size), so it adds nothing to the state_dict."""

    def __init__(self, grid: int, head_dim: int):
        super().__init__()
        self.grid, self.head_dim = grid, head_dim
        self._tables: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        key = str(x.device)
        if key not in self._tables:
            cos, sin = ddt_rope_tables(self.grid, self.head_dim)
            self._tables[key] = (cos.to(x.device), sin.to(x.device))
        cos, sin = self._tables[key]
        return apply_rope(x.float(), cos, sin).to(x.dtype)


class AxialRope(nn.Module):
    """This project's DiT RoPE option (dit/blocks.py `rope_2d_tables`) as a callable of q or k, in x's dtype."""

    def __init__(self, grid: int, head_dim: int):
        super().__init__()
        self.grid, self.head_dim = grid, head_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cos, sin = rope_2d_tables(self.grid, self.head_dim, x.device, x.dtype)
        return apply_rope(x, cos, sin)
