"""`dit-sample`: images and FID-ready `.npz` files from DiT checkpoints, on one process or under torchrun.

Follows the reference DiT FID sampler (docs/REFERENCE.md; ADM evaluation format) with three guarantees added:
every sample is a pure function of (seed, index) (sample/plan.py), finished batches survive a kill
(sample/npz.py part files, checked against a fingerprint of everything that determines the pixels), and
ranks split the missing indices between them in fixed global chunks, so for one batch size the final
arrays do not depend on the number of GPUs or on interruptions (bit for bit on one machine: same shapes,
pinned CPU threads, deterministic cuDNN; common/determinism.py). Another batch size gives the same
samples to within float rounding (docs/sampling.md).

Flow: every rank loads the model and VAE; rank 0 checks earlier results and opens the parts folder and
tells the others which indices are missing; each rank samples its batches and writes one part per batch;
after a barrier rank 0 assembles the `.npz`, the grid and the run record, then deletes the parts.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from dit_pipeline import dit
from dit_pipeline.common import distributed as dist
from dit_pipeline.common.determinism import deterministic_cuda, pinned_threads
from dit_pipeline.common.errors import UserError
from dit_pipeline.common.faults import fault_point
from dit_pipeline.common.io import atomic_write_bytes, atomic_write_json, check_writable_dir, sha256_file
from dit_pipeline.common.latent_norm import LatentNorm
from dit_pipeline.common.log import progress_enabled, setup_logging
from dit_pipeline.common.precision import AUTOCAST_DTYPES, set_tf32
from dit_pipeline.common.rae_decoder import fit_decoder
from dit_pipeline.common.vae import DEFAULT_VAE, load_vae, recorded_vae
from dit_pipeline.sample import plan
from dit_pipeline.dit import protocols
from dit_pipeline.dit.protocol_fit import model_traits
from dit_pipeline.dit.protocol_types import Protocol
from dit_pipeline.sample.config import (DEFAULT_CFG_SCALE, DEFAULT_SAMPLERS, DEFAULT_STEPS, FLOW_SAMPLERS, SPECS,
                                        SampleConfig, cfg_channels_inert, guidance_inert, resolve_cfg_scale)
from dit_pipeline.sample.generate import generate_images, protocol_loop, protocol_model_fn, resolve_cfg_channels
from dit_pipeline.sample.conditions import Sampling, sampling_for
from dit_pipeline.sample.facts import prediction_known, supply
from dit_pipeline.sample.grid import png_bytes, save_grid
from dit_pipeline.sample.load import (LoadedModel, latent_norm, load_model, manifest_folder, resolve_ckpt,
                                      resolve_flow_convention, resolve_objective, with_latent_stats)
from dit_pipeline.sample.names import with_class_ids
from dit_pipeline.sample.npz import RUN_FILE, PartStore, assemble_npz, describe_changes, parts_dir_for

RECORD_FORMAT = "dit-pipeline.samples"


@dataclass
class SampleResult:
    total: int  # samples in the run
    produced: int  # sampled by this invocation on this rank
    resumed: int  # finished by earlier invocations
    image_size: int
    seconds: float
    npz: Path | None = None
    grid: Path | None = None


def run_sampling(cfg: SampleConfig) -> SampleResult:
    """Run one sampling job (see the module docstring); joins torchrun's process group if launched by it."""
    cfg.validate()
    if cfg.out:
        check_writable_dir(cfg.out, f"--out {cfg.out}")
    if cfg.npz:
        check_writable_dir(Path(cfg.npz).expanduser().parent, f"--npz {cfg.npz}")
    dist.init()
    with dist.leaving_group():
        return _run(cfg)


