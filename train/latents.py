"""Stored arrays -> the model's training latents, a batch at a time (docs/FORMAT.md, "The latent the model sees").

latent = (z - shift) * scale with z = mean + std * noise (`latent_sample` "sample", the default), z = mean (the
posterior's mode: `latent_sample` "mean", NanoGen's encoding, End2End-Diffusion/diffusion-bench src/stage1/vae.py
`sample_mode="mode"`), or z = the stored latent for store "sample", and the
manifest's normalization (common/latent_norm.py: the scalar `(z - shift_factor) * scaling_factor` of diffusers'
pipelines, shift 0 for the SD-VAE, or per-channel vectors). Per-sample randomness (which view when the shards hold V > 1
views, and the posterior noise) comes from the sample seed mix_seed(epoch_seed(seed, epoch), key index),
so it depends on nothing but (seed, epoch, key): not on the batch, the worker, the rank or an interruption.

Cost matters here (every sample of every epoch passes through, in loader workers): a sample's view is
chosen as soon as it is read and kept in its stored dtype; the noise is drawn per sample from one
re-seeded generator, everything else runs once per batch on reused buffers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Sequence

import numpy as np
import torch

from dit_pipeline.common.latent_norm import LatentNorm
from dit_pipeline.common.pixels import to_latent
from dit_pipeline.common.seeding import STREAM_SAMPLE, derive_seed
from dit_pipeline.shards import LatentSample, Manifest, decode_pixels, key_index, view_pixels
from dit_pipeline.shards.format import PIXEL_STORE
from dit_pipeline.shards.pixels import ENCODING


LATENT_SAMPLES = ("sample", "mean")  # from a stored posterior: a fresh draw mean + std x noise, or its mean (mode)


@dataclass(frozen=True)
class LatentSpec:
    """How stored arrays become the model's training latents."""

    store: str
    views: int
    shape: tuple[int, int, int]
    norm: LatentNorm                   # z -> the model's latent (the manifest's normalization)
    pixels_encoding: str = ENCODING    # how the set stores its crops (shards/pixels.py)
    latent_sample: str = "sample"      # a posterior's draw or its mean (LATENT_SAMPLES)

    @classmethod
    def from_manifest(cls, m: Manifest, latent_sample: str = "sample") -> "LatentSpec":
        if latent_sample not in LATENT_SAMPLES:
            raise ValueError(f"latent_sample must be one of {', '.join(LATENT_SAMPLES)}, got {latent_sample!r}")
        c, h, w = m.latent_shape
        return cls(m.store, m.views, (c, h, w), m.norm, str((m.pixels or {}).get("encoding", ENCODING)),
                   latent_sample)

    @property
    def draws(self) -> bool:
        """Whether each latent is a fresh draw from the stored posterior (mean + std x noise)."""
        return self.store == "posterior" and self.latent_sample == "sample"

    @property
    def arrays(self) -> int:
        """Stored arrays a sample contributes: mean and std for a draw, else the mean or the latent (none for a
        pixel set: its crop)."""
        if self.store == "posterior":
            return 2 if self.draws else 1
        return {"sample": 1}.get(self.store, 0)

    @property
    def from_pixels(self) -> bool:
        """A pixel-space set (common/pixels.py): each latent is made from the sample's stored crop."""
        return self.store == PIXEL_STORE


def latent_sample_problem(m: Manifest, latent_sample: str) -> str | None:
    """Why `latent_sample` cannot be honoured on the set of manifest `m` (None: it can): "mean" needs the posterior's
    mean, which a set of one stored draw (dit-extract --store sample of a VAE with a posterior) no longer has. A set
    without a posterior (a feature encoder's, pixels, a VAE whose encoder gives a latent) holds its one latent, which
    is its mean, and so does a set of the posterior's mode (`--store mode`: the mean stored alone)."""
    if latent_sample != "mean" or m.store != "sample" or (m.extraction or {}).get("store") == "mode":
        return None
    vae = (m.extraction or {}).get("vae") or {}
    if (m.extraction or {}).get("encoder") or vae.get("encoder_output") == "latent":
        return None
    return ("--latent-sample mean trains on the VAE posterior's mean, and this set stores one draw of the posterior "
            "(store sample): extract the set with --store posterior, or train with --latent-sample sample")


_MASK64 = (1 << 64) - 1


