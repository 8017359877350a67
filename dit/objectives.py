"""The objectives a model can learn, as one registry: what the trainer, checkpoints, samplers and FID ask of an
objective, so that none of them names one.

An `ObjectiveSpec` says, for one objective name (dit.formats.OBJECTIVES):
- `build(settings)`: the object that draws a step's times and computes the loss (`GaussianDiffusion`,
  `FlowMatching`, `MeanFlow`), from the run's settings (a TrainConfig's dict); every such object answers
  `draw_timesteps(n, generator, device, shared)` (`shared`: the step's generator common to every rank, for a
  decision the whole step shares; the others draw from the rank's `generator`), `training_losses(model_fn, x, t,
  model_kwargs, noise)`, `drop_labels(mask)` (which samples get the null class, from the per-sample draws) and
  `attach(model, conditioning)` (the raw module and the run's Conditioning, for passes without gradient);
- `record(settings)`: what a checkpoint records beside the name (flow: its time shift; meanflow: its settings),
  which a resume must match and samplers read;
- `conditions`: the model's time input (dit/conditions.py) the objective needs;
- `samplers`, `default_sampler`, `grid_sampler`, `fid_sampler`: the sampler names that can sample such a model
  (dit-sample refuses the others), the one dit-sample uses when none is given, and those of the trainer's periodic
  grids and FID; `default_steps`: the steps of dit-sample and the FID hook when none are given (a one-step
  model's: 1).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

from .formats import OBJECTIVES
from .objective_base import ObjectiveDefaults  # noqa: F401 (the shared defaults, importable from here)


@dataclass(frozen=True)
class ObjectiveSpec:
    name: str
    build: Callable[[Mapping[str, Any]], Any]
    record: Callable[[Mapping[str, Any]], dict[str, Any]]
    conditions: str
    samplers: tuple[str, ...]
    default_sampler: str
    grid_sampler: str
    fid_sampler: str
    learn_sigma: bool = False  # the network's second half of channels learns the variance (DiT's ddpm)
    network: str | None = None  # "iMF": only the iMF family; "adaLN": every family but it; None: any family
    default_steps: int = 250  # dit-sample's and the FID hook's steps when none are given (one-step models: 1)


def _ddpm(settings: Mapping[str, Any]) -> Any:
    from .diffusion import create_diffusion

    return create_diffusion("")


def _flow(settings: Mapping[str, Any]) -> Any:
    from .flow import create_flow

    shift = settings.get("time_shift", 1.0)
    if isinstance(shift, str):
        raise ValueError("--time-shift auto is resolved against the shard set first (resolve_time_shift)")
    return create_flow(str(settings.get("t_sampling", "uniform")), float(settings.get("t_mean", 0.0)),
                       float(settings.get("t_scale", 1.0)), time_shift=float(shift),
                       cosine_loss=bool(settings.get("cosine_loss", False)),
                       prediction=str(settings.get("prediction", "v")), t_eps=float(settings.get("t_eps", 0.05)),
                       v_target=str(settings.get("v_target", "plain")),
                       reg_coeff=float(settings["reg_coeff"]) if settings.get("use_reg") else None,
                       base_model_coeff=(float(settings["base_model_coeff"]) if settings.get("base_model_depth")
                                         else None))


def _flow_record(settings: Mapping[str, Any]) -> dict[str, Any]:
    """A flow model's record: its training shift, and (x-prediction, or velocity with the clamped target, so a plain
    velocity model's record is what it always was) `prediction`, which every sampler converts the network's output
    through (dit.flow_predictions) and a resume must repeat."""
    from .flow_predictions import make_prediction

    out: dict[str, Any] = {"time_shift": float(settings.get("time_shift", 1.0))}
    pred = make_prediction(str(settings.get("prediction", "v")), float(settings.get("t_eps", 0.05)),
                           str(settings.get("v_target", "plain"))).record()
    if pred is not None:
        out["prediction"] = pred
    used = {k: settings.get(k) for k in ("lpips", "pdino") if settings.get(k)}
    if used:  # PixelGen's perceptual terms (common/perceptual.py): a resume must add the same ones
        out["perceptual"] = {**used, **{k: float(settings[k]) for k in ("lpips_weight", "pdino_weight",
                                                                           "percep_t_thresh") if k in settings}}
    if settings.get("base_model_depth"):  # internal guidance's base head trained beside (dit/reg.py)
        out["internal_guidance"] = {"base_model_depth": int(settings["base_model_depth"]),
                                    "base_model_coeff": float(settings.get("base_model_coeff", 1.0))}
    return out


# The MeanFlow settings as TrainConfig names them (its --mf-* options) -> MeanFlow's arguments
MF_SETTINGS = {"mf_t_mean": "t_mean", "mf_t_scale": "t_scale", "mf_data_proportion": "data_proportion",
               "mf_omega": "omega", "mf_kappa": "kappa", "mf_t_start": "t_start", "mf_t_end": "t_end",
               "mf_norm_p": "norm_p", "mf_norm_eps": "norm_eps", "mf_s_max": "s_max", "jvp_attention": "jvp_attention",
               "mf_rule": "rule", "v_target": "v_target", "t_eps": "t_eps"}
MF_ONLY = ("mf_rule", "v_target", "t_eps")  # settings of the meanflow variant alone (NanoGen's TransportMF)


def _meanflow(variant: str) -> Callable[[Mapping[str, Any]], Any]:
    def build(settings: Mapping[str, Any]) -> Any:
        from .meanflow import MeanFlow

        return MeanFlow(variant=variant, **{arg: settings[key] for key, arg in MF_SETTINGS.items() if key in settings
                                            and (variant == "meanflow" or key not in MF_ONLY)})
    return build


# the settings each variant acts on (what its checkpoints record and a resume must repeat); meanflow's t_eps only
# with the clamped target
MF_RECORDED = {"meanflow": ("mf_t_mean", "mf_t_scale", "mf_data_proportion", "mf_omega", "mf_kappa", "mf_t_start",
                            "mf_t_end", "mf_norm_p", "mf_norm_eps", "mf_rule", "v_target", "t_eps"),
               "imf": ("mf_t_mean", "mf_t_scale", "mf_data_proportion", "mf_norm_p", "mf_norm_eps", "mf_s_max")}
# what a record without the key means (checkpoints written before the setting existed trained so)
MF_ABSENT = {"mf_rule": "meanflow", "v_target": "plain", "t_eps": None}


def _mf_record(variant: str) -> Callable[[Mapping[str, Any]], dict[str, Any]]:
    keys = MF_RECORDED["meanflow" if variant == "meanflow" else "imf"]

    def record(settings: Mapping[str, Any]) -> dict[str, Any]:
        out = {k: settings[k] for k in keys if k in settings}
        if out.get("v_target", "plain") == "plain":
            out.pop("t_eps", None)  # the plain velocity divides by nothing
        return {"meanflow": out}
    return record


DDPM_SAMPLERS = ("ddpm", "ddim")
FLOW_SAMPLERS = ("euler", "heun", "euler-maruyama")  # dit.flow_samplers.FLOW_SAMPLERS (imported lazily there)
MEANFLOW_SAMPLERS = ("meanflow",)

SPECS: dict[str, ObjectiveSpec] = {
    "ddpm": ObjectiveSpec("ddpm", _ddpm, lambda s: {}, "t", DDPM_SAMPLERS, "ddpm", "ddim", "ddpm", True),
    "flow": ObjectiveSpec("flow", _flow, _flow_record, "t",
                          FLOW_SAMPLERS, "euler-maruyama", "euler", "euler"),
    "meanflow": ObjectiveSpec("meanflow", _meanflow("meanflow"), _mf_record("meanflow"), "meanflow",
                              MEANFLOW_SAMPLERS, "meanflow", "meanflow", "meanflow", default_steps=1),
    # the release's iMF: its own network (the iMF family, dit/imf.py) with the auxiliary v head
    "imf": ObjectiveSpec("imf", _meanflow("imf"), _mf_record("imf"), "imf", MEANFLOW_SAMPLERS, "meanflow", "meanflow",
                         "meanflow", network="iMF", default_steps=1),
    # this project's variant: iMF's draws and guidance on an adaLN family, conditions added to the time embedding
    "imf-adaln": ObjectiveSpec("imf-adaln", _meanflow("imf-adaln"), _mf_record("imf-adaln"), "imf",
                               MEANFLOW_SAMPLERS, "meanflow", "meanflow", "meanflow", network="adaLN", default_steps=1),
}
assert tuple(SPECS) == OBJECTIVES, "dit.formats.OBJECTIVES names the registry's objectives, in order"


def spec(name: str) -> ObjectiveSpec:
    if name not in SPECS:
        raise ValueError(f"unknown objective {name!r}; choose one of: {', '.join(SPECS)}")
    return SPECS[name]


def build_objective(name: str, settings: Mapping[str, Any]) -> Any:
    """The training objective `name` with the run's settings (ObjectiveSpec.build)."""
    return spec(name).build(settings)


