"""Proving a shard set complete and intact: `quick_check` (sizes only, for the trainer's start-up) and
`verify_shards` (everything `dit-shards verify` reports; docs/FORMAT.md lists the checks).

Each shard is checked in one streaming pass over its bytes (sha256 and tar parsing fed by the same 4 MiB
reads), shards in parallel processes. Set-wide checks (duplicate keys across shards, keys neither stored
nor listed as skipped, files the manifest does not list) run in the parent on what the workers return.
"""
from __future__ import annotations

import concurrent.futures as cf
import hashlib
import multiprocessing
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dit_pipeline.common.errors import UserError
from dit_pipeline.common.log import stderr_is_terminal
from dit_pipeline.shards.format import MANIFEST_NAME, ShardError, key_index, revision_index, sample_key, shard_index
from dit_pipeline.shards.manifest import Manifest, ShardRecord, read_manifest
from dit_pipeline.shards.npy import all_finite
from dit_pipeline.shards.pixels import pixels_value
from dit_pipeline.shards.reader import iter_members
from dit_pipeline.shards.sample_checks import Expect, check_sample, field_problem
from dit_pipeline.shards.text import check_text_sample
from dit_pipeline.shards.tario import TarReader

IGNORED = (MANIFEST_NAME, "logs")  # plus every name starting with "." and the kept earlier manifests
MAX_PROBLEMS_PER_SHARD = 20
MAX_LISTED_KEYS = 10
_FULL_CHUNK = 4 << 20
_QUICK_CHUNK = 64 << 10


@dataclass
class VerifyReport:
    folder: str
    quick: bool
    problems: list[tuple[str, str]] = field(default_factory=list)
    shards: int = 0
    samples: int = 0
    bytes: int = 0
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        return {"folder": self.folder, "ok": self.ok, "quick": self.quick, "shards": self.shards,
                "samples": self.samples, "bytes": self.bytes, "seconds": round(self.seconds, 3),
                "problems": [{"file": f, "problem": p} for f, p in self.problems]}


@dataclass
class _ShardResult:
    name: str
    problems: list[str]
    keys: np.ndarray  # global indices of the samples read, in file order
    read_to_end: bool
    bytes: int
    lengths: list[int] = field(default_factory=list)  # a text set: every caption's token count, in file order


def quick_check(folder: str | Path, manifest: Manifest) -> list[str]:
    """Every shard the manifest lists exists with its recorded size; returns the problems found."""
    out = []
    for rec in manifest.shards:
        path = Path(folder) / rec.name
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            out.append(f"{rec.name}: missing (listed in the manifest, not found in {folder})")
            continue
        if size != rec.bytes:
            out.append(f"{rec.name}: {size} bytes, the manifest says {rec.bytes} (truncated, replaced or "
                       "still being written; run `dit-shards verify` for details)")
    return out


def _walk(path: Path, rec: ShardRecord, expect: Expect, sps: int, quick: bool) -> _ShardResult:
    problems: list[str] = []
    keys: list[int] = []
    lengths: list[int] = []
    index = shard_index(rec.name)
    assert index is not None, rec.name  # the manifest's names are checked when it is read
    lo, hi = index * sps, (index + 1) * sps
    hasher = None if quick else hashlib.sha256()
    read_to_end = False
    with open(path, "rb", buffering=0) as f:
        reader = TarReader(f, hasher=hasher, chunk=_QUICK_CHUNK if quick else _FULL_CHUNK, seekable=quick)
        want = (lambda name: False) if quick else None
        try:
            for key, fields in iter_members(reader, rec.name, want):
                idx = key_index(key)
                keys.append(idx)
                if not lo <= idx < hi:
                    problems.append(f"sample {key}: key outside this shard's range [{sample_key(lo)}, "
                                    f"{sample_key(hi)}) (samples_per_shard {sps})")
                try:
                    if quick:
                        problem = field_problem(fields, expect.store, expect.pixels_member, expect.captions)
                        if problem:
                            raise ValueError(problem)
                    elif expect.max_length is not None:  # a text set: lengths, dtype, width, finite values
                        sample = check_text_sample(key, fields, dtype=expect.dtype, dim=expect.shape[0],
                                                   max_length=expect.max_length)
                        lengths.extend(int(n) for n in sample.lengths)
                        if not all_finite(sample.text):
                            raise ValueError("text.npy holds NaN or Inf")
                    else:
                        for name, raw in check_sample(key, fields, expect, parse_meta=True)[1].items():
                            if not all_finite(raw):
                                raise ValueError(f"{name} holds NaN or Inf")
                        # decodable, 8-bit RGB, image_size x image_size (shards/pixels.py)
                        pixels_value(fields, expect.image_size, "decoded" if expect.pixels else None,
                                     expect.pixels_encoding)
                except ValueError as e:
                    problems.append(f"sample {key}: {e}")
            read_to_end = True
        except ShardError as e:
            problems.append((f"after sample {e.key}: " if e.key else "") + e.problem)
            if hasher is not None:
                reader.drain()
    if hasher is not None and hasher.hexdigest() != rec.sha256:
        problems.insert(0, f"sha256 mismatch: the file hashes to {hasher.hexdigest()[:16]}..., the manifest "
                        f"says {rec.sha256[:16]}... (bit rot or a modified file)")
    if read_to_end:
        problems.extend(_record_mismatch(rec, keys))
    return _ShardResult(rec.name, problems, np.asarray(keys, np.int64), read_to_end, reader.bytes_read, lengths)


