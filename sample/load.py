"""Loading a DiT for sampling or export, and deciding which latent normalization decodes its samples.

Weight files of every kind go through `dit.load_dit_weights` (safe loading, shape inference); this module
turns its errors into user-facing ones, applies `--weights` and `--model`, and reads the latent normalization
that our checkpoints (and our safetensors exports) carry, per-channel statistics included. Official files have
none, so the VAE config's is used (docs/REFERENCE.md: `scaling_factor` 0.18215 for the SD-VAE, read from the
config, never a literal).
"""
from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dit_pipeline import dit
from dit_pipeline.common.errors import UserError
from dit_pipeline.common.latent_norm import LatentNorm
from dit_pipeline.common.latent_stats import read_stats_file
from dit_pipeline.common.log import get_logger
from dit_pipeline.dit.formats import SHARDED_SUFFIX

SAFETENSORS_LATENT_KEY = "latent"


@dataclass
class LoadedModel:
    model: dit.DiffusionTransformer  # any family (dit/family.py)
    state_dict: dict[str, torch.Tensor]
    info: dict[str, Any]  # from dit.load_dit_weights: source, weights, model_config, preset, latent?, step?

    @property
    def config(self) -> dict[str, Any]:
        return self.info["model_config"]

    @property
    def latent(self) -> dict[str, Any] | None:
        return self.info.get("latent")

    def describe(self) -> str:
        c = self.config
        family = dit.family.family_of_config(c)
        name = c["model"] or f"custom {family.family} ({family.describe(c)})"
        step = f", step {self.info['step']}" if self.info.get("step") is not None else ""
        release = f" ({self.info['release']}'s release)" if self.info.get("release") else ""
        cond = dit.conditioning.conditioning_of(c).describe()  # "1000 classes", "text features of width 1024"
        return (f"{name}, {c['input_size']}x{c['input_size']}x{c['in_channels']} latents, {cond}, "
                f"{self.info['source']} file{release}, {self.info['weights']} weights{step}")


def latent_shape(loaded: LoadedModel) -> tuple[int, int, int]:
    """The model's latent shape (channels, height, width), as the protocols' grids and the run record take it."""
    c = loaded.config
    return int(c["in_channels"]), int(c["input_size"]), int(c["input_size"])


def _safetensors_latent(path: Path) -> dict[str, Any] | None:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt", device="cpu") as f:
        raw = (f.metadata() or {}).get(SAFETENSORS_LATENT_KEY)
    return json.loads(raw) if raw else None


def manifest_folder(info: dict[str, Any]) -> Path | None:
    """The folder of the shard set a checkpoint was trained on (its training config's --manifest or --shards),
    where an old manifest's relative VAE path is looked for first (common.vae_identity.recorded_vae); None if
    unknown."""
    config = info.get("config") or {}
    if config.get("manifest"):
        return Path(str(config["manifest"])).expanduser().parent
    shards = Path(str(config.get("shards") or "")).expanduser()
    return shards if config.get("shards") and shards.is_dir() else None


_CKPT_RE = re.compile(r"^step-(\d{7,})\.pt$")  # train.checkpoint's names (sample/ does not import train/)


def resolve_ckpt(ckpt: str | Path) -> Path:
    """The weight file `--ckpt` means: the file itself, or for a run folder (or its checkpoints/ folder) its
    newest full checkpoint, said in the log; UserError for a folder without one."""
    path = Path(ckpt).expanduser()
    if not path.is_dir() or path.name.endswith(SHARDED_SUFFIX):  # a sharded checkpoint: the loader says what to do
        return path
    folder = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    steps = sorted((int(m.group(1)), p) for p in folder.iterdir() if (m := _CKPT_RE.match(p.name)))
    if not steps:
        sharded = sorted(p.name for p in folder.iterdir() if p.name.endswith(SHARDED_SUFFIX))
        if sharded:
            raise UserError(f"--ckpt {ckpt}: its checkpoints are sharded (newest {sharded[-1]}); write one as a "
                            f"single file first with `dit-train --consolidate {folder / sharded[-1]}`")
        raise UserError(f"--ckpt {ckpt}: a folder without checkpoints (expected a run folder holding "
                        "checkpoints/step-NNNNNNN.pt, or a weight file)")
    newest = steps[-1][1]
    get_logger().info("--ckpt %s is a run folder: using its newest checkpoint %s", ckpt, newest)
    return newest


