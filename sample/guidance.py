"""When classifier-free guidance settings act, and the scale used: the rules `dit-sample` (sample/resolve.py)
and the trainer's sample grids and FID (sample/grid.py, train/config.py, evaluate/hook.py) share, so a setting
that would do nothing on a model or protocol is refused with its reason rather than recorded and ignored.
"""
from __future__ import annotations

from dit_pipeline.dit.protocols import PROTOCOLS


def guidance_inert(conditions: str, has_null: bool, protocol: str | None = None, *,
                   unconditional: bool = False) -> str | None:
    """Why classifier-free guidance settings do nothing (None: they act). `conditions`: the model's time input
    (dit/conditions.py); `has_null`: whether it was trained with label dropout (so it has a null class);
    `protocol`: the sampling protocol (dit/protocols.py) whose guidance rule may be none; `unconditional`: a model
    conditioned on nothing (dit/conditioning.py NoCondition), which has no null to guide against either."""
    if conditions == "meanflow":
        return "a MeanFlow model trains its guidance in (omega, kappa of its training); its sampler takes none"
    if not has_null and unconditional:
        return ("the model is unconditional (trained with --conditioning none), so it has no null condition to guide "
                "against")
    if not has_null and conditions != "imf":  # iMF's guidance is its network's omega input, not the null class
        return "the model has no null class (trained without class dropout), so classifier-free guidance is impossible"
    if protocol in PROTOCOLS and PROTOCOLS[protocol].guidance.rule == "none":
        return f"--protocol {protocol} samples without guidance ({PROTOCOLS[protocol].release}'s sampler)"
    return None


def resolve_cfg_scale(given: float | None, default: float, inert: str | None, flag: str) -> float:
    """The guidance scale used: `given`, else `default` where guidance acts, else 1 (none). ValueError for a scale
    other than 1 that would do nothing (issue 41: accepted, recorded and ignored is worse than refused)."""
    if inert is None:
        return default if given is None else float(given)
    if given is not None and float(given) != 1.0:
        other = ", or drop --protocol to choose every setting" if inert.startswith("--protocol") else ""
        raise ValueError(f"{flag} {float(given):g} does nothing here: {inert}; drop {flag} (or pass 1){other}")
    return 1.0


def cfg_channels_inert(cfg_channels: str | int, cfg_scale: float, conditions: str) -> str | None:
    """The error when --cfg-channels is given (not auto) where no channel is guided: no guidance, or a
    mean-flow model (MeanFlow trains it in; iMF takes its scale as a network input, on no channels)."""
    if str(cfg_channels) == "auto":
        return None
    if conditions in ("meanflow", "imf"):
        return (f"--cfg-channels {cfg_channels} does nothing on a {'MeanFlow' if conditions == 'meanflow' else 'iMF'} "
                "model (no channel-wise guidance); drop it")
    if not cfg_scale > 1.0:
        return f"--cfg-channels {cfg_channels} does nothing without guidance (cfg scale 1); drop it"
    return None
