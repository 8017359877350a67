"""Conditioning inputs beyond the time and the class, for every model family through one place.

A model's `conditions` (recorded in its model_config when not "t") says what its time input holds:

- "t" (every model so far): t [N], the time (or DDPM step) alone.
- "meanflow" (MeanFlow, Geng et al. 2025): t [N, 2] = (t, h) with h = t - r, the length of the interval whose
  average velocity the network predicts. The time embedding is t_embedder(t) + h_embedder(h): h_embedder is a
  second timestep embedder of the family's own kind (DiT's sinusoidal MLP, DiT-DH's Fourier one).
- "imf" (improved MeanFlow, arXiv:2512.02012): t [N, 5] = (t, h, omega, t_min, t_max). iMF's own network (dit/imf.py,
  the release's) takes them as in-context tokens and adds nothing here. On the adaLN families (objective
  imf-adaln, this project's variant) the network is conditioned on h, not on t: t_embedder(h) (the t embedder's
  weights serve the one time input, so no parameter is left without a gradient under DDP), plus one embedder for
  each of the guidance scale omega and the guidance interval's ends, added to the time embedding (the one
  conditioning path every family shares, `DiffusionTransformer.embed_conditions`). omega is embedded as
  1 - 1 / omega (0 = no guidance), as the release's imfDiT does.

The added embedders are created by `add_conditions` after the family's own construction and initialisation, so a
plain model's parameters and their random initialisation are exactly those of before. MeanFlow's h_embedder
starts as the MeanFlow release starts it (Gsunshine/meanflow models/models_dit.py `TimestepEmbedder`: both Linear
weights normal(0.02), biases zero; the same when `dit-train --init` brings the rest from a SiT/DiT file); imf-adaln's
embedders start with their output layers at zero (the model starts as if it had no further input) and their first
layers as DiT initialises its t embedder.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn

CONDITIONS = ("t", "meanflow", "imf")
WIDTH = {"t": 1, "meanflow": 2, "imf": 5}  # columns of the time input
EXTRA_EMBEDDERS = {"t": (), "meanflow": ("h_embedder",), "imf": ("omega_embedder", "tmin_embedder", "tmax_embedder")}


def conditions_of(config: Mapping[str, Any]) -> str:
    """The conditions a model_config records (absent: "t", every file before MeanFlow)."""
    kind = str(config.get("conditions", "t"))
    if kind not in CONDITIONS:
        raise ValueError(f"unknown model conditions {kind!r}; known: {', '.join(CONDITIONS)}")
    return kind


def add_conditions(model: Any, kind: str) -> None:
    """Give `model` (a DiffusionTransformer) the embedders of `kind`, built like its t_embedder and initialised
    (first layer normal(0.02), last layer zero); "t" adds nothing."""
    if kind not in CONDITIONS:
        raise ValueError(f"unknown model conditions {kind!r}; known: {', '.join(CONDITIONS)}")
    model.conditions = kind
    template = model.t_embedder
    for name in EXTRA_EMBEDDERS[kind]:
        embedder = _like(template, last_zero=kind != "meanflow")
        setattr(model, name, embedder)


def _like(template: Any, last_zero: bool) -> nn.Module:
    """A fresh embedder of the template's class and size (no weights shared): biases zero, the first Linear's weight
    normal(0.02), the last one's zero (`last_zero`) or normal(0.02) (module docstring)."""
    import copy

    embedder = copy.deepcopy(template)
    if embedder.mlp[0].weight.device.type != "meta":
        with torch.no_grad():
            for p in embedder.parameters():
                if p.requires_grad:
                    nn.init.zeros_(p)
            nn.init.normal_(embedder.mlp[0].weight, std=0.02)
            if not last_zero:
                nn.init.normal_(embedder.mlp[2].weight, std=0.02)
    return embedder


def check_time_input(model: Any, t: torch.Tensor, n: int) -> None:
    kind = getattr(model, "conditions", "t")
    want = [n] if WIDTH[kind] == 1 else [n, WIDTH[kind]]
    if list(t.shape) != want:
        raise ValueError(f"a model with conditions {kind!r} takes a time input of shape {want}, got {list(t.shape)}"
                         + ("" if kind == "t" else f" (columns: {', '.join(columns(kind))})"))


def columns(kind: str) -> tuple[str, ...]:
    return {"t": ("t",), "meanflow": ("t", "h"), "imf": ("t", "h", "omega", "t_min", "t_max")}[kind]


def embed_time(model: Any, t: torch.Tensor) -> torch.Tensor:
    """The time embedding [N, D] of the time input `t` (its shape checked by check_time_input)."""
    kind = getattr(model, "conditions", "t")
    if kind == "t":
        return model.t_embedder(t)
    if kind == "meanflow":
        return model.t_embedder(t[:, 0]) + model.h_embedder(t[:, 1])
    return (model.t_embedder(t[:, 1]) + model.omega_embedder(1.0 - 1.0 / t[:, 2]) + model.tmin_embedder(t[:, 3])
            + model.tmax_embedder(t[:, 4]))