def load_weights(ckpt: str | Path, *, weights: str = "ema", expect_model: str | None = None,
                 num_heads: int | None = None, input_size: int | None = None, encoder_depth: int | None = None
                 ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(state_dict, info) of `ckpt` (a weight file or a run folder: resolve_ckpt), with --weights and --model
    applied; UserError on any mismatch. --model's preset, --num-heads, --input-size and --encoder-depth tell the
    loader what a file cannot state (a custom size's heads, DDT's latent size and encoder split); the file's own
    record (or its sidecar) wins."""
    path = resolve_ckpt(ckpt)
    hints: dict[str, Any] = {}
    if expect_model is not None:
        try:
            cls, preset = dit.family.lookup_preset(expect_model)
        except ValueError as e:
            raise UserError(f"--model: {e}") from None
        hints.update(cls.presets[preset])
    hints.update({k: v for k, v in (("num_heads", num_heads), ("input_size", input_size),
                                    ("encoder_depth", encoder_depth)) if v is not None})
    try:
        state_dict, info = dit.load_dit_weights(path, prefer=weights, hints=hints)
    except dit.WeightsError as e:
        raise UserError(f"--ckpt: {e}") from None
    if info["weights"] in ("ema", "model") and info["weights"] != weights:
        raise UserError(f"--weights {weights}: {path} has no {weights!r} weights (only {info['weights']!r}); "
                        f"pass --weights {info['weights']}")
    if path.suffix == ".safetensors" and "latent" not in info:
        try:
            latent = _safetensors_latent(path)
        except ValueError as e:
            raise UserError(f"--ckpt {path}: metadata 'latent' is not valid JSON ({e})") from None
        if latent:
            info["latent"] = latent
    if expect_model is not None:
        want = dit.canonical_model_name(expect_model)
        if info["preset"] != want:
            c = info["model_config"]
            raise UserError(f"--model {want}, but {path} holds the weights of {info['preset'] or 'a custom DiT'} "
                            f"(depth {c['depth']}, hidden {c['hidden_size']}, patch {c['patch_size']}); "
                            "drop --model or pass the matching checkpoint")
    return state_dict, info


def load_model(ckpt: str | Path, *, weights: str = "ema", expect_model: str | None = None,
               device: torch.device | str = "cpu", num_heads: int | None = None,
               input_size: int | None = None, encoder_depth: int | None = None) -> LoadedModel:
    """The model of `ckpt` in eval mode on `device` (float32 weights; precision is applied by autocast)."""
    state_dict, info = load_weights(ckpt, weights=weights, expect_model=expect_model, num_heads=num_heads,
                                    input_size=input_size, encoder_depth=encoder_depth)
    try:
        model = dit.build_model_from_weights(state_dict, info, device=device, dtype=torch.float32)
    except dit.WeightsError as e:
        raise UserError(f"--ckpt: {e}") from None
    return LoadedModel(model=model, state_dict=state_dict, info=info)


def resolve_objective(info: dict[str, Any], ckpt: str | Path, given: str | None) -> str:
    """The model's objective: recorded in our checkpoints, sidecars, EMA files and exports; else --objective; else
    "flow" for an official SiT release file (named SiT-*), "ddpm" for DiT's (DiT-*) and for the reference training
    script's checkpoints. A bare state_dict with none of these (e.g. an EMA file written before issue #34, copied
    without its sidecar) is refused naming the sidecar and the flags that replace it: its objective, time convention
    and latent normalization cannot be known, and a guess samples a flow model with DDPM, exit 0.
    UserError when --objective contradicts the record."""
    if info.get("objective_from") and given is not None:  # a release's convention, not a record: --objective wins
        return given
    recorded = info.get("objective")
    if recorded is not None and given is not None and recorded != given:
        raise UserError(f"--objective {given}, but {ckpt} records a {recorded} model; drop --objective")
    if recorded is not None:
        return str(recorded)
    if given is not None:
        return given
    name = Path(ckpt).name.lower()
    if name.startswith("sit-"):
        return "flow"
    if info.get("source") == "official" and not name.startswith("dit-"):
        raise UserError(f"--ckpt {ckpt}: a bare state_dict with no record of how it was trained (no sidecar "
                        f"{dit.sidecar_path(ckpt).name} beside it, none inside it); put the sidecar back, or pass "
                        "--objective ddpm|flow (a flow model also --flow-convention sit|repa and --time-shift S if "
                        "it trained shifted; per-channel latents --latent-stats FILE)")
    return "ddpm"


def resolve_flow_convention(info: dict[str, Any], ckpt: str | Path, given: str | None) -> str:
    """The flow model's time convention ("sit" or "repa", dit.flow_samplers): what our files record (SiT's unless they
    say "repa"); for other files --flow-convention, else "repa" when dit.load_dit_weights found REPA's projector
    keys or training args, else "sit". UserError when --flow-convention contradicts a record."""
    found, why = info.get("flow_convention", "sit"), info.get("flow_convention_from", "default")
    if why == "recorded" and given is not None and given != found:
        raise UserError(f"--flow-convention {given}, but {ckpt} records a flow model in {found}'s time; "
                        "drop --flow-convention")
    return given if given is not None else found


def with_latent_stats(norm: LatentNorm, info: dict[str, Any], stats: str | None, channels: int,
                      ckpt: str | Path) -> LatentNorm:
    """`norm` with the per-channel statistics of --latent-stats when given. A release file trained on per-channel
    statistics it does not hold (LightningDiT's `latent_norm`: info["latent_required"]) needs them from the VAE
    config or --latent-stats; UserError naming the flag otherwise (decoding with another normalization would give
    wrong images silently)."""
    if stats:
        return norm.with_record(read_stats_file(stats, channels))
    required = info.get("latent_required")
    if required and not norm.is_per_channel:
        raise UserError(f"--ckpt {ckpt}: it was trained on latents normalized per channel ({required['what']}, "
                        f"multiplier {required['multiplier']:g}), which the file does not hold and the VAE config "
                        "does not give; pass --latent-stats FILE")
    return norm


def latent_norm(latent: dict[str, Any] | None, vae_identity: dict[str, Any],
                log: logging.Logger | None = None) -> LatentNorm:
    """The normalization (common/latent_norm.py) whose inverse decodes this model's latents.

    A checkpoint that records what it was trained on wins (a per-channel normalization included); otherwise the
    VAE config's (its latents_mean/latents_std where it has them, else its scaling and shift factors).
    """
    vae = LatentNorm.of_vae(vae_identity)
    if not latent or latent.get("scaling_factor") is None:
        return vae
    mine = LatentNorm.from_record(latent)
    if log is not None and mine.key() != vae.key():
        log.warning("the checkpoint was trained on latents normalized as %s, but the VAE config says %s; decoding "
                    "with the checkpoint's values", mine.describe(), vae.describe())
    return mine
