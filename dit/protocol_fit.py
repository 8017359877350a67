"""What a sampling protocol (dit/protocol_types.py) applies to, as data: the model's space (latents or pixels), its
conditioning (dit/conditioning.py: class labels, text, none), its objective (dit/objectives.py), what its network
predicts, the latent shape a release tuned its grid and guidance for, and the model features the release's sampler
needs. A protocol row carries one `AppliesTo`; a model is described by its `ModelTraits`; a mismatch is a list of
the fields that differ, computed the same way for every field and every row (never an `if` on a protocol's name), so
a new row states what it fits and nothing else changes. A model whose file does not say what its network predicts
(NanoGen's: `ModelTraits.prediction` "unknown") fits a row whatever the row's prediction; the row then states it.

`ModelFacts` is the other direction: what a row's release config states about the model it samples that the
release's weight files do not record (NanoGen keeps the prediction, the text encoder and the latent space in its YAML
only). dit-sample takes each fact where the file is silent and no flag gives it (sample/facts.py), and records where
it came from.

Features (`FEATURES`) are what some releases' samplers need beyond the grid and guidance rule: REG's class token,
which the sampler evolves beside the image and guides with it, and NanoGen's internal guidance. A row that needs a
feature this build lacks (`AVAILABLE` does not list it) is refused naming what is missing. Pure data: no I/O.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

SPACES = ("latent", "pixels")
PREDICTIONS = ("velocity", "x")
UNKNOWN = "unknown"  # a model's prediction its file does not state (ModelTraits.prediction)

# feature -> what it is and where the release defines it (for the refusal)
FEATURES: dict[str, str] = {
    "reg": ("REG's class token (a DINOv2-B class token noised with the image's t, evolved by the sampler beside the "
            "image and guided with it: End2End-Diffusion/diffusion-bench src/stage2/transport/sampler.py l.20-30, "
            "src/utils/guidance_utils.py l.19-45, src/eval/generation.py l.160-162)"),
    "internal-guidance": ("NanoGen's internal guidance (a shallower base head's output guiding the full network: "
                          "base + s (full - base), End2End-Diffusion/diffusion-bench src/utils/guidance_utils.py "
                          "l.56-140)"),
}
AVAILABLE: frozenset[str] = frozenset(FEATURES)  # the features this build's models and samplers have
# a feature as a model has it or lacks it (the refusal's words): from its model_config (`model_traits`)
HAS = {"reg": "REG's class token (model_config reg_dim)",
       "internal-guidance": "a base head for internal guidance (model_config base_model_depth)"}


@dataclass(frozen=True)
class ModelTraits:
    """What a protocol row is matched against: a model as dit-sample loaded it."""

    space: str                          # "latent" (a VAE's or an encoder's features) or "pixels"
    conditioning: str                   # dit.conditioning.CONDITIONINGS
    objective: str                      # dit.formats.OBJECTIVES
    prediction: str                     # "velocity" or "x" (a flow model's recorded prediction; others: velocity);
    #                                     UNKNOWN where the file does not say (NanoGen's files)
    latent_shape: tuple[int, int, int]  # (C, H, W) the network samples
    features: frozenset[str] = frozenset()  # FEATURES the model has (REG's token, a base head)

    def describe(self) -> str:
        kind = {"class": "class-conditional", "text": "text-conditional", "none": "unconditional"}
        pred = {"x": " (x prediction)", UNKNOWN: " (its prediction not recorded)"}.get(self.prediction, "")
        c, h, w = self.latent_shape
        what = kind.get(self.conditioning, self.conditioning)
        return f"{'an' if what[:1] in 'aeiou' else 'a'} {what} {self.objective} model{pred} on {c}x{h}x{w} " \
               f"{'pixels' if self.space == 'pixels' else 'latents'}"


@dataclass(frozen=True)
class AppliesTo:
    """The models a protocol row fits; None in a field: any."""

    space: tuple[str, ...] | None = None
    conditioning: tuple[str, ...] | None = None
    objectives: tuple[str, ...] | None = None
    prediction: str | None = None
    latent_shape: tuple[int, int, int] | None = None
    requires: tuple[str, ...] = ()  # FEATURES the release's sampler needs

    def mismatches(self, traits: ModelTraits) -> list[str]:
        """The fields where `traits` is not what the row applies to: "space pixels (the protocol's: latent)"."""
        wanted: dict[str, Any] = {"space": self.space, "conditioning": self.conditioning,
                                  "objective": self.objectives,
                                  "prediction": None if self.prediction is None else (self.prediction,),
                                  "latent shape": None if self.latent_shape is None else (self.latent_shape,)}
        have: dict[str, Any] = {"space": traits.space, "conditioning": traits.conditioning,
                                "objective": traits.objective, "prediction": traits.prediction,
                                "latent shape": tuple(traits.latent_shape)}
        if traits.prediction == UNKNOWN:  # the row's own prediction is then the model's (ModelFacts)
            wanted["prediction"] = None
        out = [f"{k} {_shown(have[k])} (the protocol's: {' or '.join(_shown(v) for v in want)})"
               for k, want in wanted.items() if want is not None and have[k] not in want]
        return out + [f"no {HAS[f]} (the protocol's model has one)" for f in self.requires
                      if f in AVAILABLE and f not in traits.features]

    def missing(self) -> list[str]:
        """The features the row needs that this build lacks."""
        return [f for f in self.requires if f not in AVAILABLE]

    def describe(self) -> str:
        """"class-conditional flow models on latents", with what else is fixed."""
        kinds = {"class": "class-conditional", "text": "text-conditional", "none": "unconditional"}
        cond = " or ".join(kinds.get(c, c) for c in self.conditioning) if self.conditioning else "any"
        obj = " or ".join(self.objectives) if self.objectives else "any-objective"
        where = "" if self.space is None else " on " + " or ".join("pixels" if s == "pixels" else "latents"
                                                                   for s in self.space)
        extra = [f"{self.prediction} prediction"] if self.prediction else []
        extra += [f"latent shape {_shown(self.latent_shape)}"] if self.latent_shape else []
        return f"{cond} {obj} models{where}" + (f" ({', '.join(extra)})" if extra else "")


def _shown(v: Any) -> str:
    return "x".join(str(int(d)) for d in v) if isinstance(v, tuple) else str(v)


def model_traits(model_config: Mapping[str, Any], objective: str, prediction: Mapping[str, Any] | None,
                 space: str, prediction_known: bool = True) -> ModelTraits:
    """A model's traits from its model_config (conditioning, channels, size), its objective, its recorded prediction
    (dit.flow_predictions' record: {"kind": "x"} for an x-predicting network; absent or "v": velocity;
    `prediction_known` False: its file does not say, UNKNOWN) and its space."""
    from .conditioning import kind_of

    size = int(model_config["input_size"])
    kind = str((prediction or {}).get("kind", "v"))
    return ModelTraits(space=space, conditioning=kind_of(model_config), objective=str(objective),
                       prediction=UNKNOWN if not prediction_known else "x" if kind == "x" else "velocity",
                       latent_shape=(int(model_config["in_channels"]), size, size),
                       features=frozenset(f for f, key in (("reg", "reg_dim"), ("internal-guidance", "base_model_depth"))
                                          if model_config.get(key)))


@dataclass(frozen=True)
class ModelFacts:
    """What a row's release config states about the models it samples that their weight files do not record (module
    docstring); None in a field: the row does not say (its models differ in it, or it is not a release setting)."""

    source: str                                # the config file(s) the facts were read from
    keys: tuple[tuple[str, str], ...] = ()     # (fact, the config's key that states it)
    prediction: str | None = None              # PREDICTIONS: what the network predicts (transport.prediction)
    t_eps: float = 0.05                        # the smallest noise level its prediction's conversion divides by
    text_encoder: str | None = None            # a text model's encoder: a preset of common/text_encoders.py
    vae: str | None = None                     # a --vae value that decodes its latent space as the release does
    latent: tuple[float, float | None] | None = None  # the release's (scaling_factor, shift_factor) of that space
    latent_space: str = ""                     # the release's latent space and how it loads it (for messages)

    def where(self, fact: str) -> str:
        """"<config file> <key>": where the row's config states `fact`."""
        key = dict(self.keys).get(fact)
        return f"{self.source} {key}" if key else self.source

    def prediction_record(self) -> dict[str, Any] | None:
        """The prediction as dit.flow_predictions records it ({"kind": "x" | "v", "t_eps"}), None where the row does
        not say."""
        if self.prediction is None:
            return None
        return {"kind": "x" if self.prediction == "x" else "v", "t_eps": float(self.t_eps)}
