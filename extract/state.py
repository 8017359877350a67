"""The output folder of an extraction: what may be resumed, what must be refused, what is finished.

Layout: OUT/shard-*.tar, OUT/manifest.json (written last), OUT/logs/, and the hidden resume state
OUT/.extract/: `config.json` (the extraction record of the run that owns the folder), `options.json`
(the command's options as given, informational) and one
`shard-000123.json` per finished shard (its ShardRecord and its skipped images), each written atomically
right after the shard itself was renamed into place. A shard counts as finished only if its state file
exists and the file on disk has the recorded size and sha256; anything else is redone, so a run killed at
any moment resumes to exactly the shard set an uninterrupted run writes (RELIABILITY.md).
"""
from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dit_pipeline.common.errors import UserError
from dit_pipeline.common.io import atomic_write_json, remove_stale_temps, sha256_file
from dit_pipeline.shards import MANIFEST_NAME, ShardRecord, shard_index, shard_name
from dit_pipeline.shards.format import revision_index

STATE_DIR = ".extract"
CONFIG_FILE = "config.json"
OPTIONS_FILE = "options.json"      # ExtractConfig as given (dataclasses.asdict), informational
LOG_DIR = "logs"
# Record fields that may differ between the run that started a folder and the one resuming it:
# informational ones are ignored, numerics ones change last bits only and are reported as a warning.
INFO_KEYS = ("data_path",)
NUMERICS_KEYS = ("batch_size", "compile", "cpu_threads", "device", "versions")
VAE_INFO_KEYS = ("source", "kind", "config")

log = logging.getLogger("dit_pipeline")


@dataclass(frozen=True)
class ShardState:
    record: ShardRecord
    skipped: list[dict[str, Any]] = field(default_factory=list)   # {"key", "path", "reason"}
    pixel_bytes: int | None = None     # --pixels: the bytes of the shard's pixels members (None: no pixels)
    # --captions: the shard's caption counts and digest (extract/captions.py); a text set's shard: its text
    # counts (extract/text.py). None otherwise.
    captions: dict[str, Any] | None = None
    text: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        d = {"record": self.record.to_dict(), "skipped": list(self.skipped)}
        for k in ("pixel_bytes", "captions", "text"):
            if getattr(self, k) is not None:
                d[k] = getattr(self, k)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ShardState":
        return cls(record=ShardRecord.from_dict(d["record"]), skipped=list(d["skipped"]),
                   pixel_bytes=d.get("pixel_bytes"), captions=d.get("captions"), text=d.get("text"))


def state_path(out: str | Path, shard: int) -> Path:
    return Path(out) / STATE_DIR / (Path(shard_name(shard)).stem + ".json")


def save_shard_state(out: str | Path, shard: int, state: ShardState) -> None:
    atomic_write_json(state_path(out, shard), state.to_dict())


def load_shard_state(out: str | Path, shard: int) -> ShardState | None:
    """The recorded state of a shard, or None when absent or unreadable (then the shard is redone)."""
    path = state_path(out, shard)
    try:
        return ShardState.from_dict(json.loads(path.read_text(encoding="utf-8")))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.warning("ignoring unreadable shard state %s (%s); that shard will be redone", path, e)
        return None


def finished_shard(out: str | Path, shard: int) -> ShardState | None:
    """The state of shard `shard` if its file is complete (recorded size and sha256), else None."""
    state = load_shard_state(out, shard)
    if state is None or state.record.name != shard_name(shard):
        return None
    path = Path(out) / state.record.name
    try:
        if path.stat().st_size != state.record.bytes:
            return None
    except FileNotFoundError:
        return None
    return state if sha256_file(path) == state.record.sha256 else None


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            flat.update(_flatten(v, f"{prefix}{k}."))
        else:
            flat[f"{prefix}{k}"] = v
    return flat


def _comparable(record: dict[str, Any]) -> dict[str, Any]:
    flat = _flatten(record)
    vae = record.get("vae") or {}
    # The same weights reached through another path are the same VAE; without a hash, the source decides
    # (stored absolute: the path as typed, `source_given`, depends on the working directory and is display only).
    drop = {f"vae.{k}" for k in VAE_INFO_KEYS} if vae.get("weights_sha256") else set()
    drop.add("vae.source_given")
    if (record.get("encoder") or {}).get("weights_sha256"):  # a feature encoder's weights: by hash too
        drop |= {"encoder.spec", "encoder.weights"}
    return {k: v for k, v in flat.items() if k not in drop}


