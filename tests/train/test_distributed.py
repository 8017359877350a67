"""Multi-process training for real (gloo, CPU): the --nproc-per-node launcher running 2 ranks, a 2-node x 1
process torchrun with c10d rendezvous on localhost (identical to the 2-rank run), NaN on one rank, a signal
on one rank, a dying rank, and resuming with another world size."""
from __future__ import annotations

import shutil
import signal
import subprocess
import time

import pytest
import torch

from dit_pipeline.common.errors import UserError
from tests._util import BIN, cli_env, free_port, make_tiny_vae, run_cli, run_torchrun, torchrun_cmd
from tests.train.conftest import tiny_args
from dit_pipeline.train.checkpoint import CheckpointManager, load_checkpoint
from dit_pipeline.train.metrics import read_metrics

DDP = {"max-steps": 4, "num-workers": 1, "micro-batch-size": 2}  # 2 ranks x micro 2 x accum 2 = 8


def _rank_records(run_dir, rank):
    return read_metrics(run_dir / "logs" / f"rank{rank}.jsonl")


@pytest.fixture(scope="module")
def ddp_run(shard_dir, tiny_vae_dir, tmp_path_factory):
    """With sample grids on (rank 0 draws them; the 2-node run below has none and must match exactly)."""
    run_dir = tmp_path_factory.mktemp("ddp") / "run"
    grids = {"sample-every": 2, "vae": tiny_vae_dir, "sample-steps": 5, "sample-classes": "0,1"}
    r = run_cli("dit-train", ["--nproc-per-node", "2", *tiny_args(shard_dir, run_dir, **DDP, **grids)], timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return run_dir


def test_two_ranks_agree_and_log_the_mean_loss(ddp_run):
    recs = {r["step"]: r for r in read_metrics(ddp_run)}
    assert sorted(recs) == [1, 2, 3, 4]
    ranks = [{r["step"]: r for r in _rank_records(ddp_run, k) if "loss" in r} for k in (0, 1)]
    for step, rec in recs.items():
        mean = (ranks[0][step]["loss"] + ranks[1][step]["loss"]) / 2
        assert rec["loss"] == pytest.approx(mean, rel=1e-6, abs=1e-7)  # all ranks, not rank 0 or a sum
        assert ranks[0][step]["loss"] != ranks[1][step]["loss"]  # the ranks did see different data
    prints = [{r["step"]: r["weights_fingerprint"] for r in _rank_records(ddp_run, k) if "weights_fingerprint" in r}
              for k in (0, 1)]
    assert prints[0] == prints[1] and sorted(prints[0]) == [2, 4]  # identical weights on both ranks
    ck = load_checkpoint(CheckpointManager(ddp_run / "checkpoints").latest())
    assert ck["data"]["world_size"] == 2 and ck["data"]["accum"] == 2 and ck["step"] == 4
    assert sorted(p.name for p in (ddp_run / "samples").iterdir()) == ["step-0000002.png", "step-0000004.png"]


def test_two_nodes_c10d_rendezvous_matches_the_two_rank_run(ddp_run, shard_dir, tmp_path):
    run_dir = tmp_path / "run"
    port = free_port()
    args = tiny_args(shard_dir, run_dir, **DDP)
    procs = [subprocess.Popen(torchrun_cmd("dit-train", args, 1, nnodes=2, node_rank=n, port=port),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=cli_env())
             for n in (0, 1)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][1][-2000:] + outs[1][1][-2000:]
    assert read_metrics(run_dir) and [
        {k: r[k] for k in ("step", "loss", "mse", "vb", "grad_norm")} for r in read_metrics(run_dir)] == [
        {k: r[k] for k in ("step", "loss", "mse", "vb", "grad_norm")} for r in read_metrics(ddp_run)]
    a = load_checkpoint(CheckpointManager(run_dir / "checkpoints").latest())
    b = load_checkpoint(CheckpointManager(ddp_run / "checkpoints").latest())
    assert all(torch.equal(a["ema"][k], b["ema"][k]) for k in a["ema"])


def test_nan_on_one_rank_stops_every_rank_before_the_update(shard_dir, tmp_path):
    run_dir = tmp_path / "run"
    r = run_torchrun("dit-train", tiny_args(shard_dir, run_dir, **{**DDP, "max-steps": 6}),
                     env={"DIT_FAULT": "train.nan@3", "DIT_FAULT_RANK": "1"}, timeout=300)
    assert r.returncode != 0
    msg = "step 3: non-finite loss or gradient on rank(s) [1]"
    assert r.stderr.count(msg) == 2, r.stderr[-3000:]  # both ranks stop with the same message
    assert "stopped before the optimizer update" in r.stderr and "step-0000002.pt) is intact" in r.stderr
    assert CheckpointManager(run_dir / "checkpoints").steps() == [2]
    assert [rec["step"] for rec in read_metrics(run_dir)] == [1, 2]


def test_a_hook_failing_its_setup_on_rank_0_stops_every_rank_before_the_first_step(shard_dir, tmp_path):
    vae = make_tiny_vae(tmp_path / "vae8", latent_channels=8)  # loads fine; does not fit 4-channel latents
    run_dir = tmp_path / "run"
    r = run_torchrun("dit-train", tiny_args(shard_dir, run_dir, **DDP, **{"sample-every": 2, "vae": vae}),
                     timeout=300)
    assert r.returncode != 0
    assert "has 8 latent channels but the model trains on 4-channel latents" in r.stderr, r.stderr[-3000:]
    assert "[rank 1] error: stopping: a periodic hook (e.g. --sample-every) failed its setup on another rank" \
        in r.stderr
    assert read_metrics(run_dir) == [] and CheckpointManager(run_dir / "checkpoints").steps() == []


def test_signal_on_one_rank_checkpoints_on_all_and_exits_zero(shard_dir, tmp_path):
    run_dir = tmp_path / "run"
    r = run_torchrun("dit-train", tiny_args(shard_dir, run_dir, **{**DDP, "max-steps": 6, "ckpt-every": 100}),
                     env={"DIT_FAULT": "train.step_end@2:usr1", "DIT_FAULT_RANK": "1"}, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "stopped at step 2" in r.stderr
    assert CheckpointManager(run_dir / "checkpoints").steps() == [2]


def test_sigterm_to_the_launcher_checkpoints_on_every_rank_and_exits_zero(shard_dir, tmp_path):
    run_dir = tmp_path / "run"
    args = tiny_args(shard_dir, run_dir, **{**DDP, "max-steps": 100000, "ckpt-every": 100000, "quiet": None})
    proc = subprocess.Popen([str(BIN / "dit-train"), "--nproc-per-node", "2", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=cli_env())
    try:
        deadline = time.monotonic() + 240
        while not read_metrics(run_dir) and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)  # wait until training runs; the assertions below do not depend on timing
        assert read_metrics(run_dir), "training did not start"
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, out[-3000:]
    steps = CheckpointManager(run_dir / "checkpoints").steps()
    assert len(steps) == 1 and f"stopped on SIGTERM at step {steps[0]}" in (run_dir / "log.txt").read_text()
    prints = [{r["step"]: r["weights_fingerprint"] for r in _rank_records(run_dir, k) if "weights_fingerprint" in r}
              for k in (0, 1)]
    assert prints[0] == prints[1] and list(prints[0]) == steps  # both ranks took part in the final save


def test_a_dying_rank_makes_the_others_exit_naming_it(shard_dir, tmp_path):
    run_dir = tmp_path / "run"
    r = run_torchrun("dit-train", tiny_args(shard_dir, run_dir, **{**DDP, "max-steps": 6}),
                     env={"DIT_FAULT": "train.step_end@2:exit", "DIT_FAULT_RANK": "1"}, timeout=180)
    assert r.returncode != 0
    root = r.stderr[r.stderr.index("Root Cause"):]
    assert "rank      : 1" in root and "exitcode  : 17" in root  # torchrun names the rank that died
    assert "[rank 0] error: rank 0: the pre-step all-reduce at step 3 failed" in r.stderr
    assert "[rank0]: Traceback" not in r.stderr  # the survivor says what happened in one line


def test_resume_with_another_world_size(ddp_run, shard_dir, tmp_path):
    from dit_pipeline.train import merge_config, run

    run_dir = tmp_path / "run"
    shutil.copytree(ddp_run, run_dir)
    base = {"shards": str(shard_dir), "run_dir": str(run_dir), "model": "DiT-S/2", "depth": 2, "hidden_size": 32,
            "num_heads": 2, "global_batch_size": 8, "micro_batch_size": 4, "num_workers": 1, "lr": 1e-3,
            "log_every": 1, "ckpt_every": 2, "quiet": True}
    with pytest.raises(UserError, match="trained with --global-batch-size 8, this run asks for 16"):
        run(merge_config({}, {**base, "global_batch_size": 16, "max_steps": 6}))
    assert run(merge_config({}, {**base, "max_steps": 6})) == "done"
    log = (run_dir / "log.txt").read_text()
    assert "resuming with a different data layout (world_size 2 -> 1, micro_batch 2 -> 4)" in log
    assert "no longer identical" in log
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2, 3, 4, 5, 6]
    # epoch 0 (7 steps), begun at 2 ranks, is read to its end as those ranks read it (train/handover.py): its
    # checkpoints record that layout; from epoch 1 on the run reads and records its own
    assert load_checkpoint(CheckpointManager(run_dir / "checkpoints").latest())["data"]["world_size"] == 2
    assert run(merge_config({}, {**base, "max_steps": 8})) == "done"
    ck = load_checkpoint(CheckpointManager(run_dir / "checkpoints").latest())
    assert (ck["step"], ck["epoch"], ck["data"]["world_size"]) == (8, 1, 1)