def _run(cfg: SampleConfig) -> SampleResult:
    log = setup_logging(None, quiet=cfg.quiet)  # log files only once the inputs proved usable
    start = time.perf_counter()
    device = torch.device(cfg.device) if cfg.device else dist.device()
    set_tf32(cfg.tf32)
    if device.type == "cuda":
        deterministic_cuda()
    cfg = dataclasses.replace(cfg, ckpt=str(resolve_ckpt(cfg.ckpt)))  # a run folder: its newest checkpoint
    loaded = load_model(cfg.ckpt, weights=cfg.weights, expect_model=cfg.model, device=device,
                        num_heads=cfg.num_heads, input_size=cfg.input_size, encoder_depth=cfg.encoder_depth)
    log.info("model: %s", loaded.describe())
    log.info("%s", dist.launch_info().describe())
    cfg = supply(cfg, loaded, log)  # what the file cannot state: a flag's or the protocol row's (sample/facts.py)
    cfg = _with_vae(cfg, loaded, log)
    vae, vae_id = load_vae(cfg.vae, config=cfg.vae_config, device=device)
    vae_note = compare_vae(vae_id, (loaded.latent or {}).get("vae"))
    if vae_note:
        log.warning("%s", vae_note)
    norm = with_latent_stats(latent_norm(loaded.latent, vae_id, log), loaded.info, cfg.latent_stats,
                             int(loaded.config["in_channels"]), cfg.ckpt)
    if norm.is_per_channel:
        log.info("latents: %s", norm.describe())
    loaded.info["objective"] = resolve_objective(loaded.info, cfg.ckpt, cfg.objective)
    _check_fit(cfg, loaded, vae_id)  # before any work that depends on the model's conditioning
    cfg = with_class_ids(cfg, loaded.latent)  # names given in --class-labels -> ids (sample/names.py)
    if cfg.labels is None and cfg.class_labels is None and cfg.prompts is None and cfg.prompts_file is None:
        # the protocol's FID labels, else uniform draws
        cfg = dataclasses.replace(cfg, labels=protocols.protocol(cfg.protocol).labels if cfg.protocol else "uniform")
    # each sample's condition: its class, or its prompt (sample/conditions.py, by the model's conditioning)
    cfg, conds = sampling_for(cfg, loaded, device)
    labels = conds.ids
    cfg, sampler_note = _with_sampler(cfg, loaded.info["objective"])
    cfg = _with_cfg_scale(cfg, loaded, log)
    cfg.validate()  # the sampler's own rules (e.g. --flow-convention only for flow samplers) once it is known
    _check_compatible(cfg, loaded, vae_id, vae)
    if cfg.encoder_refresh > 1 and not dit.reuse.can_reuse_encoder(loaded.model):
        raise UserError(f"--encoder-refresh {cfg.encoder_refresh}: {loaded.config['model'] or 'this model'} has no "
                        "encoder/decoder split whose state could be reused (DDT has); drop --encoder-refresh")
    if loaded.info["objective"] == "flow":
        loaded.info["flow_convention"] = resolve_flow_convention(loaded.info, cfg.ckpt, cfg.flow_convention)
        if loaded.info["flow_convention"] == "repa":
            log.info("flow model in REPA's time (t = 1 noise; %s): called at 1 - t, its output negated",
                     loaded.info.get("flow_convention_from") if cfg.flow_convention is None else "--flow-convention")
        if cfg.protocol is None:  # a protocol's grid has its own shift
            cfg = _with_time_shift(cfg, loaded, log)
    cfg = _with_cfg_channels(cfg, loaded, log)
    proto = _protocol(cfg, loaded)
    guide = _guidance_model(cfg, loaded, device, log)
    image_size = int(loaded.config["input_size"]) * int(vae_id["downsample_factor"])
    if cfg.out:
        log = setup_logging(Path(cfg.out) / "logs", quiet=cfg.quiet)
    if sampler_note:
        log.info("%s", sampler_note)
    record = _record(cfg, loaded, vae_id, norm, labels, image_size, device, proto, guide, conds) \
        if dist.is_main() else {}
    if record and vae_note:
        record["vae_differs_from_shards"] = vae_note
    store = PartStore(parts_dir_for(cfg.npz, cfg.out), record.get("fingerprint", {}), cfg.total)
    state = dist.on_rank0(lambda: _prepare(cfg, store, record, log))
    if state == "complete":
        log.info("%s: already complete (same checkpoint and settings); nothing to do", cfg.npz or cfg.out)
        return SampleResult(cfg.total, 0, cfg.total, image_size, time.perf_counter() - start,
                            Path(cfg.npz) if cfg.npz else None, _grid_path(cfg))
    done = set(state)
    remaining = [i for i in range(cfg.total) if i not in done]
    g = proto.guidance
    log.info("sampling %d of %d images (%d already done) at %dx%d on %d process(es), %s %d steps, %s %s%s%s",
             len(remaining), cfg.total, len(done), image_size, image_size, dist.world_size(), cfg.sampler,
             cfg.steps, "guidance" if g.rule == "cfg" else g.rule, g.scale, "" if g.interval is None else
             f" where the noise level is in {g.ends[0]}{g.interval[0]}, {g.interval[1]}{g.ends[1]}",
             "" if cfg.protocol is None else f" (--protocol {proto.name}, {proto.release})")
    sampling_start = time.perf_counter()
    with pinned_threads(device, cfg.cpu_threads):  # the pixels must not depend on OMP_NUM_THREADS or torchrun
        produced = _sample_batches(cfg, loaded, vae, store, labels, remaining, norm, proto, guide, conds)
    with dist.peer_guard("waiting for every rank's samples"):
        dist.barrier()
    sampling = time.perf_counter() - sampling_start
    result = SampleResult(cfg.total, produced, len(done), image_size, 0.0)
    if dist.is_main():
        log.info("sampled %d images in %.1f s: %.3g images/s over %d process(es)", len(remaining), sampling,
                 len(remaining) / max(sampling, 1e-9), dist.world_size())
        result.npz, result.grid = _finish(cfg, store, labels, record, log, conds)
    result.seconds = time.perf_counter() - start
    return result


