"""`dit-extract --text-encoder`: a shard set with captions -> its text sibling set, every caption's features at
its true token length (issue 37; docs/FORMAT.md "Captions and text").

The text set is made from the captions as the latent set stores them (read back through `shards.iter_shard`,
each source shard's sha256 checked as it streams), so it holds exactly the latent set's keys, shard by shard,
and its manifest copies what `shards.siblings` compares (the image listing, views, shards, skipped keys): the
trainer reads the two in lockstep (train.data). Shard i's captions, flattened in key order, are encoded in
batches of `batch_size` captions, so the tensor shapes the encoder sees are fixed by the shard and the batch
size alone; with the pinned CPU threads of common/determinism.py the bytes do not depend on the world size or
on interruptions (the same plan, state files and resume rules as the latent extraction: extract/plan.py,
extract/state.py). Each caption is encoded padded to the encoder's max length, as the releases encode online
(common/text_encoders.py), and trimmed to its length before it is stored.

Storage: `--text-dtype auto` keeps a 16-bit encoder's dtype (Qwen3-0.6B in bfloat16: the stored features are
its outputs bit for bit) and stores a float32 encoder's outputs as float16; the largest difference between what
the encoder gave and what is stored is measured on every value and recorded (`text.storage_error`).
"""
from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from dit_pipeline.common import distributed as dist
from dit_pipeline.common.determinism import pinned_threads
from dit_pipeline.common.errors import UserError
from dit_pipeline.common.faults import fault_point
from dit_pipeline.common.io import check_writable_dir
from dit_pipeline.common.log import get_logger, progress_enabled, setup_logging
from dit_pipeline.common.runlock import EXTRACT_LOCK_NAME, RunLock
from dit_pipeline.common.text_encoders import TextEncoder, TextFeatures, load_text_encoder
from dit_pipeline.extract import plan
from dit_pipeline.extract.captions import shard_digest
from dit_pipeline.extract.config import ExtractConfig
from dit_pipeline.extract.pipeline import disk_errors
from dit_pipeline.extract.state import LOG_DIR, ShardState, finished_shard, prepare_output, start_output
from dit_pipeline.extract.summary import EXTRACT_DIST_TIMEOUT_S, ExtractSummary, tool_version
from dit_pipeline.shards import (FORMAT_VERSION_TEXT, MANIFEST_NAME, Manifest, ShardWriter, iter_shard, read_manifest,
                                 sample_key, shard_name, verify_shards, write_manifest)
from dit_pipeline.shards.info import human_bytes
from dit_pipeline.shards.siblings import SAME_EXTRACTION
from dit_pipeline.shards.text import encode_null, length_edges, length_histogram

log = get_logger()
GPU_TEXT_BATCH = 256
CPU_TEXT_BATCH = 16
_RANK_LOGS = "OUT/logs/rank*.log"
_FLOAT_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


def storage_dtype(choice: str, encoder_dtype: torch.dtype) -> str:
    """--text-dtype: auto keeps a 16-bit encoder's dtype (exact) and stores a float32 encoder as float16."""
    if choice != "auto":
        return choice
    return _FLOAT_DTYPES.get(encoder_dtype, "float16")


def text_batch_size(batch_size: int | None, device: torch.device) -> int:
    if batch_size is not None:
        return batch_size
    return GPU_TEXT_BATCH if device.type == "cuda" else CPU_TEXT_BATCH


@dataclass
class TextJob:
    cfg: ExtractConfig
    source: Manifest
    source_folder: Path
    encoder: TextEncoder
    dtype: str
    batch_size: int
    record: dict[str, Any]
    out: Path
    device: torch.device


def _record(cfg: ExtractConfig, source: Manifest, folder: Path, encoder: TextEncoder, dtype: str, batch: int,
            device: torch.device) -> dict[str, Any]:
    import tokenizers
    import transformers

    record: dict[str, Any] = {k: source.extraction.get(k) for k in SAME_EXTRACTION}
    origin: dict[str, Any] = {"folder": str(folder.resolve()), "fingerprint": source.fingerprint()}
    if cfg.caption_template is not None:  # a class-labelled set: each class's caption, from the template
        origin.update(template=cfg.caption_template, class_captions=list(class_captions(cfg, source)))
    else:
        assert source.captions is not None
        origin["captions_sha256"] = source.captions["sha256"]
    record.update({
        "kind": "text", "data_path": str(folder.resolve()),
        "source": origin,
        "text_encoder": dict(encoder.identity), "dtype": dtype, "format_version": FORMAT_VERSION_TEXT,
        "encoding": "each caption padded to max_length (right), encoded with the attention mask, trimmed to its "
                    "length; a shard's captions in key order, in batches of batch_size captions",
        "batch_size": batch, "cpu_threads": cfg.cpu_threads if device.type == "cpu" else None,
        "device": f"cuda ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "cpu",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "tokenizers": tokenizers.__version__},
    })
    return record


