"""MeanFlow (Geng et al. 2025, arXiv:2505.13447) and improved MeanFlow (iMF, arXiv:2512.02012): a network
u(z_t, t, h) that predicts the AVERAGE velocity over [r, t] (h = t - r), so that one step z_r = z_t - (t - r) u maps
noise to data.

Convention (the releases', unlike dit/flow.py's SiT time): z_t = (1 - t) x + t e, v = e - x, t = 1 is noise.

Training (`MeanFlow.training_losses`, the formulas of the JAX release's meanflow.py / imf.py):
- time pairs: t and r each logit-normal (t_mean, t_scale), then t = max, r = min; the first `data_proportion` of
  the rank's step gets r = t (`draw_timesteps` returns [n, 2] = (t, r)).
- MeanFlow guidance (omega, kappa in [t_start, t_end]): v_g = omega v + (1 - omega - kappa) u(z_t, t, 0 | null)
  + kappa u(z_t, t, 0 | y); v_g = v outside the interval and for label-dropped samples. Label dropout keeps the
  release's rule (`drop_labels`): k = the number of draws below the dropout probability, and the FIRST k samples are
  dropped (so they are among the r = t ones).
- target u_tgt = v_g - clip(t - r, 0, 1) du/dt, (u, du/dt) = jvp(u(z, t, t - r), (z_t, t, r), (v_g, 1, 0)),
  detached; loss per sample = ||u - u_tgt||^2 (summed over the latent) / (that, detached, + norm_eps)^norm_p.
- iMF (`variant` "imf", the release's: Lyy-iiis/imeanflow imf.py): data_proportion 0.5; omega drawn per sample
  from the power law on [1, 1 + s_max] (exp(u log(1 + s_max))); guidance interval t_min ~ U(0, 0.5), t_max ~
  U(0.5, 1) (0 and 1 for r = t samples); omega, t_min, t_max are inputs of the network (dit/imf.py: in-context
  tokens). v_c, v_u = the network's auxiliary v head at h = 0, (t_min, t_max) = (0, 1), with y and null at omega
  and 1 (`v_fn`, `v_cond_fn`); v_g = v + (1 - 1/omega) (v_c - v_u) for r = t samples, and with omega masked to 1
  outside [t_min, t_max] (v_c recomputed at the masked omega) for the others (`guidance_fn`); labels dropped as
  MeanFlow's (`cond_drop`: the FIRST k samples, v_g = v for them); the JVP tangent is the masked conditional
  velocity v_c, the network sees the unmasked omega; loss = w(||u + (t - r) sg(du/dt) - v_g||^2) + w(||v - v_g||^2)
  with both heads at the sample's own inputs, w the adaptive weight of each term (`forward`; the first term is
  the target form above without the clip). Logged: "mse" of the u term, "mse_v" of the v term.
- `rule` "nanogen" (meanflow variant; NanoGen's TransportMF, End2End-Diffusion/diffusion-bench
  src/stage2/transport/transport.py l.130-320): a whole optimizer step is flow matching with probability
  `data_proportion` (its fm_ratio; one coin per step, the same on every rank: `draw_timesteps(shared=...)`), with one
  logit-normal t per sample and r = t; otherwise every sample is a pair (t, r) = the max and min of two draws. Labels
  (or captions) are dropped per sample where the trainer's draw says (its `apply_cfg_dropout`), and with kappa 0 the
  guided velocity is v_u + omega (v - v_u) from the null pass alone (`guided_velocity` l.150-165). A flow-matching
  step has h = 0 throughout, so its JVP term is zero and the pass is skipped (NanoGen's `_training_losses_fm`).
- `v_target` "clamped" (NanoGen's, l.201 and l.265): the velocity v = (z_t - x) / max(t, t_eps), e - x scaled down
  where the noise level t is below t_eps, in place of e - x ("plain"); v_g, the JVP tangent and the target follow it.
- The condition reaches every pass through the run's `Conditioning` (dit/conditioning.py, given to `attach`): class
  labels or text features, the null condition of the guided velocity its `null` (the null label, the empty
  prompt's features); the trainer's dropped rows arrive as `force_drop_ids` (a text batch's rows already hold the
  empty prompt).
- "imf-adaln" (this project's variant, the only iMF before the release's network was built): the same draws and
  guidance on a network of any adaLN family with the conditions added to its time embedding (dit/conditions.py
  "imf"), no v head (v_c, v_u read from u at h = 0, one loss term), and labels dropped per sample where the
  trainer's draw says (not the release's first k).

The JVP pass. Forward-mode AD has no formula for the fused attention kernels (CPU flash, CUDA flash /
memory-efficient / cuDNN: "Trying to use forward AD with _scaled_dot_product_flash_attention..."); the math
kernel has one. So the JVP runs as its own pass under `sdpa_kernel(jvp_attention)` without autograd (its outputs
are detached anyway), in float32 with autocast off (as the PyTorch port), eager (`torch.compiler.set_stance
("force_eager")`: compiled blocks run uncompiled), on the raw module (not the DDP wrapper); then the ordinary
forward of u with gradient runs through the trainer's model function: DDP (gradients reduced once), the compiled
blocks, activation checkpointing and the fast attention kernel, exactly as for the flow objective. Cost: one JVP
pass (about 2-3 forwards) + one forward + one backward (bench/meanflow_step.py measures it).
"""
from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Sequence

