"""Reading weight files safely: torch files (`read_torch_file`: the archive's CRC-32s, then
`torch.load(weights_only=True)` allowing no class beyond tensors, containers and argparse.Namespace; anything else is
refused, never unpickled), .safetensors files with their metadata, and iMF's .npz of a flax parameter tree.
dit/weights.py (`load_dit_weights`) picks the reader by the file's suffix and turns what it reads into a model; every
problem is one WeightsError naming the file.
"""
from __future__ import annotations

import argparse
import json
import pickle
import re
import zipfile
from pathlib import Path
from typing import Any

import torch

from .formats import OBJECTIVES
from .infer import WeightsError


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


def read_safetensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A .safetensors file's tensors and what its metadata records (objective, time convention and shift,
    prediction, step, model_config, meanflow settings)."""
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


def read_npz(path: Path, prefer: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
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

