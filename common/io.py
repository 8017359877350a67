"""Crash-safe file writes.

Every file this project produces (shards, manifests, checkpoints, npz) is written to a temporary name in
the same folder, flushed and fsynced, then renamed over the final name and the folder fsynced. A reader
therefore sees either the old complete file or the new complete file, never a partial one, whether the
writer is SIGKILLed or the disk fills up (RELIABILITY.md).
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import IO, Any, Iterator

from dit_pipeline.common.errors import UserError
from dit_pipeline.common.faults import fault_point

TMP_PREFIX = ".tmp-"
_CHUNK = 1 << 20


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def fsync_dir(path: str | os.PathLike) -> None:
    """fsync a directory so a rename inside it is durable (no-op where unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "wb") -> Iterator[IO[Any]]:
    """Open a temp file next to `path`; on clean exit fsync and rename it onto `path`.

    On any exception the temp file is removed and `path` is untouched.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=TMP_PREFIX + path.name + ".", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600; outputs must be readable like any other file
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    with atomic_write(path, "wb") as f:
        f.write(data)


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    """Write JSON atomically (sorted keys, 2-space indent, trailing newline: stable bytes)."""
    text = json.dumps(obj, indent=2, sort_keys=True) + "\n"
    atomic_write_bytes(path, text.encode("utf-8"))


def remove_stale_temps(folder: str | os.PathLike) -> list[Path]:
    """Delete temp files (and temp folders: a sharded checkpoint being written) left behind by a killed writer;
    returns what was removed."""
    import shutil

    folder = Path(folder)
    removed = []
    if folder.is_dir():
        for p in folder.glob(TMP_PREFIX + "*"):
            with contextlib.suppress(FileNotFoundError):
                if p.is_dir() and not p.is_symlink():
                    shutil.rmtree(p)
                else:
                    p.unlink()
                removed.append(p)
    return removed


def check_writable_dir(path: str | os.PathLike, label: str) -> None:
    """UserError (one line naming the folder and the problem) unless `path` is, or can become, a folder this
    process can write in; `label` names the setting, e.g. "--out shards/". Leaves nothing behind: it writes
    and removes a probe file in `path`, or in the nearest existing folder above it when `path` does not exist
    yet (a read-only mount or a missing permission is only certain once a write is tried; root passes every
    permission check)."""
    folder = Path(path).expanduser()
    if folder.exists() and not folder.is_dir():
        raise UserError(f"{label}: {folder} exists and is not a folder; pass a folder")
    probe_in = folder
    while not probe_in.exists() and probe_in.parent != probe_in:
        probe_in = probe_in.parent
    try:
        if not probe_in.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, "Not a directory")
        fault_point("io.write_check")
        fd, probe = tempfile.mkstemp(prefix=TMP_PREFIX + "write-check.", dir=probe_in)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        why = e.strerror or str(e)
        where = f"write in {folder}" if probe_in == folder else f"create {folder} in {probe_in}"
        raise UserError(f"{label}: cannot {where} ({why}); pass a writable folder") from None


def missing_file(path: str | os.PathLike) -> str:
    """Why `path` (not a file) cannot be read as one, for an error message: a folder is named as a folder, so an
    existing folder is never reported as missing."""
    p = Path(path).expanduser()
    if p.is_dir():
        return f"{p} is a folder, not a file; pass a file in it"
    return f"no such file ({p.absolute()})"


def sha256_file(path: str | os.PathLike, chunk: int = _CHUNK) -> str:
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(chunk)
        view = memoryview(buf)
        while True:
            n = f.readinto(buf)
            if not n:
                break
            h.update(view[:n])
    return h.hexdigest()


class HashingWriter:
    """A write-only file wrapper that counts bytes and computes sha256 as data is written,
    so a file's record is produced while writing it, never by re-reading."""

    def __init__(self, f: IO[bytes]):
        self._f = f
        self._h = hashlib.sha256()
        self.bytes = 0

    def write(self, data: bytes | memoryview) -> int:
        n = self._f.write(data)
        self._h.update(data)
        self.bytes += len(data)
        return n

    def flush(self) -> None:
        self._f.flush()

    def tell(self) -> int:
        return self.bytes

    def hexdigest(self) -> str:
        return self._h.hexdigest()
