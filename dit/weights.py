"""Safe loading of DiT weights: the entry point of the three modules in dit/ that read files (dit/weight_files.py
the files themselves, dit/weight_records.py their sidecars) and turn what they read into a model.

Accepted: the official release files (a bare state_dict, e.g. DiT-XL-2-256x256.pt), checkpoints of the
reference training script ({"model", "ema", "opt", "args"} with a pickled argparse.Namespace), this
project's checkpoints (docs/ARCHITECTURE.md: format "dit-pipeline.checkpoint"), and .safetensors files; REPA's
release file (a bare SiT state_dict with its projector heads, `projectors.<i>.*`) and REPA train.py checkpoints
load too: the projector keys are dropped and info["flow_convention"] says the network runs REPA's time.
A bare state_dict may have a JSON sidecar beside it (`step-0001000-ema.pt` -> `step-0001000-ema.json`, written
by the trainer): its model_config (the head count is invisible in tensor shapes), latent scale and step are
used, and checked against the tensors. A release's own container (DDT's Lightning file, LightningDiT's, RAE's, a
reference train.py file) may have one too, written by hand from make_sidecar: its model_config is read (a custom
size's encoder split, latent side, heads) and checked against the tensors; the release's conventions stay.
Release checkpoints of the other model families load unchanged too (dit/releases.py: LightningDiT's
`{model, ema, opt, config}`, RAE's stage-2 `{step, epoch, model, ema, optimizer, scheduler}`, DDT's Lightning
`state_dict` with `denoiser.*` / `ema_denoiser.*`, REPA-E's `{model, ema, vae, ...}`); the family is read from a
stored model_config or recognised by its keys (`detect_family`), and each family's `infer_config` reads the
architecture back (dit/family.py). What a file cannot state (a custom size's head count, DDT's latent size) comes
from `hints` (dit-sample's --num-heads, --input-size, --model) or the file is refused naming the flag.
Pickle files are read with `torch.load(weights_only=True)`; the only class allowed beyond tensors and
containers is argparse.Namespace. Anything else is refused, never unpickled (dit/weight_files.py). The architecture
is inferred from tensor shapes (cross-checked with a stored model_config / args when present) and every key and shape
is verified before a model is touched, so a mismatch fails with a message and never half-loads
(dit/weight_match.py). Sidecars and the record a file holds: dit/weight_records.py.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from . import releases
from .family import DiffusionTransformer, model_from_config
from .formats import SHARDED_SUFFIX
from .infer import WeightsError
from .objectives import recorded_objective
from .repa import PROJECTOR_KEY
from .weight_files import read_npz, read_safetensors, read_torch_file
from .weight_match import check_state_dict, infer_model_config
from .weight_records import embedded_record, read_sidecar, sidecar_path

_PREFIXES = ("module.", "_orig_mod.")
__all__ = ["WeightsError", "build_model_from_weights", "load_dit_weights"]  # WeightsError: dit.infer's, re-exported


def load_dit_weights(path: str | Path, prefer: str = "ema", hints: dict[str, Any] | None = None
                     ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Read a DiT weight file -> (state_dict with official names, info).

    `prefer`: "ema" (default) or "model", for files holding both. `info` holds "path", "source"
    ("official" | "reference-train" | "dit-pipeline" | "safetensors"), "weights" ("ema" | "model" |
    "state_dict"), "model_config" (see DiT.config), "preset" (name or None) and, when the file has them,
    "args" (reference training args as a dict), "step", "latent", "config", "sidecar" (its path), "time_shift"
    (a flow model's recorded training shift, dit/shift.py).
    A bare state_dict with a sidecar (see sidecar_path) reads as source "dit-pipeline", weights "ema".
    Release files of the other families add "release" ("LightningDiT" | "RAE" | "DDT" | "REPA-E") and, when the
    file does not record them, the objective and time convention of that release ("flow_convention_from" says
    why); "latent_required" when the release normalized its latents with statistics the file does not hold.
    `hints`: architecture facts the caller knows (model_config keys, e.g. {"num_heads": 16, "input_size": 32}),
    used only where the file states nothing.
    """
    if prefer not in ("ema", "model"):
        raise ValueError(f"prefer must be 'ema' or 'model', got {prefer!r}")
    path = Path(path)
    if path.is_dir() and path.name.endswith(SHARDED_SUFFIX):
        raise WeightsError(f"{path} is a sharded training checkpoint (one file per rank); write it as one file first "
                           f"with `dit-train --consolidate {path}` and pass the {path.name[:-len(SHARDED_SUFFIX)]}.pt "
                           "(or -ema.pt) it writes")
    if not path.is_file():
        raise WeightsError(f"weight file {path} does not exist or is not a file")
    raw: Any = None
    if path.suffix.lower() == ".safetensors":
        state_dict, info = read_safetensors(path)
    elif path.suffix.lower() == ".npz":
        state_dict, info = read_npz(path, prefer)
    else:
        raw = read_torch_file(path)
        state_dict, info = releases.unpack(raw, path, prefer)
    where = _apply_record(info, path, raw)
    state_dict = _strip_prefixes(state_dict, path)
    state_dict = releases.drop_unbuilt(state_dict, info)
    state_dict = _read_repa_format(state_dict, info, where)
    info["path"] = str(path)
    stored, release_hints = releases.release_record(info)
    stored = info.get("model_config") or stored
    info["model_config"] = infer_model_config(state_dict, stored, info.get("args"), where=where,
                                              hints={**release_hints, **(hints or {})})
    info["preset"] = info["model_config"]["model"]
    info["family"] = info["model_config"].get("family", "DiT")
    releases.apply_conventions(info, info["family"])
    if info.get("objective") is not None:  # "imf" written before the release's network existed: imf-adaln
        info["objective"] = recorded_objective(str(info["objective"]), info["model_config"])
    return state_dict, info


