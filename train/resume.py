"""Where a training run starts, decided once and the same way in a dry run and the real run.

`check_resume` runs on every rank before any process group is joined: it refuses `--resume none` over an
existing run, finds the checkpoint to resume from, loads it once and checks it against this run (model,
objective, shard set, global batch, tensors, optimizer layout: the checks of train.parts) and lists the settings changed since
it. A refused resume therefore stops before the run folder is touched (config.json stays byte-identical);
allowed changes are logged old -> new and appended, with the full config, to RUN/config-history.jsonl.

`--init` names the weights a run started from; a resume never reads it. So a resume with another `--init` is
refused (it would do nothing, and config.json and the checkpoints would name a file the run never loaded), and a
resume without `--init` keeps the file the run started from in its config (issue 41, item 6).
"""
from __future__ import annotations

import dataclasses
import datetime
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dit_pipeline.common.errors import UserError
from dit_pipeline.common.io import atomic_write_bytes
from dit_pipeline.train.checkpoint import CheckpointManager, load_checkpoint
from dit_pipeline.train.config import TrainConfig
from dit_pipeline.train.feeds import mix_part, shard_set_part
from dit_pipeline.train.model_options import MODEL_OPTIONS
from dit_pipeline.train.parts import build_parts, check_all
from dit_pipeline.train.fit import param_counts, resolve_precision
from dit_pipeline.train.preflight import Preflight
from dit_pipeline.train.reg import RegPart

CONFIG_HISTORY = "config-history.jsonl"
# Settings whose change on resume is not a change of the run (how this invocation behaves; a moved folder).
_NOT_RUN_SETTINGS = ("dry_run", "quiet", "resume", "run_dir")


@dataclass
class StartPoint:
    """Where a run starts: the checkpoint it resumes from (None: from scratch), its step, and the settings
    changed since that checkpoint (name -> [old, new]), all checked by `check_resume`."""

    path: Path | None = None
    step: int = 0
    changes: dict[str, list] = field(default_factory=dict)
    checkpoint: dict[str, Any] | None = field(default=None, repr=False)  # loaded once; dropped after use
    kept: dict[str, Any] = field(default_factory=dict)  # settings of the checkpoint's run this one keeps (init)


def resolved_config(prep: Preflight, precision: str) -> TrainConfig:
    """The config as the run uses it (precision, micro-batch and the block switches the family took by default
    resolved), as saved in config.json."""
    return TrainConfig(**{**prep.cfg.to_dict(), "precision": precision, "micro_batch_size": prep.batch.micro_batch,
                          **model_switches(prep), **prep.cfg.resolved_guidance()})


def model_switches(prep: Preflight) -> dict[str, bool]:
    """The block switches (--qk-norm ...) the model was built with, for those its family has: given or its own."""
    from dit_pipeline.dit.family import family_of_config

    mc = param_counts(prep.model_kwargs)[2]
    accepted = family_of_config(mc).overrides
    return {k: bool(mc.get(k, False)) for k in MODEL_OPTIONS if k in accepted}


def config_changes(old: dict[str, Any], new: dict[str, Any]) -> dict[str, list]:
    """Settings that differ between a checkpoint's config and this run's (name -> [old, new]). A setting the
    checkpoint's config lacks (added since it was written) counts as its default, which that run had."""
    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig) if f.default is not dataclasses.MISSING}
    was = {k: old.get(k, defaults.get(k)) for k in new}
    return {k: [was[k], v] for k, v in new.items() if k not in _NOT_RUN_SETTINGS and was[k] != v}


def format_changes(changes: dict[str, list]) -> str:
    return "; ".join(f"{k} {old!r} -> {new!r}" for k, (old, new) in changes.items())


def _checkpoint_to_resume(cfg: TrainConfig, ckpts: CheckpointManager) -> Path | None:
    if cfg.resume == "none":
        return None
    if cfg.resume == "auto":
        return ckpts.latest()
    return Path(cfg.resume).expanduser()


