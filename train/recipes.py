"""A recipe: a `dit-train --config` file (recipes/*.yaml) that holds a published result's training settings and,
under `recipe:`, what it reproduces. `TrainConfig.recipe` keeps that mapping, so config.json and every checkpoint
say which paper a run follows and which FID the paper states for it (the paper's number, never one measured
here); the plan prints it.

    recipe:
      name: LightningDiT-XL/1, 800 epochs
      paper: Yao et al. 2025, Reconstruction vs. Generation (LightningDiT)
      arxiv: "2501.01423"
      source: hustvl/LightningDiT configs/reproductions/lightningdit_xl_vavae_f16d32_800ep_cfg.yaml
      fid: 1.35                      # FID-50K as the paper states it
      fid_setting: cfg 6.7 on 3 channels, guidance where t >= 0.125, Euler 250-point grid shifted by 0.3
      epochs: 800
      extraction: dit-extract ... (the shard set the recipe needs)
      sampling: {sampler: euler, steps: 249, ...}   # dit-sample settings that gave the number
      gpu_hours: null                # as the paper states them, when it does
"""
from __future__ import annotations

from typing import Any, Mapping

RECIPE_KEYS = ("name", "paper", "arxiv", "source", "fid", "fid_setting", "epochs", "extraction", "sampling",
               "gpu_hours", "notes")
TEXT_KEYS = ("name", "paper", "arxiv", "source", "fid_setting", "extraction", "notes")
NUMBER_KEYS = ("fid", "epochs", "gpu_hours")


def recipe_problems(recipe: Any) -> list[str]:
    """Problems of a `recipe:` mapping (None: the run follows no recipe)."""
    if recipe is None:
        return []
    if not isinstance(recipe, Mapping):
        return [f"recipe: must be a mapping ({', '.join(RECIPE_KEYS)}), got {type(recipe).__name__}"]
    p = [f"recipe: unknown key {k!r} (known: {', '.join(RECIPE_KEYS)})" for k in recipe if k not in RECIPE_KEYS]
    for k in ("name", "paper"):
        if not isinstance(recipe.get(k), str) or not recipe[k].strip():
            p.append(f"recipe: {k!r} is required (text)")
    p += [f"recipe: {k!r} must be text, got {recipe[k]!r}" for k in TEXT_KEYS
          if recipe.get(k) is not None and not isinstance(recipe[k], str)]
    p += [f"recipe: {k!r} must be a number or null, got {recipe[k]!r}" for k in NUMBER_KEYS
          if recipe.get(k) is not None and (isinstance(recipe[k], bool) or not isinstance(recipe[k], (int, float)))]
    if recipe.get("sampling") is not None and not isinstance(recipe["sampling"], Mapping):
        p.append(f"recipe: 'sampling' must be a mapping of dit-sample settings, got {recipe['sampling']!r}")
    return p


def recipe_line(recipe: Mapping[str, Any] | None) -> list[str]:
    """The plan's line naming the recipe and the paper's FID (none without a recipe)."""
    if not recipe:
        return []
    arxiv = f", arXiv:{recipe['arxiv']}" if recipe.get("arxiv") else ""
    fid = (f"; the paper states FID {recipe['fid']:g}" + (f" ({recipe['fid_setting']})" if recipe.get("fid_setting")
                                                           else "") + ", not measured here") \
        if recipe.get("fid") is not None else ""
    hours = f"; {recipe['gpu_hours']:g} GPU-hours as the paper states them" if recipe.get("gpu_hours") else ""
    return [f"  recipe      {recipe['name']} ({recipe['paper']}{arxiv}){fid}{hours}"]
