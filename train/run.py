"""`train.run(cfg)`: the whole training run on one process, under torchrun, or on many nodes.

Order matters for the failure guarantees (RELIABILITY.md): every check that needs no GPU (config, batch
arithmetic, shard set vs manifest, model vs latents, readers vs shards) runs before the process group is
joined or a GPU is touched; a checkpoint to resume from is fully validated (model, shard set, global batch,
state_dict keys and shapes, optimizer layout) before anything is loaded into the model, so a mismatch never
half-loads; the run folder keeps only complete checkpoints (partial temp files from a killed save are
removed at start).
"""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Sequence

from dit_pipeline.common import distributed as dist
from dit_pipeline.common.errors import UserError
from dit_pipeline.common.io import atomic_write_json
from dit_pipeline.common.log import get_logger, setup_logging
from dit_pipeline.common.precision import set_tf32
from dit_pipeline.common.runlock import RunLock
from dit_pipeline.train.checkpoint import CheckpointManager
from dit_pipeline.train.config import TrainConfig
from dit_pipeline.train.hooks import PeriodicHook
from dit_pipeline.train.loop import RunOutput, Trainer
from dit_pipeline.train.metrics import MetricsLog
from dit_pipeline.train.net import build_model
from dit_pipeline.train.fit import resolve_precision
from dit_pipeline.train.plan import format_plan
from dit_pipeline.train.preflight import Preflight, prepare
from dit_pipeline.train.resume import (CONFIG_HISTORY, StartPoint, append_history, check_resume, format_changes,
                                       resolved_config, start_line)
from dit_pipeline.train.signals import StopRequest
from dit_pipeline.train.state import comm_guard



# ----------------------------------------------------------------------------------------------------------

def _start_run_dir(prep: Preflight, precision: str, start: StartPoint
                   ) -> tuple[Path, CheckpointManager, TrainConfig]:
    cfg = prep.cfg
    run_dir = Path(cfg.run_dir).expanduser()
    ckpts = CheckpointManager(run_dir / "checkpoints", cfg.keep_last, cfg.keep_every)
    resolved = resolved_config(prep, precision)
    if start.kept:  # what the checkpoint's run records and this invocation did not restate (its --init)
        resolved = dataclasses.replace(resolved, **start.kept)
    removed = []
    if dist.is_main():
        run_dir.mkdir(parents=True, exist_ok=True)
        removed = ckpts.clean_partial()
        append_history(run_dir, start, resolved)
        atomic_write_json(run_dir / "config.json", resolved.to_dict())
    dist.barrier()
    setup_logging(run_dir / "logs", quiet=cfg.quiet, main_log=run_dir / "log.txt")
    if dist.is_main() and removed:
        get_logger().info(f"removed {len(removed)} partial checkpoint file(s) left by an interrupted save")
    if dist.is_main() and start.changes:
        get_logger().info(f"settings changed since {start.path} (allowed; kept in {run_dir / CONFIG_HISTORY}): "
                          f"{format_changes(start.changes)}")
    return run_dir, ckpts, resolved


def run(cfg: TrainConfig, hooks: Sequence[PeriodicHook] = (), *, world_size: int | None = None) -> str | None:
    """Train according to `cfg`. Returns "done", "stopped" (signal; checkpoint written) or None (dry run).

    world_size: the world size to plan for in a dry run (the --nproc-per-node launcher); default: this
    process's (torchrun's WORLD_SIZE, or 1).

    SIGTERM, SIGUSR1 and Ctrl-C are handled from the start (train/signals.py): a signal during start-up stops
    the run at the first step boundary, with exit 0 and nothing lost.
    """
    with StopRequest() as stop:
        return _run(cfg, hooks, world_size, stop)


def _run(cfg: TrainConfig, hooks: Sequence[PeriodicHook], world_size: int | None, stop: StopRequest) -> str | None:
    prep = prepare(cfg, world_size)
    start = check_resume(prep)  # on every rank before any is started; a dry run checks the same
    if cfg.dry_run:
        if dist.is_main():
            # the lease the real run would take: a live run's is the same refusal, a dead run's a plan line
            lease = RunLock(Path(cfg.run_dir).expanduser(), "dit-train").check()
            line = start_line(cfg.run_dir, start, dry_run=True) + (f"\n  lock        {lease}" if lease else "")
            print(format_plan(prep, line), flush=True)
        if prep.unfit:  # the real run's refusal, after the plan that shows what fits
            raise UserError(prep.unfit)
        return None
    assert prep.parallel is not None
    dist.init(single=prep.parallel.needs_group())  # a DeviceMesh needs a process group, even of one rank
    held: list[RunLock] = []
    with dist.leaving_group():
        try:
            # One live run per run folder (two jobs given the same --run-dir; see common/runlock.py): rank 0
            # holds the lease, and its refusal reaches every rank before any of them writes.
            def take() -> str | None:
                held.append(RunLock(Path(cfg.run_dir).expanduser(), "dit-train").acquire())
                return held[0].warning

            warning = dist.on_rank0(take)
            return _train(prep, hooks, stop, start, warning)
        finally:
            for lock in held:
                lock.release()


