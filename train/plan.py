"""The plan `dit-train` prints before it starts (and `--dry-run` prints alone): the run's data, model, objective,
condition, batch arithmetic, schedule, memory and integrity lines, each from the `Preflight` that decided them.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from dit_pipeline.common import distributed as dist
from dit_pipeline.dit.meanflow import VARIANTS as MEANFLOW_OBJECTIVES
from dit_pipeline.shards import Manifest
from dit_pipeline.shards.stats import NEAR_ONE, fix_hint
from dit_pipeline.dit.shift import direction as shift_direction
from dit_pipeline.train import memory
from dit_pipeline.train.config import TrainConfig
from dit_pipeline.train.fit import (host_memory_available, memory_estimate, memory_fit, mode_shards, model_facts,
                                    num_blocks, param_shapes, resolve_precision, run_parallel)
from dit_pipeline.train.init import init_line
from dit_pipeline.train.latents import LatentSpec
from dit_pipeline.train.mixprep import mix_lines, val_line
from dit_pipeline.train.model_options import MODEL_OPTIONS, implied_objective
from dit_pipeline.train.optim import optimizer_line
from dit_pipeline.train.preflight import Preflight, local_ranks
from dit_pipeline.train.recipes import recipe_line
from dit_pipeline.train.repa import repa_line
from dit_pipeline.train.schedule import schedule_line
from dit_pipeline.train.speed import compile_enabled

GiB = float(2**30)
EMA_SHORT_RUN = 10            # EMA grids of a run shorter than this many EMA horizons show early weights


def _store_text(m: Any, spec: LatentSpec) -> str:
    """"store posterior", and what the run trains on where it is not what the store says."""
    if m.store == "posterior" and not spec.draws:
        return "store posterior (trained on its mean: --latent-sample mean)"
    if (m.extraction or {}).get("store") == "mode":
        return "store mode (the VAE posterior's mean)"
    return f"store {m.store}"


def grids_line(prep: Preflight) -> list[str]:
    """The plan's line on the sample grids (none without --sample-every), with a note for short EMA runs."""
    cfg = prep.cfg
    if not cfg.sample_every:
        return []
    line = f"  grids       every {cfg.sample_every} steps, {cfg.sample_weights} weights"
    if cfg.sample_prompts:
        line += f", the prompts of {cfg.sample_prompts}"
    horizon = 1.0 / max(1.0 - cfg.ema_decay, 1e-12)
    if cfg.sample_weights == "ema" and prep.total_steps and prep.total_steps < EMA_SHORT_RUN * horizon:
        line += (f"; the EMA (decay {cfg.ema_decay:g}) averages over ~{horizon:,.0f} steps and this run has "
                 f"{prep.total_steps:,}, so its grids show barely trained weights: --sample-weights both adds "
                 "grids of the raw weights")
    return [line]


