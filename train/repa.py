"""Representation alignment in the trainer (REPA, Yu et al. 2024, arXiv:2410.06940): its settings, the teacher
checked before any GPU work, the alignment head built around the DiT, the teacher's clock and the plan line.

The pieces themselves live below: the projector, `REPAModel` and the loss in dit/repa.py (pure math), the
frozen DINOv2 teacher in common/teacher.py, the pixels in the shards (`dit-extract --pixels`, shards/pixels.py)
and in the loader (`Batch.pixels`, in the orientation of each latent's view). Each micro-batch's pixels go
through the teacher on the training device (bf16 autocast on CUDA, no gradients), the DiT's tokens after block
`repa_depth` through the projector, and the loss becomes denoising + `repa_coeff` x (-cosine similarity).
REPA is defined for flow matching (SiT); with `--objective ddpm` the same term is added to DiT's loss (the
projector sees the same hidden state; nothing else changes). The projector is a checkpoint part of its own
(train.model_parts.ProjectorPart); the EMA file stays the bare DiT, which dit-sample loads as any other.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dit_pipeline.common.errors import UserError
from dit_pipeline.common.settings import positive, setting
from dit_pipeline.common.teacher import DEFAULT_TEACHER, Teacher, load_teacher

REPA = "Representation alignment (REPA)"  # the --help section
MIX_CACHED = "cached"  # --repa cached: a data mix's sources name their cached teacher tokens (repa=)
EXTRACT_HINT = "dit-extract --data-path IMAGES --encoder dinov2-b --encoder-formula repa --out FOLDER"


@dataclass(kw_only=True)
class RepaSettings:
    """The alignment settings; dit-train's TrainConfig inherits them."""

    repa: str | None = setting(
        None, "Align the DiT's hidden state with a frozen teacher that sees the training pixels (REPA): "
        f"{DEFAULT_TEACHER} or dinov2_vitb14_reg (Meta's file in torch.hub's cache), a local weights file, or a "
        "Hugging Face id such as timm/vit_base_patch14_dinov2.lvd142m; needs shards extracted with --pixels. Or "
        "a sibling shard folder of the teacher's cached tokens (dit-extract --encoder dinov2-b --encoder-formula "
        "repa): no teacher forward, no pixels. With a data mix, `cached`: each source's tokens, named by its repa= "
        "key",
        group=REPA, shown="off")
    repa_depth: int = setting(8, "The block whose output tokens are aligned (1..depth; 8 in REPA's runs)", group=REPA)
    repa_coeff: float = setting(0.5, "Weight of the alignment term: loss = denoising + coeff x alignment",
                                group=REPA)

    def repa_problems(self) -> list[str]:
        if self.repa is None:
            return []
        p = positive(self, "repa_depth")
        if not str(self.repa).strip():
            p.append(f"--repa needs a teacher, e.g. --repa {DEFAULT_TEACHER}")
        if not (isinstance(self.repa_coeff, (int, float)) and self.repa_coeff > 0):
            p.append(f"--repa-coeff must be > 0, got {self.repa_coeff!r}")
        return p


class CachedTeacher:
    """`--repa FOLDER`: the teacher's tokens read from a sibling shard set (shards/siblings.py) of the teacher's
    features (`dit-extract --encoder ... --encoder-formula repa`): no online teacher and no pixels. The batches
    carry the tokens (`train.data.Batch.teacher`); this object stands where the `Teacher` stands (identity,
    width, token count, its cost: none)."""

    def __init__(self, folder: str, manifest: Any, where: str | None = None):
        """`where`: where the tokens are, for the plan and the record (default: in `folder`; a data mix's:
        beside each source)."""
        self.folder, self.manifest = folder, manifest
        self.label = f"--repa {folder}" if where is None else f"--repa {MIX_CACHED} (the tokens {where})"
        c, h, w = manifest.latent_shape
        self.dim, self.grid, self.num_tokens = int(c), int(h), int(h * w)
        self.encoder = enc = dict(manifest.extraction.get("encoder") or {})
        self.identity = {"name": f"cached {enc.get('model')} tokens {where or f'in {folder}'}", "cached": str(folder),
                         "encoder": enc, "weights_sha256": enc.get("weights_sha256")}
        self.image_size = int(enc.get("input_size") or 0)

    def to(self, device: Any) -> "CachedTeacher":
        return self

    def forward_macs(self) -> int:
        return 0

    def check_tokens(self, tokens: int, what: str = "the DiT") -> None:
        if tokens != self.num_tokens:
            raise UserError(f"{self.label}: its tokens are {self.grid}x{self.grid} per image but {what} has "
                            f"{tokens}; extract the teacher's features at the DiT's token grid")

    def __call__(self, pixels: Any) -> Any:
        raise AssertionError("cached teacher tokens come with the batch (Batch.teacher)")


def open_cached_teacher(folder: str, manifest: Any, flag: str = "--repa") -> CachedTeacher:
    """The cached tokens in `folder` (given as `flag`: --repa, or a data mix's source repa=) of the set of
    `manifest`: a sibling of it (shards/siblings.py) holding the `repa` formula's tokens."""
    from dit_pipeline.shards.siblings import read_sibling

    if manifest is None:
        raise UserError(f"{flag} {folder}: cached teacher tokens need the training shards' manifest")
    m = read_sibling(manifest, folder, flag)
    enc = m.extraction.get("encoder") or {}
    if not enc or m.store != "sample":
        raise UserError(f"{flag} {folder}: holds no teacher features (its manifest records no --encoder); extract "
                        f"them with {EXTRACT_HINT}")
    if enc.get("formula_name") != "repa":
        raise UserError(f"{flag} {folder}: its features are {enc.get('formula_name', 'rae')}'s, not the tokens REPA's "
                        "teacher aligns to (normalize, resize, final norm with affine); extract them with "
                        "--encoder-formula repa")
    return CachedTeacher(folder, m)


