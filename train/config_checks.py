"""The checks of `TrainConfig.validate`: every problem of a training configuration, with its fix, in the order
the error lists them (`config_problems`). The settings groups that are types of their own check themselves
(`val_problems`, `repa_problems`, `reg_problems`, `guard_problems`, `parallel_problems`, `grid_problems`,
`fid_problems`); here are the data, length, optimisation, conditioning and model checks, a data mix's, the
objective's (flow times, prediction, perceptual terms, MeanFlow), and the guidance settings that would do nothing.
Nothing here knows the world size (see train.batch.batch_plan).
"""
from __future__ import annotations

import dataclasses
import importlib.util
from typing import TYPE_CHECKING

from dit_pipeline.common.precision import PRECISIONS_AUTO as PRECISIONS
from dit_pipeline.common.settings import choice, flag_name, non_negative, positive
from dit_pipeline.dit.flow import T_SAMPLINGS
from dit_pipeline.dit.flow_predictions import PREDICTIONS, V_TARGETS
from dit_pipeline.dit.formats import OBJECTIVES
from dit_pipeline.dit.meanflow import RULES as MF_RULES, VARIANTS as MEANFLOW_OBJECTIVES
from dit_pipeline.train.latents import LATENT_SAMPLES
from dit_pipeline.train.model_options import ARCH_OVERRIDES, RUN_CONDITIONINGS, is_sit_name
from dit_pipeline.train.optim import optimizer_problems
from dit_pipeline.train.recipes import recipe_problems
from dit_pipeline.train.schedule import schedule_problems
from dit_pipeline.train.speed import ATTENTION_BACKENDS
from dit_pipeline.train.text import TEXT_FEATURES

if TYPE_CHECKING:
    from dit_pipeline.train.config import TrainConfig


def config_problems(cfg: TrainConfig) -> list[str]:
    """Every invalid setting of `cfg`, each with its fix (nothing about world size: see batch_plan)."""
    mixed = bool(cfg.source or cfg.mix)
    return (_data_problems(cfg, mixed) + _number_problems(cfg) + _objective_problems(cfg)
            + _condition_problems(cfg, mixed) + _run_problems(cfg) + _model_problems(cfg) + _hook_problems(cfg))


def _data_problems(cfg: TrainConfig, mixed: bool) -> list[str]:
    p: list[str] = []
    if not str(cfg.shards or "").strip() and not mixed:
        p.append("--shards is required: a shard folder (with manifest.json) or a URL list/pattern (or a data "
                 "mix: --source / --mix)")
    if mixed:
        p += _mix_problems(cfg)
    p += cfg.val_problems(mixed)
    if not str(cfg.run_dir or "").strip():
        p.append("--run-dir is required: the folder for checkpoints, logs and metrics")
    return p


def _number_problems(cfg: TrainConfig) -> list[str]:
    """The sizes, lengths and optimisation numbers."""
    p: list[str] = []
    if cfg.micro_batch_size != "auto":
        p += positive(cfg, "micro_batch_size")
    p += positive(cfg, "global_batch_size", "image_size", "ddp_bucket_mb", *ARCH_OVERRIDES, "max_steps",
                  "epochs", "log_every", "ckpt_every", "keep_last", "keep_every", "shuffle_buffer", "shards_in_flight",
                  "prefetch_factor")
    p += non_negative(cfg, "warmup_steps", "seed", "weight_decay")
    p += schedule_problems(cfg) + optimizer_problems(cfg) + recipe_problems(cfg.recipe)
    if cfg.num_workers is not None:
        p += non_negative(cfg, "num_workers")
    if not cfg.lr > 0:
        p.append(f"--lr must be > 0, got {cfg.lr}")
    for name in ("adam_beta1", "adam_beta2"):
        if not 0.0 <= getattr(cfg, name) < 1.0:
            p.append(f"{flag_name(name)} must be in [0, 1), got {getattr(cfg, name)}")
    if not cfg.adam_eps > 0:
        p.append(f"--adam-eps must be > 0, got {cfg.adam_eps}")
    if not 0.0 <= cfg.ema_decay <= 1.0:
        p.append(f"--ema-decay must be in [0, 1], got {cfg.ema_decay}")
    if not 0.0 <= cfg.class_dropout_prob < 1.0:
        p.append(f"--class-dropout-prob must be in [0, 1), got {cfg.class_dropout_prob}")
    return p


