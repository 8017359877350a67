"""Release sampling protocols as data: how each release turns its trained network into the images of its published
FID, read from the release's own sampling code, one record per release (issue 40).

A `Protocol` holds
- the time grid (`TimeGrid`): the release's step count (`count`, its num_steps, counting the points of its linspace
  or its intervals), the linspace's start and end in SiT's time (dit/flow.py: t = 0 noise, 1 data), a point
  appended after the linspace (DDT's last step; SiT's SDE's noise-free last step), and the shift applied to every
  point afterwards (SD3's s toward noise, dit/shift.py: a value, RAE's sqrt(C H W / 4096) of the latent ("dim"),
  or the checkpoint's recorded training shift ("recorded"));
- the solver: "ddpm" (DiT's respaced DDPM), "euler" (the ODE), "euler-maruyama" (SiT's SDE, whose last interval is
  its noise-free "Mean" step), "meanflow" (mean-flow u-steps, one network evaluation each);
- the guidance (`Guidance`): the rule ("cfg"; "autoguidance", a second, weaker network: v = v_weak + s (v - v_weak)
  on every channel; "input", iMF's scale and interval fed to the network; "none", trained in), the scale, the
  interval of noise levels (1 = noise) where it applies and whether each end is open or closed, the channels
  (DiT's first 3, or all), whether the release runs the doubled [cond; uncond] batch at every step (outside the
  interval it keeps the conditional half: the batch DDT's encoder state belongs to), and the weaker network of
  AutoGuidance (given to dit-sample as --guidance-model FILE); NanoGen's internal guidance (`internal`: its scale,
  interval and null-half scale; alone, with rule "none", or with "cfg"), which extrapolates from the network's own
  base head (dit/internal_guidance.py);
- the null label (the extra row of the label table, index num_classes, in every release here);
- the image conversion from the decoder's output to uint8, by name (`CONVERSIONS`; evaluate/ imports them);
- the class labels of its FID samples ("uniform" draws or "equal" counts) and the FID reference it was published
  against;
- what it applies to (`AppliesTo`, dit/protocol_fit.py: space, conditioning, objective, prediction, latent shape,
  the model features its sampler needs), so that a model it does not fit is refused naming the rows that fit it;
- what its release config states about the model that the release's files do not record (`ModelFacts`: NanoGen's
  prediction, text encoder and latent space), which dit-sample takes where a file is silent (sample/facts.py).

`PROTOCOLS` is the table; each row names the release files (and lines) its values were read from. NanoGen's 78
sampling configs are rows `nanogen/<config file name>` built from dit/nanogen_protocols.py. The samplers
(sample/generate.py) read a protocol, never a release's name; `dit-sample` without --protocol runs `custom`, the
protocol its flags describe. Pure data and tensor arithmetic: no I/O.
"""
from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from . import nanogen_protocols
from .protocol_fit import FEATURES, AppliesTo, ModelFacts, ModelTraits, model_traits  # noqa: F401 (sample/ uses them)
from .internal_guidance import InternalGuidance
from .shift import shift_for_dim, shift_time, shifted_grid

SOLVERS = ("ddpm", "ddim", "euler", "heun", "euler-maruyama", "meanflow")
GUIDANCE_RULES = ("cfg", "autoguidance", "input", "none")
ENDS = ("[]", "()", "[)", "(]")  # closed, open, and the two half-open intervals of noise levels
INTERVAL_SLACK = 1e-9  # float64 rounding of a grid time that falls on an end (1 - 0.3 = 0.7 + 1e-16)


# ---- image conversions ---------------------------------------------------------------------------------------
# Each takes the decoder's images as a float tensor [B, 3, H, W] and returns uint8 [B, H, W, 3] on the CPU, with the
# release's own arithmetic (float -> uint8 truncates toward zero, as torch's .to(uint8) and jnp.astype(uint8) do).

def dit_uint8(x: torch.Tensor) -> torch.Tensor:
    """x in [-1, 1]: clamp(127.5 x + 128, 0, 255), truncated (facebookresearch/DiT sample_ddp.py l.132; SiT,
    LightningDiT's vavae.py, MeanFlow and iMF the same)."""
    return torch.clamp(127.5 * x + 128.0, 0, 255).permute(0, 2, 3, 1).to("cpu", dtype=torch.uint8)


def ddt_uint8(x: torch.Tensor) -> torch.Tensor:
    """x in [-1, 1]: clip((x + 1) 127.5 + 0.5, 0, 255), truncated (MCG-NJU/DDT src/models/vae.py l.79 fp2uint8)."""
    return torch.clip((x + 1) * 127.5 + 0.5, 0, 255).permute(0, 2, 3, 1).to("cpu", dtype=torch.uint8)


