"""`srun dit-train` without torchrun, for real: two processes on this host with the environment srun gives
its tasks form ONE 2-rank job (not two rank-0 runs into one folder), and the run folder's lease refuses a
second live run."""
from __future__ import annotations

import subprocess

from dit_pipeline.train.checkpoint import CheckpointManager, load_checkpoint
from dit_pipeline.train.metrics import read_metrics
from tests._util import BIN, cli_env, free_port, srun_task_env
from tests.train.conftest import tiny_args


def test_srun_tasks_train_as_one_job(shard_dir, tmp_path):
    run_dir = tmp_path / "run"
    args = tiny_args(shard_dir, run_dir, **{"max-steps": 4, "num-workers": 1, "micro-batch-size": 2})
    port = free_port()
    procs = [subprocess.Popen([str(BIN / "dit-train"), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=cli_env(srun_task_env(r, 2, port))) for r in (0, 1)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    ck = load_checkpoint(CheckpointManager(run_dir / "checkpoints").latest())
    assert ck["step"] == 4 and ck["data"]["world_size"] == 2 and ck["data"]["accum"] == 2
    assert sorted(r["step"] for r in read_metrics(run_dir) if "loss" in r) == [1, 2, 3, 4]  # one writer
    for rank in (0, 1):
        assert any("loss" in r for r in read_metrics(run_dir / "logs" / f"rank{rank}.jsonl"))
    log = (run_dir / "log.txt").read_text()
    assert f"launcher: srun, 2 rank(s), 2 on this node, rendezvous localhost:{port}" in log
    assert not (run_dir / "run.lock").exists()  # released at the end


def test_a_second_live_run_on_the_same_folder_is_refused(shard_dir, tmp_path):
    from dit_pipeline.common.runlock import RunLock

    run_dir = tmp_path / "run"
    with RunLock(run_dir, "dit-train") as held:  # this test process plays the live run
        res = subprocess.run([str(BIN / "dit-train"), *tiny_args(shard_dir, run_dir, **{"max-steps": 1})],
                             capture_output=True, text=True, env=cli_env(), timeout=300)
        rec = held._record
    assert res.returncode == 1
    assert res.stderr.strip().splitlines()[-1] == (
        f"error: {run_dir} is in use by another live run (dit-train on host {rec['host']}, pid {rec['pid']}, "
        f"started {rec['started']}); stop it first or use another --run-dir (a run that died releases its lock "
        f"run.lock at once on the same host, else after 120 s without a heartbeat)")
    assert not (run_dir / "checkpoints").exists() or not any((run_dir / "checkpoints").iterdir())