def objective_line(cfg: TrainConfig, mc: dict[str, Any] | None = None) -> str:
    """The plan's line on what the model learns: DiT's diffusion loss or the flow objective, and the block
    options beyond DiT's (those of the model_config `mc` when given: another family's are its own)."""
    if cfg.objective == "flow":
        times = ("uniform" if cfg.t_sampling == "uniform"
                 else f"{cfg.t_sampling} (mean {cfg.t_mean:g}, scale {cfg.t_scale:g})")
        implied = f"as --model {cfg.model} implies; " if implied_objective(cfg.model) == "flow" else ""
        shift = (f", shifted by {cfg.time_shift:.4g} {shift_direction(float(cfg.time_shift))}"
                 if cfg.time_shift != 1.0 else "")
        loss = "; loss mse + cos (cosine direction)" if cfg.cosine_loss else ""
        pred = (f"x-prediction, v = (x_pred - x_t) / max(1 - t, {cfg.t_eps:g})" if cfg.prediction == "x" else
                f"velocity prediction, target (x - x_t) / max(1 - t, {cfg.t_eps:g})" if cfg.v_target == "clamped" else
                "velocity prediction")
        what = f"flow ({implied}linear interpolant, {pred}; training times {times}{shift}{loss})"
    elif cfg.objective in MEANFLOW_OBJECTIVES:
        from dit_pipeline.dit.meanflow import DATA_PROPORTION

        prop = cfg.mf_data_proportion if cfg.mf_data_proportion is not None else DATA_PROPORTION[cfg.objective]
        guide = (f"guidance omega {cfg.mf_omega:g}, kappa {cfg.mf_kappa:g} for t in [{cfg.mf_t_start:g}, "
                 f"{cfg.mf_t_end:g}]" if (cfg.mf_omega, cfg.mf_kappa) != (1.0, 0.0) else "no training guidance") \
            if cfg.objective == "meanflow" else f"omega drawn on [1, {1 + cfg.mf_s_max:g}] and fed to the network"
        heads = {"imf": "; the u and v heads' loss terms (the release's iMF)",
                 "imf-adaln": "; this project's iMF variant: conditions added to the time embedding, v read from u "
                              "at h = 0, labels dropped per sample"}.get(cfg.objective, "")
        split = (f"r = t for {prop:.0%} of each step" if cfg.mf_rule == "meanflow" else
                 f"with probability {prop:g} the whole step (every rank) is flow matching, one draw of t and r = t "
                 "(--mf-rule nanogen: NanoGen's TransportMF, labels dropped per sample)")
        target = (f"; velocity (z_t - x) / max(t, {cfg.t_eps:g})" if cfg.objective == "meanflow"
                  and cfg.v_target == "clamped" else "")
        what = (f"{cfg.objective} (average velocity u(z, t, h = t - r); t, r logit-normal({cfg.mf_t_mean:g}, "
                f"{cfg.mf_t_scale:g}), {split}{target}; {guide}{heads}; JVP through "
                f"{cfg.jvp_attention} attention; adaptive weight p {cfg.mf_norm_p:g})")
    else:
        what = "ddpm (DiT: noise prediction + learned variance, 1000-step linear schedule)"
    family = (mc or {}).get("family")
    extras = [name for name in MODEL_OPTIONS if ((mc or {}).get(name) if mc is not None else getattr(cfg, name))]
    listed = ", ".join(e.replace("_", "-") for e in extras)
    blocks = (f"{family}'s" + (f" ({listed})" if listed else "")) if family else (listed or "as in DiT")
    return f"  objective   {what}; blocks {blocks}"


def condition_line(prep: Preflight, mc: dict[str, Any]) -> str:
    """The plan's line on what the model is conditioned on (dit/conditioning.py) and its dropout."""
    from dit_pipeline.dit.conditioning import conditioning_of

    cond, p = conditioning_of(mc), prep.cfg.class_dropout_prob
    line = f"  condition   {cond.describe()}" + (f"; dropout {p:g} to {cond.describe_null()}" if p > 0 else "")
    if prep.text is not None:
        line += (f"; text encoder {prep.text.identity.get('name')} ({prep.cfg.text_features} features, up to "
                 f"{prep.text.max_length} tokens)")
    return line


def integrity_line(prep: Preflight) -> str:
    """The plan's line on the shards' sha256 check (train.preflight.sha256_mode)."""
    held = f"{prep.sha256_bytes / GiB:.2f} GiB of whole shards per node"
    return "  integrity   " + {
        None: "sha256 check of the shards off (--no-verify-shards)",
        "whole": f"each shard's sha256 checked against the manifest before its samples are used ({held})",
        "stream": (f"each shard's sha256 checked against the manifest as it streams, so a mismatch is found at "
                   f"the shard's end (hashing whole shards first would hold {held}, more than a quarter of the "
                   "available memory)")}[prep.sha256]