def _with_vae(cfg: SampleConfig, loaded: LoadedModel, log: Any) -> SampleConfig:
    """`cfg` with --vae filled in when not given: the VAE the checkpoint records (the one its shards were
    extracted with) when there is a record, else the SD-VAE the official checkpoints use."""
    if cfg.vae:
        return cfg
    encoder = (loaded.latent or {}).get("encoder")
    if encoder:  # a feature space: only a decoder makes pixels; the one the run's grids and FID used, if recorded
        run = loaded.info.get("config") or {}
        if not run.get("vae"):
            raise UserError(f"--ckpt {cfg.ckpt} was trained on the features of {encoder.get('model')} (a feature "
                            "space), which only a decoder turns into pixels, and its run records none; pass "
                            "--decoder (RAE's decoder: FILE or FILE,config.json)")
        log.info("--decoder not given: using %s, the decoder the run's grids and FID used (its config.json)",
                 run["vae"])
        return dataclasses.replace(cfg, vae=str(run["vae"]), vae_config=cfg.vae_config or run.get("vae_config"))
    recorded = (loaded.latent or {}).get("vae") or {}
    found = recorded_vae(recorded, f"--ckpt {cfg.ckpt}", base=manifest_folder(loaded.info))
    vae, vae_config = found if found else (DEFAULT_VAE, cfg.vae_config)
    typed = f", given as {recorded['source_given']}" if found and recorded.get("source_given") else ""
    log.info("--vae not given: using %s (%s)", vae, f"recorded in the checkpoint{typed}" if found else "the default")
    return dataclasses.replace(cfg, vae=vae, vae_config=cfg.vae_config or vae_config)


def compare_vae(used: dict[str, Any], shards: dict[str, Any] | None) -> str | None:
    """The VAE that decodes against the one the shards were extracted with (the checkpoint's record): their weights'
    sha256 (a file or folder), else hub id and commit. A warning line when they differ (decoding with another
    decoder of the same encoder, e.g. sd-vae-ft-mse for ft-ema latents, is allowed, so it is said, not refused);
    None when they agree or the checkpoint records none."""
    if not shards:
        return None
    a, b = used.get("weights_sha256"), shards.get("weights_sha256")
    if a and b:
        same, what = a == b, f"sha256 {str(a)[:12]}... where the shards' VAE has {str(b)[:12]}..."
    elif used.get("commit") and shards.get("commit"):
        same, what = used["commit"] == shards["commit"], f"commit {used['commit']} where the shards' has {shards['commit']}"
    else:
        return None  # nothing comparable recorded (a hub id without a commit on either side)
    if same:
        return None
    return (f"the VAE decoding these samples is not the one the shards were extracted with ({what}; the shards': "
            f"{shards.get('source_given') or shards.get('source')}): the model's latents are decoded by another VAE")


def _with_time_shift(cfg: SampleConfig, loaded: LoadedModel, log: Any) -> SampleConfig:
    """`cfg` with --time-shift filled in when not given: the flow model's recorded training shift (our
    checkpoints, sidecars and exports record it; dit/shift.py), else 1; said in the log when it shifts."""
    recorded = float(loaded.info.get("time_shift") or 1.0)
    shift = recorded if cfg.time_shift is None else float(cfg.time_shift)
    if shift != 1.0:
        why = "--time-shift" if cfg.time_shift is not None else "as the checkpoint records it"
        log.info("time grid shifted %s by %.4g (%s; the model was trained with %.4g)", dit.shift.direction(shift), shift,
                 why, recorded)
    return dataclasses.replace(cfg, time_shift=shift)


def _with_cfg_channels(cfg: SampleConfig, loaded: LoadedModel, log: Any) -> SampleConfig:
    """`cfg` with --cfg-channels resolved to the value used ("3", "all" or "N"; auto: the protocol's, else the
    model's rule, sample.generate.cfg_channels_for), which the outputs record."""
    setting = str(cfg.cfg_channels)
    if cfg.guidance_model:  # AutoGuidance: v_weak + s (v - v_weak) on every channel (sample.generate.guided_model_fn)
        if setting not in ("auto", "all"):
            raise UserError(f"--cfg-channels {setting}: AutoGuidance (--guidance-model) guides every latent channel; "
                            "drop --cfg-channels")
        return dataclasses.replace(cfg, cfg_channels="all")
    if cfg.protocol is not None and setting == "auto":
        setting = protocols.protocol(cfg.protocol).guidance.channels
    try:
        used = resolve_cfg_channels(setting, loaded.config, loaded.info["objective"],
                                    loaded.info.get("flow_convention", "sit"), loaded.info.get("release"))
    except ValueError as e:
        raise UserError(str(e)) from None
    if str(cfg.cfg_channels) == "auto" and cfg.guided and cfg.protocol is None:
        log.info("--cfg-channels auto: guiding %s of the %s latent channels", "the first 3" if used == "3" else used,
                 loaded.config["in_channels"])
    return dataclasses.replace(cfg, cfg_channels=used)


