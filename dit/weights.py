"""Safe loading of DiT weights: the only module in dit/ that reads files.

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
containers is argparse.Namespace. Anything else is refused, never unpickled. The architecture is inferred
from tensor shapes (cross-checked with a stored model_config / args when present) and every key and shape
is verified before a model is touched, so a mismatch fails with a message and never half-loads.
"""
from __future__ import annotations

import argparse
import json
import pickle
import re
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import Any, Mapping, cast

import torch

from . import releases
from .family import DiffusionTransformer, family_class, lookup_preset, model_from_config
from .formats import SHARDED_SUFFIX, SIDECAR_FORMAT, SIDECAR_VERSION
from .formats import OBJECTIVES
from .infer import WeightsError
from .objectives import recorded_objective
from .repa import PROJECTOR_KEY

_PREFIXES = ("module.", "_orig_mod.")
__all__ = ["RECORD_KEY", "WeightsError", "build_model_from_weights", "check_state_dict", "embed_record",
           "embedded_record", "infer_model_config", "load_dit_weights", "make_sidecar", "read_sidecar",
           "read_torch_file", "sidecar_path", "text_record"]


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
        state_dict, info = _read_safetensors(path)
    elif path.suffix.lower() == ".npz":
        state_dict, info = _read_npz(path, prefer)
    else:
        raw = read_torch_file(path)
        state_dict, info = releases.unpack(raw, path, prefer)
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


def sidecar_path(path: str | Path) -> Path:
    """The JSON sidecar of a bare weight file: the same name with `.json` (step-0001000-ema.pt ->
    step-0001000-ema.json)."""
    return Path(path).with_suffix(".json")


def make_sidecar(model_config: dict[str, Any], latent: dict[str, Any] | None, step: int | None,
                 objective: str | None = None, time_shift: float | None = None,
                 prediction: dict[str, Any] | None = None,
                 meanflow: dict[str, Any] | None = None,
                 text: dict[str, Any] | None = None) -> dict[str, Any]:
    """The sidecar content (JSON-compatible) for a bare state_dict of a model with `model_config` (DiT.config);
    `objective` (dit.formats.OBJECTIVES) is added when given (readers treat a sidecar without it as ddpm), a flow
    model's `time_shift` (dit/shift.py; readers treat a sidecar without it as 1, no shift), a MeanFlow model's
    `meanflow` settings (dit/objectives.py's record), and a text model's `text` (text_record: its text encoder's
    identity, which dit-sample --prompt loads)."""
    side = {"format": SIDECAR_FORMAT, "version": SIDECAR_VERSION, "model_config": dict(model_config),
            "latent": latent, "step": step}
    if objective is not None:
        side["objective"] = objective
    if time_shift is not None:
        side["time_shift"] = float(time_shift)
    if prediction is not None:  # x-prediction or the clamped velocity target (dit.flow); absent: plain velocity
        side["prediction"] = dict(prediction)
    if meanflow is not None:
        side["meanflow"] = dict(meanflow)
    if text is not None:
        side["text"] = text
    return side


