"""`run_extract`: an ImageFolder tree -> SD-VAE latents -> a verified shard set (issue #4).

Order of work (RELIABILITY.md: bad input is refused before anything is written): scan the images and
check every rank sees the same list, load the VAE, build the extraction record, check the output folder
(new / resume / refuse), then each rank encodes its shards (extract/plan.py: the work split), skipping the
ones an earlier run finished, and rank 0 writes manifest.json once every rank is done and runs the quick
verify.
"""
from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import PIL
import torch
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from dit_pipeline.common import distributed as dist
from dit_pipeline.common.determinism import pinned_threads
from dit_pipeline.common.errors import UserError
from dit_pipeline.common.faults import fault_point
from dit_pipeline.common.io import check_writable_dir
from dit_pipeline.common.latent_norm import LatentNorm
from dit_pipeline.common.log import get_logger, progress_enabled, setup_logging
from dit_pipeline.common.runlock import EXTRACT_LOCK_NAME, RunLock
from dit_pipeline.common.vae import load_vae
from dit_pipeline.extract import plan
from dit_pipeline.extract.config import ExtractConfig, resolve_batch_size, resolve_num_workers, resolve_precision
from dit_pipeline.extract.encode import LatentEncoder
from dit_pipeline.extract.files import ImageList, scan_image_folder
from dit_pipeline.extract.images import MAX_PIXELS
from dit_pipeline.extract.loader import CropDataset, make_loader
from dit_pipeline.extract.pipeline import LoopStats, ShardSink, disk_errors, encode_and_write
from dit_pipeline.extract.summary import EXTRACT_DIST_TIMEOUT_S, ExtractSummary, tool_version
from dit_pipeline.extract.state import LOG_DIR, STATE_DIR, ShardState, finished_shard, prepare_output, start_output
from dit_pipeline.extract.tokenizer import (check_store, deterministic, earlier_revision, latent_shape,
                                            manifest_normalization, resolve_normalization)
from dit_pipeline.shards import (FORMAT_VERSION, FORMAT_VERSION_PIXELS, FORMAT_VERSION_TEXT, MANIFEST_NAME, Manifest,
                                 format_version_for, verify_shards, write_manifest)
from dit_pipeline.shards.info import human_bytes
from dit_pipeline.shards import pixels as shard_pixels

log = get_logger()
_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4}
_RANK_LOGS = "OUT/logs/rank*.log"
_LATENTS_POSTERIOR = "raw VAE posterior (unscaled): model latent = (z - shift_factor) * scaling_factor"
_LATENTS_DETERMINISTIC = ("raw encoder latent, deterministic (encode(x).latent, no posterior), unscaled: model "
                          "latent = (z - shift_factor) * scaling_factor")

_LATENTS_PIXELS = ("the stored crop (pixels member, uint8), store 'pixels': model latent = its view mapped to "
                   "[-1, 1] by extraction.vae.formula (common/pixels.py), the normalization the identity")
_LATENTS_FEATURES = ("raw encoder features (extraction.encoder), deterministic, unnormalized: model latent = the "
                     "manifest's normalization of z")


def find_images(cfg: ExtractConfig) -> ImageList:
    """The images of --data-path (an ImageFolder tree; with --captions also a flat folder; a folder of
    WebDataset tars) with their captions' index (--captions), before --limit."""
    from dataclasses import replace

    from dit_pipeline.extract.captions import SIDECAR, mapping_index, sidecar_index
    from dit_pipeline.extract.files import scan_flat_folder
    from dit_pipeline.extract.webdataset import scan_webdataset, tar_files

    root = Path(cfg.data_path).expanduser()
    if root.is_dir() and tar_files(root):
        if cfg.captions is not None and cfg.captions != SIDECAR:
            raise UserError(f"--captions {cfg.captions}: a WebDataset's captions are its samples' .txt / .json "
                            "members; pass --captions sidecar")
        images, _, index = scan_webdataset(root, captions=cfg.captions is not None, caption_keys=cfg.keys)
        return replace(images, captions=index)
    flat = scan_flat_folder(root) if cfg.captions is not None else None
    images = flat if flat is not None else scan_image_folder(
        cfg.data_path, allow_split_names=cfg.allow_split_names, keep_empty_classes=cfg.keep_empty_classes)
    if cfg.captions is None:
        return images
    index = (sidecar_index(images.root, images.paths) if cfg.captions == SIDECAR
             else mapping_index(cfg.captions, images.paths, cfg.keys))
    return replace(images, captions=index)


