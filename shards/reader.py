"""Reading shards: stream a tar from any location WebDataset can open and decode its samples safely.

Locations are opened with WebDataset's url opener (`webdataset.gopen`: local paths, `file:`, `pipe:CMD`,
`http(s)://`, `gs://`, `hf://`, ...; `s3://` is read through `pipe:aws s3 cp URL -`). The tar is parsed by
`shards.tario.TarReader` as it streams: nothing is extracted to disk, member names are checked against the
closed list of the format and never used as paths, and arrays are NPY read without pickle. Given the
manifest, every sample is also checked against it (fields, dtype, shape, finiteness, label range; the checks
of one sample's members are shards/sample_checks.py), and when the url names a shard of the manifest, its keys
and count against that shard's record (a shard copied over another has the same size but not its keys); any
problem raises `ShardError(url, key, problem)`.

Hot path (the trainer's data loader runs it for every sample; `iter_shard` is a short pipeline of named stages, one
generator each, see `shard_stages`): the expected layout is derived from the
manifest once per shard, tar headers that repeat a validated layout are checked in one step, NPY headers
are parsed once per distinct header, finiteness is tested on the stored bits, and arrays are numpy views
of the member bytes until the float32 conversion. `raw=True` skips that conversion: the trainer uses one
view of each array, so it selects the view first and widens only that (a quarter of the data for
posterior shards with two views).

Pixels (format version 2, shards/pixels.py): a set extracted with `--pixels` holds each sample's crop as a
`pixels.webp` member. Its presence is always checked against the manifest; its bytes are only taken when the
caller asks (`pixels="bytes"`: the WebP bytes, header checked against the manifest's size and mode;
`pixels="decoded"`: uint8 [H, W, 3]), and skipped otherwise. Decoding belongs to the consumer that needs the
array: loader workers call `shards.decode_pixels`.
"""
from __future__ import annotations

import hashlib
import io
import shlex
from dataclasses import dataclass
from typing import IO, Any, Callable, Generator, Iterator, NamedTuple
from urllib.parse import urlparse

import numpy as np

from dit_pipeline.shards.format import CAPTIONS_FIELD, PIXELS_RAW_FIELD, TEXT_STORE, ShardError, key_index, split_member
from dit_pipeline.shards.manifest import Manifest, ShardRecord
from dit_pipeline.shards.npy import all_finite, widen
from dit_pipeline.shards.pixels import ENCODING, RAW_ENCODING, pixels_filter, pixels_value
from dit_pipeline.shards.sample_checks import DTYPE_OF_STORAGE, Expect, check_sample
from dit_pipeline.shards.tario import TarProblem, TarReader
from dit_pipeline.shards.text import decode_captions


@dataclass
class LatentSample:
    """One decoded sample; arrays are [V, C, h, w] (None when not stored): writable float32 by default,
    the stored arrays with `iter_shard(..., raw=True)` (read-only, storage dtype: <f2, <f4, or <u2 holding
    bfloat16 bits; `shards.npy.widen` converts them exactly). `pixels`: only with `iter_shard(...,
    pixels=...)`: the WebP bytes, or the crop as uint8 [H, W, 3] (view 0; `shards.view_pixels` gives view 1)."""

    key: str
    label: int
    mean: np.ndarray | None
    std: np.ndarray | None
    latent: np.ndarray | None
    meta: dict | None
    pixels: bytes | np.ndarray | None = None
    captions: list[str] | None = None   # only with `iter_shard(..., captions=True)` (a set with captions)


def open_url(url: str) -> IO[bytes]:
    """Open a shard location for reading with WebDataset's url opener."""
    from webdataset.gopen import gopen, gopen_schemes

    scheme = urlparse(url).scheme
    if scheme == "s3" and "s3" not in gopen_schemes:
        return gopen(f"pipe:aws s3 cp --quiet {shlex.quote(url)} -")
    return gopen(url, "rb")


