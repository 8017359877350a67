"""The images of an FID reference batch (`dit-eval --make-ref FOLDER`): every image under FOLDER (recursively,
sorted by relative path; hidden files and folders left out), decoded as `dit-extract` decodes them and cut to
the target size, so the reference is prepared as the training images were. Two cuts:
- "adm" (the default): ADM's center crop (guided-diffusion's `center_crop_arr`: halve with BOX while the short
  side is at least twice the target, then BICUBIC to the target short side, then the center square);
- "resize": torchvision's `Resize(size, BICUBIC)` then `CenterCrop(size)`, the transform NanoGen applies to the
  images of its text-to-image evaluation sets (End2End-Diffusion/diffusion-bench
  `src/data/unified_dataloader.py`, `_prepare_t2i_hf_loader`).
An undecodable file is skipped and named; evaluate/reference.py adds the statistics.

A captioned reference (`--make-ref FOLDER --captions FILE`, COCO-30k / MJHQ-30k style) keeps the images that
have a caption, in the same order, and gives each one caption: its only one, or one drawn with
`derive_seed(seed, STREAM_REFERENCE_CAPTION, i)` (i = its position in the reference) when it has several, as
COCO-30k draws one of an image's five. These are the prompts the samples are generated from.

A captions FILE is
- JSON Lines or CSV: one record per line/row with the image (`file_name`, `file`, `image` or `path`) and its
  caption (`caption`, `text` or `prompt`: a string, or in JSON a list of strings);
- JSON: a list of such records; COCO's `captions_*.json` (`images` with `id` and `file_name`, `annotations`
  with `image_id` and `caption`); or an object keyed by image whose values are a caption or a record with one
  (MJHQ-30k's `meta_data.json`: `{"<id>": {"category": ..., "prompt": ...}}`).
An image is named by its path relative to FOLDER, or by its file name or stem when that is unique under FOLDER.
"""
from __future__ import annotations

import csv
import io
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dit_pipeline.common.errors import UserError
from dit_pipeline.common.seeding import numpy_rng
from dit_pipeline.extract.files import is_image_file
from dit_pipeline.extract.images import SkippedImage, adm_center_crop, load_rgb

CROPS = ("adm", "resize")
STREAM_REFERENCE_CAPTION = 101  # a seed stream of its own (common/seeding.py's streams are 1..5)
_FILE_KEYS = ("file_name", "file", "image", "path")
_CAPTION_KEYS = ("caption", "captions", "text", "prompt")


def cut(image: Any, size: int, crop: str) -> np.ndarray:
    """An RGB PIL image cut to uint8 [size, size, 3] by `crop` (see the module docstring)."""
    if crop == "adm":
        return adm_center_crop(image, size)
    from torchvision.transforms import InterpolationMode
    from torchvision.transforms import functional as TF

    resized = TF.resize(image, size, interpolation=InterpolationMode.BICUBIC)
    return np.ascontiguousarray(np.asarray(TF.center_crop(resized, [size, size])))


def _image_files(root: Path, flag: str) -> list[Path]:
    if not root.is_dir():
        raise UserError(f"{flag} {root}: not a folder of images")
    return sorted((f for f in root.rglob("*") if f.is_file() and is_image_file(f.name)
                   and not any(part.startswith(".") for part in f.relative_to(root).parts)),
                  key=lambda f: f.relative_to(root).as_posix())


def _decode(root: Path, files: list[Path], size: int, crop: str) -> tuple[list[np.ndarray], list[str],
                                                                           list[tuple[str, str]]]:
    crops, used, skipped = [], [], []
    for f in files:
        rel = f.relative_to(root).as_posix()
        try:
            crops.append(cut(load_rgb(f)[0], size, crop))
            used.append(rel)
        except SkippedImage as e:
            skipped.append((rel, e.reason))
    return crops, used, skipped


def _enough(folder: str | Path, crops: list[np.ndarray], total: int) -> np.ndarray:
    if len(crops) < 2:
        raise UserError(f"--make-ref {folder}: {len(crops)} usable image(s) of {total}; a reference batch needs "
                        "at least 2 (10,000 or more for FID numbers worth comparing)")
    return np.stack(crops)


def reference_images(folder: str | Path, size: int, crop: str = "adm") -> tuple[np.ndarray, list[str],
                                                                                 list[tuple[str, str]]]:
    """(uint8 [N, size, size, 3], the relative paths used, the (path, reason) of each skipped file)."""
    root = Path(folder).expanduser()
    files = _image_files(root, "--make-ref")
    crops, used, skipped = _decode(root, files, size, crop)
    return _enough(folder, crops, len(files)), used, skipped


@dataclass
class CaptionedReference:
    images: np.ndarray                                   # uint8 [N, size, size, 3]
    records: list[dict[str, Any]]                        # per image: {"prompt", "file"}, aligned with images
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (file, reason): undecodable or missing
    uncaptioned: int = 0                                 # images under FOLDER without a caption (left out)