def _record_mismatch(rec: ShardRecord, keys: list[int]) -> list[str]:
    out = []
    if len(keys) != rec.samples:
        out.append(f"holds {len(keys)} samples, the manifest says {rec.samples}")
    first = sample_key(keys[0]) if keys else None
    last = sample_key(keys[-1]) if keys else None
    if (first, last) != (rec.first_key, rec.last_key):
        out.append(f"key range {first}..{last}, the manifest says {rec.first_key}..{rec.last_key}")
    return out


def check_shard(folder: str, rec: ShardRecord, expect: Expect, sps: int, quick: bool) -> _ShardResult:
    """All per-shard checks for one shard (runs in a worker process)."""
    path = Path(folder) / rec.name
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return _ShardResult(rec.name, ["missing: listed in the manifest but not found"],
                            np.zeros(0, np.int64), False, 0)
    pre = [] if size == rec.bytes else [f"size {size} bytes, the manifest says {rec.bytes}"]
    try:
        res = _walk(path, rec, expect, sps, quick)
    except OSError as e:
        return _ShardResult(rec.name, pre + [f"read failed: {e}"], np.zeros(0, np.int64), False, 0)
    res.problems[:0] = pre
    res.bytes = size
    if len(res.problems) > MAX_PROBLEMS_PER_SHARD:
        more = len(res.problems) - MAX_PROBLEMS_PER_SHARD
        res.problems = res.problems[:MAX_PROBLEMS_PER_SHARD] + [f"... and {more} more problems in this shard"]
    return res


def _extra_entries(folder: Path, manifest: Manifest) -> list[tuple[str, str]]:
    listed = {s.name for s in manifest.shards}
    out = []
    for name in sorted(os.listdir(folder)):
        if name in listed or name in IGNORED or name.startswith("."):
            continue
        kept = revision_index(name)  # an earlier manifest, kept by dit-shards stats --write (shards/revision.py)
        if kept is not None and kept < manifest.revision_number:
            continue
        if kept is not None:
            out.append((name, f"a kept manifest revision {kept}, but manifest.json is revision "
                              f"{manifest.revision_number} (left from another set? move it away)"))
            continue
        if shard_index(name) is not None:
            out.append((name, "extra shard not listed in the manifest (from another run? move it away)"))
        elif (folder / name).is_dir():
            out.append((name, "extra folder not listed in the manifest"))
        else:
            out.append((name, "extra file not listed in the manifest"))
    return out


def _set_problems(manifest: Manifest, results: list[_ShardResult]) -> list[tuple[str, str]]:
    """Keys duplicated across shards, skipped keys that are stored, and keys neither stored nor skipped."""
    out: list[tuple[str, str]] = []
    if not results:
        return out
    keys = np.concatenate([r.keys for r in results])
    owner = np.concatenate([np.full(len(r.keys), i, np.int64) for i, r in enumerate(results)])
    order = np.argsort(keys, kind="stable")
    keys, owner = keys[order], owner[order]
    dup = np.nonzero(keys[1:] == keys[:-1])[0]
    for i in dup[:MAX_LISTED_KEYS]:
        a, b = results[owner[i]].name, results[owner[i + 1]].name
        where = f"twice in {a}" if a == b else f"in {a} and {b}"
        out.append((b, f"duplicate key {sample_key(int(keys[i]))}: stored {where}"))
    if len(dup) > MAX_LISTED_KEYS:
        out.append((MANIFEST_NAME, f"... and {len(dup) - MAX_LISTED_KEYS} more duplicate keys"))
    skipped = []
    for s in manifest.skipped:
        try:
            skipped.append(key_index(s["key"]))
        except (ValueError, TypeError):
            out.append((MANIFEST_NAME, f"skipped entry {s.get('path')!r} has an invalid key {s['key']!r}"))
    skipped_arr = np.asarray(sorted(skipped), np.int64)
    both = np.intersect1d(skipped_arr, keys)
    for k in both[:MAX_LISTED_KEYS]:
        out.append((MANIFEST_NAME, f"key {sample_key(int(k))} is listed as skipped but is stored in a shard"))
    if all(r.read_to_end for r in results) and len(manifest.shards) == len(results):
        n = manifest.total_samples + len(manifest.skipped)
        present = np.zeros(n, bool)
        inside = np.concatenate([keys, skipped_arr])
        present[inside[(inside >= 0) & (inside < n)]] = True
        gone = np.nonzero(~present)[0]
        if len(gone):
            listed = ", ".join(sample_key(int(k)) for k in gone[:MAX_LISTED_KEYS])
            out.append((MANIFEST_NAME, f"{len(gone)} keys in [0, {n}) are neither stored nor listed as skipped: "
                        f"{listed}{' ...' if len(gone) > MAX_LISTED_KEYS else ''}"))
    return out


