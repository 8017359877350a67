"""Finding the images of a class-folder tree and their labels.

Follows torchvision's `ImageFolder` convention, which is what the published DiT was trained with
(docs/REFERENCE.md): a label is the index of the class folder in sorted folder-name order (ImageNet's
`n01440764` is 0 ... `n15075141` is 999), files are found recursively inside each class folder (following
symlinks) in sorted walk order, and an image is a file whose extension, case-insensitively, is one of
ImageFolder's. A class folder without images is refused, as ImageFolder refuses it, unless the caller keeps
it (`keep_empty_classes`: its label index stays taken, as with ImageFolder's `allow_empty=True`).

Deliberate differences from ImageFolder (RELIABILITY.md): hidden entries (names starting with ".") are
ignored, so a stray `.ipynb_checkpoints/` cannot become class 0 and shift every label, and macOS `._x.JPEG`
resource forks are not mistaken for images; symlink loops are not followed twice; a root whose class
folders are named like dataset splits (`train/`, `val/`: the layout many guides use one level up) is refused
unless the caller allows it (`allow_split_names`), since its "classes" would be the splits and the
validation images would be trained on.

The order of `ImageList.paths` defines the global sample index (the shard key), so it must be identical on
every rank and in every run; `fingerprint()` lets ranks and resumed runs check that it is.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dit_pipeline.common.errors import UserError

# torchvision.datasets.folder.IMG_EXTENSIONS, so our image set equals ImageFolder's.
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
# Folder names that dataset layouts use for splits (ImageNet's train/ and val/, Kaggle's test/, ...), compared
# case-insensitively.
SPLIT_NAMES = frozenset({"train", "training", "val", "valid", "validation", "test", "testing", "eval",
                         "evaluation", "dev", "holdout"})


@dataclass(frozen=True)
class ImageList:
    """The images of a class-folder tree in global-index order."""

    root: Path
    class_names: tuple[str, ...]
    paths: tuple[str, ...]      # relative to root, "/"-separated (a WebDataset tar's: "<tar name>/<member>")
    labels: tuple[int, ...]
    members: Any = None         # WebDataset input: where each image's bytes are (extract/webdataset.TarMembers)
    captions: Any = None        # --captions: where each image's captions are (extract/captions.CaptionIndex)

    def __len__(self) -> int:
        return len(self.paths)

    def head(self, n: int | None) -> "ImageList":
        """The first n images (all of them for None): `--limit` keeps the global indices unchanged."""
        if n is None or n >= len(self.paths):
            return self
        return ImageList(self.root, self.class_names, self.paths[:n], self.labels[:n],
                         self.members.head(n) if self.members is not None else None,
                         self.captions.head(n) if self.captions is not None else None)

    def fingerprint(self) -> str:
        """sha256 over the class names and the (label, path) list: equal iff the index -> image map is."""
        h = hashlib.sha256()
        for name in self.class_names:
            h.update(b"c\t" + name.encode("utf-8", "surrogateescape") + b"\n")
        for label, path in zip(self.labels, self.paths):
            h.update(f"{label}\t".encode() + path.encode("utf-8", "surrogateescape") + b"\n")
        return h.hexdigest()


def is_image_file(name: str) -> bool:
    return not name.startswith(".") and name.lower().endswith(IMAGE_EXTENSIONS)


def _check_root(root: Path, flag: str) -> None:
    if not root.exists():
        raise UserError(f"{flag} {root}: no such folder. Pass the folder that holds one sub-folder per class "
                        "(e.g. imagenet/train).")
    if not root.is_dir():
        raise UserError(f"{flag} {root}: is a file, not a folder. Pass the folder that holds one sub-folder "
                        "per class (e.g. imagenet/train).")


def _list_dir(path: Path, flag: str) -> list[os.DirEntry]:
    try:
        with os.scandir(path) as it:
            return list(it)
    except PermissionError as e:
        raise UserError(f"{flag} {path}: cannot read this folder (permission denied). Check its "
                        "permissions.") from e
    except OSError as e:
        raise UserError(f"{flag} {path}: cannot read this folder ({e.strerror or e}).") from e


def _is_dir(entry: os.DirEntry) -> bool:
    try:
        return entry.is_dir()  # follows symlinks, like ImageFolder
    except OSError:
        return False


def find_classes(root: str | Path, flag: str = "--data-path") -> list[str]:
    """Sorted names of the (non-hidden) class folders of `root`."""
    root = Path(root).expanduser()
    _check_root(root, flag)
    entries = _list_dir(root, flag)
    classes = sorted(e.name for e in entries if _is_dir(e) and not e.name.startswith("."))
    if not classes:
        loose = sum(1 for e in entries if e.is_file() and is_image_file(e.name))
        hint = (f" It holds {loose} image file(s) directly; put them in one sub-folder per class." if loose
                else "")
        raise UserError(f"{flag} {root}: no class folders found. Expected the ImageFolder layout "
                        f"ROOT/<class>/<image>, e.g. imagenet/train/n01440764/x.JPEG.{hint}")
    return classes


def _walk_class(class_dir: Path, flag: str) -> list[str]:
    """Image paths under one class folder in ImageFolder's order: sorted walk roots, then sorted names."""
    found: list[tuple[str, list[str]]] = []
    seen: set[str] = set()

    def on_error(e: OSError) -> None:
        raise UserError(f"{flag}: cannot read folder {e.filename} ({e.strerror or e}). Check its "
                        "permissions.") from e

    for dirpath, dirnames, filenames in os.walk(class_dir, followlinks=True, onerror=on_error):
        real = os.path.realpath(dirpath)
        if real in seen:  # a symlink loop: ImageFolder would recurse forever
            dirnames[:] = []
            continue
        seen.add(real)
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        found.append((dirpath, sorted(f for f in filenames if is_image_file(f))))
    found.sort(key=lambda item: item[0])
    return [os.path.join(d, f) for d, files in found for f in files]


