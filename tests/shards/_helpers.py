"""Tiny shard sets for the shards tests, and an independent way (Python's tarfile + np.save) to build
and edit shards, so corrupt shards are made without going through the code under test."""
from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path

import numpy as np

from dit_pipeline.shards import FORMAT_VERSION, FORMAT_VERSION_PIXELS, Manifest, ShardWriter, sample_key, shard_name, write_manifest
from dit_pipeline.shards.pixels import pixels_entry

LATENT = (4, 4, 4)  # [C, h, w]: tiny
CLASSES = ["cat", "dog", "eel"]


def arrays_for(index: int, views: int = 2, store: str = "posterior") -> dict[str, np.ndarray]:
    """Deterministic float32 arrays of one sample (values exactly representable in float16)."""
    rng = np.random.default_rng(index)
    mean = rng.standard_normal((views, *LATENT)).astype(np.float16).astype(np.float32)
    if store == "sample":
        return {"latent": mean}
    std = (np.abs(rng.standard_normal((views, *LATENT))) * 0.1 + 0.01).astype(np.float16).astype(np.float32)
    return {"mean": mean, "std": std}


def crop_for(index: int, size: int = 32) -> np.ndarray:
    """Deterministic uint8 [size, size, 3] pixels of one sample, not symmetric (so a flip shows)."""
    rng = np.random.default_rng(1000 + index)
    ramp = np.arange(size, dtype=np.int64)[None, :, None] * 5
    return ((rng.integers(0, 60, (size, size, 3)) + ramp + index) % 256).astype(np.uint8)


def make_set(folder: Path, *, n: int = 12, sps: int = 4, skipped: tuple[int, ...] = (5,), dtype: str = "float16",
             store: str = "posterior", views: int = 2, shift: float | None = None, scale: float = 0.5,
             pixels: bool = False) -> Manifest:
    """A shard set of global indices 0..n-1 (minus `skipped`), `sps` per shard, labels index % 3; with
    `pixels`, every sample also has `crop_for(index)` (format version 2)."""
    folder.mkdir(parents=True, exist_ok=True)
    records, pixel_bytes = [], 0
    for s in range((n + sps - 1) // sps):
        with ShardWriter(folder / shard_name(s), dtype=dtype, pixels=pixels) as w:
            for g in range(s * sps, min(n, (s + 1) * sps)):
                if g not in skipped:
                    w.write(sample_key(g), label=g % 3, meta={"path": f"{CLASSES[g % 3]}/img{g}.JPEG",
                                                               "class": CLASSES[g % 3], "size": [48, 40]},
                            **arrays_for(g, views, store), **({"pixels": crop_for(g)} if pixels else {}))
        records.append(w.record)
        pixel_bytes += w.pixel_bytes
    m = Manifest(format_version=FORMAT_VERSION_PIXELS if pixels else FORMAT_VERSION, tool_version="test",
                 extraction={"vae": {"source": "tiny"}}, pixels=pixels_entry(32, pixel_bytes) if pixels else None,
                 scaling_factor=scale, shift_factor=shift, image_size=32, views=views, store=store, dtype=dtype,
                 latent_shape=list(LATENT), class_names=list(CLASSES), num_classes=3,
                 total_samples=n - len(skipped), samples_per_shard=sps, shards=records,
                 skipped=[{"key": sample_key(k), "path": f"x/{k}.JPEG", "reason": "cannot decode"} for k in skipped])
    write_manifest(folder, m)
    return m


def npy(a: np.ndarray) -> bytes:
    b = io.BytesIO()
    np.save(b, a, allow_pickle=a.dtype.hasobject)
    return b.getvalue()


def read_members(path: Path) -> list[tuple[str, bytes]]:
    with tarfile.open(path) as t:
        return [(m.name, t.extractfile(m).read()) for m in t.getmembers()]


def write_tar(path: Path, members: list, *, fmt: int = tarfile.USTAR_FORMAT) -> None:
    """members: (name, data) pairs, or ready TarInfo objects (links, devices) with their data or None."""
    with tarfile.open(path, "w", format=fmt) as t:
        for item in members:
            if isinstance(item[0], tarfile.TarInfo):
                info, data = item
                t.addfile(info, io.BytesIO(data) if data is not None else None)
            else:
                name, data = item
                info = tarfile.TarInfo(name)
                info.size = len(data)
                t.addfile(info, io.BytesIO(data))


def edit_manifest(folder: Path, **changes) -> dict:
    """Rewrite manifest.json with top-level `changes`; returns the new dict."""
    path = folder / "manifest.json"
    d = json.loads(path.read_text())
    d.update(changes)
    path.write_text(json.dumps(d, indent=2))
    return d


def refresh_record(folder: Path, name: str, **changes) -> None:
    """Make the manifest's record of `name` match the file's bytes and sha256 again (plus `changes`),
    so a test sees only the problem it planted."""
    path = folder / name
    d = json.loads((folder / "manifest.json").read_text())
    for rec in d["shards"]:
        if rec["name"] == name:
            rec["bytes"] = path.stat().st_size
            rec["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
            rec.update(changes)
    d["total_samples"] = sum(r["samples"] for r in d["shards"])
    (folder / "manifest.json").write_text(json.dumps(d, indent=2))


def replace_member(folder: Path, name: str, member: str, data: bytes | None) -> None:
    """Rewrite shard `name` with `member`'s data replaced (None: member removed), record refreshed."""
    members = [(n, data if n == member else d) for n, d in read_members(folder / name)]
    write_tar(folder / name, [(n, d) for n, d in members if d is not None])
    refresh_record(folder, name)
