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

Keyed points (`fault_at(name, index)`) count nothing: "<name>@<k>" fires every time the caller reaches index
k (an optimizer step, a data batch), in every process and after every restart, so a fault can recur after a
resume or a rollback exactly as a real one tied to that step or batch would; several items may name the same
point ("train.nan_step@5,train.nan_step@6"). The divergence-guard tests use `train.nan_step`,
`train.nan_batch`, `train.spike_step` and `train.spike_batch` (train/guard.py).
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


def fault_at(name: str, index: int) -> bool:
    """True when DIT_FAULT names `name@index` (a keyed point: nothing is counted) on this rank."""
    raw = os.environ.get("DIT_FAULT", "")
    if not raw or not _rank_matches():
        return False
    for item in filter(None, (s.strip() for s in raw.split(","))):
        point, _, nth = item.partition(":")[0].partition("@")
        if point == name and nth and int(nth) == index:
            return True
    return False


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