def _apply_record(info: dict[str, Any], path: Path, raw: Any) -> str:
    """Merge into `info` the record of the file: its sidecar (dit/weight_records.py) or, for a bare state_dict
    without one, the record it holds (`embed_record`); -> the file as messages name it."""
    where = str(path)
    sidecar = read_sidecar(path) if info["source"] not in ("dit-pipeline", "safetensors") else None
    if sidecar is not None and info["source"] != "official":
        # a release's own container (DDT's Lightning file, ...): its sidecar states what the file cannot (the
        # model_config: a custom size's split, latent side and heads); the release's conventions stay
        info.update(sidecar=str(sidecar_path(path)), model_config=sidecar["model_config"])
        where, sidecar = f"{path} with its sidecar {sidecar_path(path).name}", None
    elif sidecar is not None:
        info["sidecar"] = str(sidecar_path(path))
        where = f"{path} with its sidecar {sidecar_path(path).name}"
    elif info["source"] == "official" and (sidecar := embedded_record(raw, path)) is not None:
        info["record_from"] = "embedded"  # the trainer's EMA file copied without its sidecar
        where = f"{path} (with the record it holds)"
    if sidecar is not None:
        info.update(source="dit-pipeline", weights="ema", model_config=sidecar["model_config"],
                    latent=sidecar.get("latent"), step=sidecar.get("step"),
                    objective=sidecar.get("objective", "ddpm"))  # sidecars before the key: ddpm
        if sidecar.get("flow_convention") in ("sit", "repa"):
            info["flow_convention"] = sidecar["flow_convention"]
        if isinstance(sidecar.get("time_shift"), (int, float)):
            info["time_shift"] = float(sidecar["time_shift"])
        if sidecar.get("prediction") is not None:
            info["prediction"] = sidecar["prediction"]
        if isinstance(sidecar.get("meanflow"), dict):
            info["meanflow"] = dict(sidecar["meanflow"])
        if isinstance(sidecar.get("text"), dict):
            info["text"] = sidecar["text"]
    return where


