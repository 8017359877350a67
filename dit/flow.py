"""Flow matching on a linear interpolant with velocity prediction, as SiT trains and samples it
(Ma et al. 2024, "Exploring Flow and Diffusion-based Generative Models with Scalable Interpolant
Transformers", arXiv:2401.08740; stochastic interpolants, Albergo & Vanden-Eijnden 2023).

Convention (SiT's "Linear" path, so that the official SiT checkpoints run unchanged):
- time t in [0, 1]; t = 0 is pure noise, t = 1 is data: x_t = t * x_data + (1 - t) * eps (alpha_t = t,
  sigma_t = 1 - t). This is the reverse direction of rectified flow / SD3, where t = 1 is noise.
- the network predicts the velocity v = d x_t / dt = x_data - eps; the loss is mean((v_pred - v)^2).
- the network receives t itself (a float in [0, 1], not scaled by 1000) in DiT's sinusoidal timestep
  embedder; sampling integrates dx/dt = v(x, t) from t = 0 (noise) to t = 1 (data).
- a DiT built with learn_sigma=True (SiT-XL-2-256x256.pt is one) returns 2C channels; the velocity is the
  first C, the rest is ignored.

Training times: "uniform" U(0, 1) (SiT), or "logit-normal" t = sigmoid(mean + scale * n), n ~ N(0, 1)
(Esser et al. 2024, SD3). SD3 draws its noise level sigma = 1 - t, so SD3's location m is mean = -m here.
A time shift s (dit/shift.py: SD3's, in the noise direction; RAE's sqrt(C H W / 4096)) maps every drawn time
through t / (s + (1 - s) t), and the samplers' grids through the same map.

Cosine-direction loss (LightningDiT's `use_cosine_loss`, hustvl/LightningDiT transport/transport.py and
train.py): 1 - cos(v_pred, v) over the channel dimension at each position, averaged over the positions, added
with weight 1 to the mean squared error; reported as its own term, "cos".

Samplers:
- "euler", "heun": the probability-flow ODE from 0 to 1 in `steps` intervals of a uniform grid (1 and 2
  velocity evaluations per interval; Heun is the explicit trapezoid rule, its corrector evaluating the field
  at the interval's end, t = 1 included: a velocity field is finite on all of [0, 1]).
- "euler-maruyama": the SDE dx = [v + D(t) s(x, t)] dt + sqrt(2 D(t)) dW with the score recovered from the
  velocity, s = (t v - x) / (1 - t), on SiT's grid: `steps` is SiT's `num_steps`, the number of grid points
  from t0 to 1 - last_step_size, so steps - 1 Euler-Maruyama steps, then one noise-free "Mean" step of size
  last_step_size: `steps` velocity evaluations in all, as SiT's (and REPA's) 250-step setting. D(t) is one of
  SiT's diffusion forms (norm w): constant w; SBDM w (1 - t) / t (t0 = sample_eps so that it is finite);
  sigma w (1 - t); linear w (1 - t); decreasing 0.25 (w cos(pi t) + 1)^2; increasing-decreasing w sin(pi t)^2.
All noise comes from the generators given (one per sample: each sample's draws come from its own only).

x-prediction (`prediction="x"`; Li & He 2025, "Back to Basics: Let Denoising Generative Models Denoise",
arXiv:2511.13720, JiT; NanoGen, End2End-Diffusion/diffusion-bench src/stage2/transport/transport.py): the network
outputs the clean image; its velocity is (x_pred - x_t) / max(1 - t, t_eps) and the target (x - x_t) /
max(1 - t, t_eps) (`CleanPrediction`), t_eps 0.05; the loss is still the mean over all elements, and every
sampler converts through the same rule (`velocity_field`), so the samplers are unchanged. Where the two
releases differ (both clamp the noise level at 0.05 and average the loss over all elements):
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

Networks trained in REPA's convention (x_t = (1 - t) x_data + t eps, t = 1 noise, predicting eps - x_data;
Yu et al. 2024, the released REPA checkpoints) sample with `convention="repa"`: the field calls the network at
1 - t and negates its output, so every sampler above runs unchanged in SiT's time. With D = sigma (norm 1),
last_step_size 0.04 and `steps` 250 the SDE is then exactly REPA's Euler-Maruyama sampler (time reversed).
"""
from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch

from .objective_base import ObjectiveDefaults
from .shift import shift_time, shifted_grid

Model = Callable[..., torch.Tensor]
Generators = torch.Generator | Sequence[torch.Generator] | None

T_SAMPLINGS = ("uniform", "logit-normal")
ODE_SAMPLERS = ("euler", "heun")
SDE_SAMPLERS = ("euler-maruyama",)
FLOW_SAMPLERS = ODE_SAMPLERS + SDE_SAMPLERS
FLOW_CONVENTIONS = ("sit", "repa")  # the network's time direction and sign (module docstring)
DIFFUSION_FORMS = ("sigma", "SBDM", "constant", "linear", "decreasing", "increasing-decreasing")
SAMPLE_EPS = 1e-3       # SiT's default start of the SDE grid (used by the SBDM form only)
LAST_STEP_SIZE = 0.04   # SiT's default size of the final noise-free SDE step


def _bcast(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """[N] -> [N, 1, ..., 1] matching x's rank."""
    return t.reshape(-1, *([1] * (x.dim() - 1))).to(x.dtype)


def interpolate(x_data: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """x_t = t x_data + (1 - t) noise (t [N] in [0, 1])."""
    tb = _bcast(t, x_data)
    return tb * x_data + (1 - tb) * noise


def target_velocity(x_data: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """d x_t / dt of the linear interpolant: x_data - noise."""
    return x_data - noise


def score_from_velocity(v: torch.Tensor, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """grad log p_t(x) from the velocity: E[noise | x_t] = x - t v, score = -E[noise | x_t] / (1 - t)."""
    tb = _bcast(t, x)
    return (tb * v - x) / (1 - tb)


def diffusion_coefficient(form: str, t: torch.Tensor, norm: float = 1.0) -> torch.Tensor:
    """SiT's D(t) (the SDE's noise is sqrt(2 D) dW); t [N] -> [N]."""
    if form == "constant":
        return torch.full_like(t, float(norm))
    if form == "SBDM":
        return norm * (1 - t) / t
    if form in ("sigma", "linear"):  # sigma_t = 1 - t on the linear path: the two forms coincide
        return norm * (1 - t)
    if form == "decreasing":
        return 0.25 * (norm * torch.cos(math.pi * t) + 1) ** 2
    if form == "increasing-decreasing":
        return norm * torch.sin(math.pi * t) ** 2
    raise ValueError(f"unknown diffusion form {form!r}; choose one of: {', '.join(DIFFUSION_FORMS)}")


def _randn(shape: Sequence[int], device: torch.device, generator: Generators) -> torch.Tensor:
    """Standard normal [N, ...]; with a list of generators row i is drawn from generator i only."""
    if generator is None:
        return torch.randn(*shape, device=device)
    if isinstance(generator, torch.Generator):
        return torch.randn(*shape, generator=generator, device=generator.device).to(device)
    if len(generator) != shape[0]:
        raise ValueError(f"generator must be a torch.Generator or a list of {shape[0]} (one per sample), "
                         f"got {len(generator)}")
    rows = [torch.randn(*shape[1:], generator=g, device=g.device) for g in generator]
    return torch.stack(rows).to(device)


# ----------------------------------------------------------------------------------------------------------
# What the network predicts (contract: the flow objective's `prediction` setting; samplers convert through it)

PREDICTIONS = ("v", "x")
V_TARGETS = ("plain", "clamped")  # a velocity prediction's target: x - eps, or NanoGen's clamped form
T_EPS = 0.05  # NanoGen's Transport t_eps and JiT's --t_eps: the smallest noise level a conversion divides by


def noise_level(t: torch.Tensor, x: torch.Tensor, t_eps: float) -> torch.Tensor:
    """max(1 - t, t_eps) broadcast to x: the noise level of SiT's time t (NanoGen's t, JiT's 1 - t), clamped as
    both releases clamp the denominator of their velocity."""
    return _bcast(1 - t.to(torch.float32), x).clamp_min(t_eps)


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
        return x_t + _bcast(1 - t.to(torch.float32), x_t) * out

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


class FlowMatching(ObjectiveDefaults):
    """The flow objective with the training interface of `GaussianDiffusion` (`draw_timesteps`,
    `training_losses`) and the flow samplers (`sample_loop`)."""

    objective = "flow"

    def __init__(self, *, t_sampling: str = "uniform", t_mean: float = 0.0, t_scale: float = 1.0,
                 time_shift: float = 1.0, cosine_loss: bool = False, prediction: str = "v", t_eps: float = T_EPS,
                 v_target: str = "plain", reg_coeff: float | None = None, base_model_coeff: float | None = None):
        if t_sampling not in T_SAMPLINGS:
            raise ValueError(f"unknown t sampling {t_sampling!r}; choose one of: {', '.join(T_SAMPLINGS)}")
        if not t_scale > 0:
            raise ValueError(f"logit-normal scale must be > 0, got {t_scale}")
        if not time_shift > 0:
            raise ValueError(f"the time shift must be > 0, got {time_shift}")
        self.t_sampling, self.t_mean, self.t_scale = t_sampling, float(t_mean), float(t_scale)
        self.time_shift, self.cosine_loss = float(time_shift), bool(cosine_loss)
        self.prediction = make_prediction(prediction, t_eps, v_target)
        self.x_terms: list[Any] = []  # loss terms on the predicted clean image (add_x_terms)
        self.x_terms_below = 1.0
        # NanoGen's REG class token and internal guidance's base head (dit/reg.py): their weights, None = off
        self.reg_coeff = None if reg_coeff is None else float(reg_coeff)
        self.base_model_coeff = None if base_model_coeff is None else float(base_model_coeff)

    def add_x_terms(self, terms: Sequence[Any], noise_below: float) -> None:
        """Loss terms on the clean image the network predicts (PixelGen's LPIPS and DINO distances: objects with
        `name`, `fn(x_pred, x) -> [N]` and `weight`), each weighted and counted only where the noise level 1 - t
        is below `noise_below` (NanoGen's `t < percep_loss_t_thresh` in its time), reported under its name and
        added to the loss."""
        self.x_terms, self.x_terms_below = list(terms), float(noise_below)

    def draw_timesteps(self, n: int, *, generator: torch.Generator | None = None,
                       device: torch.device | str | None = None,
                       shared: torch.Generator | None = None) -> torch.Tensor:
        """[n] float32 training times in (0, 1) from `generator` (one draw of n values), shifted by time_shift."""
        if self.t_sampling == "uniform":
            t = torch.rand(n, generator=generator, device=device)
        else:
            t = torch.sigmoid(self.t_mean + self.t_scale * torch.randn(n, generator=generator, device=device))
        return t if self.time_shift == 1.0 else shift_time(t, self.time_shift)

    def val_times(self, levels: torch.Tensor, device: torch.device | str | None = None) -> torch.Tensor:
        """SiT's time of noise levels (data at t = 1): t = 1 - level, unshifted (the shift belongs to the sampler
        of training times, which the validation loss must not depend on)."""
        return (1.0 - levels.to(torch.float64)).to(torch.float32).to(device)

    def training_losses(self, model: Model, x_start: torch.Tensor, t: torch.Tensor,
                        model_kwargs: dict[str, Any] | None = None,
                        noise: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Per-sample {"loss", "mse"} (loss = mse = mean squared velocity error; there is no variational-bound
        term, so none is reported or logged), plus "cos" with cosine_loss (loss = mse + cos). x_start is the
        data x_1, t [N] float times. With REG (`reg_coeff`) `model_kwargs` carries the batch's clean class tokens
        and their noise (dit.reg.REG_TARGET, REG_NOISE): "reg" and loss + reg_coeff x reg; with the base head
        (`base_model_coeff`, internal guidance) "base", its velocity MSE against the image's target, and loss +
        base_model_coeff x base (NanoGen's Transport.training_losses; dit/reg.py)."""
        from .reg import REG_NOISE, REG_TARGET, split_outputs

        if noise is None:
            noise = torch.randn_like(x_start)
        kwargs = dict(model_kwargs or {})
        token = None
        if self.reg_coeff is not None:  # the class token noised with the image's t by the image's formula
            token = (kwargs.pop(REG_TARGET).float(), kwargs.pop(REG_NOISE).float())
            kwargs["cls_t"] = interpolate(token[0], token[1], t)
        if self.base_model_coeff is not None:
            kwargs["return_base"] = True
        x_t = interpolate(x_start, noise, t)
        out, base, cls_pred = split_outputs(model(x_t, t, **kwargs), base=self.base_model_coeff is not None,
                                            reg=token is not None)
        v = self.prediction.velocity(velocity_of(out, x_start.shape[1]).float(), x_t, t)
        target = self.prediction.target(x_start, noise, x_t, t).float()
        mse = ((v - target) ** 2).mean(dim=list(range(1, x_start.dim())))
        terms = {"loss": mse, "mse": mse}
        if base is not None and self.base_model_coeff is not None:
            vb = self.prediction.velocity(velocity_of(base, x_start.shape[1]).float(), x_t, t)
            terms["base"] = ((vb - target) ** 2).mean(dim=list(range(1, x_start.dim())))
            terms["loss"] = terms["loss"] + self.base_model_coeff * terms["base"]
        if cls_pred is not None and token is not None and self.reg_coeff is not None:
            cls_t = kwargs["cls_t"]
            vc = self.prediction.velocity(cls_pred.float(), cls_t, t)
            terms["reg"] = ((vc - self.prediction.target(token[0], token[1], cls_t, t).float()) ** 2).mean(dim=1)
            terms["loss"] = terms["loss"] + self.reg_coeff * terms["reg"]
        if self.cosine_loss:
            terms["cos"] = cosine_direction_loss(v, target)
            terms["loss"] = terms["loss"] + terms["cos"]
        if self.x_terms:
            x_pred = self.prediction.clean(velocity_of(out, x_start.shape[1]).float(), x_t, t)
            counted = ((1 - t.to(torch.float32)) < self.x_terms_below).to(torch.float32)  # [N]
            for term in self.x_terms:
                terms[term.name] = term.weight * term.fn(x_pred, x_start.float()).float() * counted
                terms["loss"] = terms["loss"] + terms[term.name]
        return terms

    @torch.no_grad()
    def sample_loop(self, model: Model, noise: torch.Tensor, *, sampler: str = "euler", steps: int = 50,
                    model_kwargs: dict[str, Any] | None = None, generator: Generators = None,
                    diffusion_form: str = "sigma", diffusion_norm: float = 1.0,
                    last_step_size: float = LAST_STEP_SIZE, sample_eps: float = SAMPLE_EPS,
                    convention: str = "sit", time_shift: float = 1.0,
                    grid: Sequence[float] | None = None, mean_last: bool = True) -> torch.Tensor:
        """Integrate from noise (t = 0) to data (t = 1) -> float32 samples shaped like `noise`; `convention`
        is the network's ("sit", or "repa": called at 1 - t, output negated); `time_shift` shifts the grid
        (dit/shift.py). `grid`: the times themselves (a release's protocol, dit/protocols.py), in place of `steps`,
        `time_shift`, `last_step_size` and `sample_eps` (the SDE's last interval is then its noise-free step where
        `mean_last`)."""
        field = velocity_field(model, noise.shape[1], model_kwargs, convention=convention, prediction=self.prediction)
        if sampler in ODE_SAMPLERS:
            return ode_solve(field, noise, steps=steps, method=sampler, time_shift=time_shift, grid=grid)
        if sampler in SDE_SAMPLERS:
            return sde_solve(field, noise, steps=steps, generator=generator, form=diffusion_form,
                             norm=diffusion_norm, last_step_size=last_step_size, sample_eps=sample_eps,
                             time_shift=time_shift, grid=grid, mean_last=mean_last)
        raise ValueError(f"unknown flow sampler {sampler!r}; choose one of: {', '.join(FLOW_SAMPLERS)}")


def cosine_direction_loss(v: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-sample 1 - cos(v, target), the cosine taken over the channel dimension (dim 1) at each position and
    averaged over the positions: [N, C, ...] -> [N] (LightningDiT's cos_loss)."""
    cos = torch.nn.functional.cosine_similarity(v, target, dim=1)  # [N, ...]
    return (1 - cos).mean(dim=list(range(1, cos.dim()))) if cos.dim() > 1 else 1 - cos


def velocity_of(out: torch.Tensor, channels: int) -> torch.Tensor:
    """The velocity part of a network output: all of it, or the first half of a learn_sigma DiT's."""
    if out.shape[1] == channels:
        return out
    if out.shape[1] == 2 * channels:
        return out[:, :channels]
    raise ValueError(f"model output has {out.shape[1]} channels; expected {channels} or {2 * channels}")


# The attribute of a model function that takes the sampler's float64 grid time (and casts it for its network).
GRID_TIME_ATTR = "takes_grid_time"


def velocity_field(model: Model, channels: int, model_kwargs: dict[str, Any] | None,
                   convention: str = "sit", prediction: Prediction | None = None
                   ) -> Callable[[torch.Tensor, float], torch.Tensor]:
    """(x [N, C, ...], t float) -> float32 v(x, t) in SiT's convention, calling model(x, t [N], **model_kwargs);
    a "repa" network is called at 1 - t (computed in float64 before the float32 cast) and its output negated.
    `prediction` turns the network's output into the velocity (an x-predicting network's clean image: at the
    float32 time t, as the releases convert it)."""
    pred = prediction if prediction is not None else VelocityPrediction()
    if convention not in FLOW_CONVENTIONS:
        raise ValueError(f"unknown flow convention {convention!r}; choose one of: {', '.join(FLOW_CONVENTIONS)}")
    reverse = convention == "repa"

    # A model function that compares the time itself (a guidance interval: sample/generate.py) is given the grid's
    # float64 time and casts it for the network; any other model gets the float32 time (the same rounding).
    dtype = torch.float64 if getattr(model, GRID_TIME_ATTR, False) else torch.float32

    def field(x: torch.Tensor, t: float) -> torch.Tensor:
        tt = torch.full((x.shape[0],), 1.0 - float(t) if reverse else float(t), device=x.device, dtype=dtype)
        out = velocity_of(model(x, tt, **(model_kwargs or {})), channels).float()
        return pred.sit_velocity(out, x, torch.full((x.shape[0],), float(t), device=x.device), reverse)
    return field


def time_grid(t0: float, t1: float, steps: int, time_shift: float = 1.0) -> list[float]:
    """steps + 1 times from t0 to t1, computed in float64: equally spaced, or shifted (dit/shift.py)."""
    return shifted_grid(t0, t1, steps, time_shift)


def ode_solve(field: Callable[[torch.Tensor, float], torch.Tensor], x: torch.Tensor, *, steps: int,
              method: str = "euler", t0: float = 0.0, t1: float = 1.0, time_shift: float = 1.0,
              grid: Sequence[float] | None = None) -> torch.Tensor:
    """Fixed-step Euler or Heun (explicit trapezoid) for dx/dt = field(x, t) from t0 to t1 on time_grid, or on
    `grid` (float64 times, e.g. a release's: dit/protocols.py) when given."""
    if method not in ODE_SAMPLERS:
        raise ValueError(f"unknown ODE method {method!r}; choose one of: {', '.join(ODE_SAMPLERS)}")
    ts = [float(t) for t in grid] if grid is not None else time_grid(t0, t1, steps, time_shift)
    x = x.float()
    for a, b in zip(ts[:-1], ts[1:]):
        h = b - a
        d1 = field(x, a)
        if method == "euler":
            x = x + h * d1
        else:
            d2 = field(x + h * d1, b)
            x = x + 0.5 * h * (d1 + d2)
    return x


def sde_solve(field: Callable[[torch.Tensor, float], torch.Tensor], x: torch.Tensor, *, steps: int,
              generator: Generators = None, form: str = "sigma", norm: float = 1.0,
              last_step_size: float = LAST_STEP_SIZE, sample_eps: float = SAMPLE_EPS,
              time_shift: float = 1.0, grid: Sequence[float] | None = None,
              mean_last: bool = True) -> torch.Tensor:
    """Euler-Maruyama for dx = [v + D s] dt + sqrt(2 D) dW on SiT's grid of `steps` points (steps - 1 steps),
    then the "Mean" last step: `steps` field evaluations (steps - 1 when last_step_size is 0), as SiT's. With
    time_shift the grid's points move as the ODE's (dit/shift.shifted_grid; its ends and the last step stay).
    `grid`: the times themselves (float64; a release's, dit/protocols.py): Euler-Maruyama over every interval but
    the last, which is the noise-free Mean step (`mean_last`; otherwise Euler-Maruyama over every interval)."""
    if grid is not None:
        ts = [float(t) for t in grid]
        if len(ts) < 2:
            raise ValueError(f"the SDE needs a grid of >= 2 times, got {len(ts)}")
        t1, last_step_size = (ts[-2], ts[-1] - ts[-2]) if mean_last else (ts[-1], 0.0)
        ts = ts[:-1] if mean_last else ts
    else:
        if not 0 <= last_step_size < 1:
            raise ValueError(f"last_step_size must be in [0, 1), got {last_step_size}")
        if steps < 2:
            raise ValueError(f"the SDE needs steps >= 2 (SiT's num_steps: points of its time grid), got {steps}")
        t0 = sample_eps if form == "SBDM" else 0.0
        t1 = 1.0 - last_step_size
        ts = time_grid(t0, t1, steps - 1, time_shift)
    x = x.float()

    def drift(x: torch.Tensor, t: float) -> tuple[torch.Tensor, torch.Tensor]:
        tt = torch.full((x.shape[0],), t, device=x.device, dtype=torch.float32)
        d = _bcast(diffusion_coefficient(form, tt, norm), x)
        v = field(x, t)
        return v + d * score_from_velocity(v, x, tt), d

    for a, b in zip(ts[:-1], ts[1:]):
        h = b - a
        dw = _randn(x.shape, x.device, generator) * math.sqrt(h)
        mu, d = drift(x, a)
        x = x + mu * h + torch.sqrt(2 * d) * dw
    if last_step_size > 0:
        mu, _ = drift(x, t1)
        x = x + mu * last_step_size
    return x


def create_flow(t_sampling: str = "uniform", t_mean: float = 0.0, t_scale: float = 1.0, *,
                time_shift: float = 1.0, cosine_loss: bool = False, prediction: str = "v",
                t_eps: float = T_EPS, v_target: str = "plain", reg_coeff: float | None = None,
                base_model_coeff: float | None = None) -> FlowMatching:
    """The flow objective as `dit.create_diffusion` gives the DDPM one."""
    return FlowMatching(t_sampling=t_sampling, t_mean=t_mean, t_scale=t_scale, time_shift=time_shift,
                        cosine_loss=cosine_loss, prediction=prediction, t_eps=t_eps, v_target=v_target,
                        reg_coeff=reg_coeff, base_model_coeff=base_model_coeff)
