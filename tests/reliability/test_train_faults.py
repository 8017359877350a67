"""dit-train killed, preempted or diverging at deterministic points, then rerun with the same command.

After every fault: the newest complete checkpoint is intact and loads; rerunning resumes from it; the
finished run equals the uninterrupted one (`train_base`) bit for bit: every logged value of steps 1..8
exactly once and in order, the weights, EMA and optimizer state of every checkpoint, the EMA files.
Points of the 8-step run (a checkpoint every 2 steps = 4 saves): after a step (`train.step_end`), between
the EMA file and the full checkpoint (`train.ckpt_ema_written`), inside the full checkpoint's write
(`train.ckpt_mid_save`), after both before pruning (`train.ckpt_saved`). tests/train/test_resume.py covers
step_end@3, ckpt_mid_save@1 and a SIGTERM once; this sweeps every kind of point (seeded occurrences, all
of them with DIT_RELIABILITY_EXHAUSTIVE=1), both stop signals, NaN, and shards damaged during the run.
"""
from __future__ import annotations

import signal
from pathlib import Path

import pytest
import torch

from tests.reliability.conftest import TRAIN_STEPS, train_args
from tests.reliability.harness import (SWEEP, assert_clean_error, file_hashes, picks, run, start, sweep_points,
                                       temp_files, wait_stopped)
from dit_pipeline.train.checkpoint import CheckpointManager, load_checkpoint
from dit_pipeline.train.metrics import read_metrics

SAVES = TRAIN_STEPS // 2
KINDS = {"train.step_end": TRAIN_STEPS, "train.ckpt_ema_written": SAVES, "train.ckpt_mid_save": SAVES,
         "train.ckpt_saved": SAVES}
KILL_POINTS = [f"{kind}@{n}" for kind, count in KINDS.items() for n in range(1, count + 1)]
# every kind of point at 3 (after a step) or 2 (per save) seeded occurrences; all 20 with
# DIT_RELIABILITY_EXHAUSTIVE=1
SWEPT = [p for i, (kind, count) in enumerate(KINDS.items())
         for p in sweep_points(10 + i, [f"{kind}@{n}" for n in range(1, count + 1)], 3 if count > SAVES else 2)]
SUBSET = {"train.ckpt_ema_written@2"}
LOGGED = ("step", "epoch", "loss", "mse", "vb", "grad_norm", "lr")


def _logged(run_dir: Path) -> list[tuple]:
    return [tuple(r.get(k) for k in LOGGED) for r in read_metrics(run_dir)]


def _tensors_equal(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), what
    for k in a:
        assert torch.equal(a[k], b[k]), f"{what}.{k} differs"


def assert_checkpoints_match(run_dir: Path, base: Path, steps: list[int]) -> None:
    """The checkpoints of `steps` hold the uninterrupted run's weights, EMA, optimizer state and data
    position, and the EMA files are byte for byte its EMA files (full checkpoint files differ in the
    stored config's --run-dir)."""
    ours, theirs = CheckpointManager(run_dir / "checkpoints"), CheckpointManager(base / "checkpoints")
    for step in steps:
        a, b = load_checkpoint(ours.path(step)), load_checkpoint(theirs.path(step))
        assert a["step"] == b["step"] == step and a["data"] == b["data"]
        for key in ("model", "ema"):
            _tensors_equal(a[key], b[key], f"step {step} {key}")
        for i, st in b["opt"]["state"].items():
            _tensors_equal(a["opt"]["state"][i], st, f"step {step} optimizer state {i}")
        ema_file = f"checkpoints/step-{step:07d}-ema.pt"
        assert file_hashes(run_dir, ema_file) == file_hashes(base, ema_file)   # the official-format file


def assert_same_as_uninterrupted(run_dir: Path, base: Path) -> None:
    logged = _logged(run_dir)
    assert [r[0] for r in logged] == list(range(1, TRAIN_STEPS + 1))   # every step once, none twice
    assert logged == _logged(base)                                    # exact float equality
    steps = CheckpointManager(base / "checkpoints").steps()
    assert set(steps) <= set(CheckpointManager(run_dir / "checkpoints").steps())   # a preemption may add one
    assert_checkpoints_match(run_dir, base, steps)
    assert temp_files(run_dir) == []


def _resume_after(shards: Path, run_dir: Path, faults: list[str], action: str = "kill") -> None:
    """Run with each fault in turn (the first must fire), checking the newest checkpoint after each; then
    rerun without faults to the end."""
    args = train_args(shards, run_dir)
    ckpts = CheckpointManager(run_dir / "checkpoints")
    for i, fault in enumerate(faults):
        before = ckpts.steps()
        r = run("dit-train", args, fault=f"{fault}:{action}")
        if action == "kill":
            assert r.rc == -signal.SIGKILL or (i > 0 and r.rc == 0), r.err[-3000:]
        else:  # preemption: finish the step, checkpoint, exit 0
            assert r.rc == 0, r.err[-3000:]
            assert ckpts.steps() and ckpts.steps()[-1] == _logged(run_dir)[-1][0]
        assert set(before) <= set(ckpts.steps())                      # no complete checkpoint lost
        if ckpts.steps():
            assert load_checkpoint(ckpts.latest())["step"] == ckpts.steps()[-1]   # the newest is intact
    r = run("dit-train", args)
    assert r.rc == 0, r.err[-3000:]