def scan_images(cfg: ExtractConfig) -> ImageList:
    """The image list (after --limit), identical on every rank or a UserError."""
    images = find_images(cfg).head(cfg.limit)
    if images.captions is not None:  # a wrong --caption-keys or paths: refused before a byte is written
        from dit_pipeline.extract.captions import check_coverage

        check_coverage(images.captions, images.paths[0] if images.paths else "")
    if images.captions is not None and images.captions.unmatched["count"] and dist.is_main():
        u = images.captions.unmatched
        log.warning("--captions: %d caption record(s) name no image of --data-path (counted in the manifest), e.g. "
                    "%s", u["count"], "; ".join(u["examples"][:3]))
    with dist.peer_guard("comparing the image lists of the ranks", _RANK_LOGS):
        prints = dist.all_gather_object((len(images), images.fingerprint()))
    if len(set(prints)) > 1:
        detail = ", ".join(f"rank {r}: {n} images" for r, (n, _) in enumerate(prints))
        raise UserError(f"--data-path {cfg.data_path}: the ranks see different image lists ({detail}). Every "
                        "node must see the same dataset (a shared or identical copy).")
    return images


def extraction_record(cfg: ExtractConfig, images: ImageList, vae_identity: dict, *, precision: str,
                      batch_size: int, samples_per_shard: int, device: torch.device) -> dict[str, Any]:
    """The full extraction config stored in the manifest and in OUT/.extract/config.json."""
    import diffusers

    record = {
        "data_path": str(images.root), "listing_sha256": images.fingerprint(), "num_images": len(images),
        "num_classes": len(images.class_names),
        "image_size": cfg.image_size, "views": cfg.views, "flip": cfg.flip, "store": cfg.store,
        "dtype": cfg.dtype, "precision": precision, "samples_per_shard": samples_per_shard,
        "seed": cfg.seed if cfg.store == "sample" and not deterministic(vae_identity) else None,
        "max_pixels": MAX_PIXELS,
        "crop": "adm_center_crop: BOX halving while short side >= 2*size, BICUBIC to short side = size "
                "(sides rounded), center crop with floor offsets",
        "normalize": "ToTensor then Normalize(0.5, 0.5); view 1 is the horizontal mirror of view 0",
        "latents": _LATENTS_DETERMINISTIC if deterministic(vae_identity) else _LATENTS_POSTERIOR,
        "vae": dict(vae_identity), "format_version": FORMAT_VERSION,
        "batch_size": batch_size, "compile": cfg.compile,
        "cpu_threads": cfg.cpu_threads if device.type == "cpu" else None,
        "device": f"cuda ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "cpu",
        "versions": {"torch": torch.__version__, "diffusers": diffusers.__version__, "pillow": PIL.__version__},
    }
    if cfg.pixels:  # only then: the record of an extraction without pixels stays what it was
        _add_pixels_record(record, cfg.pixel_encoding)
    if vae_identity.get("kind") == "pixels":  # the crops themselves (common/pixels.py); no VAE, no encoder run
        record["normalize"] = vae_identity["formula"]
        record["latents"] = _LATENTS_PIXELS
    if images.members is not None:  # a WebDataset input: the index follows (tar order, member order)
        record["input"] = "webdataset"
    if images.captions is not None:  # only then, as for pixels
        record["captions"] = dict(images.captions.record)
        record["format_version"] = FORMAT_VERSION_TEXT
    if vae_identity.get("kind") == "features":  # only then: a VAE set's record stays what it was
        record["vae"] = None
        record["encoder"] = dict(vae_identity)
        record["normalize"] = "x/255 in [0, 1], then the encoder's formula (encoder.formula); view 1 is the mirror"
        record["latents"] = _LATENTS_FEATURES
        record["versions"]["timm"] = _timm_version()
    return record


