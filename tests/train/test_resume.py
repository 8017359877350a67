"""Crash safety with real processes: N steps straight vs. SIGKILL after a step, SIGKILL in the middle of a
checkpoint save, and SIGTERM, each followed by rerunning the same command: identical losses, weights, EMA
and optimizer state. The runs use 3 loader workers and cross an epoch boundary, so the resumed data stream
(shuffle buffers, worker rotation, next epoch's shard order) is exercised too."""
from __future__ import annotations

import json
import signal

import pytest
import torch

from tests._util import run_cli
from tests.train.conftest import tiny_args
from dit_pipeline.train.checkpoint import CheckpointManager, load_checkpoint
from dit_pipeline.train.metrics import read_metrics

STEPS = 8


def _train(args, env=None):
    return run_cli("dit-train", args, env=env, timeout=300)


def _records(run_dir):
    return {r["step"]: (r["epoch"], r["loss"], r["mse"], r["vb"], r["grad_norm"]) for r in read_metrics(run_dir)}


def assert_same_run(a, b):
    ra, rb = _records(a), _records(b)
    assert sorted(ra) == list(range(1, STEPS + 1)) and ra == rb  # exact float equality of every logged value
    ca = load_checkpoint(CheckpointManager(a / "checkpoints").latest())
    cb = load_checkpoint(CheckpointManager(b / "checkpoints").latest())
    assert ca["step"] == cb["step"] == STEPS and ca["data"] == cb["data"]
    assert torch.equal(ca["rng"]["torch"], cb["rng"]["torch"])  # nothing draws from the global generator
    for key in ("model", "ema"):
        assert ca[key].keys() == cb[key].keys()
        for name in ca[key]:
            assert torch.equal(ca[key][name], cb[key][name]), f"{key}.{name} differs"
    for i, st in ca["opt"]["state"].items():
        for k, v in st.items():
            assert torch.equal(v, cb["opt"]["state"][i][k]), f"optimizer state {i}.{k} differs"
    ema_a = torch.load(a / "checkpoints" / f"step-{STEPS:07d}-ema.pt", weights_only=True)
    assert all(torch.equal(ema_a[k], cb["ema"][k]) for k in ema_a)


@pytest.fixture(scope="module")
def straight(shard_dir, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("straight") / "run"
    r = _train(tiny_args(shard_dir, run_dir))
    assert r.returncode == 0, r.stderr
    return run_dir


def test_straight_run_outputs(straight):
    recs = read_metrics(straight)
    assert [r["step"] for r in recs] == list(range(1, STEPS + 1))
    assert recs[0]["epoch"] == 0 and recs[-1]["epoch"] == 1  # 6 steps per epoch: crossed into epoch 1
    assert all(r["loss"] == pytest.approx(r["mse"] + r["vb"], rel=1e-5) for r in recs)
    assert CheckpointManager(straight / "checkpoints").steps() == [4, 6, 8]  # keep-last 3
    ck = load_checkpoint(straight / "checkpoints" / "step-0000008.pt")
    assert ck["model_config"]["depth"] == 2 and ck["latent"]["scaling_factor"] == 0.5
    assert ck["config"]["micro_batch_size"] == 4 and ck["data"]["workers"] == 3
    assert json.loads((straight / "config.json").read_text())["precision"] == "fp32"  # resolved from auto
    assert (straight / "config.json").is_file() and (straight / "log.txt").is_file()
    assert (straight / "logs" / "rank0.log").is_file()


@pytest.mark.determinism  # same world size, same threads per process (both runs are CLI processes)
def test_sigkill_sigterm_and_kill_during_save_then_resume_is_identical(straight, shard_dir, tmp_path):
    run_dir = tmp_path / "run"
    args = tiny_args(shard_dir, run_dir)
    ckpts = CheckpointManager(run_dir / "checkpoints")
    r = _train(args, env={"DIT_FAULT": "train.step_end@3:kill"})  # SIGKILL after step 3 (last save: 2)
    assert r.returncode == -signal.SIGKILL and ckpts.steps() == [2]
    r = _train(args, env={"DIT_FAULT": "train.ckpt_mid_save@1:kill"})  # SIGKILL while writing step 4
    assert r.returncode == -signal.SIGKILL, r.stderr
    assert "resumed from" in r.stderr and "at step 2" in r.stderr
    assert ckpts.steps() == [2] and load_checkpoint(ckpts.latest())["step"] == 2  # intact
    assert list(ckpts.folder.glob(".tmp-step-0000004.pt*"))  # the interrupted save's temp file
    # SIGTERM (preemption) after step 5 of the resumed run: finish the step, checkpoint, exit 0
    r = _train(args, env={"DIT_FAULT": "train.step_end@3:term"})
    assert r.returncode == 0, r.stderr
    assert "removed 1 partial checkpoint file" in r.stderr and not list(ckpts.folder.glob(".tmp-*"))
    assert "stopped on SIGTERM at step 5" in r.stderr and ckpts.steps() == [2, 4, 5]
    r = _train(args)
    assert r.returncode == 0 and "at step 5" in r.stderr, r.stderr
    assert_same_run(straight, run_dir)


def test_rerun_of_a_finished_run_does_nothing(straight, shard_dir):
    from dit_pipeline.train import merge_config, run

    cfg = merge_config({}, {"shards": str(shard_dir), "run_dir": str(straight), "max_steps": STEPS,
                            "global_batch_size": 8, "micro_batch_size": 4, "num_workers": 3, "model": "DiT-S/2",
                            "depth": 2, "hidden_size": 32, "num_heads": 2, "quiet": True})
    before = sorted(p.name for p in (straight / "checkpoints").iterdir())
    assert run(cfg) == "done"
    assert sorted(p.name for p in (straight / "checkpoints").iterdir()) == before
    assert "nothing to do" in (straight / "log.txt").read_text()
