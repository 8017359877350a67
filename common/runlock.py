"""A lease on a run folder: one live run writes it at a time, and a dead run never blocks its own resume.

dit-train leases its run folder (`RUN/run.lock`), dit-extract its output folder (`OUT/.extract.lock`, hidden
so that `dit-shards verify` and the output check ignore it). The holder creates the lock file with
`O_CREAT | O_EXCL` (atomic on local file systems and on NFSv3+; no reliance on flock/fcntl locks, which many
shared file systems do not honour) and writes its host, pid, process start time and a heartbeat into it; a
daemon thread renews the heartbeat every `lease_s / 6`.
Another run finding the file is refused with an error naming that holder, unless the lease has lapsed:
- the holder is on this host and its process (pid + start time) no longer exists (kill -9): taken over at
  once, with a warning;
- the heartbeat is older than `lease_s` (a dead node; clocks of a cluster's nodes agree to well under the
  lease): taken over, with a warning.
A takeover renames the stale file aside first, so of two runs racing for the same stale lease only one wins.
"""
from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from dit_pipeline.common.errors import UserError
from dit_pipeline.common.io import atomic_write_bytes

LOCK_NAME = "run.lock"
EXTRACT_LOCK_NAME = ".extract.lock"
DEFAULT_LEASE_S = 120.0


class RunFolderBusy(UserError):
    """Another live run holds the run folder's lease."""


def _proc_start(pid: int) -> str | None:
    """The kernel's start time of `pid` (clock ticks since boot; with the pid it names one process), or None."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[-1].split()[19]


def _alive_here(holder: dict[str, Any]) -> bool:
    return _proc_start(int(holder.get("pid", -1))) == holder.get("proc_start")


def lease_seconds() -> float:
    return float(os.environ.get("DIT_LOCK_LEASE_S", DEFAULT_LEASE_S))


class RunLock:
    """`with RunLock(run_dir, "dit-train"):` holds the run folder's lease (see the module docstring).

    name: the lock file's name in the folder; flag: the option that names the folder (for the refusal)."""

    def __init__(self, run_dir: str | os.PathLike, what: str, lease_s: float | None = None, *,
                 name: str = LOCK_NAME, flag: str = "--run-dir"):
        self.path = Path(run_dir) / name
        self.what = what
        self.flag = flag
        self.noun = "run folder" if flag == "--run-dir" else "output folder"
        self.lease_s = lease_seconds() if lease_s is None else lease_s
        self.warning: str | None = None  # set when a lapsed lease was taken over
        self._record = {"what": what, "host": socket.gethostname(), "pid": os.getpid(),
                        "proc_start": _proc_start(os.getpid()), "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                        "token": uuid.uuid4().hex, "lease_s": self.lease_s}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _payload(self) -> bytes:
        return json.dumps({**self._record, "heartbeat": time.time()}).encode()

    def _read(self, path: Path | None = None) -> dict[str, Any] | None:
        try:
            return json.loads((path or self.path).read_text())
        except (OSError, ValueError):
            return None

    def _lapsed(self, holder: dict[str, Any] | None, age: float) -> str | None:
        """Why `holder`'s lease is over, or None while it is live."""
        if holder is None:
            return "unreadable lock file" if age > self.lease_s else None
        if holder.get("host") == socket.gethostname() and not _alive_here(holder):
            return "its process is gone"
        beat = float(holder.get("heartbeat", 0))
        if time.time() - beat > float(holder.get("lease_s", self.lease_s)):
            return f"no heartbeat for {time.time() - beat:.0f} s"
        return None

    def acquire(self) -> "RunLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(5):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                self._take_over_or_refuse()
                continue
            with os.fdopen(fd, "wb") as f:
                f.write(self._payload())
                f.flush()
                os.fsync(f.fileno())
            self._thread = threading.Thread(target=self._heartbeat, name="run-lock-heartbeat", daemon=True)
            self._thread.start()
            return self
        raise RunFolderBusy(f"{self.path.parent}: could not take the {self.noun}'s lock {self.path} (contended)")

    def _take_over_or_refuse(self) -> None:
        try:
            age = time.time() - self.path.stat().st_mtime
        except FileNotFoundError:
            return
        holder = self._read()
        why = self._lapsed(holder, age)
        if why is None:
            raise self._busy(holder)
        aside = self.path.with_name(f"{self.path.name}.stale-{self._record['token']}")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return  # someone else moved it: try to create again
        moved = self._read(aside)
        if holder is not None and (moved or {}).get("token") != holder.get("token"):
            # we moved a newer lock than the stale one we judged: put it back, unless a third run made one
            try:
                os.link(aside, self.path)
            except FileExistsError:
                pass
            aside.unlink(missing_ok=True)
            return
        aside.unlink(missing_ok=True)
        h = holder or {}
        self.warning = (f"took over the {self.noun}'s lock from an earlier run that is not running any more ({why}: "
                        f"{h.get('what', '?')} on host {h.get('host')}, pid {h.get('pid')}, started {h.get('started')})")

    def _busy(self, holder: dict[str, Any] | None) -> RunFolderBusy:
        h = holder or {}
        return RunFolderBusy(
            f"{self.path.parent} is in use by another live run ({h.get('what', '?')} on host {h.get('host')}, "
            f"pid {h.get('pid')}, started {h.get('started')}); stop it first or use another {self.flag} "
            f"(a run that died releases its lock {self.path.name} at once on the same host, else after "
            f"{float(h.get('lease_s', self.lease_s)):.0f} s without a heartbeat)")

    def check(self) -> str | None:
        """What `acquire` would meet, without taking or touching anything (a dry run): RunFolderBusy (the same
        refusal) while another live run holds the lease; else None, or a line saying that a lapsed lease would
        be taken over."""
        try:
            age = time.time() - self.path.stat().st_mtime
        except FileNotFoundError:
            return None
        holder = self._read()
        why = self._lapsed(holder, age)
        if why is None:
            raise self._busy(holder)
        h = holder or {}
        return (f"would take over the {self.noun}'s lock from an earlier run that is not running any more ({why}: "
                f"{h.get('what', '?')} on host {h.get('host')}, pid {h.get('pid')}, "
                f"started {h.get('started')})")

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.lease_s / 6):
            current = self._read()
            if current is not None and current.get("token") != self._record["token"]:
                return  # taken over (this run stalled past its lease): never overwrite the new holder
            try:
                atomic_write_bytes(self.path, self._payload())
            except OSError:
                pass  # a full or flaky disk: the next beat tries again

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None
        current = self._read()
        if current is not None and current.get("token") == self._record["token"]:
            self.path.unlink(missing_ok=True)

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()
