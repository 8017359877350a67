"""Inception features of a source, in GPU batches across all ranks, cached beside the source.

Images are cut into consecutive batches of `batch_size` and batch k goes to rank k % world_size (the split of
`dit-sample`), so every batch holds the same images whatever the number of ranks: features do not depend on
the world size. Rank 0 collects every rank's rows (in rounds of bounded size through one all-gather) and holds
the result; the other ranks get None.

The cache: `.NAME.<sha256[:16]>.<extractor>.features.npz` beside the input (NAME is the file or folder name),
keyed by the content hash of the input and the extractor identity (version and weights), written atomically by
rank 0. A second evaluation of the same input is a file read. Arrays: `pool` [N, 2048], `spatial` [N, 2023],
`logits` [N, 1008] float32 (no `spatial` from torch-fidelity's network), `format`, and `meta` (JSON: source, hash,
extractor). Such a file can also be passed to `dit-eval` directly.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np
import torch

from dit_pipeline.common import distributed as dist
from dit_pipeline.common.io import atomic_write
from dit_pipeline.common.log import progress_enabled
from dit_pipeline.evaluate.inception import LOGITS_DIM, POOL_DIM, SPATIAL_DIM
from dit_pipeline.evaluate.inputs import FEATURES_FORMAT, Source, read_features_file
from dit_pipeline.sample.plan import rank_batches

KEYS = ("pool", "spatial", "logits")
_ROWS_PER_ROUND = 2048  # rows each rank sends per all-gather round (about 40 MB)


def extractor_tag(ident: dict[str, Any]) -> str:
    """Short, filename-safe extractor identity: version plus the weights' hash (or 'random-seed-N')."""
    weights = (ident.get("weights_sha256") or "")[:8] or str(ident.get("weights"))
    return f"{ident['extractor']}-{weights}"


def cache_path(source: Source, content_sha256: str, ident: dict[str, Any]) -> Path:
    return source.path.parent / f".{source.path.name}.{content_sha256[:16]}.{extractor_tag(ident)}.features.npz"


@torch.no_grad()
def batch_features(model: torch.nn.Module, images: np.ndarray | torch.Tensor,
                   device: torch.device) -> dict[str, np.ndarray]:
    """One batch of uint8 [n, H, W, 3] -> float32 arrays {pool, spatial, logits} on the CPU."""
    x = images if isinstance(images, torch.Tensor) else torch.from_numpy(np.array(images, np.uint8))  # writable copy
    x = x.to(device)
    out = model(x)
    return {k: v.cpu().numpy() for k, v in out.items()}  # KEYS, and any extra output (evaluate.hook: "dinov2")


def local_features(model: torch.nn.Module, batches: Iterable[tuple[list[int], np.ndarray]], device: torch.device,
                   progress: Callable[[int], None] | None = None) -> tuple[list[int], dict[str, np.ndarray]]:
    """This rank's (indices, features) for its (indices, images) batches."""
    idx: list[int] = []
    parts: dict[str, list[np.ndarray]] = {}  # the network's outputs (torch-fidelity's has no "spatial")
    for indices, images in batches:
        feats = batch_features(model, images, device)
        idx.extend(indices)
        for k, v in feats.items():
            parts.setdefault(k, []).append(v)
        if progress is not None:
            progress(len(indices))
    dims = {"pool": POOL_DIM, "spatial": SPATIAL_DIM, "logits": LOGITS_DIM}
    if not parts:  # no batch on this rank
        parts = {k: [] for k in KEYS}
    arrays = {k: (np.concatenate(v) if v else np.zeros((0, dims.get(k, 0)), np.float32)) for k, v in parts.items()}
    return idx, arrays


def gather_rows(indices: list[int], arrays: dict[str, np.ndarray], total: int,
                rows_per_rank: list[int]) -> dict[str, np.ndarray] | None:
    """Every rank's rows placed by global index, on rank 0 ([total, D] arrays); None on other ranks.

    rows_per_rank: how many rows each rank holds (known to all from the deterministic split).
    """
    if not dist.is_initialized():
        order = np.argsort(np.asarray(indices, np.int64), kind="stable")
        return {k: v[order] for k, v in arrays.items()}
    out: dict[str, np.ndarray] | None = None
    rounds = -(-max(rows_per_rank) // _ROWS_PER_ROUND) if rows_per_rank else 0
    for r in range(rounds):
        lo, hi = r * _ROWS_PER_ROUND, (r + 1) * _ROWS_PER_ROUND
        mine = (indices[lo:hi], {k: v[lo:hi] for k, v in arrays.items()})
        with dist.peer_guard("gathering Inception features"):
            everyone = dist.all_gather_object(mine)
        if not dist.is_main():
            continue
        for idx, part in everyone:
            if not idx:
                continue
            if out is None:
                out = {k: np.zeros((total, v.shape[1]), np.float32) for k, v in part.items()}
            for k, v in part.items():
                out[k][np.asarray(idx, np.int64)] = v
    return out


def write_features(path: Path, arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> None:
    with atomic_write(path) as f:
        np.savez(f, format=np.array(FEATURES_FORMAT), meta=np.array(json.dumps(meta, sort_keys=True)),
                 **{k: np.ascontiguousarray(arrays[k], np.float32) for k in KEYS if k in arrays})


def source_features(source: Source, model: torch.nn.Module, ident: dict[str, Any], *, batch_size: int,
                    device: torch.device, use_cache: bool, quiet: bool,
                    log: logging.Logger) -> dict[str, np.ndarray] | None:
    """Features of every image of `source` (see the module docstring): arrays on rank 0, None elsewhere."""
    from tqdm.auto import tqdm

    if source.kind == "features":
        return read_features_file(source.path)[0] if dist.is_main() else None
    # the content hash keys the cache (one more pass over the file); without the cache nothing needs it
    digest = dist.on_rank0(source.content_hash) if use_cache else None
    cache = cache_path(source, digest, ident) if use_cache else None
    hit = dist.on_rank0(lambda: cache is not None and cache.is_file())
    if hit:
        if dist.is_main():
            log.info("%s: cached features %s", source.path, cache)
            return read_features_file(cache)[0]
        return None
    batches = rank_batches(range(source.count), batch_size, dist.rank(), dist.world_size())
    ws = dist.world_size()
    rows = [sum(len(b) for b in rank_batches(range(source.count), batch_size, r, ws)) for r in range(ws)]
    with tqdm(total=source.count, unit="img", desc=f"Inception {source.path.name}", dynamic_ncols=True,
              disable=not progress_enabled(quiet)) as bar, source.reader() as reader:
        def advance(n: int) -> None:
            bar.update(min(n * ws, bar.total - bar.n))  # ranks run in lockstep: rank 0 stands for all
        # one reader for all batches, read in increasing order: each byte of an npz is read once
        idx, arrays = local_features(model, ((b, reader.read(b[0], b[-1] + 1)) for b in batches), device, advance)
    result = gather_rows(idx, arrays, source.count, rows)
    if dist.is_main() and use_cache:
        meta = {"source": str(source.path), "kind": source.kind, "sha256": digest, "count": source.count,
                "extractor": ident}
        try:
            write_features(cache, result, meta)
            log.info("%s: features cached in %s", source.path, cache)
        except OSError as e:
            log.warning("could not cache the features of %s in %s (%s); continuing without the cache",
                        source.path, cache, e)
    return result
