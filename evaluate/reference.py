"""An FID reference batch as the ADM evaluator's reference files are (`dit-eval --make-ref FOLDER --out REF.npz`):
`arr_0` uint8 [N, H, W, 3] (the images, cut by extract/reference.py) and the Inception statistics of all of them,
`mu`, `sigma` (pool features, 2048) and `mu_s`, `sigma_s` (spatial features), which `dit-eval SAMPLES --ref
REF.npz` then uses for FID and sFID (precision and recall use the images)."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dit_pipeline.common.errors import UserError
from dit_pipeline.common.io import atomic_write, check_writable_dir
from dit_pipeline.evaluate import metrics as M
from dit_pipeline.evaluate.features import local_features
from dit_pipeline.evaluate.inception import load_inception


def check_output(out: str | Path) -> Path:
    """REF.npz's folder is writable (before any work); an existing file is refused."""
    path = Path(out).expanduser()
    if path.suffix != ".npz":
        raise UserError(f"--out {out}: a reference batch is an .npz file (e.g. val256.npz)")
    if path.exists():
        raise UserError(f"--out {path} already exists; remove it or choose another name")
    check_writable_dir(path.parent, f"--out {out}")
    return path


def write_reference(images: np.ndarray, out: Path, *, inception: str | None = None, batch_size: int = 64,
                    device: torch.device | str = "cpu", random_seed: int | None = None, input_size: int = 299,
                    log: logging.Logger | None = None) -> dict[str, Any]:
    """Compute the Inception statistics of `images` (one process) and write REF.npz atomically; a summary."""
    model, ident = load_inception(inception, device=device, random_seed=random_seed, input_size=input_size)
    batches = ((list(range(i, min(i + batch_size, len(images)))), images[i:i + batch_size])
               for i in range(0, len(images), batch_size))
    _, feats = local_features(model, batches, torch.device(device))
    pool, spatial = M.statistics(feats["pool"]), M.statistics(feats["spatial"])
    with atomic_write(out) as f:
        np.savez(f, arr_0=images, mu=pool.mu, sigma=pool.sigma, mu_s=spatial.mu, sigma_s=spatial.sigma)
    if log is not None:
        log.info("wrote %s: %d images of %dx%d and their Inception statistics (%s)", out, len(images),
                 images.shape[1], images.shape[2], ident["weights"])
    return {"path": str(out), "count": int(len(images)), "image_size": int(images.shape[1]), "extractor": ident}