def record_differences(old: dict[str, Any], new: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(differences that make the folder incompatible, differences in numerics only), as readable lines."""
    a, b = _comparable(old), _comparable(new)
    hard, soft = [], []
    for k in sorted(set(a) | set(b)):
        top = k.split(".", 1)[0]
        if top in INFO_KEYS or a.get(k, "<absent>") == b.get(k, "<absent>"):
            continue
        line = f"{k}: {a.get(k, '<absent>')!r} in the folder, {b.get(k, '<absent>')!r} now"
        (soft if top in NUMERICS_KEYS else hard).append(line)
    return hard, soft


def _ours(name: str) -> bool:
    return (name.startswith(".") or name in (MANIFEST_NAME, LOG_DIR) or shard_index(name) is not None
            or revision_index(name) is not None)  # an earlier manifest kept by dit-shards stats --write


def clear_output(out: Path) -> None:
    """Delete what an extraction wrote (manifest first, so a half-cleared folder never looks complete)."""
    (out / MANIFEST_NAME).unlink(missing_ok=True)
    for p in sorted(out.iterdir()):
        if (shard_index(p.name) is not None or revision_index(p.name) is not None) and p.is_file():
            p.unlink()
    shutil.rmtree(out / STATE_DIR, ignore_errors=True)
    remove_stale_temps(out)


def _saved_record(out: Path) -> dict[str, Any] | None:
    try:
        return json.loads((out / STATE_DIR / CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def prepare_output(out: str | Path, record: dict[str, Any], *, overwrite: bool) -> str:
    """Check OUT against this run's extraction record before anything is written.

    Returns "new", "resume" or "overwritten". Raises UserError for a file in the way, foreign files,
    or a shard set made with another configuration (unless `overwrite`, which deletes it first).
    """
    out = Path(out)
    if not out.exists():
        return "new"
    if not out.is_dir():
        raise UserError(f"--out {out}: exists and is not a folder; choose a new or empty folder.")
    names = sorted(p.name for p in out.iterdir())
    foreign = [n for n in names if not _ours(n)]
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise UserError(f"--out {out}: holds files that dit-extract did not write ({shown}); choose a new or "
                        "empty folder (nothing was changed).")
    saved = _saved_record(out)
    if saved is None and not any(n == MANIFEST_NAME or shard_index(n) is not None for n in names):
        return "new"
    if saved is None:
        hard = ["the folder holds shards but no extraction state (.extract/config.json), so their "
                "configuration is unknown"]
    else:
        hard, soft = record_differences(saved, record)
        for line in soft:
            log.warning("resuming with a different %s; shards redone now may differ from the others in "
                        "the last bits", line)
    if not hard:
        return "resume"
    if not overwrite:
        raise UserError(f"--out {out}: holds a shard set made with a different configuration:\n  - "
                        + "\n  - ".join(hard) + "\nUse another --out, rerun with the original settings to "
                        "resume it, or pass --overwrite to delete it and start over (nothing was changed).")
    log.warning("--overwrite: deleting the shard set in %s made with a different configuration", out)
    clear_output(out)
    return "overwritten"


def start_output(out: str | Path, record: dict[str, Any], options: dict[str, Any] | None = None) -> None:
    """Record this run's configuration (and, for the record, the command's options as given) and drop
    temp files left by a killed writer (rank 0, once)."""
    out = Path(out)
    (out / STATE_DIR).mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / STATE_DIR / CONFIG_FILE, record)
    if options is not None:
        atomic_write_json(out / STATE_DIR / OPTIONS_FILE, options)
    for removed in remove_stale_temps(out) + remove_stale_temps(out / STATE_DIR):
        log.info("removed %s left by an interrupted run", removed.name)


__all__ = ["ShardState", "STATE_DIR", "clear_output", "finished_shard", "load_shard_state",
           "prepare_output", "record_differences", "save_shard_state", "start_output", "state_path"]
