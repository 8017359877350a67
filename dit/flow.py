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

What the network predicts (the velocity, x-prediction, NanoGen's clamped velocity target) and the linear path are
in dit/flow_predictions.py; the ODE and SDE samplers that `FlowMatching.sample_loop` runs, and REPA's time
convention, in dit/flow_samplers.py.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from .flow_predictions import T_EPS, interpolate, make_prediction, velocity_of
from .flow_samplers import (FLOW_SAMPLERS, LAST_STEP_SIZE, ODE_SAMPLERS, SAMPLE_EPS, SDE_SAMPLERS, Generators, Model,
                            ode_solve, sde_solve, velocity_field)
from .objective_base import ObjectiveDefaults
from .shift import shift_time

T_SAMPLINGS = ("uniform", "logit-normal")


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


def create_flow(t_sampling: str = "uniform", t_mean: float = 0.0, t_scale: float = 1.0, *,
                time_shift: float = 1.0, cosine_loss: bool = False, prediction: str = "v",
                t_eps: float = T_EPS, v_target: str = "plain", reg_coeff: float | None = None,
                base_model_coeff: float | None = None) -> FlowMatching:
    """The flow objective as `dit.create_diffusion` gives the DDPM one."""
    return FlowMatching(t_sampling=t_sampling, t_mean=t_mean, t_scale=t_scale, time_shift=time_shift,
                        cosine_loss=cosine_loss, prediction=prediction, t_eps=t_eps, v_target=v_target,
                        reg_coeff=reg_coeff, base_model_coeff=base_model_coeff)
