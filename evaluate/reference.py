"""An FID reference batch as the ADM evaluator's reference files are (`dit-eval --make-ref FOLDER --out REF.npz`):
`arr_0` uint8 [N, H, W, 3] (the images, cut by extract/reference.py) and the Inception statistics of all of them,
`mu`, `sigma` (pool features, 2048) and `mu_s`, `sigma_s` (spatial features), which `dit-eval SAMPLES --ref
REF.npz` then uses for FID and sFID (precision and recall use the images). A captioned reference
(`--captions FILE`) also writes its prompts beside it, `REF.prompts.jsonl` (common/prompts.py: one record per
image of `arr_0`, in its order, `{"prompt", "file"}`): the file `dit-sample --prompts` generates from and
`dit-eval --prompts` scores against."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dit_pipeline.common.errors import UserError
from dit_pipeline.common.io import atomic_write, check_writable_dir
from dit_pipeline.common.prompts import write_prompts
from dit_pipeline.evaluate import metrics as M
from dit_pipeline.evaluate.features import local_features
from dit_pipeline.evaluate.inception import load_inception


def prompts_path(ref: Path) -> Path:
    """Where a captioned reference's prompts go: REF.npz -> REF.prompts.jsonl."""
    return ref.with_name(ref.stem + ".prompts.jsonl")


def check_output(out: str | Path, captioned: bool = False) -> Path:
    """REF.npz's folder is writable (before any work); an existing file (or prompts file) is refused."""
    path = Path(out).expanduser()
    if path.suffix != ".npz":
        raise UserError(f"--out {out}: a reference batch is an .npz file (e.g. val256.npz)")
    if path.exists():
        raise UserError(f"--out {path} already exists; remove it or choose another name")
    if captioned and prompts_path(path).exists():
        raise UserError(f"--out {out}: its prompts file {prompts_path(path)} already exists; remove it or choose "
                        "another name")
    check_writable_dir(path.parent, f"--out {out}")
    return path


def write_reference(images: np.ndarray, out: Path, *, inception: str | None = None, batch_size: int = 64,
                    device: torch.device | str = "cpu", random_seed: int | None = None, input_size: int = 299,
                    log: logging.Logger | None = None, records: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Compute the Inception statistics of `images` (one process) and write REF.npz atomically (and, for a
    captioned reference, `records` to REF.prompts.jsonl first); a summary."""
    model, ident = load_inception(inception, device=device, random_seed=random_seed, input_size=input_size)
    batches = ((list(range(i, min(i + batch_size, len(images)))), images[i:i + batch_size])
               for i in range(0, len(images), batch_size))
    _, feats = local_features(model, batches, torch.device(device))
    pool, spatial = M.statistics(feats["pool"]), M.statistics(feats["spatial"])
    prompts = None
    if records is not None:
        assert len(records) == len(images), (len(records), len(images))
        prompts = write_prompts(prompts_path(out), records)
    with atomic_write(out) as f:
        np.savez(f, arr_0=images, mu=pool.mu, sigma=pool.sigma, mu_s=spatial.mu, sigma_s=spatial.sigma)
    if log is not None:
        log.info("wrote %s: %d images of %dx%d and their Inception statistics (%s)", out, len(images),
                 images.shape[1], images.shape[2], ident["weights"])
        if prompts is not None:
            log.info("wrote %s: the %d captions, one per image, in the order of %s", prompts, len(images), out.name)
    return {"path": str(out), "count": int(len(images)), "image_size": int(images.shape[1]), "extractor": ident,
            "prompts": str(prompts) if prompts else None}
