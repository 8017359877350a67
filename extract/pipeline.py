"""The encode loop of one rank: DataLoader batches -> VAE -> ShardWriter, shard by shard, in key order.

The GPU works on batch k while the host writes the results of batch k-1 (one batch in flight), so the
encoder is never waiting for tar writing or hashing. A shard is closed (fsync + rename by ShardWriter)
and then its state is saved; only then does it count as finished (see state.py). Fault points for the
kill tests (common.faults): `extract.sample_written` after each sample, `extract.shard_renamed` between
a shard's rename and its state file, `extract.shard_done` after both.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from tqdm import tqdm

from dit_pipeline.common.errors import UserError
from dit_pipeline.common.faults import fault_point
from dit_pipeline.common.log import get_logger
from dit_pipeline.extract.captions import NO_CAPTION, shard_digest
from dit_pipeline.extract.encode import LatentEncoder, Pending
from dit_pipeline.extract.files import ImageList
from dit_pipeline.extract.loader import Batch, printable_path
from dit_pipeline.extract.state import ShardState, save_shard_state
from dit_pipeline.shards import ShardWriter, sample_key, shard_name

log = get_logger()


@contextlib.contextmanager
def disk_errors(path: Path, kept: str) -> Iterator[None]:
    """A failed write (disk full, quota, file size limit, I/O error) becomes one clear UserError naming the
    file; the writers behind it are atomic, so what was finished before stays valid."""
    try:
        yield
    except OSError as e:
        raise UserError(f"cannot write {path} ({e.strerror or e}). Free space (or fix the folder) and rerun the "
                        f"same command: {kept}.") from None


@dataclass
class LoopStats:
    images: int = 0          # encoded this run
    skipped: int = 0         # skipped this run
    states: dict[int, ShardState] = field(default_factory=dict)   # shards finished this run


class ShardSink:
    """Writes encoded batches into their shards, opening and finishing shards as the keys move on."""

    def __init__(self, out: Path, images: ImageList, *, dtype: str, store: str, strict: bool, bar: tqdm,
                 pixels: bool = False, pixel_encoding: str = "webp-lossless", captions: bool = False):
        self.out, self.images, self.dtype, self.store, self.strict, self.bar = out, images, dtype, store, strict, bar
        self.pixels = pixels
        self.pixel_encoding = pixel_encoding
        self.captions = captions
        self.stats = LoopStats()
        self._writer: ShardWriter | None = None
        self._shard = -1
        self._skipped: list[dict] = []
        self._caps: dict = {}
        self._cap_items: list[tuple[str, list[str]]] = []

    def check_skips(self, batch: Batch) -> None:
        """Log unusable images as soon as a batch arrives; with --strict, stop at the first one."""
        for index, reason in batch.skipped:
            path = printable_path(self.images.paths[index])
            if self.strict:
                raise UserError(f"{self.images.root / path}: {reason}. --strict makes an unusable image an error; "
                                "remove or fix the file, or drop --strict to skip it (skipped images are listed "
                                "in manifest.json).")
            log.warning("skipping %s (key %s): %s", path, sample_key(index), reason)

    def _disk_errors(self, shard: int):
        return disk_errors(self.out / shard_name(shard), f"the {len(self.stats.states)} shard(s) finished by this "
                           "run and those of earlier runs are kept")

    def write(self, batch: Batch, pending: Pending) -> None:
        if batch.shard != self._shard:
            self.finish()
            with self._disk_errors(batch.shard):
                self._writer = ShardWriter(self.out / shard_name(batch.shard), dtype=self.dtype, pixels=self.pixels,
                                           store=self.store, pixels_encoding=self.pixel_encoding,
                                           captions=self.captions)
            self._shard = batch.shard
            self._skipped = []
            self._caps = {"captions": 0, "dropped_empty": 0, "dropped_undecodable": 0, "uncaptioned": 0,
                          "per_image_min": 0, "per_image_max": 0}
            self._cap_items = []
        mean, std = pending.arrays()
        with self._disk_errors(self._shard):
            for row, index in enumerate(batch.kept):
                arrays = ({"mean": mean[row], "std": std[row]} if self.store == "posterior"
                          else {"latent": mean[row]} if self.store == "sample" else {})
                if self.pixels:
                    arrays["pixels"] = batch.encoded[row]
                caps = batch.captions[row] if self.captions and batch.captions is not None else None
                self._writer.write(sample_key(index), label=self.images.labels[index], meta=batch.meta[row],
                                   captions=caps, **arrays)
                if caps is not None:
                    self._count_captions(sample_key(index), caps)
                fault_point("extract.sample_written")
        self._skipped += [{"key": sample_key(i), "path": printable_path(self.images.paths[i]), "reason": r}
                          for i, r in batch.skipped]
        if self.captions:
            self._caps["dropped_empty"] += batch.dropped[0]
            self._caps["dropped_undecodable"] += batch.dropped[1]
            self._caps["uncaptioned"] += sum(1 for _, r in batch.skipped if r.startswith(NO_CAPTION))
        self.stats.images += len(batch.kept)
        self.stats.skipped += len(batch.skipped)
        self.bar.update(len(batch.indices))

    def _count_captions(self, key: str, caps: list[str]) -> None:
        c = self._caps
        c["captions"] += len(caps)
        c["per_image_min"] = min(c["per_image_min"], len(caps)) if c["per_image_max"] else len(caps)
        c["per_image_max"] = max(c["per_image_max"], len(caps))
        self._cap_items.append((key, caps))

    def finish(self) -> None:
        """Close the open shard (if any) and save its state: from now on it counts as finished."""
        if self._writer is None:
            return
        with self._disk_errors(self._shard):
            record = self._writer.close()
            pixel_bytes = self._writer.pixel_bytes if self.pixels else None
            self._writer = None
            fault_point("extract.shard_renamed")
            caps = {**self._caps, "sha256": shard_digest(self._cap_items)} if self.captions else None
            state = ShardState(record=record, skipped=self._skipped, pixel_bytes=pixel_bytes, captions=caps)
            save_shard_state(self.out, self._shard, state)
        self.stats.states[self._shard] = state
        log.info("finished %s: %d samples, %d skipped, %d bytes", record.name, record.samples,
                 len(self._skipped), record.bytes)
        fault_point("extract.shard_done")

    def abort(self) -> None:
        if self._writer is not None:
            self._writer.abort()
            self._writer = None


def encode_and_write(loader, encoder: LatentEncoder, sink: ShardSink) -> LoopStats:
    """Run the loop over every batch of `loader`; the shard being written is aborted on any error."""
    in_flight: tuple[Batch, Pending] | None = None
    try:
        for batch in loader:
            sink.check_skips(batch)
            pending = encoder.submit(batch.pixels, batch.kept)
            if in_flight is not None:
                sink.write(*in_flight)
            in_flight = (batch, pending)
        if in_flight is not None:
            sink.write(*in_flight)
        sink.finish()
    except BaseException:
        sink.abort()
        raise
    return sink.stats