def epoch_seed(seed: int, epoch: int) -> int:
    """The base of the per-sample seeds of `epoch` (one SeedSequence hash per epoch, not per sample)."""
    return derive_seed(seed, STREAM_SAMPLE, epoch)


def mix_seed(base: int, index: int) -> int:
    """Sample `index`'s 63-bit seed from its epoch's base: output number index + 1 of SplitMix64 started
    at `base` (Steele, Lea & Flood 2014; Java's SplittableRandom, and the usual way to seed generators).
    Distinct indices give distinct 64-bit values (a Weyl step, then a bijective finaliser); about 1 us in
    Python against about 10 us for a SeedSequence hash per sample."""
    z = (base + (index + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def sample_seed(seed: int, epoch: int, key: str) -> int:
    """The seed of one sample's randomness in `epoch` (independent of batch, worker and rank)."""
    return mix_seed(epoch_seed(seed, epoch), key_index(key))


def sample_view(sample_seed_: int, views: int) -> int:
    """Which stored view (e.g. original / mirrored) a sample uses: bits 32.. of its seed, mod V. The noise
    generator is seeded with the seed as well (torch's CPU generator uses its low 32 bits), so a separate
    draw is not needed for the view."""
    return (sample_seed_ >> 32) % views if views > 1 else 0


class Pending(NamedTuple):
    """A sample between reading and batching: its chosen view, still in the stored dtype."""

    arrays: np.ndarray | None  # [A, C, h, w] storage dtype: (mean, std) of the chosen view, or (latent,); pixel set: None
    label: int
    key: int                   # global sample index
    seed: int                  # sample_seed: the posterior noise
    view: int = 0              # the stored view the latent comes from (1: the mirror of a flipped set)
    pixels: bytes | None = None  # the encoded crop (sets with pixels, when the trainer needs them)
    teacher: np.ndarray | None = None  # [C', h', w'] stored: the sibling set's tokens of this view (--repa FOLDER)


def pending(sample: LatentSample, spec: LatentSpec, base: int, teacher: np.ndarray | None = None) -> Pending:
    """Pick the sample's view (from its seed; base = epoch_seed) and copy just that view out of the member
    bytes, so a shuffle buffer holds A x C x h x w stored values per sample, not every view."""
    index = key_index(sample.key)
    sd = mix_seed(base, index)
    v = sample_view(sd, spec.views)
    arrays: np.ndarray | None = None  # a pixel set's latent is its crop (the pixels bytes, decoded per batch)
    if spec.draws:
        assert sample.mean is not None and sample.std is not None  # the reader checked the fields
        mean = sample.mean[v]
        arrays = np.empty((2, *mean.shape), dtype=mean.dtype)
        arrays[0], arrays[1] = mean, sample.std[v]
    elif spec.store == "posterior":  # latent_sample "mean": the posterior's mean alone, as a stored latent
        assert sample.mean is not None
        arrays = np.array(sample.mean[v:v + 1])
    elif spec.store == "sample":
        assert sample.latent is not None
        arrays = np.array(sample.latent[v:v + 1])
    return Pending(arrays, sample.label, index, sd, v, None if sample.pixels is None else bytes(sample.pixels),
                   None if teacher is None else np.array(teacher[v]))


def build_teacher(items: Sequence[Pending], dtype: str, out: torch.Tensor | None = None) -> torch.Tensor:
    """[B, h' * w', C'] float32: each item's cached teacher tokens (the sibling set's stored latent of the same
    view, raw: REPA aligns to unnormalized features), in the token order of a ViT's patch sequence (row-major)."""
    from dit_pipeline.shards.npy import widen

    first = items[0].teacher
    assert first is not None, "the reader was asked for the sibling's tokens"
    c, h, w = first.shape
    out = out if out is not None else torch.empty((len(items), h * w, c), dtype=torch.float32)
    rows = out.numpy()
    for it, row in zip(items, rows):
        assert it.teacher is not None
        row[...] = widen(it.teacher, dtype).reshape(c, h * w).T
    return out


def build_pixels(items: Sequence[Pending], image_size: int, out: torch.Tensor | None = None,
                 encoding: str = ENCODING) -> torch.Tensor:
    """[B, H, W, 3] uint8: each item's crop in the orientation of its latent's view (view 1 of a flipped set is
    the stored crop mirrored left-right, shards.view_pixels), so a teacher sees exactly the image the latent
    was encoded from. `out`: where to write (e.g. shared memory)."""
    out = out if out is not None else torch.empty((len(items), image_size, image_size, 3), dtype=torch.uint8)
    rows = out.numpy()
    for it, row in zip(items, rows):
        assert it.pixels is not None, "the reader was asked for the pixels"
        row[...] = view_pixels(decode_pixels(it.pixels, image_size, encoding), it.view)
    return out


def _stored_tensor(stored: np.ndarray) -> torch.Tensor:
    """The stored values as a tensor without converting them: float16 / float32 as they are, bfloat16 bits
    (<u2, docs/FORMAT.md) reinterpreted as torch.bfloat16. Arithmetic with float32 widens them exactly."""
    if stored.dtype == np.uint16:
        return torch.from_numpy(stored.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(stored)


class Scratch:
    """Buffers one reader reuses from batch to batch. Fresh memory costs a page fault per 4 KiB (microseconds
    each in a virtual machine), more than the arithmetic on it; the stacked stored values and their float32
    copy therefore live here, and only the output batch is new memory."""

    def __init__(self) -> None:
        self._arrays: dict[tuple, Any] = {}

    def numpy(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        key = ("np", shape, np.dtype(dtype).str)
        if key not in self._arrays:
            self._arrays[key] = np.empty(shape, dtype=dtype)
        return self._arrays[key]

    def torch(self, shape: tuple[int, ...]) -> torch.Tensor:
        key = ("torch", shape)
        if key not in self._arrays:
            self._arrays[key] = torch.empty(shape)
        return self._arrays[key]


def build_latents(items: Sequence[Pending], spec: LatentSpec, out: torch.Tensor | None = None,
                  scratch: Scratch | None = None) -> torch.Tensor:
    """[B, C, h, w] float32 training latents: (mean + std * noise - shift) * scale of each item's view (scalar or
    per channel: spec.norm; (mean - shift) * scale with spec.latent_sample "mean"), with
    noise = torch.randn(C, h, w) of a CPU generator seeded with the item's seed (torch's normal sampler is
    several times faster than numpy's at these sizes). One generator is re-seeded per sample; the affine
    part runs once over the batch, one elementwise op at a time (each exactly rounded, so a sample's values
    do not depend on the batch it is in). `out`: where to write (e.g. shared memory)."""
    scratch = scratch if scratch is not None else Scratch()
    if spec.from_pixels:  # the crop of each item's view, to [-1, 1] (common/pixels.py), normalized (identity)
        c, h, w = spec.shape
        crops = scratch.numpy((len(items), h, w, c), np.dtype(np.uint8))
        build_pixels(items, h, torch.from_numpy(crops), spec.pixels_encoding)
        return spec.norm.apply(to_latent(crops, out))
    arrays = [it.arrays for it in items if it.arrays is not None]
    assert len(arrays) == len(items), "a latent set's items carry their stored arrays"
    shape = (len(items), spec.arrays, *spec.shape)
    stored = scratch.numpy(shape, arrays[0].dtype)
    np.stack(arrays, out=stored)  # [B, A, C, h, w] as stored
    z = out if out is not None else torch.empty(shape[:1] + shape[2:])
    if spec.draws:
        g = torch.Generator()
        for it, row in zip(items, z.unbind(0)):
            g.manual_seed(it.seed)
            row.normal_(generator=g)  # the values of torch.randn(C, h, w, generator=g)
        wide = scratch.torch(shape).copy_(_stored_tensor(stored))  # exact for every stored dtype
        z.mul_(wide[:, 1]).add_(wide[:, 0])
    else:
        z.copy_(_stored_tensor(stored)[:, 0])
    return spec.norm.apply(z)


def make_latents(samples: Sequence[LatentSample], spec: LatentSpec, seed: int, epoch: int) -> torch.Tensor:
    """[B, C, h, w]: the training latents of `samples` (raw or float32 LatentSamples) in `epoch` (spec.latent_sample:
    a posterior's draw or its mean)."""
    base = epoch_seed(seed, epoch)
    return build_latents([pending(s, spec, base) for s in samples], spec)


def make_latent(sample: LatentSample, spec: LatentSpec, seed: int, epoch: int) -> torch.Tensor:
    """[C, h, w] float32 training latent of one sample in `epoch` (equal to its row in any batch)."""
    return make_latents([sample], spec, seed, epoch)[0]
