"""A process of a real dit-train killed by SIGKILL (what the kernel's out-of-memory killer sends): a loader worker
(kill -9 of its pid while the trainer is frozen after step 3) and a whole rank of the --nproc-per-node launcher.
Each ends in one line naming the process and the signal with the likely cause, on stderr and in the run's
logs, exit status 1, no traceback; rerunning the same command resumes from the newest checkpoint."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time

import pytest

from dit_pipeline.train.checkpoint import CheckpointManager
from dit_pipeline.train.launch import _children
from dit_pipeline.train.metrics import read_metrics
from tests._util import BIN, cli_env, rank_pids, run_cli
from tests.train.conftest import tiny_args
from tests.train.signal_rounds import HANG_GUARD_S, survivors_of, wait_stopped

OOM = ("was killed by SIGKILL: most likely the kernel's out-of-memory killer (host memory, not GPU memory; `dmesg` "
       "names the process it killed): use fewer --num-workers")
RESUMES = "rerunning the same command resumes from the newest checkpoint"


def test_a_loader_worker_killed_by_sigkill_is_one_line_in_the_logs(shard_dir, tmp_path):
    run_dir = tmp_path / "run"
    args = tiny_args(shard_dir, run_dir, **{"max-steps": 8, "num-workers": 2, "ckpt-every": 3})
    proc = subprocess.Popen([str(BIN / "dit-train"), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=cli_env({"DIT_FAULT": "train.step_end@3:stop"}), start_new_session=True)
    wait_stopped(proc.pid)  # after step 3 and its checkpoint; the loader workers keep running
    workers = _children(proc.pid)
    assert len(workers) == 2
    os.kill(workers[0], signal.SIGKILL)
    os.kill(proc.pid, signal.SIGCONT)
    _, err = proc.communicate(timeout=HANG_GUARD_S)
    line = (f"loader worker (pid {workers[0]}) {OOM} (now 2) or a smaller --shuffle-buffer (now 1000); {RESUMES}")
    assert proc.returncode == 1, err[-3000:]
    assert err.rstrip().splitlines()[-1] == f"error: {line}"
    assert "Traceback" not in err and survivors_of(proc.pid) == []
    for log in (run_dir / "log.txt", run_dir / "logs" / "rank0.log"):
        assert log.read_text().rstrip().splitlines()[-1].endswith(f" ERROR {line}")
    assert CheckpointManager(run_dir / "checkpoints").latest().name == "step-0000003.pt"
    # the rerun resumes from it and finishes the run
    r = run_cli("dit-train", args)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resumes from {run_dir / 'checkpoints' / 'step-0000003.pt'} (step 3)" in (run_dir / "log.txt").read_text()
    steps = [row["step"] for row in read_metrics(run_dir) if "loss" in row]
    assert steps[-5:] == [4, 5, 6, 7, 8]


def test_a_rank_killed_by_sigkill_is_named_by_the_launcher(shard_dir, tmp_path):
    run_dir = tmp_path / "run"
    args = tiny_args(shard_dir, run_dir, **{"max-steps": 8, "num-workers": 1, "micro-batch-size": 2})
    proc = subprocess.Popen([str(BIN / "dit-train"), "--nproc-per-node", "2", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env=cli_env({"DIT_FAULT": "train.step_end@2:stop", "DIT_FAULT_RANK": "1"}))
    ranks: dict[int, int] = {}
    try:
        end = time.monotonic() + HANG_GUARD_S  # a hang guard only
        while len(ranks) < 2 and proc.poll() is None and time.monotonic() < end:
            time.sleep(0.1)
            ranks = {r: pid for launcher in _children(proc.pid) for r, pid in rank_pids(launcher).items()}
        wait_stopped(ranks[1])
        os.kill(ranks[1], signal.SIGKILL)
        _, err = proc.communicate(timeout=HANG_GUARD_S)
    finally:  # whatever failed: no process left (torchrun starts each rank in a session of its own)
        for pid in ranks.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    line = f"rank 1 (local rank 1, pid {ranks[1]}) {OOM} or a smaller --shuffle-buffer; {RESUMES}"
    assert proc.returncode == 1, err[-3000:]
    assert err.rstrip().splitlines()[-1] == f"error: {line}"
    # torchrun's own summary, without its traceback
    assert f"exitcode  : -9 (pid: {ranks[1]})" in err and "Signal 9 (SIGKILL) received by PID" in err
    assert "Traceback" not in err
    assert "[rank 0] error: rank 0: the " in err  # the survivor says in one line that it lost its peer
    log = (run_dir / "log.txt").read_text().rstrip().splitlines()
    assert log[-1].endswith(f" ERROR {line}")
    assert any("[rank 0] ERROR rank 0: the " in x and "most likely because another rank died" in x for x in log)


def test_the_lines_for_other_failures():
    """Units of train/failures.py: torch's other worker messages, a rank that exits with an error code, and the
    rank to name when several failed (the killed one, not those that lost it)."""
    from types import SimpleNamespace

    from dit_pipeline.train.failures import likely_cause, rank_death, root_failure, worker_death

    assert worker_death(ValueError("DataLoader worker (pid 1) is killed by signal: Killed.")) is None
    assert worker_death(RuntimeError("a gloo error")) is None
    assert worker_death(RuntimeError("DataLoader worker (pid 7) is killed by signal: Bus error. It is possible ...")) \
        == (f"loader worker (pid 7) was killed by SIGBUS: most likely out of shared memory (/dev/shm, where loader "
            f"workers pass batches): raise its size; {RESUMES}")
    assert worker_death(RuntimeError("DataLoader worker (pid(s) 8, 9) exited unexpectedly")) == (
        "loader workers (pids 8, 9) exited unexpectedly: if `dmesg` shows the out-of-memory killer, use fewer "
        f"--num-workers or a smaller --shuffle-buffer; {RESUMES}")
    cfg = SimpleNamespace(num_workers=8, shuffle_buffer=5000)
    assert worker_death(RuntimeError("DataLoader worker (pid 3) exited unexpectedly with exit code 1. Details are "
                                     "lost due to multiprocessing."), cfg) == (
        "loader worker (pid 3) exited unexpectedly with exit code 1: if `dmesg` shows the out-of-memory killer, use "
        f"fewer --num-workers (now 8) or a smaller --shuffle-buffer (now 5000); {RESUMES}")
    # torch's liveness check names only the pids; its frame holds the dead worker, whose exit code tells the signal
    # (which of torch's two checks sees a killed worker first is a race: the loaded-machine run of the test above)

    def try_get_data():  # the frame of torch.utils.data.dataloader's _try_get_data, as far as it matters here
        failed_workers = [SimpleNamespace(pid=5, exitcode=-9)]  # noqa: F841 (read from the traceback)
        raise RuntimeError("DataLoader worker (pid(s) 5) exited unexpectedly")

    with pytest.raises(RuntimeError) as e:
        try_get_data()
    assert worker_death(e.value) == (
        "loader worker (pid 5) was killed by SIGKILL: most likely the kernel's out-of-memory killer (host memory, not "
        f"GPU memory; `dmesg` names the process it killed): use fewer --num-workers or a smaller --shuffle-buffer; "
        f"{RESUMES}")
    assert likely_cause("SIGTERM") == "sent by another process or the scheduler"
    failed = {0: SimpleNamespace(local_rank=0, pid=10, exitcode=1, timestamp=100),
              1: SimpleNamespace(local_rank=1, pid=11, exitcode=-9, timestamp=101)}
    assert root_failure(failed) == (1, failed[1])  # killed, though torchrun saw rank 0 fail first
    assert rank_death(0, failed[0]) == "rank 0 (local rank 0, pid 10) exited with code 1: its error is above and in " \
                                       "RUN/logs/rank0.log"
    assert root_failure({0: failed[0]}) == (0, failed[0])
