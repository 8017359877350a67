"""DiT's fixed embeddings (docs/REFERENCE.md "Forward pass", "pos_embed"): the sinusoidal timestep features fed to
the timestep MLP and the 2-D sin-cos position table, computed as the official code's formulas state them."""
from __future__ import annotations

import math

import numpy as np
import torch

FREQUENCY_EMBEDDING_SIZE = 256  # sinusoidal features fed to the timestep MLP


def timestep_embedding(t: torch.Tensor, dim: int = FREQUENCY_EMBEDDING_SIZE,
                       max_period: float = 10000.0) -> torch.Tensor:
    """[N] timesteps -> [N, dim] float32 features concat(cos(t * f_k), sin(t * f_k)),
    f_k = exp(-ln(max_period) * k / (dim/2)), k = 0 .. dim/2 - 1."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device)
                      / half)
    args = t[:, None].float() * freqs[None]  # [N, half]
    emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
    if dim % 2:  # odd sizes get a zero column (never the case for DiT's 256)
        emb = torch.cat([emb, torch.zeros_like(emb[:, :1])], dim=-1)
    return emb


def _sincos_1d(dim: int, pos: np.ndarray) -> np.ndarray:
    """[M] positions -> [M, dim] float64 concat(sin(pos * w_k), cos(pos * w_k)), w_k = 10000^(-k/(dim/2))."""
    omega = 1.0 / 10000 ** (np.arange(dim // 2, dtype=np.float64) / (dim / 2.0))
    out = np.outer(pos.reshape(-1).astype(np.float64), omega)  # [M, dim/2]
    return np.concatenate([np.sin(out), np.cos(out)], axis=1)


def pos_embed_2d(dim: int, grid_size: int) -> np.ndarray:
    """[grid^2, dim] float64 table; tokens row-major, first dim/2 features from the column index,
    the other half from the row index."""
    if dim % 4:
        raise ValueError(f"hidden size must be divisible by 4 for the 2-D sin-cos table, got {dim}")
    rows, cols = np.meshgrid(np.arange(grid_size), np.arange(grid_size), indexing="ij")
    return np.concatenate([_sincos_1d(dim // 2, cols), _sincos_1d(dim // 2, rows)], axis=1)
