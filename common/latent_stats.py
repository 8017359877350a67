"""Statistics files of the latent normalization (common/latent_norm.py): a per-channel or per-position
normalization record read from a file (`--latent-stats` of dit-extract, dit-sample and `dit-shards stats`:
LightningDiT's `latents_stats.pt`, a diffusers config's `latents_mean` / `latents_std`, RAE's `stat.pt`), and the
records of statistics `dit-shards stats` computes (`stats_record`, `mean_var_record`).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from dit_pipeline.common.errors import UserError
from dit_pipeline.common.latent_norm import ARRAY_ENCODING, encode_array, normalization_problems

STATS_SUFFIXES = (".pt", ".pth", ".json", ".safetensors")
RAE_EPS = 1e-5  # RAE's stat.pt normalization: (z - mean) / sqrt(var + eps)


def _vector(value: Any, name: str, where: str) -> list[float]:
    arr = np.asarray(value.detach().cpu().numpy() if hasattr(value, "detach") else value, dtype=np.float64)
    if arr.ndim == 0 or arr.size == 0 or sum(1 for n in arr.shape if n > 1) > 1:
        raise UserError(f"{where}: {name} must hold one value per latent channel (e.g. [C] or LightningDiT's "
                        f"[1, C, 1, 1]), got shape {list(arr.shape)}")
    return [float(v) for v in arr.reshape(-1)]


def _scalar(value: Any, name: str, where: str) -> float:
    arr = np.asarray(value.detach().cpu().numpy() if hasattr(value, "detach") else value, dtype=np.float64)
    if arr.size != 1:
        raise UserError(f"{where}: {name} must be one number, got shape {list(arr.shape)}")
    return float(arr.reshape(-1)[0])


def _read_stats_values(path: Path) -> dict[str, Any]:
    suffix = path.suffix.lower()
    if suffix == ".json":
        data = json.loads(path.read_text(encoding="utf-8"))
    elif suffix == ".safetensors":
        from safetensors.numpy import load_file

        data = load_file(str(path))
    else:
        import torch

        data = torch.load(path, map_location="cpu", weights_only=True)  # tensors and containers only
    if not isinstance(data, dict):
        raise ValueError(f"the file holds a {type(data).__name__}, not a mapping of named vectors")
    return data


def _position_array(value: Any, name: str, where: str) -> np.ndarray:
    arr = np.asarray(value.detach().cpu().float().numpy() if hasattr(value, "detach") else value, dtype=np.float64)
    while arr.ndim > 3 and arr.shape[0] == 1:
        arr = arr[0]
    if arr.ndim != 3:
        raise UserError(f"{where}: {name} must be a [C, h, w] array (RAE's stat.pt: per channel and position), got "
                        f"shape {list(np.asarray(value).shape) if not hasattr(value, 'shape') else list(value.shape)}")
    return arr


def mean_var_record(mean: np.ndarray, var: np.ndarray, source: dict[str, Any], eps: float = RAE_EPS) -> dict[str, Any]:
    """A per-position (mean_var) normalization record of [C, h, w] arrays."""
    return {"form": "mean_var", "shape": [int(v) for v in np.shape(mean)], "encoding": ARRAY_ENCODING,
            "mean": encode_array(np.asarray(mean)), "var": encode_array(np.asarray(var)), "eps": float(eps),
            "source": dict(source)}


def read_stats_file(path: str | Path, channels: int | Sequence[int]) -> dict[str, Any]:
    """A per-channel normalization record from a statistics file: `mean` and `std` (LightningDiT's
    `latents_stats.pt`: tensors [1, C, 1, 1]; also `latents_mean` / `latents_std` as in a diffusers VAE config),
    with an optional `multiplier` (default 1), or `scale` and `shift`. `.pt`/`.pth` (read with
    `torch.load(weights_only=True)`), `.json` or `.safetensors`; or `mean` and `var` of shape [C, h, w] (RAE's
    `stat.pt`: per channel and position, eps 1e-5 or the file's `eps`). `channels`: the latent channels, or the
    latent shape [C, h, w] a per-position file must have. UserError naming the file and the problem."""
    from dit_pipeline.common.io import missing_file, sha256_file

    p = Path(path).expanduser()
    where = f"--latent-stats {path}"
    if not p.is_file():
        raise UserError(f"{where}: {missing_file(p)}")
    if p.suffix.lower() not in STATS_SUFFIXES:
        raise UserError(f"{where}: expected a {', '.join(STATS_SUFFIXES)} file holding per-channel mean and std")
    try:
        data = _read_stats_values(p)
    except UserError:
        raise
    except Exception as e:  # any unreadable or unsafe file: one line, nothing unpickled
        raise UserError(f"{where}: cannot read it ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
                        ) from None
    aliases = {"latents_mean": "mean", "latents_std": "std"}
    data = {aliases.get(k, k): v for k, v in data.items()}
    if "mean" in data and "var" in data and "std" not in data:
        mean, var = _position_array(data["mean"], "mean", where), _position_array(data["var"], "var", where)
        if mean.shape != var.shape:
            raise UserError(f"{where}: mean {list(mean.shape)} and var {list(var.shape)} differ in shape")
        eps = _scalar(data["eps"], "eps", where) if "eps" in data else RAE_EPS
        record = mean_var_record(mean, var, {"kind": "file", "path": str(p.resolve()), "sha256": sha256_file(p)}, eps)
        problems = normalization_problems(record, channels)
        if problems:
            raise UserError(f"{where}: {'; '.join(problems)}")
        return record
    if "mean" in data and "std" in data:
        record: dict[str, Any] = {"form": "mean_std", "mean": _vector(data["mean"], "mean", where),
                                  "std": _vector(data["std"], "std", where),
                                  "multiplier": _scalar(data.get("multiplier", 1.0), "multiplier", where)}
    elif "scale" in data and "shift" in data:
        record = {"form": "scale_shift", "scale": _vector(data["scale"], "scale", where),
                  "shift": _vector(data["shift"], "shift", where)}
    else:
        raise UserError(f"{where}: holds {sorted(map(str, data))[:8]}; expected mean and std (or scale and shift)")
    record["source"] = {"kind": "file", "path": str(p.resolve()), "sha256": sha256_file(p)}
    problems = normalization_problems(record, channels)
    if problems:
        raise UserError(f"{where}: {'; '.join(problems)}")
    return record


def stats_record(mean: Sequence[float], std: Sequence[float], source: dict[str, Any]) -> dict[str, Any]:
    """A mean/std normalization record (multiplier 1) of computed statistics."""
    return {"form": "mean_std", "mean": [float(v) for v in mean], "std": [float(v) for v in std],
            "multiplier": 1.0, "source": dict(source)}
