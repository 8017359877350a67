"""Crash-safe file writes.

Every file this project produces (shards, manifests, checkpoints, npz) is written to a temporary name in
the same folder, flushed and fsynced, then renamed over the final name and the folder fsynced. A reader
therefore sees either the old complete file or the new complete file, never a partial one, whether the
writer is SIGKILLed or the disk fills up (RELIABILITY.md).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import IO, Any, Iterator

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
    """Delete temp files left behind by a killed writer; returns what was removed."""
    folder = Path(folder)
    removed = []
    if folder.is_dir():
        for p in folder.glob(TMP_PREFIX + "*"):
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
                removed.append(p)
    return removed


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

    def write(self, data: bytes) -> int:
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
