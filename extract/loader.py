"""Parallel decode + crop with a torch DataLoader, delivering batches in key order.

Each DataLoader batch is one `plan.batches_of` chunk of a shard (consecutive global indices), decoded and
cropped by the worker processes in parallel and handed back in order, so what the encoder sees (and hence
every shard byte) does not depend on `--num-workers`. Unusable images come back as skips with their
reason instead of pixels; the batch's pixel tensor holds only the usable ones, pinned for a fast,
non-blocking copy to the GPU.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from dit_pipeline.common.workers import worker_context
from dit_pipeline.extract.captions import CaptionCounts, CaptionIndex, clean
from dit_pipeline.extract.images import MAX_PIXELS, SkippedImage, load_and_crop
from dit_pipeline.shards.pixels import ENCODING, encode_pixels


def printable_path(rel: str) -> str:
    """A relative path safe for UTF-8 JSON: undecodable filename bytes shown as \\xNN escapes."""
    return rel.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


@dataclass
class Decoded:
    """One image after a worker's decode + crop: pixels, or the reason it was skipped."""

    index: int
    pixels: np.ndarray | None          # uint8 [size, size, 3]
    meta: dict | None
    reason: str | None = None
    encoded: bytes | None = None       # with --pixels: `pixels` as the shard stores them (shards.encode_pixels)
    captions: CaptionCounts | None = None  # with --captions: the image's captions after the caption policy


@dataclass
class Batch:
    """A shard's chunk of consecutive indices: usable images stacked, skipped ones listed."""

    shard: int
    indices: list[int]                                 # every index of the chunk, in order
    kept: list[int]                                    # indices with pixels, in order
    pixels: torch.Tensor | None                        # uint8 [len(kept), size, size, 3]
    meta: list[dict]                                   # per kept index
    skipped: list[tuple[int, str]] = field(default_factory=list)   # (index, reason)
    encoded: list[bytes] | None = None                 # with --pixels: per kept index, its stored pixels
    captions: list[list[str]] | None = None            # with --captions: per kept index, its captions
    dropped: tuple[int, int] = (0, 0)                  # captions dropped in the chunk: (empty, undecodable)

    def pin_memory(self) -> "Batch":  # called by the DataLoader's pin-memory thread
        if self.pixels is not None:
            self.pixels = self.pixels.pin_memory()
        return self


class CropDataset(Dataset):
    """Global index -> `Decoded` (decode, convert to RGB, ADM center crop)."""

    def __init__(self, root: str | Path, paths: Sequence[str], image_size: int, max_pixels: int = MAX_PIXELS,
                 pixels: bool = False, pixel_encoding: str = ENCODING, members: Any = None,
                 captions: CaptionIndex | None = None):
        self.root = str(root)
        self.members = members      # WebDataset input: the tar members holding the images (extract/webdataset.py)
        self.captions = captions    # --captions: where each image's captions are
        # One byte buffer + offsets instead of a list of 1.28M str objects: forked workers share it without
        # copy-on-write page faults from reference counting, and it pickles compactly for spawned ones.
        encoded = [p.encode("utf-8", "surrogateescape") for p in paths]
        self._blob = np.frombuffer(b"".join(encoded), dtype=np.uint8)
        self._offsets = np.cumsum([0] + [len(e) for e in encoded], dtype=np.int64)
        self.image_size = image_size
        self.max_pixels = max_pixels
        self.pixels = pixels
        self.pixel_encoding = pixel_encoding

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def rel_path(self, index: int) -> str:
        start, stop = self._offsets[index], self._offsets[index + 1]
        return self._blob[start:stop].tobytes().decode("utf-8", "surrogateescape")

    def __getitem__(self, index: int) -> Decoded:
        rel = self.rel_path(index)
        caps = None
        if self.captions is not None:  # first: an image without a caption is skipped without being decoded
            raw, what = self.captions.candidates(self.root, rel, index)
            caps = clean(raw, what)
            if caps.problem is not None:
                return Decoded(index, None, None, caps.problem, captions=caps)
        try:
            source = self.members.read(index) if self.members is not None else f"{self.root}/{rel}"
            pixels, info = load_and_crop(source, self.image_size, self.max_pixels)
        except SkippedImage as e:
            return Decoded(index, None, None, e.reason)
        meta = {"path": printable_path(rel), "orig_size": [info.width, info.height], "orig_mode": info.mode,
                "orig_format": info.format}
        # Encoded here, in the worker, from the very array the encoder gets: the shard's pixels are the
        # VAE's input, and the encode cost runs in parallel with decoding instead of in the writer.
        encoded = encode_pixels(pixels, self.pixel_encoding) if self.pixels else None
        return Decoded(index, pixels, meta, encoded=encoded, captions=caps)


class ShardBatches:
    """Batch sampler: the chunks of the given shards, in order, as lists of global indices."""

    def __init__(self, chunks: Sequence[tuple[int, range]]):
        self.chunks = list(chunks)

    def __iter__(self) -> Iterator[list[int]]:
        for _, chunk in self.chunks:
            yield list(chunk)

    def __len__(self) -> int:
        return len(self.chunks)


class _Collate:
    """Stack a chunk's decoded images into one uint8 tensor (picklable for worker processes)."""

    def __init__(self, samples_per_shard: int):
        self.samples_per_shard = samples_per_shard

    def __call__(self, items: list[Decoded]) -> Batch:
        kept = [d for d in items if d.pixels is not None]
        pixels = torch.from_numpy(np.stack([d.pixels for d in kept])) if kept else None
        return Batch(shard=items[0].index // self.samples_per_shard, indices=[d.index for d in items],
                     kept=[d.index for d in kept], pixels=pixels, meta=[d.meta for d in kept],
                     skipped=[(d.index, d.reason) for d in items if d.pixels is None],
                     encoded=[d.encoded for d in kept] if kept and kept[0].encoded is not None else None,
                     captions=[d.captions.captions for d in kept if d.captions is not None] if any(
                         d.captions is not None for d in items) else None,
                     dropped=(sum(d.captions.dropped_empty for d in items if d.captions is not None),
                              sum(d.captions.dropped_undecodable for d in items if d.captions is not None)))


def make_loader(dataset: CropDataset, chunks: Sequence[tuple[int, range]], *, samples_per_shard: int,
                num_workers: int, pin_memory: bool) -> DataLoader:
    """A DataLoader yielding one `Batch` per (shard, chunk) in `chunks`, in that order."""
    kwargs = {}
    if num_workers > 0:
        kwargs = {"prefetch_factor": 4, "persistent_workers": False, "multiprocessing_context": worker_context()}
    return DataLoader(dataset, batch_sampler=ShardBatches(chunks), num_workers=num_workers,
                      collate_fn=_Collate(samples_per_shard), pin_memory=pin_memory, **kwargs)
