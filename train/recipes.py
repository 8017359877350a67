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
      sampling: {protocol: lightningdit, ...}   # dit-sample settings that gave the number (a release's protocol)
      gpu_hours: null                # as the paper states them, when it does
      requires:                      # the extraction, compared with the shard set's manifest
        latent_shape: [32, 16, 16]
        image_size: 256
        views: 2                     # both flips
        normalization: per-channel   # scalar, per-channel or per-position
        encoder: null                # a feature encoder's timm model (null: a VAE)
        pixels: false                # crops stored beside the latents (REPA's teacher)

A run departs from its recipe where (a) a setting that changes the trained model differs from the recipe file's
(a flag given over it: `--model DiT-S/2`, `--max-steps 100`, `--init FILE`; bookkeeping such as --run-dir,
--num-workers, --ckpt-every, the grids, FID during training, --precision or --compile does not count), or (b) the
shard set is not the extraction the recipe `requires`. (b) is refused before any work unless
`--allow-departures` says the run is meant to differ. Every departure is listed in the plan, kept in config.json
and every checkpoint (`recipe.departures`), and shown by dit-report, which puts the paper's number beside the run
only when nothing departs (issue 41, item 9).
"""
from __future__ import annotations

from typing import Any, Mapping

RECIPE_KEYS = ("name", "paper", "arxiv", "source", "fid", "fid_setting", "epochs", "extraction", "sampling",
               "gpu_hours", "notes", "requires", "departures")
REQUIRE_KEYS = ("latent_shape", "image_size", "views", "normalization", "encoder", "pixels")
NORMALIZATIONS = ("scalar", "per-channel", "per-position")
# settings that do not change the trained model: changing them is no departure from a recipe
NOT_DEPARTURES = frozenset((
    "vae", "vae_config", "cfg_channels", "sample_every", "sample_classes", "sample_steps", "sample_weights",
    "sample_cfg_scale", "fid_every", "fid_ref", "fid_num_samples", "fid_steps", "fid_cfg_scale", "fid_batch_size",
    "fid_labels", "inception", "fid_input_size", "fd_dinov2", "dinov2", "fid_random_inception", "on_divergence",
    "spike_factor", "spike_window", "max_skips", "skip_window", "shards", "run_dir", "manifest", "num_workers",
    "shuffle_buffer", "shards_in_flight", "prefetch_factor", "skip_bad_shards", "verify_shards", "micro_batch_size",
    "seed", "precision", "tf32", "grad_checkpointing", "compile", "attention", "jvp_attention", "ddp_bucket_mb",
    "log_every", "ckpt_every", "keep_last", "keep_every", "resume", "peak_tflops", "tensorboard", "wandb",
    "wandb_project", "quiet", "dry_run", "extra", "recipe", "allow_departures", "protocol", "parallel",
    "hsdp_shard_size", "gpu_memory", "log_keys"))
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
    req = recipe.get("requires")
    if req is not None and not isinstance(req, Mapping):
        p.append(f"recipe: 'requires' must be a mapping ({', '.join(REQUIRE_KEYS)}), got {req!r}")
    elif req is not None:
        p += [f"recipe: requires: unknown key {k!r} (known: {', '.join(REQUIRE_KEYS)})" for k in req
              if k not in REQUIRE_KEYS]
        if req.get("normalization") not in (None, *NORMALIZATIONS):
            p.append(f"recipe: requires: normalization must be one of {', '.join(NORMALIZATIONS)}, got "
                     f"{req['normalization']!r}")
    if recipe.get("departures") is not None and not isinstance(recipe["departures"], list):
        p.append(f"recipe: 'departures' is a list (written by dit-train), got {recipe['departures']!r}")
    return p


def setting_departures(recipe_values: Mapping[str, Any], given: Mapping[str, Any],
                       defaults: Mapping[str, Any]) -> list[str]:
    """The settings given over a recipe file that change the trained model: "--model DiT-DH-XL -> DiT-S/2"."""
    out = []
    for name, value in given.items():
        if name in NOT_DEPARTURES:
            continue
        was = recipe_values.get(name, defaults.get(name))
        if was != value:
            out.append(f"--{name.replace('_', '-')} {_shown(was)} -> {_shown(value)}")
    return out


def _shown(v: Any) -> str:
    return "unset" if v is None else (f"{v:g}" if isinstance(v, float) else str(v))


def extraction_departures(requires: Mapping[str, Any] | None, manifest: Any) -> list[str]:
    """Where the shard set differs from the extraction the recipe requires ("latent shape 4x32x32 where the recipe
    needs 768x16x16 (...)"), from its manifest."""
    if not requires:
        return []
    m, out = manifest, []
    have: dict[str, Any] = {
        "latent_shape": list(m.latent_shape), "image_size": m.image_size, "views": m.views,
        "normalization": "per-position" if m.norm.is_per_position else
        ("per-channel" if m.norm.is_per_channel else "scalar"),
        "encoder": (m.extraction.get("encoder") or {}).get("model"), "pixels": bool(m.has_pixels)}
    words = {"latent_shape": "latent shape", "image_size": "image size", "views": "views (2: both flips)",
             "normalization": "normalization", "encoder": "feature encoder", "pixels": "stored pixels"}
    for key in REQUIRE_KEYS:
        if key not in requires:
            continue
        want = list(requires[key]) if key == "latent_shape" else requires[key]
        if have[key] != want:
            fmt = (lambda v: "x".join(map(str, v))) if key == "latent_shape" else \
                (lambda v: "none (a VAE)" if v is None else str(v))
            out.append(f"{words[key]} {fmt(have[key])} where the recipe needs {fmt(want)}")
    return out


def recipe_line(recipe: Mapping[str, Any] | None) -> list[str]:
    """The plan's lines naming the recipe and the paper's FID (only when the run departs from it in nothing),
    then every departure (none without a recipe)."""
    if not recipe:
        return []
    arxiv = f", arXiv:{recipe['arxiv']}" if recipe.get("arxiv") else ""
    departures = list(recipe.get("departures") or [])
    fid = (f"; the paper states FID {recipe['fid']:g}" + (f" ({recipe['fid_setting']})" if recipe.get("fid_setting")
                                                           else "") + ", not measured here") \
        if recipe.get("fid") is not None and not departures else ""
    if departures:
        fid = (f"; this run departs from it in {len(departures)} way(s), so the paper's number does not apply to it:"
               + "".join(f"\n  departs     {d}" for d in departures))
    hours = f"; {recipe['gpu_hours']:g} GPU-hours as the paper states them" if recipe.get("gpu_hours") else ""
    return [f"  recipe      {recipe['name']} ({recipe['paper']}{arxiv}){fid}{hours}"]