def _with_cfg_scale(cfg: SampleConfig, loaded: LoadedModel, log: Any) -> SampleConfig:
    """`cfg` with --cfg-scale resolved (sample.config.resolve_cfg_scale): given, else the protocol's, else
    DEFAULT_CFG_SCALE, where guidance acts, else 1. A setting that would do nothing on this model or protocol
    (guidance on a MeanFlow model, one without a null class, or under a protocol without guidance; a guidance
    interval or guided channels where nothing is guided) is refused with the reason, never recorded and ignored."""
    conditions = str(loaded.config.get("conditions", "t"))
    unconditional = loaded.model.condition_kind == "none"  # no null condition, whatever its recorded dropout
    # AutoGuidance (--guidance-model) guides with a weaker network, not the null class
    has_null = (float(loaded.config.get("class_dropout_prob", 0.1)) > 0 and not unconditional) \
        or bool(cfg.guidance_model)
    inert = guidance_inert(conditions, has_null, cfg.protocol, unconditional=unconditional)
    default = protocols.protocol(cfg.protocol).guidance.scale if cfg.protocol is not None else DEFAULT_CFG_SCALE
    try:
        scale = resolve_cfg_scale(cfg.cfg_scale, default, inert, "--cfg-scale")
    except ValueError as e:
        raise UserError(str(e)) from None
    if cfg.guidance_model and (inert or not scale > 1.0):  # issue 47: loaded, recorded and equal to no guidance
        why = inert or (f"AutoGuidance at scale {scale:g} is the model alone (v_weak + 1 (v - v_weak) = v)")
        raise UserError(f"--guidance-model {cfg.guidance_model} does nothing here: {why}; drop --guidance-model"
                        + ("" if inert else " or pass --cfg-scale > 1"))
    problems = []
    if inert and cfg.guidance_interval is not None:
        other = ", or drop --protocol to choose every setting" if inert.startswith("--protocol") else ""
        problems.append(f"--guidance-interval {cfg.guidance_interval[0]:g} {cfg.guidance_interval[1]:g} does nothing "
                        f"here: {inert}; drop it{other}")
    channels = cfg_channels_inert(cfg.cfg_channels, scale, conditions)
    if channels:
        problems.append(channels)
    if problems:
        raise UserError("; ".join(problems))
    if cfg.cfg_scale is None and inert and default != 1.0:
        log.info("--cfg-scale not given: 1 (no guidance): %s", inert)
    return dataclasses.replace(cfg, cfg_scale=scale)


def _with_sampler(cfg: SampleConfig, objective: str) -> tuple[SampleConfig, str | None]:
    """`cfg` with --sampler and --steps filled in when not given (recorded as if given): the protocol's
    (dit/protocols.py), else the defaults for the model's objective (a flow checkpoint samples with SiT's SDE, a
    one-step model in one step); and the line that says so. --cfg-scale: `_with_cfg_scale`."""
    if cfg.protocol is not None:
        p = protocols.protocol(cfg.protocol)
        if p.solver not in SPECS[objective].samplers:
            raise UserError(f"--protocol {p.name} samples with {p.solver}, which does not sample a {objective} model "
                            f"({cfg.ckpt}); choose a protocol of a {objective} release, or pass --objective if the "
                            "file's objective was guessed wrong")
        steps = cfg.steps if cfg.steps is not None else p.count
        cfg = dataclasses.replace(cfg, sampler=p.solver, steps=steps)
        return cfg, (f"--protocol {p.name}: {p.release}'s sampler ({p.solver}, {steps} steps as its num_steps counts "
                     f"them, guidance rule {p.guidance.rule}, images by its '{p.conversion}' conversion; read "
                     f"from {p.sources[0].split(' ')[0]})")
    notes = []
    if cfg.steps is None:
        cfg = dataclasses.replace(cfg, steps=DEFAULT_STEPS[objective])
        notes.append(f"--steps not given: {cfg.steps}, the default for {objective} models")
    if cfg.sampler is None:
        cfg = dataclasses.replace(cfg, sampler=DEFAULT_SAMPLERS[objective])
        notes.insert(0, f"--sampler not given: {cfg.sampler}, the default for {objective} models ({cfg.steps} steps)")
    return cfg, "; ".join(notes) or None


def _check_fit(cfg: SampleConfig, loaded: LoadedModel, vae_id: dict[str, Any]) -> None:
    """--protocol's row must apply to the model (dit/protocol_fit.py: space, conditioning, objective, prediction,
    latent shape); else refused, naming the rows that fit it."""
    if cfg.protocol is None:
        return
    space = "pixels" if vae_id.get("kind") == "pixels" else "latent"
    traits = model_traits(loaded.config, loaded.info["objective"], loaded.info.get("prediction"), space,
                          prediction_known=prediction_known(loaded))
    problem = protocols.fit_problem(protocols.protocol(cfg.protocol), traits)
    if problem:
        raise UserError(f"{problem} ({cfg.ckpt})")