def class_captions(cfg: ExtractConfig, source: Manifest) -> tuple[str, ...]:
    """--caption-template filled with each class's name (the manifest's, or --class-names)."""
    from dit_pipeline.shards.text import read_class_names, template_captions

    assert cfg.caption_template is not None
    return template_captions(cfg.caption_template, read_class_names(cfg.class_names, source, "--class-names"))


def _setup(cfg: ExtractConfig, held: list[RunLock]) -> TextJob:
    folder = Path(cfg.data_path).expanduser()
    source = read_manifest(folder)
    if source.is_text or not (source.has_captions or cfg.caption_template is not None):
        what = "a text set" if source.is_text else "a shard set without captions"
        raise UserError(f"--data-path {folder}: {what}; --text-encoder encodes the captions of a latent set "
                        "extracted with --captions, or a class-labelled set's with --caption-template 'a photo of a "
                        "{name}'")
    if source.has_captions and cfg.caption_template is not None:
        raise UserError(f"--data-path {folder} stores captions; --caption-template makes captions for a set without "
                        "them: drop it (or extract the images without --captions)")
    if source.total_samples == 0:
        raise UserError(f"--data-path {folder}: the set holds no samples ({source.captions.get('uncaptioned', 0)} "
                        "images were skipped without a caption, see its manifest's 'skipped'); extract the latents "
                        "again with captions (--caption-keys naming the keys that hold them)")
    device = dist.device()
    encoder = load_text_encoder(cfg.text_encoder or "", max_length=cfg.text_max_length, device=device,
                                revision=cfg.text_revision)
    dtype = storage_dtype(cfg.text_dtype, encoder.dtype)
    batch = text_batch_size(cfg.batch_size, device)
    record = _record(cfg, source, folder, encoder, dtype, batch, device)
    out = Path(cfg.out).expanduser()
    if out.resolve() == folder.resolve():
        raise UserError(f"--out {out}: the source set itself; the text set is a folder of its own (a sibling)")

    def claim() -> None:
        held.append(RunLock(out, "dit-extract", name=EXTRACT_LOCK_NAME, flag="--out").acquire())
        prepare_output(out, record, overwrite=cfg.overwrite)

    dist.on_rank0(claim, _RANK_LOGS)
    return TextJob(cfg, source, folder, encoder, dtype, batch, record, out, device)


class _ShardText:
    """The counts of one text shard, for its state file and the manifest."""

    def __init__(self, max_length: int):
        self.max_length = max_length
        self.lengths: list[int] = []
        self.truncated = 0
        self.max_abs = 0.0     # largest |encoder output - stored value|
        self.max_value = 0.0   # largest |encoder output|

    def add(self, feats: TextFeatures, stored: list[np.ndarray], exact: list[torch.Tensor]) -> None:
        self.lengths += feats.lengths
        self.truncated += sum(feats.truncated)
        for s, e in zip(stored, exact):
            if e.numel():
                e32 = e.float().cpu()
                self.max_abs = max(self.max_abs, float((torch.from_numpy(s) - e32).abs().max()))
                self.max_value = max(self.max_value, float(e32.abs().max()))

    def to_dict(self, digest: str) -> dict[str, Any]:
        return {"captions": len(self.lengths), "tokens": int(sum(self.lengths)), "truncated": self.truncated,
                "histogram": length_histogram(self.lengths, self.max_length), "max_abs": self.max_abs,
                "max_value": self.max_value, "captions_sha256": digest}


def _round_trip(x: torch.Tensor, dtype: str) -> np.ndarray:
    """float32 [L, D] of what the shard stores for `x` (the storage dtype's rounding; shards.npy rounds alike)."""
    from dit_pipeline.shards.npy import decode_raw, encode_array, widen

    return widen(decode_raw(encode_array(x.float().cpu().numpy(), dtype)), dtype)


