"""The file layouts of the releases whose checkpoints `dit.load_dit_weights` reads, and their conventions.

Every release keeps its network's parameter names (dit/ddt.py, dit/ditdh.py, dit/lightningdit.py use them as
they are), so reading a release is: find the weights in its container, drop what only trained, say which family
the tensors are, and record how its time runs. Containers (facts of each release's training script):

| file | container | weights taken |
|---|---|---|
| DiT / SiT release | a bare state_dict | it |
| DiT / SiT / REPA / REPA-E `train.py` | `{model, ema, opt, args[, steps, vae]}` | `ema` (or `model`) |
| LightningDiT `train.py` (hustvl/LightningDiT) | `{model, ema, opt, config}`, config = its YAML as a dict | `ema` |
| RAE stage 2 (bytetriper/RAE src/train.py) | `{step, epoch, model, ema, optimizer, scheduler}` | `ema` |
| NanoGen stage 2 (End2End-Diffusion/diffusion-bench src/utils/checkpoint.py l.65-84) | the same as RAE's | `ema` |
| NanoGen's releases `<name>-v<n>.pt` (src/utils/model_utils.py l.33-39 loads either) | RAE's, or a bare state_dict | `ema` (or it) |
| DDT (MCG-NJU/DDT, a Lightning checkpoint) | `{state_dict: {denoiser.*, ema_denoiser.*, diffusion_trainer.*}, ...}` | `ema_denoiser.*` |
| iMF, its PyTorch branch (Lyy-iiis/imeanflow `torch`: iMF-B-2.pth ...) | a bare state_dict, `net.*` with `_flax_linear` | it, renamed (dit/imf.py) |
| iMF, its JAX TrainState flattened to `.npz` (dit/imf.py `from_flax_params`) | `params/net/...`, `ema_params/net/...` | `ema_params` |
| this project's | `{format: "dit-pipeline.checkpoint", ...}` (docs/ARCHITECTURE.md) | `ema` |

Conventions (each release's transport code; `info["flow_convention"]`, dit/flow_samplers.py):
- LightningDiT, DDT: flow matching in SiT's time (x_t = t x + (1 - t) noise, t = 0 noise, predicts x - noise,
  raw t in [0, 1]): "sit";
- RAE (DiT-DH), NanoGen (its in-context DiT-DH, recognised by its time tokens), REPA, REPA-E: REPA's time (x_t = (1 -
  t) x + t noise, t = 1 noise, predicts noise - x): "repa"; NanoGen's MeanFlow files (a second time embedder,
  `t_abs_embedder`) objective "meanflow". NanoGen's files state neither what the network predicts nor their latent
  space nor a text model's encoder (`info["unstated"]`, NANOGEN_UNSTATED): its configs do (dit/nanogen_protocols.py);
- REPA-E's end-to-end checkpoints (with their `vae`) normalize latents with the SiT's BatchNorm statistics
  `bn.running_mean` / `bn.running_var` (x = (z - mean) / sqrt(var)): read into `info["latent"]`, the `bn.*`
  buffers then dropped; LightningDiT's `config` records `latent_norm` (per-channel statistics kept in a separate
  `latents_stats.pt`, which dit-sample then needs: --latent-stats) and its `latent_multiplier`.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Mapping

import torch

from .formats import CHECKPOINT_FORMAT, CHECKPOINT_VERSION
from .infer import WeightsError

SIT, REPA = "sit", "repa"
# release -> (flow convention, why), for files that do not record their objective
CONVENTIONS = {
    "LightningDiT": (SIT, "LightningDiT's release (its Linear velocity transport: t = 0 noise, predicts data - noise, "
                          "the network sees t in [0, 1])"),
    "DDT": (SIT, "DDT's release (its LinearScheduler: t = 0 noise, predicts data - noise, the network sees t in "
                 "[0, 1])"),
    "RAE": (REPA, "RAE's release (its Linear path: t = 1 noise, predicts noise - data, the network sees t in [0, 1])"),
    "NanoGen": (REPA, "NanoGen's release (its Transport: x_t = (1 - t) x + t noise, t = 1 noise, predicts noise - "
                      "data, the network sees t in [0, 1])"),
}
FAMILY_RELEASE = {"LightningDiT": "LightningDiT", "DDT": "DDT", "DiT-DH": "RAE", "iMF": "iMF",
                  "DiT-DH-IC": "NanoGen"}  # a bare file
# release -> (objective, why) for the one-step releases, whose files record no objective
ONE_STEP = {"iMF": ("imf", "iMF's release (Lyy-iiis/imeanflow: its network trains only with its own objective, "
                           "t = 1 noise, one-step sampling)")}
# What NanoGen keeps in its YAML only, never in a file (dit/nanogen_protocols.py: each config's ModelFacts): the
# settings dit-sample takes from a flag or the protocol row of the file's config, refusing the file otherwise
# (sample/facts.py). Keyed by the SampleConfig field that supplies it.
NANOGEN_UNSTATED = {
    "prediction": "NanoGen's files do not record what the network predicts (transport.prediction of its config: x for "
                  "its JiT and PixelGen models, the velocity for the others, with the same network)",
    "vae": "NanoGen's files do not record their latent space (stage_1 of the config)",
    "text_encoder": "NanoGen's files do not record the text encoder (conditioning.text_encoder of the config)",
}
NANOGEN_MEANFLOW = ("NanoGen's MeanFlow file (its t_abs_embedder: TransportMF's u(x, h = t - r, t_abs = t), "
                    "src/stage2/transport/transport.py l.167-169)")
# Keys of NanoGen's networks that this project does not build: REPA's projector (it only trains) and internal
# guidance's base head (DiTwDDTHeadIG) of a file that does not record its depth (dit/incontext.py builds it where the
# record names base_model_depth).
NANOGEN_UNBUILT = ("repa_projector.", "base_final_layer.")


def is_state_dict(obj: Any) -> bool:
    return isinstance(obj, dict) and bool(obj) and all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items())


def unpack(obj: Any, path: Path, prefer: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Pick the weights inside a loaded pickle and describe where they came from (module docstring)."""
    if is_state_dict(obj):
        if _ddt_keys(obj):
            return _ddt_weights(obj, path, prefer)
        from .imf import RELEASE_LATENT, from_release_torch, is_release_torch

        if is_release_torch(obj):  # the iMF release's PyTorch file (iMF-B-2.pth ...) and the latents it decodes
            return from_release_torch(obj), {"source": "imf-release", "weights": "state_dict", "release": "iMF",
                                             "latent": json.loads(json.dumps(RELEASE_LATENT))}
        bare: dict[str, Any] = {"source": "official", "weights": "state_dict"}
        if "bn.running_var" in obj:
            bare["release"] = "REPA-E"
        return {k: v for k, v in obj.items() if not k.startswith("bn.")}, bare
    if not isinstance(obj, dict):
        raise WeightsError(f"{path} holds a {type(obj).__name__}, not a DiT state_dict or checkpoint")
    if is_state_dict(obj.get("state_dict")) and _ddt_keys(obj["state_dict"]):
        return _ddt_weights(obj["state_dict"], path, prefer)
    own = obj.get("format") == CHECKPOINT_FORMAT
    if own and obj.get("version") != CHECKPOINT_VERSION:
        raise WeightsError(f"{path} is a dit-pipeline checkpoint of version {obj.get('version')!r}; "
                           f"this code reads version {CHECKPOINT_VERSION}")
    order = ("ema", "model") if prefer == "ema" else ("model", "ema")
    chosen = next((k for k in order if is_state_dict(obj.get(k))), None)
    if chosen is None:
        raise WeightsError(f"{path} is a dict without DiT weights: expected tensors only, or 'ema'/'model' "
                           f"state_dicts; found keys {sorted(map(str, obj))[:12]}")
    info: dict[str, Any] = {"source": "dit-pipeline" if own else "reference-train", "weights": chosen}
    if own:
        for key in ("model_config", "latent", "step", "config", "objective", "flow_convention", "time_shift",
                    "prediction", "meanflow", "text"):
            if key in obj:
                info[key] = obj[key]
        info.setdefault("objective", "ddpm")  # our checkpoints before the key existed
    else:
        _release_container(obj, info, path)
    args = obj.get("args")
    if isinstance(args, argparse.Namespace):
        info["args"] = dict(vars(args))
    elif isinstance(args, dict):
        info["args"] = dict(args)
    if str(info.get("args", {}).get("model", "")).lower().startswith("sit-"):
        info["objective"] = "flow"  # a checkpoint of SiT's train.py (args.model = "SiT-XL/2")
    state_dict = dict(obj[chosen])
    if is_state_dict(obj.get("vae")) and "bn.running_var" in state_dict:
        info.update(release="REPA-E", latent=_bn_latent(state_dict, path))
    return {k: v for k, v in state_dict.items() if not k.startswith("bn.")}, info