def _protocol(cfg: SampleConfig, loaded: LoadedModel) -> Protocol:
    """The protocol the samplers read: --protocol's row with the values --steps, --cfg-scale, --guidance-interval,
    --time-shift and --labels changed, or `custom`, the one the sampler flags describe."""
    assert cfg.steps is not None and cfg.cfg_scale is not None and cfg.sampler is not None
    labels = None if cfg.class_labels else cfg.labels
    if cfg.protocol is not None:
        proto = protocols.protocol(cfg.protocol).with_overrides(count=cfg.steps, scale=cfg.cfg_scale,
                                                                interval=cfg.guidance_interval, labels=labels,
                                                                shift=cfg.time_shift)
    else:
        proto = protocols.custom(solver=cfg.sampler, steps=cfg.steps, scale=cfg.cfg_scale,
                                 interval=cfg.guidance_interval, channels=str(cfg.cfg_channels),
                                 last_step_size=cfg.last_step_size, diffusion_form=cfg.diffusion_form,
                                 diffusion_norm=cfg.diffusion_norm, time_shift=float(cfg.time_shift or 1.0),
                                 labels=labels or "uniform",
                                 guide_model=Path(cfg.guidance_model).name if cfg.guidance_model else None)
    return _internal_guidance(cfg, proto, loaded)


def _internal_guidance(cfg: SampleConfig, proto: Protocol, loaded: LoadedModel) -> Protocol:
    """The protocol with --ig-scale / --ig-interval / --ig-uncond-scale (NanoGen's internal guidance) in place of its
    own; UserError where it is on and the model has no base head to guide from."""
    from dit_pipeline.dit.internal_guidance import InternalGuidance, as_internal, with_internal

    if cfg.ig_scale is not None or cfg.ig_uncond_scale is not None:
        own = as_internal(proto.guidance.internal)
        proto = with_internal(proto, InternalGuidance(
            float(cfg.ig_scale if cfg.ig_scale is not None else (own.scale if own else 1.0)),
            tuple(cfg.ig_interval) if cfg.ig_interval else (own.interval if own else (0.0, 1.0)),  # type: ignore
            cfg.ig_uncond_scale))
    ig = as_internal(proto.guidance.internal)
    if ig is not None and ig.active and not loaded.config.get("base_model_depth"):
        flag = "--ig-scale" if cfg.ig_scale is not None else f"--protocol {cfg.protocol}"
        raise UserError(f"internal guidance ({flag}) extrapolates from the model's base head; {cfg.ckpt} has none "
                        "(train one with dit-train --base-model-depth K)")
    return proto


def _guidance_model(cfg: SampleConfig, loaded: LoadedModel, device: torch.device, log: Any) -> LoadedModel | None:
    """AutoGuidance's weaker network (--guidance-model): loaded as --ckpt is, and refused unless it takes the same
    latents and classes in the same time convention."""
    if not cfg.guidance_model:
        return None
    guide = load_model(cfg.guidance_model, weights=cfg.weights, device=device)
    a, b = loaded.config, guide.config
    wrong = [f"{k} {b[k]} (the model: {a[k]})" for k in ("in_channels", "input_size", "num_classes") if a[k] != b[k]]
    objective = resolve_objective(guide.info, cfg.guidance_model, cfg.objective)
    if objective != loaded.info["objective"]:
        wrong.append(f"objective {objective} (the model: {loaded.info['objective']})")
    elif objective == "flow":
        convention = resolve_flow_convention(guide.info, cfg.guidance_model, cfg.flow_convention)
        if convention != loaded.info.get("flow_convention", "sit"):
            wrong.append(f"{convention}'s time convention (the model: {loaded.info.get('flow_convention')}'s)")
    if wrong:
        raise UserError(f"--guidance-model {cfg.guidance_model}: {'; '.join(wrong)}; AutoGuidance needs a weaker "
                        "network of the same latents, classes and time convention")
    log.info("guidance model (AutoGuidance): %s", guide.describe())
    return guide


def label_sampling(cfg: SampleConfig) -> str:
    """How the run's classes were chosen: "given" (--class-labels), "uniform" or "equal" (--labels, or the
    protocol's)."""
    return "given" if cfg.class_labels else (cfg.labels or "uniform")


