"""A release's sampling protocol as a record: how a release turns its trained network into the images of its
published FID, read from the release's own sampling code (issue 40). The rows themselves are dit/release_protocols.py
(the releases') and dit/nanogen_protocols.py (NanoGen's configs); dit/protocols.py is their table.

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
- the image conversion from the decoder's output to uint8, by name (dit/image_conversions.py `CONVERSIONS`);
- the class labels of its FID samples ("uniform" draws or "equal" counts) and the FID reference it was published
  against;
- what it applies to (`AppliesTo`, dit/protocol_fit.py: space, conditioning, objective, prediction, latent shape,
  the model features its sampler needs), so that a model it does not fit is refused naming the rows that fit it;
- what its release config states about the model that the release's files do not record (`ModelFacts`: NanoGen's
  prediction, text encoder and latent space), which dit-sample takes where a file is silent (sample/facts.py).

Also here: the guidance rules' arithmetic (`cfg_combine`, `autoguidance_combine`) and the names a row may use
(`SOLVERS`, `GUIDANCE_RULES`, `ENDS`). Pure data and tensor arithmetic: no I/O.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from .protocol_fit import AppliesTo, ModelFacts
from .internal_guidance import InternalGuidance
from .shift import shift_for_dim, shift_time, shifted_grid

SOLVERS = ("ddpm", "ddim", "euler", "heun", "euler-maruyama", "meanflow")
GUIDANCE_RULES = ("cfg", "autoguidance", "input", "none")
ENDS = ("[]", "()", "[)", "(]")  # closed, open, and the two half-open intervals of noise levels
INTERVAL_SLACK = 1e-9  # float64 rounding of a grid time that falls on an end (1 - 0.3 = 0.7 + 1e-16)


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
