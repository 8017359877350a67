"""`TrainConfig`: every setting of a training run, its validation, and the batch arithmetic.

Follows the project convention (docs/ARCHITECTURE.md): one keyword-only dataclass whose `validate()` reports
**all** problems at once with the fix; settings come from defaults < `--config run.yaml|json` < explicit
flags; the resolved config is stored as JSON (never pickled). Defaults are the reference DiT recipe
(docs/REFERENCE.md): AdamW lr 1e-4, no weight decay, betas (0.9, 0.999), constant lr, global batch 256, EMA 0.9999,
class dropout 0.1, seed 0.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dit_pipeline.common.errors import ConfigError, UserError, collect
from dit_pipeline.common.precision import PRECISIONS_AUTO as PRECISIONS

SAMPLE_WEIGHTS = ("ema", "raw", "both")  # which weights the sample grids show

ATTENTION_BACKENDS = ("auto", "cudnn", "flash", "efficient", "math")  # train.speed applies them
OBJECTIVES = ("ddpm", "flow")


@dataclass(kw_only=True)
class TrainConfig:
    # data
    shards: str                                 # shard folder, or URL list / brace pattern (+ manifest)
    run_dir: str
    manifest: str | None = None                 # manifest.json path/folder when `shards` is a URL pattern
    image_size: int | None = None               # optional cross-check against the manifest
    num_workers: int | None = None              # loader processes per rank (0 = in the main process); None:
                                                # 4, fewer when the shard set has fewer shards per rank
    shuffle_buffer: int = 1000                  # samples held by each reader's in-memory shuffle buffer
    shards_in_flight: int = 16                  # shards each reader reads at once (mixes classes)
    prefetch_factor: int = 2
    skip_bad_shards: bool = False
    verify_shards: bool = True                  # check each shard's sha256 against the manifest while training
    # model
    model: str = "DiT-XL/2"
    depth: int | None = None
    hidden_size: int | None = None
    num_heads: int | None = None
    patch_size: int | None = None
    class_dropout_prob: float = 0.1
    qk_norm: bool = False                       # optional block features (dit/blocks.py), off = DiT
    rms_norm: bool = False
    swiglu: bool = False
    rope: bool = False
    # objective: ddpm (DiT) or flow (SiT's linear interpolant, velocity prediction; dit/flow.py)
    objective: str = "ddpm"
    t_sampling: str = "uniform"                 # flow training times: uniform | logit-normal
    t_mean: float = 0.0                         # logit-normal location and scale
    t_scale: float = 1.0
    # length and batch
    max_steps: int | None = None
    epochs: int | None = None
    global_batch_size: int = 256
    micro_batch_size: int | str | None = None   # per rank and forward pass; default: no accumulation;
                                                # "auto": the largest that fits the GPU (train.memory)
    # optimisation
    lr: float = 1e-4
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    warmup_steps: int = 0
    grad_clip: float | None = None
    ema_decay: float = 0.9999
    seed: int = 0
    # speed
    precision: str = "auto"                     # bf16 on GPU, fp32 on CPU
    tf32: bool = True
    grad_checkpointing: bool = False
    compile: bool | None = None                 # regional (per-block) torch.compile; None: on for CUDA
    attention: str = "auto"                     # SDPA backend on CUDA: auto (fastest, timed) | cudnn | ...
    ddp_bucket_mb: int = 25                     # DDP gradient bucket size (torch's default)
    # bookkeeping
    log_every: int = 100
    ckpt_every: int = 5000
    keep_last: int = 3
    keep_every: int | None = None
    resume: str = "auto"                        # auto | none | path to a checkpoint
    peak_tflops: float | None = None            # MFU denominator override (per GPU, dense bf16/fp16)
    tensorboard: bool = True                    # write events when tensorboard is installed
    quiet: bool = False
    dry_run: bool = False
    # sample grids (sample.grid.SampleGridHook, built by the CLI): every N steps rank 0 writes
    # RUN/samples/step-NNNNNNN.png of the EMA model's DDIM (flow: Euler ODE) samples of fixed classes and seeds
    sample_every: int | None = None
    vae: str | None = None                      # decodes the grids: hub id, diffusers folder or single file
    vae_config: str | None = None               # diffusers config folder for a single-file --vae
    sample_classes: list[int] | None = None     # default: 8 classes spread over the label range
    sample_steps: int = 50                      # DDIM steps (flow: Euler steps)
    sample_weights: str = "ema"                 # ema | raw | both: which weights the grids show
    sample_cfg_scale: float = 4.0               # classifier-free guidance (1 = none)
    # FID during training (evaluate.hook.FidHook): every N steps all ranks sample with the EMA weights as
    # dit-sample does, rank 0 logs fid, sfid, inception_score, precision, recall to metrics.jsonl
    fid_every: int | None = None
    fid_ref: str | None = None                  # reference: ADM reference batch, npz/folder of images, stats
    fid_num_samples: int = 5000
    fid_steps: int = 250                        # DDPM steps, as for the paper's FID
    fid_cfg_scale: float = 1.5
    fid_batch_size: int = 32                    # samples per process and batch
    inception: str | None = None                # Inception weights file [torch hub cache]
    fid_input_size: int = 299                   # test knob (hidden): Inception input resolution
    fid_random_inception: int | None = None     # test knob (hidden): random Inception weights of this seed
    extra: dict[str, Any] = field(default_factory=dict)  # settings owned by other hooks

    def __post_init__(self) -> None:
        if isinstance(self.sample_classes, str):  # "0,207,360" from the flag (a config file may give a list)
            with contextlib.suppress(ValueError):
                self.sample_classes = parse_classes(self.sample_classes)

    def validate(self) -> None:
        """Raise ConfigError listing every invalid setting (nothing about world size: see batch_plan)."""
        p: list[str] = []
        if not str(self.shards or "").strip():
            p.append("--shards is required: a shard folder (with manifest.json) or a URL list/pattern")
        if not str(self.run_dir or "").strip():
            p.append("--run-dir is required: the folder for checkpoints, logs and metrics")
        if self.micro_batch_size != "auto":
            _positive(p, self, "micro_batch_size")
        _positive(p, self, "global_batch_size", "image_size", "ddp_bucket_mb", "depth", "hidden_size",
                  "num_heads", "patch_size", "max_steps", "epochs", "log_every", "ckpt_every", "keep_last",
                  "keep_every", "shuffle_buffer", "shards_in_flight", "prefetch_factor")
        _non_negative(p, self, "warmup_steps", "seed", "weight_decay")
        if self.num_workers is not None:
            _non_negative(p, self, "num_workers")
        if self.sample_weights not in SAMPLE_WEIGHTS:
            p.append(f"--sample-weights must be one of {', '.join(SAMPLE_WEIGHTS)}, got {self.sample_weights!r}")
        if not self.lr > 0:
            p.append(f"--lr must be > 0, got {self.lr}")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                p.append(f"--{_flag(name)} must be in [0, 1), got {getattr(self, name)}")
        if not self.adam_eps > 0:
            p.append(f"--adam-eps must be > 0, got {self.adam_eps}")
        if not 0.0 <= self.ema_decay <= 1.0:
            p.append(f"--ema-decay must be in [0, 1], got {self.ema_decay}")
        if not 0.0 <= self.class_dropout_prob < 1.0:
            p.append(f"--class-dropout-prob must be in [0, 1), got {self.class_dropout_prob}")
        p += self._objective_problems()
        if self.grad_clip is not None and not self.grad_clip > 0:
            p.append(f"--grad-clip must be > 0 (omit it to disable clipping), got {self.grad_clip}")
        if self.peak_tflops is not None and not self.peak_tflops > 0:
            p.append(f"--peak-tflops must be > 0, got {self.peak_tflops}")
        if self.attention not in ATTENTION_BACKENDS:
            p.append(f"--attention must be one of {', '.join(ATTENTION_BACKENDS)}, got {self.attention!r}")
        if self.precision not in PRECISIONS:
            p.append(f"--precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if not str(self.resume or "").strip():
            p.append("--resume must be 'auto', 'none' or a checkpoint path")
        try:
            from dit_pipeline.dit.models import canonical_model_name
            canonical_model_name(self.model)
        except ValueError as e:
            p.append(f"--model: {e}")
        p += self._sample_grid_problems()
        p += self._fid_problems()
        collect(p, "training configuration")

    def _fid_problems(self) -> list[str]:
        p: list[str] = []
        if self.fid_every is None:
            if self.fid_ref:
                p.append("--fid-ref only serves FID during training: add --fid-every N (or drop it)")
            return p
        _positive(p, self, "fid_every", "fid_num_samples", "fid_steps", "fid_batch_size")
        if not str(self.fid_ref or "").strip():
            p.append("--fid-every needs --fid-ref, the reference (e.g. VIRTUAL_imagenet256_labeled.npz)")
        if not str(self.vae or "").strip():
            p.append("--fid-every needs --vae, the VAE that decodes the samples (the one the shards were "
                     "extracted with)")
        if isinstance(self.fid_num_samples, int) and 0 < self.fid_num_samples < 4:
            p.append(f"--fid-num-samples must be >= 4 (precision/recall use 3 nearest neighbours), got "
                     f"{self.fid_num_samples}")
        if not (isinstance(self.fid_cfg_scale, (int, float)) and self.fid_cfg_scale >= 1.0):
            p.append(f"--fid-cfg-scale must be >= 1 (1 = no guidance), got {self.fid_cfg_scale!r}")
        return p

    def _objective_problems(self) -> list[str]:
        from dit_pipeline.dit.flow import T_SAMPLINGS

        p: list[str] = []
        if self.objective not in OBJECTIVES:
            p.append(f"--objective must be one of {', '.join(OBJECTIVES)}, got {self.objective!r}")
        elif is_sit_name(self.model) and self.objective != "flow":
            dit_name = "DiT-" + str(self.model).strip()[4:]
            p.append(f"--model {self.model} names SiT, a flow model (dit-sample samples SiT- files as flow), which "
                     f"--objective {self.objective} contradicts: drop --objective (a SiT- name implies flow) or use "
                     f"--model {dit_name} for DiT's {self.objective} objective")
        if self.t_sampling not in T_SAMPLINGS:
            p.append(f"--t-sampling must be one of {', '.join(T_SAMPLINGS)}, got {self.t_sampling!r}")
        elif self.objective == "ddpm" and (self.t_sampling, self.t_mean, self.t_scale) != ("uniform", 0.0, 1.0):
            p.append("--t-sampling, --t-mean and --t-scale choose flow training times: add --objective flow "
                     "(ddpm draws its 1000 discrete steps uniformly)")
        if not self.t_scale > 0:
            p.append(f"--t-scale must be > 0, got {self.t_scale}")
        return p

    def make_objective(self):
        """The dit/ object that draws training times and computes the loss (GaussianDiffusion or FlowMatching)."""
        from dit_pipeline import dit

        if self.objective == "flow":
            return dit.create_flow(self.t_sampling, self.t_mean, self.t_scale)
        return dit.create_diffusion("")

    def _sample_grid_problems(self) -> list[str]:
        from dit_pipeline.dit.respace import TRAIN_TIMESTEPS, ddim_stride, nearest_ddim_steps

        p: list[str] = []
        if self.sample_every is None:
            grid_only = ("sample_classes",) if self.fid_every is not None else ("vae", "vae_config", "sample_classes")
            given = [f"--{_flag(n)}" for n in grid_only if getattr(self, n)]
            if given:
                p.append(f"{', '.join(given)} only serve the sample grids: add --sample-every N (or drop them)")
            return p
        _positive(p, self, "sample_every")
        if self.sample_classes is not None:
            try:
                parse_classes(self.sample_classes)
            except ValueError as e:
                p.append(f"--sample-classes: {e}")
        steps = self.sample_steps
        if isinstance(steps, bool) or not isinstance(steps, int) or not (1 <= steps <= TRAIN_TIMESTEPS
                                                                         and ddim_stride(steps)):
            near = nearest_ddim_steps(steps) if isinstance(steps, int) else [25, 50, 100, 250]
            p.append(f"--sample-steps {steps!r} is not a DDIM step count (DDIM takes every k-th of the 1000 "
                     f"steps); nearest valid counts: {', '.join(map(str, near))}")
        if not (isinstance(self.sample_cfg_scale, (int, float)) and self.sample_cfg_scale >= 1.0):
            p.append(f"--sample-cfg-scale must be >= 1 (1 = no guidance), got {self.sample_cfg_scale!r}")
        return p

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _flag(name: str) -> str:
    return name.replace("_", "-")


def parse_classes(value: Any) -> list[int]:
    """Class ids from "0,1,2" (a flag) or a list (a config file); ValueError saying what is wrong."""
    items = [v.strip() for v in value.split(",")] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not items:
        raise ValueError(f"give comma-separated class ids such as 0,207,360, got {value!r}")
    out = []
    for v in items:
        if isinstance(v, bool) or not ((isinstance(v, int) and v >= 0) or (isinstance(v, str) and v.isdigit())):
            raise ValueError(f"{v!r} is not a class id (a non-negative integer); give e.g. 0,207,360")
        out.append(int(v))
    return out


def _positive(problems: list[str], cfg: TrainConfig, *names: str) -> None:
    for name in names:
        v = getattr(cfg, name)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            problems.append(f"--{_flag(name)} must be a positive integer, got {v!r}")


def _non_negative(problems: list[str], cfg: TrainConfig, *names: str) -> None:
    for name in names:
        v = getattr(cfg, name)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
            problems.append(f"--{_flag(name)} must be >= 0, got {v!r}")


# ----------------------------------------------------------------------------------------------------------
# Batch arithmetic: global batch = world size x micro-batch x accumulation steps, exactly.

@dataclass(frozen=True)
class BatchPlan:
    world_size: int
    global_batch: int
    micro_batch: int
    accum: int

    @property
    def per_rank(self) -> int:
        return self.micro_batch * self.accum


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def batch_plan(global_batch: int, micro_batch: int | None, world_size: int) -> BatchPlan:
    """Split the global batch over ranks and accumulation steps, or explain why it cannot be split.

    The message states the arithmetic and suggests valid values (the classic DiT confusion between the
    global and the per-GPU batch).
    """
    if world_size < 1:
        raise ValueError(f"world size must be >= 1, got {world_size}")
    if global_batch % world_size:
        lo = global_batch // world_size * world_size
        hi = lo + world_size
        near = " or ".join(str(v) for v in (lo, hi) if v > 0)
        raise ConfigError([f"--global-batch-size {global_batch} is not divisible by the world size "
                           f"{world_size} ({global_batch} / {world_size} = {global_batch / world_size:g}); "
                           f"use a multiple of {world_size}, e.g. {near}"], "batch configuration")
    per_rank = global_batch // world_size
    micro = per_rank if micro_batch is None else micro_batch
    if micro > per_rank or per_rank % micro:
        divs = _divisors(per_rank)
        shown = divs if len(divs) <= 12 else divs[:6] + ["..."] + divs[-5:]
        why = ("is larger than" if micro > per_rank else "does not divide")
        raise ConfigError([f"--micro-batch-size {micro} {why} the per-rank batch {per_rank} "
                           f"(= global batch {global_batch} / {world_size} ranks); valid micro-batch sizes: "
                           f"{', '.join(map(str, shown))} (accumulation steps = {per_rank} / micro-batch)"],
                          "batch configuration")
    return BatchPlan(world_size=world_size, global_batch=global_batch, micro_batch=micro,
                     accum=per_rank // micro)


# ----------------------------------------------------------------------------------------------------------
# Config files and merging: defaults < file < flags.

FIELD_NAMES = tuple(f.name for f in dataclasses.fields(TrainConfig))


def load_config_file(path: str | Path) -> dict[str, Any]:
    """Read a YAML or JSON mapping of TrainConfig settings (dashed or underscored keys)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise UserError(f"--config {path}: no such file")
    text = path.read_text(encoding="utf-8")
    import yaml

    try:
        # YAML is a superset of JSON, but a .json file gets the stricter parser and its error messages.
        data = json.loads(text) if path.suffix.lower() == ".json" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as e:
        raise UserError(f"--config {path}: cannot parse: {e}") from e
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(f"--config {path}: expected a mapping of settings, got {type(data).__name__}")
    out = {str(k).replace("-", "_"): v for k, v in data.items()}
    unknown = sorted(set(out) - set(FIELD_NAMES))
    if unknown:
        raise ConfigError([f"--config {path}: unknown setting {k!r}" for k in unknown]
                          + [f"known settings: {', '.join(FIELD_NAMES)}"], "config file")
    return out


def is_sit_name(model: Any) -> bool:
    """A SiT preset name (SiT-XL/2, ...): DiT's network trained with SiT's flow objective (Ma et al. 2024)."""
    return str(model or "").strip().lower().startswith("sit-")


def merge_config(file_values: dict[str, Any], flag_values: dict[str, Any]) -> TrainConfig:
    """TrainConfig from defaults, then the config file, then explicitly given flags. A SiT model name without
    an objective implies `--objective flow` (the plan says so); with `--objective ddpm` it is refused."""
    merged = {**file_values, **flag_values}
    if is_sit_name(merged.get("model")) and merged.get("objective") is None:
        merged["objective"] = "flow"
    missing = [n for n in ("shards", "run_dir") if merged.get(n) in (None, "")]
    if missing:
        raise ConfigError([f"--{_flag(n)} is required (as a flag or in --config)" for n in missing],
                          "training configuration")
    return TrainConfig(**merged)