import torch

from .flow_predictions import velocity_of
from .objective_base import ObjectiveDefaults

Model = Callable[..., torch.Tensor]
MEANFLOW_SAMPLERS = ("meanflow",)
JVP_ATTENTION = ("math",)  # SDPA kernels with forward-mode AD (the fused ones have none)
VARIANTS = ("meanflow", "imf", "imf-adaln")
RULES = ("meanflow", "nanogen")  # how a meanflow step is split and labels dropped: the JAX release's, or NanoGen's
# the velocity e - x, or NanoGen's (z_t - x) / max(t, t_eps) (dit.flow_predictions.V_TARGETS)
V_TARGETS = ("plain", "clamped")
CONDITIONS = {"meanflow": "meanflow", "imf": "imf", "imf-adaln": "imf"}  # the network's time input (dit/conditions)
# The JAX releases' defaults: Gsunshine/meanflow configs/default.py (P_mean, P_std, data_proportion 0.75, omega 1.0,
# kappa 0.5, t_start 0, t_end 1, norm_p 1, norm_eps 0.01) and Lyy-iiis/imeanflow configs/default.py, imf.py
# (data_proportion 0.5, cfg_beta 1, s_max 7.0)
DEFAULTS = {"t_mean": -0.4, "t_scale": 1.0, "omega": 1.0, "kappa": 0.5, "t_start": 0.0, "t_end": 1.0, "norm_p": 1.0,
            "norm_eps": 0.01, "s_max": 7.0}
DATA_PROPORTION = {"meanflow": 0.75, "imf": 0.5, "imf-adaln": 0.5}


def _b(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, *([1] * (x.dim() - 1))).to(x.dtype)


def _kwargs(cond: Any) -> dict[str, Any]:
    """The condition's keyword arguments: class labels [N] as `y`, or a mapping as the conditioning gives it."""
    return {"y": cond} if isinstance(cond, torch.Tensor) else dict(cond)


def logit_normal(n: int, mean: float, scale: float, generator: torch.Generator | None,
                 device: torch.device | str | None) -> torch.Tensor:
    return torch.sigmoid(mean + scale * torch.randn(n, generator=generator, device=device))


def time_input(kind: str, t: torch.Tensor, r: torch.Tensor, omega: torch.Tensor | None = None,
               t_min: torch.Tensor | None = None, t_max: torch.Tensor | None = None) -> torch.Tensor:
    """The network's time input (dit/conditions.py) for times t, r [N]: (t, h) or (t, h, omega, t_min, t_max)."""
    cols = [t, t - r]
    if kind == "imf":
        assert omega is not None and t_min is not None and t_max is not None
        cols += [omega, t_min, t_max]
    return torch.stack([c.float() for c in cols], dim=1)