def repa_uint8(x: torch.Tensor) -> torch.Tensor:
    """x in [-1, 1]: clamp(255 ((x + 1) / 2), 0, 255), truncated (sihyun-yu/REPA generate.py l.151-154): the
    floor of 255 u, u in [0, 1], where DiT's rounds (about half of the pixel values end one level lower)."""
    return torch.clamp(255.0 * ((x + 1) / 2.0), 0, 255).permute(0, 2, 3, 1).to("cpu", dtype=torch.uint8)


def unit_uint8(u: torch.Tensor) -> torch.Tensor:
    """u in [0, 1] (the decoder's own [0, 1] output): clamp(0, 1) then mul(255), truncated (bytetriper/RAE
    src/sample_ddp.py l.276-277)."""
    return u.clamp(0, 1).mul(255).permute(0, 2, 3, 1).to("cpu", dtype=torch.uint8)


@dataclass(frozen=True)
class Conversion:
    name: str
    domain: str  # "[-1, 1]" (a VAE's decode) or "[0, 1]" (a decoder's own [0, 1] images, e.g. RAE's)
    fn: Callable[[torch.Tensor], torch.Tensor]
    source: str

    def __call__(self, images: torch.Tensor, unit: torch.Tensor | None = None) -> torch.Tensor:
        """images in [-1, 1] (a diffusers VAE's `decode(z).sample`); `unit`: the decoder's own [0, 1] images where it
        has them (RAE's decoder), else (images + 1) / 2 for a [0, 1] conversion."""
        if self.domain == "[-1, 1]":
            return self.fn(images.float())
        return self.fn((unit if unit is not None else (images.float() + 1) / 2).float())


CONVERSIONS: dict[str, Conversion] = {c.name: c for c in (
    Conversion("dit", "[-1, 1]", dit_uint8, "facebookresearch/DiT sample_ddp.py l.132"),
    Conversion("ddt", "[-1, 1]", ddt_uint8, "MCG-NJU/DDT src/models/vae.py l.78-80"),
    Conversion("repa", "[-1, 1]", repa_uint8, "sihyun-yu/REPA generate.py l.151-154"),
    Conversion("rae", "[0, 1]", unit_uint8, "bytetriper/RAE src/sample_ddp.py l.276-277"),
    # NanoGen decodes to [0, 1] ((x + 1) / 2 for a VAE, src/stage1/vae.py l.239), then RAE's arithmetic
    Conversion("nanogen", "[0, 1]", unit_uint8, "End2End-Diffusion/diffusion-bench src/eval/generation.py l.167-168"),
)}


def conversion(name: str) -> Conversion:
    if name not in CONVERSIONS:
        raise ValueError(f"unknown image conversion {name!r}; choose one of: {', '.join(CONVERSIONS)}")
    return CONVERSIONS[name]


# ---- the time grid ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TimeGrid:
    """The times a flow sampler visits, in SiT's time (0 = noise, 1 = data), as float64 (module docstring)."""

    count_is: str = "intervals"  # the release's num_steps counts the linspace's "points" or its "intervals"
    start: float = 0.0           # the linspace's first point (before the shift)
    end: float = 1.0             # its last point (before the shift)
    append: float | None = None  # a point after the linspace (before the shift)
    shift: float | str = 1.0     # SD3's s; "dim": sqrt(C H W / 4096) of the latent; "recorded": the checkpoint's
    stretch: bool = False        # ours: the unit grid shifted, then stretched onto [start, end] (both ends stay)

    def points(self, count: int) -> int:
        n = count if self.count_is == "points" else count + 1
        if n < 2:
            raise ValueError(f"a grid of {count} {self.count_is} has fewer than 2 points")
        return n

    def times(self, count: int, shift: float) -> list[float]:
        """The grid's times for the release's count and the resolved shift s."""
        n = self.points(count)
        if self.stretch:
            head = shifted_grid(self.start, self.end, n - 1, shift)
        else:
            head = [shift_time(self.start + (self.end - self.start) * i / (n - 1), shift) for i in range(n)]
        return head + ([shift_time(self.append, shift)] if self.append is not None else [])

    def resolve_shift(self, latent_shape: tuple[int, ...], recorded: float | None) -> float:
        if self.shift == "dim":
            c, h, w = latent_shape
            return shift_for_dim(c * h * w)
        if self.shift == "recorded":
            return float(recorded or 1.0)
        return float(self.shift)