@pytest.mark.parametrize("fault", [f if f in SUBSET else pytest.param(f, marks=SWEEP)
                                   for f in sorted(set(SWEPT) | SUBSET, key=KILL_POINTS.index)])
def test_sigkill_at_every_point_then_rerun(train_shards, train_base, tmp_path, fault):
    _resume_after(train_shards, tmp_path / "run", [fault])
    assert_same_as_uninterrupted(tmp_path / "run", train_base)


@SWEEP
@pytest.mark.parametrize("seed", range(2))
def test_several_kills_in_one_run(train_shards, train_base, tmp_path, seed):
    _resume_after(train_shards, tmp_path / "run", picks(seed, KILL_POINTS, 3))
    assert_same_as_uninterrupted(tmp_path / "run", train_base)


@pytest.mark.parametrize("fault, action", [
    pytest.param("train.step_end@3", "usr1", marks=SWEEP),
    pytest.param("train.step_end@5", "term", marks=SWEEP),
    pytest.param("train.ckpt_mid_save@2", "term", marks=SWEEP),     # the signal arrives during a save
    pytest.param("train.ckpt_ema_written@1", "usr1", marks=SWEEP),
])
def test_preemption_checkpoints_and_exits_zero(train_shards, train_base, tmp_path, fault, action):
    _resume_after(train_shards, tmp_path / "run", [fault], action=action)
    assert_same_as_uninterrupted(tmp_path / "run", train_base)


@pytest.mark.parametrize("step", [pytest.param(k, marks=SWEEP) for k in (1, 3, 8)])
def test_nan_stops_before_the_update_and_the_last_checkpoint_stays(train_shards, train_base, tmp_path, step):
    run_dir = tmp_path / "run"
    args = train_args(train_shards, run_dir)
    r = run("dit-train", args, fault=f"train.nan@{step}")
    last = (step - 1) // 2 * 2
    assert_clean_error(r, f"step {step}: non-finite loss or gradient", "stopped before the optimizer update",
                       f"({f'step-{last:07d}.pt' if last else 'none yet'}) is intact")
    assert [rec[0] for rec in _logged(run_dir)] == list(range(1, step))        # the bad step is not logged
    good = list(range(2, step, 2))
    assert CheckpointManager(run_dir / "checkpoints").steps() == good
    assert_checkpoints_match(run_dir, train_base, good)                        # the good ones, intact
    assert run("dit-train", args).rc == 0                                      # the rerun continues as if
    assert_same_as_uninterrupted(run_dir, train_base)                           # nothing had happened


def _corrupt(path: Path, how: str, other: Path) -> None:
    data = bytearray(path.read_bytes())
    if how == "truncate":
        path.write_bytes(bytes(data[: len(data) // 2]))
    elif how == "delete":
        path.unlink()
    elif how == "header_flip":   # one bit of the second member's name (its header checksum no longer matches)
        data[1024 + 3] ^= 0x10
        path.write_bytes(bytes(data))
    elif how == "garbage":       # same size, not a tar at all
        path.write_bytes(bytes(range(256)) * (len(data) // 256) + bytes(len(data) % 256))
    elif how == "other_shard":   # same size, the samples of another shard (keys outside this one's range)
        path.write_bytes(other.read_bytes())


@pytest.mark.parametrize("how", ["truncate", *[pytest.param(h, marks=SWEEP)
                                               for h in ("delete", "header_flip", "garbage", "other_shard")]])
def test_shard_corrupted_while_training_fails_naming_it(train_shards, train_base, tmp_path, how):
    """The run freezes itself after step 2 (fault action `stop`); the test damages a shard the run has
    already checked at start-up and finished reading for epoch 0; epoch 1 (step 7) must stop naming it."""
    import shutil

    shards = tmp_path / "shards"
    shutil.copytree(train_shards, shards)
    run_dir = tmp_path / "run"
    proc = start("dit-train", train_args(shards, run_dir, **{"shuffle-buffer": 64}), fault="train.step_end@2:stop")
    try:
        wait_stopped(proc)
        _corrupt(shards / "shard-000001.tar", how, shards / "shard-000000.tar")
    finally:
        proc.send_signal(signal.SIGCONT)
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 1, err[-3000:]
    assert "Traceback" not in err and "shard-000001.tar" in err and "--skip-bad-shards" in err, err[-3000:]
    assert "step 7" in err, err[-3000:]
    ckpts = CheckpointManager(run_dir / "checkpoints")
    assert ckpts.steps() == [2, 4, 6] and load_checkpoint(ckpts.latest())["step"] == 6
