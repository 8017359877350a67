"""Plain POSIX ustar (the tar format WebDataset shards use): deterministic member headers for the writer
and a strict, streaming, single-pass reader.

The reader is deliberately narrower than `tarfile`: it accepts only regular-file members with ustar
headers whose checksum is right, refuses links, devices, directories, pax/GNU extension headers and
members above `MAX_MEMBER_BYTES` before reading their data, and never touches the file system with a
member name. It reads big chunks and can feed every byte it reads to a hash, so `verify` checks the
sha256 and the structure of a shard in one pass over the bytes.
"""
from __future__ import annotations

import tarfile
from typing import IO, Any, Callable, Iterator

from dit_pipeline.shards.format import MAX_MEMBER_BYTES

BLOCK = 512
RECORD = 20 * BLOCK  # the tar "blocking factor" GNU tar and tarfile pad archives to
ZERO_BLOCK = bytes(BLOCK)
_TYPE_NAMES = {b"1": "hard link", b"2": "symbolic link", b"3": "character device", b"4": "block device",
               b"5": "directory", b"6": "FIFO", b"7": "contiguous file", b"x": "pax extended header",
               b"g": "pax global header", b"L": "GNU long name", b"K": "GNU long link name"}

_COMPRESSED = {b"\x1f\x8b\x08\x00": "gzip", b"\x1f\x8b\x08\x08": "gzip", b"\x28\xb5\x2f\xfd": "zstd",
               b"BZh9": "bzip2", b"\xfd7zX": "xz"}


class TarProblem(Exception):
    """The archive cannot be read past this point (message says why and where)."""


def member_header(name: str, size: int) -> bytes:
    """ustar header of a regular file with every variable field fixed: mtime 0, uid/gid 0, empty
    user/group names, mode 0644. The same (name, size) always gives the same 512 bytes."""
    info = tarfile.TarInfo(name)
    info.size = size
    info.mtime = 0
    info.mode = 0o644
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.type = tarfile.REGTYPE
    return info.tobuf(tarfile.USTAR_FORMAT, "ascii", "strict")


def member_bytes(name: str, data: bytes) -> bytes:
    """Header, data and zero padding to the next block: one complete member."""
    return member_header(name, len(data)) + data + bytes(-len(data) % BLOCK)


def end_of_archive(offset: int) -> bytes:
    """Two zero blocks, then zeros up to the next record boundary (as tar and tarfile write)."""
    end = offset + 2 * BLOCK
    return bytes(2 * BLOCK + (-end % RECORD))


def _octal(field: bytes, what: str, offset: int) -> int:
    if field[:1] and field[0] & 0x80:
        raise TarProblem(f"member header at byte {offset} uses a base-256 {what} (huge member), refused")
    text = field.split(b"\0", 1)[0].strip(b" ")
    try:
        return int(text or b"0", 8)
    except ValueError:
        raise TarProblem(f"corrupt member header at byte {offset} (unreadable {what} field)") from None


