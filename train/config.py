"""`TrainConfig`: every setting of a training run, its validation, and the batch arithmetic.

Follows the project convention (docs/ARCHITECTURE.md): one keyword-only dataclass whose `validate()` reports
**all** problems at once with the fix; settings come from defaults < `--config run.yaml|json` < explicit
flags; the resolved config is stored as JSON (never pickled). Defaults are the reference DiT recipe
(docs/REFERENCE.md): AdamW lr 1e-4, no weight decay, betas (0.9, 0.999), constant lr, global batch 256, EMA 0.9999,
class dropout 0.1, seed 0.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dit_pipeline.common.errors import ConfigError, UserError, collect
from dit_pipeline.common.io import missing_file
from dit_pipeline.common.precision import PRECISIONS_AUTO as PRECISIONS
from dit_pipeline.common.settings import choice, flag_name, non_negative, positive, setting
from dit_pipeline.dit.conditioning import CONDITIONINGS
from dit_pipeline.dit.flow import PREDICTIONS, T_EPS, T_SAMPLINGS, V_TARGETS
from dit_pipeline.dit.formats import OBJECTIVES
from dit_pipeline.dit.meanflow import DEFAULTS as MF, RULES as MF_RULES, VARIANTS as MEANFLOW_OBJECTIVES
from dit_pipeline.evaluate.hook import FidSettings
from dit_pipeline.sample.grid import GRIDS, GridSettings
from dit_pipeline.train.guard import GUARD, GuardSettings
from dit_pipeline.train.latents import LATENT_SAMPLES
from dit_pipeline.train.optim import MUON_ADJUST_LR, OPTIMIZERS, optimizer_problems
from dit_pipeline.train.parallel import ParallelSettings
from dit_pipeline.train.recipes import recipe_problems
from dit_pipeline.train.reg import REG, RegSettings
from dit_pipeline.train.repa import REPA, RepaSettings
from dit_pipeline.train.schedule import schedule_problems
from dit_pipeline.train.text import TEXT_FEATURES
from dit_pipeline.train.validation import VAL, ValSettings

ATTENTION_BACKENDS = ("auto", "cudnn", "flash", "efficient", "math")  # train.speed applies them
DEFAULT_MAX_STEPS = 400_000   # neither --max-steps nor --epochs: the DiT paper's length for its comparisons
DEFAULT_NUM_WORKERS = 4       # loader processes per rank, unless the shard set has fewer shards per rank

DATA, MIX, MODEL, OBJECTIVE = "Data", "Data mix", "Model", "Objective"
LENGTH, OPTIM, SPEED, CKPT = "Length and batch", "Optimisation", "Speed and memory", "Checkpoints and logging"
_PRESETS = "the family's: off for DiT, as its release for the others"
MODEL_OPTIONS = ("qk_norm", "rms_norm", "swiglu", "rope", "wo_shift")  # block switches, passed only when given
ARCH_OVERRIDES = ("depth", "hidden_size", "num_heads", "patch_size", "encoder_depth", "head_depth", "head_hidden_size",
                  "head_num_heads", "bottleneck_dim", "in_context_len", "in_context_start", "num_t_tokens", "num_c_tokens")
RUN_CONDITIONINGS = ("auto", *CONDITIONINGS)  # --conditioning; auto: text with --text, else class labels
GROUPS = (DATA, MIX, MODEL, OBJECTIVE, REPA, REG, LENGTH, OPTIM, GUARD, SPEED, CKPT, VAL, GRIDS)  # dit-train --help's order


@dataclass(kw_only=True)
class TrainConfig(ParallelSettings, ValSettings, GuardSettings, RegSettings, RepaSettings, FidSettings, GridSettings):
    """Every setting of a training run. The sample-grid, FID, alignment, REG, divergence-guard, data-parallel and
    validation settings belong to their own types (sample.grid.GridSettings, evaluate.hook.FidSettings,
    train.repa.RepaSettings, train.reg.RegSettings, train.guard.GuardSettings, train.parallel.ParallelSettings,
    train.validation.ValSettings), inherited here so that the stored config stays one flat JSON object."""

    # data
    shards: str | None = setting(None, help="Shard folder (with manifest.json), or a URL list 'a::b' / brace pattern "
                          "(s3://bucket/shard-{000000..000127}.tar, pipe:CMD) together with --manifest", group=DATA)
    run_dir: str = setting(help="Run folder: checkpoints/, metrics.jsonl, log.txt, logs/, config.json", group=DATA)
    manifest: str | None = setting(None, "manifest.json of the shard set, when --shards is a URL list or pattern",
                                   group=DATA)
    image_size: int | None = setting(None, "Cross-check against the shard set's image size", group=DATA)
    num_workers: int | None = setting(
        None, "Loader processes per GPU (0 = in the main process)", group=DATA,
        shown=f"{DEFAULT_NUM_WORKERS}; fewer when the shard set has fewer shards per rank, said in the plan")
    shuffle_buffer: int = setting(1000, "Samples in each loader worker's shuffle buffer", group=DATA)
    shards_in_flight: int = setting(16, "Shards each loader worker reads at once, taking samples from them in a "
                                    "random order (shards are written in class order)", group=DATA)
    prefetch_factor: int = setting(2, "Batches each loader worker prepares ahead", group=DATA)
    skip_bad_shards: bool = setting(False, "Skip (and count) a shard that turns out unreadable instead of "
                                    "stopping", group=DATA, shown="stop")
    latent_sample: str = setting(
        "sample", "The latent of a set that stores the VAE posterior: sample (mean + std x noise, drawn anew every "
        "epoch) or mean (the posterior's mean, its mode: NanoGen's encoding); a set without a posterior holds one "
        "latent either way", group=DATA, choices=LATENT_SAMPLES)
    # a data mix (train/mix.py, docs/data-mix.md): --source repeated, or a YAML file
    source: list[str] | None = setting(
        None, "A source of a data mix: 'SHARDS key=value ...' (repeat the option; keys proportion, repeat, choose "
        "(MosaicML Streaming's weights), text, caption, template, class_names, holdout, name, manifest; "
        "docs/data-mix.md)", group=MIX, shown="none: --shards alone")
    mix: str | None = setting(None, "YAML file of a data mix: sources (each a mapping of the --source keys), "
                              "epoch_size, lanes", group=MIX)
    mix_epoch_size: int | None = setting(None, "Samples per epoch of a mix weighted by proportion", group=MIX,
                                         shown="the sources' samples together")
    mix_lanes: int | None = setting(
        None, "Readers of the mix's global sample sequence, fixed for the run (a resume may use any world size that "
        "divides them)", group=MIX, shown="world size x loader workers, dividing the global batch")
    new_mix: bool = setting(False, "Resume a run on other sources than its checkpoint's: training continues at the "
                            "next epoch's start, and the checkpoint's mix history records the change", group=MIX)
    data_mix: dict[str, Any] | None = setting(None, help="the resolved mix (train/mix.py)", group=MIX, cli=False)
    verify_shards: bool = setting(
        True, "Check each shard's sha256 against the manifest while training: before its samples are used when "
        "the shards read at once fit in a quarter of the host memory, else as it streams (the plan says which)",
        group=DATA)
    # model
    model: str = setting("DiT-XL/2", "Model preset of any family: DiT-XL/2, DiT-B/4, LightningDiT-XL/1, DDT-XL/2, "
                         "DiT-DH-XL, ... (docs/families.md)", group=MODEL)
    depth: int | None = setting(None, "Override the preset's depth (small experiments; DiT-DH: its encoder's)",
                                group=MODEL)
    hidden_size: int | None = setting(None, "Override the preset's hidden size", group=MODEL)
    num_heads: int | None = setting(None, "Override the preset's attention heads", group=MODEL)
    patch_size: int | None = setting(None, "Override the preset's patch size", group=MODEL)
    encoder_depth: int | None = setting(None, "DDT: blocks of its encoder (the rest of --depth decode)", group=MODEL)
    head_depth: int | None = setting(None, "DiT-DH: blocks of its head", group=MODEL)
    head_hidden_size: int | None = setting(None, "DiT-DH: width of its head", group=MODEL)
    head_num_heads: int | None = setting(None, "DiT-DH: attention heads of its head", group=MODEL)
    bottleneck_dim: int | None = setting(None, "JiT: width of its bottleneck patch embedding", group=MODEL)
    in_context_len: int | None = setting(None, "JiT: in-context class tokens", group=MODEL)
    in_context_start: int | None = setting(None, "JiT: the block before which the class tokens join", group=MODEL)
    num_t_tokens: int | None = setting(None, "DiT-DH-IC: time tokens in context (NanoGen's t4: 4)", group=MODEL)
    num_c_tokens: int | None = setting(None, "DiT-DH-IC: class tokens in context (NanoGen's c8: 8), or the longest "
                                       "text", group=MODEL, shown="8; text: the encoder's max length")
    class_dropout_prob: float = setting(0.1, "Condition dropout for classifier-free guidance: a label becomes the "
                                        "null label, a caption's features the empty prompt's (NanoGen's 0.1)",
                                        group=MODEL)
    conditioning: str = setting("auto", "What the model is conditioned on: class, text (the --text set's "
                                "features of the shards' captions) or none; auto: text with --text, else class",
                                group=MODEL, choices=RUN_CONDITIONINGS)
    text: str | None = setting(None, "Text set of the shards' captions (dit-extract --text-encoder): the model is "
                               "conditioned on its features", group=DATA, shown="none: class labels")
    text_features: str = setting("cached", "Features of the --text set: cached (read from it) or online (the "
                                 "shards' captions encoded while training by its encoder)", group=MODEL,
                                 choices=TEXT_FEATURES)
    # block options (dit/blocks.py, dit/lightningdit.py); None: the family's own (off for DiT, LightningDiT's release)
    qk_norm: bool | None = setting(None, "RMSNorm on attention queries and keys", group=MODEL, shown=_PRESETS)
    rms_norm: bool | None = setting(None, "RMSNorm instead of LayerNorm in the blocks", group=MODEL, shown=_PRESETS)
    swiglu: bool | None = setting(None, "SwiGLU MLP (2/3 width, about equal parameters)", group=MODEL,
                                  shown=_PRESETS)
    rope: bool | None = setting(None, "2-D rotary position embedding on queries and keys", group=MODEL,
                                shown=_PRESETS)
    wo_shift: bool | None = setting(None, "LightningDiT, DiT-DH: adaLN without shifts (scale and gate only)",
                                    group=MODEL, shown=_PRESETS)
    # objective: ddpm (DiT) or flow (SiT's linear interpolant, velocity prediction; dit/flow.py)
    objective: str = setting("ddpm", "ddpm: DiT's diffusion; flow: SiT's linear interpolant with velocity "
                             "prediction, t in [0, 1] (docs/objectives.md)", group=OBJECTIVE,
                             choices=OBJECTIVES)
    t_sampling: str = setting("uniform", "Flow training times: uniform or sigmoid(t-mean + t-scale * N(0, 1))",
                              group=OBJECTIVE, choices=T_SAMPLINGS)
    t_mean: float = setting(0.0, "Logit-normal location (SiT time: data at t = 1)", group=OBJECTIVE)
    t_scale: float = setting(1.0, "Logit-normal scale", group=OBJECTIVE)
    time_shift: str | float = setting(
        1.0, "Shift the flow training times toward noise, SD3's s (noise level s n / (1 + (s - 1) n)); 'auto': RAE's "
        "sqrt(C x H x W / --time-shift-base) of the latent. Recorded, and used by the grids, FID and dit-sample",
        group=OBJECTIVE, shown="1: none")
    time_shift_base: int = setting(4096, "The latent size whose shift is 1 for --time-shift auto", group=OBJECTIVE)
    cosine_loss: bool = setting(False, "Add LightningDiT's cosine-direction term 1 - cos(v_pred, v) over the "
                                "channels to the flow loss (logged as cos)", group=OBJECTIVE)
    prediction: str = setting("v", "flow: what the network predicts, v (the velocity) or x (the clean image, converted "
                              "to a velocity as JiT and NanoGen do: (x_pred - x_t) / max(1 - t, --t-eps)); recorded, "
                              "and every sampler converts through it (docs/pixel-space.md)", group=OBJECTIVE,
                              choices=PREDICTIONS)
    v_target: str = setting("plain", "--prediction v: the velocity's training target, plain (x - noise at every t) or "
                            "clamped (NanoGen's (x - x_t) / max(--t-eps, 1 - t): x - noise scaled down where the "
                            "noise level 1 - t is below it; --objective meanflow: the velocity its target and JVP "
                            "follow, as NanoGen's MeanFlow); recorded, a resume must repeat it, sampling is "
                            "unchanged", group=OBJECTIVE, choices=V_TARGETS)
    t_eps: float = setting(T_EPS, "--prediction x, --v-target clamped: the smallest noise level 1 - t the conversion "
                           "and the target divide by", group=OBJECTIVE)
    # PixelGen's perceptual losses on the predicted clean image (common/perceptual.py; docs/pixel-space.md)
    lpips: str | None = setting(None, "--prediction x: add LPIPS of the predicted image, networks from VGG16_FILE,"
                                "LIN_FILE (torchvision's vgg16 weights, the lpips package's v0.1 vgg.pth)",
                                group=OBJECTIVE)
    lpips_weight: float = setting(0.1, "Weight of the LPIPS term (PixelGen: 0.1)", group=OBJECTIVE)
    pdino: str | None = setting(None, "--prediction x: add the DINOv2 feature distance of the predicted image, the "
                                "DINOv2 weights as --repa takes them (PixelGen: dinov2_vitb14_reg)", group=OBJECTIVE)
    pdino_weight: float = setting(0.01, "Weight of the DINOv2 feature term (PixelGen: 0.01)", group=OBJECTIVE)
    percep_t_thresh: float = setting(0.7, "The perceptual terms count only where the noise level 1 - t is below this "
                                     "(PixelGen: 0.7)", group=OBJECTIVE)
    # MeanFlow and iMF (dit/meanflow.py; docs/one-step.md): the JAX releases' defaults (dit.meanflow.DEFAULTS)
    mf_t_mean: float = setting(MF["t_mean"], "meanflow/imf: logit-normal location of t and r (t = 1 noise)",
                               group=OBJECTIVE)
    mf_t_scale: float = setting(MF["t_scale"], "meanflow/imf: logit-normal scale of t and r", group=OBJECTIVE)
    mf_data_proportion: float | None = setting(
        None, "meanflow/imf: fraction of each step's samples with r = t (plain flow matching)", group=OBJECTIVE,
        shown="0.75 for meanflow, 0.5 for imf and imf-adaln")
    mf_omega: float = setting(MF["omega"], "meanflow: training guidance scale omega", group=OBJECTIVE)
    mf_kappa: float = setting(MF["kappa"], "meanflow: training guidance kappa (weight of the conditional velocity): "
                              "v_g = omega v + (1 - omega - kappa) u_null + kappa u_class; omega 1 with kappa 0: none",
                              group=OBJECTIVE, shown="0.5, the release's configs/default.py")
    mf_t_start: float = setting(MF["t_start"], "meanflow: training guidance applies for t in [t-start, t-end]",
                                group=OBJECTIVE)
    mf_t_end: float = setting(MF["t_end"], "meanflow: end of the training guidance interval", group=OBJECTIVE)
    mf_norm_p: float = setting(MF["norm_p"], "meanflow/imf: adaptive loss weight 1 / (loss + eps)^p (0: plain loss)",
                               group=OBJECTIVE)
    mf_norm_eps: float = setting(MF["norm_eps"], "meanflow/imf: eps of the adaptive loss weight", group=OBJECTIVE)
    mf_s_max: float = setting(MF["s_max"], "imf: guidance scales omega drawn on [1, 1 + s-max] (power law)",
                              group=OBJECTIVE)
    mf_rule: str = setting("meanflow", "meanflow: how a step is split between flow matching and MeanFlow pairs: "
                           "meanflow (the release's: the first --mf-data-proportion of each step's samples get r = t, "
                           "t the max of two draws; labels dropped for the first k samples) or nanogen (NanoGen's "
                           "TransportMF: with probability --mf-data-proportion the whole step, on every rank, is flow "
                           "matching with one draw of t; labels dropped per sample)", group=OBJECTIVE,
                           choices=MF_RULES)
    jvp_attention: str = setting("math", "meanflow/imf: the attention kernel of the JVP pass (only math has "
                                 "forward-mode AD; the ordinary forward keeps --attention)", group=OBJECTIVE,
                                 choices=("math",))
    # length and batch
    max_steps: int | None = setting(
        None, "Stop after this many optimizer steps", group=LENGTH,
        shown=f"{DEFAULT_MAX_STEPS}, the DiT paper's length for its model comparisons, when --epochs is not given "
        "either; said in the plan")
    epochs: int | None = setting(None, "Stop after this many epochs (with --max-steps: whichever comes first)",
                                 group=LENGTH)
    global_batch_size: int = setting(256, "Images per optimizer step over all GPUs", group=LENGTH)
    micro_batch_size: int | str | None = setting(
        None, "Images per GPU per forward pass; accumulation steps = global / (world size x micro); 'auto' = "
        "the largest that fits the GPU memory estimate (train.memory)", group=LENGTH, shown="global / world size")
    # optimisation
    lr: float = setting(1e-4, "Learning rate (constant unless warmed up or decayed)", group=OPTIM)
    optimizer: str = setting("adamw", "adamw, or muon: torch.optim.Muon on the 2-D weights and AdamW on the rest "
                             "(PyTorch 2.9+)", group=OPTIM, choices=OPTIMIZERS)
    muon_momentum: float = setting(0.95, "Muon momentum (Nesterov)", group=OPTIM)
    muon_adjust_lr: str = setting("match_rms_adamw", "Muon's lr scaling per matrix: match_rms_adamw (one lr for "
                                  "both optimizers) or original (Keller Jordan's)", group=OPTIM, choices=MUON_ADJUST_LR)
    weight_decay: float = setting(0.0, "AdamW weight decay", group=OPTIM)
    adam_beta1: float = setting(0.9, "AdamW beta1", group=OPTIM)
    adam_beta2: float = setting(0.999, "AdamW beta2", group=OPTIM)
    adam_eps: float = setting(1e-8, "AdamW epsilon", group=OPTIM)
    warmup_steps: int = setting(0, "Linear learning-rate warm-up: lr x (step + 1) / N for the first N steps",
                                group=OPTIM, shown="0: off")
    warmup_epochs: float | None = setting(None, "The warm-up in epochs (an epoch: samples // global batch steps)",
                                          group=OPTIM)
    final_lr: float | None = setting(None, "Decay the lr linearly to this value (RAE: 2e-5), then keep it",
                                     group=OPTIM, shown="off: no decay")
    lr_decay_start_steps: int | None = setting(None, "Step where the decay starts", group=OPTIM,
                                               shown="the end of the warm-up")
    lr_decay_start_epochs: float | None = setting(None, "Epoch where the decay starts (RAE: 40)", group=OPTIM)
    lr_decay_end_steps: int | None = setting(None, "Step where the decay reaches --final-lr", group=OPTIM,
                                             shown="the end of the run")
    lr_decay_end_epochs: float | None = setting(None, "Epoch where the decay reaches --final-lr (RAE: 800)",
                                                group=OPTIM)
    grad_clip: float | None = setting(None, "Clip the gradient norm to this value", group=OPTIM, shown="off")
    ema_decay: float = setting(0.9999, "EMA decay per optimizer step", group=OPTIM)
    seed: int = setting(0, "Global seed: model init, data order, noise", group=OPTIM)
    # speed
    precision: str = setting("auto", "Autocast dtype; fp16 uses a GradScaler", group=SPEED, choices=PRECISIONS,
                             shown="auto: bf16 on GPU, fp32 on CPU")
    tf32: bool = setting(True, "TF32 matmuls for fp32 work", group=SPEED)
    grad_checkpointing: bool = setting(False, "Recompute DiT blocks in the backward pass (less memory, ~30% more "
                                       "compute)", group=SPEED)
    compile: bool | None = setting(None, "torch.compile each DiT block in place (state_dict names unchanged); "
                                   "eager with a warning where compile cannot run", group=SPEED,
                                   shown="on for CUDA, off on CPU")
    attention: str = setting("auto", "SDPA attention backend on CUDA; auto times each at start-up and keeps the "
                             "fastest", group=SPEED, choices=ATTENTION_BACKENDS)
    ddp_bucket_mb: int = setting(25, "DDP gradient bucket size in MB (torch's default)", group=SPEED)
    # bookkeeping
    log_every: int = setting(100, "Steps per metrics line", group=CKPT)
    ckpt_every: int = setting(5000, "Steps between checkpoints", group=CKPT)
    keep_last: int = setting(3, "Checkpoints kept", group=CKPT)
    keep_every: int | None = setting(None, "Also keep every checkpoint whose step is a multiple of this",
                                     group=CKPT, shown="off")
    resume: str = setting("auto", "'auto' (newest checkpoint in the run folder), 'none', or a checkpoint path",
                          group=CKPT)
    init: str | None = setting(
        None, "Start a new run from these weights (fine-tuning, another input size, SiT from DiT): our checkpoints "
        "(EMA weights), EMA files, the DiT/SiT/REPA/LightningDiT/DDT/DiT-DH release files or .safetensors; "
        "optimizer fresh, step 0 (train/init.py)", group=CKPT, shown="off")
    peak_tflops: float | None = setting(None, "Peak TFLOP/s per GPU for the MFU estimate (dense bf16/fp16)",
                                        group=CKPT, shown="from the GPU model")
    tensorboard: bool = setting(True, "TensorBoard events when installed", group=CKPT)
    record_keys: bool = setting(False, "Write the (source, key) of every sample each step trains on, per rank, to "
                                "RUN/logs/keys-rank{r}.jsonl: an audit of what the run saw (held-out keys, a "
                                "resume's continuation)", group=CKPT)
    wandb: bool = setting(False, "Also log the metrics to Weights & Biases (rank 0; the run id is kept in RUN/wandb-id "
                          "so a resumed run continues the same W&B run; WANDB_MODE=offline works without a network; "
                          "pip install 'dit-pipeline[wandb]')", group=CKPT)
    wandb_project: str = setting("dit-pipeline", "W&B project of --wandb", group=CKPT)
    quiet: bool = setting(False, "No progress bar or info messages on the console", group=CKPT)
    dry_run: bool = setting(False, "Run every check the real run runs (shards, model vs latents, batch split, "
                            "readers, run folder, resume point) and print its plan, without training. DIT_DRY_RUN=1 "
                            "in front of a pasted command does the same", group=CKPT, envvar="DIT_DRY_RUN")
    extra: dict[str, Any] = setting(default_factory=dict, help="settings owned by other hooks", group=CKPT,
                                    cli=False)
    log_keys: bool = setting(False, "Write each step's sample keys to RUN/logs/rank{r}.jsonl (tests: which samples "
                             "each step trained on)", group=CKPT, hidden=True)
    recipe: dict[str, Any] | None = setting(None, "what a recipe file (recipes/) reproduces: name, paper, FID, ...",
                                            group=CKPT, cli=False)
    allow_departures: bool = setting(
        False, "Run a recipe (--config recipes/...) on a shard set that is not the extraction it requires; every "
        "departure is listed in the plan, config.json and the report, and the paper's FID is not put beside the "
        "run", group=CKPT)

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.source, tuple):  # repeated --source flags
            self.source = list(self.source) or None
        if isinstance(self.time_shift, str) and self.time_shift.strip() != "auto":  # "2.5" from the flag
            try:
                self.time_shift = float(self.time_shift)
            except ValueError:
                pass  # validate() reports it

    def validate(self) -> None:
        """Raise ConfigError listing every invalid setting (nothing about world size: see batch_plan)."""
        p: list[str] = []
        mixed = bool(self.source or self.mix)
        if not str(self.shards or "").strip() and not mixed:
            p.append("--shards is required: a shard folder (with manifest.json) or a URL list/pattern (or a data "
                     "mix: --source / --mix)")
        if mixed:
            p += self._mix_problems()
        p += self.val_problems(mixed)
        if not str(self.run_dir or "").strip():
            p.append("--run-dir is required: the folder for checkpoints, logs and metrics")
        if self.micro_batch_size != "auto":
            p += positive(self, "micro_batch_size")
        p += positive(self, "global_batch_size", "image_size", "ddp_bucket_mb", *ARCH_OVERRIDES, "max_steps",
                      "epochs", "log_every", "ckpt_every", "keep_last", "keep_every", "shuffle_buffer", "shards_in_flight", "prefetch_factor")
        p += non_negative(self, "warmup_steps", "seed", "weight_decay")
        p += schedule_problems(self) + optimizer_problems(self) + recipe_problems(self.recipe)
        if self.num_workers is not None:
            p += non_negative(self, "num_workers")
        if not self.lr > 0:
            p.append(f"--lr must be > 0, got {self.lr}")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                p.append(f"{flag_name(name)} must be in [0, 1), got {getattr(self, name)}")
        if not self.adam_eps > 0:
            p.append(f"--adam-eps must be > 0, got {self.adam_eps}")
        if not 0.0 <= self.ema_decay <= 1.0:
            p.append(f"--ema-decay must be in [0, 1], got {self.ema_decay}")
        if not 0.0 <= self.class_dropout_prob < 1.0:
            p.append(f"--class-dropout-prob must be in [0, 1), got {self.class_dropout_prob}")
        p += self._objective_problems() + choice(self, "conditioning", RUN_CONDITIONINGS)
        p += choice(self, "text_features", TEXT_FEATURES) + choice(self, "latent_sample", LATENT_SAMPLES)
        if self.text is not None and self.conditioning not in ("auto", "text"):
            p.append(f"--text conditions the model on text; --conditioning {self.conditioning} does not use it "
                     "(drop one)")
        elif self.conditioning == "text" and self.text is None and not mixed:
            p.append("--conditioning text needs --text FOLDER, the text set of the shards' captions (dit-extract "
                     "--text-encoder NAME --data-path SHARDS --out FOLDER)")
        if self.grad_clip is not None and not self.grad_clip > 0:
            p.append(f"--grad-clip must be > 0 (omit it to disable clipping), got {self.grad_clip}")
        if self.peak_tflops is not None and not self.peak_tflops > 0:
            p.append(f"--peak-tflops must be > 0, got {self.peak_tflops}")
        p += choice(self, "attention", ATTENTION_BACKENDS) + choice(self, "precision", PRECISIONS)
        if self.init is not None and self.resume not in ("auto", "none"):
            p.append(f"--init starts a new run from weights and --resume {self.resume} continues a run; give one")
        if not str(self.resume or "").strip():
            p.append("--resume must be 'auto', 'none' or a checkpoint path")
        try:
            from dit_pipeline.dit.family import lookup_preset
            from dit_pipeline.dit.objectives import network_problem

            family = lookup_preset(self.model)[0].family
            if self.objective in OBJECTIVES and (problem := network_problem(self.objective, family)):
                p.append(problem)
            options = tuple(lookup_preset(self.model)[0].overrides)
        except ValueError as e:
            p.append(f"--model: {e}")
            options = ("reg_dim", "base_model_depth")  # the model's own problem is reported above
        p += self.repa_problems() + self.guard_problems() + self.reg_problems(self.objective, options, self.repa) + \
            self.parallel_problems()
        if self.wandb and importlib.util.find_spec("wandb") is None:
            p.append("--wandb needs the wandb package: pip install 'dit-pipeline[wandb]' (or drop --wandb)")
        from dit_pipeline.sample.config import GRID_SAMPLER

        p += self.grid_problems(fid_on=self.fid_every is not None, sampler=GRID_SAMPLER.get(self.objective, "ddim"))
        p += self.fid_problems(objective=self.objective) + self._guidance_problems()
        collect(p, "training configuration")

    def _mix_problems(self) -> list[str]:
        """A data mix replaces --shards, --manifest and --text (each source names its own)."""
        given = [flag for flag, on in (("--shards", self.shards), ("--manifest", self.manifest), ("--text", self.text),
                                       ("--repa", self.repa), ("--reg-tokens", self.reg_tokens)) if on]
        p = [f"{', '.join(given)} with a data mix: each source names its shards (manifest=) and its text set "
             "(text=) in --source / --mix" + (", and --repa does not read a mix" if self.repa else "")
             + (", and REG's class tokens (--reg-tokens) are not joined to a mix's sources" if self.reg_tokens
                else "")] if given else []
        if self.source and self.mix:
            p.append("give the sources either as --source options or in a --mix file, not both")
        p += positive(self, "mix_epoch_size", "mix_lanes")
        return p

    def _guidance_problems(self) -> list[str]:
        """Grid and FID guidance settings that would do nothing (issue 41: refused with the reason, never recorded
        and ignored): a scale on a MeanFlow model or one without label dropout, channels where nothing is guided."""
        from dit_pipeline.dit.objectives import SPECS
        from dit_pipeline.evaluate.hook import fid_default_scale
        from dit_pipeline.sample.config import PROTOCOLS
        from dit_pipeline.sample.grid import GRID_CFG_SCALE, guidance_inert_for
        from dit_pipeline.sample.guidance import cfg_channels_inert, resolve_cfg_scale

        if self.objective not in SPECS or not isinstance(self.class_dropout_prob, (int, float)):
            return []
        protocol = self.protocol if self.protocol in PROTOCOLS else None
        p, scales = [], []
        for on, flag, given, default, inert in (
                (self.sample_every is not None, "--sample-cfg-scale", self.sample_cfg_scale, GRID_CFG_SCALE,
                 guidance_inert_for(self.objective, self)),
                (self.fid_every is not None, "--fid-cfg-scale", self.fid_cfg_scale, fid_default_scale(protocol),
                 guidance_inert_for(self.objective, self, protocol))):
            if on and (given is None or isinstance(given, (int, float))):
                try:
                    scales.append(resolve_cfg_scale(given, default, inert, flag))
                except ValueError as e:
                    p.append(str(e))
        channels = cfg_channels_inert(self.cfg_channels, max(scales or [1.0]), SPECS[self.objective].conditions)
        if channels and (self.sample_every is not None or self.fid_every is not None):
            p.append(channels)
        return p

    def resolved_guidance(self) -> dict[str, float]:
        """The grid and FID guidance scales this run uses (None resolved), as config.json records them."""
        from dit_pipeline.evaluate.hook import fid_default_scale
        from dit_pipeline.sample.config import PROTOCOLS
        from dit_pipeline.sample.grid import GRID_CFG_SCALE, effective_cfg_scale

        protocol = self.protocol if self.protocol in PROTOCOLS else None
        return {"sample_cfg_scale": effective_cfg_scale(self.sample_cfg_scale, GRID_CFG_SCALE, self.objective, self,
                                                        "--sample-cfg-scale"),
                "fid_cfg_scale": effective_cfg_scale(self.fid_cfg_scale, fid_default_scale(protocol), self.objective,
                                                     self, "--fid-cfg-scale", protocol=protocol)}

    def _objective_problems(self) -> list[str]:
        p = choice(self, "objective", OBJECTIVES)
        if not p and is_sit_name(self.model) and self.objective != "flow":
            dit_name = "DiT-" + str(self.model).strip()[4:]
            p.append(f"--model {self.model} names SiT, a flow model (dit-sample samples SiT- files as flow), which "
                     f"--objective {self.objective} contradicts: drop --objective (a SiT- name implies flow) or use "
                     f"--model {dit_name} for DiT's {self.objective} objective")
        if self.t_sampling not in T_SAMPLINGS:
            p += choice(self, "t_sampling", T_SAMPLINGS)
        elif self.objective == "ddpm" and (self.t_sampling, self.t_mean, self.t_scale) != ("uniform", 0.0, 1.0):
            p.append("--t-sampling, --t-mean and --t-scale choose flow training times: add --objective flow "
                     "(ddpm draws its 1000 discrete steps uniformly)")
        if not self.t_scale > 0:
            p.append(f"--t-scale must be > 0, got {self.t_scale}")
        shift = self.time_shift
        if not (shift == "auto" or (isinstance(shift, (int, float)) and not isinstance(shift, bool) and shift > 0)):
            p.append(f"--time-shift must be a number > 0 or 'auto', got {shift!r}")
        elif self.objective == "ddpm" and (shift != 1.0 or self.cosine_loss):
            p.append("--time-shift and --cosine-loss act on the flow objective: add --objective flow")
        p += positive(self, "time_shift_base")
        return p + self._prediction_problems() + self._meanflow_problems()

    def _prediction_problems(self) -> list[str]:
        p = choice(self, "prediction", PREDICTIONS)
        if not p and self.prediction != "v" and self.objective != "flow":
            p.append(f"--prediction {self.prediction} acts on the flow objective (the network predicts the clean "
                     "image, converted to a velocity): add --objective flow")
        p += choice(self, "v_target", V_TARGETS)
        if self.v_target == "clamped" and self.objective not in ("flow", "meanflow"):
            p.append(f"--v-target clamped is the velocity target of the flow and meanflow objectives (NanoGen's): add "
                     f"--objective flow or meanflow, or drop --v-target (--objective {self.objective} has its own)")
        if self.v_target == "clamped" and self.prediction == "x":
            p.append("--v-target clamped is a velocity-predicting network's target; --prediction x already trains "
                     "toward (x - x_t) / max(1 - t, --t-eps): drop --v-target")
        if not 0 < self.t_eps < 1:
            p.append(f"--t-eps must be in (0, 1), got {self.t_eps}")
        if (self.lpips or self.pdino) and (self.objective != "flow" or self.prediction != "x"):
            p.append("--lpips and --pdino compare the predicted clean image with the true one: add --objective flow "
                     "--prediction x")
        if not 0 < self.percep_t_thresh <= 1:
            p.append(f"--percep-t-thresh must be in (0, 1], got {self.percep_t_thresh}")
        for name in ("lpips_weight", "pdino_weight"):
            if not getattr(self, name) >= 0:
                p.append(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        return p

    def _meanflow_problems(self) -> list[str]:
        from dit_pipeline.dit.meanflow import JVP_ATTENTION

        p: list[str] = []
        defaults = {f.name: f.default for f in dataclasses.fields(self) if f.name.startswith("mf_")}
        changed = [k for k, v in defaults.items() if getattr(self, k) != v]
        if self.objective not in MEANFLOW_OBJECTIVES:
            if changed:
                p.append(f"{', '.join(flag_name(k) for k in changed)} act on the MeanFlow objectives: add "
                         "--objective meanflow (or imf)")
            return p
        if self.jvp_attention not in JVP_ATTENTION:
            p.append(f"--jvp-attention {self.jvp_attention}: that kernel has no forward-mode AD, so the JVP cannot "
                     f"run through it; use {' or '.join(JVP_ATTENTION)}")
        if self.t_sampling != "uniform" or self.time_shift != 1.0 or self.cosine_loss:
            p.append("--t-sampling, --time-shift and --cosine-loss act on the flow objective; MeanFlow draws its "
                     "times with --mf-t-mean and --mf-t-scale")
        if not self.mf_t_scale > 0:
            p.append(f"--mf-t-scale must be > 0, got {self.mf_t_scale}")
        if self.mf_data_proportion is not None and not 0.0 <= self.mf_data_proportion <= 1.0:
            p.append(f"--mf-data-proportion must be in [0, 1], got {self.mf_data_proportion}")
        if not 0.0 <= self.mf_t_start <= self.mf_t_end <= 1.0:
            p.append(f"--mf-t-start and --mf-t-end must satisfy 0 <= start <= end <= 1, got {self.mf_t_start}, "
                     f"{self.mf_t_end}")
        if not self.mf_norm_eps > 0 or self.mf_norm_p < 0:
            p.append(f"--mf-norm-eps must be > 0 and --mf-norm-p >= 0, got {self.mf_norm_eps}, {self.mf_norm_p}")
        if not self.mf_s_max >= 0:
            p.append(f"--mf-s-max must be >= 0, got {self.mf_s_max}")
        guided = self.objective != "meanflow" or (self.mf_omega, self.mf_kappa) != (1.0, 0.0)
        if guided and not self.class_dropout_prob > 0:
            p.append("MeanFlow's training guidance needs the null class: --class-dropout-prob > 0")
        if self.objective == "meanflow" and any(getattr(self, k) != defaults[k] for k in ("mf_s_max",)):
            p.append("--mf-s-max acts on --objective imf")
        p += choice(self, "mf_rule", MF_RULES)
        if self.objective != "meanflow" and self.mf_rule != defaults["mf_rule"]:
            p.append(f"--mf-rule {self.mf_rule} acts on --objective meanflow; {self.objective} splits its steps as its "
                     "release does")
        if self.objective != "meanflow" and any(getattr(self, k) != defaults[k] for k in
                                           ("mf_omega", "mf_kappa", "mf_t_start", "mf_t_end")):
            p.append(f"--mf-omega, --mf-kappa, --mf-t-start, --mf-t-end are MeanFlow's fixed guidance; {self.objective} "
                     "draws omega and the interval per sample (--mf-s-max)")
        if self.repa:
            p.append("--repa with MeanFlow is not supported (the alignment term is defined for the flow loss)")
        return p

    def make_objective(self) -> Any:
        """The dit/ object that draws training times and computes the loss (dit/objectives.py: GaussianDiffusion,
        FlowMatching, MeanFlow)."""
        from dit_pipeline.dit.objectives import build_objective

        return build_objective(self.objective, self.to_dict())

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def resolve_time_shift(cfg: TrainConfig, latent_shape: list[int]) -> tuple[TrainConfig, str | None]:
    """`cfg` with --time-shift auto replaced by RAE's sqrt(C x H x W / base) for these latents (what the run,
    its config.json and its checkpoints record), and the plan's note on it; unchanged otherwise."""
    if cfg.time_shift != "auto":
        return cfg, None
    from dit_pipeline.dit.shift import shift_for_dim

    dim = 1
    for n in latent_shape:
        dim *= int(n)
    s = shift_for_dim(dim, cfg.time_shift_base)
    shape = "x".join(map(str, latent_shape))
    return dataclasses.replace(cfg, time_shift=s), f"--time-shift auto: sqrt({shape} / {cfg.time_shift_base}) = {s:.4g}"


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
        shown = [str(d) for d in divs] if len(divs) <= 12 else [*map(str, divs[:6]), "...", *map(str, divs[-5:])]
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
    import yaml

    path = moved_config(Path(path).expanduser())
    if not path.is_file():
        raise UserError(f"--config {path}: {missing_file(path)}")
    text = path.read_text(encoding="utf-8")

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