def _condition_problems(cfg: TrainConfig, mixed: bool) -> list[str]:
    p = choice(cfg, "conditioning", RUN_CONDITIONINGS)
    p += choice(cfg, "text_features", TEXT_FEATURES) + choice(cfg, "latent_sample", LATENT_SAMPLES)
    if cfg.text is not None and cfg.conditioning not in ("auto", "text"):
        p.append(f"--text conditions the model on text; --conditioning {cfg.conditioning} does not use it "
                 "(drop one)")
    elif cfg.conditioning == "text" and cfg.text is None and not mixed:
        p.append("--conditioning text needs --text FOLDER, the text set of the shards' captions (dit-extract "
                 "--text-encoder NAME --data-path SHARDS --out FOLDER)")
    return p


def _run_problems(cfg: TrainConfig) -> list[str]:
    """Clipping, MFU, the kernels and the run's start."""
    p: list[str] = []
    if cfg.grad_clip is not None and not cfg.grad_clip > 0:
        p.append(f"--grad-clip must be > 0 (omit it to disable clipping), got {cfg.grad_clip}")
    if cfg.peak_tflops is not None and not cfg.peak_tflops > 0:
        p.append(f"--peak-tflops must be > 0, got {cfg.peak_tflops}")
    p += choice(cfg, "attention", ATTENTION_BACKENDS) + choice(cfg, "precision", PRECISIONS)
    if cfg.init is not None and cfg.resume not in ("auto", "none"):
        p.append(f"--init starts a new run from weights and --resume {cfg.resume} continues a run; give one")
    if not str(cfg.resume or "").strip():
        p.append("--resume must be 'auto', 'none' or a checkpoint path")
    return p


def _model_problems(cfg: TrainConfig) -> list[str]:
    """The model against the objective, and the settings groups that depend on the model."""
    p: list[str] = []
    try:
        from dit_pipeline.dit.family import lookup_preset
        from dit_pipeline.dit.objectives import network_problem

        family = lookup_preset(cfg.model)[0].family
        if cfg.objective in OBJECTIVES and (problem := network_problem(cfg.objective, family)):
            p.append(problem)
        options = tuple(lookup_preset(cfg.model)[0].overrides)
    except ValueError as e:
        p.append(f"--model: {e}")
        options = ("reg_dim", "base_model_depth")  # the model's own problem is reported above
    mixed = bool(cfg.source or cfg.mix)  # a mix's sources name their class tokens (reg=)
    p += cfg.repa_problems() + cfg.guard_problems() + cfg.reg_problems(cfg.objective, options, cfg.repa, mixed) + \
        cfg.parallel_problems()
    if cfg.wandb and importlib.util.find_spec("wandb") is None:
        p.append("--wandb needs the wandb package: pip install 'dit-pipeline[wandb]' (or drop --wandb)")
    return p


def _hook_problems(cfg: TrainConfig) -> list[str]:
    """The periodic sample grids' and FID's settings, and their guidance."""
    from dit_pipeline.sample.config import GRID_SAMPLER

    p = cfg.grid_problems(fid_on=cfg.fid_every is not None, sampler=GRID_SAMPLER.get(cfg.objective, "ddim"))
    return p + cfg.fid_problems(objective=cfg.objective) + _guidance_problems(cfg)


def _mix_problems(cfg: TrainConfig) -> list[str]:
    """A data mix replaces --shards, --manifest and --text (each source names its own)."""
    from dit_pipeline.train.repa import is_cached

    given = [flag for flag, on in (("--shards", cfg.shards), ("--manifest", cfg.manifest), ("--text", cfg.text),
                                   ("--reg-tokens", cfg.reg_tokens)) if on]
    p = [f"{', '.join(given)} with a data mix: each source names its shards (manifest=), its text set (text=), "
         "its REG class tokens (reg=) and its REPA tokens (repa=) in --source / --mix"] if given else []
    if is_cached(cfg.repa):
        p.append(f"--repa {cfg.repa} is one shard set's cached teacher tokens: with a data mix name each source's "
                 "with repa=FOLDER and pass --repa cached, or give --repa a teacher (it sees each source's pixels: "
                 "dit-extract --pixels)")
    if cfg.source and cfg.mix:
        p.append("give the sources either as --source options or in a --mix file, not both")
    p += positive(cfg, "mix_epoch_size", "mix_lanes")
    return p