def _timm_version() -> str:
    import timm

    return str(timm.__version__)


def _add_pixels_record(record: dict[str, Any], encoding: str) -> None:
    """--pixels in the extraction record: the encoding (a folder of the other setting is refused on resume),
    the format version of a set with pixels, and the codec library that decides the pixels' bytes (WebP)."""
    record["pixels"] = encoding
    record["format_version"] = FORMAT_VERSION_PIXELS
    if encoding == shard_pixels.ENCODING:
        record["versions"]["libwebp"] = shard_pixels.codec_version()


def _samples_per_shard(cfg: ExtractConfig, latent_shape: list[int]) -> int:
    if cfg.samples_per_shard is not None:
        return cfg.samples_per_shard
    arrays = {"posterior": 2, "sample": 1, "pixels": 0}[cfg.shard_store]
    per_sample = plan.bytes_per_sample(cfg.views, arrays, tuple(latent_shape), _ITEMSIZE[cfg.dtype])
    if cfg.pixels:
        per_sample += plan.pixel_bytes_estimate(cfg.image_size, cfg.pixel_encoding)
    return plan.default_samples_per_shard(per_sample)


def _my_shards(out: Path, total_shards: int) -> tuple[dict[int, ShardState], list[int]]:
    """This rank's shards: (finished by an earlier run, still to write)."""
    done: dict[int, ShardState] = {}
    todo: list[int] = []
    for shard in plan.shards_of_rank(total_shards, dist.rank(), dist.world_size()):
        state = finished_shard(out, shard)
        if state is None:
            todo.append(shard)
        else:
            done[shard] = state
    return done, todo


@dataclass
class ExtractJob:
    """What `_setup` resolved and checked, before anything was written."""

    cfg: ExtractConfig
    images: ImageList
    device: torch.device
    precision: str
    batch_size: int
    vae: torch.nn.Module
    vae_identity: dict[str, Any]
    latent_shape: list[int]
    samples_per_shard: int
    record: dict[str, Any]
    out: Path
    status: str
    norm: LatentNorm                   # the manifest's normalization (extract/tokenizer.py)
    lock_warning: str | None = None  # a dead run's lease on --out was taken over
    kept: Manifest | None = None     # the folder's revised manifest of this extraction, whose normalization stays


def _claim_output(out: Path, record: dict[str, Any], cfg: ExtractConfig, held: list[RunLock]
                  ) -> tuple[str | None, str]:
    """Rank 0: the lease on --out (one live extraction per folder: a second one would delete the first's live
    temp files as left by an interrupted run; common/runlock.py), then the folder check. Returns (the
    takeover warning, the folder's status)."""
    held.append(RunLock(out, "dit-extract", name=EXTRACT_LOCK_NAME, flag="--out").acquire())
    return held[-1].warning, prepare_output(out, record, overwrite=cfg.overwrite)


