"""Labelled PNG grids of samples, for `dit-sample --out` and the trainer's periodic `RUN/samples/`.

`sample_grid` draws a fixed set of classes and seeds with the same code path as `dit-sample` (noise of
sample i from (seed, i)), so a grid the trainer saved at step k is reproduced by
`dit-sample --ckpt step-k.pt --class-labels <same> --seed <same> --sampler <same> --steps <same>`.
`save_grid` tiles uint8 images with torchvision's `make_grid` and writes each tile's class in its corner.
"""
from __future__ import annotations

import io
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from torch import nn

from dit_pipeline import dit
from dit_pipeline.common.determinism import DEFAULT_CPU_THREADS, pinned_threads
from dit_pipeline.common.errors import UserError
from dit_pipeline.common.hooks import HookContext, evaluating
from dit_pipeline.common.io import atomic_write_bytes
from dit_pipeline.common.latent_norm import LatentNorm
from dit_pipeline.common.settings import choice, flag_name, positive, setting
from dit_pipeline.common.precision import AUTOCAST_DTYPES
from dit_pipeline.common.rae_decoder import fit_decoder
from dit_pipeline.common.vae import load_vae
from dit_pipeline.dit.respace import TRAIN_TIMESTEPS, ddim_stride, nearest_ddim_steps
from dit_pipeline.sample.config import GRID_SAMPLER, SAMPLERS
from dit_pipeline.sample.generate import (as_norm, generate_images, generate_latents, guided_model_fn,
                                          make_diffusion, resolve_cfg_channels)

GRID_PADDING = 2


def grid_shape(n: int, ncol: int | None = None) -> tuple[int, int]:
    """(rows, cols) of the grid for n tiles; cols default to ceil(sqrt(n))."""
    cols = min(n, ncol) if ncol else max(1, math.ceil(math.sqrt(n)))
    return math.ceil(n / cols), cols


def grid_size(n: int, height: int, width: int, ncol: int | None = None,
              padding: int = GRID_PADDING) -> tuple[int, int]:
    """(height, width) in pixels of the grid save_grid writes (make_grid's layout)."""
    rows, cols = grid_shape(n, ncol)
    return rows * (height + padding) + padding, cols * (width + padding) + padding


def png_bytes(image: np.ndarray) -> bytes:
    """uint8 [H, W, 3] -> PNG file bytes (lossless, so the pixels read back exactly)."""
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(image), "RGB").save(buf, format="PNG")
    return buf.getvalue()