def check_resume(prep: Preflight) -> StartPoint:
    """Where the run starts, with every check of a resume done (UserError on a refused one)."""
    from dit_pipeline import dit

    cfg = prep.cfg
    ckpts = CheckpointManager(Path(cfg.run_dir).expanduser() / "checkpoints")
    existing = ckpts.steps()
    if cfg.resume == "none" and existing:
        raise UserError(f"{cfg.run_dir} already holds checkpoints up to step {existing[-1]}; --resume none would "
                        "train a new run over them. Use a new --run-dir, or --resume auto to continue this one.")
    path = _checkpoint_to_resume(cfg, ckpts)
    if path is None:
        return StartPoint()
    try:
        ckpt = load_checkpoint(path)
    except UserError as e:
        if cfg.resume in ("auto", "none") or "not a dit-pipeline training checkpoint" not in str(e):
            raise  # a damaged or hostile file: --init would refuse it too
        raise UserError(f"{e}; to start a new run from the weights of a file, pass --init {cfg.resume} "
                        "instead of --resume") from None
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    old = ckpt.get("config") or {}
    kept = _kept_init(cfg, old, path, int(ckpt["step"]))
    new = {**resolved_config(prep, resolve_precision(cfg.precision, device)).to_dict(), **kept}
    with torch.device("meta"):  # the shapes and settings the checkpoint must fit; no weights allocated
        model = dit.create_model(**prep.model_kwargs)
        head = (dit.repa.REPAModel(model, encoder_depth=cfg.repa_depth, z_dims=(prep.teacher.dim,))
                if prep.teacher is not None else None)
    check_all(build_parts(objective=cfg.objective, config=new, model=model, head=head,
                          shard_set=shard_set_part(prep), mix=mix_part(prep),
                          text=prep.text.record(cfg.text_features) if prep.text else None,
                          reg=RegPart.of(new, prep.reg)), ckpt, str(path))
    return StartPoint(path, int(ckpt["step"]), config_changes(old, new), ckpt, kept)


def _kept_init(cfg: TrainConfig, old: dict[str, Any], path: Path, step: int) -> dict[str, Any]:
    """The `init` a resumed run records: the one it started from. Another --init is refused: a resume never
    reads it (UserError naming both files and the two ways on)."""
    was = old.get("init")
    if cfg.init is None or cfg.init == was:
        return {"init": was} if cfg.init is None and was is not None else {}
    started = f"started from {was}" if was else "started from scratch (no --init)"
    raise UserError(f"--init {cfg.init} does nothing here: {cfg.run_dir} resumes {path.name} (step {step}) of a run "
                    f"that {started}, and a resume never reads --init. Drop --init (or pass the run's own) to "
                    f"resume, or use a new --run-dir to start a run from {cfg.init}")


def append_history(run_dir: Path, start: StartPoint, resolved: TrainConfig) -> None:
    """RUN/config-history.jsonl: one line per start of the run (step, time, changes, the full config)."""
    path = run_dir / CONFIG_HISTORY
    old = path.read_bytes() if path.is_file() else b""
    rec = {"step": start.step, "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "resumed_from": str(start.path) if start.path else None, "changes": start.changes,
           "config": resolved.to_dict()}
    atomic_write_bytes(path, old + (json.dumps(rec, sort_keys=True) + "\n").encode())


def start_line(run_dir: str, start: StartPoint, dry_run: bool) -> str:
    """The plan's lines on where the run starts and what changed since its checkpoint."""
    verb = ("would resume" if dry_run else "resumes") if start.path else ("would start" if dry_run else "starts")
    where = f" from {start.path} (step {start.step})" if start.path else " from scratch"
    line = f"  run dir     {run_dir}: {verb}{where}"
    if start.changes:
        line += f"\n  changed     since that checkpoint (allowed): {format_changes(start.changes)}"
    return line