def _encode_shard(job: TextJob, shard: int, bar: tqdm) -> tuple[ShardState, int]:
    """Read shard `shard`'s captions, encode them, write the text shard; its state and the number of captions."""
    rec = job.source.shards[shard]
    url = str(job.source_folder / rec.name)
    template = job.record["source"].get("class_captions")  # a class-labelled set: its class's caption
    items = [(s.key, [template[s.label]] if template is not None else s.captions or [])
             for s in iter_shard(url, job.source, raw=True, record=rec, captions=template is None, sha256="stream")]
    flat = [(i, c) for i, (_, caps) in enumerate(items) for c in caps]
    per_sample: list[list[np.ndarray]] = [[] for _ in items]
    stats = _ShardText(job.encoder.max_length)
    for start in range(0, len(flat), job.batch_size):
        chunk = flat[start:start + job.batch_size]
        feats = job.encoder.encode([c for _, c in chunk])
        exact = [feats.trimmed(j) for j in range(len(chunk))]
        stored = [_round_trip(e, job.dtype) for e in exact]
        stats.add(feats, stored, exact)
        for (i, _), s in zip(chunk, stored):
            per_sample[i].append(s)
        bar.update(len(chunk))
    with disk_errors(job.out / shard_name(shard), "finished shards are kept"):
        with ShardWriter(job.out / shard_name(shard), dtype=job.dtype) as writer:
            for (key, _), feats_of in zip(items, per_sample):
                writer.write_text(key, feats_of)
                fault_point("extract.sample_written")
            record = writer.close()
        fault_point("extract.shard_renamed")
        from dit_pipeline.extract.state import save_shard_state

        state = ShardState(record=record, text=stats.to_dict(shard_digest(items)))
        save_shard_state(job.out, shard, state)
    log.info("finished %s: %d samples, %d captions, %d tokens, %d bytes", record.name, record.samples,
             len(flat), sum(stats.lengths), record.bytes)
    fault_point("extract.shard_done")
    return state, len(flat)


def _text_record(job: TextJob, states: list[ShardState]) -> dict[str, Any]:
    texts = [s.text for s in states if s.text is not None]
    assert len(texts) == len(states)
    import hashlib

    h = hashlib.sha256()
    for t in texts:
        h.update(bytes.fromhex(t["captions_sha256"]))
    templated = job.record["source"].get("template") is not None
    if not templated and h.hexdigest() != (job.source.captions or {}).get("sha256"):
        raise UserError(f"--data-path {job.source_folder}: the captions read from its shards do not hash to its "
                        "manifest's captions.sha256 (the set changed while this ran?); rerun with --overwrite")
    enc = job.encoder
    null = enc.null()
    max_abs = max((t["max_abs"] for t in texts), default=0.0)
    max_value = max((t["max_value"] for t in texts), default=0.0)
    return {
        "encoder": dict(enc.identity), "dim": enc.dim, "max_length": enc.max_length,
        "captions": sum(t["captions"] for t in texts), "tokens": sum(t["tokens"] for t in texts),
        "truncated": sum(t["truncated"] for t in texts),
        "length_histogram": {"edges": length_edges(enc.max_length),
                             "counts": [int(x) for x in np.sum([t["histogram"] for t in texts], axis=0)]
                             if texts else [0] * (len(length_edges(enc.max_length)) - 1)},
        "null": encode_null(_round_trip(null.trimmed(0), job.dtype), job.dtype),
        "storage_error": {"max_abs": max_abs, "max_rel": max_abs / max_value if max_value else 0.0,
                          "encoder_dtype": str(enc.dtype).removeprefix("torch."), "stored_as": job.dtype},
        "source": {**job.record["source"], **({"captions_sha256": h.hexdigest()} if templated else {})},
        "truncation": "captions longer than max_length tokens are cut to max_length (counted in truncated)",
    }


def _write_manifest(job: TextJob, states: dict[int, ShardState]) -> None:
    ordered = [states[i] for i in sorted(states)]
    src = job.source
    manifest = Manifest(
        format_version=FORMAT_VERSION_TEXT, tool_version=tool_version(), extraction=job.record,
        scaling_factor=1.0, shift_factor=None, image_size=src.image_size, views=src.views, store="text",
        dtype=job.dtype, latent_shape=[job.encoder.dim], class_names=list(src.class_names),
        num_classes=src.num_classes, total_samples=sum(s.record.samples for s in ordered),
        samples_per_shard=src.samples_per_shard, shards=[s.record for s in ordered], skipped=list(src.skipped),
        text=_text_record(job, ordered))
    with disk_errors(job.out / MANIFEST_NAME, "every shard is finished and kept"):
        fault_point("extract.before_manifest")
        write_manifest(job.out, manifest)
    report = verify_shards(job.out, quick=True, progress=False)
    if not report.ok:
        problems = "; ".join(f"{where}: {what}" for where, what in report.problems[:10])
        raise UserError(f"{job.out}: the quick verify of the new text set failed ({problems}). Rerun the same command "
                        "to redo the damaged shards.")