def _check_compatible(cfg: SampleConfig, loaded: LoadedModel, vae_id: dict[str, Any], vae: Any = None) -> None:
    c, objective = loaded.config, loaded.info["objective"]
    if cfg.sampler not in SPECS[objective].samplers:  # each objective's samplers (dit/objectives.py)
        want = SPECS[objective].samplers
        raise UserError(f"--sampler {cfg.sampler}: {cfg.ckpt} is a {objective} model; pass --sampler "
                        f"{' or '.join(want)} (or --objective if the file's objective was guessed wrong: a "
                        "file without a record is ddpm unless its name starts with SiT-)")
    if int(vae_id["latent_channels"]) != int(c["in_channels"]):
        raise UserError(f"--vae {cfg.vae!r} has {vae_id['latent_channels']} latent channels but the model takes "
                        f"{c['in_channels']}; pass the VAE the model was trained with")
    fit_decoder(vae, vae_id, loaded.latent, int(c["input_size"]), f"--vae {cfg.vae!r}")
    cfg_rule = cfg.protocol is None or protocols.protocol(cfg.protocol).guidance.rule == "cfg"
    if cfg.guided and cfg_rule and not cfg.guidance_model and not float(c["class_dropout_prob"]) > 0:
        raise UserError(f"--cfg-scale {cfg.cfg_scale}: the model has no null class (trained without class "
                        "dropout), so classifier-free guidance is impossible; pass --cfg-scale 1")


def _record(cfg: SampleConfig, loaded: LoadedModel, vae_id: dict[str, Any], norm: LatentNorm,
            labels: np.ndarray, image_size: int, device: torch.device, proto: Protocol,
            guide: LoadedModel | None = None, conds: Sampling | None = None) -> dict[str, Any]:
    """What the outputs record: the fingerprint (what the samples are) and context.

    `numerics` (batch size, CPU threads, device) change only the last float bits, so they stay out of
    the fingerprint: a resume with another batch size keeps the finished parts (common/determinism.py)."""
    vae_key = ({"weights_sha256": vae_id["weights_sha256"]} if vae_id.get("weights_sha256")
               else {k: vae_id.get(k) for k in ("source", "revision", "commit")})
    fingerprint = {
        "format": RECORD_FORMAT, "version": 1,
        "checkpoint_sha256": sha256_file(Path(cfg.ckpt).expanduser()), "weights": loaded.info["weights"],
        "model_config": loaded.config, "vae": vae_key, "scaling_factor": norm.scaling_factor,
        "shift_factor": norm.shift_factor, **_normalization_key(norm),
        "objective": loaded.info["objective"], "sampler": cfg.sampler, "steps": cfg.steps,
        **_sde_settings(cfg), **_optional_settings(cfg, loaded), "cfg_scale": cfg.cfg_scale,
        "cfg_channels": cfg.cfg_channels,
        "seed": cfg.seed, "num_samples": cfg.total, "image_size": image_size, **_label_settings(cfg),
        "labels_sha256": hashlib.sha256(np.ascontiguousarray(labels, dtype="<i8").tobytes()).hexdigest(),
        "precision": cfg.precision, "tf32": cfg.tf32, "compile": cfg.compile,
        **({"protocol": proto.name} if cfg.protocol is not None else {}),
        **({"guidance_model_sha256": sha256_file(Path(cfg.guidance_model).expanduser())} if guide is not None else {}),
        **(conds.fingerprint() if conds is not None else {}),
    }
    numerics = {"batch_size": cfg.batch_size, "cpu_threads": cfg.cpu_threads if device.type == "cpu" else None,
                "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    return {"fingerprint": json.loads(json.dumps(fingerprint)), "numerics": numerics, "config": cfg.to_dict(),
            "checkpoint": {"path": str(cfg.ckpt), "source": loaded.info["source"], "step": loaded.info.get("step")},
            "vae": vae_id, "label_sampling": label_sampling(cfg), "labels": labels.tolist(),
            "class_names": (loaded.latent or {}).get("class_names"), **(conds.record() if conds is not None else {}),
            "protocol": proto.record(_latent_shape(loaded), loaded.info.get("time_shift")),
            **({"settings_from": dict(loaded.info["settings_from"])} if loaded.info.get("settings_from") else {}),
            **({"guidance_model": {"path": str(cfg.guidance_model), "source": guide.info["source"],
                                   "model_config": guide.config}} if guide is not None else {})}


def _latent_shape(loaded: LoadedModel) -> tuple[int, int, int]:
    c = loaded.config
    return int(c["in_channels"]), int(c["input_size"]), int(c["input_size"])


def _normalization_key(norm: LatentNorm) -> dict[str, Any]:
    """A per-channel normalization's numbers in the fingerprint (where they came from does not change a pixel);
    nothing for a scalar one, whose factors are there already, so earlier fingerprints stay valid."""
    if norm.per_channel is None:
        return {}
    return {"normalization": {k: v for k, v in norm.per_channel.items() if k != "source"}}


def _label_settings(cfg: SampleConfig) -> dict[str, Any]:
    """Equal-label sampling in the fingerprint; nothing for uniform or given classes, so the fingerprints of
    earlier runs (and their finished parts) stay valid (labels_sha256 pins the classes either way)."""
    return {"label_sampling": "equal"} if label_sampling(cfg) == "equal" else {}