MOVED = "MOVED.yaml"  # in a folder of config files: {old file name: its new path, relative to the folder}


def moved_config(path: Path) -> Path:
    """The config file `path` names: itself; with ".yaml" added when it is given without (recipes/nanogen/NAME);
    or, for a file listed in its folder's MOVED.yaml, the file it moved to (said on stderr), so commands written
    before a recipe moved keep running."""
    if path.is_file():
        return path
    if not path.suffix and path.with_suffix(".yaml").is_file():
        return path.with_suffix(".yaml")
    index = path.parent / MOVED
    if index.is_file():
        import yaml

        moved = yaml.safe_load(index.read_text(encoding="utf-8")) or {}
        if isinstance(moved, dict) and isinstance(moved.get(path.name), str):
            new = path.parent / moved[path.name]
            print(f"--config {path}: moved to {new} (its release's own config name); reading that", file=sys.stderr)
            return new
    return path


def is_sit_name(model: Any) -> bool:
    """A SiT preset name (SiT-XL/2, ...): DiT's network trained with SiT's flow objective (Ma et al. 2024)."""
    return str(model or "").strip().lower().startswith("sit-")


def implied_objective(model: Any) -> str | None:
    """The objective a model name implies: flow for a SiT name, a family's own (dit/family.py
    `default_objective`: flow for LightningDiT, DDT, DiT-DH, whose releases train flow models); None for DiT."""
    if is_sit_name(model):
        return "flow"
    from dit_pipeline.dit.family import lookup_preset

    try:
        objective = lookup_preset(str(model))[0].default_objective
    except ValueError:  # validate() reports the unknown name
        return None
    return objective if objective != "ddpm" else None


def merge_config(file_values: dict[str, Any], flag_values: dict[str, Any]) -> TrainConfig:
    """TrainConfig from defaults, then the config file, then explicitly given flags. A model name that implies an
    objective (`implied_objective`: SiT names, the flow families) sets it when none is given (the plan says so);
    a SiT name with `--objective ddpm` is refused."""
    merged = {**file_values, **flag_values}
    if isinstance(file_values.get("recipe"), dict):  # what the run changes of the recipe (train/recipes.py)
        from dit_pipeline.train.recipes import setting_departures

        defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig) if f.default is not dataclasses.MISSING}
        merged["recipe"] = {**file_values["recipe"],
                            "departures": setting_departures(file_values, flag_values, defaults)}
    if merged.get("objective") is None and (implied := implied_objective(merged.get("model"))):
        merged["objective"] = implied
    needed = ("run_dir",) if merged.get("source") or merged.get("mix") else ("shards", "run_dir")
    missing = [n for n in needed if merged.get(n) in (None, "")]
    if missing:
        raise ConfigError([f"{flag_name(n)} is required (as a flag or in --config)" for n in missing],
                          "training configuration")
    return TrainConfig(**merged)