# ---- guidance ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Guidance:
    rule: str = "cfg"
    scale: float = 1.0
    interval: tuple[float, float] | None = None  # noise levels (1 = noise); None: every step
    ends: str = "[]"
    channels: str = "all"  # "3": DiT's first three latent channels; "all"
    doubled: bool = False  # the release runs [cond; uncond] at every step
    guide_model: str | None = None  # autoguidance: the weaker network the release used
    internal: InternalGuidance | None = None  # NanoGen's internal guidance, alone or with cfg (dit/internal_guidance.py)

    @property
    def kind(self) -> str:
        """What guides: "cfg" (or "autoguidance", "input"), "internal", "internal+cfg", or "none" (no rule, or a
        scale of 1, which guides nothing)."""
        rule = self.rule if self.rule != "none" and (self.rule == "input" or self.scale > 1.0) else "none"
        if self.internal is None or not self.internal.active:
            return rule
        return "internal" if rule == "none" else f"internal+{rule}"

    def applies(self, level: float) -> bool:
        """Whether guidance applies at noise level `level` (the grid's own float64 time)."""
        if self.interval is None:
            return True
        low, high = self.interval
        above = level >= low - INTERVAL_SLACK if self.ends[0] == "[" else level > low + INTERVAL_SLACK
        below = level <= high + INTERVAL_SLACK if self.ends[1] == "]" else level < high - INTERVAL_SLACK
        return above and below


def cfg_combine(cond: torch.Tensor, uncond: torch.Tensor, scale: float | torch.Tensor) -> torch.Tensor:
    """Classifier-free guidance: uncond + s (cond - uncond)."""
    return uncond + scale * (cond - uncond)


def autoguidance_combine(main: torch.Tensor, weak: torch.Tensor, scale: float | torch.Tensor) -> torch.Tensor:
    """AutoGuidance (Karras et al. 2024): v_weak + s (v - v_weak) (RAE's forward_with_autoguidance)."""
    return weak + scale * (main - weak)


# ---- the protocol -----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Protocol:
    name: str
    release: str                 # the repository
    sources: tuple[str, ...]     # the files (and lines) the values were read from
    solver: str
    count: int                   # the release's num_steps (ddpm: respaced steps)
    guidance: Guidance
    conversion: str
    labels: str                  # "uniform" draws or "equal" counts per class
    fid_reference: str
    grid: TimeGrid | None = None  # flow and mean-flow solvers
    diffusion_form: str = "sigma"  # euler-maruyama: SiT's D(t) and its norm
    diffusion_norm: float = 1.0
    null_label: str = "num_classes"
    fid: float | None = None     # the FID the release states with it
    model: str = ""              # the network it was published with
    notes: str = ""
    overrides: tuple[str, ...] = field(default=())  # settings changed from the row (recorded)
    applies_to: AppliesTo = AppliesTo()  # the models it fits (dit/protocol_fit.py; `custom`: any)
    facts: ModelFacts | None = None  # what its config states that its release's files do not (dit/protocol_fit.py)

    def with_overrides(self, *, count: int | None = None, scale: float | None = None,
                       interval: tuple[float, float] | list[float] | None = None,
                       labels: str | None = None, shift: float | None = None) -> "Protocol":
        """This protocol with the values a user chose instead of the release's; they are recorded (`overrides`).
        `shift`: the grid's shift (dit-sample --time-shift), in place of the row's value or rule."""
        changed, p = [], self
        if count is not None and count != p.count:
            changed.append(f"steps {count}")
            p = dataclasses.replace(p, count=int(count))
        if shift is not None and p.grid is not None and float(shift) != p.grid.shift:
            changed.append(f"shift {float(shift):g}")
            p = dataclasses.replace(p, grid=dataclasses.replace(p.grid, shift=float(shift)))
        if scale is not None and float(scale) != p.guidance.scale:
            changed.append(f"scale {scale:g}")
            p = dataclasses.replace(p, guidance=dataclasses.replace(p.guidance, scale=float(scale)))
        if interval is not None and tuple(interval) != p.guidance.interval:
            iv = (float(interval[0]), float(interval[1]))
            changed.append(f"interval {p.guidance.ends[0]}{iv[0]:g}, {iv[1]:g}{p.guidance.ends[1]}")
            p = dataclasses.replace(p, guidance=dataclasses.replace(p.guidance, interval=iv))
        if labels is not None and labels != p.labels:
            changed.append(f"labels {labels}")
            p = dataclasses.replace(p, labels=labels)
        return dataclasses.replace(p, overrides=p.overrides + tuple(changed)) if changed else p

    def times(self, latent_shape: tuple[int, ...], recorded_shift: float | None = None) -> list[float] | None:
        """The float64 time grid (SiT's time) for a model of this latent shape, None for the ddpm solvers."""
        if self.grid is None:
            return None
        return self.grid.times(self.count, self.grid.resolve_shift(latent_shape, recorded_shift))

    def record(self, latent_shape: tuple[int, ...] | None = None, recorded_shift: float | None = None
               ) -> dict[str, Any]:
        """The protocol as JSON for the sample files: the row, the resolved shift and the overrides."""
        out = dataclasses.asdict(self)
        out["sources"], out["overrides"] = list(self.sources), list(self.overrides)
        if self.grid is not None and latent_shape is not None:
            out["grid"]["resolved_shift"] = self.grid.resolve_shift(latent_shape, recorded_shift)
        return out

    @property
    def evaluations_per_step(self) -> int:
        """Network evaluations per step and sample inside the guidance interval (cfg and autoguidance: 2)."""
        g = self.guidance
        return 2 if g.rule in ("cfg", "autoguidance") and g.scale > 1.0 else 1