def run_text_extract(cfg: ExtractConfig):
    """Encode the captions of the shard set `cfg.data_path` with `cfg.text_encoder` into the text set `cfg.out`
    (one process, or every rank of a torchrun job); returns an ExtractSummary (images = samples)."""
    cfg.validate()
    check_writable_dir(cfg.out, f"--out {cfg.out}")
    dist.init(timeout_s=float(os.environ.get("DIT_DIST_TIMEOUT", EXTRACT_DIST_TIMEOUT_S)))
    setup_logging(None, quiet=cfg.quiet)
    held: list[RunLock] = []
    t0 = time.monotonic()
    try:
        job = _setup(cfg, held)
        setup_logging(job.out / LOG_DIR, quiet=cfg.quiet)
        enc = job.encoder.identity
        captions_of = (job.source.captions or {}).get("captions", job.source.total_samples)  # a template: 1 each
        log.info("dit-extract: text features of %s (%d samples, %d captions) with %s (%s, %d dims, max length %d), "
                 "stored as %s -> %s", job.source_folder, job.source.total_samples, captions_of,
                 enc["name"], enc["dtype"], enc["dim"], enc["max_length"], job.dtype, job.out)
        dist.on_rank0(lambda: start_output(job.out, job.record, options=cfg.to_dict()), _RANK_LOGS)
        total = len(job.source.shards)
        done: dict[int, ShardState] = {}
        todo: list[int] = []
        for i in plan.shards_of_rank(total, dist.rank(), dist.world_size()):
            state = finished_shard(job.out, i)
            (todo.append(i) if state is None else done.__setitem__(i, state))
        with dist.peer_guard("agreeing on the shards to write", _RANK_LOGS):
            if dist.any_true(bool(todo)) and dist.is_main():
                (job.out / MANIFEST_NAME).unlink(missing_ok=True)
            dist.barrier()
        written: dict[int, ShardState] = {}
        captions = 0
        mine = sum(job.source.shards[i].samples for i in todo)
        bar = tqdm(total=None, unit="caption", desc="text", disable=not progress_enabled(cfg.quiet) or not mine)
        with bar, pinned_threads(job.device, cfg.cpu_threads):
            for i in todo:
                written[i], n = _encode_shard(job, i, bar)
                captions += n
        with dist.peer_guard("collecting the finished shards of every rank", _RANK_LOGS):
            gathered = dist.all_gather_object(({i: s.to_dict() for i, s in {**done, **written}.items()},
                                               sum(job.source.shards[i].samples for i in written), len(done), captions))
        states = {i: ShardState.from_dict(d) for part in gathered for i, d in part[0].items()}
        assert sorted(states) == list(range(total)), "every shard is written by exactly one rank"
        dist.on_rank0(lambda: _write_manifest(job, states), _RANK_LOGS)
        kept = sum(g[2] for g in gathered)
        summary = ExtractSummary(out=str(job.out), manifest=str(job.out / MANIFEST_NAME),
                                 images=sum(g[1] for g in gathered), skipped=len(job.source.skipped),
                                 total_samples=sum(s.record.samples for s in states.values()),
                                 shards_written=len(states) - kept, shards_kept=kept,
                                 total_bytes=sum(s.record.bytes for s in states.values()),
                                 wall_s=time.monotonic() - t0, fp32_retries=0)
        if dist.is_main():
            n = sum(g[3] for g in gathered)
            log.info("done: %d captions of %d samples encoded in %.1f s (%.1f captions/s, %d rank(s)); %d shards (%d "
                     "written now, %d kept), %s; manifest %s (quick verify passed)", n, summary.images,
                     summary.wall_s, n / summary.wall_s if summary.wall_s else 0.0, dist.world_size(),
                     len(states), summary.shards_written, kept, human_bytes(summary.total_bytes), summary.manifest)
        return summary
    finally:
        for lock in held:
            lock.release()


__all__ = ["run_text_extract", "storage_dtype", "text_batch_size"]