def _text_totals(manifest: Manifest, results: list[_ShardResult]) -> list[str]:
    """A text set's manifest counts (captions, tokens, the token-length histogram) against the stored lengths."""
    from dit_pipeline.shards.text import length_histogram

    assert manifest.text is not None
    t = manifest.text
    lengths = [n for r in results for n in r.lengths]
    out = []
    if len(lengths) != t["captions"]:
        out.append(f"the shards hold {len(lengths)} captions' features, the manifest's text record says {t['captions']}")
    if sum(lengths) != t["tokens"]:
        out.append(f"the shards hold {sum(lengths)} tokens, the manifest's text record says {t['tokens']}")
    hist = length_histogram(lengths, int(t["max_length"]))
    if hist != t["length_histogram"]["counts"]:
        out.append(f"token-length histogram of the shards {hist} differs from the manifest's "
                   f"{t['length_histogram']['counts']}")
    return out


def _mp_context() -> multiprocessing.context.BaseContext:
    """fork (workers start in milliseconds, and it works whatever the main module is) unless this process
    has initialised CUDA, whose state must not be forked; then spawn."""
    torch = sys.modules.get("torch")
    if "fork" in multiprocessing.get_all_start_methods() and not (torch is not None and torch.cuda.is_initialized()):
        return multiprocessing.get_context("fork")
    return multiprocessing.get_context("spawn")


def _run(args: list[tuple], jobs: int, progress: bool, total_bytes: int) -> list[_ShardResult]:
    """check_shard over all shards, in `jobs` processes, with a progress bar in bytes."""
    from tqdm import tqdm

    results: list[_ShardResult] = []
    if jobs == 1 or len(args) <= 1:
        with tqdm(total=total_bytes, unit="B", unit_scale=True, desc="verify", disable=not progress) as bar:
            for a in args:
                results.append(check_shard(*a))
                bar.update(a[1].bytes)
        return results
    with cf.ProcessPoolExecutor(max_workers=min(jobs, len(args)), mp_context=_mp_context()) as pool:
        # Submit (which starts the workers) before the bar exists: no tqdm thread is around at fork time.
        futures = {pool.submit(check_shard, *a): a[1] for a in args}
        with tqdm(total=total_bytes, unit="B", unit_scale=True, desc="verify", disable=not progress) as bar:
            for fut in cf.as_completed(futures):
                results.append(fut.result())
                bar.update(futures[fut].bytes)
    return results


def verify_shards(folder: str | Path, *, quick: bool = False, jobs: int = 1, progress: bool = True) -> VerifyReport:
    """Check a shard folder against its manifest (all checks in docs/FORMAT.md); never raises for a bad
    shard set: every problem is in the report. UserError only if `folder` is not a folder."""
    folder = Path(folder)
    if not folder.is_dir():
        raise UserError(f"{folder}: not a folder (pass the shard folder that holds manifest.json)")
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    t0 = time.perf_counter()
    report = VerifyReport(str(folder), quick)
    try:
        manifest = read_manifest(folder)
    except UserError as e:
        report.problems.append((MANIFEST_NAME, str(e)))
        return report
    expect = Expect.from_manifest(manifest)
    args = [(str(folder), rec, expect, manifest.samples_per_shard, quick) for rec in manifest.shards]
    results = _run(args, jobs, progress and stderr_is_terminal(), manifest.total_bytes)  # no redraws in a log
    results.sort(key=lambda r: r.name)
    for r in results:
        report.problems.extend((r.name, p) for p in r.problems)
    report.problems.extend(_set_problems(manifest, results))
    if manifest.is_text and not quick and all(r.read_to_end and not r.problems for r in results):
        report.problems.extend((MANIFEST_NAME, p) for p in _text_totals(manifest, results))
    report.problems.extend(_extra_entries(folder, manifest))
    report.shards = len(results)
    report.samples = int(sum(len(r.keys) for r in results))
    report.bytes = int(sum(r.bytes for r in results))
    report.seconds = time.perf_counter() - t0
    return report