def iter_members(reader: TarReader, url: str, want: Callable[[str], bool] | None = None
                 ) -> Iterator[tuple[str, dict[str, bytes | None]]]:
    """Group a shard's members into samples: (key, {field: data}). Raises ShardError where the archive
    stops being valid: a refused member, a duplicate field, or keys that do not increase (a key's members
    must be contiguous, and keys unique within a shard)."""
    key: str | None = None
    fields: dict[str, bytes | None] = {}
    last = -1
    try:
        for name, data in reader.members(want):
            try:
                k, field = split_member(name)
            except ValueError as e:
                raise ShardError(url, key, str(e)) from None
            if k != key:
                if key is not None:
                    yield key, fields
                idx = key_index(k)
                if idx <= last:
                    raise ShardError(url, key, f"key {k} follows key {key}: keys repeat or are out of order "
                                     "(duplicate sample or non-contiguous members)")
                key, fields, last = k, {}, idx
            if field in fields:
                raise ShardError(url, k, f"duplicate member {name!r}")
            fields[field] = data
    except TarProblem as e:
        raise ShardError(url, key, str(e)) from None
    except OSError as e:
        raise ShardError(url, key, f"read failed: {e}") from None
    if key is not None:
        yield key, fields

def _encoding_of(fields: dict[str, Any]) -> str:
    """The pixels encoding a sample's members show (reading without a manifest)."""
    return RAW_ENCODING if PIXELS_RAW_FIELD in fields else ENCODING



SHA256_MODES = ("whole", "stream")


def _sha256_problem(record: ShardRecord, digest: str, used: str) -> str:
    return (f"sha256 mismatch: the file hashes to {digest[:16]}..., the manifest records {record.sha256[:16]}... "
            f"for {record.name} (changed or damaged since extraction); {used}")


def _read_whole(url: str, stream: IO[bytes], record: ShardRecord) -> IO[bytes]:
    """The shard's bytes in memory, checked against the record's sha256 before any sample is parsed."""
    try:
        data = stream.read()
    except (OSError, ValueError) as e:
        raise ShardError(url, None, f"read failed: {_close(stream) or e}") from None
    failure = _close(stream)
    if failure:
        raise ShardError(url, None, f"read failed: {failure}")
    digest = hashlib.sha256(data).hexdigest()
    if digest != record.sha256:
        raise ShardError(url, None, _sha256_problem(record, digest, "none of its samples were used"))
    return io.BytesIO(data)


Stage = Callable[[Iterator[Any]], Iterator[Any]]  # iterator -> iterator (webdataset's pipeline style)


def iter_shard(url: str, manifest: Manifest | None = None, *, with_meta: bool = False, raw: bool = False,
               record: ShardRecord | None = None, sha256: str | None = None,
               pixels: str | None = None, captions: bool = False) -> Generator[LatentSample, None, None]:
    """Stream the samples of one shard (see the module docstring); ShardError on any problem.

    A pipeline of named stages over the tar's samples (`shard_stages` lists them): the record's key range,
    the sample checks, finiteness, the samples as yielded, then the record's count and the streamed hash.
    raw: yield the stored arrays (read-only views, storage dtype) instead of float32 copies; the checks are
    the same (with a manifest: fields, dtype, shape, label range, and finite values on the stored bits).
    record: the shard's manifest record (default: the one the url's file name names).
    sha256: check the shard's bytes against the record's sha256: "whole" reads the shard into memory and
    checks it before the first sample is yielded; "stream" hashes the bytes as they are parsed and checks
    once the shard ends (its samples were yielded by then: the error says how many); None: no hash.
    pixels (a set with pixels): None skips their bytes (their presence is still checked); "bytes" yields the
    WebP bytes (header checked: complete, size, RGB); "decoded" the crop, uint8 [H, W, 3] (shards.decode_pixels).
    captions (a set with captions, format version 4): also decode each sample's captions (LatentSample.captions);
    otherwise only their presence is checked.
    """
    url = str(url)
    expect = Expect.from_manifest(manifest) if manifest is not None else None
    if expect is not None and expect.store == TEXT_STORE:
        raise ShardError(url, None, "a shard of a text set (text-encoder features, no latents); read it with "
                         "shards.iter_text_shard")
    if captions and expect is not None and not expect.captions:
        raise ShardError(url, None, "captions were asked for, but the manifest records none (the set was "
                         "extracted without --captions)")
    if record is None and manifest is not None:
        record = _record_of(url, manifest)
    want = pixels_filter(url, expect.pixels if expect is not None else None, pixels)
    yield from _stream(url, record, sha256, want, lambda reader, hasher: shard_stages(
        url, expect, record, reader, hasher, with_meta=with_meta, raw=raw, pixels=pixels, captions=captions))