ADM_REF = "ADM's VIRTUAL_imagenet256_labeled.npz (openai/guided-diffusion evaluations)"
NANOGEN_REF = "NanoGen's data/imagenet/jit_in256_stats.npz (ImageNet validation statistics)"
T2I_REF = "none: GenEval, DPG-Bench and GenAI-Bench VQAScore on the prompts (dit-eval --t2i)"
_LATENT, _PIXELS = ("latent",), ("pixels",)
CLASS_FLOW = AppliesTo(space=_LATENT, conditioning=("class",), objectives=("flow",))
_SDE_GRID = TimeGrid(count_is="points", start=0.0, end=0.96, append=1.0)  # SiT's and REPA's: 0.96, then Mean to 1

PROTOCOLS: dict[str, Protocol] = {p.name: p for p in (
    Protocol(
        "dit", "facebookresearch/DiT",
        ("sample_ddp.py l.78 (create_diffusion(str(num_sampling_steps)): 250 respaced DDPM steps), l.114-119 "
         "(the doubled [cond; null = 1000] batch, forward_with_cfg), l.132 (clamp(127.5 x + 128))",
         "models.py l.250-265 forward_with_cfg: guidance on model_out[:, :3]",
         "sample_ddp.py: y = torch.randint(0, num_classes) per sample"),
        solver="ddpm", count=250, guidance=Guidance("cfg", 1.5, channels="3", doubled=True), conversion="dit",
        labels="uniform", fid_reference=ADM_REF, fid=2.27, model="DiT-XL/2 256 px",
        applies_to=AppliesTo(space=_LATENT, conditioning=("class",), objectives=("ddpm",))),
    Protocol(
        "sit", "willisma/SiT",
        ("sample_ddp.py l.109-117 (sample_sde: Euler, diffusion form sigma, norm 1, last step Mean 0.04, 250 steps), "
         "l.163-168 (doubled batch, null 1000), l.178 (clamp(127.5 x + 128))",
         "transport/transport.py l.73-95 check_interval (SDE: t0 = 0, t1 = 1 - last_step_size), l.247-262 the Mean "
         "last step, l.279-286 sample_sde",
         "transport/integrators.py l.23 linspace(t0, t1, num_steps)", "models.py l.250-265 (first 3 channels)"),
        solver="euler-maruyama", count=250, grid=_SDE_GRID,
        guidance=Guidance("cfg", 1.5, channels="3", doubled=True), conversion="dit", labels="uniform",
        fid_reference=ADM_REF, fid=2.06, model="SiT-XL/2 256 px", applies_to=CLASS_FLOW),
    Protocol(
        "repa", "sihyun-yu/REPA",
        ("samplers.py l.105-183 euler_maruyama_sampler: t = linspace(1, 0.04, num_steps) then 0 (REPA's t = noise "
         "level), diffusion 2t, guidance where guidance_low <= t <= guidance_high (l.131), the doubled batch only "
         "there, the last step without noise",
         "README (generate.py --mode sde --num-steps 250 --cfg-scale 1.8 --guidance-high 0.7)",
         "generate.py l.151-154 ((x + 1) / 2, clamp(255 x)), l.122 y = randint"),
        solver="euler-maruyama", count=250, grid=_SDE_GRID,
        guidance=Guidance("cfg", 1.8, interval=(0.0, 0.7), ends="[]", channels="all"), conversion="repa",
        labels="uniform", fid_reference=ADM_REF, fid=1.42, model="SiT-XL/2 + REPA 256 px, 800 epochs",
        applies_to=CLASS_FLOW),
    Protocol(
        "lightningdit", "hustvl/LightningDiT",
        ("transport/integrators.py l.94-101 (linspace(t0, t1, num_steps), then a t / (1 + (a - 1) t), "
         "a = timestep_shift)", "transport/transport.py l.95-96 check_interval (ODE: t0 = 0, t1 = 1)",
         "configs/reproductions/lightningdit_xl_vavae_f16d32_800ep_cfg.yaml (euler, 250 points, cfg 6.7, "
         "cfg_interval_start 0.125, timestep_shift 0.3)",
         "models/lightningdit.py l.420-442 forward_with_cfg (first 3 channels; the conditional half where "
         "t < cfg_interval_start)", "inference.py l.202-218 (doubled batch at every step, null 1000, randint labels)",
         "tokenizer/vavae.py l.81 (clamp(127.5 x + 128))"),
        solver="euler", count=250, grid=TimeGrid(count_is="points", shift=1 / 0.3),
        guidance=Guidance("cfg", 6.7, interval=(0.0, 0.875), ends="[]", channels="3", doubled=True),
        conversion="dit", labels="uniform", fid_reference=ADM_REF, fid=1.35,
        model="LightningDiT-XL/1 on VA-VAE f16d32, 800 epochs", applies_to=CLASS_FLOW,
        notes="the 64-epoch config: cfg 10.0, cfg_interval_start 0.10 (--cfg-scale 10 --guidance-interval 0 0.9)"),
    Protocol(
        "ddt", "MCG-NJU/DDT",
        ("src/diffusion/stateful_flow_matching/sampling.py l.53-58 (timesteps = cat(linspace(0, 1 - last_step, "
         "num_steps), [1]), then t / (t + (1 - t) shift)), l.88-102 (the doubled [uncond; cond] batch at every step, "
         "the encoder state reset where i % state_refresh_rate == 0, guidance where guidance_interval_min < t < "
         "guidance_interval_max)",
         "configs/repa_improved_ddt_xlen22de6_256.yaml l.68-81 (250 steps, guidance 2.0, timeshift 1.0, "
         "state_refresh_rate 1, interval (0.3, 1.0), last_step 0.04, simple_guidance_fn: every channel)",
         "src/models/vae.py l.78-80 fp2uint8", "src/data/dataset/randn.py (label = idx // num_seeds: 50 per class)"),
        solver="euler", count=250, grid=TimeGrid(count_is="points", start=0.0, end=0.96, append=1.0),
        guidance=Guidance("cfg", 2.0, interval=(0.0, 0.7), ends="()", channels="all", doubled=True),
        conversion="ddt", labels="equal", fid_reference=ADM_REF + " (README: ADM evaluation suite)", fid=1.26,
        model="DDT-XL/2 (22 + 6 blocks) 256 px", applies_to=CLASS_FLOW,
        notes="encoder sharing: dit-sample --encoder-refresh K is the release's state_refresh_rate K (1 in the "
              "config): the encoder recomputed at steps i % K == 0 on the doubled batch"),
    Protocol(
        "rae", "bytetriper/RAE",
        ("src/stage2/transport/transport.py l.125-152 check_interval (t0 = 0, t1 = 1 - 1/1000 for the ODE), "
         "sample_ode", "src/stage2/transport/integrators.py l.100-101 (t = 1 - linspace(t0, t1, num_steps), then "
         "s t / (1 + (s - 1) t) in its noise-level time)",
         "src/sample_ddp.py l.134-137 (s = sqrt(prod(latent_size) / 4096)), l.246-274 (guidance where the scale is "
         "> 1: the doubled [x; x] with [y; null] at every step, forward_with_cfg, the first half kept), l.276-277 "
         "(clamp(0, 1).mul(255))",
         "src/stage2/models/DDT.py l.364-389 forward_with_cfg (every channel, where t_min <= t <= t_max in its t = "
         "noise level; the conditional half elsewhere)",
         "configs/stage2/sampling/ImageNet256/DiTDHXL-DINOv2-B.yaml (euler, num_steps 50, guidance method cfg, "
         "scale 1.0, t-min 0.0, t-max 1.0)",
         "README (--label-sampling equal by default)"),
        solver="euler", count=50, grid=TimeGrid(count_is="points", start=0.0, end=0.999, shift="dim"),
        guidance=Guidance("cfg", 1.0, interval=(0.0, 1.0), ends="[]", channels="all", doubled=True),
        conversion="rae", labels="equal", fid_reference=ADM_REF, fid=1.51,
        model="DiT-DH-XL on DINOv2-B features 256 px, 800 epochs", applies_to=CLASS_FLOW,
        notes="the config's guidance is cfg at scale 1.0 (none); --cfg-scale S guides as its forward_with_cfg does"),
    Protocol(
        "rae-ag", "bytetriper/RAE",
        ("configs/stage2/sampling/ImageNet256/DiTDHXL-DINOv2-B_AG.yaml (method autoguidance, scale 1.42, t-min 0, "
         "t-max 1, guidance_model DiT-DH-S: hidden [384, 2048], depth [12, 2])",
         "src/stage2/models/DDT.py l.391-408 forward_with_autoguidance (ag + s (eps - ag) on every channel where "
         "t_min <= t <= t_max)", "src/sample_ddp.py l.179-186, l.255-277",
         "src/stage2/transport/transport.py l.125-152, integrators.py l.100-101 (the rae grid)"),
        solver="euler", count=50, grid=TimeGrid(count_is="points", start=0.0, end=0.999, shift="dim"),
        guidance=Guidance("autoguidance", 1.42, interval=(0.0, 1.0), ends="[]", channels="all",
                          guide_model="DiT-DH-S"),
        conversion="rae", labels="equal", fid_reference=ADM_REF, fid=1.13,
        model="DiT-DH-XL on DINOv2-B features 256 px, guided by DiT-DH-S", applies_to=CLASS_FLOW,
        notes="the release runs both networks on its doubled [cond; null] batch and keeps the conditional half; "
              "here only the conditional half runs: 2 network evaluations per step instead of 4"),
    Protocol(
        "nanogen", "End2End-Diffusion/diffusion-bench",
        ("src/stage2/transport/sampler.py l.10-34 sample_ode (t = linspace(1, 0, num_steps + 1), then "
         "s t / (1 + (s - 1) t), NanoGen's t = noise level; x = x - (t_i - t_i+1) drift(x, t_i))",
         "src/offline_eval.py l.119-124 (s = sqrt(time_dist_shift_dim / time_dist_shift_base_eval), the dim being "
         "prod(latent_size) and base_eval the training base 4096 unless a config sets it)",
         "src/utils/guidance_utils.py l.14-39 forward_with_cfg (the doubled [x; x] with [y; null] at every step, "
         "guidance on the in_channels where t_min <= t <= t_max, the conditional half elsewhere), "
         "src/configs/stage2.py (use_cfg: scale > 1)",
         "src/eval/generation.py l.150-168 (null label num_classes; decode to [0, 1], clamp, mul(255), uint8), "
         "src/eval/distributed.py l.35-58 (one sample per validation image, with its label)",
         "configs/stage2/sampling/imagenet/ddt-en28d1152hd72-dn2d2048hd128-sdvae-ema-vpred-t4c8-cfg1.6-t0.0-0.9.yaml "
         "(50 steps, cfg 1.6 in [0, 0.9])"),
        solver="euler", count=50, grid=TimeGrid(count_is="intervals", start=0.0, end=1.0, shift="dim"),
        guidance=Guidance("cfg", 1.6, interval=(0.0, 0.9), ends="[]", channels="all", doubled=True),
        conversion="nanogen", labels="equal", fid_reference=NANOGEN_REF, fid=None,
        model="NanoGen's in-context DiT-DH t4c8 on SD-VAE-EMA latents, 80 epochs", applies_to=CLASS_FLOW,
        facts=nanogen_protocols.generic_facts("imagenet", False, "every latent config of "
                                              "configs/stage2/sampling/imagenet/"),
        notes="any latent space, with the grid's shift sqrt(C H W / 4096) of the model's latents (1 for SD-VAE, "
              "sqrt(48) for RAE's DINOv2-B features); each NanoGen config's own scale: nanogen/<config>"),
    Protocol(
        "nanogen-pixels", "End2End-Diffusion/diffusion-bench",
        ("src/stage2/transport/sampler.py l.10-34 sample_ode (the nanogen grid)",
         "configs/stage2/sampling/imagenet/jit-ddt-en28d1152hd72-dn2d2048hd128-xpred-t4c8-cfg2.6-t0.0-0.9.yaml "
         "(time_dist_shift_base_eval 196608 = time_dist_shift_dim: the grid unshifted; 50 steps, cfg 2.6 in "
         "[0, 0.9])", "src/stage2/transport/transport.py l.105-127 (prediction 'x': drift (x - out) / "
         "t.clamp_min(0.05), after the guidance)",
         "src/utils/guidance_utils.py l.14-39 forward_with_cfg", "src/eval/generation.py l.150-168"),
        solver="euler", count=50, grid=TimeGrid(count_is="intervals", start=0.0, end=1.0, shift=1.0),
        guidance=Guidance("cfg", 2.6, interval=(0.0, 0.9), ends="[]", channels="all", doubled=True),
        conversion="nanogen", labels="equal", fid_reference=NANOGEN_REF, fid=None,
        model="NanoGen's JiT-DDT (in-context DiT-DH t4c8, patch 16 on pixels, x-prediction), 80 epochs",
        applies_to=AppliesTo(space=_PIXELS, conditioning=("class",), objectives=("flow",)),
        facts=nanogen_protocols.generic_facts("imagenet", True, "every pixel config of "
                                              "configs/stage2/sampling/imagenet/"),
        notes="PixelGen's and PixNerd's configs (cfg 2.0, 2.4): nanogen/pixelgen-..., nanogen/pixnerd-...; a NanoGen "
              "file predicts x (JiT, PixelGen) or the velocity (PixNerd) with the same network: its config's row "
              "says which"),
    Protocol(
        "nanogen-t2i", "End2End-Diffusion/diffusion-bench",
        ("src/stage2/transport/sampler.py l.10-34 sample_ode (the nanogen grid, shifted by sqrt(C H W / 4096))",
         "configs/stage2/sampling/t2i/t2i-ddt-en28d1152hd72-dn2d2048hd128-sdvae-ema-vpred-t4.yaml (50 steps, cfg 6.0 "
         "with t_min 0.0, t_max 1.0)", "src/eval/generation.py l.136-147 (the doubled batch against the text "
         "encoder's features of the empty prompt, with its mask), l.163-168 (the first half; [0, 1], mul(255), uint8)",
         "src/utils/guidance_utils.py l.14-39 forward_with_cfg"),
        solver="euler", count=50, grid=TimeGrid(count_is="intervals", start=0.0, end=1.0, shift="dim"),
        guidance=Guidance("cfg", 6.0, interval=(0.0, 1.0), ends="[]", channels="all", doubled=True),
        conversion="nanogen", labels="uniform", null_label="the empty prompt", fid_reference=T2I_REF, fid=None,
        model="NanoGen's T2I in-context DiT-DH t4 (Qwen3-0.6B) on SD-VAE-EMA latents",
        applies_to=AppliesTo(space=_LATENT, conditioning=("text",), objectives=("flow",)),
        facts=nanogen_protocols.generic_facts("t2i", False, "every config of "
                                              "configs/stage2/sampling/t2i/"),
        notes="prompts from --prompt / --prompts (a text model); pixel models: nanogen-t2i-pixels"),
    Protocol(
        "nanogen-t2i-pixels", "End2End-Diffusion/diffusion-bench",
        ("src/stage2/transport/sampler.py l.10-34 sample_ode (the nanogen grid, unshifted)",
         "configs/stage2/sampling/t2i/t2i-jit-ddt-en28d1152hd72-dn2d2048hd128-xpred-t4.yaml and "
         "t2i-pixelgen-ddt-en28d1152hd72-dn2d2048hd128-xpred-t4-0.1lpips-0.01pdino-thresh0.7.yaml (50 steps, cfg 6.0 "
         "with t_min 0.0, t_max 1.0, time_dist_shift_base_eval 196608 = time_dist_shift_dim: s = 1)",
         "src/offline_eval.py l.118-124 (s = sqrt(dim / base_eval))",
         "src/eval/generation.py l.136-147, l.163-168", "src/utils/guidance_utils.py l.14-39 forward_with_cfg"),
        solver="euler", count=50, grid=TimeGrid(count_is="intervals", start=0.0, end=1.0, shift=1.0),
        guidance=Guidance("cfg", 6.0, interval=(0.0, 1.0), ends="[]", channels="all", doubled=True),
        conversion="nanogen", labels="uniform", null_label="the empty prompt", fid_reference=T2I_REF, fid=None,
        model="NanoGen's T2I JiT-DDT and PixelGen (in-context DiT-DH t4, patch 16 on pixels, x-prediction)",
        applies_to=AppliesTo(space=_PIXELS, conditioning=("text",), objectives=("flow",)),
        facts=nanogen_protocols.generic_facts("t2i", True, "every pixel config of "
                                              "configs/stage2/sampling/t2i/"),
        notes="NanoGen's T2I PixNerd config is shifted by sqrt(48) (no base_eval): "
              "nanogen/t2i-pixnerd-ddt-en28d1152hd72-dn2d2048hd128-vpred-t4"),
    Protocol(
        "meanflow", "Gsunshine/meanflow",
        ("meanflow.py l.102-124 (sample_one_step: z_r = z_t - (t - r) u(z_t, t, t - r); _default_schedule "
         "[1.0, 0.0]), l.15-53 generate (randint labels)", "configs/default.py (sampling.num_steps 1)",
         "train.py l.165-166 (127.5 x + 128, clip, astype(uint8))"),
        solver="meanflow", count=1, grid=TimeGrid(count_is="intervals", start=0.0, end=1.0),
        guidance=Guidance("none", 1.0), conversion="dit", labels="uniform",
        fid_reference="the release's ImageNet 256 statistics, computed as ADM's (README: FID stats)", fid=None,
        model="MeanFlow (the release's MF-B/4: FID 11.4 in its README)",
        applies_to=AppliesTo(space=_LATENT, conditioning=("class",), objectives=("meanflow",)),
        notes="the release samples 2 steps only on a list it is given (sampling.sampling_timesteps); "
              "--steps 2 here takes linspace(1, 0, 3), our choice"),
    Protocol(
        "imf", "Lyy-iiis/imeanflow",
        ("imf.py l.42 (t_steps = linspace(1, 0, num_steps + 1)), l.90-114 sample_one_step (omega, t_min, t_max "
         "are network inputs)", "configs/eval_config.yml (iMF-B/2: 1 step, omega 8.0, interval [0.4, 0.65])",
         "utils/sample_util.py l.28-29 (127.5 x + 128, clip, astype(uint8))",
         "imf.py l.36-39 (y = (arange(n) + sample_idx n) % num_classes: equal counts)"),
        solver="meanflow", count=1, grid=TimeGrid(count_is="intervals", start=0.0, end=1.0),
        guidance=Guidance("input", 8.0, interval=(0.4, 0.65), ends="[]", channels="all"), conversion="dit",
        labels="equal", fid_reference="the release's imagenet_256_fid_stats.npz (computed on TPU with JAX)",
        fid=3.39, model="iMF-B/2 256 px",
        applies_to=AppliesTo(space=_LATENT, conditioning=("class",), objectives=("imf", "imf-adaln")),
        notes="eval_config.yml: iMF-M/2 and L/2 omega 10.5 in [0.4, 0.6]; XL/2 8.0 in [0.42, 0.62]; XL/2 2 steps "
              "4.0 in [0.36, 0.64] (--cfg-scale, --guidance-interval, --steps)"),
)}