class TarReader:
    """Iterate the members of a tar stream: (name, data) pairs, data None for members not wanted.

    stream: any binary object with read(n); hasher: object with update(bytes), fed every byte read
    (including padding and the end-of-archive blocks, so it sees exactly the file); seekable: skip
    unwanted data with seek() instead of reading it (only without a hasher).
    """

    def __init__(self, stream: IO[bytes], *, hasher: Any = None, chunk: int = 1 << 20, seekable: bool = False):
        self._stream = stream
        self._readinto = getattr(stream, "readinto", None)
        self._hasher = hasher
        self._chunk = chunk
        self._seekable = seekable and hasher is None
        # One reused buffer, filled with readinto: no allocation (and no page faults) per chunk read.
        self._buf = bytearray(chunk)
        self._mv = memoryview(self._buf)
        self._pos = 0  # next unread byte in the buffer
        self._end = 0  # end of the valid bytes in the buffer
        self.offset = 0  # bytes of the archive consumed so far
        self.bytes_read = 0  # bytes taken from the stream (== file size once drained)
        # header[100:148] -> (size, header[156:], checksum of everything but the name) of validated headers
        self._known: dict[bytes, tuple[int, bytes, int]] = {}

    def _read_into(self, start: int) -> int:
        """One read from the stream into the buffer from `start` on; the byte count (0 at end of stream)."""
        view = self._mv[start:]
        if self._readinto is not None:
            n = self._readinto(view) or 0
        else:  # e.g. webdataset's Pipe, which only has read()
            data = self._stream.read(len(view))
            n = len(data)
            view[:n] = data
        if n:
            self.bytes_read += n
            if self._hasher is not None:
                self._hasher.update(view[:n])
        return n

    def _fill(self, n: int) -> int:
        """Make n bytes available at _pos if the stream has them; returns how many are available."""
        avail = self._end - self._pos
        if avail >= n:
            return avail
        if self._pos:  # move the unread tail (less than one member) to the front
            tail = bytes(self._mv[self._pos:self._end])
            self._mv[:avail] = tail
            self._pos, self._end = 0, avail
        if n > len(self._buf):
            self._mv.release()
            self._buf.extend(bytes(max(n, 2 * len(self._buf)) - len(self._buf)))
            self._mv = memoryview(self._buf)
        while self._end < n:
            got = self._read_into(self._end)
            if not got:
                break
            self._end += got
        return self._end - self._pos

    def _take(self, n: int) -> bytes:
        avail = self._fill(n)
        k = min(n, avail)
        out = bytes(self._mv[self._pos:self._pos + k])
        self._pos += k
        self.offset += k
        return out

    def _skip(self, n: int) -> int:
        avail = self._end - self._pos
        if self._seekable and n > avail:
            self._stream.seek(n - avail, 1)
            self._pos = self._end = 0
            self.offset += n
            return n
        if n <= avail:
            self._pos += n
            self.offset += n
            return n
        return len(self._take(n))

    def members(self, want: Callable[[str], bool] | None = None) -> Iterator[tuple[str, bytes | None]]:
        """Yield (name, data) for every member; raises TarProblem where the archive stops being valid."""
        known = self._known
        while True:
            start = self.offset
            pos = self._pos
            if self._end - pos >= BLOCK:
                header = bytes(self._mv[pos:pos + BLOCK])
                self._pos = pos + BLOCK
                self.offset = start + BLOCK
            else:
                header = self._take(BLOCK)
            if len(header) < BLOCK:
                where = "inside a member header" if header else "before the end-of-archive marker"
                raise TarProblem(f"truncated: the archive ends at byte {start + len(header)}, {where}")
            # Fast path: a header whose fields after the name equal those of an already validated header
            # (in a shard they differ only in name and checksum): check the checksum from the name bytes.
            hit = known.get(header[100:148])
            if (hit is not None and header[156:] == hit[1] and header[345] == 0
                    and sum(header[:100]) + hit[2] == int(header[148:155].rstrip(b"\0 ") or b"0", 8)):
                size = hit[0]
                name = header[:100].split(b"\0", 1)[0].decode("latin1")
            elif header == ZERO_BLOCK:
                self._finish(start)
                return
            else:
                name, size = self._parse(header, start)
                if len(known) < 64:
                    known[header[100:148]] = (size, header[156:], sum(header[100:148]) + 256 + sum(header[156:]))
            padded = size + (-size % BLOCK)
            if want is None or want(name):
                pos = self._pos
                if self._end - pos >= padded:  # the whole member is in the current chunk (usually)
                    data = bytes(self._mv[pos:pos + size])
                    self._pos = pos + padded
                    self.offset += padded
                else:
                    data = self._take(size)
                    if len(data) < size or len(self._take(padded - size)) < padded - size:
                        raise TarProblem(f"truncated: the archive ends inside member {name!r} "
                                         f"(byte {self.offset})")
                yield name, data
            else:
                self._skip(padded)
                yield name, None

    def _parse(self, header: bytes, start: int) -> tuple[str, int]:
        if start == 0 and header[:4] in _COMPRESSED:
            raise TarProblem(f"{_COMPRESSED[header[:4]]}-compressed file: shards are plain (uncompressed) tar")
        stored = _octal(header[148:156], "checksum", start)
        # The checksum counts its own 8-byte field as spaces (8 * 32).
        if sum(header) - sum(header[148:156]) + 256 != stored:
            raise TarProblem(f"corrupt member header at byte {start} (checksum mismatch)")
        if header[257:262] != b"ustar":
            raise TarProblem(f"member header at byte {start} is not a ustar header")
        name = header[:100].split(b"\0", 1)[0].decode("latin1")
        if header[345] != 0:  # ustar prefix field: the name is really "prefix/name"
            name = header[345:500].split(b"\0", 1)[0].decode("latin1") + "/" + name
        kind = header[156:157]
        if kind != b"0" and kind != b"\0":
            what = _TYPE_NAMES.get(kind, f"unknown type {kind!r}")
            raise TarProblem(f"{what} member {name!r} refused (a shard holds only regular files; "
                             "links and devices are never followed)")
        size = _octal(header[124:136], "size", start)
        if size > MAX_MEMBER_BYTES:
            raise TarProblem(f"huge member {name!r} ({size} bytes > {MAX_MEMBER_BYTES}) refused")
        return name, size

    def _finish(self, start: int) -> None:
        second = self._take(BLOCK)
        if second != ZERO_BLOCK:
            if len(second) < BLOCK:
                raise TarProblem(f"truncated: incomplete end-of-archive marker at byte {start}")
            raise TarProblem(f"a zero block at byte {start} is followed by data (corrupt or spliced archive)")
        while True:
            at = self.offset
            rest = self._take(self._chunk)
            if not rest:
                return
            if rest.count(0) != len(rest):
                at += len(rest) - len(rest.lstrip(b"\0"))
                raise TarProblem(f"non-zero data after the end-of-archive marker (byte {at})")

    def drain(self) -> None:
        """Read (and hash) the rest of the stream without parsing it."""
        self._pos = self._end = 0
        while self._read_into(0):
            pass
