"""What a release's weight file cannot state, and where `dit-sample` takes it from (issue 44 item 5).

NanoGen's files (dit/releases.py `NANOGEN_UNSTATED`, listed in `info["unstated"]`) record neither what the network
predicts, nor their latent space, nor a text model's encoder: NanoGen keeps them in the YAML config that names the
file. For each such setting dit-sample takes, in this order:

1. its flag: --prediction, --vae (--decoder), --text-encoder;
2. the fact the protocol row states (`Protocol.facts`, dit/protocol_fit.py `ModelFacts`): `--protocol
   nanogen/<config>` names the config (dit/nanogen_protocols.py), and the generic NanoGen rows state what all their
   configs share (the pixel space, the text encoder);
3. none: the file is refused, naming the flag and the rows that would state it. A prediction is never guessed: a
   guessed velocity samples an x-predicting network into noise and exits 0.

A setting the file does state stays the file's; a flag that contradicts it is refused. Where each supplied setting
came from is `info["settings_from"]` (flag or row, with the config file and keys), which the sample record keeps. One
path for every release whose files are silent: the sampler reads the filled-in `info` and `SampleConfig` and never asks
which release a file is.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from dit_pipeline.common.errors import UserError
from dit_pipeline.dit import protocols
from dit_pipeline.dit.flow_predictions import T_EPS
from dit_pipeline.dit.protocol_fit import SPACES, ModelFacts, model_traits
from dit_pipeline.sample.config import SampleConfig

SHOWN = 6  # rows named in a refusal


def prediction_record(kind: str, t_eps: float = T_EPS) -> dict[str, Any]:
    """--prediction x | velocity as dit.flow_predictions records it (the velocity with its t_eps: NanoGen's clamped
    target, sampled as it is)."""
    return {"kind": "x" if kind == "x" else "v", "t_eps": float(t_eps)}


def _kind(record: Any) -> str:
    return "x" if isinstance(record, dict) and record.get("kind") == "x" else "velocity"


def _row(cfg: SampleConfig) -> tuple[str, ModelFacts | None]:
    if cfg.protocol is None:
        return "", None
    p = protocols.protocol(cfg.protocol)
    return f"--protocol {p.name}", p.facts


def _from_row(flag: str, facts: ModelFacts, fact: str) -> str:
    return f"{flag} ({facts.where(fact)})"


def prediction_known(loaded: Any) -> bool:
    """Whether the model's prediction is the file's or a flag's (False: unknown to the file, the row states it), as
    the protocol-fit check needs it (dit/protocol_fit.py UNKNOWN)."""
    unstated = "prediction" in (loaded.info.get("unstated") or {})
    return not unstated or not str(loaded.info.get("settings_from", {}).get("prediction", "")).startswith("--protocol")


def supply(cfg: SampleConfig, loaded: Any, log: Any) -> SampleConfig:
    """`cfg` and `loaded.info` with every setting the file does not state filled in (module docstring); one UserError
    naming every setting that nothing supplies, or a flag that contradicts the file."""
    info, (row, facts) = loaded.info, _row(cfg)
    unstated: dict[str, str] = dict(info.get("unstated") or {})
    came: dict[str, str] = {}
    problems: list[str] = []
    if "vae" in unstated:
        if cfg.vae:
            came["vae"] = "--vae"
        elif facts is not None and facts.vae:
            cfg, came["vae"] = dataclasses.replace(cfg, vae=facts.vae), _from_row(row, facts, "vae")
        elif facts is not None and facts.latent_space:
            problems.append(f"{unstated['vae']}; {row} names its latent space, {facts.latent_space}, which dit-sample "
                            "does not load by that name: pass it as --vae (a local folder of it) or --decoder")
        else:
            problems.append(f"{unstated['vae']}; pass --vae (--decoder for a feature space), or name the config: "
                            "--protocol nanogen/<config> (docs/nanogen-checkpoints.md)")
        if not loaded.latent and facts is not None and facts.latent is not None:
            scale, shift = facts.latent  # the release's normalization of that space, which its VAE class fixes
            info["latent"] = {"scaling_factor": float(scale), "shift_factor": None if shift is None else float(shift)}
            came["latent"] = _from_row(row, facts, "latent")
    problems[:0] = _prediction(cfg, loaded, unstated, row, facts, came)
    if "text_encoder" in unstated:
        if cfg.text_encoder:
            came["text_encoder"] = "--text-encoder"
        elif facts is not None and facts.text_encoder:
            cfg = dataclasses.replace(cfg, text_encoder=facts.text_encoder)
            came["text_encoder"] = _from_row(row, facts, "text_encoder")
        # else: sample/prompts.py refuses a prompt without an encoder, naming --text-encoder and the rows
    if problems:
        raise UserError(f"--ckpt {cfg.ckpt}: " + "; and ".join(problems))
    if came:
        info["settings_from"] = came
        for setting, source in came.items():
            if source.startswith("--protocol"):
                log.info("%s not recorded in the file: taken from %s", setting, source)
    return cfg


def _prediction(cfg: SampleConfig, loaded: Any, unstated: dict[str, str], row: str, facts: ModelFacts | None,
                came: dict[str, str]) -> list[str]:
    """info["prediction"] for a file that does not state it; the problems (a contradicted record, nothing that
    states it, an x-predicting MeanFlow model)."""
    info = loaded.info
    if "prediction" not in unstated:
        if cfg.prediction is not None and cfg.prediction != _kind(info.get("prediction")):
            return [f"--prediction {cfg.prediction}, but the file records a {_kind(info.get('prediction'))}-"
                    "predicting network; drop --prediction"]
        return []
    if cfg.prediction is not None:
        info["prediction"], came["prediction"] = prediction_record(cfg.prediction), "--prediction"
    elif facts is not None and facts.prediction is not None:
        info["prediction"], came["prediction"] = facts.prediction_record(), _from_row(row, facts, "prediction")
    else:
        which = f"{row} does not say which (its configs differ in it)" if row else "no --protocol names its config"
        return [f"{unstated['prediction']}, and {which}; name the config: --protocol nanogen/<config>"
                f"{_fitting(loaded, cfg.vae)}, or pass --prediction x|velocity"]
    if info.get("objective") == "meanflow" and _kind(info["prediction"]) == "x":
        return ["an x-predicting MeanFlow network (NanoGen's TransportMF with prediction x), which this build does "
                "not sample (its MeanFlow configs predict the velocity)"]
    return []


def _fitting(loaded: Any, vae: str | None) -> str:
    """" (rows that state it and fit this model: ...)": the rows that state a prediction and fit the model's
    conditioning, objective and shape in its space (the pixel space or latents, by --vae); where no --vae says which,
    only the per-config rows, whose latent shape says it."""
    from dit_pipeline.common.pixels import is_pixel_space

    spaces = SPACES if not vae else ("pixels",) if is_pixel_space(vae) else ("latent",)
    names: list[str] = []
    for space in spaces:
        traits = model_traits(loaded.config, loaded.info["objective"], None, space, prediction_known=False)
        for n in protocols.fitting(traits):
            p = protocols.PROTOCOLS[n]
            if p.facts is not None and p.facts.prediction is not None and n not in names and \
                    (vae or p.applies_to.latent_shape is not None):
                names.append(n)
    if not names:
        return " (none of NanoGen's configs has this model's shape)"
    more = f" and {len(names) - SHOWN} more" if len(names) > SHOWN else ""
    return f" (rows that state it and fit this model: {', '.join(names[:SHOWN])}{more})"