def text_record(text: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The JSON part of a checkpoint's `text` record (its text encoder's identity and how its features were made;
    not the empty prompt's tensors): what sidecars and dit-sample's records keep."""
    if not text:
        return None
    return {k: json.loads(json.dumps(v)) for k, v in text.items() if k in ("encoder", "features")}


# The key under which the trainer's EMA file (a bare state_dict) holds its sidecar's record: an entry of the
# state_dict's `_metadata` (torch's per-module version table, kept by torch.save and torch.load(weights_only=True)).
# load_state_dict looks `_metadata` up by module prefix only, so the official DiT code's
# torch.load + load_state_dict(strict=True) ignores it (tests/dit/test_weights.py).
RECORD_KEY = "dit-pipeline:record"


def embed_record(state_dict: dict[str, torch.Tensor], record: dict[str, Any]) -> dict[str, torch.Tensor]:
    """A copy of `state_dict` (same tensors) whose `_metadata` also holds `record` (make_sidecar's content)."""
    out: Any = OrderedDict(state_dict)
    out._metadata = OrderedDict(getattr(state_dict, "_metadata", None) or {})
    out._metadata[RECORD_KEY] = json.loads(json.dumps(record))  # plain JSON types: weights_only loads them
    return cast(dict[str, torch.Tensor], out)


def embedded_record(obj: Any, path: str | Path) -> dict[str, Any] | None:
    """The record a bare state_dict holds (embed_record), None when it holds none; WeightsError when it is not
    a valid one."""
    meta = getattr(obj, "_metadata", None)
    if not isinstance(meta, dict) or RECORD_KEY not in meta:
        return None
    return _checked_record(meta[RECORD_KEY], f"{path}'s embedded record ({RECORD_KEY})",
                           f"re-save {Path(path).name} or put its sidecar {sidecar_path(path).name} beside it")


def _checked_record(data: Any, what: str, fix: str) -> dict[str, Any]:
    if not isinstance(data, dict) or data.get("format") != SIDECAR_FORMAT:
        raise WeightsError(f"{what} is not a weights record (no format {SIDECAR_FORMAT!r}); {fix}")
    if data.get("version") != SIDECAR_VERSION:
        raise WeightsError(f"{what} has sidecar version {data.get('version')!r}; this code reads version "
                           f"{SIDECAR_VERSION}")
    if not isinstance(data.get("model_config"), dict):
        raise WeightsError(f"{what} has no model_config object; {fix}")
    return data


def read_sidecar(path: str | Path) -> dict[str, Any] | None:
    """The sidecar of weight file `path`, None when there is none; WeightsError for a file in the sidecar's
    place that is unreadable or not one (it is never silently ignored: it would decide the head count)."""
    side = sidecar_path(path)
    if not side.is_file():
        return None
    fix = f"fix or remove {side} (without it a DiT of non-preset size cannot be loaded from {Path(path).name})"
    try:
        data = json.loads(side.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise WeightsError(f"{side}, the sidecar of {Path(path).name}, is unreadable ({e}); {fix}") from None
    if not isinstance(data, dict) or data.get("format") != SIDECAR_FORMAT:
        raise WeightsError(f"{side} sits beside {Path(path).name} but is not a weights sidecar (no format "
                           f"{SIDECAR_FORMAT!r}); {fix}")
    return _checked_record(data, str(side), fix)


def check_archive(path: str | Path) -> None:
    """Check the CRC-32 that torch.save records for every member of its zip archive: torch.load does not, so
    a flipped bit in a tensor or a torn copy would otherwise load as silently different weights. Files in
    torch's legacy (non-zip) format carry no checksums and pass unchecked. WeightsError naming the member."""
    path = Path(path)
    if not zipfile.is_zipfile(path):
        return  # legacy format, or no readable zip directory at all (torch.load then says what is wrong)
    try:
        with zipfile.ZipFile(path) as z:
            bad = z.testzip()
    except Exception as e:  # any failure to parse the damaged directory or a member header
        raise WeightsError(f"cannot read {path}: damaged zip archive ({type(e).__name__}: {e})") from None
    if bad is not None:
        raise WeightsError(f"{path} is corrupt: its member {bad!r} fails the CRC-32 check (a flipped bit or an "
                           "incomplete copy); nothing was loaded")


def read_torch_file(path: str | Path, *, mmap: bool = False) -> Any:
    """The one safe read of a torch file (weights, reference and dit-pipeline checkpoints): the archive's
    CRC-32s first (`check_archive`), then `torch.load(weights_only=True)` to the CPU, allowing no class beyond
    tensors, containers and argparse.Namespace. `mmap`: map the file instead of reading it (the ranks of a node
    then share one copy in the page cache). WeightsError saying what is wrong; nothing is ever unpickled."""
    path = Path(path)
    check_archive(path)
    try:
        with torch.serialization.safe_globals([argparse.Namespace]):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        detail = _unpickler_detail(str(e))
        found = re.search(r"GLOBAL ([\w.]+)", detail)
        if found is None:  # not a pickle at all, or a damaged one
            raise WeightsError(f"cannot read {path}: not a valid torch checkpoint ({detail})") from None
        raise WeightsError(
            f"refusing to load {path}: it contains a pickled {found.group(1)}; only tensors, containers "
            "and argparse.Namespace are accepted, since unpickling anything else could run arbitrary "
            "code. If you trust the file, re-save only its state_dict "
            "(torch.save(ckpt['ema'], 'weights.pt')).") from None
    except Exception as e:  # truncated, torn or foreign archives fail in many ways: all the same to the user
        raise WeightsError(f"cannot read {path}: not a complete torch checkpoint (corrupt or truncated?): "
                           f"{type(e).__name__}: {_unpickler_detail(str(e))}") from None


def _unpickler_detail(message: str) -> str:
    """The informative line of a torch.load error (skipping its generic weights_only preamble)."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    for line in lines:
        if "GLOBAL" in line or "Unsupported" in line or "unsupported" in line:
            return line.removeprefix("WeightsUnpickler error:").strip()
    return lines[0] if lines else "unknown error"


def _read_safetensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    from safetensors import SafetensorError, safe_open

    try:
        state_dict: dict[str, torch.Tensor] = {}
        with safe_open(str(path), framework="pt", device="cpu") as f:
            metadata = f.metadata() or {}
            for key in f.keys():
                state_dict[key] = f.get_tensor(key)
    except (SafetensorError, OSError) as e:
        raise WeightsError(f"cannot read {path}: not a valid safetensors file: {e}") from None
    info: dict[str, Any] = {"source": "safetensors", "weights": "state_dict"}
    if metadata.get("objective") in OBJECTIVES:
        info["objective"] = metadata["objective"]
        if metadata.get("flow_convention") in ("sit", "repa"):
            info["flow_convention"] = metadata["flow_convention"]
        if metadata.get("time_shift"):
            try:
                info["time_shift"] = float(metadata["time_shift"])
            except ValueError:
                raise WeightsError(f"{path}: metadata 'time_shift' is not a number") from None
        if metadata.get("prediction"):
            try:
                info["prediction"] = json.loads(metadata["prediction"])
            except json.JSONDecodeError:
                raise WeightsError(f"{path}: metadata 'prediction' is not valid JSON") from None
    elif metadata.get("format") == "dit-pipeline.weights":
        info["objective"] = "ddpm"  # our exports before the key existed
    elif metadata.get("objective"):
        raise WeightsError(f"{path}: metadata 'objective' is {metadata['objective']!r}, none this code knows "
                           f"({', '.join(OBJECTIVES)})")
    if (metadata.get("step") or "").isdigit():
        info["step"] = int(metadata["step"])
    for key in ("model_config", "meanflow"):
        if key in metadata:
            try:
                info[key] = json.loads(metadata[key])
            except json.JSONDecodeError:
                raise WeightsError(f"{path}: metadata {key!r} is not valid JSON") from None
    return state_dict, info


def _read_npz(path: Path, prefer: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A numpy archive of a flax parameter tree flattened with "/" (the iMF release's, dit/imf.py
    `from_flax_params`), read without pickles."""
    import numpy as np

    from .imf import RELEASE_LATENT, flax_root, from_flax_params, is_flax_params

    try:
        with np.load(path, allow_pickle=False) as archive:
            flat = {k: archive[k] for k in archive.files}
    except (OSError, ValueError, zipfile.BadZipFile) as e:
        raise WeightsError(f"cannot read {path}: not a numpy .npz archive of arrays ({e})") from None
    if not is_flax_params(flat):
        raise WeightsError(f"{path}: an .npz of {len(flat)} arrays, but not iMF's flax parameter tree (keys such as "
                           f"'net/shared_blocks_0/...'; found {sorted(flat)[:4]})")
    root = flax_root(flat, prefer)
    weights = {"ema_params": "ema", "params": "model", None: "state_dict"}[root]
    return from_flax_params(flat, prefer), {"source": "imf-flax", "weights": weights, "release": "iMF",
                                            "latent": json.loads(json.dumps(RELEASE_LATENT))}


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
