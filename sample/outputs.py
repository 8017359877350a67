"""What `dit-sample` writes beside the samples and reads back from earlier runs.

`run_record` is the run record (`NAME.npz.json`, `OUT/samples.json`): the fingerprint of everything that determines
the pixels (keys added later appear only where they apply, so earlier fingerprints and their finished parts stay
valid) and the context around it. `prepare_outputs` (rank 0, before sampling) finds this exact run complete, or opens
its parts, refusing to replace the outputs of another run without --overwrite. `write_outputs` (rank 0, after
every rank finished) assembles the `.npz`, the grid and the records, then removes the parts; a failed write is one
error that keeps every finished sample for the rerun.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from dit_pipeline.common.errors import UserError
from dit_pipeline.common.faults import fault_point
from dit_pipeline.common.io import atomic_write_json, sha256_file
from dit_pipeline.common.latent_norm import LatentNorm
from dit_pipeline.dit import protocols
from dit_pipeline.sample.conditions import Sampling
from dit_pipeline.sample.config import FLOW_SAMPLERS, SampleConfig
from dit_pipeline.sample.grid import save_grid
from dit_pipeline.sample.load import LoadedModel, latent_shape
from dit_pipeline.sample.npz import RUN_FILE, PartStore, assemble_npz, describe_changes

RECORD_FORMAT = "dit-pipeline.samples"


def run_record(cfg: SampleConfig, loaded: LoadedModel, vae_id: dict[str, Any], norm: LatentNorm,
               labels: np.ndarray, image_size: int, device: torch.device, proto: protocols.Protocol,
               guide: LoadedModel | None = None, conds: Sampling | None = None) -> dict[str, Any]:
    """What the outputs record: the fingerprint (what the samples are) and context.

    `numerics` (batch size, CPU threads, device) change only the last float bits, so they stay out of
    the fingerprint: a resume with another batch size keeps the finished parts (common/determinism.py)."""
    vae_key = ({"weights_sha256": vae_id["weights_sha256"]} if vae_id.get("weights_sha256")
               else {k: vae_id.get(k) for k in ("source", "revision", "commit")})
    fingerprint = {
        "format": RECORD_FORMAT, "version": 1,
        "checkpoint_sha256": sha256_file(Path(cfg.ckpt).expanduser()), "weights": loaded.info["weights"],
        "model_config": loaded.config, "vae": vae_key, "scaling_factor": norm.scaling_factor,
        "shift_factor": norm.shift_factor, **_normalization_key(norm),
        "objective": loaded.info["objective"], "sampler": cfg.sampler, "steps": cfg.steps,
        **_sde_settings(cfg), **_optional_settings(cfg, loaded), "cfg_scale": cfg.cfg_scale,
        "cfg_channels": cfg.cfg_channels,
        "seed": cfg.seed, "num_samples": cfg.total, "image_size": image_size, **_label_settings(cfg),
        "labels_sha256": hashlib.sha256(np.ascontiguousarray(labels, dtype="<i8").tobytes()).hexdigest(),
        "precision": cfg.precision, "tf32": cfg.tf32, "compile": cfg.compile,
        **({"protocol": proto.name} if cfg.protocol is not None else {}),
        **({"guidance_model_sha256": sha256_file(Path(cfg.guidance_model).expanduser())} if guide is not None else {}),
        **(conds.fingerprint() if conds is not None else {}),
    }
    numerics = {"batch_size": cfg.batch_size, "cpu_threads": cfg.cpu_threads if device.type == "cpu" else None,
                "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    return {"fingerprint": json.loads(json.dumps(fingerprint)), "numerics": numerics, "config": cfg.to_dict(),
            "checkpoint": {"path": str(cfg.ckpt), "source": loaded.info["source"], "step": loaded.info.get("step")},
            "vae": vae_id, "label_sampling": label_sampling(cfg), "labels": labels.tolist(),
            "class_names": (loaded.latent or {}).get("class_names"), **(conds.record() if conds is not None else {}),
            "protocol": proto.record(latent_shape(loaded), loaded.info.get("time_shift")),
            **({"settings_from": dict(loaded.info["settings_from"])} if loaded.info.get("settings_from") else {}),
            **({"guidance_model": {"path": str(cfg.guidance_model), "source": guide.info["source"],
                                   "model_config": guide.config}} if guide is not None else {})}


def _normalization_key(norm: LatentNorm) -> dict[str, Any]:
    """A per-channel normalization's numbers in the fingerprint (where they came from does not change a pixel);
    nothing for a scalar one, whose factors are there already, so earlier fingerprints stay valid."""
    if norm.per_channel is None:
        return {}
    return {"normalization": {k: v for k, v in norm.per_channel.items() if k != "source"}}


def _label_settings(cfg: SampleConfig) -> dict[str, Any]:
    """Equal-label sampling in the fingerprint; nothing for uniform or given classes, so the fingerprints of
    earlier runs (and their finished parts) stay valid (labels_sha256 pins the classes either way)."""
    return {"label_sampling": "equal"} if label_sampling(cfg) == "equal" else {}


def _sde_settings(cfg: SampleConfig) -> dict[str, Any]:
    """The SDE sampler's settings (they determine its pixels); nothing for the other samplers."""
    if cfg.sampler != "euler-maruyama":
        return {}
    return {"diffusion_form": cfg.diffusion_form, "diffusion_norm": cfg.diffusion_norm,
            "last_step_size": cfg.last_step_size}