def network_problem(name: str, family: str) -> str | None:
    """Why objective `name` cannot train a network of `family` (None: it can)."""
    network = spec(name).network
    if network == "iMF" and family != "iMF":
        return (f"--objective {name} is the release's iMF, whose network is its own (an auxiliary v head, the "
                f"conditions as in-context tokens): use --model iMF-B/2 (or M/2, L/2, XL/2), or --objective imf-adaln "
                f"for this project's variant on a {family}")
    if network == "adaLN" and family == "iMF":
        return (f"--objective {name} is this project's iMF variant for the adaLN families; the iMF network trains "
                "with --objective imf")
    if network is None and family == "iMF":
        return f"iMF's network (--model iMF-*) trains with --objective imf, not {name}"
    return None


def recorded_objective(name: str | None, model_config: Mapping[str, Any] | None) -> str | None:
    """The objective a file's record means today: "imf" recorded with a network that is not iMF's is this project's
    variant, named imf-adaln since the release's network was built (such files were written before)."""
    if name == "imf" and (model_config or {}).get("family") != "iMF":
        return "imf-adaln"
    return name


def objective_of_sampler(sampler: str) -> list[str]:
    """The objectives whose models `sampler` can sample."""
    return [name for name, s in SPECS.items() if sampler in s.samplers]