def split_like(classes: list[str] | tuple[str, ...]) -> list[str]:
    """The class folders that look like dataset splits: all of them when every one is named like a split, or
    the split-named ones when there are at least two (train + val); none otherwise (one class called `test`
    among real class names is left alone)."""
    named = [c for c in classes if c.lower() in SPLIT_NAMES]
    return named if len(named) == len(classes) or len(named) >= 2 else []


def _check_split_names(root: Path, classes: list[str], flag: str) -> None:
    splits = split_like(classes)
    if not splits:
        return
    inner = root / splits[0]
    raise UserError(f"{flag} {root}: its class folders look like dataset splits ({', '.join(splits)}), not "
                    f"classes: every image would be labelled with its split's name, and the images of every split "
                    f"would be trained on. Pass the folder of one split, whose sub-folders are the classes (e.g. "
                    f"{flag} {inner}), or add --allow-split-names if these really are class names.")


def _check_empty_classes(root: Path, classes: list[str], labels: list[int], flag: str) -> None:
    used = set(labels)
    empty = [name for label, name in enumerate(classes) if label not in used]
    if not empty:
        return
    shown = ", ".join(empty[:5]) + (f" and {len(empty) - 5} more" if len(empty) > 5 else "")
    raise UserError(f"{flag} {root}: {len(empty)} of {len(classes)} class folder(s) hold no image files ({shown}); "
                    "torchvision's ImageFolder refuses this too. Remove them or add their images, or pass "
                    "--keep-empty-classes to keep their labels (each keeps its index in sorted order, so the other "
                    "labels stay those of ImageFolder(allow_empty=True)).")


def scan_flat_folder(root: str | Path, flag: str = "--data-path") -> ImageList | None:
    """A captioned folder without class folders: the images directly in `root`, sorted by name, all label 0 of
    one class "unlabeled" (T2I data has no classes); None when `root` has class folders (then it is an
    ImageFolder tree, whose labels are kept) or no loose images."""
    root = Path(root).expanduser()
    _check_root(root, flag)
    entries = _list_dir(root, flag)
    if any(_is_dir(e) and not e.name.startswith(".") for e in entries):
        return None
    names = sorted(e.name for e in entries if e.is_file() and is_image_file(e.name))
    if not names:
        return None
    return ImageList(root.resolve(), ("unlabeled",), tuple(names), (0,) * len(names))


def scan_image_folder(root: str | Path, flag: str = "--data-path", *, allow_split_names: bool = False,
                      keep_empty_classes: bool = False) -> ImageList:
    """All images of an ImageFolder-style tree with their labels; UserError for anything unusable.

    allow_split_names: accept class folders named like splits (train, val, ...; see `split_like`).
    keep_empty_classes: a class folder without images keeps its label instead of being refused.
    """
    root = Path(root).expanduser()
    classes = find_classes(root, flag)
    if not allow_split_names:
        _check_split_names(root, classes, flag)
    paths: list[str] = []
    labels: list[int] = []
    base = str(root)
    for label, name in enumerate(classes):
        for full in _walk_class(root / name, flag):
            paths.append(Path(os.path.relpath(full, base)).as_posix())
            labels.append(label)
    if not paths:
        raise UserError(f"{flag} {root}: found {len(classes)} class folder(s) but no image files in them "
                        f"(looked for {', '.join(IMAGE_EXTENSIONS)}, any case).")
    if not keep_empty_classes:
        _check_empty_classes(root, classes, labels, flag)
    return ImageList(root.resolve(), tuple(classes), tuple(paths), tuple(labels))