def _read_repa_format(state_dict: dict[str, torch.Tensor], info: dict[str, Any],
                      where: str) -> dict[str, torch.Tensor]:
    """Drop REPA's projector keys (`projectors.<i>.*`: training-only heads) and say how the file's flow time
    runs: info["flow_convention"] ("sit" | "repa") and info["flow_convention_from"] (why). A file that records its
    objective (ours) is SiT's convention unless it records "repa"; a file that does not is REPA's when it has
    projector keys or REPA's training args (proj_coeff / enc_type), since REPA trains x_t = (1 - t) x + t eps."""
    projectors = {k: v for k, v in state_dict.items() if k.startswith("projectors.")}
    args = info.get("args") or {}
    repa_args = sorted(k for k in ("proj_coeff", "enc_type", "encoder_depth") if k in args)
    if projectors or repa_args:
        last: dict[int, tuple[int, int]] = {}
        for key, value in projectors.items():
            if (m := PROJECTOR_KEY.match(key)) and m.group(3) == "weight":
                i, j = int(m.group(1)), int(m.group(2))
                if j >= last.get(i, (-1, 0))[0]:
                    last[i] = (j, int(value.shape[0]))
        info["repa"] = {"projectors": len(last), "z_dims": [last[i][1] for i in sorted(last)],
                        **{k: args[k] for k in ("enc_type", "encoder_depth", "proj_coeff") if k in args}}
        if "blocks.0.attn.q_norm.bias" in state_dict:
            raise WeightsError(f"{where}: REPA's --qk-norm (a LayerNorm with bias per head) is not this project's "
                               "qk_norm (RMSNorm); such a checkpoint cannot be loaded")
        if str(args.get("path_type", "linear")) != "linear" or str(args.get("prediction", "v")) != "v":
            raise WeightsError(f"{where}: REPA trained with path_type={args.get('path_type')!r}, prediction="
                               f"{args.get('prediction')!r}; only its linear path with velocity prediction is "
                               "supported")
    if info.get("objective") is not None and info["source"] in ("dit-pipeline", "safetensors"):
        info.setdefault("flow_convention", "sit")
        info["flow_convention_from"] = "recorded"
    elif projectors or repa_args:
        info.update(objective="flow", flow_convention="repa",
                    flow_convention_from="REPA's projector keys" if projectors else f"REPA's training args {repa_args}")
    else:
        info.update(flow_convention="sit", flow_convention_from="default")
    return {k: v for k, v in state_dict.items() if not k.startswith("projectors.")}


def build_model_from_weights(state_dict: dict[str, torch.Tensor], info: dict[str, Any],
                             device: torch.device | str | None = None,
                             dtype: torch.dtype | None = None) -> DiffusionTransformer:
    """The model described by info["model_config"], loaded strictly with `state_dict`, in eval mode
    (float32 unless `dtype` says otherwise)."""
    check_state_dict(state_dict, info["model_config"], where=info.get("path", "state_dict"))
    with torch.device("meta"):  # skip the random init of weights about to be overwritten
        model = model_from_config(info["model_config"])
    # fresh float32 storage on the target device, then a copying load: no aliasing of `state_dict`
    model = model.to_empty(device=device or "cpu")
    model.load_state_dict(state_dict, strict=True)
    return model.to(dtype=dtype or torch.float32).eval()


def _strip_prefixes(state_dict: dict[str, torch.Tensor], path: Path) -> dict[str, torch.Tensor]:
    """Drop DDP's `module.` and torch.compile's `_orig_mod.` wrappers from every key."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        name = key
        while name.startswith(_PREFIXES):
            name = name.split(".", 1)[1]
        if name in out:
            raise WeightsError(f"{path}: keys {key!r} and another one both map to {name!r}")
        out[name] = value
    return out

