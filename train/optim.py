"""The optimizer of a training run: AdamW (DiT, SiT, REPA, LightningDiT, RAE), or Muon for the 2-D weights with
AdamW for every other tensor (RAEv2's choice, nanovisionx/RAEv2 src/utils/optim_utils.py and
configs/stage2/training: Muon lr 2e-4, momentum 0.95, Nesterov, no weight decay, on every tensor with
ndim == 2; AdamW on the rest at the same lr).

Muon (Jordan et al. 2024, "Muon: An optimizer for hidden layers in neural networks") is `torch.optim.Muon`,
present from PyTorch 2.9; this project's floor is torch 2.6, so `--optimizer muon` on an older torch is one
clear refusal naming the installed version, before any work. Muon orthogonalises each 2-D update by a
Newton-Schulz iteration; `--muon-adjust-lr match_rms_adamw` (the default, Moonlight's: lr x 0.2 sqrt(max(A, B)))
scales its update to AdamW's RMS so both halves run at one lr, as RAEv2 runs them; `original` is Keller
Jordan's max(1, A / B)^0.5. RAEv2's Muon is a different implementation (gram_newton_schulz, Polar Express
coefficients); torch's uses the fixed quintic (3.4445, -4.775, 2.0315), so the two are not bit-equal.

The two optimizers act as one (`MuonWithAdamW`): one list of parameter groups (the trainer sets each step's lr on
all of them), one `step`, one `zero_grad`, and one state_dict {"muon": ..., "adamw": ...} in the checkpoint's
`opt`, so a resume continues both exactly. GradScaler (fp16) unscales and steps it as any optimizer.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any, Iterable, Mapping

import torch

OPTIMIZERS = ("adamw", "muon")
MUON_ADJUST_LR = ("match_rms_adamw", "original")  # torch.optim.Muon's adjust_lr_fn values offered here
MUON_FROM = "2.9"  # the first PyTorch release with torch.optim.Muon


def muon_available() -> bool:
    return getattr(torch.optim, "Muon", None) is not None


def optimizer_problems(cfg: Any) -> list[str]:
    """Problems of the optimizer settings of a TrainConfig (`optimizer`, `muon_momentum`, `muon_adjust_lr`)."""
    p: list[str] = []
    if cfg.optimizer not in OPTIMIZERS:
        return [f"--optimizer must be one of {', '.join(OPTIMIZERS)}, got {cfg.optimizer!r}"]
    if cfg.optimizer == "muon" and not muon_available():
        p.append(f"--optimizer muon needs torch.optim.Muon (PyTorch {MUON_FROM} and later), which torch "
                 f"{torch.__version__} lacks: upgrade torch, or use --optimizer adamw")
    if not (isinstance(cfg.muon_momentum, (int, float)) and 0.0 <= cfg.muon_momentum < 1.0):
        p.append(f"--muon-momentum must be in [0, 1), got {cfg.muon_momentum!r}")
    if cfg.muon_adjust_lr not in MUON_ADJUST_LR:
        p.append(f"--muon-adjust-lr must be one of {', '.join(MUON_ADJUST_LR)}, got {cfg.muon_adjust_lr!r}")
    elif cfg.optimizer == "adamw" and (cfg.muon_momentum, cfg.muon_adjust_lr) != (0.95, "match_rms_adamw"):
        p.append("--muon-momentum and --muon-adjust-lr set Muon: add --optimizer muon (or drop them)")
    return p


def split_for_muon(params: Iterable[torch.nn.Parameter]) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    """(the 2-D tensors, which Muon updates; every other tensor, which AdamW updates), each in model order."""
    muon: list[torch.nn.Parameter] = []
    rest: list[torch.nn.Parameter] = []
    for q in params:
        (muon if q.ndim == 2 else rest).append(q)
    return muon, rest


class MuonWithAdamW(torch.optim.Optimizer):
    """torch.optim.Muon on the 2-D tensors and AdamW on the rest, driven as one optimizer (module docstring).

    It subclasses Optimizer only for its type: the state lives in the two inner optimizers, whose groups
    `param_groups` lists (the same dicts, so setting a group's lr sets the inner optimizer's)."""

    def __init__(self, muon: torch.optim.Optimizer, adamw: torch.optim.Optimizer):  # no super().__init__: no state
        self.muon, self.adamw = muon, adamw
        self.defaults: dict[str, Any] = {}
        self.param_groups = [*muon.param_groups, *adamw.param_groups]

    @property
    def state(self) -> defaultdict[torch.Tensor, Any]:  # type: ignore[override]
        """Both optimizers' per-tensor state (a read-only merged view)."""
        return defaultdict(dict, {**self.muon.state, **self.adamw.state})

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.muon.zero_grad(set_to_none=set_to_none)
        self.adamw.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def step(self, closure: None = None) -> None:  # type: ignore[override]
        self.muon.step()
        self.adamw.step()

    def state_dict(self) -> dict[str, Any]:
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict()}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        self.muon.load_state_dict(state_dict["muon"])
        self.adamw.load_state_dict(state_dict["adamw"])
        self.param_groups = [*self.muon.param_groups, *self.adamw.param_groups]

    def __repr__(self) -> str:
        return f"MuonWithAdamW(muon={self.muon!r}, adamw={self.adamw!r})"