def _sde_settings(cfg: SampleConfig) -> dict[str, Any]:
    """The SDE sampler's settings (they determine its pixels); nothing for the other samplers."""
    if cfg.sampler != "euler-maruyama":
        return {}
    return {"diffusion_form": cfg.diffusion_form, "diffusion_norm": cfg.diffusion_norm,
            "last_step_size": cfg.last_step_size}


def _optional_settings(cfg: SampleConfig, loaded: LoadedModel) -> dict[str, Any]:
    """Fingerprint keys added later, present only where they apply, so the fingerprints of other runs are
    unchanged: `sde_steps` (the SDE counts SiT's num_steps; runs recorded before took one step more and must
    neither resume nor count as complete), the guidance interval, REPA's time convention, a flow time shift."""
    out: dict[str, Any] = {"sde_steps": "sit-num-steps"} if cfg.sampler == "euler-maruyama" else {}
    if cfg.guidance_interval is not None:
        out["guidance_interval"] = [float(v) for v in cfg.guidance_interval]
    if loaded.info.get("flow_convention") == "repa" and loaded.info["objective"] == "flow":
        out["flow_convention"] = "repa"
    if cfg.sampler in FLOW_SAMPLERS and cfg.time_shift not in (None, 1.0):
        out["time_shift"] = float(cfg.time_shift)  # type: ignore[arg-type]
    elif cfg.protocol is not None and cfg.time_shift is not None:  # replaces the protocol's shift, 1 included
        out["time_shift"] = float(cfg.time_shift)
    if cfg.encoder_refresh > 1:
        out["encoder_refresh"] = cfg.encoder_refresh
    if cfg.ig_scale is not None or cfg.ig_uncond_scale is not None:  # internal guidance decides the pixels
        out["internal_guidance"] = {"scale": cfg.ig_scale, "interval": cfg.ig_interval,
                                    "uncond_scale": cfg.ig_uncond_scale}
    if cfg.sampler in FLOW_SAMPLERS and loaded.info.get("prediction") is not None:
        out["prediction"] = loaded.info["prediction"]  # x-prediction: the conversion decides the pixels
    return out


def _record_paths(cfg: SampleConfig) -> list[Path]:
    paths = [Path(str(cfg.npz) + ".json")] if cfg.npz else []
    return paths + ([Path(cfg.out) / "samples.json"] if cfg.out else [])


def _grid_path(cfg: SampleConfig) -> Path | None:
    return Path(cfg.out) / "grid.png" if cfg.out and cfg.grid_max > 0 else None


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _read_fingerprint(path: Path) -> dict[str, Any] | None:
    data = _read_json(path)
    return data.get("fingerprint") if isinstance(data, dict) else None


def _interrupted_npz(npz_record: Path, store: PartStore) -> bool:
    """An npz without its record, beside the parts of this very run, was written by this run before it was
    interrupted (the record is written after the npz): it is rewritten from the parts, not foreign."""
    return not npz_record.exists() and _read_json(store.folder / RUN_FILE) == store.fingerprint


def _prepare(cfg: SampleConfig, store: PartStore, record: dict[str, Any], log) -> str | list[int]:
    """Rank 0: "complete" if this exact run already finished, else open the parts; the finished indices.

    Outputs of a different run (another checkpoint or other settings, or of unknown origin) are never
    replaced without --overwrite.
    """
    fp = record["fingerprint"]
    records = _record_paths(cfg)
    same = [_read_fingerprint(p) == fp for p in records]
    finals = [p for p in (Path(cfg.npz) if cfg.npz else None, _grid_path(cfg)) if p is not None]
    if all(same) and all(p.is_file() for p in finals) and not store.folder.exists():
        return "complete"
    foreign = [str(p) for p, ok in zip(records, same) if p.exists() and not ok]
    if cfg.npz and Path(cfg.npz).exists() and not same[0] and not _interrupted_npz(records[0], store):
        foreign.insert(0, str(cfg.npz))
    if foreign and not cfg.overwrite:
        changed = describe_changes(next((_read_fingerprint(p) for p in records if p.exists() and
                                         _read_fingerprint(p) != fp), None), fp)
        raise UserError(f"{', '.join(foreign)} already exist(s) and were not made by this checkpoint with these "
                        f"settings (changed: {changed}); choose another output or pass --overwrite to replace them")
    return store.open(overwrite=cfg.overwrite, log=log)