def _optional_settings(cfg: SampleConfig, loaded: LoadedModel) -> dict[str, Any]:
    """Fingerprint keys added later, present only where they apply, so the fingerprints of other runs are
    unchanged: `sde_steps` (the SDE counts SiT's num_steps; runs recorded before took one step more and must
    neither resume nor count as complete), the guidance interval, REPA's time convention, a flow time shift."""
    out: dict[str, Any] = {"sde_steps": "sit-num-steps"} if cfg.sampler == "euler-maruyama" else {}
    if cfg.guidance_interval is not None:
        out["guidance_interval"] = [float(v) for v in cfg.guidance_interval]
    if loaded.info.get("flow_convention") == "repa" and loaded.info["objective"] == "flow":
        out["flow_convention"] = "repa"
    if cfg.sampler in FLOW_SAMPLERS and cfg.time_shift not in (None, 1.0):
        out["time_shift"] = float(cfg.time_shift)  # type: ignore[arg-type]
    elif cfg.protocol is not None and cfg.time_shift is not None:  # replaces the protocol's shift, 1 included
        out["time_shift"] = float(cfg.time_shift)
    if cfg.encoder_refresh > 1:
        out["encoder_refresh"] = cfg.encoder_refresh
    if cfg.ig_scale is not None or cfg.ig_uncond_scale is not None:  # internal guidance decides the pixels
        out["internal_guidance"] = {"scale": cfg.ig_scale, "interval": cfg.ig_interval,
                                    "uncond_scale": cfg.ig_uncond_scale}
    if cfg.sampler in FLOW_SAMPLERS and loaded.info.get("prediction") is not None:
        out["prediction"] = loaded.info["prediction"]  # x-prediction: the conversion decides the pixels
    return out


def label_sampling(cfg: SampleConfig) -> str:
    """How the run's classes were chosen: "given" (--class-labels), "uniform" or "equal" (--labels, or the
    protocol's)."""
    return "given" if cfg.class_labels else (cfg.labels or "uniform")


def record_paths(cfg: SampleConfig) -> list[Path]:
    paths = [Path(str(cfg.npz) + ".json")] if cfg.npz else []
    return paths + ([Path(cfg.out) / "samples.json"] if cfg.out else [])


def grid_file(cfg: SampleConfig) -> Path | None:
    return Path(cfg.out) / "grid.png" if cfg.out and cfg.grid_max > 0 else None


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _read_fingerprint(path: Path) -> dict[str, Any] | None:
    data = _read_json(path)
    return data.get("fingerprint") if isinstance(data, dict) else None


def _interrupted_npz(npz_record: Path, store: PartStore) -> bool:
    """An npz without its record, beside the parts of this very run, was written by this run before it was
    interrupted (the record is written after the npz): it is rewritten from the parts, not foreign."""
    return not npz_record.exists() and _read_json(store.folder / RUN_FILE) == store.fingerprint


def prepare_outputs(cfg: SampleConfig, store: PartStore, record: dict[str, Any], log) -> str | list[int]:
    """Rank 0: "complete" if this exact run already finished, else open the parts; the finished indices.

    Outputs of a different run (another checkpoint or other settings, or of unknown origin) are never
    replaced without --overwrite.
    """
    fp = record["fingerprint"]
    records = record_paths(cfg)
    same = [_read_fingerprint(p) == fp for p in records]
    finals = [p for p in (Path(cfg.npz) if cfg.npz else None, grid_file(cfg)) if p is not None]
    if all(same) and all(p.is_file() for p in finals) and not store.folder.exists():
        return "complete"
    foreign = [str(p) for p, ok in zip(records, same) if p.exists() and not ok]
    if cfg.npz and Path(cfg.npz).exists() and not same[0] and not _interrupted_npz(records[0], store):
        foreign.insert(0, str(cfg.npz))
    if foreign and not cfg.overwrite:
        changed = describe_changes(next((_read_fingerprint(p) for p in records if p.exists() and
                                         _read_fingerprint(p) != fp), None), fp)
        raise UserError(f"{', '.join(foreign)} already exist(s) and were not made by this checkpoint with these "
                        f"settings (changed: {changed}); choose another output or pass --overwrite to replace them")
    return store.open(overwrite=cfg.overwrite, log=log)


@contextlib.contextmanager
def _writing(path: Path, store: PartStore) -> Iterator[None]:
    """A failed output write (disk full, quota, I/O error) is one clear error; outputs are written atomically
    and the parts are removed only after all of them, so every finished sample is kept for the rerun."""
    try:
        yield
    except OSError as e:
        raise UserError(f"cannot write {path} ({e.strerror or e}); all {store.total} samples are finished and kept "
                        f"in {store.folder}. Free space (or fix the folder) and rerun the same command to write "
                        "the outputs.") from None


def write_outputs(cfg: SampleConfig, store: PartStore, labels: np.ndarray, record: dict[str, Any],
                  log, conds: Sampling) -> tuple[Path | None, Path | None]:
    """Rank 0 after every rank finished: npz, grid, run records; then the parts go."""
    npz_path = grid_path = None
    if cfg.npz:
        npz_path = Path(cfg.npz)
        with _writing(npz_path, store):
            n, h, w = assemble_npz(store, npz_path, labels)
        log.info("wrote %s: arr_0 uint8 [%d, %d, %d, 3], arr_1 labels [%d]", npz_path, n, h, w, n)
        fault_point("sample.npz_written")  # the npz is in place, its record and the grid not yet
    grid_path = grid_file(cfg)
    if grid_path is not None:
        k = min(cfg.total, cfg.grid_max)
        pairs = list(store.iter_images(range(k)))
        with _writing(grid_path, store):
            save_grid(np.stack([p[0] for p in pairs]), grid_path, ncol=cfg.grid_cols,
                      labels=conds.grid_labels([p[1] for p in pairs]))
        log.info("wrote %s (%d samples)", grid_path, k)
    for path in record_paths(cfg):
        with _writing(path, store):
            atomic_write_json(path, record)
    store.remove()
    return npz_path, grid_path