def _train(prep: Preflight, hooks: Sequence[PeriodicHook], stop: StopRequest, start: StartPoint,
           lock_warning: str | None = None) -> str:
    device = dist.device()
    precision = resolve_precision(prep.cfg.precision, device)
    set_tf32(prep.cfg.tf32)  # for the float32 matmuls/convolutions that remain outside autocast
    run_dir, ckpts, resolved = _start_run_dir(prep, precision, start)
    log = get_logger()
    log.info(format_plan(prep, start_line(prep.cfg.run_dir, start, dry_run=False), dry_run=False))
    if lock_warning:
        log.warning(lock_warning)
    net = build_model(prep, device, precision)
    metrics = MetricsLog(run_dir, dist.rank(), main=dist.is_main(), tensorboard=prep.cfg.tensorboard,
                         wandb=(prep.cfg.wandb_project, resolved.to_dict()) if prep.cfg.wandb else None)
    trainer = Trainer(dataclasses.replace(prep, cfg=resolved), net, RunOutput(run_dir, ckpts, metrics), hooks)
    for note in trainer.feed.start_notes(prep.plan0):  # samples left out of each epoch; a mix's repeated sources
        log.warning(note)
    with comm_guard("agreeing on the checkpoint to resume from", 0):
        seen = dist.all_gather_object(str(start.path) if start.path else None)
    if len(set(seen)) > 1:  # every rank found its own (train.resume.check_resume): they must be the same
        raise UserError(f"the ranks would resume from different checkpoints ({', '.join(map(str, seen))}): "
                        "--run-dir must be one shared folder on every node")
    ckpt, start.checkpoint = start.checkpoint, None  # the only reference: freed once loaded
    if start.path is not None and ckpt is not None:
        trainer.resume_from(ckpt, start.path)
    del ckpt
    state = trainer.state
    metrics.resume_at(state.step)
    if trainer.done():
        log.info(f"nothing to do: the run in {run_dir} is complete at step {state.step}")
        return "done"
    stop.lost = lambda: (f"the {trainer.state.step - trainer.last_saved} step(s) since the last checkpoint (step "
                         f"{trainer.last_saved}) are lost; rerun the same command to resume from it")
    t0, first_step = time.perf_counter(), state.step
    try:
        outcome = trainer.fit(stop)
    finally:
        metrics.close()
    with comm_guard("the final barrier", state.step):
        dist.barrier()
    why = f" on {stop.received.name}" if outcome == "stopped" and stop.received else ""
    # the epoch of the last step, as the step lines count it (at an epoch's end state.epoch is the next one)
    last_epoch = state.epoch - 1 if state.step_in_epoch == 0 and state.epoch > 0 else state.epoch
    wall = time.perf_counter() - t0
    log.info(f"{'stopped' + why if outcome == 'stopped' else 'finished'} at step {state.step} (epoch {last_epoch}) "
             f"after {wall:.1f}s{_final_numbers(run_dir, state.step - first_step, prep.batch.global_batch, wall)}; "
             f"newest checkpoint {ckpts.latest()}{'; ' + trainer.guard.summary() if trainer.guard.summary() else ''}")
    return outcome


def _final_numbers(run_dir: Path, steps: int, global_batch: int, wall: float) -> str:
    """': loss L (step S), N images/s' for the closing line: the last logged loss (all-rank mean, from the tail of
    RUN/metrics.jsonl, complete after the final barrier) and this invocation's images per second, checkpoints and
    hooks included."""
    import json

    loss = ""
    try:
        with open(run_dir / "metrics.jsonl", "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - 65536))
            for line in reversed(f.read().decode("utf-8", "replace").splitlines()):
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                if isinstance(rec, dict) and isinstance(rec.get("loss"), (int, float)):
                    loss = f"final loss {rec['loss']:.4f} (step {rec.get('step')}), "
                    break
    except OSError:
        pass
    return f": {loss}{steps * global_batch / max(wall, 1e-9):.1f} images/s"
