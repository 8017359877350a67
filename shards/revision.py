"""Manifest revisions: `dit-shards stats --write` changes how a shard set's latents are normalized, never
silently and never in place.

The manifest being replaced is kept byte for byte as `manifest.json.rev<N>` (N: its revision number, 1 for
the manifest dit-extract wrote), written atomically before the new `manifest.json`, which records
`revision: {"number": N + 1, "previous": "manifest.json.rev<N>", "by": <the command>}`. Only the normalization
changes (a per-channel record, format version 3; or a new scalar scaling_factor). The fingerprint covers the
normalization's numbers, so it changes exactly when the latents the trainer computes change: a run trained
on revision N is refused on resume against revision N + 1 (train.setting_parts.ShardSetPart), and continues against
the kept file (`dit-train --manifest SHARDS/manifest.json.rev<N>`). `dit-shards verify` accepts the kept
files of earlier revisions.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dit_pipeline.common.errors import UserError
from dit_pipeline.common.io import atomic_write_bytes
from dit_pipeline.common.latent_norm import LatentNorm, normalization_problems
from dit_pipeline.shards.format import MANIFEST_NAME, file_mode, revision_name
from dit_pipeline.shards.manifest import Manifest, format_version_for, read_manifest, write_manifest


@dataclass(frozen=True)
class Revision:
    """A written revision: the new manifest, the kept previous one, and the fingerprints before and after."""

    manifest: Manifest
    kept: Path
    old_fingerprint: str
    new_fingerprint: str


def revised(m: Manifest, *, normalization: dict[str, Any] | None, scaling_factor: float | None,
            by: str) -> Manifest:
    """`m` with a new normalization (a per-channel record, or None with a new scalar `scaling_factor`) as its
    next revision; UserError when the numbers are unusable."""
    if m.is_text:
        raise UserError("a text set (text-encoder features) has no latents to normalize; run this on the latent set")
    if normalization is not None:
        problems = normalization_problems(normalization, list(m.latent_shape))
        if problems:
            raise UserError(f"cannot write this normalization: {'; '.join(problems)} (a channel whose latents are "
                            "constant has no std to divide by)")
    scale = m.scaling_factor if scaling_factor is None else float(scaling_factor)
    if not scale > 0:
        raise UserError(f"cannot write scaling_factor {scale!r}: it must be > 0")
    number = m.revision_number
    return dataclasses.replace(
        m, normalization=normalization, scaling_factor=scale,
        format_version=format_version_for(pixels=m.has_pixels, normalization=normalization is not None,
                                          text=m.has_captions),
        revision={"number": number + 1, "previous": revision_name(number), "by": by})


def write_revision(folder: str | Path, *, normalization: dict[str, Any] | None, scaling_factor: float | None,
                   by: str) -> Revision:
    """Replace FOLDER/manifest.json by its next revision (see the module docstring), keeping the old one."""
    folder = Path(folder)
    path = folder / MANIFEST_NAME
    old = read_manifest(folder)
    new = revised(old, normalization=normalization, scaling_factor=scaling_factor, by=by)
    kept = folder / revision_name(old.revision_number)
    before = path.read_bytes()
    if kept.exists() and kept.read_bytes() != before:
        raise UserError(f"{kept} exists and is not the current manifest.json; move it away (it would be "
                        "overwritten by the manifest this revision replaces). Nothing was changed.")
    try:
        atomic_write_bytes(kept, before)
        os.chmod(kept, file_mode())
        write_manifest(folder, new)
    except OSError as e:
        raise UserError(f"cannot write the new manifest revision in {folder} ({e.strerror or e}); manifest.json "
                        "is unchanged unless it says revision "
                        f"{new.revision_number}") from None
    return Revision(new, kept, old.fingerprint(), new.fingerprint())


def same_normalization(a: LatentNorm, b: LatentNorm) -> bool:
    """Whether two normalizations compute the same latents (their numbers, not where they came from)."""
    return a.key() == b.key()


def revise(folder: str | Path, *, mode: str | None = None, stats_file: str | None = None,
           max_samples: int = 10_000, seed: int = 0) -> dict[str, Any]:
    """`dit-shards stats FOLDER --write MODE` (statistics computed over the set: "per-channel" mean/std of z, or
    a "scalar" scaling factor for unit std) or `--latent-stats FILE` (the file's per-channel statistics): the
    new normalization as the manifest's next revision, and the statistics after it. A normalization equal to
    the current one is not written again (`written` False)."""
    from dit_pipeline.common.latent_stats import read_stats_file
    from dit_pipeline.shards.stats import compute_stats, computed_normalization

    if (mode is None) == (stats_file is None):
        raise ValueError("give exactly one of mode and stats_file")
    folder = Path(folder)
    m = read_manifest(folder)
    before = None
    if stats_file is not None:
        from_file = read_stats_file(stats_file, list(m.latent_shape))
        record: dict[str, Any] | None = from_file
        scale: float | None = None
        by = f"dit-shards stats --latent-stats {from_file['source']['path']}"
    elif mode == "per-position":  # exact, over every sample and view (shards.stats.position_stats)
        from dit_pipeline.shards.stats import position_stats

        exact = position_stats(folder)
        record, scale = computed_normalization(exact, "per-position", m.revision_number + 1)
        by = "dit-shards stats --write per-position"
    else:
        before = compute_stats(folder, max_samples=max_samples, seed=seed)
        if not before["samples_used"]:
            raise UserError(f"{folder}: the shard set holds no samples; there are no statistics to write")
        record, scale = computed_normalization(before, str(mode), m.revision_number + 1)
        by = f"dit-shards stats --write {mode} --max-samples {max_samples} --seed {seed}"
    new = m.norm.with_record(record) if record is not None else LatentNorm(float(scale or 0), m.shift_factor)
    out: dict[str, Any] = {"folder": str(folder), "normalization": new.describe(), "before": before}
    if same_normalization(new, m.norm):
        return {**out, "written": False, "revision": m.revision_number, "fingerprint": m.fingerprint()}
    rev = write_revision(folder, normalization=record, scaling_factor=scale, by=by)
    after = compute_stats(folder, max_samples=max_samples, seed=seed)
    return {**out, "written": True, "revision": rev.manifest.revision_number, "kept": str(rev.kept),
            "old_fingerprint": rev.old_fingerprint, "new_fingerprint": rev.new_fingerprint, "after": after}


def format_revise(r: dict[str, Any]) -> str:
    """The text `dit-shards stats --write / --latent-stats` prints."""
    if not r["written"]:
        return (f"{r['folder']}: manifest revision {r['revision']} already normalizes so ({r['normalization']}); "
                "nothing was written")
    old = r["revision"] - 1
    after = r["after"]
    lines = [f"wrote manifest revision {r['revision']} of {r['folder']}: {r['normalization']}",
             f"  the previous manifest (revision {old}) is kept as {r['kept']}",
             f"  fingerprint {r['old_fingerprint'][:12]}... -> {r['new_fingerprint'][:12]}...: dit-train refuses to "
             f"resume a run trained on revision {old} against it (continue such a run with --manifest {r['kept']})"]
    if after.get("samples_used"):
        verdict = "near 1, as DiT assumes" if after["near_unit_std"] else "NOT near 1"
        spread = f"channel std {min(after['channel_std']):.4f}..{max(after['channel_std']):.4f}"
        mean = round(after["mean"], 4) + 0.0  # no "-0.0000" for a mean of -1e-9
        lines.append(f"  after: all channels mean {mean:+.4f} std {after['std']:.4f} -> {verdict} ({spread}; "
                     f"{after['samples_used']} samples)")
    return "\n".join(lines)
