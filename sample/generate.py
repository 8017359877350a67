"""The sampling core shared by `dit-sample` and the trainer's periodic grids.

Follows the reference DiT sampler (docs/REFERENCE.md): classifier-free guidance as [cond; uncond] through
`forward_with_cfg` (first 3 latent channels guided by default), IDDPM respacing, `clip_denoised=False`,
decode with the VAE after inverting the latent normalization (dividing by its scaling factor for the SD-VAE;
common/latent_norm.py for the others), and pixels to uint8 as
`clamp(127.5 * x + 128, 0, 255)` truncated, as the reference's FID sampling script does.

One difference in bookkeeping, not in results: the reference carries both CFG halves through the sampler
and discards the second at the end. Here the diffusion loop holds only the conditional half and the model
function doubles it for the network call, which is the same computation for every kept sample and lets
each sample's noise come from its own generator (seed, index) alone.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

from dit_pipeline import dit
from dit_pipeline.common.latent_norm import LatentNorm
from dit_pipeline.dit import image_conversions, protocol_types
from dit_pipeline.dit.conditioning import Conditioning
from dit_pipeline.dit.flow_predictions import T_EPS, prediction_from_record
from dit_pipeline.dit.flow_samplers import GRID_TIME_ATTR, LAST_STEP_SIZE
from dit_pipeline.dit.internal_guidance import InternalGuidance, as_internal, internal_combine
from dit_pipeline.dit.meanflow import MEANFLOW_SAMPLERS, MeanFlowLoop
from dit_pipeline.sample.config import respacing
from dit_pipeline.sample.plan import noise_generators



def cfg_channels_for(model_config: dict[str, Any], objective: str = "ddpm", flow_convention: str = "sit",
                     release: str | None = None) -> str:
    """The latent channels classifier-free guidance guides by default (--cfg-channels auto): "3" only where that
    reproduces a reference sampler, "all" otherwise. Guiding the first 3 channels is a quirk of DiT's sampler (and
    SiT's, a copy) for SD-VAE's 4 channels, and of LightningDiT's release sampler (upstream, on 32 channels); for any
    other model it would leave most of the latent unguided (issue #34). So: a 4-channel DiT-family model trained as
    DiT (ddpm) or SiT (flow in SiT's time), or a LightningDiT release file: "3"; REPA's files (REPA's time; its
    sampler guides every channel), every other family and every other channel count: "all"."""
    if release == "LightningDiT":
        return "3"
    if model_config.get("family", "DiT") == "DiT" and int(model_config["in_channels"]) == 4 and release is None \
            and (objective == "ddpm" or (objective == "flow" and flow_convention == "sit")):
        return "3"
    return "all"


def resolve_cfg_channels(setting: str | int, model_config: dict[str, Any], objective: str = "ddpm",
                         flow_convention: str = "sit", release: str | None = None) -> str:
    """--cfg-channels auto | all | N -> the value used ("3", "all", "N"); ValueError for N outside 1..channels."""
    setting = str(setting)
    if setting == "auto":
        return cfg_channels_for(model_config, objective, flow_convention, release)
    if setting == "all":
        return "all"
    channels = int(model_config["in_channels"])
    if not setting.isdigit() or not 1 <= int(setting) <= channels:
        raise ValueError(f"--cfg-channels {setting}: the model has {channels} latent channels; give auto, all or "
                         f"1..{channels}")
    return "all" if int(setting) == channels else str(int(setting))


def guide_channels_arg(cfg_channels: str | int) -> int | str:
    """--cfg-channels value -> forward_with_cfg's guide_channels (3 = the reference, "all")."""
    return "all" if str(cfg_channels) == "all" else int(cfg_channels)


def autocast(device: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def noise_level_fn(objective: str, flow_convention: str = "sit") -> Callable[[float], float]:
    """The network's time input -> its noise level in [0, 1] (1 = pure noise), the scale of --guidance-interval:
    DDPM timestep index / 1000; SiT-convention flow 1 - t; REPA-convention flow t itself."""
    if objective == "ddpm":
        return lambda t: t / 1000.0
    return (lambda t: t) if flow_convention == "repa" else (lambda t: 1.0 - t)


# --guidance-interval's ends are compared with the sampler's float64 grid time (never the network's float32 time:
# 0.8 in float32 is 0.80000001, whose noise level 1 - t falls below an end at 0.2), with a slack far below any grid's
# spacing for an end that falls on a grid time up to float64 rounding (dit.protocol_types.Guidance.applies).
INTERVAL_SLACK = protocol_types.INTERVAL_SLACK


def guided_model_fn(model: nn.Module, *, cfg_scale: float, cfg_channels: str | int = "3",
                    autocast_dtype: torch.dtype | None = None, compile: bool = False,
                    guidance_interval: Sequence[float] | None = None,
                    noise_level: Callable[[float], float] | None = None, ends: str = "[]", doubled: bool = False,
                    guide_model: nn.Module | None = None,
                    conditioning: Conditioning | None = None,
                    internal: InternalGuidance | None = None) -> Callable[..., Any]:
    """model_fn(x [B, C, S, S], t [B], y [B] or the condition's keyword arguments) -> float32 [B, Cout, S, S] for
    the diffusion loops.

    With cfg_scale > 1 each call runs the network on [x; x] with the conditions [given; null] (the null label, or a
    text model's empty prompt: `conditioning`, dit/conditioning.py, by default the model's own) and returns the
    guided conditional half; cfg_scale == 1 is the plain conditional model, as in the reference.
    guidance_interval (low, high) with noise_level (noise_level_fn): guided only where the noise level is in the
    interval, its `ends` open or closed ("[]", "()", "[)", "(]": dit/protocol_types.py; Kynkaanniemi et al. 2024;
    REPA's guidance_low/high, DDT's open (0.3, 1)), elsewhere one pass of the conditional model alone, or with
    `doubled` the conditional half of the doubled batch (the release runs it at every step: DDT's encoder state
    belongs to that batch).
    guide_model: AutoGuidance (Karras et al. 2024; RAE's _AG configs): v_weak + cfg_scale (v - v_weak) on every
    channel, one pass of each network (no null label).
    internal: NanoGen's internal guidance (dit/internal_guidance.py), alone or with classifier-free guidance; the
    network's base head gives the weaker prediction (needs noise_level).
    A REG model's class token comes as `cls_t` beside the condition and its prediction goes back beside the image's:
    (out, cls_pred), guided as NanoGen guides it (dit/reg.py).
    compile: torch.compile the network call (static shapes: the one shorter last batch recompiles once).
    """
    if getattr(model, "conditions", "t") != "t":
        cfg_scale = 1.0  # a mean-flow model: guidance is trained in (meanflow) or an input (imf, MeanFlowLoop)
    guide = "all" if guide_model is not None else guide_channels_arg(cfg_channels)
    cond = conditioning if conditioning is not None else model.conditioning()
    ig = internal if internal is not None and internal.active else None
    if (guidance_interval is not None or ig is not None) and noise_level is None:
        raise ValueError("guidance_interval and internal guidance need noise_level (the network's time -> noise level)")
    if ig is not None and (guide_model is not None or not getattr(model, "base_model_depth", 0)):
        raise ValueError("internal guidance needs a model with its base head (trained with --base-model-depth) and "
                         "no --guidance-model")
    rule = protocol_types.Guidance("autoguidance" if guide_model is not None else "cfg", float(cfg_scale),
                              None if guidance_interval is None else (float(guidance_interval[0]),
                                                                      float(guidance_interval[1])), ends)
    on = cfg_scale > 1.0
    # forward_with_cfg calls self.forward directly, so the bound method itself is what gets compiled.
    guided = model.forward_with_cfg if on and guide_model is None and ig is None else None
    plain = model if not on or guidance_interval is not None or guide_model is not None or doubled or ig else None
    weak = guide_model if on else None
    if compile:
        guided, plain, weak = (torch.compile(f, dynamic=False) if f is not None else None
                               for f in (guided, plain, weak))

    def use_guidance(t: torch.Tensor) -> bool:
        if not on:
            return False
        # the grid's own time, float64 (flow samplers: dit.flow_samplers.GRID_TIME_ATTR)
        return guidance_interval is None or rule.applies(noise_level(float(t[0])))  # type: ignore[misc]

    def model_fn(x: torch.Tensor, t: torch.Tensor, y: torch.Tensor | None = None, **condition: Any) -> Any:
        given = dict(condition if y is None else {"y": y, **condition})
        token = given.pop("cls_t", None)  # REG's class token: it travels with x, it is no condition
        one, two = ({}, {}) if token is None else ({"cls_t": token}, {"cls_t": torch.cat([token, token])})
        guide_here = use_guidance(t)
        ig_here = ig is not None and ig.applies(noise_level(float(t[0])))  # type: ignore[misc]
        if t.dtype == torch.float64:
            t = t.float()  # the network's time: float32, as the flow samplers always gave it
        n = x.shape[0]
        with autocast(x.device, autocast_dtype):
            if ig is not None:
                out = _internally_guided(plain, x, t, given, one, two, cond, ig, ig_here,  # type: ignore[arg-type]
                                         cfg_scale if on else None, guide_here)
            elif guide_here and weak is not None:
                if token is not None:
                    raise ValueError("AutoGuidance of a REG model is not supported (its class token has no weaker "
                                     "network's prediction)")
                main, low = plain(x, t, **given), weak(x, t, **given)
                c = int(model.in_channels)
                out = torch.cat([protocol_types.autoguidance_combine(main[:, :c], low[:, :c], cfg_scale),
                                 main[:, c:]], 1)
            elif guide_here:
                both = cond.concat(given, cond.null(given))  # [given; null]
                out = _rows(guided(torch.cat([x, x]), torch.cat([t, t]), cfg_scale=cfg_scale, guide_channels=guide,
                                   **both, **two), n)
            elif doubled and on and weak is None:
                out = _rows(plain(torch.cat([x, x]), torch.cat([t, t]), **cond.concat(given, cond.null(given)),
                                  **two), n)
            else:
                out = plain(x, t, **given, **one)
        # the diffusion math stays in float32 whatever the model ran in
        return tuple(o.float() for o in out) if isinstance(out, tuple) else out.float()

    setattr(model_fn, GRID_TIME_ATTR, True)
    return model_fn


def _rows(out: Any, n: int) -> Any:
    """The first n rows of an output or of each part of one (a REG model's (out, cls_pred))."""
    return tuple(o[:n] for o in out) if isinstance(out, tuple) else out[:n]


def _internally_guided(net: Callable[..., Any], x: torch.Tensor, t: torch.Tensor, given: dict[str, Any],
                       one: dict[str, Any], two: dict[str, Any], cond: Conditioning, ig: InternalGuidance,
                       ig_here: bool, cfg_scale: float | None, cfg_here: bool) -> Any:
    """NanoGen's internal guidance, alone (cfg_scale None: one conditional pass) or with classifier-free guidance
    (the doubled batch at every step); dit/internal_guidance.py states the rules."""
    if cfg_scale is None:
        full, base, *token = net(x, t, return_base=True, **given, **one)
        out = internal_combine(full, base, ig.scale) if ig_here else full
        return (out, token[0]) if token else out
    n = x.shape[0]
    full, base, *token = net(torch.cat([x, x]), torch.cat([t, t]), return_base=True,
                             **cond.concat(given, cond.null(given)), **two)
    (full_c, full_u), (base_c, base_u) = full.split(n), base.split(n)
    cond_out = internal_combine(full_c, base_c, ig.scale) if ig_here else full_c
    null_out = internal_combine(full_u, base_u, ig.null_scale) if ig_here else full_u
    out = protocol_types.cfg_combine(cond_out, null_out, cfg_scale) if cfg_here else cond_out
    if not token:
        return out
    c, u = token[0].split(n)
    return out, protocol_types.cfg_combine(c, u, cfg_scale) if cfg_here else c


def condition_kwargs(condition: torch.Tensor | Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model's condition keyword arguments: class labels [B] (y), or a mapping of them as the conditioning
    gives them (text and text_mask)."""
    return {"y": condition} if isinstance(condition, torch.Tensor) else dict(condition)


def initial_noise(generators: Sequence[torch.Generator], shape: tuple[int, ...],
                  device: torch.device) -> torch.Tensor:
    """[B, *shape] standard normal noise, row b drawn from generators[b] (on its own device)."""
    rows = [torch.randn(shape, generator=g, device=g.device, dtype=torch.float32) for g in generators]
    return torch.stack(rows).to(device)


@dataclass(frozen=True)
class FlowLoop:
    """A flow sampler bound to its settings (dit.flow): what `sample_latents` runs for a flow model."""

    sampler: str
    steps: int
    diffusion_form: str = "sigma"
    diffusion_norm: float = 1.0
    last_step_size: float = LAST_STEP_SIZE
    convention: str = "sit"  # the network's time convention (dit.flow_samplers; "repa" for REPA's checkpoints)
    time_shift: float = 1.0  # SD3's shift of the time grid toward noise (dit/shift.py)
    grid: tuple[float, ...] | None = None  # a protocol's times (dit/protocols.py), in place of the four above
    mean_last: bool = True  # euler-maruyama on `grid`: its last interval is the noise-free Mean step
    prediction: dict[str, Any] | None = None  # what the network predicts (dit.flow_predictions' record; None: velocity)

    def __call__(self, fn: Callable, noise: torch.Tensor, labels: torch.Tensor | Mapping[str, torch.Tensor],
                 generators: Sequence[torch.Generator]) -> torch.Tensor:
        pred = prediction_from_record(self.prediction)
        flow = dit.create_flow(prediction=pred.name, t_eps=pred.t_eps or T_EPS)
        return flow.sample_loop(fn, noise, sampler=self.sampler, steps=self.steps,
                                model_kwargs=condition_kwargs(labels),
                                generator=list(generators), diffusion_form=self.diffusion_form,
                                diffusion_norm=self.diffusion_norm, last_step_size=self.last_step_size,
                                convention=self.convention, time_shift=self.time_shift, grid=self.grid,
                                mean_last=self.mean_last)


def make_diffusion(sampler: str, steps: int, learn_sigma: bool = True, **flow_options):
    """The respaced DiT diffusion for a sampler: "ddpm" -> "N" sections, "ddim" -> "ddimN"; a FlowLoop for the
    flow samplers (euler, heun, euler-maruyama; `flow_options` are FlowLoop's SDE settings, convention and time
    shift); a MeanFlowLoop for "meanflow" (`flow_options`: iMF's guidance `interval`)."""
    if sampler in MEANFLOW_SAMPLERS:
        return MeanFlowLoop(steps, **flow_options)
    if sampler in dit.FLOW_SAMPLERS:
        return FlowLoop(sampler, steps, **flow_options)
    return dit.create_diffusion(timestep_respacing=respacing(sampler, steps), learn_sigma=learn_sigma)


def protocol_loop(p: protocol_types.Protocol, *, latent_shape: tuple[int, ...], recorded_shift: float | None = None,
                  convention: str = "sit", learn_sigma: bool = True, prediction: dict[str, Any] | None = None):
    """The sampling loop a protocol describes (dit/protocols.py): its solver on its time grid for a model of this
    latent shape (`recorded_shift`: the checkpoint's training shift, for grids that use it; `convention`: the
    network's time, dit.flow_samplers; `prediction`: what a flow network predicts, as recorded, the objective
    converting it to a velocity); DDPM and DDIM respaced to its count."""
    if p.solver in ("ddpm", "ddim"):
        return make_diffusion(p.solver, p.count, learn_sigma=learn_sigma)
    times = p.times(latent_shape, recorded_shift)
    assert times is not None and p.grid is not None
    if p.solver in MEANFLOW_SAMPLERS:  # the mean-flow models' time: t = 1 noise
        return MeanFlowLoop(p.count, interval=p.guidance.interval or (0.0, 1.0), grid=[1.0 - t for t in times])
    return FlowLoop(p.solver, p.count, diffusion_form=p.diffusion_form, diffusion_norm=p.diffusion_norm,
                    convention=convention, time_shift=p.grid.resolve_shift(latent_shape, recorded_shift),
                    grid=tuple(times), mean_last=p.grid.append is not None, prediction=prediction)


def protocol_model_fn(p: protocol_types.Protocol, model: nn.Module, *, objective: str, convention: str = "sit",
                      in_channels: int | None = None, autocast_dtype: torch.dtype | None = None,
                      compile: bool = False, guide_model: nn.Module | None = None,
                      doubled: bool = False, conditioning: Conditioning | None = None) -> Callable[..., torch.Tensor]:
    """The guided network function a protocol describes: its rule, scale, interval and ends, channels and doubled
    batch (`doubled` forces it: encoder reuse needs it); `guide_model` the weaker network of AutoGuidance;
    `conditioning` the model's with its null condition (a text model's: the empty prompt)."""
    g = p.guidance
    channels = in_channels if in_channels is not None else int(model.in_channels)
    cfg_channels = "all" if g.channels == "all" or int(g.channels) >= channels else g.channels
    scale = g.scale if g.rule in ("cfg", "autoguidance") else 1.0
    if g.rule == "autoguidance" and guide_model is None and scale > 1.0:
        raise ValueError(f"the {p.name} protocol guides with a second, weaker network ({g.guide_model or 'any'}); "
                         "give it (dit-sample --guidance-model FILE)")
    return guided_model_fn(model, cfg_scale=scale, cfg_channels=cfg_channels, autocast_dtype=autocast_dtype,
                           compile=compile, guidance_interval=g.interval if scale > 1.0 else None,
                           noise_level=noise_level_fn(objective, convention), ends=g.ends,
                           doubled=g.doubled or doubled, guide_model=guide_model if scale > 1.0 else None,
                           conditioning=conditioning, internal=as_internal(g.internal))


@torch.no_grad()
def sample_latents(model: nn.Module, diffusion, labels: torch.Tensor | Mapping[str, torch.Tensor],
                   generators: Sequence[torch.Generator], *, sampler: str = "ddpm", cfg_scale: float = 4.0,
                   cfg_channels: str | int = "3", autocast_dtype: torch.dtype | None = None,
                   model_fn: Callable | None = None) -> torch.Tensor:
    """Denoise one batch: labels [B] (on the model's device), or the condition's keyword arguments (a text model's
    text and text_mask), one generator per sample -> latents [B, C, S, S].

    The initial noise and every step's noise of sample b come from generators[b] only. `diffusion` is a
    GaussianDiffusion (sampler ddpm/ddim) or a FlowLoop (flow models; `sampler` is then the FlowLoop's).
    """
    kwargs = condition_kwargs(labels)
    device = next(iter(kwargs.values())).device if kwargs else next(model.parameters()).device
    shape = (int(model.in_channels), int(model.input_size), int(model.input_size))
    fn = model_fn or guided_model_fn(model, cfg_scale=cfg_scale, cfg_channels=cfg_channels,
                                     autocast_dtype=autocast_dtype)
    noise = initial_noise(generators, shape, device)
    dim = int(getattr(model, "reg_dim", 0) or 0)
    if dim:  # REG: the class token beside the image, one packed state of the flow samplers (dit/reg.py)
        if not isinstance(diffusion, FlowLoop):
            raise ValueError("a REG model (its class token) samples with the flow samplers (euler, heun, "
                             "euler-maruyama)")
        state = dit.reg.pack(noise, dit.reg.initial_token(generators, dim, device))
        return dit.reg.unpack(diffusion(dit.reg.packed_model_fn(fn, shape), state, kwargs, generators), shape)[0]
    if isinstance(diffusion, MeanFlowLoop):  # the model's time inputs; an iMF model takes cfg_scale as its omega
        loop = diffusion.bind(str(getattr(model, "conditions", "t")), cfg_scale)
        if isinstance(labels, torch.Tensor):
            return loop(fn, noise, labels, generators)
        return loop(lambda z, t, _: fn(z, t, **kwargs), noise, None, generators)  # type: ignore[arg-type]
    if isinstance(diffusion, FlowLoop):
        return diffusion(fn, noise, kwargs, generators)
    loop = diffusion.ddim_sample_loop if sampler == "ddim" else diffusion.p_sample_loop
    return loop(fn, noise.shape, noise=noise, clip_denoised=False, model_kwargs=kwargs,
                progress=False, generator=list(generators))


def to_uint8(images: torch.Tensor) -> torch.Tensor:
    """[B, 3, H, W] in [-1, 1] -> uint8 [B, H, W, 3] on the CPU (the reference's rounding: +128, truncate; the
    "dit" conversion of dit/image_conversions.py)."""
    return image_conversions.dit_uint8(images.float())


def as_norm(norm: LatentNorm | None, scaling_factor: float | None, shift_factor: float | None) -> LatentNorm:
    """`norm`, or the scalar normalization of (scaling_factor, shift_factor) for callers that pass factors."""
    if norm is not None:
        return norm
    if scaling_factor is None:
        raise ValueError("pass norm (a LatentNorm) or scaling_factor")
    return LatentNorm(float(scaling_factor), shift_factor)


@torch.no_grad()
def decode_latents(vae: nn.Module, latents: torch.Tensor, *, scaling_factor: float | None = None,
                   shift_factor: float | None = None, norm: LatentNorm | None = None,
                   conversion: str = "dit") -> torch.Tensor:
    """Latents [B, C, S, S] -> uint8 images [B, H, W, 3] on the CPU.

    Inverts the latent normalization x = (z - shift) * scale (`norm`, or the scalar factors: diffusers'
    convention) and decodes z with the VAE (AutoencoderKL or AutoencoderDC: `decode(z).sample`). The VAE runs
    in its own dtype (float32 as loaded) with autocast off, as the reference decodes. It decodes one image at a
    time: convolution and GroupNorm kernels (oneDNN, cuDNN) pick their algorithm by batch size, so batched
    decoding would make the last bits, and now and then a pixel, depend on the batch size. At 250 steps
    decoding is well under 1% of a sample's cost. `conversion`: the image conversion to uint8 by name
    (dit/image_conversions.py CONVERSIONS; "dit": the reference's), given the decoder's own [0, 1] images where it has
    them (RAE's decoder: `.unit`).
    """
    param = next(vae.parameters())
    z = as_norm(norm, scaling_factor, shift_factor).invert(latents.to(device=param.device, dtype=torch.float32))
    with torch.autocast(device_type=param.device.type, enabled=False):
        decoded = [vae.decode(row[None].to(param.dtype)) for row in z]
    units = [getattr(d, "unit", None) for d in decoded]
    unit = torch.cat(units) if all(u is not None for u in units) else None
    return image_conversions.conversion(conversion)(torch.cat([d.sample for d in decoded]), unit=unit)


def generate_images(model: nn.Module, vae: nn.Module, diffusion, *, indices: Sequence[int], labels: Sequence[int],
                    seed: int, scaling_factor: float | None = None, shift_factor: float | None = None,
                    sampler: str = "ddpm", cfg_scale: float = 4.0, cfg_channels: str | int = "3",
                    autocast_dtype: torch.dtype | None = None, model_fn: Callable | None = None,
                    norm: LatentNorm | None = None, conversion: str = "dit",
                    condition: Mapping[str, torch.Tensor] | None = None) -> torch.Tensor:
    """Samples `indices` with classes `labels` (or the condition's keyword arguments `condition`, e.g. a text
    model's prompt features) -> uint8 [B, H, W, 3] (CPU); noise from (seed, index); pixels by the named image
    conversion (dit/image_conversions.py)."""
    latents = generate_latents(model, diffusion, indices=indices, labels=labels, seed=seed, sampler=sampler,
                               cfg_scale=cfg_scale, cfg_channels=cfg_channels, autocast_dtype=autocast_dtype,
                               model_fn=model_fn, condition=condition)
    return decode_latents(vae, latents, norm=as_norm(norm, scaling_factor, shift_factor), conversion=conversion)


def generate_latents(model: nn.Module, diffusion, *, indices: Sequence[int], labels: Sequence[int], seed: int,
                     sampler: str = "ddpm", cfg_scale: float = 4.0, cfg_channels: str | int = "3",
                     autocast_dtype: torch.dtype | None = None, model_fn: Callable | None = None,
                     condition: Mapping[str, torch.Tensor] | None = None) -> torch.Tensor:
    """The latents `generate_images` decodes: the same network passes (a sharded run's other ranks run them beside
    the rank that decodes)."""
    device = next(model.parameters()).device
    given: torch.Tensor | dict[str, torch.Tensor] = (
        torch.as_tensor(list(labels), dtype=torch.long, device=device) if condition is None
        else {k: v.to(device) for k, v in condition.items()})
    return sample_latents(model, diffusion, given, noise_generators(seed, indices), sampler=sampler,
                          cfg_scale=cfg_scale, cfg_channels=cfg_channels, autocast_dtype=autocast_dtype,
                          model_fn=model_fn)