def _sample_batches(cfg: SampleConfig, loaded: LoadedModel, vae, store: PartStore, labels: np.ndarray,
                     remaining: list[int], norm: LatentNorm, proto: Protocol,
                     guide: LoadedModel | None = None, conds: Sampling | None = None) -> int:
    """This rank's share of the missing samples, one part file per batch; returns images produced. The loop and
    the guided network function are the protocol's (sample.generate.protocol_loop, protocol_model_fn)."""
    from tqdm.auto import tqdm

    model: Any = loaded.model
    if cfg.encoder_refresh > 1:  # DDT's encoder sharing across neighbouring steps (dit/reuse.py)
        model = dit.reuse.EncoderReuse(model, cfg.encoder_refresh)
    convention = loaded.info.get("flow_convention", "sit")
    diffusion = protocol_loop(proto, latent_shape=_latent_shape(loaded), recorded_shift=cfg.time_shift
                              if cfg.protocol is None else loaded.info.get("time_shift"), convention=convention,
                              learn_sigma=bool(loaded.config["learn_sigma"]), prediction=loaded.info.get("prediction"))
    try:
        model_fn = protocol_model_fn(proto, model, objective=loaded.info["objective"], convention=convention,
                                     in_channels=int(loaded.config["in_channels"]),
                                     autocast_dtype=AUTOCAST_DTYPES[cfg.precision], compile=cfg.compile,
                                     guide_model=guide.model if guide is not None else None,
                                     doubled=cfg.encoder_refresh > 1,  # a reused state belongs to the doubled batch
                                     conditioning=conds.conditioning(loaded.model) if conds is not None else None)
    except ValueError as e:
        raise UserError(str(e)) from None
    batches = plan.rank_batches(remaining, cfg.batch_size, dist.rank(), dist.world_size())
    ws = dist.world_size()
    produced = 0
    # Rank 0's bar stands for all ranks (they run in lockstep), so its rate reads as total images/s.
    with tqdm(total=len(remaining), unit="img", desc="sampling", disable=not progress_enabled(cfg.quiet),
              dynamic_ncols=True) as bar:
        for batch in batches:
            if isinstance(model, dit.reuse.EncoderReuse):
                model.reset()  # a state belongs to one batch of samples
            images = generate_images(model, vae, diffusion, indices=batch, labels=labels[batch].tolist(),
                                     seed=cfg.seed, norm=norm, sampler=cfg.sampler, cfg_scale=proto.guidance.scale,
                                     model_fn=model_fn, conversion=proto.conversion,
                                     condition=conds.condition(batch) if conds is not None else None).numpy()
            try:
                if cfg.save_images:
                    _write_pngs(Path(cfg.out) / "images", batch, images, cfg.total)
                fault_point("sample.part_write")
                store.write(batch, labels[batch], images)  # the commit point of this batch
            except OSError as e:
                raise UserError(f"cannot write the samples of indices {batch[0]}..{batch[-1]} under {store.folder} "
                                f"({e}); free space or fix the folder, then rerun the same command: the "
                                f"{produced} images finished here are kept") from e
            fault_point("sample.part_written")
            produced += len(batch)
            bar.update(min(len(batch) * ws, bar.total - bar.n))
    return produced


def _write_pngs(folder: Path, indices: list[int], images: np.ndarray, total: int) -> None:
    width = max(6, len(str(total - 1)))
    for i, img in zip(indices, images):
        atomic_write_bytes(folder / f"{i:0{width}d}.png", png_bytes(img))


@contextlib.contextmanager
def _writing(path: Path, store: PartStore) -> Iterator[None]:
    """A failed output write (disk full, quota, I/O error) is one clear error; outputs are written atomically
    and the parts are removed only after all of them, so every finished sample is kept for the rerun."""
    try:
        yield
    except OSError as e:
        raise UserError(f"cannot write {path} ({e.strerror or e}); all {store.total} samples are finished and kept "
                        f"in {store.folder}. Free space (or fix the folder) and rerun the same command to write "
                        "the outputs.") from None


def _finish(cfg: SampleConfig, store: PartStore, labels: np.ndarray, record: dict[str, Any],
            log, conds: Sampling) -> tuple[Path | None, Path | None]:
    """Rank 0 after every rank finished: npz, grid, run records; then the parts go."""
    npz_path = grid_path = None
    if cfg.npz:
        npz_path = Path(cfg.npz)
        with _writing(npz_path, store):
            n, h, w = assemble_npz(store, npz_path, labels)
        log.info("wrote %s: arr_0 uint8 [%d, %d, %d, 3], arr_1 labels [%d]", npz_path, n, h, w, n)
        fault_point("sample.npz_written")  # the npz is in place, its record and the grid not yet
    grid_path = _grid_path(cfg)
    if grid_path is not None:
        k = min(cfg.total, cfg.grid_max)
        pairs = list(store.iter_images(range(k)))
        with _writing(grid_path, store):
            save_grid(np.stack([p[0] for p in pairs]), grid_path, ncol=cfg.grid_cols,
                      labels=conds.grid_labels([p[1] for p in pairs]))
        log.info("wrote %s (%d samples)", grid_path, k)
    for path in _record_paths(cfg):
        with _writing(path, store):
            atomic_write_json(path, record)
    store.remove()
    return npz_path, grid_path