def _release_container(obj: Mapping[str, Any], info: dict[str, Any], path: Path) -> None:
    """LightningDiT's `{model, ema, opt, config}` and RAE's `{step, epoch, model, ema, optimizer, scheduler}`."""
    config = obj.get("config")
    if isinstance(config, dict) and isinstance(config.get("model"), dict) and "model_type" in config["model"]:
        info.update(source="lightningdit-train", release="LightningDiT", release_config=config)
        transport = config.get("transport") or {}
        path_type, prediction = transport.get("path_type", "Linear"), transport.get("prediction", "velocity")
        if (path_type, prediction) != ("Linear", "velocity"):
            raise WeightsError(f"{path}: LightningDiT trained with path_type={path_type!r}, prediction="
                               f"{prediction!r}; only its Linear path with velocity prediction is supported")
        data = config.get("data") or {}
        if data.get("latent_norm"):
            info["latent_required"] = {"multiplier": float(data.get("latent_multiplier", 1.0)),
                                       "what": "LightningDiT's per-channel latent statistics (latents_stats.pt)"}
    elif {"optimizer", "scheduler", "epoch"} <= set(obj):
        info.update(source="rae-train", release="RAE")
        if "step" in obj and isinstance(obj["step"], int):
            info["step"] = obj["step"]


