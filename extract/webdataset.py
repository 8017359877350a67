"""WebDataset tars of image + caption as `dit-extract --data-path` (BLIP3o's layout, as NanoGen's
`BLIP3OWebDataset` reads it: `<key>.jpg|png|jpeg|webp` with `<key>.txt`, or a `<key>.json` holding the caption).

The tars (a folder of `*.tar`, in sorted name order) are scanned once, headers only (tarfile seeks over the
data): the global index of a sample is its position in (tar order, member order), as the ImageFolder order is
for folders, so keys, shards and ranks follow extract/plan.py unchanged and every image is encoded exactly once
for any world size. A decode worker then reads an image's bytes at their recorded offset (`TarMembers.read`),
and its caption members likewise (extract/captions.py applies the caption policy).

Grouping follows WebDataset's rule: a member's key is its path up to the first "." of its file name, its field
the rest, lower-cased; a sample's members are consecutive. Member names are never used as paths; links,
folders and other non-regular members are ignored, and so are hidden names. A key met twice in a tar, or a
sample with two images, is refused naming the tar and the key. A sample with captions but no image is counted
as a caption without an image. Labels come from a `.cls` member when the samples have one (all of them must),
else every sample is label 0 of one class, "unlabeled".
"""
from __future__ import annotations

import os
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dit_pipeline.common.errors import UserError
from dit_pipeline.extract.captions import CaptionIndex, _blob, _note, parse_caption_member
from dit_pipeline.extract.files import IMAGE_EXTENSIONS, ImageList

IMAGE_FIELDS = tuple(e.lstrip(".") for e in IMAGE_EXTENSIONS)
CAPTION_FIELDS = ("txt", "json")
UNLABELED = "unlabeled"


def tar_files(root: Path) -> list[Path]:
    """The `*.tar` files directly in `root`, sorted by name (hidden ones ignored)."""
    try:
        return sorted(p for p in root.iterdir() if p.name.endswith(".tar") and not p.name.startswith(".")
                      and p.is_file())
    except OSError:
        return []


@dataclass
class TarMembers:
    """Where each global index's image bytes are: (tar, offset, size); read by the decode workers."""

    tars: list[str]
    tar: np.ndarray
    offset: np.ndarray
    size: np.ndarray
    _files: dict[int, Any] = field(default_factory=dict, repr=False, compare=False)

    def head(self, n: int) -> "TarMembers":
        return TarMembers(self.tars, self.tar[:n], self.offset[:n], self.size[:n])

    def read_at(self, tar: int, offset: int, size: int) -> bytes:
        f = self._files.get(tar)
        if f is None or f[0] != os.getpid():  # one handle per process (forked workers open their own)
            f = (os.getpid(), open(self.tars[tar], "rb"))
            self._files[tar] = f
        f[1].seek(offset)
        return f[1].read(size)

    def read(self, index: int) -> bytes:
        return self.read_at(int(self.tar[index]), int(self.offset[index]), int(self.size[index]))

    def __getstate__(self) -> dict[str, Any]:  # open files stay in their process
        return {**self.__dict__, "_files": {}}


def _split(name: str) -> tuple[str, str] | None:
    """(key, field) of a member name by WebDataset's rule; None for a name without a field or a hidden name."""
    folder, _, base = name.rpartition("/")
    if base.startswith(".") or "." not in base:
        return None
    stem, _, suffix = base.partition(".")
    return (f"{folder}/{stem}" if folder else stem), suffix.lower()


