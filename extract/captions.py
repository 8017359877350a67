"""Captions of the images of a `dit-extract --captions` run: where each image's captions come from, and the
one policy every source follows (issue 37; docs/FORMAT.md "Captions and text").

Sources (`--captions`):
- a mapping file, JSONL (one object per line), JSON (a list of such objects, or one object {path: caption(s)})
  or CSV/TSV (a header row): each record names an image by its path relative to --data-path (keys `path`,
  `image`, `file_name`, `filename`, `file`, `image_path`; a bare file name also matches when it is unique in the
  folder, as ImageNet recaption sets name images) and gives one or more captions under `--caption-keys` (a
  string or a list of strings each; e.g. long and short captions, all kept and drawn at training time);
- `sidecar`: a caption file beside each image, same name with `.txt` (the whole file is one caption) or `.json`
  (an object with the caption keys), identified in the record by their names and contents, so an edited caption
  file is a changed source as an edited mapping file is; in a WebDataset tar the sample's `.txt` / `.json` member (BLIP3o's layout,
  as NanoGen's loader reads it: the `txt` member decoded as UTF-8 and stripped).

The policy (never a silent drop; each count lands in the manifest's captions record, each skip in `skipped`):
- a caption is stripped of surrounding whitespace (NanoGen's `.strip()`); one that is then empty is dropped
  and counted (`dropped_empty`);
- caption text that is not UTF-8 (or a `.json` caption that does not parse) is dropped and counted
  (`dropped_undecodable`); in a mapping file it is refused naming the file and line, since the whole file is
  then suspect;
- an image left without a caption is skipped like an undecodable image (reason "no caption: ...", naming the caption
  keys a mapping record lacks; counted as `uncaptioned`; `--strict` makes it an error naming the file);
- a source that gives a caption to fewer than 1% of the images (`MIN_COVERAGE`: a wrong --caption-keys, paths that
  name no image of --data-path, no caption files) is refused before anything is written, naming the keys its
  records do have (`check_coverage`): such a set would be verified with no samples, and on ImageNet walk 1.28M
  images for nothing;
- a caption without an image (a mapping record naming no image of --data-path, a caption file or tar sample
  without an image) is counted (`unmatched`, with the first examples) and logged;
- the same image named twice in a mapping file, or one tar key twice, is refused naming the file and both
  places: which captions belong to it would be a guess.
"""
from __future__ import annotations

import csv
import hashlib
import io
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from dit_pipeline.common.errors import UserError
from dit_pipeline.common.io import sha256_file

PATH_KEYS = ("path", "image", "file_name", "filename", "file", "image_path")
DEFAULT_CAPTION_KEYS = ("caption", "captions")
SIDECAR = "sidecar"
CAPTION_SUFFIXES = (".txt", ".json")
MAX_EXAMPLES = 10
NO_CAPTION = "no caption"
MIN_COVERAGE = 0.01  # a source that captions fewer of the images is refused (check_coverage)


@dataclass(frozen=True)
class CaptionCounts:
    """What the policy did to one image's candidate captions."""

    captions: list[str]
    dropped_empty: int = 0
    dropped_undecodable: int = 0
    problem: str | None = None          # why nothing is left (the image is then skipped)


def clean(candidates: Sequence[str | bytes | None], what: str) -> CaptionCounts:
    """The policy applied to one image's candidates: str (already text), bytes (to decode as UTF-8), or None (an
    undecodable member, already known)."""
    kept: list[str] = []
    empty = undecodable = 0
    bad: str | None = None
    for c in candidates:
        if c is None:
            undecodable += 1
            continue
        if isinstance(c, (bytes, bytearray, memoryview)):
            try:
                c = bytes(c).decode("utf-8")
            except UnicodeDecodeError as e:
                undecodable += 1
                bad = f"{what} is not UTF-8 text ({e.reason} at byte {e.start})"
                continue
        text = c.strip()
        if text:
            kept.append(text)
        else:
            empty += 1
    problem = None
    if not kept:
        problem = f"{NO_CAPTION}: " + (bad or (f"{what} holds only empty or whitespace captions" if empty else what))
    return CaptionCounts(kept, empty, undecodable, problem)


def captions_of(value: Any, keys: Sequence[str], where: str) -> list[str]:
    """The captions of one record (an object): the values under `keys`, each a string or a list of strings, in
    the order of `keys`; UserError naming `where` for anything else."""
    out: list[str] = []
    for k in keys:
        v = value.get(k)
        if v is None:
            continue
        items = v if isinstance(v, list) else [v]
        for item in items:
            if not isinstance(item, str):
                raise UserError(f"{where}: {k!r} holds {type(item).__name__}, not a caption string (or a list of them)")
            out.append(item)
    return out