def drop_unbuilt(state_dict: dict[str, torch.Tensor], info: dict[str, Any]) -> dict[str, torch.Tensor]:
    """A NanoGen file (its time tokens) without the keys of heads this project does not build (NANOGEN_UNBUILT),
    named in info["dropped"]; every other state_dict as it is. A NanoGen file from a release container is labelled
    as NanoGen's rather than RAE's (the same container)."""
    if "t_embedder.learnable_tokens" not in state_dict:
        return state_dict
    if info.get("release") == "RAE":
        info.update(release="NanoGen", source="nanogen-train")
    # internal guidance's base head stays where the file's record names the block it reads (ours do)
    unbuilt = tuple(k for k in NANOGEN_UNBUILT
                    if not (k == "base_final_layer." and (info.get("model_config") or {}).get("base_model_depth")))
    dropped = sorted({k.split(".")[0] for k in state_dict if k.startswith(unbuilt)})
    if dropped:
        info["dropped"] = dropped
    return {k: v for k, v in state_dict.items() if not k.startswith(unbuilt)}


def release_record(info: Mapping[str, Any]) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """What a release's own record (LightningDiT's `config`) says about the network: (facts checked against the
    tensors: family, classes, channels, block switches; hints: the preset it names, used where the tensors are
    silent, e.g. its head count). A model_type that is no preset of ours (LightningDiT's train.py builds any name
    its models/lightningdit.py defines) gives no hints: the tensors, --num-heads or a sidecar say the rest."""
    config = info.get("release_config")
    if not isinstance(config, dict):
        return None, {}
    from .family import family_class, lookup_preset

    model, data = config.get("model") or {}, config.get("data") or {}
    try:
        cls, preset = lookup_preset(str(model.get("model_type")))
        hints = dict(cls.presets[preset])
    except ValueError:  # a size of its own (train.py takes any model_type): the tensors, the flags or a sidecar say
        cls, hints = family_class("LightningDiT"), {}
    facts: dict[str, Any] = {"family": cls.family, "num_classes": data.get("num_classes"),
                             "in_channels": model.get("in_chans"), "learn_sigma": model.get("learn_sigma")}
    flags = {"use_qknorm": "qk_norm", "use_swiglu": "swiglu", "use_rope": "rope", "use_rmsnorm": "rms_norm",
             "wo_shift": "wo_shift"}
    facts.update({ours: bool(model[theirs]) for theirs, ours in flags.items() if theirs in model})
    return {k: v for k, v in facts.items() if v is not None}, hints