def _samples(path: Path):
    """(key, {field: (offset, size)}) of every sample of one tar, in member order; UserError for a key met twice."""
    try:
        tf = tarfile.open(path, mode="r:")
    except (tarfile.TarError, OSError) as e:
        raise UserError(f"--data-path {path}: not a readable uncompressed tar ({e}); nothing was written") from None
    seen: dict[str, str] = {}
    key: str | None = None
    fields: dict[str, tuple[int, int]] = {}
    with tf:
        try:
            for m in tf:
                split = _split(m.name) if m.isreg() else None
                if split is None:
                    continue
                k, f = split
                if k != key:
                    if key is not None:
                        yield key, fields
                    if k in seen:
                        raise UserError(f"--data-path {path}: key {k!r} appears twice ({seen[k]} and {m.name}): a "
                                        "duplicate sample or members out of order; fix the tar (nothing was written)")
                    key, fields = k, {}
                    seen[k] = m.name
                if f in fields:
                    raise UserError(f"--data-path {path}: key {k!r} has two {f!r} members; fix the tar (nothing was "
                                    "written)")
                fields[f] = (m.offset_data, m.size)
        except tarfile.TarError as e:
            raise UserError(f"--data-path {path}: damaged tar after key {key!r} ({e}); nothing was written") from None
    if key is not None:
        yield key, fields


def _label(path: Path, key: str, span: tuple[int, int]) -> int:
    with open(path, "rb") as f:
        f.seek(span[0])
        data = f.read(min(span[1], 32)).strip()
    if not data.isdigit():
        raise UserError(f"--data-path {path}: key {key!r}: its cls member {data[:20]!r} is not a class index")
    return int(data)


def scan_webdataset(root: str | Path, *, captions: bool, caption_keys: tuple[str, ...]
                    ) -> tuple[ImageList, TarMembers, CaptionIndex | None]:
    """The images of a folder of WebDataset tars, their byte locations and (with `captions`) their captions."""
    root = Path(root).expanduser().resolve()
    tars = tar_files(root)
    if not tars:
        raise UserError(f"--data-path {root}: no .tar files found")
    paths: list[str] = []
    labels: list[int | None] = []
    where: list[tuple[int, int, int]] = []
    entries: list[str] = []
    unmatched: dict[str, Any] = {"count": 0, "examples": []}
    for t, path in enumerate(tars):
        for key, fields in _samples(path):
            images = [f for f in fields if f in IMAGE_FIELDS]
            if len(images) > 1:
                raise UserError(f"--data-path {path}: key {key!r} has {len(images)} images ({', '.join(images)}); "
                                "fix the tar (nothing was written)")
            caps = [f for f in CAPTION_FIELDS if f in fields]
            if not images:
                if caps:
                    _note(unmatched, f"{path.name}: {key} (captions, no image)")
                continue
            paths.append(f"{path.name}/{key}.{images[0]}")
            where.append((t, *fields[images[0]]))
            labels.append(_label(path, key, fields["cls"]) if "cls" in fields else None)
            entries.append(";".join(f"{t}:{fields[c][0]}:{fields[c][1]}:{c}" for c in caps))
    if not paths:
        raise UserError(f"--data-path {root}: its {len(tars)} tar(s) hold no images (members named <key>.jpg, .png, "
                        ".webp, ...)")
    labelled = [x is not None for x in labels]
    if any(labelled) and not all(labelled):
        missing = paths[labelled.index(False)]
        raise UserError(f"--data-path {root}: some samples have a .cls label and some do not (first without: "
                        f"{missing}); labels must be all or none")
    if all(labelled):
        n = max(x for x in labels if x is not None) + 1
        class_names: tuple[str, ...] = tuple(str(i) for i in range(n))
        final = [int(x) for x in labels if x is not None]
    else:
        class_names, final = (UNLABELED,), [0] * len(paths)
    arr = np.asarray(where, dtype=np.int64)
    members = TarMembers([str(p) for p in tars], arr[:, 0], arr[:, 1], arr[:, 2])
    images = ImageList(root, class_names, tuple(paths), tuple(final), members=members)
    index = None
    if captions:
        blob, offsets = _blob(entries)
        record = {"kind": "webdataset", "file": None, "keys": list(caption_keys),
                  "sha256": images.fingerprint(), "note": "the tars' caption members (.txt, .json)"}
        index = CaptionIndex("webdataset", record, blob, offsets, unmatched, members=members)
    return images, members, index