@dataclass
class CaptionIndex:
    """Per global index, where its captions come from (picklable and compact, for forked decode workers):
    a mapping's captions as one UTF-8 blob of JSON arrays with offsets, or a sidecar file's relative path, or a
    tar member (reader in extract/webdataset.py)."""

    kind: str                                   # "mapping" | "sidecar" | "webdataset"
    record: dict[str, Any]                      # the manifest's captions source record
    blob: np.ndarray | None = None              # mapping / sidecar: utf-8 bytes, one entry per image
    offsets: np.ndarray | None = None
    unmatched: dict[str, Any] = field(default_factory=lambda: {"count": 0, "examples": []})
    members: Any = None                         # webdataset: the tars' TarMembers (extract/webdataset.py)
    record_keys: tuple[str, ...] = ()           # mapping: the keys its records hold (named when none has a caption)
    records: int = 0                            # mapping: how many records the file holds

    def __len__(self) -> int:
        assert self.offsets is not None
        return len(self.offsets) - 1

    def entry(self, index: int) -> str:
        assert self.blob is not None and self.offsets is not None
        return self.blob[self.offsets[index]:self.offsets[index + 1]].tobytes().decode("utf-8", "surrogateescape")

    def head(self, n: int) -> "CaptionIndex":
        if self.offsets is None or n >= len(self):
            return self
        return CaptionIndex(self.kind, self.record, self.blob, self.offsets[:n + 1], self.unmatched, self.members,
                            self.record_keys, self.records)

    def candidates(self, root: str, rel_path: str, index: int) -> tuple[list[str | bytes | None], str]:
        """(the raw captions of image `index`, how to name their source in a skip reason)."""
        entry = self.entry(index)
        if self.kind == "mapping":
            file = self.record["file"]
            if not entry:
                return [], f"no record in {file}"
            caps = json.loads(entry)
            keys = ", ".join(self.record["keys"])
            return caps, (f"its record in {file}" if caps else f"its record in {file} has no caption under {keys}")
        if self.kind == "webdataset":
            tar = rel_path.split("/", 1)[0]
            return self._tar_candidates(entry), (f"its caption in {tar}" if entry else
                                                 f"no .txt or .json member in {tar}")
        if not entry:
            return [], "no caption file beside it"
        return read_sidecar(os.path.join(root, entry), tuple(self.record["keys"])), f"caption file {entry}"


    def _tar_candidates(self, entry: str) -> list[str | bytes | None]:
        """The raw captions of one tar sample from its caption members (`tar:offset:size:field;...`)."""
        out: list[str | bytes | None] = []
        for part in filter(None, entry.split(";")):
            t, off, size, suffix = part.split(":")
            data = self.members.read_at(int(t), int(off), int(size))
            out.extend(parse_caption_member(data, suffix, tuple(self.record["keys"])))
        return out


def read_sidecar(path: str, keys: Sequence[str]) -> list[str | bytes | None]:
    """The raw captions of one caption file: a .txt file is one caption (bytes, decoded by `clean`); a .json file
    an object with the caption keys (None: it does not parse)."""
    try:
        with open(path, "rb") as f:
            data = f.read(1 << 20)
    except OSError:
        return [None]
    return parse_caption_member(data, path.rsplit(".", 1)[-1].lower(), keys)


def parse_caption_member(data: bytes, suffix: str, keys: Sequence[str]) -> list[str | bytes | None]:
    if suffix == "txt":
        return [data]
    try:
        value = json.loads(data.decode("utf-8"))
        if not isinstance(value, dict):
            return [None]
        return list(captions_of(value, keys, "json"))
    except (UnicodeDecodeError, ValueError, UserError):
        return [None]


