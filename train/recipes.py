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
        vae: hustvl/vavae-imagenet256-f16d32-dinov2   # the VAE: hub id [/subfolder], or "pixels"
        encoder: null                # a feature encoder (null: a VAE)
        latent_space: null           # NanoGen's name of the space (common/latent_spaces.py, nanogen_encoders.py)
        reg: {encoder: dinov2-vit-b, resolution: 256}   # REG's class tokens (--reg-tokens): NanoGen's target
        pixels: false                # crops stored beside the latents (REPA's teacher)
        text: {encoder: Qwen/Qwen3-0.6B, dim: 1024, max_length: 256}   # a text model's --text set
      pending: []                    # settings of the release not built here yet (below)

How a tokenizer is recognised (`vae:`, `encoder:`, `text: {encoder}` against the manifests' identities): a hub id
recorded by the extraction is compared as it is (with its subfolder: black-forest-labs/FLUX.2-dev/vae); a local
copy is recognised by the hub id the extraction recorded for it (`hub_id`), by a Hugging Face cache path
(.../models--stabilityai--sd-vae-ft-ema/snapshots/<rev>/), or by its own name: a folder named after the repository
(.../sd-vae-ft-ema, .../FLUX.2-dev/vae or a pipeline folder .../FLUX.2-dev), or a weight file under a name the same
weights are published as (`VAE_ALIASES`: vae-ft-ema-560000-ema-pruned.safetensors). A feature encoder is
recognised by its model name under any of the names its weights go by (`ENCODER_NAMES`: NanoGen's `dinov2-vit-b`
is timm's vit_base_patch14_reg4_dinov2 and torch.hub's dinov2_vitb14_reg), never with random weights. The weights
themselves are not hashed against the release (no hash of them can be checked here): a folder of other weights
under the release's name passes, which is the user's own statement; a folder under another name departs.

A run departs from its recipe where (a) a setting that changes the trained model differs from the recipe file's
(a flag given over it: `--model DiT-S/2`, `--max-steps 100`, `--init FILE`; bookkeeping such as --run-dir,
--num-workers, --ckpt-every, the grids, FID during training, --precision or --compile does not count), or (b) the
shard set is not the extraction the recipe `requires`. (b) is refused before any work unless
`--allow-departures` says the run is meant to differ. Every departure is listed in the plan, kept in config.json
and every checkpoint (`recipe.departures`), and shown by dit-report, which puts the paper's number beside the run
only when nothing departs (issue 41, item 9). The text set given with --text is bookkeeping like --shards; its
encoder, width and max length are what `requires: text` compares.

`latent_space` (NanoGen's name of the space: its name in the manifest and NanoGen's normalization of it) and `reg`
(REG's class tokens given with --reg-tokens: their target encoder) are compared by train/identities.py,
which also recognises the tokenizers (`recognise`, `recognise_encoder`).

`pending:` lists what a release's config sets that this toolkit does not build yet, each {setting, value, nanogen,
owner, what} (the TrainConfig field it is expected to become, NanoGen's key): a run of such a recipe is refused
naming them, or with --allow-departures runs without them, each one a departure.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from dit_pipeline.common.errors import UserError
from dit_pipeline.train.identities import (ENCODER_NAMES, VAE_ALIASES, hub_parts, is_space,  # noqa: F401
                                           recognise, recognise_encoder, reg_departures, space_departures)

RECIPE_KEYS = ("name", "paper", "arxiv", "source", "fid", "fid_setting", "epochs", "extraction", "sampling",
               "gpu_hours", "notes", "requires", "pending", "departures", "recognised")
REQUIRE_KEYS = ("latent_shape", "image_size", "views", "normalization", "vae", "encoder", "latent_space", "pixels",
                "text", "reg")
TEXT_REQUIRE_KEYS = ("encoder", "dim", "max_length")
REG_REQUIRE_KEYS = ("encoder", "resolution")
PENDING_KEYS = ("setting", "value", "nanogen", "owner", "what")
PIXELS = "pixels"
NORMALIZATIONS = ("scalar", "per-channel", "per-position")
# settings that do not change the trained model: changing them is no departure from a recipe
NOT_DEPARTURES = frozenset((
    "vae", "vae_config", "cfg_channels", "sample_every", "sample_classes", "sample_steps", "sample_weights",
    "sample_cfg_scale", "fid_every", "fid_ref", "fid_num_samples", "fid_steps", "fid_cfg_scale", "fid_batch_size",
    "fid_labels", "fid_prompts", "inception", "fid_input_size", "fd_dinov2", "dinov2", "fid_random_inception",
    "on_divergence",
    "spike_factor", "spike_window", "max_skips", "skip_window", "shards", "run_dir", "manifest", "num_workers",
    "shuffle_buffer", "shards_in_flight", "prefetch_factor", "skip_bad_shards", "verify_shards", "micro_batch_size",
    "seed", "precision", "tf32", "grad_checkpointing", "compile", "attention", "jvp_attention", "ddp_bucket_mb",
    "log_every", "ckpt_every", "keep_last", "keep_every", "resume", "peak_tflops", "tensorboard", "wandb",
    "wandb_project", "quiet", "dry_run", "extra", "recipe", "allow_departures", "protocol", "parallel",
    "hsdp_shard_size", "gpu_memory", "log_keys",
    # the text set's folder, like --shards (its encoder is compared with `requires: text`); cached or online
    # features are the same numbers (tests/train/test_text_training.py)
    "text", "text_features",
    "reg_tokens",  # REG's cached class tokens: data, like --shards
    # a data mix's sources: data, like --shards (each checked against `requires`; a weight departs: data_departures)
    "source", "mix", "mix_lanes", "new_mix",
    # what is measured or drawn while training, not what is trained
    "val_shards", "val_every", "val_samples", "val_timesteps", "val_batch_size", "val_weights", "sample_prompts"))
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
        vae = req.get("vae")
        if vae is not None and not (vae == PIXELS or (isinstance(vae, str) and hub_parts(vae) is not None)):
            p.append(f"recipe: requires: vae is a hub id, owner/name or owner/name/subfolder, or {PIXELS!r}; got "
                     f"{vae!r}")
        text = req.get("text")
        if text is not None and not (isinstance(text, Mapping) and set(text) == set(TEXT_REQUIRE_KEYS)):
            p.append(f"recipe: requires: text is a mapping of {', '.join(TEXT_REQUIRE_KEYS)}, got {text!r}")
        reg = req.get("reg")
        if reg is not None and not (isinstance(reg, Mapping) and set(reg) == set(REG_REQUIRE_KEYS)):
            p.append(f"recipe: requires: reg is a mapping of {', '.join(REG_REQUIRE_KEYS)}, got {reg!r}")
        if req.get("latent_space") is not None and not is_space(str(req["latent_space"])):
            p.append(f"recipe: requires: latent_space {req['latent_space']!r} is none of NanoGen's spaces "
                     "(common/latent_spaces.py VAE_SPACES, common/nanogen_encoders.py ENCODER_SPACES)")
    pending = recipe.get("pending")
    if pending is not None and not (isinstance(pending, list) and all(
            isinstance(x, Mapping) and set(x) <= set(PENDING_KEYS) and {"setting", "value", "what"} <= set(x)
            for x in pending)):
        p.append(f"recipe: 'pending' is a list of mappings of {', '.join(PENDING_KEYS)} (setting, value and what "
                 f"required), got {pending!r}")
    for k in ("departures", "recognised"):
        if recipe.get(k) is not None and not isinstance(recipe[k], list):
            p.append(f"recipe: {k!r} is a list (written by dit-train), got {recipe[k]!r}")
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


def pending_departures(recipe: Mapping[str, Any] | None) -> list[str]:
    """The recipe's settings this toolkit does not build yet, one departure each ("not built here yet: REG, the
    DINOv2-B class token denoised beside the image (repa.use_reg true)")."""
    return [f"not built here yet: {x['what']}" + (f" ({x['nanogen']})" if x.get("nanogen") else "")
            for x in (recipe or {}).get("pending") or []]


def _vae_shown(identity: Mapping[str, Any] | None) -> str:
    if not identity:
        return "none"
    if identity.get("kind") == PIXELS:
        return PIXELS
    where = {"folder": "a local folder", "file": "a local file", "hub": "a hub id"}.get(str(identity.get("kind")), "")
    return f"{identity.get('source')}" + (f" ({where})" if where else "")


def extraction_departures(requires: Mapping[str, Any] | None, manifest: Any, text: Any = None,
                          text_folder: str | None = None, reg: Any = None,
                          reg_folder: str | None = None) -> tuple[list[str], list[str]]:
    """(where the shard set, the text set `text` given with --text and REG's class tokens `reg` given with
    --reg-tokens differ from the extraction the recipe requires: "latent shape 4x32x32 where the recipe needs
    768x16x16", ...; how each tokenizer the recipe names was recognised: "VAE stabilityai/sd-vae-ft-ema: its hub
    id"), from their manifests."""
    if not requires:
        return [], []
    m, out, met = manifest, [], []
    encoder = m.extraction.get("encoder") or {}
    have: dict[str, Any] = {
        "latent_shape": list(m.latent_shape), "image_size": m.image_size, "views": m.views,
        "normalization": "per-position" if m.norm.is_per_position else
        ("per-channel" if m.norm.is_per_channel else "scalar"),
        "encoder": encoder.get("model"), "pixels": bool(m.has_pixels)}
    words = {"latent_shape": "latent shape", "image_size": "image size", "views": "views (2: both flips)",
             "normalization": "normalization", "encoder": "feature encoder", "pixels": "stored pixels"}
    for key in REQUIRE_KEYS:
        if key not in requires:
            continue
        want: Any = list(requires[key]) if key == "latent_shape" else requires[key]
        if key == "vae" and want is not None:  # null: no VAE, a feature set (`encoder` says which)
            vae = m.extraction.get("vae")
            how = ("a pixel-space set" if (vae or {}).get("kind") == PIXELS else None) if want == PIXELS else \
                recognise(str(want), vae)
            if how is None:
                out.append(f"VAE {_vae_shown(vae)} where the recipe needs {want} (a local copy is recognised by its "
                           "name: docs/diffusionbench.md)")
            else:
                met.append(f"VAE {want}: {how}")
            continue
        if key == "encoder" and want is not None:
            how = recognise_encoder(str(want), encoder)
            if how is None:
                shown = "none (a VAE)" if not encoder else str(encoder.get("model")) + (
                    " with random weights" if str(encoder.get("weights") or "").startswith("random") else "")
                out.append(f"feature encoder {shown} where the recipe needs {want}")
            else:
                met.append(f"feature encoder {want}: {how}")
            continue
        if key == "text" and isinstance(want, Mapping):
            out += _text_departures(want, text, text_folder, met)
            continue
        if key == "reg" and isinstance(want, Mapping):
            out += reg_departures(want, reg, reg_folder, met)
            continue
        if key == "latent_space" and want is not None:
            out += space_departures(str(want), m, met)
            continue
        if key not in ("vae", "text", "reg", "latent_space") and have[key] != want:
            fmt = (lambda v: "x".join(map(str, v))) if key == "latent_shape" else \
                (lambda v: "none (a VAE)" if v is None else str(v))
            out.append(f"{words[key]} {fmt(have[key])} where the recipe needs {fmt(want)}")
    return out, met


def _text_departures(want: Mapping[str, Any], text: Any, folder: str | None, met: list[str]) -> list[str]:
    needs = f"{want['encoder']} (width {want['dim']}, max length {want['max_length']})"
    if text is None:
        return [f"no text set where the recipe needs the features of {needs}"]
    identity = text.text_encoder or {}
    how = recognise(str(want["encoder"]), _text_as_hub(identity))
    dim, length = identity.get("dim"), identity.get("max_length")
    if how is None or dim != want["dim"] or length != want["max_length"]:
        return [f"text set {folder}: {identity.get('source') or identity.get('name')} (width {dim}, max length "
                f"{length}) where the recipe needs {needs}"]
    met.append(f"text encoder {want['encoder']}: {how}, width {dim}, max length {length}")
    return []


def _text_as_hub(identity: Mapping[str, Any]) -> dict[str, Any]:
    """A text encoder identity (common/text_encoders.py: `source` a hub id or an absolute folder) in the form
    `recognise` reads."""
    source = str(identity.get("source") or identity.get("name") or "")
    return {**identity, "source": source, "kind": "folder" if source.startswith("/") else "hub"}


def check_recipe_extraction(cfg: Any, source: Any, mix: Any = None) -> Any:
    """A recipe run on a shard set (and text set) that is not the extraction its recipe requires, or of a recipe
    with settings not built here yet (`pending`, above): refused before any work, or with --allow-departures, run
    with every difference added to its departures. How each tokenizer was recognised goes to `recognised`. A data
    mix: each source (its shards, its text set, its class tokens) against the requirement, its name on what departs."""
    recipe = cfg.recipe if isinstance(cfg.recipe, dict) else None
    if recipe is None:
        return cfg
    found, met = data_departures(cfg, recipe.get("requires") or {}, source, mix)
    pending = pending_departures(recipe)
    recipe = {**recipe, "recognised": met}
    if not found and not pending:
        return dataclasses.replace(cfg, recipe=recipe)
    where = "the mix's sources" if mix is not None else source.folder or cfg.manifest
    if not cfg.allow_departures:
        why, anyway = [], []
        if found:
            why.append(f"needs another shard set than {where}: {'; '.join(found)}. Extract as the recipe says "
                       f"({recipe.get('extraction') or 'its extraction'})")
            anyway.append("train on these shards anyway")
        if pending:
            items = "; ".join(p.removeprefix("not built here yet: ") for p in pending)
            why.append(f"sets what this toolkit does not build yet: {items}")
            anyway.append("train without it")
        raise UserError(f"the recipe {recipe.get('name')!r} {'. It also '.join(why)}, or pass --allow-departures to "
                        f"{' and '.join(anyway)} (the paper's FID then does not apply)")
    known = list(recipe.get("departures") or [])
    new = [f"shards: {d}" for d in found] + pending
    return dataclasses.replace(cfg, recipe={**recipe, "departures": known + [d for d in new if d not in known]})


def data_departures(cfg: Any, requires: dict[str, Any], source: Any, mix: Any = None
                    ) -> tuple[list[str], list[str]]:
    """train.recipes.extraction_departures of the run's data: one shard set with --text and --reg-tokens, or every
    source of a mix with its own (text=, reg=), each departure prefixed with the source's name."""
    from dit_pipeline.train.reg import read_reg_tokens

    if mix is not None:
        found: list[str] = []
        met: list[str] = []
        for o in mix.sources:
            f, m = extraction_departures(requires, o.manifest, o.text, o.spec.text,
                                         None if o.reg is None else o.reg.manifest, o.spec.reg)
            found += [f"source {o.name}: {d}" for d in f]
            met += [x for x in m if x not in met]
            w = o.spec.weight  # the recipe's data is read once per epoch, every sample alike (repeat 1 too)
            if w.kind is not None and not (w.kind == "repeat" and w.repeat == 1):
                found.append(f"source {o.name}: weighted ({w.describe()}) where the recipe reads each "
                             "sample once per epoch")
        return found, met
    text = None
    if "text" in requires and cfg.text is not None and source.folder is not None:
        from dit_pipeline.shards.siblings import read_text_sibling

        text = read_text_sibling(source.manifest, cfg.text, "--text")
    reg = read_reg_tokens(cfg, source.manifest) if "reg" in requires else None
    return extraction_departures(requires, source.manifest, text, cfg.text, None if reg is None else reg.manifest,
                                 cfg.reg_tokens)


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
    met = "".join(f"\n  requires    {r}" for r in recipe.get("recognised") or [])
    return [f"  recipe      {recipe['name']} ({recipe['paper']}{arxiv}){fid}{hours}{met}"]
