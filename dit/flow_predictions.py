"""The linear path of flow matching and what a flow network predicts (dit/flow.py's convention: SiT's time,
x_t = t x_data + (1 - t) eps, t = 1 data): the velocity itself (the default), the clean image, or the velocity
trained toward NanoGen's clamped target. Each prediction turns the network's output into the velocity the samplers
integrate (dit/flow_samplers.py) and gives the objective its training target (dit/flow.py).

x-prediction (`prediction="x"`; Li & He 2025, "Back to Basics: Let Denoising Generative Models Denoise",
arXiv:2511.13720, JiT; NanoGen, End2End-Diffusion/diffusion-bench src/stage2/transport/transport.py): the network
outputs the clean image; its velocity is (x_pred - x_t) / max(1 - t, t_eps) and the target (x - x_t) /
max(1 - t, t_eps) (`CleanPrediction`), t_eps 0.05; the loss is still the mean over all elements, and every
sampler converts through the same rule (dit/flow_samplers.py `velocity_field`), so the samplers are unchanged.
Where the two releases differ (both clamp the noise level at 0.05 and average the loss over all elements):
- time: NanoGen's t is the noise level, drawn sigmoid(-1.1 + 0.8 n) and shifted by sqrt(C H W / 4096) (sqrt(48)
  at 256 x 256 x 3) toward noise: here t_mean 1.1, t_scale 0.8, time_shift sqrt(48). JiT's t is ours (t = 1
  data), drawn sigmoid(-0.8 + 0.8 n) (P_mean -0.8, P_std 0.8), unshifted, and its noise is scaled by
  noise_scale (1 at 256 px, 2 at 512 px; not supported here: 1 only);
- sampling: NanoGen integrates 50 Euler steps on the unshifted grid (`euler`, time_shift 1); JiT takes Heun
  (49 Heun steps, then one Euler step to t = 1, so the field is never evaluated at the data end) with CFG
  only where 0.1 <= t <= 1 (its interval is in its time, ours).

Velocity prediction with NanoGen's clamped target (`v_target="clamped"`; End2End-Diffusion/diffusion-bench
src/stage2/transport/transport.py, `Transport.training_losses` and `convert_model_pred`, every `*-vpred-*` config):
the network's output is the velocity as it is (the samplers do not change), but the target is made from x_t as the
x-prediction's is, (x - x_t) / max(1 - t, t_eps) (NanoGen's (x_t - x1) / max(t, t_eps) in its time, t_eps 0.05):
x - eps where the noise level 1 - t is at least t_eps, and (1 - t) / t_eps (x - eps) below it
(`ClampedVelocityPrediction`). The default target is x - eps at every t.
"""
from __future__ import annotations

from typing import Any

import torch


