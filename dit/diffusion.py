"""Gaussian diffusion as DiT trains and samples it (DDPM, Ho et al. 2020; IDDPM, Nichol & Dhariwal 2021).

Conventions follow docs/REFERENCE.md: linear betas 1e-4..0.02 (x 1000/steps) and every table in float64,
cast to float32 when gathered for a batch of timesteps; epsilon prediction; "learned range" variance;
hybrid loss mse + vb (vb in bits, mean detached, discretized Gaussian NLL at t = 0); respacing with the
model always called at the original step index; DDPM and DDIM (eta) sampling loops. Random draws in the
loops follow the reference order (initial noise, then one draw per step) so a seeded global RNG gives
the reference's samples; `generator` can instead be one torch.Generator or a list of per-sample ones.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch

from .objective_base import ObjectiveDefaults
from .respace import respaced_betas, space_timesteps

Model = Callable[..., torch.Tensor]
Generators = torch.Generator | Sequence[torch.Generator] | None


def linear_betas(num_timesteps: int = 1000) -> np.ndarray:
    """float64 linspace(1e-4, 0.02) scaled by 1000 / num_timesteps."""
    scale = 1000.0 / num_timesteps
    return np.linspace(scale * 1e-4, scale * 0.02, num_timesteps, dtype=np.float64)


def mean_flat(x: torch.Tensor) -> torch.Tensor:
    """Mean over every dimension but the batch one, in float32 whatever the autocast (a loss reduction)."""
    return x.float().mean(dim=list(range(1, x.dim())))


def normal_kl(mean1: torch.Tensor, logvar1: torch.Tensor, mean2: torch.Tensor,
              logvar2: torch.Tensor) -> torch.Tensor:
    """Elementwise KL(N(mean1, e^logvar1) || N(mean2, e^logvar2)) in nats."""
    return 0.5 * (-1.0 + logvar2 - logvar1 + torch.exp(logvar1 - logvar2)
                  + (mean1 - mean2) ** 2 * torch.exp(-logvar2))


def approx_standard_normal_cdf(x: torch.Tensor) -> torch.Tensor:
    """The tanh approximation of the standard normal CDF."""
    return 0.5 * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3))))


def discretized_gaussian_log_likelihood(x: torch.Tensor, means: torch.Tensor,
                                        log_scales: torch.Tensor) -> torch.Tensor:
    """log P(x) for data in [-1, 1] quantised to 256 bins of width 2/255; edge bins open (|x| > 0.999)."""
    centered = x - means
    inv_stdv = torch.exp(-log_scales)
    cdf_plus = approx_standard_normal_cdf(inv_stdv * (centered + 1.0 / 255.0))
    cdf_min = approx_standard_normal_cdf(inv_stdv * (centered - 1.0 / 255.0))
    log_cdf_plus = torch.log(cdf_plus.clamp(min=1e-12))
    log_one_minus_cdf_min = torch.log((1.0 - cdf_min).clamp(min=1e-12))
    log_cdf_delta = torch.log((cdf_plus - cdf_min).clamp(min=1e-12))
    return torch.where(x < -0.999, log_cdf_plus,
                       torch.where(x > 0.999, log_one_minus_cdf_min, log_cdf_delta))


class GaussianDiffusion(ObjectiveDefaults):
    """A (possibly respaced) diffusion process; `t` arguments index its own steps 0..num_timesteps-1."""

    objective = "ddpm"

    def __init__(self, betas: np.ndarray, *, learn_sigma: bool = True, sigma_small: bool = False,
                 timestep_map: Sequence[int] | None = None):
        betas = np.asarray(betas, dtype=np.float64)
        if betas.ndim != 1 or len(betas) < 1 or not ((betas > 0) & (betas <= 1)).all():
            raise ValueError("betas must be a non-empty 1-D array with values in (0, 1]")
        self.learn_sigma, self.sigma_small = bool(learn_sigma), bool(sigma_small)
        self.num_timesteps = len(betas)
        self.timestep_map = list(range(len(betas)) if timestep_map is None else timestep_map)
        assert len(self.timestep_map) == self.num_timesteps
        self.betas = betas
        alphas = 1.0 - betas
        self.alphas_cumprod = np.cumprod(alphas)
        self.alphas_cumprod_prev = np.append(1.0, self.alphas_cumprod[:-1])
        self.alphas_cumprod_next = np.append(self.alphas_cumprod[1:], 0.0)
        self.sqrt_alphas_cumprod = np.sqrt(self.alphas_cumprod)
        self.sqrt_one_minus_alphas_cumprod = np.sqrt(1.0 - self.alphas_cumprod)
        self.sqrt_recip_alphas_cumprod = np.sqrt(1.0 / self.alphas_cumprod)
        self.sqrt_recipm1_alphas_cumprod = np.sqrt(1.0 / self.alphas_cumprod - 1)
        # Variance of q(x_{t-1} | x_t, x_0); it is 0 at t = 0, so its log uses the t = 1 value there.
        self.posterior_variance = betas * (1.0 - self.alphas_cumprod_prev) / (1.0 - self.alphas_cumprod)
        self.posterior_log_variance_clipped = np.log(
            np.append(self.posterior_variance[1], self.posterior_variance[1:])
            if len(betas) > 1 else self.posterior_variance)
        self.posterior_mean_coef1 = betas * np.sqrt(self.alphas_cumprod_prev) / (1.0 - self.alphas_cumprod)
        self.posterior_mean_coef2 = ((1.0 - self.alphas_cumprod_prev) * np.sqrt(alphas)
                                     / (1.0 - self.alphas_cumprod))
        self.log_betas = np.log(betas)
        # Fixed variances used when the model does not learn sigma ("large": beta_t; "small": posterior).
        large = np.append(self.posterior_variance[1], betas[1:]) if len(betas) > 1 else betas
        self.fixed_variance = self.posterior_variance if sigma_small else large
        self.fixed_log_variance = self.posterior_log_variance_clipped if sigma_small else np.log(large)
        self._cache: dict[tuple[str, torch.device], torch.Tensor] = {}

    # -- tables ---------------------------------------------------------------------------------------
    def _gather(self, name: str, t: torch.Tensor, ndim: int) -> torch.Tensor:
        """Table `name` at timesteps t [N] as float32 [N, 1, ...] (float64 values rounded once)."""
        key = (name, t.device)
        table = self._cache.get(key)
        if table is None:
            table = torch.from_numpy(getattr(self, name)).to(device=t.device, dtype=torch.float32)
            self._cache[key] = table
        return table[t].reshape(-1, *([1] * (ndim - 1)))

    def _call_model(self, model: Model, x: torch.Tensor, t: torch.Tensor,
                    model_kwargs: dict[str, Any] | None) -> torch.Tensor:
        """Run the model at the ORIGINAL step indices; returns its output as float32."""
        key = ("timestep_map", t.device)
        mapping = self._cache.get(key)
        if mapping is None:
            mapping = torch.tensor(self.timestep_map, dtype=torch.long, device=t.device)
            self._cache[key] = mapping
        out = model(x, mapping[t].to(t.dtype), **(model_kwargs or {}))
        channels = x.shape[1] * (2 if self.learn_sigma else 1)
        if out.shape != (x.shape[0], channels, *x.shape[2:]):
            raise ValueError(f"model output has shape {list(out.shape)}, expected "
                             f"{[x.shape[0], channels, *x.shape[2:]]} (learn_sigma={self.learn_sigma}); "
                             "build the diffusion with the model's learn_sigma")
        return out.float()

    def draw_timesteps(self, n: int, *, generator: torch.Generator | None = None,
                       device: torch.device | str | None = None,
                       shared: torch.Generator | None = None) -> torch.Tensor:
        """[n] training steps, uniform over 0..num_timesteps-1 (one randint draw from `generator`)."""
        return torch.randint(0, self.num_timesteps, (n,), generator=generator, device=device)

    def val_times(self, levels: torch.Tensor, device: torch.device | str | None = None) -> torch.Tensor:
        """The discrete steps of noise levels: floor(level x num_timesteps) (level 0: step 0, the least noise)."""
        return torch.floor(levels.to(torch.float64) * self.num_timesteps).long().clamp(0, self.num_timesteps - 1).to(device)

    # -- forward process ------------------------------------------------------------------------------
    def q_sample(self, x_start: torch.Tensor, t: torch.Tensor,
                 noise: torch.Tensor | None = None) -> torch.Tensor:
        """x_t = sqrt(abar_t) x_0 + sqrt(1 - abar_t) noise."""
        if noise is None:
            noise = torch.randn_like(x_start)
        n = x_start.dim()
        return (self._gather("sqrt_alphas_cumprod", t, n) * x_start
                + self._gather("sqrt_one_minus_alphas_cumprod", t, n) * noise)

    def q_posterior_mean_variance(self, x_start: torch.Tensor, x_t: torch.Tensor,
                                  t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Mean, variance and clipped log variance of q(x_{t-1} | x_t, x_0)."""
        n = x_t.dim()
        mean = (self._gather("posterior_mean_coef1", t, n) * x_start
                + self._gather("posterior_mean_coef2", t, n) * x_t)
        return (mean, self._gather("posterior_variance", t, n),
                self._gather("posterior_log_variance_clipped", t, n))

    # -- reverse process ------------------------------------------------------------------------------
    def p_mean_variance(self, model: Model, x: torch.Tensor, t: torch.Tensor,
                        clip_denoised: bool = False, model_kwargs: dict[str, Any] | None = None,
                        denoised_fn: Callable[[torch.Tensor], torch.Tensor] | None = None
                        ) -> dict[str, torch.Tensor]:
        """p(x_{t-1} | x_t): {"mean", "variance", "log_variance", "pred_xstart"}."""
        out = self._call_model(model, x, t, model_kwargs)
        return self._p_from_output(out, x, t, clip_denoised, denoised_fn)

    def _p_from_output(self, model_output: torch.Tensor, x: torch.Tensor, t: torch.Tensor,
                       clip_denoised: bool = False,
                       denoised_fn: Callable[[torch.Tensor], torch.Tensor] | None = None
                       ) -> dict[str, torch.Tensor]:
        n = x.dim()
        if self.learn_sigma:
            eps, v = model_output.split(x.shape[1], dim=1)
            min_log = self._gather("posterior_log_variance_clipped", t, n)
            max_log = self._gather("log_betas", t, n)
            frac = (v + 1) / 2  # v in [-1, 1] interpolates between the two log variances
            log_variance = frac * max_log + (1 - frac) * min_log
            variance = torch.exp(log_variance)
        else:
            eps = model_output
            shape = x.shape
            variance = self._gather("fixed_variance", t, n).expand(shape)
            log_variance = self._gather("fixed_log_variance", t, n).expand(shape)
        pred_xstart = self._predict_xstart_from_eps(x, t, eps)
        if denoised_fn is not None:
            pred_xstart = denoised_fn(pred_xstart)
        if clip_denoised:
            pred_xstart = pred_xstart.clamp(-1, 1)
        mean, _, _ = self.q_posterior_mean_variance(pred_xstart, x, t)
        return {"mean": mean, "variance": variance, "log_variance": log_variance,
                "pred_xstart": pred_xstart}

    def _predict_xstart_from_eps(self, x_t: torch.Tensor, t: torch.Tensor,
                                 eps: torch.Tensor) -> torch.Tensor:
        n = x_t.dim()
        return (self._gather("sqrt_recip_alphas_cumprod", t, n) * x_t
                - self._gather("sqrt_recipm1_alphas_cumprod", t, n) * eps)

    def _predict_eps_from_xstart(self, x_t: torch.Tensor, t: torch.Tensor,
                                 pred_xstart: torch.Tensor) -> torch.Tensor:
        n = x_t.dim()
        return ((self._gather("sqrt_recip_alphas_cumprod", t, n) * x_t - pred_xstart)
                / self._gather("sqrt_recipm1_alphas_cumprod", t, n))

    # -- training -------------------------------------------------------------------------------------
    def training_losses(self, model: Model, x_start: torch.Tensor, t: torch.Tensor,
                        model_kwargs: dict[str, Any] | None = None,
                        noise: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """{"loss", "mse", "vb"}, each [N]. loss = mse + vb with learned sigma; vb (bits) trains only the
        variance output. Without learned sigma loss = mse and vb is zeros."""
        if noise is None:
            noise = torch.randn_like(x_start)
        x_t = self.q_sample(x_start, t, noise)
        out = self._call_model(model, x_t, t, model_kwargs).float()  # the loss in float32 under any autocast
        if not self.learn_sigma:
            mse = mean_flat((noise - out) ** 2)
            return {"loss": mse, "mse": mse, "vb": torch.zeros_like(mse)}
        eps, v = out.split(x_start.shape[1], dim=1)
        mse = mean_flat((noise - eps) ** 2)
        frozen = torch.cat([eps.detach(), v], dim=1)  # the vb term must not move the mean
        vb = self._vb_bits(frozen, x_start, x_t, t)
        return {"loss": mse + vb, "mse": mse, "vb": vb}

    def _vb_bits(self, model_output: torch.Tensor, x_start: torch.Tensor, x_t: torch.Tensor,
                 t: torch.Tensor) -> torch.Tensor:
        """KL(q(x_{t-1}|x_t,x_0) || p(x_{t-1}|x_t)) per sample in bits; decoder NLL at t = 0."""
        true_mean, _, true_log_var = self.q_posterior_mean_variance(x_start, x_t, t)
        p = self._p_from_output(model_output, x_t, t)
        kl = mean_flat(normal_kl(true_mean, true_log_var, p["mean"], p["log_variance"])) / math.log(2.0)
        nll = -discretized_gaussian_log_likelihood(x_start, p["mean"], 0.5 * p["log_variance"])
        nll = mean_flat(nll) / math.log(2.0)
        return torch.where(t == 0, nll, kl)

    # -- sampling -------------------------------------------------------------------------------------
    def p_sample(self, model: Model, x: torch.Tensor, t: torch.Tensor, clip_denoised: bool = False,
                 model_kwargs: dict[str, Any] | None = None, generator: Generators = None,
                 denoised_fn: Callable[[torch.Tensor], torch.Tensor] | None = None
                 ) -> dict[str, torch.Tensor]:
        """One ancestral step: {"sample", "pred_xstart"}; no noise added at t = 0."""
        out = self.p_mean_variance(model, x, t, clip_denoised, model_kwargs, denoised_fn)
        noise = _randn(x.shape, x.device, generator)
        nonzero = (t != 0).float().reshape(-1, *([1] * (x.dim() - 1)))
        sample = out["mean"] + nonzero * torch.exp(0.5 * out["log_variance"]) * noise
        return {"sample": sample, "pred_xstart": out["pred_xstart"]}

    def ddim_sample(self, model: Model, x: torch.Tensor, t: torch.Tensor, clip_denoised: bool = False,
                    model_kwargs: dict[str, Any] | None = None, eta: float = 0.0,
                    generator: Generators = None,
                    denoised_fn: Callable[[torch.Tensor], torch.Tensor] | None = None
                    ) -> dict[str, torch.Tensor]:
        """One DDIM step (Song et al. 2021, eq. 12): {"sample", "pred_xstart"}."""
        out = self.p_mean_variance(model, x, t, clip_denoised, model_kwargs, denoised_fn)
        eps = self._predict_eps_from_xstart(x, t, out["pred_xstart"])
        abar = self._gather("alphas_cumprod", t, x.dim())
        abar_prev = self._gather("alphas_cumprod_prev", t, x.dim())
        sigma = eta * torch.sqrt((1 - abar_prev) / (1 - abar)) * torch.sqrt(1 - abar / abar_prev)
        noise = _randn(x.shape, x.device, generator)  # drawn even for eta = 0: same RNG stream
        mean = out["pred_xstart"] * torch.sqrt(abar_prev) + torch.sqrt(1 - abar_prev - sigma ** 2) * eps
        nonzero = (t != 0).float().reshape(-1, *([1] * (x.dim() - 1)))
        return {"sample": mean + nonzero * sigma * noise, "pred_xstart": out["pred_xstart"]}

    def p_sample_loop(self, model: Model, shape: Sequence[int], noise: torch.Tensor | None = None,
                      clip_denoised: bool = False, model_kwargs: dict[str, Any] | None = None,
                      progress: bool = False, generator: Generators = None, *,
                      device: torch.device | str | None = None,
                      denoised_fn: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        """Ancestral sampling from step num_timesteps-1 down to 0; returns x_0 [shape].

        `generator`: None (global RNG, the reference's draw order), a torch.Generator, or a list of
        len(shape[0]) generators, one per sample: sample i's initial noise (unless `noise` is given) and
        every step's noise are drawn from generator i only, so results do not depend on the batch size.
        """
        final = None
        for final in self.p_sample_loop_progressive(model, shape, noise, clip_denoised, model_kwargs,
                                                    progress, generator, device=device,
                                                    denoised_fn=denoised_fn):
            pass
        assert final is not None  # the loop yields once per step, and there is at least one
        return final["sample"]

    def ddim_sample_loop(self, model: Model, shape: Sequence[int], noise: torch.Tensor | None = None,
                         clip_denoised: bool = False, model_kwargs: dict[str, Any] | None = None,
                         progress: bool = False, generator: Generators = None, eta: float = 0.0, *,
                         device: torch.device | str | None = None,
                         denoised_fn: Callable[[torch.Tensor], torch.Tensor] | None = None
                         ) -> torch.Tensor:
        """DDIM sampling (eta = 0: deterministic given the initial noise); see p_sample_loop."""
        final = None
        for final in self.p_sample_loop_progressive(model, shape, noise, clip_denoised, model_kwargs,
                                                    progress, generator, device=device,
                                                    denoised_fn=denoised_fn, ddim_eta=eta):
            pass
        assert final is not None  # the loop yields once per step, and there is at least one
        return final["sample"]

    def p_sample_loop_progressive(self, model: Model, shape: Sequence[int],
                                  noise: torch.Tensor | None = None, clip_denoised: bool = False,
                                  model_kwargs: dict[str, Any] | None = None, progress: bool = False,
                                  generator: Generators = None, *,
                                  device: torch.device | str | None = None,
                                  denoised_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
                                  ddim_eta: float | None = None) -> Iterator[dict[str, torch.Tensor]]:
        """Yield {"sample", "pred_xstart"} after every step (DDIM when ddim_eta is not None)."""
        shape = tuple(int(s) for s in shape)
        _check_generators(generator, shape[0])
        if noise is not None:
            if tuple(noise.shape) != shape:
                raise ValueError(f"noise has shape {list(noise.shape)}, expected {list(shape)}")
            x = noise
        else:
            x = _randn(shape, _pick_device(device, model), generator)
        steps = range(self.num_timesteps - 1, -1, -1)
        if progress:
            from tqdm.auto import tqdm  # optional, only when asked for

            steps = tqdm(steps)
        for i in steps:
            t = torch.full((shape[0],), i, dtype=torch.long, device=x.device)
            with torch.no_grad():
                if ddim_eta is None:
                    out = self.p_sample(model, x, t, clip_denoised, model_kwargs, generator, denoised_fn)
                else:
                    out = self.ddim_sample(model, x, t, clip_denoised, model_kwargs, ddim_eta,
                                           generator, denoised_fn)
            yield out
            x = out["sample"]


def _check_generators(generator: Generators, batch: int) -> None:
    if generator is None or isinstance(generator, torch.Generator):
        return
    if len(generator) != batch or not all(isinstance(g, torch.Generator) for g in generator):
        raise ValueError(f"generator must be a torch.Generator or a list of {batch} (one per sample), "
                         f"got {type(generator).__name__} of length {len(generator)}")


def _randn(shape: Sequence[int], device: torch.device | str, generator: Generators) -> torch.Tensor:
    """Standard normal noise; per-sample generators draw their own row, on the generator's device."""
    if generator is None:
        return torch.randn(*shape, device=device)
    if isinstance(generator, torch.Generator):
        return torch.randn(*shape, generator=generator, device=generator.device).to(device)
    rows = [torch.randn(*shape[1:], generator=g, device=g.device) for g in generator]
    if len({r.device for r in rows}) == 1:  # one transfer for the batch, not one per sample
        return torch.stack(rows).to(device)
    return torch.stack([r.to(device) for r in rows])


def _pick_device(device: torch.device | str | None, model: Model) -> torch.device:
    """Explicit device, else the device of the model's (or the bound method's owner's) parameters."""
    if device is not None:
        return torch.device(device)
    owner = getattr(model, "__self__", model)
    params = getattr(owner, "parameters", None)
    if callable(params):
        for p in params():
            return p.device
    return torch.device("cpu")


def create_diffusion(timestep_respacing: str | list[int] = "", noise_schedule: str = "linear",
                     learn_sigma: bool = True, sigma_small: bool = False,
                     diffusion_steps: int = 1000) -> GaussianDiffusion:
    """DiT's diffusion: `create_diffusion("")` for training, `create_diffusion("250")` or "ddim50" for
    sampling. Respacing "" (or None) keeps all `diffusion_steps` steps."""
    if noise_schedule != "linear":
        raise ValueError(f"noise_schedule {noise_schedule!r} is not supported; DiT uses 'linear'")
    if diffusion_steps < 2:
        raise ValueError(f"diffusion_steps must be >= 2, got {diffusion_steps}")
    betas = linear_betas(diffusion_steps)
    if timestep_respacing in (None, ""):
        return GaussianDiffusion(betas, learn_sigma=learn_sigma, sigma_small=sigma_small)
    use = space_timesteps(diffusion_steps, timestep_respacing)
    base = GaussianDiffusion(betas, learn_sigma=learn_sigma, sigma_small=sigma_small)
    return GaussianDiffusion(respaced_betas(base.alphas_cumprod, use), learn_sigma=learn_sigma,
                             sigma_small=sigma_small, timestep_map=use)