def _stream(url: str, record: ShardRecord | None, sha256: str | None, want: Callable[[str], bool] | None,
            make_stages: Callable[[TarReader, Any], list[Stage]]) -> Generator[Any, None, None]:
    """Open `url`, group its members into samples and run them through `make_stages(reader, hasher)`; the
    shell every shard reader shares (the sha256 modes, closing the stream, naming a pipe's failure)."""
    if sha256 is not None and sha256 not in SHA256_MODES:
        raise ValueError(f"sha256 must be one of {SHA256_MODES} or None, got {sha256!r}")
    if record is None:
        sha256 = None
    try:
        stream = open_url(url)
    except (OSError, ValueError) as e:
        raise ShardError(url, None, f"cannot open: {e}") from None
    hasher = hashlib.sha256() if sha256 == "stream" else None
    try:
        if sha256 == "whole":
            assert record is not None
            stream = _read_whole(url, stream, record)
        reader = TarReader(stream, hasher=hasher)
        samples: Iterator[Any] = iter_members(reader, url, want)
        for stage in make_stages(reader, hasher):
            samples = stage(samples)
        yield from samples
    except ShardError as e:
        # A pipe: command that failed usually shows up as a short archive first; name the real cause.
        failure = _close(stream)
        if failure:
            raise ShardError(url, e.key, f"read failed: {failure} ({e.problem})") from None
        raise
    except BaseException:  # GeneratorExit when the consumer stops early: not an error of the stream
        _close(stream)
        raise
    failure = _close(stream)
    if failure:
        raise ShardError(url, None, f"read failed: {failure}")


def shard_stages(url: str, expect: Expect | None, record: ShardRecord | None, reader: TarReader,
                 hasher: Any, *, with_meta: bool, raw: bool, pixels: str | None, captions: bool = False) -> list[Stage]:
    """iter_shard's stages over (key, fields) pairs, in order; each mode adds or drops a stage."""
    stages: list[Stage] = []
    if record is not None:
        stages.append(lambda items: in_record_keys(items, url, record))
    stages.append(lambda items: checked_samples(items, url, expect, with_meta=with_meta, pixels=pixels,
                                                captions=captions))
    if expect is not None:
        stages.append(lambda items: finite_samples(items, url))
    stages.append(lambda items: latent_samples(items, raw=raw))
    if record is not None:
        stages.append(lambda items: counted(items, url, record))
        if hasher is not None:  # (a hash needs the record)
            stages.append(lambda items: hash_checked(items, url, record, reader, hasher))
    return stages


class Checked(NamedTuple):
    """A sample whose members passed the checks (arrays still as stored)."""

    key: str
    label: int
    arrays: dict[str, np.ndarray]
    meta: dict | None
    pixels: bytes | np.ndarray | None
    captions: list[str] | None = None


