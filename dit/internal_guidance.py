"""NanoGen's internal guidance (End2End-Diffusion/diffusion-bench src/utils/guidance_utils.py, src/configs/stage2.py
`IGConfig`, `GuidanceConfig`): a guidance rule that extrapolates from a weaker prediction the network makes itself,
its base head on the encoder's tokens after block `base_model_depth` (dit/incontext.py, DiTwDDTHeadIG). Pure data and
tensor arithmetic; sample/generate.py runs it (`guided_model_fn`), a protocol row carries it (dit/protocol_types.py
`Guidance.internal`).

NanoGen's rules, t its noise level, every interval closed (t_min <= t <= t_max):
- active (`GuidanceConfig.use_ig`): scale > 1, or an unconditional scale given and not 1;
- internal guidance alone (`forward_with_internalguidance`, l.56-80): one pass of the conditional batch,
  base + scale (full - base) inside the interval, full outside; REG's class token passes unguided (no base head);
- with classifier-free guidance (`forward_with_ig_and_cfg`, l.83-140): the doubled [cond; null] batch at every step;
  inside IG's interval each half is extrapolated from its own base (the null half with `uncond_scale`, default the
  scale), then inside CFG's interval uncond' + cfg (cond' - uncond'), else cond'; the class token gets CFG alone.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

INTERVAL_SLACK = 1e-9  # dit/protocol_types.py's: float64 rounding of a grid time on an end


@dataclass(frozen=True)
class InternalGuidance:
    """NanoGen's `IGConfig`: scale, interval of noise levels (closed), the null half's scale (None: the scale)."""

    scale: float = 1.0
    interval: tuple[float, float] = (0.0, 1.0)
    uncond_scale: float | None = None

    def __post_init__(self) -> None:
        low, high = self.interval
        if not low < high:  # NanoGen asserts it
            raise ValueError(f"the internal-guidance interval must be (low, high) with low < high, got {self.interval}")

    @property
    def active(self) -> bool:
        """NanoGen's use_ig."""
        return self.scale > 1.0 or (self.uncond_scale is not None and self.uncond_scale != 1.0)

    def applies(self, level: float) -> bool:
        low, high = self.interval
        return low - INTERVAL_SLACK <= level <= high + INTERVAL_SLACK

    @property
    def null_scale(self) -> float:
        return self.scale if self.uncond_scale is None else float(self.uncond_scale)


def internal_combine(full: torch.Tensor, base: torch.Tensor, scale: float | torch.Tensor) -> torch.Tensor:
    """base + s (full - base)."""
    return base + scale * (full - base)


def as_internal(value: Any) -> InternalGuidance | None:
    """A protocol row's internal guidance: an `InternalGuidance`, or the tuple (scale, t_min, t_max[, uncond_scale]) a
    row may write it as; None: off."""
    if value is None or isinstance(value, InternalGuidance):
        return value
    scale, low, high, *rest = value
    return InternalGuidance(float(scale), (float(low), float(high)), float(rest[0]) if rest and rest[0] is not None
                            else None)


def with_internal(protocol: Any, ig: InternalGuidance) -> Any:
    """A protocol (dit/protocols.py) with this internal guidance in place of its own, recorded as an override."""
    low, high = ig.interval
    note = f"internal guidance {ig.scale:g} in [{low:g}, {high:g}]" + (
        f", null half {ig.uncond_scale:g}" if ig.uncond_scale is not None else "")
    return dataclasses.replace(protocol, guidance=dataclasses.replace(protocol.guidance, internal=ig),
                               overrides=protocol.overrides + (note,))
