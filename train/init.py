"""`dit-train --init WEIGHTS`: start a new run from pretrained weights (fine-tuning, 256 -> 512 px, SiT from a
DiT), with a fresh optimizer, EMA = the initial weights, step 0.

WEIGHTS is any file `dit-sample` reads (`dit.load_dit_weights`): our checkpoints (their EMA weights), EMA files
with their sidecar, the official DiT / SiT / REPA release files, the release files of LightningDiT, DDT and
RAE's DiT-DH, or .safetensors. Every tensor of the new model must be in the file with its shape, except
- the family's fixed tables (`fixed_tensors`: DiT's 2-D sin-cos `pos_embed`, RoPE tables): never trained, so
  the new model's own table is used, exact for its token grid (what a 2-D bicubic resample of the old table
  would only approximate); this is how the input size may change (256 -> 512 px);
- the label table, when the class count differs (a new data set): the new model's fresh initialisation;
- the output projection, when learned sigma differs (a flow run from a DiT file: C outputs where the file has
  DiT's 2C): the family's initialisation, zero for DiT (SiT's own train.py keeps 2C and drops half instead);
- the embedders a MeanFlow objective adds (dit/conditions.py: MeanFlow's `h_embedder`, imf-adaln's omega and
  interval embedders), when the file has none (a MeanFlow run from a SiT/DiT file): initialised as a fresh run's
  (h_embedder as the MeanFlow release initialises it). The reverse, a flow or ddpm run from a MeanFlow file: the
  file's added embedders are dropped, and the plan lists them.
Anything else that differs (family, width, depth, patch, channels, learned sigma) is one UserError listing it,
before any GPU work (also in `--dry-run`). The path is recorded in the run's config.json (`init`); a resume
loads its checkpoint and never the init file again.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dit_pipeline import dit
from dit_pipeline.common.errors import UserError
from dit_pipeline.common.io import sha256_file

LABEL_TABLE_SUFFIX = "y_embedder.embedding_table.weight"
OUTPUT_PREFIX = "final_layer.linear."  # the output projection: 2C channels with learned sigma (DiT), C without


@dataclass
class InitWeights:
    """What `--init` copies into the new model: tensors by name, and what the plan says about the rest."""

    path: Path
    state_dict: dict[str, torch.Tensor]      # the tensors copied (official names)
    source: str                              # "official" | "dit-pipeline" | ... (dit.load_dit_weights)
    preset: str | None
    sha256: str
    kept: list[str] = field(default_factory=list)  # the new model's own tensors and why
    dropped: list[str] = field(default_factory=list)  # the file's tensors this model has no place for, and why

    def describe(self) -> str:
        own = f"; the new model's own {', '.join(self.kept)}" if self.kept else ""
        gone = f"; dropped from the file: {', '.join(self.dropped)}" if self.dropped else ""
        return (f"{self.path} ({self.preset or 'custom'}, {self.source}, sha256 {self.sha256[:12]}...): "
                f"{len(self.state_dict)} tensors copied{own}{gone}; optimizer fresh, EMA = these weights, step 0")


def load_init(spec: str, model_kwargs: dict[str, Any]) -> InitWeights:
    """Read `spec` and match it to the model `model_kwargs` builds (see the module docstring); UserError naming
    every mismatch."""
    path = Path(spec).expanduser()
    with torch.device("meta"):
        model = dit.create_model(**model_kwargs)
    new = dict(model.config)
    # what a file may not state (DDT's input size); the file's own record wins
    hints: dict[str, Any] = {k: new[k] for k in ("input_size", "num_heads") if k in new}
    try:
        state_dict, info = dit.load_dit_weights(path, prefer="ema", hints=hints)
    except dit.WeightsError as e:
        raise UserError(f"--init: {e}") from None
    family, old_family = new.get("family", "DiT"), info.get("family", "DiT")
    if family != old_family:
        raise UserError(f"--init {spec} holds a {old_family} ({info.get('preset') or 'custom'}) but this run trains "
                        f"a {family}; pass --model of the file's family")
    expected = model.state_dict()
    fixed = set(type(model).fixed_tensors(new))
    learned = bool(info["model_config"].get("learn_sigma"))
    fresh, spare = _added(new), _added(info["model_config"])
    kept, take, problems = [], {}, []
    for key, want in expected.items():
        have = state_dict.get(key)
        if key in fixed:
            continue  # recomputed for the new grid: the same table whatever the file held
        if have is None and key.split(".", 1)[0] in fresh:
            continue  # a MeanFlow objective's embedder the file has not (listed below)
        if have is None:
            problems.append(f"missing {key}")
        elif tuple(have.shape) == tuple(want.shape):
            take[key] = have
        elif key.endswith(LABEL_TABLE_SUFFIX) and have.shape[1:] == want.shape[1:]:
            kept.append(f"label table ({want.shape[0]} rows where the file has {have.shape[0]}: "
                        "a new class set, initialised fresh)")
        elif key.startswith(OUTPUT_PREFIX) and have.shape[1:] == want.shape[1:] and new["learn_sigma"] != learned:
            if not any(k.startswith("output layer") for k in kept):
                kept.append(f"output layer (learned sigma {'on' if new['learn_sigma'] else 'off'} here, "
                            f"{'on' if learned else 'off'} in the file: initialised as the family does, to zero)")
        else:
            problems.append(f"{key}: {list(have.shape)} in the file, {list(want.shape)} here")
    if fixed:
        kept.insert(0, f"{', '.join(sorted(fixed))} (fixed sin-cos/RoPE tables, computed for {new['input_size']}x"
                       f"{new['input_size']} latents)")
    new_embedders = [name for name in fresh if not any(k.startswith(name + ".") for k in state_dict)]
    if new_embedders:
        kept.append(_fresh_line(new_embedders, str(new.get("conditions"))))
    gone = [name for name in spare if name not in fresh and any(k.startswith(name + ".") for k in state_dict)]
    dropped = [f"{', '.join(gone)} (the file's {info['model_config'].get('conditions')} time inputs; this run's "
               "objective has none)"] if gone else []
    unused = sorted(k for k in set(state_dict) - set(expected) if k.split(".", 1)[0] not in gone)
    if unused:
        problems.append(f"tensors this model has no place for: {unused[:4]}{' ...' if len(unused) > 4 else ''}")
    if problems:
        c = info["model_config"]
        raise UserError(f"--init {spec} ({info.get('preset') or 'custom'}: depth {c.get('depth')}, hidden "
                        f"{c.get('hidden_size')}, patch {c.get('patch_size')}, {c.get('in_channels')} channels) does "
                        f"not fit this run's {new.get('model') or 'custom'} model: {'; '.join(problems[:6])}"
                        f"{' ...' if len(problems) > 6 else ''}. Only the input size (the position table) and the "
                        "class count (the label table) may differ")
    return InitWeights(path, take, str(info.get("source")), info.get("preset"), sha256_file(path), kept, dropped)


def _added(config: dict[str, Any]) -> tuple[str, ...]:
    """The embedders dit/conditions.py adds to a model of `config` (none for a family with its own time inputs)."""
    from dit_pipeline.dit.conditions import EXTRA_EMBEDDERS, conditions_of
    from dit_pipeline.dit.family import family_of_config

    if family_of_config(config).conditions != "t":
        return ()
    return EXTRA_EMBEDDERS[conditions_of(config)]


def _fresh_line(names: list[str], conditions: str) -> str:
    if conditions == "meanflow":
        return (f"{', '.join(names)} (MeanFlow's time input h = t - r, not in the file: initialised as the MeanFlow "
                "release initialises it, weights normal(0.02), biases zero)")
    return (f"{', '.join(names)} (the {conditions} time inputs, not in the file: first layers normal(0.02), output "
            "layers zero, as a new run's)")


@torch.no_grad()
def apply_init(model: torch.nn.Module, init: InitWeights) -> None:
    """Copy the init tensors into `model` (in place, any device and dtype)."""
    own = model.state_dict()
    for key, tensor in init.state_dict.items():
        own[key].copy_(tensor)


def init_line(init: InitWeights | None) -> list[str]:
    """The plan's line on --init (none without it)."""
    return [] if init is None else [f"  init        {init.describe()} (a resume loads its checkpoint instead)"]