def in_record_keys(items: Iterator[tuple[str, dict]], url: str, record: ShardRecord) -> Iterator[tuple[str, dict]]:
    """Stage: every key within the keys the manifest records for this shard (a shard copied over another one
    has the same size, so the start-up check passes, but not these keys)."""
    # the manifest records both keys of a shard with samples; with 0 samples no key is in range
    lo, hi = (int(record.first_key), int(record.last_key)) if record.first_key and record.last_key else (1, 0)
    for key, fields in items:
        if not lo <= int(key) <= hi:
            raise ShardError(url, key, f"key {key} is outside the keys the manifest records for "
                             f"{record.name} ({record.first_key}..{record.last_key}): the file holds other "
                             "samples (another shard copied over it?)")
        yield key, fields


def checked_samples(items: Iterator[tuple[str, dict]], url: str, expect: Expect | None, *, with_meta: bool,
                    pixels: str | None, captions: bool = False) -> Iterator[Checked]:
    """Stage: each sample's members checked (fields, label, dtype, shape; its pixels and captions as asked)."""
    for key, fields in items:
        try:
            label, arrays, meta = check_sample(key, fields, expect, parse_meta=with_meta)
            px = pixels_value(fields, expect.image_size if expect is not None else None, pixels,
                              expect.pixels_encoding if expect is not None else _encoding_of(fields))
            caps = decode_captions(fields[CAPTIONS_FIELD]) if captions and CAPTIONS_FIELD in fields else None
            if captions and caps is None:
                raise ValueError(f"no {CAPTIONS_FIELD} member")
        except ValueError as e:
            raise ShardError(url, key, str(e)) from None
        yield Checked(key, label, arrays, meta, px, caps)


def finite_samples(items: Iterator[Checked], url: str) -> Iterator[Checked]:
    """Stage: no NaN or Inf in any stored array (widening is exact, so this holds for the float32 values too)."""
    for item in items:
        for f, a in item.arrays.items():
            if not all_finite(a):
                raise ShardError(url, item.key, f"{f} holds NaN or Inf")
        yield item


def latent_samples(items: Iterator[Checked], *, raw: bool) -> Iterator[LatentSample]:
    """Stage: the samples as yielded, with float32 arrays (raw: the stored ones)."""
    for key, label, arrays, meta, px, caps in items:
        out = arrays if raw else {f: widen(a, DTYPE_OF_STORAGE[a.dtype.str]) for f, a in arrays.items()}
        yield LatentSample(key=key, label=label, mean=out.get("mean.npy"), std=out.get("std.npy"),
                           latent=out.get("latent.npy"), meta=meta, pixels=px, captions=caps)


def counted(items: Iterator[LatentSample], url: str, record: ShardRecord) -> Iterator[LatentSample]:
    """Stage: at the shard's end, as many samples as the manifest records for it."""
    count = 0
    for item in items:
        count += 1
        yield item
    if count != record.samples:
        raise ShardError(url, None, f"holds {count} samples, the manifest records {record.samples} for "
                         f"{record.name}")


def hash_checked(items: Iterator[LatentSample], url: str, record: ShardRecord, reader: TarReader,
                 hasher: Any) -> Iterator[LatentSample]:
    """Stage: at the shard's end, the sha256 of all its bytes (hashed as they streamed) against the record."""
    count = 0
    for item in items:
        count += 1
        yield item
    reader.drain()
    if hasher.hexdigest() != record.sha256:
        raise ShardError(url, None, _sha256_problem(record, hasher.hexdigest(), f"all {count} of its "
                         "samples were already read (a check as the shard streams comes at its end)"))


def _record_of(url: str, manifest: Manifest) -> ShardRecord | None:
    """The manifest's record of the shard `url` names by its file name (None when it names none, e.g. a
    `pipe:` command)."""
    name = url.rstrip("/").rsplit("/", 1)[-1]
    return next((rec for rec in manifest.shards if rec.name == name), None)


def _close(stream: IO[bytes]) -> str | None:
    """Close a stream; the error text if that fails (a pipe: command's exit status is checked here)."""
    try:
        stream.close()
    except (OSError, ValueError) as e:
        return str(e)
    except Exception as e:  # subprocess.TimeoutExpired and the like from webdataset's Pipe
        return f"{type(e).__name__}: {e}"
    return None
