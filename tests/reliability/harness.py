"""Machinery of the reliability suite: run the real CLIs in subprocesses with injected faults, and check the
guarantees of RELIABILITY.md afterwards.

Faults are deterministic (common.faults: `DIT_FAULT="<point>@<n>:<action>"`, `DIT_FAULT_RANK`), a full disk
is a real `RLIMIT_FSIZE` set in the child before it starts (Python ignores SIGXFSZ, so a write past the
limit fails with EFBIG exactly like one on a full disk), and the sweep's "random" points come from seeded
generators, so every failure reproduces from its test id. `COUNTS` tallies faults injected and bad inputs
tried; conftest.py prints the totals at the end of the session (they go into docs/RELIABILITY.md).
"""
from __future__ import annotations

import hashlib
import os
import random
import resource
import subprocess
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import pytest

from tests._util import BIN, cli_env, torchrun_cmd

SWEEP = pytest.mark.reliability  # the full sweep: `make test-reliability`; unmarked cases run in `make test`
COUNTS: Counter[str] = Counter()  # "faults": faults injected; "inputs": bad inputs tried
# Upper bound for any one command here; a run that hangs (e.g. a survivor waiting for a dead rank) fails
# the test through subprocess's TimeoutExpired instead of hanging the suite.
TIMEOUT_S = 240


@dataclass
class Result:
    rc: int
    out: str
    err: str
    wall_s: float

    @property
    def text(self) -> str:
        return self.out + self.err


def _limit_file_size(nbytes: int):
    def apply() -> None:  # runs in the child between fork and exec
        resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, nbytes))
    return apply


def command(cmd: str, args: Sequence[object], nproc: int = 1) -> list[str]:
    """argv of a console script of this venv, under torchrun (gloo) with `nproc` > 1 ranks."""
    if nproc > 1:
        return torchrun_cmd(cmd, args, nproc)
    return [str(BIN / cmd), *map(str, args)]


def fault_env(fault: str | None = None, rank: int | None = None, env: dict | None = None) -> dict:
    extra = dict(env or {})
    if fault:
        extra["DIT_FAULT"] = fault
        COUNTS["faults"] += len([f for f in fault.split(",") if f.strip()])
    if rank is not None:
        extra["DIT_FAULT_RANK"] = str(rank)
    return cli_env(extra)


def run(cmd: str, args: Sequence[object], *, fault: str | None = None, rank: int | None = None,
        fsize: int | None = None, nproc: int = 1, env: dict | None = None, timeout: float = TIMEOUT_S) -> Result:
    """Run `cmd args` to completion (optionally with a fault, a file size limit, or as `nproc` ranks)."""
    if fsize is not None:
        COUNTS["faults"] += 1
    t0 = time.monotonic()
    p = subprocess.run(command(cmd, args, nproc), capture_output=True, text=True, env=fault_env(fault, rank, env),
                       timeout=timeout, preexec_fn=_limit_file_size(fsize) if fsize is not None else None)
    return Result(p.returncode, p.stdout, p.stderr, time.monotonic() - t0)


IN_PROCESS = {"dit-shards": "shards_main"}  # commands run_in_process can call (their click group in cli.py)


def run_in_process(cmd: str, args: Sequence[object]) -> Result:
    """`cmd args` through its click command in this process (CliRunner): the same parsing, error handling, exit
    code and output as the installed script, without a Python start-up and torch import per case. An exception
    that escapes the command (which the script would print as a traceback) is returned in the output, so
    assert_clean_error fails on it as on the script's traceback."""
    import traceback

    from click.testing import CliRunner

    from dit_pipeline import cli

    try:
        runner = CliRunner(mix_stderr=False)  # type: ignore[call-arg]  # click < 8.2
    except TypeError:
        runner = CliRunner()  # click >= 8.2 keeps stderr apart
    t0 = time.monotonic()
    r = runner.invoke(getattr(cli, IN_PROCESS[cmd]), [str(a) for a in args], catch_exceptions=True)
    err = r.stderr
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        err += "".join(traceback.format_exception(r.exception))
    return Result(r.exit_code, r.stdout, err, time.monotonic() - t0)


def run_cli_case(request: pytest.FixtureRequest, cmd: str, args: Sequence[object]) -> Result:
    """One bad-input case through `cmd`: as a script (a process of its own) in the full sweep (`make
    test-reliability`), in this process in `make test`, where each case's start-up would cost more than its
    check."""
    if request.config.getoption("--run-reliability"):
        return run(cmd, args)
    return run_in_process(cmd, args)


def start(cmd: str, args: Sequence[object], *, fault: str | None = None, env: dict | None = None
          ) -> subprocess.Popen:
    """Start `cmd args` in the background (for faults that need the test to act while it runs)."""
    return subprocess.Popen(command(cmd, args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=fault_env(fault, None, env))


def wait_stopped(proc: subprocess.Popen, timeout: float = TIMEOUT_S) -> None:
    """Block until `proc` has stopped itself (fault action `stop`): its /proc state is T."""
    deadline = time.monotonic() + timeout
    stat = Path(f"/proc/{proc.pid}/stat")
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"process exited ({proc.returncode}) before its stop point: "
                                 f"{proc.stderr.read()[-3000:] if proc.stderr else ''}")
        if stat.read_text().rsplit(")", 1)[-1].split()[0] == "T":
            return
        time.sleep(0.02)
    raise AssertionError("process did not reach its stop point")


def tried(n: int = 1) -> None:
    """Count bad inputs tried."""
    COUNTS["inputs"] += n


def picks(seed: int, population: Sequence, k: int) -> list:
    """k distinct elements of population, chosen by a generator seeded with `seed` (in population order)."""
    chosen = set(random.Random(seed).sample(range(len(population)), min(k, len(population))))
    return [population[i] for i in sorted(chosen)]


def sweep_points(seed: int, population: Sequence, k: int) -> list:
    """The fault points a sweep visits: k seeded picks, or all of them with DIT_RELIABILITY_EXHAUSTIVE=1
    (every point of every run; about three times as long)."""
    if os.environ.get("DIT_RELIABILITY_EXHAUSTIVE") == "1":
        return list(population)
    return picks(seed, population, k)


# ----------------------------------------------------------------------------------------------------------
# Checks

def assert_clean_error(r: Result, *needles: str, code: int = 1) -> None:
    """RELIABILITY.md's clear error: the exit code, the message parts, and no Python traceback."""
    assert r.rc == code, f"exit {r.rc}, expected {code}:\n{r.err[-3000:]}"
    assert "Traceback" not in r.text, r.text[-3000:]
    for n in needles:
        assert n in r.text, f"{n!r} not in:\n{r.text[-3000:]}"


def file_hashes(folder: Path, pattern: str = "**/*") -> dict[str, str]:
    """relative path -> sha256 of every file under `folder` matching `pattern`."""
    folder = Path(folder)
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.glob(pattern)) if p.is_file()}


def temp_files(folder: Path) -> list[str]:
    """Temp files of interrupted atomic writes (`.tmp-*`) anywhere under `folder`."""
    return sorted(p.relative_to(folder).as_posix() for p in Path(folder).rglob(".tmp-*"))
