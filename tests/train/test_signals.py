"""Signals to the whole process group of a real dit-train with 2 loader workers (what scancel, preemption and
Ctrl-C in a terminal do): SIGTERM and a first Ctrl-C finish the step, checkpoint and exit 0; a second Ctrl-C
aborts saying what is lost; no traceback, no process left. The randomized version is
tests/reliability/test_group_signals.py."""
from __future__ import annotations

import os
import signal
import time

import pytest

from tests.train.signal_rounds import finish, start, wait_for_step, wait_stopped

FIRST_CTRL_C = ("Ctrl-C: finishing the current step, writing a checkpoint and exiting (Ctrl-C again aborts at once, "
                "losing the steps since the last checkpoint)")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "ctrl-c"])
def test_signal_to_the_group_checkpoints_exits_zero_and_leaves_no_process(shard_dir, tmp_path, sig):
    run_dir = tmp_path / "run"
    proc = start(shard_dir, run_dir)
    wait_for_step(run_dir, 2)
    os.killpg(proc.pid, sig)
    r = finish(proc, run_dir, time.monotonic())
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.survivors == []
    assert r.steps_logged >= 2 and r.checkpoint_step == r.steps_logged  # the last step ran is saved
    assert "Traceback" not in r.stderr and "exited unexpectedly" not in r.stderr
    log = (run_dir / "log.txt").read_text()
    assert f"stopped on {sig.name} at step {r.steps_logged} " in log
    assert (FIRST_CTRL_C in r.stderr) == (sig == signal.SIGINT)


def test_second_ctrl_c_aborts_at_once_saying_what_is_lost(shard_dir, tmp_path):
    """Deterministic: the run freezes itself after step 4 (the first Ctrl-C is sent then), and again inside the
    final checkpoint's write (the second Ctrl-C is sent then)."""
    run_dir = tmp_path / "run"
    proc = start(shard_dir, run_dir, env={"DIT_FAULT": "train.step_end@4:stop,train.ckpt_mid_save@2:stop"})
    wait_stopped(proc.pid)
    os.killpg(proc.pid, signal.SIGINT)
    os.kill(proc.pid, signal.SIGCONT)
    wait_stopped(proc.pid)
    os.killpg(proc.pid, signal.SIGINT)
    os.kill(proc.pid, signal.SIGCONT)
    r = finish(proc, run_dir, time.monotonic())
    assert r.returncode == 130, r.stderr[-3000:]
    assert FIRST_CTRL_C in r.stderr
    assert r.stderr.rstrip().splitlines()[-1] == ("aborted by a second Ctrl-C: the 1 step(s) since the last checkpoint "
                                                  "(step 3) are lost; rerun the same command to resume from it")
    assert "Traceback" not in r.stderr
    assert r.survivors == [] and r.steps_logged == 4 and r.checkpoint_step == 3
