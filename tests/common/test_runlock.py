"""The run folder's lease (common/runlock.py) with real processes: a live holder is named and refused, a
killed holder never blocks the resume, a holder on another host is trusted until its heartbeat lapses."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from dit_pipeline.common.runlock import LOCK_NAME, RunFolderBusy, RunLock
from tests._util import REPO

HOLD = ("import sys, time; from dit_pipeline.common.runlock import RunLock; "
        "lock = RunLock(sys.argv[1], 'dit-train', lease_s=float(sys.argv[2])).acquire(); print('held', flush=True); "
        "sys.stdin.read(); lock.release()")


def _holder(run_dir, lease_s: float = 120.0) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir), str(lease_s)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True, cwd=REPO)
    assert p.stdout.readline() == "held\n"
    return p


def _wait_until(cond, timeout: float = 60.0) -> bool:
    end = time.monotonic() + timeout  # a hang guard only
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.05)
    return False


def test_a_live_holder_is_named_and_refused_then_released(tmp_path):
    p = _holder(tmp_path)
    try:
        rec = json.loads((tmp_path / LOCK_NAME).read_text())
        with pytest.raises(RunFolderBusy) as e:
            RunLock(tmp_path, "dit-train").acquire()
        assert str(e.value).startswith(f"{tmp_path} is in use by another live run (dit-train on host "
                                       f"{socket.gethostname()}, pid {p.pid}, started {rec['started']}); ")
    finally:
        p.communicate("", timeout=60)
    assert p.returncode == 0 and not (tmp_path / LOCK_NAME).exists()
    with RunLock(tmp_path, "dit-train") as lock:
        assert lock.warning is None


def test_a_killed_holder_never_blocks_the_resume(tmp_path):
    p = _holder(tmp_path)
    os.kill(p.pid, signal.SIGKILL)
    p.wait(timeout=60)
    with RunLock(tmp_path, "dit-train") as lock:
        assert lock.warning.startswith("took over the run folder's lock from an earlier run that is not running any "
                                       f"more (its process is gone: dit-train on host {socket.gethostname()}, "
                                       f"pid {p.pid}, ")
        assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    assert not (tmp_path / LOCK_NAME).exists()


def _foreign_lock(run_dir, heartbeat_age: float) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / LOCK_NAME).write_text(json.dumps({
        "what": "dit-train", "host": "other-node-17", "pid": 4321, "proc_start": "99", "started": "then",
        "token": "t", "lease_s": 120.0, "heartbeat": time.time() - heartbeat_age}))


def test_a_holder_on_another_host_is_trusted_until_its_heartbeat_lapses(tmp_path):
    _foreign_lock(tmp_path, heartbeat_age=5)
    with pytest.raises(RunFolderBusy, match=r"\(dit-train on host other-node-17, pid 4321, started then\)"):
        RunLock(tmp_path, "dit-train").acquire()
    _foreign_lock(tmp_path, heartbeat_age=500)
    with RunLock(tmp_path, "dit-train") as lock:
        assert lock.warning.startswith("took over the run folder's lock from an earlier run that is not running any "
                                       "more (no heartbeat for 50")
        assert lock.warning.endswith("dit-train on host other-node-17, pid 4321, started then)")


def test_the_heartbeat_renews_the_lease_and_a_new_holder_is_never_overwritten(tmp_path):
    lock = RunLock(tmp_path, "dit-train", lease_s=0.6).acquire()
    first = json.loads((tmp_path / LOCK_NAME).read_text())["heartbeat"]
    assert _wait_until(lambda: json.loads((tmp_path / LOCK_NAME).read_text())["heartbeat"] > first)
    _foreign_lock(tmp_path, heartbeat_age=0)  # as if another run had taken over after a stall
    time.sleep(0.5)  # several beat periods: the old holder must see the new token and stop writing
    lock.release()
    assert json.loads((tmp_path / LOCK_NAME).read_text())["host"] == "other-node-17"
