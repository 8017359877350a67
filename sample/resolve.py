"""The settings `dit-sample` decides once the checkpoint is read, and the checks that they fit the model.

Each `with_*` returns the config with one setting filled in or resolved (recorded as if given): the VAE (the one
the checkpoint records, else the default), the sampler and steps (the protocol's, else the objective's
defaults), the guidance scale and guided channels (refused where they would do nothing), the flow time convention
and shift. `sampling_protocol` is the protocol the samplers read (--protocol's row with the flags' changes, or the
one the flags describe, with internal guidance); `load_guidance_model` is AutoGuidance's weaker network;
`check_fit` and `check_compatible` refuse a model that the protocol, sampler or VAE does not fit.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from dit_pipeline import dit
from dit_pipeline.common.errors import UserError
from dit_pipeline.common.rae_decoder import fit_decoder
from dit_pipeline.common.vae import DEFAULT_VAE
from dit_pipeline.common.vae_identity import recorded_vae
from dit_pipeline.dit import protocols
from dit_pipeline.dit.protocol_fit import model_traits
from dit_pipeline.sample.config import DEFAULT_CFG_SCALE, DEFAULT_SAMPLERS, DEFAULT_STEPS, SPECS, SampleConfig
from dit_pipeline.sample.facts import prediction_known
from dit_pipeline.sample.generate import resolve_cfg_channels
from dit_pipeline.sample.guidance import cfg_channels_inert, guidance_inert, resolve_cfg_scale
from dit_pipeline.sample.load import (LoadedModel, load_model, manifest_folder, resolve_flow_convention,
                                      resolve_objective)


def with_vae(cfg: SampleConfig, loaded: LoadedModel, log: Any) -> SampleConfig:
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


def with_time_shift(cfg: SampleConfig, loaded: LoadedModel, log: Any) -> SampleConfig:
    """`cfg` with --time-shift filled in when not given: the flow model's recorded training shift (our
    checkpoints, sidecars and exports record it; dit/shift.py), else 1; said in the log when it shifts."""
    recorded = float(loaded.info.get("time_shift") or 1.0)
    shift = recorded if cfg.time_shift is None else float(cfg.time_shift)
    if shift != 1.0:
        why = "--time-shift" if cfg.time_shift is not None else "as the checkpoint records it"
        log.info("time grid shifted %s by %.4g (%s; the model was trained with %.4g)", dit.shift.direction(shift), shift,
                 why, recorded)
    return dataclasses.replace(cfg, time_shift=shift)


def with_flow_settings(cfg: SampleConfig, loaded: LoadedModel, log: Any) -> SampleConfig:
    """A flow model's time convention (into `loaded.info`, said in the log when it is REPA's) and, without
    --protocol (whose grid has its own shift), its time shift (`with_time_shift`); `cfg` unchanged otherwise."""
    if loaded.info["objective"] != "flow":
        return cfg
    loaded.info["flow_convention"] = resolve_flow_convention(loaded.info, cfg.ckpt, cfg.flow_convention)
    if loaded.info["flow_convention"] == "repa":
        log.info("flow model in REPA's time (t = 1 noise; %s): called at 1 - t, its output negated",
                 loaded.info.get("flow_convention_from") if cfg.flow_convention is None else "--flow-convention")
    if cfg.protocol is None:  # a protocol's grid has its own shift
        cfg = with_time_shift(cfg, loaded, log)
    return cfg


def with_cfg_channels(cfg: SampleConfig, loaded: LoadedModel, log: Any) -> SampleConfig:
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


def with_cfg_scale(cfg: SampleConfig, loaded: LoadedModel, log: Any) -> SampleConfig:
    """`cfg` with --cfg-scale resolved (sample.guidance.resolve_cfg_scale): given, else the protocol's, else
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


def with_sampler(cfg: SampleConfig, objective: str) -> tuple[SampleConfig, str | None]:
    """`cfg` with --sampler and --steps filled in when not given (recorded as if given): the protocol's
    (dit/protocols.py), else the defaults for the model's objective (a flow checkpoint samples with SiT's SDE, a
    one-step model in one step); and the line that says so. --cfg-scale: `with_cfg_scale`."""
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


def check_fit(cfg: SampleConfig, loaded: LoadedModel, vae_id: dict[str, Any]) -> None:
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


def sampling_protocol(cfg: SampleConfig, loaded: LoadedModel) -> protocols.Protocol:
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


def _internal_guidance(cfg: SampleConfig, proto: protocols.Protocol, loaded: LoadedModel) -> protocols.Protocol:
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


def load_guidance_model(cfg: SampleConfig, loaded: LoadedModel, device: torch.device,
                        log: Any) -> LoadedModel | None:
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


def check_compatible(cfg: SampleConfig, loaded: LoadedModel, vae_id: dict[str, Any], vae: Any = None) -> None:
    """The sampler samples the model's objective, the VAE decodes its latents, guidance has a null class to guide
    against, and --encoder-refresh has an encoder state to reuse; else refused with the fix."""
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
    if cfg.encoder_refresh > 1 and not dit.reuse.can_reuse_encoder(loaded.model):
        raise UserError(f"--encoder-refresh {cfg.encoder_refresh}: {loaded.config['model'] or 'this model'} has no "
                        "encoder/decoder split whose state could be reused (DDT has); drop --encoder-refresh")