@contextlib.contextmanager
def jvp_context(attention: str = "math", device_type: str = "cpu"):
    """Where the JVP pass runs: no autograd, autocast off, the SDPA kernel `attention`, compiled modules eager."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if attention not in JVP_ATTENTION:
        raise ValueError(f"the JVP needs an attention kernel with forward-mode AD ({', '.join(JVP_ATTENTION)}); "
                         f"got {attention!r}")
    stance = torch.compiler.set_stance("force_eager") if hasattr(torch.compiler, "set_stance") \
        else contextlib.nullcontext()
    with torch.no_grad(), sdpa_kernel([SDPBackend.MATH]), stance, torch.autocast(device_type, enabled=False):
        yield


class MeanFlow(ObjectiveDefaults):
    """The MeanFlow / iMF objective with the trainer's interface (`draw_timesteps`, `drop_labels`, `attach`,
    `training_losses`); `variant` "meanflow", "imf" or "imf-adaln" (module docstring); defaults the releases'."""

    def __init__(self, *, variant: str = "meanflow", t_mean: float = DEFAULTS["t_mean"],
                 t_scale: float = DEFAULTS["t_scale"], data_proportion: float | None = None,
                 omega: float = DEFAULTS["omega"], kappa: float = DEFAULTS["kappa"], t_start: float = DEFAULTS["t_start"],
                 t_end: float = DEFAULTS["t_end"], norm_p: float = DEFAULTS["norm_p"],
                 norm_eps: float = DEFAULTS["norm_eps"], s_max: float = DEFAULTS["s_max"],
                 jvp_attention: str = "math", num_classes: int | None = None, rule: str = "meanflow",
                 v_target: str = "plain", t_eps: float = 0.05):
        if variant not in VARIANTS:
            raise ValueError(f"unknown MeanFlow variant {variant!r}; known: {', '.join(VARIANTS)}")
        if rule not in RULES or (rule != "meanflow" and variant != "meanflow"):
            raise ValueError(f"MeanFlow rule {rule!r}: the meanflow variant takes {', '.join(RULES)}; the iMF "
                             "variants their release's (meanflow)")
        if v_target not in V_TARGETS or not 0 < float(t_eps) < 1:
            raise ValueError(f"MeanFlow velocity target {v_target!r} with t_eps {t_eps}: choose one of "
                             f"{', '.join(V_TARGETS)}, t_eps in (0, 1)")
        self.rule, self.v_target, self.t_eps = rule, v_target, float(t_eps)
        self.objective = self.variant = variant
        self.conditions = CONDITIONS[variant]
        self.v_head = variant == "imf"  # the release's network: an auxiliary v head with its own loss term
        self.t_mean, self.t_scale = float(t_mean), float(t_scale)
        self.data_proportion = float(data_proportion if data_proportion is not None else DATA_PROPORTION[variant])
        self.omega, self.kappa, self.t_start, self.t_end = float(omega), float(kappa), float(t_start), float(t_end)
        self.norm_p, self.norm_eps, self.s_max = float(norm_p), float(norm_eps), float(s_max)
        self.jvp_attention = jvp_attention
        self.num_classes = num_classes
        self.raw: Model | None = None  # the module itself (attach): the JVP and guidance passes run on it
        self.cond: Any = None  # the run's Conditioning (attach): the null condition of the guided velocity

    @property
    def guided(self) -> bool:
        return self.variant != "meanflow" or self.omega != 1.0 or self.kappa != 0.0

    def attach(self, model: Model, conditioning: Any = None) -> None:
        """The raw network (not the DDP wrapper, any compile still inside it) for the passes without gradient, and
        the run's Conditioning (dit/conditioning.py; a text model's with its empty prompt), by default the model's
        own or class labels."""
        self.raw = model
        if getattr(model, "num_classes", None) is not None:
            self.num_classes = int(getattr(model, "num_classes"))
        self.cond = conditioning
        if self.cond is None and callable(getattr(model, "conditioning", None)):
            self.cond = model.conditioning()  # type: ignore[attr-defined]

    def _conditioning(self) -> Any:
        if self.cond is None:
            from .conditioning import ClassLabels

            assert self.num_classes is not None, "MeanFlow.attach(model) first"
            self.cond = ClassLabels(self.num_classes, 0.0)
        return self.cond

    # -- random draws of a step (the trainer draws them for the rank's whole step) -------------------------------
    def draw_timesteps(self, n: int, *, generator: torch.Generator | None = None,
                       device: torch.device | str | None = None,
                       shared: torch.Generator | None = None) -> torch.Tensor:
        """[n, 2] float32 (t, r), t >= r, the first int(n x data_proportion) with r = t. iMF: [n, 5] with its
        omega, t_min, t_max drawn from the same generator after (t, r). Rule nanogen: one coin from `shared` (the
        step's generator common to every rank; `generator` without it) decides whether the whole step is flow
        matching (one draw of t, r = t) or MeanFlow pairs."""
        if self.rule == "nanogen":
            coin = torch.rand(1, generator=shared if shared is not None else generator,
                              device=None if shared is not None else device)
            if float(coin) < self.data_proportion:
                t = logit_normal(n, self.t_mean, self.t_scale, generator, device)
                return torch.stack([t, t], dim=1)
        a = logit_normal(n, self.t_mean, self.t_scale, generator, device)
        b = logit_normal(n, self.t_mean, self.t_scale, generator, device)
        t, r = torch.maximum(a, b), torch.minimum(a, b)
        fm = torch.arange(n, device=t.device) < (0 if self.rule == "nanogen" else int(n * self.data_proportion))
        r = torch.where(fm, t, r)
        if self.variant == "meanflow":
            return torch.stack([t, r], dim=1)
        u = torch.rand(n, generator=generator, device=device)
        omega = torch.exp(u * math.log1p(self.s_max))  # the power law on [1, 1 + s_max] (cfg_beta 1)
        t_min = torch.rand(n, generator=generator, device=device) * 0.5
        t_max = 0.5 + torch.rand(n, generator=generator, device=device) * 0.5
        t_min, t_max = torch.where(fm, 0.0, t_min), torch.where(fm, 1.0, t_max)
        return torch.stack([t, r, omega, t_min, t_max], dim=1)

    def val_times(self, levels: torch.Tensor, device: torch.device | str | None = None) -> torch.Tensor:
        """(t, r) = (level, level) (t = 1 is noise here): the instantaneous velocity, h = 0; iMF's further inputs
        unguided (omega 1 over the whole interval)."""
        t = levels.to(torch.float32).to(device)
        if self.variant == "meanflow":
            return torch.stack([t, t], dim=1)
        one, zero = torch.ones_like(t), torch.zeros_like(t)
        return torch.stack([t, t, one, zero, one], dim=1)

    def drop_labels(self, drop: torch.Tensor) -> torch.Tensor:
        """The label-dropout mask [n] (1 = null class) from the trainer's per-sample draws: MeanFlow and iMF drop the
        FIRST k samples, k = the number of draws that fell below the probability (both releases' `cond_drop`);
        imf-adaln (ours) and rule nanogen (NanoGen's apply_cfg_dropout) keep the per-sample draws."""
        if self.variant == "imf-adaln" or self.rule == "nanogen":
            return drop
        k = int(drop.sum())
        return (torch.arange(drop.shape[0], device=drop.device) < k).to(drop.dtype)

    # -- the loss ------------------------------------------------------------------------------------------------
    def _net(self, z: torch.Tensor, tin: torch.Tensor, cond: Any, drop: torch.Tensor,
             head: str = "u") -> torch.Tensor:
        """u (or, with the release's network, its v head: `head` "v") of the raw module, float32; `cond` the
        condition's keyword arguments (or class labels), `drop` the rows given the null label."""
        assert self.raw is not None, "MeanFlow.attach(model) first"
        extra = {"heads": head} if self.v_head else {}
        return velocity_of(self.raw(z, tin, force_drop_ids=drop, **_kwargs(cond), **extra), z.shape[1]).float()

    def guided_velocity(self, z: torch.Tensor, v: torch.Tensor, tr: torch.Tensor, y: Any,
                        drop: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(v_g, the JVP tangent) of the batch, without gradient (module docstring); `y` the class labels or the
        condition's keyword arguments."""
        t, r = tr[:, 0], tr[:, 1]
        n = z.shape[0]
        keep = torch.zeros_like(drop)
        if not self.guided:
            return v, v
        cond = self._conditioning()
        given = cond.take(_kwargs(y), slice(None))
        both = cond.concat(given, cond.null(given))  # [given; null]
        zeros, ones = torch.zeros_like(t), torch.ones_like(t)
        with torch.no_grad(), torch.autocast(z.device.type, enabled=False):
            if self.variant == "meanflow" and self.rule == "nanogen" and self.kappa == 0.0:
                # NanoGen's own form with kappa 0 (transport.py l.158-160): the null pass alone
                u_u = self._net(z, time_input("meanflow", t, t), cond.null(given), keep)
                mix = u_u + self.omega * (v - u_u)
            elif self.variant == "meanflow":
                out = self._net(torch.cat([z, z]), time_input("meanflow", torch.cat([t, t]), torch.cat([t, t])),
                                both, torch.cat([keep, keep]))
                u_c, u_u = out[:n], out[n:]
                mix = self.omega * v + (1 - self.omega - self.kappa) * u_u + self.kappa * u_c
            if self.variant == "meanflow":
                inside = (t >= self.t_start) & (t <= self.t_end) & (drop == 0)
                v_g = torch.where(_b(inside, v) > 0, mix, v)
                return v_g, v_g
            omega, t_min, t_max = tr[:, 2], tr[:, 3], tr[:, 4]
            fm = t == r
            out = self._net(torch.cat([z, z]), time_input("imf", torch.cat([t, t]), torch.cat([t, t]),
                                                          torch.cat([omega, ones]), torch.cat([zeros, zeros]),
                                                          torch.cat([ones, ones])),
                            both, torch.cat([keep, keep]), head="v")
            v_c, v_u = out[:n], out[n:]
            g_fm = v + _b(1 - 1 / omega, v) * (v_c - v_u)
            w = torch.where((t >= t_min) & (t <= t_max), omega, ones)
            v_cm = self._net(z, time_input("imf", t, t, w, zeros, ones), given, keep, head="v")
            g = v + _b(1 - 1 / w, v) * (v_cm - v_u)
            v_g = torch.where(_b(fm, v) > 0, g_fm, g)
            v_g = torch.where(_b(drop > 0, v) > 0, v, v_g)
            return v_g, v_cm

    def jvp(self, z: torch.Tensor, tr: torch.Tensor, y: Any, drop: torch.Tensor,
            tangent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(u, du/dt) of the network along (dz, dt, dr) = (tangent, 1, 0), in the JVP context (module docstring)."""
        t, r = tr[:, 0], tr[:, 1]
        extra = [tr[:, i] for i in range(2, tr.shape[1])]

        def u_fn(z_: torch.Tensor, t_: torch.Tensor, r_: torch.Tensor) -> torch.Tensor:
            return self._net(z_, time_input(self.conditions, t_, r_, *extra), y, drop)

        with jvp_context(self.jvp_attention, z.device.type):
            out = torch.func.jvp(u_fn, (z.float(), t.float(), r.float()),
                                 (tangent.float(), torch.ones_like(t).float(), torch.zeros_like(r).float()))
        return out[0], out[1]

    def target(self, x: torch.Tensor, noise: torch.Tensor, tr: torch.Tensor, y: Any,
               drop: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(z_t, u_tgt, v_g), without gradient: v_g is the guided velocity, the v head's target; `y` the class
        labels or the condition's keyword arguments."""
        t, r = tr[:, 0], tr[:, 1]
        x, noise = x.float(), noise.float()
        z = (1 - _b(t, x)) * x + _b(t, x) * noise
        # the velocity: e - x, or NanoGen's clamped (z_t - x) / max(t, t_eps) (module docstring)
        v = noise - x if self.v_target == "plain" else (z - x) / _b(t.clamp_min(self.t_eps), x)
        v_g, tangent = self.guided_velocity(z, v, tr, y, drop)
        h = t - r
        if self.variant == "meanflow":
            h = h.clamp(0.0, 1.0)
        if bool((h == 0).all()):  # a flow-matching step (rule nanogen): the JVP term is zero, skip the pass
            return z, v_g.detach(), v_g.detach()
        _, dudt = self.jvp(z, tr, y, drop, tangent)
        return z, (v_g - _b(h, v) * dudt).detach(), v_g.detach()

    def training_losses(self, model: Model, x_start: torch.Tensor, t: torch.Tensor,
                        model_kwargs: dict[str, Any] | None = None,
                        noise: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Per-sample {"loss" (adaptively weighted), "mse" (mean squared error to the target), and with the v head
        "mse_v" (its term's)}; `t` is draw_timesteps' [N, 2] (or iMF's [N, 5]); `model` the trainer's model function
        (gradient pass: with the v head, one forward of both heads)."""
        kwargs = dict(model_kwargs or {})
        if noise is None:
            noise = torch.randn_like(x_start)
        drop = kwargs.get("force_drop_ids")
        drop = torch.zeros(x_start.shape[0], dtype=torch.long, device=x_start.device) if drop is None else drop
        kwargs["force_drop_ids"] = drop
        if self.raw is None:
            self.attach(model)
        cond = {k: v for k, v in kwargs.items() if k != "force_drop_ids"}  # labels, or text and its mask
        z, u_tgt, v_g = self.target(x_start, noise, t, cond, drop)
        tin = time_input(self.conditions, t[:, 0], t[:, 1], *[t[:, i] for i in range(2, t.shape[1])])
        c = x_start.shape[1]
        if not self.v_head:
            u = velocity_of(model(z, tin, **kwargs), c).float()
            err = self._sq(u, u_tgt)
            return {"loss": self._weighted(err), "mse": err.detach() / u[0].numel()}
        out = model(z, tin, heads="uv", **kwargs).float()  # [u; v] along the channels (dit/imf.py)
        u, v = out[:, :c], out[:, c:]
        err, err_v = self._sq(u, u_tgt), self._sq(v, v_g)
        return {"loss": self._weighted(err) + self._weighted(err_v), "mse": err.detach() / u[0].numel(),
                "mse_v": err_v.detach() / v[0].numel()}

    @staticmethod
    def _sq(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return ((a - b) ** 2).sum(dim=list(range(1, a.dim())))

    def _weighted(self, err: torch.Tensor) -> torch.Tensor:
        """The releases' adaptive weight: err / sg(err + eps)^p."""
        return err / (err.detach() + self.norm_eps) ** self.norm_p


class MeanFlowLoop:
    """n-step mean-flow sampling on linspace(1, 0, steps + 1): z_r = z_t - (t - r) u(z_t, t, t - r); one network
    evaluation per step. iMF's network also takes the guidance scale omega and interval (t_min, t_max)."""

    def __init__(self, steps: int = 1, *, conditions: str = "meanflow", omega: float = 1.0,
                 interval: Sequence[float] = (0.0, 1.0), grid: Sequence[float] | None = None):
        if steps < 1:
            raise ValueError(f"mean-flow sampling needs steps >= 1, got {steps}")
        self.sampler, self.steps, self.conditions = "meanflow", int(steps), conditions
        self.omega, self.interval = float(omega), (float(interval[0]), float(interval[1]))
        # the times from 1 (noise) to 0 (a protocol's, dit/protocols.py); by default linspace(1, 0, steps + 1)
        self.grid = [float(t) for t in grid] if grid is not None else [1.0 - i / self.steps for i in range(steps + 1)]
        if len(self.grid) != self.steps + 1:
            raise ValueError(f"a mean-flow grid of {self.steps} steps has {self.steps + 1} times, got {len(self.grid)}")

    def bind(self, conditions: str, cfg_scale: float = 1.0) -> "MeanFlowLoop":
        """This loop for a model with `conditions` (dit/conditions.py); an iMF model's omega is `cfg_scale`.
        ValueError for a model without the mean-flow time inputs."""
        if conditions not in ("meanflow", "imf"):
            raise ValueError("the meanflow sampler needs a MeanFlow model (one trained with --objective meanflow "
                             f"or imf); this model's time input is {conditions!r}")
        return MeanFlowLoop(self.steps, conditions=conditions,
                            omega=float(cfg_scale) if conditions == "imf" else 1.0, interval=self.interval,
                            grid=self.grid)

    def __call__(self, fn: Model, noise: torch.Tensor, labels: torch.Tensor,
                 generators: Sequence[torch.Generator] | None = None) -> torch.Tensor:
        z = noise.float()
        n = z.shape[0]
        for a, b in zip(self.grid[:-1], self.grid[1:]):
            t = torch.full((n,), a, device=z.device)
            r = torch.full((n,), b, device=z.device)
            extra = [] if self.conditions != "imf" else [torch.full((n,), v, device=z.device) for v in
                                                          (self.omega, *self.interval)]
            u = velocity_of(fn(z, time_input(self.conditions, t, r, *extra), labels), z.shape[1]).float()
            z = z - (a - b) * u
        return z