def _guidance_problems(cfg: TrainConfig) -> list[str]:
    """Grid and FID guidance settings that would do nothing (issue 41: refused with the reason, never recorded
    and ignored): a scale on a MeanFlow model or one without label dropout, channels where nothing is guided."""
    from dit_pipeline.dit.objectives import SPECS
    from dit_pipeline.evaluate.hook import fid_default_scale
    from dit_pipeline.sample.config import PROTOCOLS
    from dit_pipeline.sample.guidance import cfg_channels_inert, resolve_cfg_scale
    from dit_pipeline.sample.grid import GRID_CFG_SCALE, guidance_inert_for

    if cfg.objective not in SPECS or not isinstance(cfg.class_dropout_prob, (int, float)):
        return []
    protocol = cfg.protocol if cfg.protocol in PROTOCOLS else None
    p, scales = [], []
    for on, flag, given, default, inert in (
            (cfg.sample_every is not None, "--sample-cfg-scale", cfg.sample_cfg_scale, GRID_CFG_SCALE,
             guidance_inert_for(cfg.objective, cfg)),
            (cfg.fid_every is not None, "--fid-cfg-scale", cfg.fid_cfg_scale, fid_default_scale(protocol),
             guidance_inert_for(cfg.objective, cfg, protocol))):
        if on and (given is None or isinstance(given, (int, float))):
            try:
                scales.append(resolve_cfg_scale(given, default, inert, flag))
            except ValueError as e:
                p.append(str(e))
    channels = cfg_channels_inert(cfg.cfg_channels, max(scales or [1.0]), SPECS[cfg.objective].conditions)
    if channels and (cfg.sample_every is not None or cfg.fid_every is not None):
        p.append(channels)
    return p


def _objective_problems(cfg: TrainConfig) -> list[str]:
    p = choice(cfg, "objective", OBJECTIVES)
    if not p and is_sit_name(cfg.model) and cfg.objective != "flow":
        dit_name = "DiT-" + str(cfg.model).strip()[4:]
        p.append(f"--model {cfg.model} names SiT, a flow model (dit-sample samples SiT- files as flow), which "
                 f"--objective {cfg.objective} contradicts: drop --objective (a SiT- name implies flow) or use "
                 f"--model {dit_name} for DiT's {cfg.objective} objective")
    if cfg.t_sampling not in T_SAMPLINGS:
        p += choice(cfg, "t_sampling", T_SAMPLINGS)
    elif cfg.objective == "ddpm" and (cfg.t_sampling, cfg.t_mean, cfg.t_scale) != ("uniform", 0.0, 1.0):
        p.append("--t-sampling, --t-mean and --t-scale choose flow training times: add --objective flow "
                 "(ddpm draws its 1000 discrete steps uniformly)")
    if not cfg.t_scale > 0:
        p.append(f"--t-scale must be > 0, got {cfg.t_scale}")
    shift = cfg.time_shift
    if not (shift == "auto" or (isinstance(shift, (int, float)) and not isinstance(shift, bool) and shift > 0)):
        p.append(f"--time-shift must be a number > 0 or 'auto', got {shift!r}")
    elif cfg.objective == "ddpm" and (shift != 1.0 or cfg.cosine_loss):
        p.append("--time-shift and --cosine-loss act on the flow objective: add --objective flow")
    p += positive(cfg, "time_shift_base")
    return p + _prediction_problems(cfg) + _meanflow_problems(cfg)


def _prediction_problems(cfg: TrainConfig) -> list[str]:
    p = choice(cfg, "prediction", PREDICTIONS)
    if not p and cfg.prediction != "v" and cfg.objective != "flow":
        p.append(f"--prediction {cfg.prediction} acts on the flow objective (the network predicts the clean "
                 "image, converted to a velocity): add --objective flow")
    p += choice(cfg, "v_target", V_TARGETS)
    if cfg.v_target == "clamped" and cfg.objective not in ("flow", "meanflow"):
        p.append(f"--v-target clamped is the velocity target of the flow and meanflow objectives (NanoGen's): add "
                 f"--objective flow or meanflow, or drop --v-target (--objective {cfg.objective} has its own)")
    if cfg.v_target == "clamped" and cfg.prediction == "x":
        p.append("--v-target clamped is a velocity-predicting network's target; --prediction x already trains "
                 "toward (x - x_t) / max(1 - t, --t-eps): drop --v-target")
    if not 0 < cfg.t_eps < 1:
        p.append(f"--t-eps must be in (0, 1), got {cfg.t_eps}")
    if (cfg.lpips or cfg.pdino) and (cfg.objective != "flow" or cfg.prediction != "x"):
        p.append("--lpips and --pdino compare the predicted clean image with the true one: add --objective flow "
                 "--prediction x")
    if not 0 < cfg.percep_t_thresh <= 1:
        p.append(f"--percep-t-thresh must be in (0, 1], got {cfg.percep_t_thresh}")
    for name in ("lpips_weight", "pdino_weight"):
        if not getattr(cfg, name) >= 0:
            p.append(f"--{name.replace('_', '-')} must be >= 0, got {getattr(cfg, name)}")
    return p