def format_plan(prep: Preflight, start_line: str | None = None, *, dry_run: bool = True) -> str:
    """The plan `--dry-run` prints and the real run logs; `start_line`: where the run starts
    (train.resume.start_line), else "from scratch"."""
    cfg, b, m, p0 = prep.cfg, prep.batch, prep.source.manifest, prep.plan0
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    precision = resolve_precision(cfg.precision, device)
    total, trainable, mc, shapes = param_shapes(prep.model_kwargs)
    c, h, w = m.latent_shape
    shards_per = [len(s) for s in p0.lanes] if prep.mix is not None else [len(s) for s in p0.slot_shards]
    mem = memory_estimate(prep)
    parts = " + ".join(f"{k} {v:.2f}" for k, v in mem.parts.items())
    par = run_parallel(prep)
    facts = model_facts(prep)
    rows = memory.fits(facts, b.micro_batch, resolve_precision(cfg.precision, torch.device("cuda")),
                       compile_enabled(cfg.compile, torch.device("cuda")), mode_shards(prep))
    fit_lines, _ = memory_fit(prep)
    compiled = compile_enabled(cfg.compile, device)
    local = local_ranks(prep.world_size)
    # Each reader buffers one view of each sample as stored (mean + std, the mean alone, or the latent), keeps two
    # scratch batches (the stacked stored values and their float32 copy) and its float32 output slots (train.pool:
    # prefetch + 2 + its share of one step's micro-batches).
    spec = LatentSpec.from_manifest(m, cfg.latent_sample)
    arrays, itemsize = max(spec.arrays, 1), (4 if m.dtype == "float32" else 2)
    pending_bytes = arrays * c * h * w * itemsize
    slots = cfg.prefetch_factor + 2 + math.ceil(b.accum / prep.layout.workers)
    batch_bytes = b.micro_batch * c * h * w * (arrays * (itemsize + 4) + 4 * slots)
    host = local * prep.layout.workers * (cfg.shuffle_buffer * pending_bytes + batch_bytes)
    gpu = (f" of {torch.cuda.get_device_properties(0).total_memory / GiB:.1f} GiB on "
           f"{torch.cuda.get_device_name(0)}" if device.type == "cuda" else " (no GPU visible here)")
    avail = host_memory_available()
    length = [f"max_steps {cfg.max_steps}"] if cfg.max_steps else []
    length += [f"epochs {cfg.epochs}"] if cfg.epochs else []
    lines = [
        "dit-train plan (dry run: nothing was started)" if dry_run else "dit-train plan",
        *recipe_line(cfg.recipe),
        *([f"  shards      {cfg.shards}: {len(m.shards)} shards, {m.total_samples:,} samples, {_store_text(m, spec)}, "
           f"{m.views} view(s), latents {c}x{h}x{w} {m.dtype}, {_scale_text(m)}, {m.num_classes} classes"]
          if prep.mix is None else [f"  latents     {c}x{h}x{w} ({_scale_text(m)}), the space of every source"]),
        *normalization_line(m),
        *latent_std_line(prep),
        *init_line(prep.init),
        f"  model       {mc['model'] or 'custom'} ({describe_model(mc)}): {total / 1e6:.2f}M parameters, input "
        f"{mc['input_size']} ({tokens_text(mc)})",
        condition_line(prep, mc),
        objective_line(cfg, mc) + (f"\n              ({prep.notes['time_shift']})" if "time_shift" in prep.notes else ""),
        optimizer_line(cfg, shapes),
        f"  precision   {precision}, tf32 {'on' if cfg.tf32 else 'off'}, grad checkpointing "
        f"{'on' if cfg.grad_checkpointing else 'off'}, compile {'on (per block)' if compiled else 'off'}, "
        f"attention {cfg.attention if device.type == 'cuda' else 'default (CPU)'}",
        f"  {dist.launch_info().describe()}",
        f"  batch       global {b.global_batch} = {prep.world_size} rank(s) x micro-batch {b.micro_batch} x "
        f"{b.accum} accumulation step(s)"
        + (" (--micro-batch-size auto: the largest that fits the GPU memory estimate)"
           if cfg.micro_batch_size == "auto" and device.type == "cuda" else
           " (--micro-batch-size auto: no GPU visible, no accumulation)" if cfg.micro_batch_size == "auto" else ""),
        *(mix_lines(prep) if prep.mix is not None else [
            f"  epoch 0     {p0.steps:,} optimizer steps; {p0.samples_used:,} of {p0.samples_total:,} samples used "
            f"({p0.samples_total - p0.samples_used:,} left out so every rank runs the same number of steps)",
            f"  readers     {prep.world_size} rank(s) x {prep.layout.workers} loader worker(s) = {len(shards_per)}; "
            f"shards per reader {min(shards_per)}-{max(shards_per)}, up to {cfg.shards_in_flight} read at once; "
            f"shuffle buffer {cfg.shuffle_buffer} samples each"
            + (f"\n              ({prep.notes['readers']})" if "readers" in prep.notes else "")]),
        *val_line(cfg),
        f"  length      {', '.join(length)} -> {prep.total_steps:,} steps "
        f"(~{prep.total_steps / max(p0.steps, 1):.2f} epochs)"
        + (f"\n              ({prep.notes['length']})" if "length" in prep.notes else ""),
        *([schedule_line(prep.schedule)] if prep.schedule else []),
        f"  parallel    {par.describe()}",
        f"  GPU memory  ({mem.source}, {'per rank' if par.sharded else 'rank 0'}) {parts} = {mem.total:.2f} GiB{gpu}",
        *memory.table_lines(rows, b.micro_batch, prep.world_size, par.mode.name),
        *fit_lines,
        f"  host memory (estimate, per node) {local} rank(s) x {prep.layout.workers} worker(s) x shuffle buffers = "
        f"{host / GiB:.2f} GiB{f' of {avail:.1f} GiB available' if avail is not None else ''}",
        integrity_line(prep),
        *repa_line(cfg, prep.teacher, num_blocks(mc), dit_train_flops(mc)),
        *([prep.reg.line(cfg.reg_coeff, prep.mix)] if prep.reg is not None else []),
        *([f"  guidance    internal guidance's base head after encoder block {cfg.base_model_depth}: loss + "
           f"{cfg.base_model_coeff:g} x base (dit-sample --ig-scale)"] if cfg.base_model_depth else []),
        *grids_line(prep),
        start_line or f"  run dir     {cfg.run_dir}: {'would start' if dry_run else 'starts'} from scratch",
    ]
    return "\n".join(lines)


