"""The record of a bare weight file: what its tensor shapes cannot say (the model_config, with the head count; the
latent scale; the step; the objective and its settings; a text model's encoder), as a JSON sidecar beside the file
(`step-0001000-ema.pt` -> `step-0001000-ema.json`, format dit.formats.SIDECAR_FORMAT) and as the same record inside
the file (`embed_record`), so a copy without its sidecar still loads. The trainer writes both (train/checkpoint.py);
dit/weights.py reads them and checks them against the tensors.
"""
from __future__ import annotations

import json
from collections import OrderedDict
from pathlib import Path
from typing import Any, Mapping, cast

import torch

from .formats import SIDECAR_FORMAT, SIDECAR_VERSION
from .infer import WeightsError


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
    if prediction is not None:  # x-prediction or the clamped velocity target (dit.flow_predictions); absent: velocity
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