def _setup(cfg: ExtractConfig, held: list[RunLock]) -> ExtractJob:
    """Everything checked before a byte is written: images, VAE, sizes, the output folder (leased by rank 0
    into `held`; every rank learns a refusal)."""
    if cfg.pixels and cfg.pixel_encoding == shard_pixels.ENCODING and shard_pixels.codec_problem():
        raise UserError(f"--pixels: {shard_pixels.codec_problem()}")
    images = scan_images(cfg)
    device = dist.device()
    precision = resolve_precision(cfg.precision, device)
    batch_size = resolve_batch_size(cfg.batch_size, device)
    if cfg.encoder:  # a feature encoder (common/features.py) in the VAE's place
        from dit_pipeline.common.features import load_feature_encoder

        vae, vae_identity = load_feature_encoder(cfg.encoder, weights=cfg.encoder_weights, layers=cfg.encoder_layers,
                                                 device=device, image_size=cfg.image_size,
                                                 formula=cfg.encoder_formula)
    else:
        vae, vae_identity = load_vae(cfg.vae, config=cfg.vae_config, revision=cfg.vae_revision, device=device)
    check_store(cfg, vae_identity)
    shape = latent_shape(cfg, vae_identity)
    norm = resolve_normalization(cfg, vae_identity, shape)
    samples_per_shard = _samples_per_shard(cfg, shape)
    record = extraction_record(cfg, images, vae_identity, precision=precision, batch_size=batch_size,
                               samples_per_shard=samples_per_shard, device=device)
    out = Path(cfg.out).expanduser()
    kept = earlier_revision(out, record)  # before the folder changes
    warning, status = dist.on_rank0(lambda: _claim_output(out, record, cfg, held), _RANK_LOGS)
    return ExtractJob(cfg, images, device, precision, batch_size, vae, vae_identity, shape, samples_per_shard,
                      record, out, status, norm, warning, kept)


def _encode(run: ExtractJob, todo: list[int]):
    """Encode and write this rank's unfinished shards; returns (LoopStats, fp32 retries)."""
    cfg, n = run.cfg, len(run.images)
    if not todo:
        return LoopStats(), 0
    chunks = [(s, c) for s in todo
              for c in plan.batches_of(plan.shard_span(s, run.samples_per_shard, n), run.batch_size)]
    workers = resolve_num_workers(cfg.num_workers, dist.local_world_size())
    log.info("rank %d: %d shard(s) to write (%d images), batch %d, %d decode worker(s), %s on %s",
             dist.rank(), len(todo), sum(len(c) for _, c in chunks), run.batch_size, workers, run.precision,
             run.device)
    dataset = CropDataset(run.images.root, run.images.paths, cfg.image_size, pixels=cfg.pixels,
                          pixel_encoding=cfg.pixel_encoding, members=run.images.members,
                          captions=run.images.captions)
    loader = make_loader(dataset, chunks, samples_per_shard=run.samples_per_shard, num_workers=workers,
                         pin_memory=run.device.type == "cuda")
    encoder = LatentEncoder(run.vae, device=run.device, precision=run.precision, views=cfg.views,
                            store=cfg.store, seed=cfg.seed, compile=cfg.compile, latent_shape=tuple(run.latent_shape),
                            unit_range=run.vae_identity.get("input_range") == "0,1")
    desc = "extract" if dist.world_size() == 1 else f"extract (rank 0 of {dist.world_size()})"
    bar = tqdm(total=sum(len(c) for _, c in chunks), unit="img", desc=desc, smoothing=0.05, dynamic_ncols=True,
               disable=not progress_enabled(cfg.quiet))
    # Route console log lines through tqdm so they do not tear the bar; only where the bar is shown (the
    # redirect would otherwise add an unfiltered console handler to quiet runs and to other ranks).
    redirect = logging_redirect_tqdm(loggers=[log]) if not bar.disable else contextlib.nullcontext()
    # Pinned threads (common/determinism.py): the shard bytes must not depend on OMP_NUM_THREADS or on the
    # one thread per process that torchrun sets when it starts several ranks.
    with redirect, bar, pinned_threads(run.device, cfg.cpu_threads):
        sink = ShardSink(run.out, run.images, dtype=cfg.dtype, store=cfg.shard_store, strict=cfg.strict, bar=bar,
                         pixels=cfg.pixels, pixel_encoding=cfg.pixel_encoding,
                         captions=run.images.captions is not None)
        try:
            stats = encode_and_write(loader, encoder, sink)
        except torch.OutOfMemoryError as e:
            raise UserError(f"out of {run.device.type} memory encoding batches of {run.batch_size} images x "
                            f"{cfg.views} view(s) at {cfg.image_size} px; rerun with a smaller --batch-size "
                            "(finished shards are kept)") from e
    return stats, encoder.fp32_retries


