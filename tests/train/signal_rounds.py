"""One round of "signal the whole process group of a real dit-train" (what scancel, preemption and Ctrl-C
in a terminal do), shared by the fast tests (tests/train/test_signals.py) and the randomized sweep
(tests/reliability/test_group_signals.py); `signal_group_at` does it for any command at a fault point."""
from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from dit_pipeline.train.checkpoint import CheckpointManager
from dit_pipeline.train.metrics import read_metrics
from tests._util import BIN, cli_env
from tests.train.conftest import tiny_args

HANG_GUARD_S = 180  # not a timing requirement: only stops a hung round from blocking the suite


@dataclasses.dataclass
class Round:
    returncode: int
    stderr: str
    steps_logged: int  # the highest step in metrics.jsonl (0: none ran)
    checkpoint_step: int | None
    survivors: list[int]
    seconds_after_signal: float


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of process group `pgid`."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[-1].split()
            except OSError:
                continue
            if fields[2] == str(pgid) and fields[0] != "Z":
                out.append(int(entry.name))
    return out


def survivors_of(pgid: int) -> list[int]:
    """The processes of group `pgid` still alive a minute after its leader ended (given that long to go)."""
    deadline = time.monotonic() + 60
    while (survivors := group_members(pgid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return survivors


def start(shard_dir: Path, run_dir: Path, *, env: dict | None = None, **overrides) -> subprocess.Popen:
    opts = {"max-steps": 400, "num-workers": 2, "ckpt-every": 3, **overrides}
    return subprocess.Popen([str(BIN / "dit-train"), *tiny_args(shard_dir, run_dir, **opts)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=cli_env(env), start_new_session=True)


def finish(proc: subprocess.Popen, run_dir: Path, signalled_at: float) -> Round:
    _, err = proc.communicate(timeout=HANG_GUARD_S)
    seconds = time.monotonic() - signalled_at
    survivors = survivors_of(proc.pid)
    steps = [r["step"] for r in read_metrics(run_dir) if "loss" in r]
    latest = CheckpointManager(run_dir / "checkpoints").latest() if (run_dir / "checkpoints").is_dir() else None
    step = int(latest.name.split("-")[1].split(".")[0]) if latest else None
    return Round(proc.returncode, err, max(steps, default=0), step, survivors, seconds)


@dataclasses.dataclass
class Signalled:
    returncode: int
    stdout: str
    stderr: str
    survivors: list[int]


def signal_group_at(cmd: str, args: list[str], fault: str, sig: signal.Signals, *,
                    env: dict | None = None) -> Signalled:
    """Run console script `cmd` in its own process group, freeze its main process at fault point `fault`
    (DIT_FAULT's stop action; its loader workers keep running), send `sig` to the whole group, let it go on,
    and wait for it: the group's processes still alive a minute later are the survivors."""
    proc = subprocess.Popen([str(BIN / cmd), *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=cli_env({**(env or {}), "DIT_FAULT": f"{fault}:stop"}),
                            start_new_session=True)
    try:
        wait_stopped(proc.pid)
    except (TimeoutError, OSError):
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"{cmd} never reached {fault}: {err[-3000:]}") from None
    os.killpg(proc.pid, sig)
    os.killpg(proc.pid, signal.SIGCONT)
    out, err = proc.communicate(timeout=HANG_GUARD_S)
    return Signalled(proc.returncode, out, err, survivors_of(proc.pid))


def signal_group_after(proc: subprocess.Popen, delay_s: float, sig: signal.Signals = signal.SIGTERM) -> float:
    time.sleep(delay_s)
    t = time.monotonic()
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass
    return t


def wait_stopped(pid: int, timeout: float = HANG_GUARD_S) -> None:
    """Wait until `pid` is in state T (it SIGSTOPped itself at a fault point)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0] == "T":
            return
        time.sleep(0.05)
    raise TimeoutError(f"process {pid} never stopped at its fault point")


def cpu_burners(n: int) -> list[subprocess.Popen]:
    """n busy processes beside the run (the load of a shared node)."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def wait_for_step(run_dir: Path, step: int) -> None:
    """Wait until metrics.jsonl holds step `step` (or a later one)."""
    end = time.monotonic() + HANG_GUARD_S
    while time.monotonic() < end:
        if any(r.get("step", 0) >= step for r in read_metrics(run_dir)):
            return
        time.sleep(0.05)
    raise TimeoutError(f"no step {step} in {run_dir}")