def _draw_labels(grid: np.ndarray, labels: Sequence[int | str], tile_hw: tuple[int, int], cols: int,
                 padding: int) -> np.ndarray:
    from PIL import Image, ImageDraw

    from dit_pipeline.sample.fonts import label_runs

    img = Image.fromarray(grid)
    draw = ImageDraw.Draw(img)
    h, w = tile_hw
    size = max(8, h // 16)
    for k, label in enumerate(labels):
        x = padding + (k % cols) * (w + padding)
        y = padding + (k // cols) * (h + padding)
        text = label if isinstance(label, str) else str(int(label))
        for line in text.split("\n"):  # a wrapped prompt: one line under the other
            if line and y < padding + (k // cols) * (h + padding) + h - 1:
                y = _draw_line(draw, line, x, y, w, h, size, label_runs) + 1
    return np.array(img)  # a writable copy (PIL's buffer is read-only)


def _draw_line(draw: Any, text: str, x: int, y: int, w: int, h: int, size: int, label_runs: Any) -> int:
    """One line of a tile's label, white on black at (x, y); returns its bottom."""
    # runs of one font each (sample/fonts.py: a font that has the glyphs, so no name is drawn as boxes)
    placed, left = [], x + 1
    for font, piece in label_runs(text, size):
        placed.append((left, font, piece))
        left += draw.textlength(piece, font=font)
    boxes = [draw.textbbox((px, y), piece, font=font) for px, font, piece in placed]
    right, bottom = max(b[2] for b in boxes), max(b[3] for b in boxes)
    draw.rectangle((x, y, min(right + 1, x + w - 1), min(bottom + 1, y + h - 1)), fill=(0, 0, 0))
    for px, font, piece in placed:
        draw.text((px, y), piece, fill=(255, 255, 255), font=font)
    return int(bottom)


def save_grid(images: np.ndarray | torch.Tensor, path: str | Path, *, labels: Sequence[int | str] | None = None,
              ncol: int | None = None, padding: int = GRID_PADDING) -> Path:
    """Write uint8 images [N, H, W, 3] as one PNG grid (atomically); returns the path.

    labels: class of each image, printed in the tile's top-left corner (None: no text).
    The PNG is `grid_size(N, H, W, ncol, padding)` pixels.
    """
    from torchvision.utils import make_grid

    arr = np.asarray(images.cpu() if isinstance(images, torch.Tensor) else images)
    if arr.dtype != np.uint8 or arr.ndim != 4 or arr.shape[-1] != 3 or len(arr) == 0:
        raise ValueError(f"save_grid expects uint8 [N, H, W, 3] with N >= 1, got {arr.dtype} {list(arr.shape)}")
    if labels is not None and len(labels) != len(arr):
        raise ValueError(f"{len(labels)} labels for {len(arr)} images")
    _, cols = grid_shape(len(arr), ncol)
    grid = make_grid(torch.from_numpy(arr).permute(0, 3, 1, 2), nrow=cols, padding=padding, pad_value=0)
    grid_hwc = grid.permute(1, 2, 0).contiguous().numpy()
    if labels is not None:
        grid_hwc = _draw_labels(grid_hwc, labels, arr.shape[1:3], cols, padding)
    path = Path(path)
    atomic_write_bytes(path, png_bytes(grid_hwc))
    return path


@torch.no_grad()
def sample_grid(model: nn.Module, *, vae: nn.Module | None, scaling_factor: float | None = None,
                shift_factor: float | None = None, class_labels: Sequence[int], seed: int, steps: int = 50,
                sampler: str = "ddim", cfg_scale: float = 4.0, cfg_channels: str = "auto", batch_size: int | None = None,
                precision: str = "fp32", cpu_threads: int = DEFAULT_CPU_THREADS,
                norm: LatentNorm | None = None, time_shift: float = 1.0,
                prediction: dict[str, Any] | None = None, conds: Any = None) -> np.ndarray | None:
    """Sample one image per entry of `class_labels` -> uint8 [N, H, W, 3] (numpy).

    model: a DiT (not DDP-wrapped; pass the EMA copy) on its device; `vae` on the same device.
    Image i uses the noise of (seed, i), exactly as `dit-sample --seed seed --class-labels ...` would.
    The model is switched to eval mode for sampling (no class dropout) and restored afterwards.
    precision: "fp32", "bf16" or "fp16" autocast for the DiT (the VAE decodes in float32).
    norm: the latent normalization to invert before decoding (or the scalar scaling_factor / shift_factor).
    vae None: the same network passes and no pictures (None): a sharded run's ranks beside the one that decodes.
    batch_size: images per batch (default: all in one). Bit-identical to `dit-sample` with the same batch
    size and `--cpu-threads` on the same machine; another batch size changes the last float bits.
    time_shift: a flow sampler's grid shift (dit/shift.py; the run's, as dit-sample reads it from the checkpoint).
    prediction: a flow model's recorded prediction (dit.flow_predictions.prediction_from_record; None: velocity).
    conds: the condition's sampling object (sample.conditions.Sampling, e.g. a text model's prompts: each image's
    inputs and the guidance's null, as dit-sample takes them); None: the class labels and the model's null class.
    """
    if sampler not in SAMPLERS:
        raise ValueError(f"sampler must be one of {', '.join(SAMPLERS)}, got {sampler!r}")
    labels = [int(c) for c in class_labels]
    objective = "flow" if sampler in dit.FLOW_SAMPLERS else "ddpm"
    cfg_channels = resolve_cfg_channels(cfg_channels, model.config, objective)  # auto: the model's rule
    flow = {"time_shift": float(time_shift), "prediction": prediction} if sampler in dit.FLOW_SAMPLERS else {}
    diffusion = make_diffusion(sampler, steps, learn_sigma=bool(model.learn_sigma), **flow)
    device = next(model.parameters()).device
    how: dict[str, Any] = {"sampler": sampler, "cfg_scale": cfg_scale, "cfg_channels": cfg_channels,
                           "autocast_dtype": AUTOCAST_DTYPES[precision]}
    if conds is not None:  # guidance against the condition's null (a text model's empty prompt), as dit-sample's
        how["model_fn"] = guided_model_fn(model, cfg_scale=cfg_scale, cfg_channels=cfg_channels,
                                          autocast_dtype=how["autocast_dtype"], conditioning=conds.conditioning(model))
    with evaluating(model), pinned_threads(device, cpu_threads):
        return _sample_chunks(model, vae, diffusion, labels, batch_size or len(labels), seed=seed,
                              norm=as_norm(norm, scaling_factor, shift_factor), conds=conds, **how)


def _sample_chunks(model: nn.Module, vae: nn.Module | None, diffusion, labels: list[int], step: int, *, seed: int,
                   norm: LatentNorm, conds: Any, **kwargs: Any) -> np.ndarray | None:
    """Images [0, step), [step, 2*step), ... of `labels`, concatenated (the global chunks of dit-sample); without a
    VAE their latents only, and None."""
    chunks = []
    for start in range(0, len(labels), step):
        idx = list(range(start, min(start + step, len(labels))))
        given = dict(labels=[labels[i] for i in idx], seed=seed,
                     condition=None if conds is None else conds.condition(idx), **kwargs)
        if vae is None:
            generate_latents(model, diffusion, indices=idx, **given)
            continue
        chunks.append(generate_images(model, vae, diffusion, indices=idx, norm=norm, **given))
    return torch.cat(chunks).numpy() if chunks else None


def run_time_shift(config: dict[str, Any] | None) -> float:
    """The time shift a training run's flow samples use: its resolved --time-shift (dit/shift.py), else 1."""
    shift = (config or {}).get("time_shift", 1.0)
    return float(shift) if isinstance(shift, (int, float)) else 1.0


GRID_CFG_SCALE = 4.0  # the grids' guidance where guidance acts (pictures)


def guidance_inert_for(objective: str, settings: Any, protocol: str | None = None) -> str | None:
    """Why guidance settings do nothing in a training run of `objective` (sample.guidance.guidance_inert), from its
    settings' label dropout and, for the FID samples, the sampling protocol they follow."""
    from dit_pipeline.dit.objectives import SPECS
    from dit_pipeline.sample.guidance import guidance_inert

    conditions = SPECS[objective].conditions if objective in SPECS else "t"
    return guidance_inert(conditions, float(getattr(settings, "class_dropout_prob", 0.1) or 0) > 0, protocol)


def effective_cfg_scale(given: float | None, default: float, objective: str, settings: Any, flag: str,
                        protocol: str | None = None) -> float:
    """The grid or FID guidance a run uses: `given`, else `default` where guidance acts, else 1 (a given scale that
    would do nothing is refused in TrainConfig.validate; here it falls back to 1 for safety)."""
    from dit_pipeline.sample.guidance import resolve_cfg_scale

    try:
        return resolve_cfg_scale(given, default, guidance_inert_for(objective, settings, protocol), flag)
    except ValueError:
        return 1.0


def run_prediction(config: dict[str, Any] | None) -> dict[str, Any] | None:
    """What a training run's flow model predicts, as its checkpoints record it (dit.objectives: None for velocity)."""
    from dit_pipeline.dit.objectives import spec

    c = config or {}
    if c.get("objective") != "flow":
        return None
    return spec("flow").record({k: c[k] for k in ("prediction", "t_eps", "v_target") if k in c}).get("prediction")


def default_grid_labels(num_classes: int, n: int = 8) -> list[int]:
    """n classes spread evenly over the label range (all of them when there are fewer)."""
    n = min(n, num_classes)
    return [k * num_classes // n for k in range(n)]


# ----------------------------------------------------------------------------------------------------------
# The hook's settings: dit-train's TrainConfig inherits them (so they are stored flat in its config, and its
# options come from them); `SampleGridHook.from_settings` reads them. A new grid setting is a field here and
# its use in the hook.

GRIDS = "Sample grids and FID during training"  # their --help section
SAMPLE_WEIGHTS = ("ema", "raw", "both")  # which weights the grids show


@dataclass(kw_only=True)
class DecodeSettings:
    """The VAE that decodes the trainer's samples (grids and FID)."""

    vae: str | None = setting(None, "VAE that decodes the sample grids and FID samples: hub id, local diffusers "
                              "folder or single .safetensors/.ckpt file", group=GRIDS,
                              shown="the one the manifest records, i.e. the shards were extracted with")
    vae_config: str | None = setting(None, "Diffusers config folder for a single-file --vae", group=GRIDS,
                                     shown="the SD-VAE config")
    cfg_channels: str = setting(
        "auto", "Latent channels guidance guides in the sample grids and FID samples: auto (the first 3 where that "
        "reproduces the reference sampler: a 4-channel DiT/SiT; all channels otherwise), all, or N (the first N)",
        group=GRIDS)

    def cfg_channels_problems(self) -> list[str]:
        v = str(self.cfg_channels)
        if v in ("auto", "all") or (v.isdigit() and int(v) >= 1):
            return []
        return [f"--cfg-channels must be auto, all or a channel count N >= 1, got {self.cfg_channels!r}"]


@dataclass(kw_only=True)
class GridSettings(DecodeSettings):
    """Every `sample_every` steps rank 0 writes RUN/samples/step-NNNNNNN.png of the EMA model's samples of
    fixed classes (a text run: prompts) and seeds (sample.grid.SampleGridHook)."""

    sample_every: int | None = setting(
        None, "Every N steps rank 0 writes RUN/samples/step-NNNNNNN.png, a grid of the EMA model's samples (DDIM; "
        "Euler ODE for --objective flow) of fixed classes or a text run's prompts and seeds, labelled with the "
        "class names or the prompts", group=GRIDS,
        shown="off")
    sample_classes: list[int | str] | None = setting(
        None, "Classes of the sample grids, comma-separated, e.g. 207,360,387", group=GRIDS,
        shown="8 spread over the label range")
    sample_prompts: str | None = setting(
        None, "A text run's grid prompts, one tile each: a file of one prompt per line, JSON Lines with a \"prompt\" "
        "per line, or JSON (as dit-sample --prompts), encoded once by the run's text encoder", group=GRIDS,
        shown="required by a text run's grids")
    sample_steps: int = setting(50, "DDIM (flow: Euler) steps of the sample grids", group=GRIDS)
    sample_weights: str = setting(
        "ema", "Weights the grids show: ema, raw (step-NNNNNNN-raw.png) or both; an EMA of decay 0.9999 averages "
        "~10,000 steps, so in a short run its grids show barely trained weights", group=GRIDS,
        choices=SAMPLE_WEIGHTS)
    sample_cfg_scale: float | None = setting(
        None, "Guidance scale of the sample grids (1 = none); a scale that would do nothing (a MeanFlow model, one "
        "without label dropout) is refused", group=GRIDS, shown=f"{GRID_CFG_SCALE} where guidance acts, else 1 (none)")

    def __post_init__(self) -> None:
        if isinstance(self.sample_classes, str):  # "0,207,360" from the flag (a config file may give a list)
            try:
                self.sample_classes = parse_classes(self.sample_classes)
            except ValueError:
                pass  # grid_problems reports it

    def grid_problems(self, fid_on: bool, sampler: str = "ddim") -> list[str]:
        """Every problem of the grid settings (`fid_on`: --fid-every is set, so --vae serves FID too; `sampler`: the
        grids' sampler, GRID_SAMPLER of the run's objective: only DDIM restricts the step count)."""
        p = choice(self, "sample_weights", SAMPLE_WEIGHTS) + self.cfg_channels_problems()
        if self.sample_every is None:
            grid_only = (("sample_classes", "sample_prompts") if fid_on
                         else ("vae", "vae_config", "sample_classes", "sample_prompts"))
            given = [flag_name(n) for n in grid_only if getattr(self, n)]
            if given:
                p.append(f"{', '.join(given)} only serve the sample grids: add --sample-every N (or drop them)")
            return p
        p += positive(self, "sample_every")
        if self.sample_classes is not None:
            try:
                parse_classes(self.sample_classes)
            except ValueError as e:
                p.append(f"--sample-classes: {e}")
            if self.sample_prompts is not None:
                p.append("--sample-classes and --sample-prompts: a class run's grids draw classes, a text run's "
                         "prompts; give the one of this run")
        steps = self.sample_steps
        if isinstance(steps, bool) or not isinstance(steps, int) or not (1 <= steps <= TRAIN_TIMESTEPS and (
                sampler != "ddim" or ddim_stride(steps))):
            near = nearest_ddim_steps(steps) if isinstance(steps, int) else [25, 50, 100, 250]
            p.append(f"--sample-steps {steps!r} is not a DDIM step count (DDIM takes every k-th of the 1000 "
                     f"steps); nearest valid counts: {', '.join(map(str, near))}")
        if self.sample_cfg_scale is not None and not (isinstance(self.sample_cfg_scale, (int, float))
                                                      and self.sample_cfg_scale >= 1.0):
            p.append(f"--sample-cfg-scale must be >= 1 (1 = no guidance), got {self.sample_cfg_scale!r}")
        return p


def parse_classes(value: Any) -> list[int | str]:
    """Class ids or names from "0,n01440764,2" (a flag, as dit-sample --class-labels: sample/names.py) or a list (a
    config file); ValueError saying what is wrong. Names become ids against the shard set's class names."""
    from dit_pipeline.sample.names import parse_class_labels

    if isinstance(value, str):
        items: Any = parse_class_labels(value)
    else:
        items = value
    if not isinstance(items, (list, tuple)) or not items:
        raise ValueError(f"give comma-separated class ids or names such as 0,207,n01440764, got {value!r}")
    out: list[int | str] = []
    for v in items:
        if isinstance(v, bool) or not ((isinstance(v, int) and v >= 0) or (isinstance(v, str) and v.strip())):
            raise ValueError(f"{v!r} is not a class id (a non-negative integer) or name; give e.g. 0,207,n01440764")
        out.append(v if isinstance(v, int) else (int(v) if v.isdigit() and not isinstance(value, str) else v))
    return out


@dataclass
class SampleGridHook:
    """Trainer hook (train.hooks.PeriodicHook): every `every` steps rank 0 writes a labelled grid of the
    EMA model's samples (the raw model when there is no EMA) to RUN/samples/step-0001000.png.

    Classes (a text run: the prompts of --sample-prompts, a tile each) and noise are fixed (seed, index), so the
    grids of one run show the same images evolving. It draws no global random numbers, so training stays exactly
    resumable. The VAE loads with `load()` (the CLI calls it before training starts, so a bad --vae fails at once),
    else in `setup`, which the trainer calls before the first step and which checks the VAE and the classes against
    the model, or encodes a text run's prompts. Under the sharded modes every rank samples beside rank 0.
    """

    every: int
    vae: str
    vae_config: str | None = None
    class_labels: Sequence[int] | None = None  # default: default_grid_labels(num_classes)
    seed: int = 0
    steps: int = 50
    sampler: str = "ddim"
    cfg_scale: float = 4.0
    cfg_channels: str = "auto"  # resolved per model: sample.generate.resolve_cfg_channels
    precision: str = "fp32"
    weights: str = "ema"  # ema | raw | both (raw grids are step-NNNNNNN-raw.png)
    prompts: list[dict[str, Any]] | None = None  # a text run's (common.prompts.read_prompts records), a tile each
    _vae: Any = field(default=None, init=False, repr=False)
    _identity: dict[str, Any] = field(default_factory=dict, init=False, repr=False)
    _conds: Any = field(default=None, init=False, repr=False)  # the tiles' conditions (sample.conditions.grid_sampling)

    @classmethod
    def from_settings(cls, s: GridSettings, *, vae: str, vae_config: str | None, seed: int,
                      objective: str) -> "SampleGridHook":
        """The hook a TrainConfig's grid settings ask for (`vae`: the --vae or the manifest's VAE)."""
        from dit_pipeline.common.prompts import read_prompts

        assert s.sample_every is not None
        prompts = read_prompts(s.sample_prompts, "--sample-prompts") if s.sample_prompts else None
        return cls(every=s.sample_every, vae=vae, vae_config=vae_config, class_labels=s.sample_classes, seed=seed,
                   steps=s.sample_steps, sampler=GRID_SAMPLER[objective],
                   cfg_scale=effective_cfg_scale(s.sample_cfg_scale, GRID_CFG_SCALE, objective, s, "--sample-cfg-scale"),
                   cfg_channels=str(s.cfg_channels), weights=s.sample_weights, prompts=prompts)

    def channels_used(self, model_config: dict[str, Any]) -> str:
        """--cfg-channels for this model ("3", "all", "N"): the run's own model is DiT's/SiT's (SiT's time)."""
        objective = "flow" if self.sampler in dit.FLOW_SAMPLERS else "ddpm"
        try:
            return resolve_cfg_channels(self.cfg_channels, model_config, objective)
        except ValueError as e:
            raise UserError(str(e)) from None

    def load(self, device: torch.device | str = "cpu") -> dict[str, Any]:
        """Load the VAE now (UserError for a bad --vae); returns its identity (common.vae.load_vae)."""
        if self._vae is None:
            self._vae, self._identity = load_vae(self.vae, config=self.vae_config, device=device)
        return self._identity

    def setup(self, ctx: HookContext) -> None:
        """Before training (rank 0, and under the sharded modes every rank, which samples beside it): the VAE on
        rank 0's training device, its latent channels and the classes checked against the model; UserError naming
        the mismatch."""
        if not ctx.runs_passes():
            return
        if ctx.rank == 0:
            identity = self.load(ctx.device)
            self._vae.to(ctx.device)
            channels = int(ctx.model_config["in_channels"])
            if int(identity["latent_channels"]) != channels:
                raise UserError(f"--vae {self.vae!r} has {identity['latent_channels']} latent channels but the "
                                f"model trains on {channels}-channel latents; pass the VAE the shards were extracted "
                                "with")
            fit_decoder(self._vae, identity, ctx.latent, int(ctx.model_config["input_size"]), f"--vae {self.vae!r}")
        self.channels_used(ctx.model_config)  # a bad --cfg-channels N fails before training
        if self.class_labels:  # names (and ambiguous numbers) as dit-sample takes them, against the shards' names
            from dit_pipeline.sample.names import class_ids

            names = (ctx.latent or {}).get("class_names") or ctx.class_names
            self.class_labels = class_ids(list(self.class_labels), names, "the shard set", "--sample-classes")
        bad = [c for c in self.class_labels or () if not 0 <= int(c) < ctx.num_classes]
        if bad:
            raise UserError(f"--sample-classes {bad}: the model has {ctx.num_classes} classes (ids 0.."
                            f"{ctx.num_classes - 1})")
        self._tiles(ctx)  # a text run's prompts encoded now, before training

    def _tiles(self, ctx: HookContext) -> Any:
        """What each tile is conditioned on, for the model's condition kind (sample.conditions.grid_sampling): the
        classes, or a text run's prompts encoded once by its text encoder."""
        from dit_pipeline.sample.conditions import grid_sampling

        if self._conds is None:
            labels = list(self.class_labels) if self.class_labels else default_grid_labels(ctx.num_classes)
            self._conds = grid_sampling(ctx.model.condition_kind, labels=labels, class_names=ctx.class_names,
                                        prompts=self.prompts, text_encoder=ctx.text_encoder, device=ctx.device)
        return self._conds

    def __call__(self, ctx: HookContext) -> Path | None:
        """Write this step's grid(s); returns the path of the last one written (None on other ranks). Rank 0 samples
        and draws; under the sharded modes every rank runs the same passes of its shards (a collective) and rank 0
        alone decodes them."""
        if not ctx.runs_passes():
            return None
        if ctx.rank == 0:
            self.load(ctx.device)
            self._vae.to(ctx.device)
        conds = self._tiles(ctx)
        # A model trained without class dropout has no null class: show it unguided.
        cfg_scale = self.cfg_scale if float(ctx.model_config.get("class_dropout_prob", 0.1)) > 0 else 1.0
        path = None
        for w in {"ema": ["ema"], "raw": ["raw"], "both": ["ema", "raw"]}[self.weights]:
            module = ctx.ema if w == "ema" and ctx.ema is not None else ctx.model
            with ctx.evaluation(module) as model:
                images = sample_grid(model, vae=self._vae if ctx.rank == 0 else None,
                                     norm=LatentNorm.from_record(ctx.latent), class_labels=conds.ids.tolist(),
                                     seed=self.seed, steps=self.steps, sampler=self.sampler, cfg_scale=cfg_scale,
                                     cfg_channels=self.channels_used(ctx.model_config), precision=self.precision,
                                     time_shift=run_time_shift(ctx.config), prediction=run_prediction(ctx.config),
                                     conds=conds)
            if images is None:  # a sharded run's other ranks
                continue
            name = f"step-{ctx.step:07d}{'-raw' if w == 'raw' else ''}.png"
            path = save_grid(images, Path(ctx.run_dir) / "samples" / name, labels=conds.grid_labels(conds.ids))
        return path