RELEASE_ROWS = tuple(PROTOCOLS)  # the releases' own rows, before NanoGen's configs
PROTOCOLS.update(nanogen_protocols.rows())


def names() -> str:
    """The protocol names for a message: every release's, then NanoGen's configs as one pattern."""
    n = len(PROTOCOLS) - len(RELEASE_ROWS)
    return f"{', '.join(RELEASE_ROWS)}, nanogen/<NanoGen sampling config> ({n} rows: docs/nanogen-protocols.md)"


def _near(name: str) -> str:
    near = difflib.get_close_matches(name, list(PROTOCOLS), n=3, cutoff=0.8)
    return f" (did you mean {' or '.join(near)}?)" if near else ""


def unknown(name: str, flag: str = "--protocol") -> str:
    """The message for a protocol name that is not a row (with the closest names)."""
    return f"{flag} must be one of {names()}, got {name!r}{_near(name)}"


def protocol(name: str) -> Protocol:
    if name not in PROTOCOLS:
        raise ValueError(f"unknown sampling protocol {name!r}; choose one of: {names()}{_near(name)}")
    return PROTOCOLS[name]


def fitting(traits: ModelTraits) -> list[str]:
    """The rows that fit a model, releases' first; rows needing a feature this build lacks are left out."""
    return [n for n, p in PROTOCOLS.items() if not p.applies_to.mismatches(traits) and not p.applies_to.missing()]


