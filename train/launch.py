"""`dit-train --nproc-per-node N`: run the same command as N local ranks under `torch.distributed.run`.

A convenience for the single-node case; torchrun does the real work (rendezvous on a free local port, one
process per GPU, and when one rank dies it stops the others and reports the failed rank with its exit code).
The launcher flag is removed from the child command line, and the children recognise that they already run
under a launcher from torchrun's environment (LOCAL_RANK), so they never launch again.

This process stays as the parent of torchrun and forwards SIGTERM/SIGUSR1 to the ranks themselves: each
rank finishes its step, they write a checkpoint and exit 0, and torchrun then exits 0 too. (Signalling
torchrun directly also makes the ranks checkpoint, but torchrun itself then exits 1.) torchrun runs through
train/torchrun.py, which names a failed rank and its signal in one line, also in RUN/log.txt.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Sequence

from dit_pipeline.train.signals import STOP_SIGNALS

LAUNCHER_FLAGS = ("--nproc-per-node", "--nproc_per_node")
LOG_ENV = "DIT_LAUNCH_LOG"  # the run's log, where train/torchrun.py appends the line naming a failed rank


def under_launcher() -> bool:
    """True inside a process started by torchrun (or another launcher that sets LOCAL_RANK)."""
    return "LOCAL_RANK" in os.environ or "TORCHELASTIC_RUN_ID" in os.environ


def strip_launcher_flag(args: Sequence[str]) -> list[str]:
    """`args` without `--nproc-per-node N` / `--nproc-per-node=N` (either spelling)."""
    out: list[str] = []
    skip = False
    for a in args:
        if skip:
            skip = False
            continue
        if a in LAUNCHER_FLAGS:
            skip = True
            continue
        if a.split("=", 1)[0] in LAUNCHER_FLAGS and "=" in a:
            continue
        out.append(a)
    return out


def _script(argv0: str, name: str) -> str:
    """The console script to run in each rank: this one when it is a file, else the venv's `name`."""
    p = Path(argv0)
    if p.is_file() and p.name == name:
        return str(p.resolve())
    beside = Path(sys.executable).parent / name
    if beside.is_file():
        return str(beside)
    found = shutil.which(name)
    if found is None:
        raise FileNotFoundError(f"cannot find the {name} console script to launch under torchrun")
    return found


def launch_command(nproc: int, args: Sequence[str], *, script_name: str = "dit-train",
                   argv0: str | None = None) -> list[str]:
    """argv that runs `script_name args` (launcher flag removed) as `nproc` local ranks under torchrun."""
    script = _script(argv0 if argv0 is not None else sys.argv[0], script_name)
    # torchrun itself, its failure said in one line (train/torchrun.py)
    return [sys.executable, "-m", "dit_pipeline.train.torchrun", "--standalone", f"--nproc-per-node={nproc}",
            script, *strip_launcher_flag(args)]


def _children(pid: int) -> list[int]:
    """Direct children of `pid` (Linux /proc scan; empty elsewhere)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            # the command name may contain spaces and parentheses: fields after the last ')' are fixed
            fields = stat.rsplit(")", 1)[-1].split()
            if len(fields) > 1 and fields[1] == str(pid):
                out.append(int(entry.name))
    return out


def launch(nproc: int, args: Sequence[str], log_file: str | os.PathLike | None = None) -> int:
    """Run torchrun with `nproc` ranks of the same command, forwarding stop signals to the ranks; returns
    torchrun's exit code. log_file: where the line naming a failed rank is appended (RUN/log.txt)."""
    cmd = launch_command(nproc, args)
    sys.stdout.flush()
    sys.stderr.flush()
    env = {**os.environ, **({LOG_ENV: str(log_file)} if log_file is not None else {})}
    proc = subprocess.Popen(cmd, env=env)

    def forward(signum: int, frame: object) -> None:
        ranks = _children(proc.pid)
        for pid in ranks or [proc.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

    previous = {s: signal.signal(s, forward) for s in STOP_SIGNALS}
    try:
        return proc.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