def mix_teacher(mix: Any) -> CachedTeacher:
    """--repa cached: the tokens of a data mix's sources (train.mix.OpenMix; opened and checked to be one encoder's,
    of one shape, when the mix was opened) as one teacher for the plan and the record."""
    first = mix.sources[0].repa
    where = "beside each source (" + ", ".join(f"{o.name}: {o.spec.repa}" for o in mix.sources) + ")"
    teacher = CachedTeacher(first.folder, first.manifest, where)
    teacher.identity["cached"] = {o.name: str(o.spec.repa) for o in mix.sources}
    return teacher


def is_cached(spec: str | None) -> bool:
    """Whether --repa names a shard folder of cached teacher tokens (rather than a teacher)."""
    return spec is not None and (Path(spec).expanduser() / "manifest.json").is_file()


def check_repa(settings: RepaSettings, *, has_pixels: bool, where: str, depth: int, grid: int,
               manifest: Any = None, mix: Any = None) -> "Teacher | CachedTeacher | None":
    """Before any GPU work: the shard set has pixels, the aligned block exists, and the teacher loads (on the
    CPU: a missing or foreign file fails here, also in a dry run) and gives one token per DiT token. A shard
    folder (`--repa FOLDER`): the sibling set of cached tokens, checked against `manifest` instead; `--repa cached`
    with a data mix (`mix`, train.mix.OpenMix): each source's (repa=), checked when the mix was opened."""
    if settings.repa is None:
        return None
    if mix is not None and settings.repa == MIX_CACHED:
        if settings.repa_depth > depth:
            raise UserError(f"--repa-depth {settings.repa_depth}: the model has {depth} blocks; choose 1..{depth}")
        cached = mix_teacher(mix)
        cached.check_tokens(grid * grid)
        return cached
    if is_cached(settings.repa):
        if settings.repa_depth > depth:
            raise UserError(f"--repa-depth {settings.repa_depth}: the model has {depth} blocks; choose 1..{depth}")
        cached = open_cached_teacher(str(settings.repa), manifest)
        cached.check_tokens(grid * grid)
        return cached
    if settings.repa == MIX_CACHED:
        raise UserError(f"--repa {MIX_CACHED} aligns to each data-mix source's cached tokens (their repa= key in "
                        "--source / --mix); with one shard set give the tokens' folder: --repa FOLDER")
    if not has_pixels:
        raise UserError(f"--repa needs the training pixels, but the shard set in {where} was extracted without "
                        "them; extract again with dit-extract --pixels (the latents are the same)")
    if settings.repa_depth > depth:
        raise UserError(f"--repa-depth {settings.repa_depth}: the model has {depth} blocks; choose 1..{depth}")
    teacher = load_teacher(settings.repa, grid=grid, device="cpu")
    teacher.check_tokens(grid * grid)
    return teacher


def repa_line(settings: RepaSettings, teacher: "Teacher | CachedTeacher | None", depth: int,
              step_flops: float) -> list[str]:
    """The plan's line on the alignment (none without --repa): the teacher, the block, the weight and the
    teacher's cost next to a training step's."""
    if teacher is None:
        return []
    ident = teacher.identity
    if isinstance(teacher, CachedTeacher):
        return [f"  repa        {ident['name']} ({teacher.num_tokens} tokens of {teacher.dim}), no teacher forward; "
                f"aligned after block {settings.repa_depth} of {depth}, coefficient {settings.repa_coeff:g}"]
    weights = ident.get("weights_sha256")
    fwd = 2.0 * teacher.forward_macs()
    return [f"  repa        teacher {ident.get('name')} ({teacher.image_size} px, {teacher.num_tokens} tokens of "
            f"{teacher.dim}{f', weights sha256 {weights[:12]}' if weights else ''}), frozen; aligned after block "
            f"{settings.repa_depth} of {depth}, coefficient {settings.repa_coeff:g}; teacher forward "
            f"{fwd / 1e9:.2f} GFLOP per image = {fwd / max(step_flops, 1.0):.1%} of a training step's FLOPs"]


class TeacherClock:
    """The seconds the teacher takes, for the `teacher_time` metric. On CUDA the teacher runs asynchronously,
    so its time is read from CUDA events once they have completed (at the latest one step later), never by
    waiting for the GPU; on the CPU it is the wall time of the call."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._pending: list[tuple[Any, Any]] = []
        self._t0 = 0.0
        self._done = 0.0

    def __enter__(self) -> "TeacherClock":
        if self.cuda:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            self._pending.append((start, torch.cuda.Event(enable_timing=True)))
        else:
            self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.cuda:
            self._pending[-1][1].record()
        else:
            self._done += time.perf_counter() - self._t0

    def take(self) -> float:
        """The seconds measured since the last call (on CUDA: of the calls whose events have completed)."""
        if self.cuda:
            done = [e.query() for _, e in self._pending]
            self._done += sum(s.elapsed_time(e) for (s, e), d in zip(self._pending, done) if d) / 1e3
            self._pending = [pair for pair, d in zip(self._pending, done) if not d]
        out, self._done = self._done, 0.0
        return out
