"""`dit-train --nproc-per-node N`: re-execute the same command under `torch.distributed.run` (torchrun).

A convenience for the single-node case; torchrun does the real work (rendezvous on a free local port, one
process per GPU, and when one rank dies it stops the others and reports the failed rank with its exit code).
The launcher flag is removed from the child command line, and the children recognise that they already run
under a launcher from torchrun's environment (LOCAL_RANK), so they never launch again.
"""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import NoReturn, Sequence

LAUNCHER_FLAGS = ("--nproc-per-node", "--nproc_per_node")


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
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            script, *strip_launcher_flag(args)]


def relaunch(nproc: int, args: Sequence[str]) -> NoReturn:
    """Replace this process by torchrun running `nproc` ranks of the same command (signals go to torchrun)."""
    cmd = launch_command(nproc, args)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(cmd[0], cmd)