def _blob(entries: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    encoded = [e.encode("utf-8", "surrogateescape") for e in entries]
    return (np.frombuffer(b"".join(encoded), dtype=np.uint8),
            np.cumsum([0] + [len(e) for e in encoded], dtype=np.int64))


def _note(unmatched: dict[str, Any], example: str) -> None:
    unmatched["count"] += 1
    if len(unmatched["examples"]) < MAX_EXAMPLES:
        unmatched["examples"].append(example)


# ----------------------------------------------------------------------------------------------------------
# Mapping files

def _records(path: Path, flag: str) -> list[tuple[str, dict[str, Any]]]:
    """(where, record) of every record of a mapping file; UserError naming the file and line for bad input."""
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise UserError(f"{flag} {path}: cannot read it ({e.strerror or e})") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise UserError(f"{flag} {path}:{line}: not UTF-8 text ({e.reason} at byte {e.start}); re-save the file as "
                        "UTF-8 (nothing was written)") from None
    suffix = path.suffix.lower()
    if suffix in (".csv", ".tsv"):
        rows = csv.DictReader(io.StringIO(text), delimiter="\t" if suffix == ".tsv" else ",")
        return [(f"{path}:{i + 2}", dict(r)) for i, r in enumerate(rows)]
    if suffix == ".json":
        try:
            value = json.loads(text)
        except ValueError as e:
            raise UserError(f"{flag} {path}: invalid JSON ({e})") from None
        if isinstance(value, dict):
            return [(f"{path}: {k!r}", {"path": k, "caption": v}) for k, v in value.items()]
        if isinstance(value, list) and all(isinstance(v, dict) for v in value):
            return [(f"{path}: record {i}", v) for i, v in enumerate(value)]
        raise UserError(f"{flag} {path}: expected a JSON list of objects or an object {{path: caption}}")
    out = []
    for i, line in enumerate(text.splitlines()):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except ValueError as e:
            raise UserError(f"{flag} {path}:{i + 1}: invalid JSON ({e}); each line is one object") from None
        if not isinstance(value, dict):
            raise UserError(f"{flag} {path}:{i + 1}: each line must be a JSON object, got {type(value).__name__}")
        out.append((f"{path}:{i + 1}", value))
    return out


def _path_key(records: list[tuple[str, dict[str, Any]]], path: Path, flag: str) -> str:
    first = records[0][1]
    found = next((k for k in PATH_KEYS if k in first), None)
    if found is None:
        raise UserError(f"{flag} {records[0][0]}: no image path; name the image under one of {', '.join(PATH_KEYS)}")
    return found


def mapping_index(file: str | Path, rel_paths: Sequence[str], keys: Sequence[str], flag: str = "--captions"
                  ) -> CaptionIndex:
    """The captions of `rel_paths` (the image list, relative to --data-path) from a mapping file."""
    path = Path(file).expanduser()
    records = _records(path, flag)
    if not records:
        raise UserError(f"{flag} {path}: holds no captions")
    path_key = _path_key(records, path, flag)
    by_path = {p: i for i, p in enumerate(rel_paths)}
    by_name: dict[str, int | None] = {}
    for i, p in enumerate(rel_paths):
        name = p.rsplit("/", 1)[-1]
        by_name[name] = None if name in by_name else i  # None: the name is not unique
    found: dict[int, tuple[str, list[str]]] = {}
    unmatched: dict[str, Any] = {"count": 0, "examples": []}
    for where, rec in records:
        name = rec.get(path_key)
        if not isinstance(name, str) or not name:
            raise UserError(f"{flag} {where}: no image path under {path_key!r}")
        caps = captions_of(rec, keys, f"{flag} {where}")
        rel = name.replace("\\", "/").removeprefix("./")
        index = by_path.get(rel)
        if index is None and "/" not in rel:
            index = by_name.get(rel)
        if index is None:
            _note(unmatched, f"{where}: {name}" + (" (file name not unique in --data-path)" if by_name.get(rel, 0)
                                                   is None and rel in by_name else ""))
            continue
        if index in found:
            raise UserError(f"{flag} {where}: names {rel_paths[index]} again (first at {found[index][0]}); give "
                            "all of an image's captions in one record (a list under a caption key), nothing was "
                            "written")
        found[index] = (where, caps)
    entries = [json.dumps(found[i][1], ensure_ascii=False) if i in found else "" for i in range(len(rel_paths))]
    blob, offsets = _blob(entries)
    record = {"kind": "mapping", "file": str(path.resolve()), "sha256": sha256_file(path), "keys": list(keys),
              "path_key": path_key}
    seen = sorted({k for _, rec in records for k in rec})
    return CaptionIndex("mapping", record, blob, offsets, unmatched, record_keys=tuple(seen), records=len(records))


# ----------------------------------------------------------------------------------------------------------
# Caption files beside the images

def sidecar_index(root: str | Path, rel_paths: Sequence[str]) -> CaptionIndex:
    """Each image's caption file (`<stem>.txt`, else `<stem>.json`, beside it); caption files without an image
    are counted as unmatched; two images sharing one caption file are refused."""
    root = Path(root)
    entries: list[str] = []
    owner: dict[str, str] = {}
    dirs: dict[str, set[str]] = {}
    for rel in rel_paths:
        folder, _, name = rel.rpartition("/")
        if folder not in dirs:
            try:
                dirs[folder] = set(os.listdir(root / folder)) if folder else set(os.listdir(root))
            except OSError as e:
                raise UserError(f"--captions sidecar: cannot list {root / folder} ({e.strerror or e})") from None
        stem = name.rsplit(".", 1)[0]
        entry = ""
        for suffix in CAPTION_SUFFIXES:
            if stem + suffix in dirs[folder]:
                entry = f"{folder}/{stem}{suffix}" if folder else f"{stem}{suffix}"
                break
        if entry:
            if entry in owner:
                raise UserError(f"--captions sidecar: {owner[entry]} and {rel} share the caption file {entry}; "
                                "rename one image (nothing was written)")
            owner[entry] = rel
        entries.append(entry)
    unmatched: dict[str, Any] = {"count": 0, "examples": []}
    for folder in sorted(dirs):
        for name in sorted(dirs[folder]):
            rel = f"{folder}/{name}" if folder else name
            if name.lower().endswith(CAPTION_SUFFIXES) and not name.startswith(".") and rel not in owner:
                _note(unmatched, f"{rel} (no image named {name.rsplit('.', 1)[0]}.*)")
    blob, offsets = _blob(entries)
    record = {"kind": SIDECAR, "file": None, "sha256": _sidecar_digest(root, entries),
              "keys": list(DEFAULT_CAPTION_KEYS),
              "note": "sha256 over each image's caption file name and bytes, in image order: an edited caption "
                      "changes the record, so a rerun is refused as an edited mapping file is"}
    return CaptionIndex(SIDECAR, record, blob, offsets, unmatched)


def check_coverage(index: CaptionIndex, example_path: str, flag: str = "--captions") -> None:
    """Refuse a source that gives a caption to fewer than MIN_COVERAGE of the images (before anything is written),
    with the cause: no record names an image, the records hold none of --caption-keys (naming the keys they hold),
    no caption files or members. Counts the candidates only (the caption policy may still drop some)."""
    assert index.offsets is not None
    n = len(index)
    sizes = np.diff(index.offsets)
    covered = int((sizes > (2 if index.kind == "mapping" else 0)).sum())  # a mapping's "[]": a record, no caption
    if n == 0 or covered >= max(1, int(np.ceil(MIN_COVERAGE * n))):
        return
    head = f"{flag} {index.record.get('file') or index.kind} gives a caption to {covered} of the {n} images"
    if index.kind == "mapping":
        named = int((sizes > 0).sum())
        if named == 0:
            first = index.unmatched["examples"][0] if index.unmatched["examples"] else "none"
            cause = (f"none of its {index.records} records names one of them (first: {first}); name each image by "
                     f"its path relative to --data-path (e.g. {example_path}) or by its file name")
        else:
            keys = ", ".join(index.record["keys"])
            cause = (f"its records name {named} of them, but {named - covered} of those hold nothing under "
                     f"--caption-keys {keys}; the records' keys are {', '.join(index.record_keys)}: pass the ones "
                     "that hold captions as --caption-keys")
    elif index.kind == SIDECAR:
        cause = (f"{n - covered} have no caption file beside them (<name>.txt, or <name>.json with a 'caption' or "
                 "'captions' key)")
    else:
        cause = f"{n - covered} samples of the tars have no .txt or .json member"
    raise UserError(f"{head} (fewer than {MIN_COVERAGE:.0%}): {cause} (nothing was written)")


def _sidecar_digest(root: Path, entries: Sequence[str]) -> str:
    """sha256 over (name, size, bytes) of each image's caption file in image order ("" for none), so that editing a
    caption file changes the extraction record as editing a mapping file does (issue 47: the edit was kept out of
    a rerun that kept the finished shards); an unreadable file hashes as its name alone (the worker skips it)."""
    h = hashlib.sha256()
    for entry in entries:
        h.update(entry.encode("utf-8", "surrogateescape") + b"\0")
        if entry:
            try:
                data = (root / entry).read_bytes()
            except OSError:
                data = b""
            h.update(len(data).to_bytes(8, "little") + data)
    return h.hexdigest()


def captions_record(index: CaptionIndex, shards: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The manifest's captions record from the source and the per-shard counts (extract/state.py), in shard
    order: the set's captions digest is the sha256 of the shards' digests, which the text extraction recomputes
    from the stored captions."""
    h = hashlib.sha256()
    for s in shards:
        h.update(bytes.fromhex(s["sha256"]))
    total = {k: sum(int(s[k]) for s in shards) for k in ("captions", "dropped_empty", "dropped_undecodable",
                                                         "uncaptioned")}
    used = [s for s in shards if s["per_image_max"]]
    return {"member": "captions.json", "source": dict(index.record), **total,
            "per_image": {"min": min((s["per_image_min"] for s in used), default=0),
                          "max": max((s["per_image_max"] for s in used), default=0)},
            "unmatched": dict(index.unmatched), "sha256": h.hexdigest(),
            "policy": "stripped of surrounding whitespace; empty and undecodable captions dropped and counted; an "
                      "image without a caption skipped (reason 'no caption'); captions without an image counted"}


def shard_digest(items: Sequence[tuple[str, Sequence[str]]]) -> str:
    """sha256 over a shard's (key, captions) in key order: the same bytes as the captions members' JSON."""
    h = hashlib.sha256()
    for key, caps in items:
        h.update(key.encode("ascii") + b"\t" + json.dumps(list(caps), ensure_ascii=False,
                                                          separators=(",", ":")).encode("utf-8") + b"\n")
    return h.hexdigest()
