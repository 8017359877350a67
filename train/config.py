"""`TrainConfig`: every setting of a training run, its defaults, help texts and `--help` sections.

Follows the project convention (docs/ARCHITECTURE.md): one keyword-only dataclass whose `validate()` reports
**all** problems at once with the fix (the checks: train/config_checks.py); settings come from defaults <
`--config run.yaml|json` < explicit flags (train/config_file.py); the resolved config is stored as JSON (never
pickled). Defaults are the reference DiT recipe (docs/REFERENCE.md): AdamW lr 1e-4, no weight decay, betas
(0.9, 0.999), constant lr, global batch 256, EMA 0.9999, class dropout 0.1, seed 0. The batch arithmetic is
train/batch.py; the model settings' tables train/model_options.py.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from dit_pipeline.common.errors import collect
from dit_pipeline.common.precision import PRECISIONS_AUTO as PRECISIONS
from dit_pipeline.common.settings import setting
from dit_pipeline.dit.flow import T_SAMPLINGS
from dit_pipeline.dit.flow_predictions import PREDICTIONS, T_EPS, V_TARGETS
from dit_pipeline.dit.formats import OBJECTIVES
from dit_pipeline.dit.meanflow import DEFAULTS as MF, RULES as MF_RULES
from dit_pipeline.evaluate.hook import FidSettings
from dit_pipeline.sample.grid import GRIDS, GridSettings
from dit_pipeline.train.config_checks import config_problems
from dit_pipeline.train.guard import GUARD, GuardSettings
from dit_pipeline.train.latents import LATENT_SAMPLES
from dit_pipeline.train.model_options import RUN_CONDITIONINGS
from dit_pipeline.train.optim import MUON_ADJUST_LR, OPTIMIZERS
from dit_pipeline.train.parallel import ParallelSettings
from dit_pipeline.train.reg import REG, RegSettings
from dit_pipeline.train.repa import REPA, RepaSettings
from dit_pipeline.train.speed import ATTENTION_BACKENDS
from dit_pipeline.train.text import TEXT_FEATURES
from dit_pipeline.train.validation import VAL, ValSettings

DEFAULT_MAX_STEPS = 400_000   # neither --max-steps nor --epochs: the DiT paper's length for its comparisons
DEFAULT_NUM_WORKERS = 4       # loader processes per rank, unless the shard set has fewer shards per rank

DATA, MIX, MODEL, OBJECTIVE = "Data", "Data mix", "Model", "Objective"
LENGTH, OPTIM, SPEED, CKPT = "Length and batch", "Optimisation", "Speed and memory", "Checkpoints and logging"
_PRESETS = "the family's: off for DiT, as its release for the others"
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
        "(MosaicML Streaming's weights), text, caption, template, class_names, holdout, reg (REG's class tokens), repa "
        "(REPA's cached teacher tokens, with --repa cached), name, manifest; docs/data-mix.md)", group=MIX,
        shown="none: --shards alone")
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
        collect(config_problems(self), "training configuration")

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
