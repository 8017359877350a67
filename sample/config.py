"""Settings of `dit-sample` (SampleConfig) and `dit-sample export` (ExportConfig).

Keyword-only dataclasses that validate themselves and report every problem at once with its fix
(STYLE.md, litgpt's validate_args). They hold plain JSON-compatible values so a run can record them.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dit_pipeline.common.determinism import DEFAULT_CPU_THREADS
from dit_pipeline.common.errors import collect
from dit_pipeline.common.precision import PRECISIONS
from dit_pipeline.dit.flow_samplers import FLOW_SAMPLERS  # ODE Euler / Heun, SDE Euler-Maruyama
from dit_pipeline.dit.formats import OBJECTIVES
from dit_pipeline.dit.meanflow import MEANFLOW_SAMPLERS  # 1- and n-step mean-flow sampling
from dit_pipeline.dit.objectives import SPECS
from dit_pipeline.dit import protocols  # noqa: F401 (the releases' sampling protocols: evaluate/ reads them here)
from dit_pipeline.dit.image_conversions import CONVERSIONS, Conversion  # noqa: F401 (image conversions, likewise)
from dit_pipeline.dit.protocols import PROTOCOLS
from dit_pipeline.dit.protocol_fit import PREDICTIONS
# the DDIM stride search lives in dit.respace; ddim_stride and valid_ddim_steps stay importable from here
from dit_pipeline.dit.respace import TRAIN_TIMESTEPS, ddim_stride, nearest_ddim_steps, valid_ddim_steps  # noqa: F401
from dit_pipeline.sample.plan import LABEL_SAMPLINGS

DDPM_SAMPLERS = ("ddpm", "ddim")
SAMPLERS = DDPM_SAMPLERS + FLOW_SAMPLERS + MEANFLOW_SAMPLERS
# The sampler of the trainer's periodic work, by objective: grids are quick deterministic previews (DDIM, Euler
# ODE); FID samples as the papers' tables do (DDPM; flow: the Euler ODE, as the grids).
# MeanFlow: its own one- or n-step sampler. Each objective's own (dit/objectives.py).
GRID_SAMPLER = {name: s.grid_sampler for name, s in SPECS.items()}
FID_SAMPLER = {name: s.fid_sampler for name, s in SPECS.items()}
FLOW_CONVENTIONS = ("sit", "repa")  # dit.flow_samplers: SiT's time (t = 0 noise) or REPA's (t = 1 noise, sign flipped)
# The sampler when --sampler is not given, by the model's objective: the reference DiT's DDPM, and SiT's SDE
# (Euler-Maruyama with SiT's sample_ddp.py defaults: diffusion form sigma, norm 1, last step 0.04), each the
# sampler of its paper's FID-50K at the default 250 steps.
DEFAULT_SAMPLERS = {name: s.default_sampler for name, s in SPECS.items()}
# The steps when --steps is not given (no --protocol): 250 (the papers' FID-50K setting), one for a one-step model
DEFAULT_STEPS = {name: s.default_steps for name, s in SPECS.items()}
# the guidance scale when --cfg-scale is not given (no --protocol) and guidance acts: pictures (1.5 is DiT's FID
# setting)
DEFAULT_CFG_SCALE = 4.0
DIFFUSION_FORMS = ("sigma", "SBDM", "constant", "linear", "decreasing", "increasing-decreasing")
CFG_CHANNELS = ("auto", "all")  # or a channel count N: guide the first N (sample.generate.cfg_channels_for)
WEIGHTS = ("ema", "model")
EXPORT_TARGETS = ("diffusers", "safetensors")


def respacing(sampler: str, steps: int) -> str:
    """The timestep_respacing string for dit.create_diffusion (IDDPM conventions)."""
    return f"ddim{steps}" if sampler == "ddim" else str(steps)


@dataclass(kw_only=True)
class SampleConfig:
    """One sampling run. Either `class_labels` or `num_samples` (or both: the labels repeat cyclically)."""

    ckpt: str
    vae: str | None = None  # default: the VAE the checkpoint records, else DEFAULT_VAE
    vae_config: str | None = None  # diffusers config folder for a single-file VAE
    weights: str = "ema"  # which weights of a training checkpoint: "ema" or "model"
    model: str | None = None  # expected preset, checked against the weights
    num_heads: int | None = None  # attention heads of a file that states none (a custom size without model_config)
    input_size: int | None = None  # latent side of a file that states none (DDT's: no position table)
    encoder_depth: int | None = None  # DDT's encoder blocks, for a file of a custom size that states none
    latent_stats: str | None = None  # per-channel latent statistics (LightningDiT's latents_stats.pt) to decode with
    encoder_refresh: int = 1  # DDT: recompute the encoder every k-th network call, reuse its state between (dit/reuse.py)
    # a release's sampling protocol (dit/protocols.py): its grid, solver, guidance rule, image conversion and labels;
    # --steps, --cfg-scale, --guidance-interval and --labels change its values (recorded), the other sampler flags
    # must agree with it
    protocol: str | None = None
    guidance_model: str | None = None  # AutoGuidance's weaker network (dit-sample --guidance-model FILE)
    sampler: str | None = None  # ddpm models: ddpm, ddim; flow models: euler, heun, euler-maruyama;
    # None: the protocol's, else DEFAULT_SAMPLERS of the model's objective (sample.resolve resolves it once the
    # checkpoint is read)
    steps: int | None = None  # None: the protocol's, else DEFAULT_STEPS of the model's objective (250; one-step: 1)
    objective: str | None = None  # ddpm | flow; None: what the checkpoint records (SiT-* files: flow)
    flow_convention: str | None = None  # sit | repa; None: recorded, else repa for REPA's files, else sit
    # what the network predicts (x | velocity), for a file that does not record it (NanoGen's); None: the file's,
    # else the --protocol row's (sample/facts.py); a file that states neither is refused
    prediction: str | None = None
    diffusion_form: str = "sigma"  # euler-maruyama: SiT's diffusion coefficient D(t) and its norm
    diffusion_norm: float = 1.0
    last_step_size: float = 0.04  # euler-maruyama: SiT's final noise-free step
    # flow samplers: SD3's shift s of the time grid toward noise (dit/shift.py); None: the checkpoint's recorded
    # training shift (RAE samples with it), else 1. LightningDiT's timestep_shift a is 1 / a here.
    time_shift: float | None = None
    # None: the protocol's, else DEFAULT_CFG_SCALE, where guidance acts; 1 where it cannot (no null class, MeanFlow,
    # a protocol without guidance); a scale that would do nothing is refused (sample.resolve resolves it once the
    # checkpoint is read)
    cfg_scale: float | None = None
    # auto: 3 where that reproduces the reference sampler (a 4-channel DiT/SiT, LightningDiT's release), else all
    # (sample.generate.cfg_channels_for); "all"; or N: the first N
    cfg_channels: str = "auto"
    # [low, high]: guide only where the noise level (1 = noise: flow 1 - t in SiT's time, i.e. REPA's t; DDPM
    # timestep index / 1000) is in [low, high], both ends included (a protocol's ends are its own); elsewhere the
    # conditional model alone
    guidance_interval: list[float] | None = None
    # NanoGen's internal guidance (dit/internal_guidance.py): its scale, interval of noise levels and null-half scale;
    # None: the protocol's (off for every row without it)
    ig_scale: float | None = None
    ig_interval: list[float] | None = None
    ig_uncond_scale: float | None = None
    class_labels: list[int | str] | None = None  # ids, or class names the checkpoint records (sample/names.py)
    prompts: list[str] | None = None  # a text model's prompts (--prompt, repeatable), each num_samples / P samples
    prompts_file: str | None = None  # --prompts FILE: one per line, or JSON Lines with a "prompt" (sample/prompts.py)
    text_encoder: str | None = None  # a text model's encoder (common/text_encoders.py); default: the checkpoint's
    num_samples: int | None = None
    labels: str | None = None  # classes of --num-samples without --class-labels: "uniform" draws or "equal" counts
    # (None: the protocol's, else uniform)
    seed: int = 0
    batch_size: int = 32  # per process
    cpu_threads: int = DEFAULT_CPU_THREADS  # intra-op threads of the sampling compute on CPU
    npz: str | None = None
    out: str | None = None
    save_images: bool = False  # also one PNG per sample under OUT/images/
    grid_max: int = 64  # at most this many samples in OUT/grid.png (0: no grid)
    grid_cols: int | None = None
    precision: str = "fp32"  # the reference samples in fp32 (with TF32 matmuls on GPU)
    tf32: bool = True
    compile: bool = False
    overwrite: bool = False  # discard finished parts / an existing npz from a different configuration
    quiet: bool = False
    device: str | None = None  # default: this rank's GPU, else the CPU

    @property
    def total(self) -> int:
        if self.num_samples is not None:
            return int(self.num_samples)
        return len(self.prompts or self.class_labels or [])

    @property
    def guided(self) -> bool:
        """Whether the guidance scale (given, else the protocol's, else DEFAULT_CFG_SCALE) guides."""
        scale = self.cfg_scale
        if scale is None:
            scale = PROTOCOLS[self.protocol].guidance.scale if self.protocol in PROTOCOLS else DEFAULT_CFG_SCALE
        return scale > 1.0

    def validate(self) -> "SampleConfig":
        p: list[str] = []
        if not self.ckpt:
            p.append("--ckpt is required: a DiT checkpoint (ours, an EMA-only file, an official release file "
                     "or a reference training checkpoint)")
        if self.class_labels is None and self.num_samples is None and self.prompts is None and self.prompts_file is None:
            p.append("pass --class-labels 207,360,... or --num-samples N (classes drawn uniformly), or a text model's "
                     "--prompt TEXT / --prompts FILE")
        p += self._check_prompts()
        if self.class_labels is not None:
            if len(self.class_labels) == 0:
                p.append("--class-labels is empty; give comma-separated class ids, e.g. 207,360,387")
            bad = [c for c in self.class_labels if not isinstance(c, str) and int(c) < 0]
            if bad:
                p.append(f"--class-labels must be class ids >= 0, got {bad}")
        if self.labels is not None and self.labels not in LABEL_SAMPLINGS:
            p.append(f"--labels must be one of {LABEL_SAMPLINGS}, got {self.labels!r}")
        elif self.labels not in (None, "uniform") and self.class_labels is not None:
            p.append(f"--labels {self.labels} chooses the classes of --num-samples; it cannot be combined with "
                     "--class-labels (drop one)")
        if self.num_samples is not None and self.num_samples < 1:
            p.append(f"--num-samples must be >= 1, got {self.num_samples}")
        if self.npz is None and self.out is None:
            p.append("nothing would be written: pass --npz FILE (ADM evaluator format) and/or --out DIR (PNG grid)")
        if self.save_images and self.out is None:
            p.append("--save-images writes PNGs under --out DIR; pass --out")
        if isinstance(self.encoder_refresh, bool) or not isinstance(self.encoder_refresh, int) \
                or self.encoder_refresh < 1:
            p.append(f"--encoder-refresh must be a positive integer (1: no reuse), got {self.encoder_refresh!r}")
        p += self._check_sampler()
        if str(self.cfg_channels) not in CFG_CHANNELS and not (str(self.cfg_channels).isdigit()
                                                               and int(self.cfg_channels) >= 1):
            p.append(f"--cfg-channels must be auto, all or a channel count N >= 1, got {self.cfg_channels!r}")
        if self.weights not in WEIGHTS:
            p.append(f"--weights must be one of {WEIGHTS}, got {self.weights!r}")
        if self.precision not in PRECISIONS:
            p.append(f"--precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.seed < 0:
            p.append(f"--seed must be >= 0, got {self.seed}")
        p += _architecture_hints(self) + self._check_protocol() + self._check_internal()
        if self.batch_size < 1:
            p.append(f"--batch-size must be >= 1 (images per process and batch), got {self.batch_size}")
        if self.cpu_threads < 1:
            p.append(f"--cpu-threads must be >= 1, got {self.cpu_threads}")
        if self.grid_max < 0:
            p.append(f"--grid-max must be >= 0, got {self.grid_max}")
        if self.grid_cols is not None and self.grid_cols < 1:
            p.append(f"--grid-cols must be >= 1, got {self.grid_cols}")
        if self.npz is not None and Path(self.npz).is_dir():
            p.append(f"--npz {self.npz!r} is a folder; give a file name such as samples.npz")
        if self.out is not None and Path(self.out).exists() and not Path(self.out).is_dir():
            p.append(f"--out {self.out!r} exists and is not a folder")
        collect(p, "sampling configuration")
        return self

    def _check_prompts(self) -> list[str]:
        p: list[str] = []
        if self.prompts is not None and self.prompts_file is not None:
            p.append("--prompt and --prompts FILE both give the prompts; pass one")
        if (self.prompts is not None or self.prompts_file is not None) and self.class_labels is not None:
            p.append("--class-labels is for class-conditional models, --prompt / --prompts for text models; pass one")
        if self.prompts is not None and len(self.prompts) == 0:
            p.append("--prompt: no prompt given")
        elif self.prompts and self.num_samples is not None and self.num_samples % len(self.prompts):
            p.append(f"--num-samples {self.num_samples} is not a multiple of the {len(self.prompts)} prompts (each "
                     "prompt gets the same number of samples)")
        if (self.prompts is not None or self.prompts_file is not None) and self.labels not in (None, "uniform"):
            p.append(f"--labels {self.labels} chooses classes; a text model samples its prompts")
        if self.text_encoder is not None and self.prompts is None and self.prompts_file is None:
            p.append("--text-encoder encodes --prompt / --prompts; pass them")
        return p

    def _check_sampler(self) -> list[str]:
        p = []
        if self.sampler is not None and self.sampler not in SAMPLERS:
            p.append(f"--sampler must be one of {SAMPLERS}, got {self.sampler!r}")
        if self.steps is not None and not 1 <= self.steps <= TRAIN_TIMESTEPS:
            p.append(f"--steps must be in 1..{TRAIN_TIMESTEPS}, got {self.steps}")
        elif self.steps is not None and self.sampler == "ddim" and ddim_stride(self.steps) is None:
            near = nearest_ddim_steps(self.steps)
            p.append(f"--steps {self.steps} is not possible with --sampler ddim (DDIM takes every k-th of the "
                     f"{TRAIN_TIMESTEPS} steps); nearest valid counts: {near}")
        if self.cfg_scale is not None and not self.cfg_scale >= 1.0:
            p.append(f"--cfg-scale must be >= 1 (1 = no guidance), got {self.cfg_scale}")
        p += self._check_interval()
        if self.sampler == "euler-maruyama" and self.steps is not None and self.steps < 2:
            p.append(f"--steps {self.steps}: the SDE counts the points of SiT's time grid (its num_steps: steps - 1 "
                     "Euler-Maruyama steps and the last step); pass --steps >= 2")
        if self.flow_convention is not None and self.flow_convention not in FLOW_CONVENTIONS:
            p.append(f"--flow-convention must be one of {FLOW_CONVENTIONS}, got {self.flow_convention!r}")
        elif self.flow_convention is not None and self.sampler in DDPM_SAMPLERS + MEANFLOW_SAMPLERS:
            p.append(f"--flow-convention applies to flow models (samplers {', '.join(FLOW_SAMPLERS)}), not to "
                     f"--sampler {self.sampler}")
        if self.prediction is not None and self.prediction not in PREDICTIONS:
            p.append(f"--prediction must be one of {PREDICTIONS}, got {self.prediction!r}")
        elif self.prediction is not None and self.sampler in DDPM_SAMPLERS:
            p.append(f"--prediction is what a flow or MeanFlow network predicts, not a ddpm model's (--sampler "
                     f"{self.sampler})")
        if self.objective is not None and self.objective not in OBJECTIVES:
            p.append(f"--objective must be one of {OBJECTIVES}, got {self.objective!r}")
        elif self.objective is not None and self.sampler in SAMPLERS and \
                self.sampler not in SPECS[self.objective].samplers:
            want = SPECS[self.objective].samplers
            p.append(f"--sampler {self.sampler} does not sample a {self.objective} model; choose one of {want}")
        if self.diffusion_form not in DIFFUSION_FORMS:
            p.append(f"--diffusion-form must be one of {DIFFUSION_FORMS}, got {self.diffusion_form!r}")
        if not 0.0 <= self.last_step_size < 1.0:
            p.append(f"--last-step-size must be in [0, 1), got {self.last_step_size}")
        if self.time_shift is not None and not self.time_shift > 0:
            p.append(f"--time-shift must be > 0 (1 = none), got {self.time_shift}")
        elif self.time_shift is not None and self.sampler in DDPM_SAMPLERS + MEANFLOW_SAMPLERS:
            p.append(f"--time-shift shifts the flow samplers' time grid ({', '.join(FLOW_SAMPLERS)}), not "
                     f"--sampler {self.sampler}'s")
        return p

    def _check_interval(self) -> list[str]:
        if self.guidance_interval is None:
            return []
        iv = list(self.guidance_interval)
        if len(iv) != 2 or not all(isinstance(v, (int, float)) and 0.0 <= v <= 1.0 for v in iv) or iv[0] > iv[1]:
            return [f"--guidance-interval takes LOW HIGH with 0 <= LOW <= HIGH <= 1 (noise levels), got {iv}"]
        if self.cfg_scale is not None and not self.cfg_scale > 1.0:
            return [f"--guidance-interval {iv[0]} {iv[1]} limits classifier-free guidance, but --cfg-scale is "
                    f"{self.cfg_scale} (no guidance); pass --cfg-scale > 1 or drop --guidance-interval"]
        return []

    def _check_internal(self) -> list[str]:
        """The internal-guidance flags: an interval low < high in [0, 1], scales that guide."""
        p: list[str] = []
        if self.ig_interval is not None:
            low, high = (list(self.ig_interval) + [None, None])[:2]
            if not (isinstance(low, (int, float)) and isinstance(high, (int, float)) and 0 <= low < high <= 1):
                p.append(f"--ig-interval must be LOW HIGH with 0 <= LOW < HIGH <= 1, got {self.ig_interval}")
        given = self.ig_scale is not None or self.ig_uncond_scale is not None
        if self.ig_interval is not None and not given:
            p.append("--ig-interval: add --ig-scale (internal guidance's scale)")
        if given and not ((self.ig_scale or 1.0) > 1.0 or self.ig_uncond_scale not in (None, 1.0)):
            p.append("--ig-scale 1 without another --ig-uncond-scale does not guide (NanoGen's use_ig: a scale > 1); "
                     "drop the internal-guidance flags")
        for name in ("ig_scale", "ig_uncond_scale"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                p.append(f"--{name.replace('_', '-')} must be > 0, got {v}")
        return p

    def _check_protocol(self) -> list[str]:
        """--protocol's name and whether this build can run it; the sampler flags that must agree with it;
        --time-shift only on a time grid; --guidance-model with AutoGuidance only."""
        p: list[str] = []
        if self.protocol is None:
            return p
        if self.protocol not in PROTOCOLS:
            return p + [protocols.unknown(self.protocol)]
        pr = PROTOCOLS[self.protocol]
        missing = protocols.missing_features(pr)
        if missing:
            p.append(missing)
        grid_end = pr.grid.end if pr.grid is not None else 1.0
        own = {"sampler": pr.solver, "cfg_channels": pr.guidance.channels, "diffusion_form": pr.diffusion_form,
               "diffusion_norm": pr.diffusion_norm,
               "last_step_size": round(1.0 - grid_end, 12) if pr.solver == "euler-maruyama" else 0.04}
        defaults = {"sampler": None, "cfg_channels": "auto", "diffusion_form": "sigma", "diffusion_norm": 1.0,
                    "last_step_size": 0.04}
        clash = [f"--{k.replace('_', '-')} {getattr(self, k)}" for k, v in own.items()
                 if getattr(self, k) not in (defaults[k], v)]
        if self.time_shift is not None and pr.solver not in FLOW_SAMPLERS:  # else it replaces the grid's shift
            p.append(f"--time-shift shifts the flow samplers' time grid ({', '.join(FLOW_SAMPLERS)}), not --protocol "
                     f"{self.protocol}'s {pr.solver}; drop --time-shift")
        if clash:
            p.append(f"{', '.join(clash)}: --protocol {self.protocol} sets these ({pr.release}'s {pr.solver} sampler; "
                     "docs/sampling.md); drop them, or drop --protocol to choose every setting")
        ag = pr.guidance.rule == "autoguidance"
        if ag and not self.guidance_model:
            p.append(f"--protocol {self.protocol} guides with a second, weaker network ({pr.guidance.guide_model} in "
                     "the release): pass it as --guidance-model FILE")
        elif self.guidance_model and not ag:
            p.append(f"--guidance-model: --protocol {self.protocol} does not use AutoGuidance "
                     f"({', '.join(n for n, q in PROTOCOLS.items() if q.guidance.rule == 'autoguidance')} does); "
                     "drop one of them")
        return p

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(kw_only=True)
class ExportConfig:
    """`dit-sample export --to diffusers|safetensors OUTPUT --ckpt X`."""

    to: str
    output: str
    ckpt: str
    weights: str = "ema"
    model: str | None = None
    num_heads: int | None = None  # as SampleConfig's
    input_size: int | None = None
    encoder_depth: int | None = None
    vae: str | None = None  # bundled into the diffusers pipeline folder [recorded in the checkpoint, else DEFAULT_VAE]
    vae_config: str | None = None
    overwrite: bool = False
    objective: str | None = None  # for a file that does not record it (as SampleConfig.objective)

    def validate(self) -> "ExportConfig":
        p: list[str] = []
        if self.to not in EXPORT_TARGETS:
            p.append(f"--to must be one of {EXPORT_TARGETS}, got {self.to!r}")
        if not self.ckpt:
            p.append("--ckpt is required")
        if self.weights not in WEIGHTS:
            p.append(f"--weights must be one of {WEIGHTS}, got {self.weights!r}")
        p += _architecture_hints(self)
        out = Path(self.output)
        if out.exists() and not self.overwrite:
            p.append(f"{self.output!r} already exists; choose a new path or pass --overwrite")
        if self.to == "safetensors" and out.suffix != ".safetensors":
            p.append(f"--to safetensors writes one file; name it *.safetensors (got {self.output!r})")
        if self.to == "diffusers" and out.exists() and not out.is_dir():
            p.append(f"--to diffusers writes a folder, but {self.output!r} is a file")
        collect(p, "export configuration")
        return self


def _architecture_hints(cfg: Any) -> list[str]:
    """Problems of --num-heads, --input-size and --encoder-depth (positive integers when given)."""
    return [f"--{name.replace('_', '-')} must be a positive integer, got {getattr(cfg, name)!r}"
            for name in ("num_heads", "input_size", "encoder_depth")
            if getattr(cfg, name) is not None and getattr(cfg, name) < 1]
