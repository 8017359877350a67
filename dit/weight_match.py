"""A state_dict against the architectures: its family (`detect_family`: a stored model_config's, else recognised by
its keys), the model_config its tensor shapes describe (`infer_model_config`: each family's `infer_config`,
dit/family.py and dit/infer.py, with what shapes cannot show taken from a stored record, the reference training args
or the caller's hints), its conditions (`conditions_from_keys`), and the strict check of every key, shape and fixed
table before a model is touched (`check_state_dict`), so a mismatch fails with a message and never half-loads.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

from .family import family_class, lookup_preset, model_from_config
from .infer import WeightsError


def detect_family(state_dict: dict[str, torch.Tensor], stored: dict[str, Any] | None) -> str:
    """The family of a state_dict: a stored model_config's "family", else recognised by its keys (iMF: its u head's
    final layer; DiT-DH: both patch embeddings and Fourier time features; DDT: both, Linear patch embeddings;
    LightningDiT: its RoPE buffers, learned norm scales, a 4 D adaLN (wo_shift) or its unrounded SwiGLU width;
    DiT-DH-IC: NanoGen's time tokens; PixArt: its adaLN-single t_block; DiT otherwise)."""
    if stored and stored.get("family"):
        return str(stored["family"])
    if "u_final_layer.linear.weight" in state_dict:
        return "iMF"
    if "t_block.1.weight" in state_dict:
        return "PixArt"  # adaLN-single
    if "s_embedder.proj.weight" in state_dict:
        if "t_embedder.learnable_tokens" in state_dict:
            return "DiT-DH-IC"  # NanoGen's in-context DiT-DH: time tokens
        return "DiT-DH" if "t_embedder.W" in state_dict else "DDT"
    if any(k in state_dict for k in ("feat_rope.freqs_cos", "blocks.0.norm1.weight", "final_layer.norm_final.weight")):
        return "LightningDiT"
    if "x_embedder.proj.weight" in state_dict and "blocks.0.adaLN_modulation.1.weight" in state_dict:
        from .blocks import swiglu_hidden
        from .lightningdit import swiglu_width

        hidden = state_dict["x_embedder.proj.weight"].shape[0]
        if state_dict["blocks.0.adaLN_modulation.1.weight"].shape[0] == 4 * hidden:
            return "LightningDiT"
        w3 = state_dict.get("blocks.0.mlp.w3.weight")
        if w3 is not None and w3.shape[1] == swiglu_width(hidden) != swiglu_hidden(hidden, 4):
            return "LightningDiT"
    return "DiT"


def infer_model_config(state_dict: dict[str, torch.Tensor], stored: dict[str, Any] | None = None,
                       args: dict[str, Any] | None = None, where: str = "state_dict",
                       hints: dict[str, Any] | None = None) -> dict[str, Any]:
    """The model_config matching the tensor shapes, of the file's family (`detect_family`). What shapes cannot
    show (the head count, some families' splits and sizes) comes from the stored model_config, the reference
    training args' model name, the `hints`, or the one preset of these dimensions (dit/infer.py); the result is
    checked against every tensor (`check_state_dict`)."""
    if not stored and args and isinstance(args.get("model"), str):
        try:
            cls, preset = lookup_preset(args["model"])
        except ValueError as e:
            raise WeightsError(f"{where}: training args name an unknown model: {e}") from None
        stored = {"num_heads": cls.presets[preset]["num_heads"],
                  **({"num_classes": args["num_classes"]} if isinstance(args.get("num_classes"), int) else {})}
    family = detect_family(state_dict, stored)
    try:
        cls = family_class(family)
    except ValueError as e:
        raise WeightsError(f"{where}: {e}") from None
    config = cls.infer_config(state_dict, stored, where, {k: v for k, v in (hints or {}).items() if v is not None})
    config = {**config, **conditions_from_keys(state_dict, stored, where)}
    check_state_dict(state_dict, config, where)
    return config


def conditions_from_keys(state_dict: Mapping[str, torch.Tensor], stored: Mapping[str, Any] | None,
                         where: str) -> dict[str, str]:
    """The model_config entry of the conditions (dit/conditions.py) the file's embedders show, checked against
    the stored record; {} for a plain model."""
    found = "imf" if "omega_embedder.mlp.0.weight" in state_dict else \
        "meanflow" if "h_embedder.mlp.0.weight" in state_dict or "t_abs_embedder.mlp.0.weight" in state_dict else "t"
    recorded = str((stored or {}).get("conditions", found))
    if recorded != found:
        raise WeightsError(f"{where}: its model_config records conditions {recorded!r} but its tensors are those of "
                           f"{found!r}")
    return {} if found == "t" else {"conditions": found}


def check_state_dict(state_dict: dict[str, torch.Tensor], config: dict[str, Any],
                     where: str = "state_dict") -> None:
    """Every key, shape and value check a strict load would need, plus finiteness and the family's fixed tables
    (the sin-cos position table, RoPE buffers); raises WeightsError listing what does not match."""
    try:
        with torch.device("meta"):
            model = model_from_config({**config, "model": None})
        expected = model.state_dict()
        fixed = type(model).fixed_tensors(config)
    except ValueError as e:
        raise WeightsError(f"{where}: {e}") from None
    missing = sorted(set(expected) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(expected))
    wrong = [f"{k}: {list(state_dict[k].shape)} vs {list(v.shape)}" for k, v in expected.items()
             if k in state_dict and state_dict[k].shape != v.shape]
    problems = ([f"missing {missing[:6]}{' ...' if len(missing) > 6 else ''}"] if missing else []) + \
        ([f"unexpected {unexpected[:6]}{' ...' if len(unexpected) > 6 else ''}"] if unexpected else []) + \
        ([f"shape mismatch {wrong[:6]}"] if wrong else [])
    if problems:
        raise WeightsError(f"{where} does not match a {type(model).family} with {config}: " + "; ".join(problems))
    # meta tensors (a sharded checkpoint's, before any of its tensors is read) have shapes, not values
    bad = [k for k, v in state_dict.items() if v.is_floating_point() and not v.is_meta and not torch.isfinite(v).all()]
    if bad:
        raise WeightsError(f"{where}: non-finite values (NaN/Inf) in {bad[:6]}; the file is corrupt")
    for key, table in fixed.items():
        if state_dict[key].is_meta:
            continue
        # atol loose enough for weights stored in bf16; another layout differs by O(1)
        if not torch.allclose(state_dict[key].double(), table.double(), atol=1e-2):
            what = "DiT's fixed 2-D sin-cos table" if key == "pos_embed" else "the family's RoPE table"
            raise WeightsError(f"{where}: {key} is not {what}; these weights come from a different architecture")