def _write_manifest(run: ExtractJob, states: dict[int, ShardState]) -> None:
    cfg, shards = run.cfg, [states[i] for i in sorted(states)]
    pixels = None
    if cfg.pixels:
        assert all(s.pixel_bytes is not None for s in shards), "a pixels folder holds only shards with pixels"
        pixels = shard_pixels.pixels_entry(cfg.image_size, sum(s.pixel_bytes for s in shards), cfg.pixel_encoding)
    norm = manifest_normalization(run.norm, run.kept, cfg)
    captions = None
    if run.images.captions is not None:
        from dit_pipeline.extract.captions import captions_record

        assert all(s.captions is not None for s in shards), "a captioned folder holds only shards with captions"
        captions = captions_record(run.images.captions, [s.captions for s in shards])
    manifest = Manifest(
        captions=captions,
        format_version=format_version_for(pixels=cfg.pixels, normalization=norm.is_per_channel,
                                          text=captions is not None),
        tool_version=tool_version(), extraction=run.record, pixels=pixels, normalization=norm.per_channel,
        revision=run.kept.revision if run.kept is not None else None,
        scaling_factor=float(norm.scaling_factor), shift_factor=norm.shift_factor,
        image_size=cfg.image_size, views=cfg.views, store=cfg.shard_store, dtype=cfg.dtype,
        latent_shape=list(run.latent_shape), class_names=list(run.images.class_names),
        num_classes=len(run.images.class_names), total_samples=sum(s.record.samples for s in shards),
        samples_per_shard=run.samples_per_shard, shards=[s.record for s in shards],
        skipped=sorted((k for s in shards for k in s.skipped), key=lambda k: k["key"]))
    with disk_errors(run.out / MANIFEST_NAME, "every shard is finished and kept"):
        fault_point("extract.before_manifest")  # every shard finished, manifest.json not yet written
        write_manifest(run.out, manifest)
    report = verify_shards(run.out, quick=True, progress=False)
    if not report.ok:
        problems = "; ".join(f"{where}: {what}" for where, what in report.problems[:10])
        raise UserError(f"{run.out}: the quick verify of the new shard set failed ({problems}). Rerun the same "
                        "command to redo the damaged shards.")


def _start_output(run: ExtractJob) -> None:
    with disk_errors(run.out / STATE_DIR, "no shard was changed"):
        start_output(run.out, run.record, options=run.cfg.to_dict())


def _log_summary(s: ExtractSummary) -> None:
    log.info("done: %d images encoded in %.1f s (%.1f images/s, %d rank(s)); %d shards (%d written now, %d kept "
             "from an earlier run), %d samples, %d skipped, %s", s.images, s.wall_s, s.images_per_s,
             dist.world_size(), s.shards_written + s.shards_kept, s.shards_written, s.shards_kept,
             s.total_samples, s.skipped, human_bytes(s.total_bytes))
    if s.fp32_retries:
        log.info("%d batch(es) overflowed in reduced precision and were encoded again in fp32", s.fp32_retries)
    if s.skipped:
        log.info("skipped images and their reasons are listed under 'skipped' in %s", s.manifest)
    log.info("manifest: %s (quick verify passed)", s.manifest)


