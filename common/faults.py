"""Deterministic fault injection, for the reliability tests (no sleeps, no races).

Code marks interesting moments with `fault_point("name")` (e.g. "extract.shard_mid_write",
"train.ckpt_mid_save"). Nothing happens unless the environment asks for it:

    DIT_FAULT="<name>[@<n>][:<action>]"     several separated by ","
    DIT_FAULT_RANK=<r>                       only on this global rank (default: every rank)

The n-th time (1-based, default 1) this process reaches the named point it performs the action:
`kill` (SIGKILL itself, the default: like the OOM killer or a node loss), `term` (SIGTERM itself, like
cluster preemption), `usr1` (SIGUSR1), `exit` (os._exit(17): a crashed rank), `enospc` (raise
OSError(ENOSPC): a full disk), `erofs` (raise OSError(EROFS): a read-only mount), or `stop` (SIGSTOP itself: the process freezes there until a test has
changed something, e.g. corrupted a shard, and sends SIGCONT). `nan` is handled by the caller through
`fault_requested(name)`.
"""
from __future__ import annotations

import errno
import os
import signal
from collections import Counter

_counts: Counter[str] = Counter()


def _spec() -> dict[str, tuple[int, str]]:
    raw = os.environ.get("DIT_FAULT", "")
    out: dict[str, tuple[int, str]] = {}
    for item in filter(None, (s.strip() for s in raw.split(","))):
        name, _, action = item.partition(":")
        name, _, nth = name.partition("@")
        out[name] = (int(nth) if nth else 1, action or "kill")
    return out


def _rank_matches() -> bool:
    want = os.environ.get("DIT_FAULT_RANK")
    return want in (None, "") or want == os.environ.get("RANK", "0")


def fault_requested(name: str) -> bool:
    """True exactly when this call is the requested occurrence of `name` (counts the call)."""
    if "DIT_FAULT" not in os.environ:
        return False
    spec = _spec().get(name)
    if spec is None or not _rank_matches():
        return False
    _counts[name] += 1
    return _counts[name] == spec[0]


def fault_point(name: str) -> None:
    """Perform the configured fault if this is the requested occurrence of `name`; else nothing."""
    if "DIT_FAULT" not in os.environ:
        return
    spec = _spec().get(name)
    if spec is None or not fault_requested(name):
        return
    action = spec[1]
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "term":
        os.kill(os.getpid(), signal.SIGTERM)
    elif action == "usr1":
        os.kill(os.getpid(), signal.SIGUSR1)
    elif action == "exit":
        os._exit(17)
    elif action == "enospc":
        raise OSError(errno.ENOSPC, f"No space left on device (injected at {name})")
    elif action == "erofs":
        raise OSError(errno.EROFS, "Read-only file system")
    elif action == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    else:
        raise ValueError(f"DIT_FAULT: unknown action {action!r} for {name!r}")