def _ddt_keys(state_dict: Mapping[str, Any]) -> bool:
    return any(k.startswith(("denoiser.", "ema_denoiser.")) for k in state_dict)


def _ddt_weights(state_dict: Mapping[str, torch.Tensor], path: Path,
                 prefer: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """DDT's Lightning state_dict: the EMA (`ema_denoiser.*`) or the trained denoiser (`denoiser.*`); the REPA
    projector (`diffusion_trainer.*`) and anything else the module held are dropped."""
    prefixes = {"ema": "ema_denoiser.", "model": "denoiser."}
    order = ("ema", "model") if prefer == "ema" else ("model", "ema")
    chosen = next((w for w in order if any(k.startswith(prefixes[w]) for k in state_dict)), None)
    if chosen is None:
        raise WeightsError(f"{path}: a DDT checkpoint without denoiser weights")
    n = len(prefixes[chosen])
    weights = {k[n:]: v for k, v in state_dict.items() if k.startswith(prefixes[chosen])}
    return weights, {"source": "ddt-train", "weights": chosen, "release": "DDT"}


def _bn_latent(state_dict: Mapping[str, torch.Tensor], path: Path) -> dict[str, Any]:
    """REPA-E's latent normalization from the SiT's BatchNorm buffers: scale rsqrt(var), shift mean."""
    mean = state_dict["bn.running_mean"].double().reshape(-1)
    scale = state_dict["bn.running_var"].double().reshape(-1).rsqrt()
    record = {"form": "scale_shift", "scale": scale.tolist(), "shift": mean.tolist(),
              "source": {"kind": "file", "path": f"{path} [ema bn.running_mean, bn.running_var]"}}
    return {"scaling_factor": 1.0, "shift_factor": None, "normalization": record}


def apply_conventions(info: dict[str, Any], family: str) -> None:
    """Record the time convention of a release's file that does not record its objective (module docstring)."""
    if info.get("flow_convention_from") == "recorded":
        return
    release = info.get("release") or FAMILY_RELEASE.get(family)
    if release in ONE_STEP and info.get("objective") is None:
        objective, why = ONE_STEP[release]
        info.update(release=release, objective=objective, objective_from=why)
        return
    if release in CONVENTIONS:
        convention, why = CONVENTIONS[release]
        info.update(release=release, objective="flow", objective_from=why, flow_convention=convention,
                    flow_convention_from=why)
    if release == "NanoGen":
        from .conditioning import kind_of
        from .conditions import conditions_of

        config = info.get("model_config") or {}
        if conditions_of(config) == "meanflow":  # the file shows it: MeanFlow's second time embedder
            info.update(objective="meanflow", objective_from=NANOGEN_MEANFLOW)
        info["unstated"] = {k: why for k, why in NANOGEN_UNSTATED.items()
                            if k != "text_encoder" or kind_of(config) == "text"}
    if release == "LightningDiT" and not info.get("latent"):  # every release config normalizes VA-VAE's latents
        info.setdefault("latent_required", {"multiplier": 1.0, "what": "LightningDiT's per-channel latent "
                                            "statistics (latents_stats.pt; a bare file does not say, its configs do)"})