def bcast(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """[N] -> [N, 1, ..., 1] matching x's rank."""
    return t.reshape(-1, *([1] * (x.dim() - 1))).to(x.dtype)


def interpolate(x_data: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """x_t = t x_data + (1 - t) noise (t [N] in [0, 1])."""
    tb = bcast(t, x_data)
    return tb * x_data + (1 - tb) * noise


def target_velocity(x_data: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """d x_t / dt of the linear interpolant: x_data - noise."""
    return x_data - noise


def velocity_of(out: torch.Tensor, channels: int) -> torch.Tensor:
    """The velocity part of a network output: all of it, or the first half of a learn_sigma DiT's."""
    if out.shape[1] == channels:
        return out
    if out.shape[1] == 2 * channels:
        return out[:, :channels]
    raise ValueError(f"model output has {out.shape[1]} channels; expected {channels} or {2 * channels}")


PREDICTIONS = ("v", "x")
V_TARGETS = ("plain", "clamped")  # a velocity prediction's target: x - eps, or NanoGen's clamped form
T_EPS = 0.05  # NanoGen's Transport t_eps and JiT's --t_eps: the smallest noise level a conversion divides by


def noise_level(t: torch.Tensor, x: torch.Tensor, t_eps: float) -> torch.Tensor:
    """max(1 - t, t_eps) broadcast to x: the noise level of SiT's time t (NanoGen's t, JiT's 1 - t), clamped as
    both releases clamp the denominator of their velocity."""
    return bcast(1 - t.to(torch.float32), x).clamp_min(t_eps)


class VelocityPrediction:
    """The network outputs the velocity itself (SiT, REPA, LightningDiT, RAE): the identity conversion."""

    name = "v"
    t_eps: float | None = None  # the plain target divides by nothing

    def velocity(self, out: torch.Tensor, x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return out

    def target(self, x_data: torch.Tensor, noise: torch.Tensor, x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return target_velocity(x_data, noise)

    def sit_velocity(self, out: torch.Tensor, x_t: torch.Tensor, t: torch.Tensor, reverse: bool) -> torch.Tensor:
        """The sampler's velocity in SiT's time; a REPA-time network's output (noise - data) negated."""
        return -out if reverse else out

    def clean(self, out: torch.Tensor, x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """The clean image the output implies: x_t + (1 - t) v."""
        return x_t + bcast(1 - t.to(torch.float32), x_t) * out

    def record(self) -> dict[str, Any] | None:
        return None


class CleanPrediction:
    """The network outputs the clean image x (JiT; NanoGen's `prediction: 'x'`), turned into a velocity as both
    releases turn it: v = (x_pred - x_t) / max(1 - t, t_eps) in SiT's time (NanoGen's (x_t - x_pred) / max(t, t_eps)
    in its own, t = 1 noise; JiT's (x_pred - z) / (1 - t).clamp_min(t_eps)); the training target is made from
    x_t the same way, (x - x_t) / max(1 - t, t_eps), so the loss is the squared x error weighted by
    1 / max(1 - t, t_eps)^2."""

    name = "x"

    def __init__(self, t_eps: float = T_EPS):
        if not 0 < t_eps < 1:
            raise ValueError(f"t_eps must be in (0, 1), got {t_eps}")
        self.t_eps = float(t_eps)

    def velocity(self, out: torch.Tensor, x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return (out - x_t) / noise_level(t, x_t, self.t_eps)

    def target(self, x_data: torch.Tensor, noise: torch.Tensor, x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return (x_data - x_t) / noise_level(t, x_t, self.t_eps)

    def sit_velocity(self, out: torch.Tensor, x_t: torch.Tensor, t: torch.Tensor, reverse: bool) -> torch.Tensor:
        """The sampler's velocity in SiT's time (a clean image is the same in either time direction)."""
        return self.velocity(out, x_t, t)

    def clean(self, out: torch.Tensor, x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return out

    def record(self) -> dict[str, Any] | None:
        return {"kind": "x", "t_eps": self.t_eps}


class ClampedVelocityPrediction(VelocityPrediction):
    """The network outputs the velocity (sampled as it is), trained toward NanoGen's velocity target, made from x_t
    as the x-prediction's is: (x - x_t) / max(1 - t, t_eps) in SiT's time (NanoGen's vt = (xt - x1) /
    t.clamp_min(t_eps) in its own, t = 1 noise), so x - eps where 1 - t >= t_eps and (1 - t) / t_eps (x - eps)
    below it. Recorded {"kind": "v", "t_eps"} (a plain velocity model records nothing)."""

    t_eps: float

    def __init__(self, t_eps: float = T_EPS):
        if not 0 < t_eps < 1:
            raise ValueError(f"t_eps must be in (0, 1), got {t_eps}")
        self.t_eps = float(t_eps)

    def target(self, x_data: torch.Tensor, noise: torch.Tensor, x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return (x_data - x_t) / noise_level(t, x_t, self.t_eps)

    def record(self) -> dict[str, Any] | None:
        return {"kind": "v", "t_eps": self.t_eps}


Prediction = VelocityPrediction | CleanPrediction


def make_prediction(kind: str = "v", t_eps: float = T_EPS, v_target: str = "plain") -> Prediction:
    """What the network predicts (`kind`) and, for the velocity, its training target (`v_target`, V_TARGETS)."""
    if kind not in PREDICTIONS:
        raise ValueError(f"unknown prediction {kind!r}; choose one of: {', '.join(PREDICTIONS)}")
    if v_target not in V_TARGETS:
        raise ValueError(f"unknown velocity target {v_target!r}; choose one of: {', '.join(V_TARGETS)}")
    if kind == "x":
        if v_target != "plain":
            raise ValueError(f"the velocity target {v_target!r} is a velocity prediction's; an x-prediction's "
                             "target is always (x - x_t) / max(1 - t, t_eps)")
        return CleanPrediction(t_eps)
    return ClampedVelocityPrediction(t_eps) if v_target == "clamped" else VelocityPrediction()


def prediction_from_record(record: Any) -> Prediction:
    """The prediction a checkpoint, sidecar or export records (`prediction`: {"kind": "x", "t_eps"}, or
    {"kind": "v", "t_eps"} for the clamped velocity target); absent or None (and {"kind": "v"} without t_eps):
    velocity with the plain target. ValueError for a record this code does not know."""
    if record is None:
        return VelocityPrediction()
    if not isinstance(record, dict) or record.get("kind") not in PREDICTIONS:
        raise ValueError(f"unknown prediction record {record!r} (expected {{'kind': 'x', 't_eps': 0.05}}, "
                         "{'kind': 'v', 't_eps': 0.05} or none)")
    if record["kind"] == "v":
        return make_prediction("v", float(record["t_eps"]), "clamped") if "t_eps" in record else VelocityPrediction()
    return make_prediction("x", float(record.get("t_eps", T_EPS)))

