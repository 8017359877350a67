"""An FID reference batch as the ADM evaluator's reference files are (`dit-eval --make-ref FOLDER --out REF.npz`):
`arr_0` uint8 [N, H, W, 3] (the images, cut by extract/reference.py) and the Inception statistics of all of them,
`mu`, `sigma` (pool features, 2048) and `mu_s`, `sigma_s` (spatial features), which `dit-eval SAMPLES --ref
REF.npz` then uses for FID and sFID (precision and recall use the images); plus `extractor`, the identity of the
network that made the statistics (JSON: weights file and sha256 or the random seed, input size, resize), which
dit-eval compares with its own network before using them (evaluate/run.py `check_network`). A captioned reference
(`--captions FILE`) also writes its prompts beside it, `REF.prompts.jsonl` (common/prompts.py: one record per
image of `arr_0`, in its order, `{"prompt", "file"}`): the file `dit-sample --prompts` generates from and
`dit-eval --prompts` scores against."""
from __future__ import annotations

import errno
import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dit_pipeline.common.errors import UserError
from dit_pipeline.common.faults import fault_point
from dit_pipeline.common.io import atomic_write, check_writable_dir
from dit_pipeline.common.log import progress_enabled
from dit_pipeline.common.prompts import write_prompts
from dit_pipeline.evaluate import metrics as M
from dit_pipeline.evaluate.features import local_features
from dit_pipeline.evaluate.inception import describe_network, load_inception


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


def _mib(nbytes: int) -> str:
    """"32.1 MiB", "3.8 KiB" (issue 47: a 32.1 MiB file was said to need "about 0 MiB", its images alone)."""
    return f"{nbytes / 2**20:.1f} MiB" if nbytes >= 2**20 // 10 else f"{nbytes / 2**10:.1f} KiB"


def write_reference(images: np.ndarray, out: Path, *, inception: str | None = None, batch_size: int = 64,
                    device: torch.device | str = "cpu", random_seed: int | None = None, input_size: int = 299,
                    quiet: bool = False, log: logging.Logger | None = None,
                    records: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Compute the Inception statistics of `images` (one process, a progress bar) and write REF.npz atomically
    (and, for a captioned reference, `records` to REF.prompts.jsonl first); a summary {path, count, image_size,
    extractor, bytes, prompts}. A full disk is a UserError, and nothing is left (no prompts file either)."""
    from tqdm.auto import tqdm

    model, ident = load_inception(inception, device=device, random_seed=random_seed, input_size=input_size)
    if log is not None:
        log.info("Inception statistics of %d images with %s", len(images), describe_network(ident))
    batches = ((list(range(i, min(i + batch_size, len(images)))), images[i:i + batch_size])
               for i in range(0, len(images), batch_size))
    with tqdm(total=len(images), unit="img", desc="Inception", dynamic_ncols=True,
              disable=not progress_enabled(quiet)) as bar:
        _, feats = local_features(model, batches, torch.device(device), bar.update)
    pool, spatial = M.statistics(feats["pool"]), M.statistics(feats["spatial"])
    prompts = None
    needed = images.nbytes + sum(np.asarray(a).nbytes for a in (pool.mu, pool.sigma, spatial.mu, spatial.sigma))
    try:
        if records is not None:
            assert len(records) == len(images), (len(records), len(images))
            prompts = write_prompts(prompts_path(out), records)
        with atomic_write(out) as f:
            fault_point("eval.make_ref_write")
            np.savez(f, arr_0=images, mu=pool.mu, sigma=pool.sigma, mu_s=spatial.mu, sigma_s=spatial.sigma,
                     extractor=np.array(json.dumps(ident, sort_keys=True)))
    except OSError as e:
        if prompts is not None:
            Path(prompts).unlink(missing_ok=True)
        full = " (the disk is full)" if e.errno == errno.ENOSPC else ""
        raise UserError(f"cannot write --out {out}: {e.strerror or e}{full}; nothing was written. Free space or "
                        f"pass --out on another disk (it needs at least {_mib(needed)})") from None
    return {"path": str(out), "count": int(len(images)), "image_size": int(images.shape[1]), "extractor": ident,
            "bytes": out.stat().st_size, "prompts": str(prompts) if prompts else None}