def captioned_reference(folder: str | Path, captions: str | Path, size: int, crop: str = "adm",
                        seed: int = 0) -> CaptionedReference:
    """The captioned images of FOLDER, cut, each with one caption (see the module docstring)."""
    root = Path(folder).expanduser()
    files = _image_files(root, "--make-ref")
    entries = read_captions(captions)
    by_file = _match(root, files, entries, captions)
    chosen = [f for f in files if f in by_file]
    if not chosen:
        raise UserError(f"--captions {captions}: none of its {len(entries)} captions names an image under {folder} "
                        f"(of {len(files)}); an image is named by its path relative to the folder, or by its unique "
                        "file name or stem")
    crops, used, skipped = _decode(root, chosen, size, crop)
    missing = [(key, "named in the captions file but not found under the folder") for key in by_file.get(None, [])]
    records = []
    for i, rel in enumerate(used):
        options = by_file[root / rel]
        pick = 0 if len(options) == 1 else int(numpy_rng(seed, STREAM_REFERENCE_CAPTION, i).integers(len(options)))
        records.append({"prompt": options[pick], "file": rel})
    return CaptionedReference(_enough(folder, crops, len(chosen)), records, skipped + missing,
                              uncaptioned=len(files) - len(chosen))


def _match(root: Path, files: list[Path], entries: list[tuple[str, list[str]]],
           captions: str | Path) -> dict[Any, list[str]]:
    """{image file: its captions (in file order)}, and under None the keys that name no image."""
    by_rel = {f.relative_to(root).as_posix(): f for f in files}
    by_name: dict[str, list[Path]] = {}
    for f in files:
        for name in {f.name, f.stem}:
            by_name.setdefault(name, []).append(f)
    out: dict[Any, list[str]] = {}
    for key, texts in entries:
        rel = key.replace("\\", "/")
        while rel.startswith("./"):
            rel = rel[2:]
        found = by_rel.get(rel)
        if found is None:
            candidates = by_name.get(rel, [])
            if len(candidates) > 1:
                shown = ", ".join(c.relative_to(root).as_posix() for c in candidates[:3])
                raise UserError(f"--captions {captions}: {key!r} could be any of {shown}; name the image by its "
                                "path relative to the folder")
            found = candidates[0] if candidates else None
        if found is None:
            out.setdefault(None, []).append(key)
        else:
            out.setdefault(found, []).extend(texts)
    return out


def _texts(value: Any, where: str) -> list[str]:
    texts = [value] if isinstance(value, str) else value if isinstance(value, list) else None
    if not texts or not all(isinstance(t, str) and t.strip() for t in texts):
        raise UserError(f"{where}: the caption must be a non-empty string (or a list of them), got {value!r}")
    return [t.strip() for t in texts]


def _entry(obj: Any, where: str, key: str | None = None) -> tuple[str, list[str]]:
    if isinstance(obj, str) and key is not None:
        return key, _texts(obj, where)
    if not isinstance(obj, dict):
        raise UserError(f"{where}: expected a record with an image and a caption, got {type(obj).__name__}")
    image = key if key is not None else next((obj[k] for k in _FILE_KEYS if k in obj), None)
    text_key = next((k for k in _CAPTION_KEYS if k in obj), None)
    if image is None or text_key is None:
        raise UserError(f"{where}: needs the image ({'/'.join(_FILE_KEYS)}) and its caption "
                        f"({'/'.join(_CAPTION_KEYS)}); found {', '.join(sorted(obj)) or 'nothing'}")
    return str(image), _texts(obj[text_key], where)


def read_captions(path: str | Path) -> list[tuple[str, list[str]]]:
    """(image key, captions) pairs of a captions file, in file order (see the module docstring)."""
    p = Path(path).expanduser()
    flag = f"--captions {p}"
    try:
        text = p.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{flag}: cannot read it ({getattr(e, 'strerror', None) or e})") from None
    suffix = p.suffix.lower()
    if suffix == ".csv":
        rows = list(csv.DictReader(io.StringIO(text)))
        entries = [_entry(row, f"{flag} row {i + 2}") for i, row in enumerate(rows)]
    elif suffix == ".jsonl":
        entries = []
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    entries.append(_entry(json.loads(line), f"{flag} line {n}"))
                except ValueError as e:
                    raise UserError(f"{flag} line {n}: not JSON ({e})") from None
    elif suffix == ".json":
        try:
            data = json.loads(text)
        except ValueError as e:
            raise UserError(f"{flag}: not JSON ({e})") from None
        entries = _json_entries(data, flag)
    else:
        raise UserError(f"{flag}: a captions file is .jsonl, .csv or .json")
    if not entries:
        raise UserError(f"{flag} holds no captions")
    return entries


def _json_entries(data: Any, flag: str) -> list[tuple[str, list[str]]]:
    if isinstance(data, dict) and "images" in data and "annotations" in data:  # COCO captions_*.json
        names = {img["id"]: img["file_name"] for img in data["images"]}
        entries = []
        for i, ann in enumerate(data["annotations"]):
            if ann.get("image_id") not in names:
                raise UserError(f"{flag}: annotation {i} names image_id {ann.get('image_id')!r}, which is not "
                                "among its images")
            entries.append((names[ann["image_id"]], _texts(ann.get("caption"), f"{flag} annotation {i}")))
        return entries
    if isinstance(data, dict):
        return [_entry(v, f"{flag} entry {k!r}", key=str(k)) for k, v in data.items()]
    if isinstance(data, list):
        return [_entry(v, f"{flag} entry {i}") for i, v in enumerate(data)]
    raise UserError(f"{flag}: expected a list of records, COCO's captions format or an object keyed by image")