def build_optimizer(params: list[torch.nn.Parameter], cfg: Any, device: torch.device) -> torch.optim.Optimizer:
    """The run's optimizer over `params` (the trainable tensors, in model order): AdamW, or Muon + AdamW."""
    fused = device.type == "cuda"
    adamw = dict(lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps,
                 weight_decay=cfg.weight_decay)
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(params, fused=fused, **adamw)
    muon_params, rest = split_for_muon(params)
    muon = torch.optim.Muon(muon_params, lr=cfg.lr, weight_decay=cfg.weight_decay,
                            momentum=cfg.muon_momentum, nesterov=True, adjust_lr_fn=cfg.muon_adjust_lr)
    return MuonWithAdamW(muon, torch.optim.AdamW(rest, fused=fused, **adamw))


def check_state(opt_state: Any, kind: str, trainable: int, where: str) -> str | None:
    """Why the checkpoint's optimizer state `opt_state` cannot continue this run's `kind` of optimizer over
    `trainable` tensors; None when it can."""
    if not isinstance(opt_state, Mapping):
        return f"checkpoint {where}: its optimizer state is not a state_dict"
    saved = "muon" if "muon" in opt_state else "adamw"
    if saved != kind:
        return (f"checkpoint {where} was trained with --optimizer {saved}, this run asks for --optimizer {kind}; "
                f"resume with --optimizer {saved}, or use a new --run-dir")
    states = [opt_state["muon"], opt_state["adamw"]] if kind == "muon" else [opt_state]
    groups = [g for s in states for g in (s.get("param_groups", []) if isinstance(s, Mapping) else [])]
    if len(groups) != len(states) or sum(len(g.get("params", [])) for g in groups) != trainable:
        return (f"checkpoint {where}: optimizer state does not match this model ({trainable} trainable tensors). "
                "Nothing was loaded.")
    return None


def optimizer_line(cfg: Any, shapes: list[tuple[int, ...]]) -> str:
    """The plan's line on the optimizer; `shapes` are the trainable tensors' shapes (which Muon takes)."""
    betas = f"betas ({cfg.adam_beta1:g}, {cfg.adam_beta2:g}), eps {cfg.adam_eps:g}, weight decay {cfg.weight_decay:g}"
    clip = f"; grad clip {cfg.grad_clip:g}" if cfg.grad_clip is not None else "; no grad clip"
    ema = f"; EMA decay {cfg.ema_decay:g}"
    if cfg.optimizer == "adamw":
        return f"  optimizer   AdamW, {betas}{clip}{ema}"
    two_d = [s for s in shapes if len(s) == 2]
    n2 = sum(int(torch.Size(s).numel()) for s in two_d)
    rest = sum(int(torch.Size(s).numel()) for s in shapes if len(s) != 2)
    return (f"  optimizer   Muon on {len(two_d)} 2-D tensors ({n2 / 1e6:.2f}M parameters; momentum "
            f"{cfg.muon_momentum:g}, Nesterov, lr adjusted {cfg.muon_adjust_lr}) + AdamW on {len(shapes) - len(two_d)} "
            f"others ({rest / 1e6:.2f}M; {betas}){clip}{ema}")
