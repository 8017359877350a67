"""The images of an FID reference batch (`dit-eval --make-ref FOLDER`): every image under FOLDER (recursively,
sorted by relative path; hidden files and folders left out), decoded as `dit-extract` decodes them and cut with
ADM's center crop (guided-diffusion's `center_crop_arr`: halve with BOX while the short side is at least twice
the target, then BICUBIC to the target short side, then the center square), so the reference is prepared as the
training images were. An undecodable file is skipped and named; evaluate/reference.py adds the statistics."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from dit_pipeline.common.errors import UserError
from dit_pipeline.extract.files import is_image_file
from dit_pipeline.extract.images import SkippedImage, load_and_crop


def reference_images(folder: str | Path, size: int,
                     quiet: bool = False) -> tuple[np.ndarray, list[str], list[tuple[str, str]]]:
    """(uint8 [N, size, size, 3], the relative paths used, the (path, reason) of each skipped file); a progress
    bar on a terminal unless `quiet`."""
    from tqdm.auto import tqdm

    from dit_pipeline.common.log import progress_enabled

    root = Path(folder).expanduser()
    if not root.is_dir():
        raise UserError(f"--make-ref {folder}: not a folder of images")
    files = sorted((f for f in root.rglob("*") if f.is_file() and is_image_file(f.name)
                    and not any(part.startswith(".") for part in f.relative_to(root).parts)),
                   key=lambda f: f.relative_to(root).as_posix())
    crops, used, skipped = [], [], []
    for f in tqdm(files, unit="img", desc="crop", dynamic_ncols=True, disable=not progress_enabled(quiet)):
        rel = f.relative_to(root).as_posix()
        try:
            crops.append(load_and_crop(f, size)[0])
            used.append(rel)
        except SkippedImage as e:
            skipped.append((rel, e.reason))
    if len(crops) < 2:
        raise UserError(f"--make-ref {folder}: {len(crops)} usable image(s) of {len(files)}; a reference batch needs "
                        "at least 2 (10,000 or more for FID numbers worth comparing)")
    return np.stack(crops), used, skipped