def _scale_text(m: Manifest) -> str:
    """The shards line's latent scale: the scalar factors as always, or "normalized per channel"."""
    if m.norm.is_per_channel:
        return "normalized per channel"
    return f"scaling {m.scaling_factor:g}{f', shift {m.shift_factor:g}' if m.shift_factor else ''}"


def normalization_line(m: Manifest) -> list[str]:
    """The plan's line on a per-channel normalization and a revised manifest (none for an unrevised scalar
    set, whose factors the shards line shows): never silently trained on."""
    if not m.norm.is_per_channel and m.revision is None:
        return []
    revised = (f" (manifest revision {m.revision['number']}, by {m.revision['by']})" if m.revision else "")
    return [f"  latents     {m.norm.describe()}{revised}"]


def latent_std_line(prep: Preflight) -> list[str]:
    """One line when the latents it trains on are far from unit std (DiT's noise schedule assumes ~1), with the
    command that normalizes them; none otherwise."""
    if prep.latent_std is None or abs(prep.latent_std[0] - 1.0) <= NEAR_ONE:
        return []
    std, used, shard = prep.latent_std
    return [f"  latents     std {std:.3g} over the first {used} samples of {shard}: NOT near 1 (DiT assumes ~1); "
            f"{fix_hint(str(prep.source.folder or prep.cfg.shards))}"]


def describe_model(mc: dict[str, Any]) -> str:
    """The architecture in words (its family's `describe`): depth, widths, heads, patch."""
    from dit_pipeline.dit.family import family_of_config

    return family_of_config(mc).describe(mc)


def tokens_text(mc: dict[str, Any]) -> str:
    """Tokens per image: (latent side / patch)^2, the DiT's sequence length."""
    g = mc["input_size"] // mc["patch_size"]
    return f"{mc['input_size']}x{mc['input_size']} latents / patch {mc['patch_size']} = {g * g} tokens per image"


def dit_train_flops(mc: dict[str, Any]) -> float:
    """Model FLOPs of one training step per image (dit.train_flops_per_image)."""
    from dit_pipeline import dit

    return float(dit.train_flops_per_image(mc))
