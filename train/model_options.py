"""The model settings' tables and what a model name implies: the preset overrides a run may give
(`ARCH_OVERRIDES`), the block switches passed only when given (`MODEL_OPTIONS`), `--conditioning`'s values
(`RUN_CONDITIONINGS`), and the objective a SiT or flow-family name implies (`is_sit_name`, `implied_objective`).
"""
from __future__ import annotations

from typing import Any

from dit_pipeline.dit.conditioning import CONDITIONINGS

MODEL_OPTIONS = ("qk_norm", "rms_norm", "swiglu", "rope", "wo_shift")  # block switches, passed only when given
ARCH_OVERRIDES = ("depth", "hidden_size", "num_heads", "patch_size", "encoder_depth", "head_depth", "head_hidden_size",
                  "head_num_heads", "bottleneck_dim", "in_context_len", "in_context_start", "num_t_tokens", "num_c_tokens")
RUN_CONDITIONINGS = ("auto", *CONDITIONINGS)  # --conditioning; auto: text with --text, else class labels


def is_sit_name(model: Any) -> bool:
    """A SiT preset name (SiT-XL/2, ...): DiT's network trained with SiT's flow objective (Ma et al. 2024)."""
    return str(model or "").strip().lower().startswith("sit-")


def implied_objective(model: Any) -> str | None:
    """The objective a model name implies: flow for a SiT name, a family's own (dit/family.py
    `default_objective`: flow for LightningDiT, DDT, DiT-DH, whose releases train flow models); None for DiT."""
    if is_sit_name(model):
        return "flow"
    from dit_pipeline.dit.family import lookup_preset

    try:
        objective = lookup_preset(str(model))[0].default_objective
    except ValueError:  # validate() reports the unknown name
        return None
    return objective if objective != "ddpm" else None