def fit_problem(p: Protocol, traits: ModelTraits, shown: int = 8,
                instead: str = "drop --protocol and choose the sampler with dit-sample's flags") -> str | None:
    """Why protocol `p` does not fit a model with `traits` (None: it fits), naming the rows that do and, last, what
    else to do (`instead`)."""
    wrong = p.applies_to.mismatches(traits)
    if not wrong:
        return None
    fits = fitting(traits)
    more = f" and {len(fits) - shown} more" if len(fits) > shown else ""
    which = f"Protocols that fit it: {', '.join(fits[:shown])}{more}" if fits else "No protocol fits it"
    return (f"--protocol {p.name} applies to {p.applies_to.describe()}; this is {traits.describe()} "
            f"({'; '.join(wrong)}). {which}; or {instead}")


def missing_features(p: Protocol) -> str | None:
    """Why protocol `p` cannot run in this build (None: it can): the features its release's sampler needs."""
    missing = p.applies_to.missing()
    if not missing:
        return None
    return (f"--protocol {p.name} needs {'; '.join(FEATURES[f] for f in missing)}, which this build does not have "
            "yet; no other setting samples it as the release does")


def custom(*, solver: str, steps: int, scale: float = 1.0, interval: tuple[float, float] | list[float] | None = None,
           channels: str = "all", last_step_size: float = 0.04, sample_eps: float = 1e-3, diffusion_form: str = "sigma",
           diffusion_norm: float = 1.0, time_shift: float = 1.0, labels: str = "uniform",
           guide_model: str | None = None) -> Protocol:
    """The protocol `dit-sample`'s own flags describe (no --protocol): uniform grids from 0 to 1 (the SDE: `steps`
    points from 0 (SBDM: sample_eps) to 1 - last_step_size, then its Mean step), shifted by `time_shift` with both
    ends kept, guidance on a closed interval, a single conditional pass outside it, DiT's image conversion."""
    grid: TimeGrid | None = None
    if solver in ("euler", "heun", "meanflow"):
        grid = TimeGrid(count_is="intervals", shift=time_shift, stretch=True)
    elif solver == "euler-maruyama":
        grid = TimeGrid(count_is="points", start=sample_eps if diffusion_form == "SBDM" else 0.0,
                        end=1.0 - last_step_size, append=1.0 if last_step_size > 0 else None, shift=time_shift,
                        stretch=True)
    rule = "autoguidance" if guide_model else ("cfg" if scale > 1.0 else "none")
    iv = None if interval is None else (float(interval[0]), float(interval[1]))
    return Protocol("custom", "dit-pipeline", ("dit-sample's flags",), solver=solver, count=int(steps),
                    guidance=Guidance(rule, float(scale), interval=iv, channels=channels, guide_model=guide_model),
                    conversion="dit", labels=labels, fid_reference="", grid=grid, diffusion_form=diffusion_form,
                    diffusion_norm=float(diffusion_norm))