def _meanflow_problems(cfg: TrainConfig) -> list[str]:
    from dit_pipeline.dit.meanflow import JVP_ATTENTION

    p: list[str] = []
    defaults = {f.name: f.default for f in dataclasses.fields(cfg) if f.name.startswith("mf_")}
    changed = [k for k, v in defaults.items() if getattr(cfg, k) != v]
    if cfg.objective not in MEANFLOW_OBJECTIVES:
        if changed:
            p.append(f"{', '.join(flag_name(k) for k in changed)} act on the MeanFlow objectives: add "
                     "--objective meanflow (or imf)")
        return p
    if cfg.jvp_attention not in JVP_ATTENTION:
        p.append(f"--jvp-attention {cfg.jvp_attention}: that kernel has no forward-mode AD, so the JVP cannot "
                 f"run through it; use {' or '.join(JVP_ATTENTION)}")
    if cfg.t_sampling != "uniform" or cfg.time_shift != 1.0 or cfg.cosine_loss:
        p.append("--t-sampling, --time-shift and --cosine-loss act on the flow objective; MeanFlow draws its "
                 "times with --mf-t-mean and --mf-t-scale")
    if not cfg.mf_t_scale > 0:
        p.append(f"--mf-t-scale must be > 0, got {cfg.mf_t_scale}")
    if cfg.mf_data_proportion is not None and not 0.0 <= cfg.mf_data_proportion <= 1.0:
        p.append(f"--mf-data-proportion must be in [0, 1], got {cfg.mf_data_proportion}")
    if not 0.0 <= cfg.mf_t_start <= cfg.mf_t_end <= 1.0:
        p.append(f"--mf-t-start and --mf-t-end must satisfy 0 <= start <= end <= 1, got {cfg.mf_t_start}, "
                 f"{cfg.mf_t_end}")
    if not cfg.mf_norm_eps > 0 or cfg.mf_norm_p < 0:
        p.append(f"--mf-norm-eps must be > 0 and --mf-norm-p >= 0, got {cfg.mf_norm_eps}, {cfg.mf_norm_p}")
    if not cfg.mf_s_max >= 0:
        p.append(f"--mf-s-max must be >= 0, got {cfg.mf_s_max}")
    guided = cfg.objective != "meanflow" or (cfg.mf_omega, cfg.mf_kappa) != (1.0, 0.0)
    if guided and not cfg.class_dropout_prob > 0:
        p.append("MeanFlow's training guidance needs the null class: --class-dropout-prob > 0")
    if cfg.objective == "meanflow" and any(getattr(cfg, k) != defaults[k] for k in ("mf_s_max",)):
        p.append("--mf-s-max acts on --objective imf")
    p += choice(cfg, "mf_rule", MF_RULES)
    if cfg.objective != "meanflow" and cfg.mf_rule != defaults["mf_rule"]:
        p.append(f"--mf-rule {cfg.mf_rule} acts on --objective meanflow; {cfg.objective} splits its steps as its "
                 "release does")
    if cfg.objective != "meanflow" and any(getattr(cfg, k) != defaults[k] for k in
                                       ("mf_omega", "mf_kappa", "mf_t_start", "mf_t_end")):
        p.append(f"--mf-omega, --mf-kappa, --mf-t-start, --mf-t-end are MeanFlow's fixed guidance; {cfg.objective} "
                 "draws omega and the interval per sample (--mf-s-max)")
    if cfg.repa:
        p.append("--repa with MeanFlow is not supported (the alignment term is defined for the flow loss)")
    return p