"""What the VAE decides about a shard set, checked before anything is written: the latent geometry (channels
and the downsampling factor, from the VAE itself), what its encoder can store (a posterior, or only a
deterministic latent), and how model latents are made from the stored ones (common/latent_norm.py: the VAE
config's scalar factors or per-channel statistics, a `--latent-stats` file, or a revision `dit-shards stats
--write` made of an earlier run of the same extraction).
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from dit_pipeline.common.errors import UserError
from dit_pipeline.common.latent_norm import LatentNorm, normalization_problems
from dit_pipeline.common.latent_stats import read_stats_file
from dit_pipeline.extract.config import ExtractConfig
from dit_pipeline.extract.state import record_differences
from dit_pipeline.shards import MANIFEST_NAME, Manifest, read_manifest

log = logging.getLogger("dit_pipeline")


def latent_shape(cfg: ExtractConfig, vae_identity: dict[str, Any]) -> list[int]:
    """[C, h, w] of the latents at --image-size; UserError when the size is not a multiple of the VAE's factor."""
    f = int(vae_identity["downsample_factor"])
    if cfg.image_size % f:
        lower, upper = cfg.image_size // f * f, (cfg.image_size // f + 1) * f
        sizes = " or ".join(str(s) for s in (lower, upper) if s > 0)
        raise UserError(f"--image-size {cfg.image_size} is not a multiple of the VAE's downsampling factor {f} "
                        f"({vae_identity.get('class', 'VAE')}, {vae_identity['latent_channels']} latent channels); "
                        f"use {sizes}")
    return [int(vae_identity["latent_channels"]), cfg.image_size // f, cfg.image_size // f]


def deterministic(vae_identity: dict[str, Any]) -> bool:
    """Whether the encoder gives a latent and no posterior (AutoencoderDC: `encode(x).latent`)."""
    return vae_identity.get("encoder_output") == "latent"


def check_store(cfg: ExtractConfig, vae_identity: dict[str, Any]) -> None:
    """--store must be something the encoder gives: a posterior needs `latent_dist`."""
    if cfg.store == "posterior" and deterministic(vae_identity):
        raise UserError(f"--store posterior: the VAE {cfg.vae!r} ({vae_identity.get('class')}) encodes to a "
                        "deterministic latent (encode(x).latent), it has no posterior mean and std to store; pass "
                        "--store sample, which stores its latent as it is")


def resolve_normalization(cfg: ExtractConfig, vae_identity: dict[str, Any], shape: int | list[int]) -> LatentNorm:
    """The manifest's normalization: the --latent-stats file's, else the VAE config's (per-channel where it has
    latents_mean / latents_std, else its scalar factors). UserError for statistics that do not fit."""
    norm = LatentNorm.of_vae(vae_identity)
    if norm.per_channel is not None:
        channels = shape if isinstance(shape, int) else shape[0]
        problems = normalization_problems(norm.per_channel, channels)
        if problems:
            raise UserError(f"the VAE {cfg.vae!r}: its config's latents_mean / latents_std do not fit its "
                            f"{channels} latent channels ({'; '.join(problems)})")
    if cfg.latent_stats:
        record = read_stats_file(cfg.latent_stats, shape)
        if norm.per_channel is not None:
            log.warning("--latent-stats %s replaces the VAE config's latents_mean/latents_std", cfg.latent_stats)
        norm = norm.with_record(record)
    return norm


def earlier_revision(out: Path, record: dict[str, Any]) -> Manifest | None:
    """The manifest in OUT when `dit-shards stats --write` revised it and it was made by this very extraction
    (no difference but in numerics): its normalization is kept when the manifest is written again (a rerun of
    the command must not silently undo a revision). None otherwise."""
    path = out / MANIFEST_NAME
    if not path.is_file():
        return None
    try:
        m = read_manifest(path)
    except UserError:
        return None
    return m if m.revision is not None and not record_differences(m.extraction, record)[0] else None


def manifest_normalization(norm: LatentNorm, kept: Manifest | None, cfg: ExtractConfig) -> LatentNorm:
    """The normalization the new manifest records: that of the kept revision, else `norm`."""
    if kept is None:
        return norm
    log.info("keeping the normalization of manifest revision %d (%s): %s", kept.revision_number,
             (kept.revision or {}).get("by"), kept.norm.describe())
    if cfg.latent_stats and kept.norm.key() != norm.key():
        log.warning("--latent-stats %s is not applied: the set's manifest revision %d normalizes otherwise; "
                    "write the file's statistics as a new revision with dit-shards stats %s --latent-stats %s",
                    cfg.latent_stats, kept.revision_number, cfg.out, cfg.latent_stats)
    return kept.norm