def _summarize(run: ExtractJob, gathered: list, states: dict[int, ShardState], t0: float) -> ExtractSummary:
    kept = sum(g[2] for g in gathered)
    return ExtractSummary(
        out=str(run.out), manifest=str(run.out / MANIFEST_NAME), images=sum(g[1] for g in gathered),
        skipped=sum(len(s.skipped) for s in states.values()),
        total_samples=sum(s.record.samples for s in states.values()), shards_written=len(states) - kept,
        shards_kept=kept, total_bytes=sum(s.record.bytes for s in states.values()),
        wall_s=time.monotonic() - t0, fp32_retries=sum(g[3] for g in gathered))


def run_extract(cfg: ExtractConfig) -> ExtractSummary:
    """Extract latents for `cfg` (one process, or every rank of a torchrun job)."""
    cfg.validate()
    check_writable_dir(cfg.out, f"--out {cfg.out}")  # before any work (the VAE, the image scan)
    # Ranks wait in the final gather for the slowest one (a resumed run can be very uneven), so the
    # collective timeout is long; a rank that dies is handled by torchrun, which stops the others.
    dist.init(timeout_s=float(os.environ.get("DIT_DIST_TIMEOUT", EXTRACT_DIST_TIMEOUT_S)))
    setup_logging(None, quiet=cfg.quiet)
    held: list[RunLock] = []
    try:
        return _extract(cfg, held)
    finally:
        for lock in held:
            lock.release()


def _extract(cfg: ExtractConfig, held: list[RunLock]) -> ExtractSummary:
    t0 = time.monotonic()
    run = _setup(cfg, held)
    setup_logging(run.out / LOG_DIR, quiet=cfg.quiet)
    if run.lock_warning:
        log.warning("--out %s: %s", run.out, run.lock_warning)
    names = run.images.class_names
    log.info("dit-extract %s: %d images in %d classes (first %r, last %r) from %s -> %s (%s)", tool_version(),
             len(run.images), len(names), names[0], names[-1], run.images.root, run.out, run.status)
    log.info("%s", dist.launch_info().describe())
    ident = run.vae_identity
    log.info("latents: %s, %d x %d x %d at %d px (%s, downsampling %d); normalization %s", run.cfg.store,
             *run.latent_shape, run.cfg.image_size, ident.get("class"), ident["downsample_factor"], run.norm.describe())
    dist.on_rank0(lambda: _start_output(run), _RANK_LOGS)  # also the barrier before any rank looks at the folder
    total_shards = plan.num_shards(len(run.images), run.samples_per_shard)
    done, todo = _my_shards(run.out, total_shards)
    if done:
        log.info("rank %d: keeping %d finished shard(s) from an earlier run", dist.rank(), len(done))
    with dist.peer_guard("agreeing on the shards to write", _RANK_LOGS):
        if dist.any_true(bool(todo)) and dist.is_main():
            (run.out / MANIFEST_NAME).unlink(missing_ok=True)  # the folder is about to change: no stale manifest
        dist.barrier()
    stats, retries = _encode(run, todo)
    with dist.peer_guard("collecting the finished shards of every rank", _RANK_LOGS):
        gathered = dist.all_gather_object(({i: s.to_dict() for i, s in {**done, **stats.states}.items()},
                                           stats.images, len(done), retries))
    states = {i: ShardState.from_dict(d) for part in gathered for i, d in part[0].items()}
    assert sorted(states) == list(range(total_shards)), "every shard is written by exactly one rank"
    dist.on_rank0(lambda: _write_manifest(run, states), _RANK_LOGS)
    summary = _summarize(run, gathered, states, t0)
    if dist.is_main():
        _log_summary(summary)
    return summary


def main(cfg: ExtractConfig) -> ExtractSummary:
    """The `dit-extract` command: `run_extract` with quiet libraries, leaving no process group behind."""
    from diffusers.utils import logging as diffusers_logging

    diffusers_logging.set_verbosity_error()
    with dist.leaving_group():
        if cfg.text_encoder:  # a shard set's captions -> its text sibling set (extract/text.py)
            from dit_pipeline.extract.text import run_text_extract

            return run_text_extract(cfg)
        return run_extract(cfg)
