"""Where a `TrainConfig` comes from: defaults < a `--config run.yaml|json` file < explicitly given flags.
`load_config_file` reads a file (following a recipe's move, `moved_config`), `merge_config` merges it with the
flags (a model name's implied objective, a recipe's departures), `FIELD_NAMES` are the settings a file may hold.
"""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from dit_pipeline.common.errors import ConfigError, UserError
from dit_pipeline.common.io import missing_file
from dit_pipeline.common.settings import flag_name
from dit_pipeline.train.config import TrainConfig
from dit_pipeline.train.model_options import implied_objective

FIELD_NAMES = tuple(f.name for f in dataclasses.fields(TrainConfig))


def load_config_file(path: str | Path) -> dict[str, Any]:
    """Read a YAML or JSON mapping of TrainConfig settings (dashed or underscored keys)."""
    import yaml

    path = moved_config(Path(path).expanduser())
    if not path.is_file():
        raise UserError(f"--config {path}: {missing_file(path)}")
    text = path.read_text(encoding="utf-8")

    try:
        # YAML is a superset of JSON, but a .json file gets the stricter parser and its error messages.
        data = json.loads(text) if path.suffix.lower() == ".json" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as e:
        raise UserError(f"--config {path}: cannot parse: {e}") from e
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(f"--config {path}: expected a mapping of settings, got {type(data).__name__}")
    out = {str(k).replace("-", "_"): v for k, v in data.items()}
    unknown = sorted(set(out) - set(FIELD_NAMES))
    if unknown:
        raise ConfigError([f"--config {path}: unknown setting {k!r}" for k in unknown]
                          + [f"known settings: {', '.join(FIELD_NAMES)}"], "config file")
    return out


MOVED = "MOVED.yaml"  # in a folder of config files: {old file name: its new path, relative to the folder}


def moved_config(path: Path) -> Path:
    """The config file `path` names: itself; with ".yaml" added when it is given without (recipes/nanogen/NAME);
    or, for a file listed in its folder's MOVED.yaml, the file it moved to (said on stderr), so commands written
    before a recipe moved keep running."""
    if path.is_file():
        return path
    if not path.suffix and path.with_suffix(".yaml").is_file():
        return path.with_suffix(".yaml")
    index = path.parent / MOVED
    if index.is_file():
        import yaml

        moved = yaml.safe_load(index.read_text(encoding="utf-8")) or {}
        if isinstance(moved, dict) and isinstance(moved.get(path.name), str):
            new = path.parent / moved[path.name]
            print(f"--config {path}: moved to {new} (its release's own config name); reading that", file=sys.stderr)
            return new
    return path


def merge_config(file_values: dict[str, Any], flag_values: dict[str, Any]) -> TrainConfig:
    """TrainConfig from defaults, then the config file, then explicitly given flags. A model name that implies an
    objective (`implied_objective`: SiT names, the flow families) sets it when none is given (the plan says so);
    a SiT name with `--objective ddpm` is refused."""
    merged = {**file_values, **flag_values}
    if isinstance(file_values.get("recipe"), dict):  # what the run changes of the recipe (train/recipes.py)
        from dit_pipeline.train.recipes import setting_departures

        defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig) if f.default is not dataclasses.MISSING}
        merged["recipe"] = {**file_values["recipe"],
                            "departures": setting_departures(file_values, flag_values, defaults)}
    if merged.get("objective") is None and (implied := implied_objective(merged.get("model"))):
        merged["objective"] = implied
    needed = ("run_dir",) if merged.get("source") or merged.get("mix") else ("shards", "run_dir")
    missing = [n for n in needed if merged.get(n) in (None, "")]
    if missing:
        raise ConfigError([f"{flag_name(n)} is required (as a flag or in --config)" for n in missing],
                          "training configuration")
    return TrainConfig(**merged)
