"""Settings as data: each config field's default, type, help text and help group written once, on the field.

A config dataclass declares a field with `setting(default, "help text", group=...)`; the CLI builds its options
from these fields (type from the annotation, the default shown from the field's default unless `shown` says
it better), so a setting is one place, not a field plus an option plus a help literal. Stage-owned settings
(the sample grids, FID during training) are dataclasses of their own that the command's config inherits, so
the stored config stays one flat JSON object.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

META_KEY = "setting"


@dataclass(frozen=True)
class SettingHelp:
    """How a config field appears on the command line."""

    text: str                               # the help text, without the default
    group: str                              # the --help section it is listed in
    shown: str | None = None                # the default as the help shows it, when not the field's value
    choices: tuple[str, ...] | None = None  # the accepted values
    hidden: bool = False                    # a test knob: accepted, not listed
    envvar: str | None = None               # an environment variable that sets it too
    cli: bool = True                        # False: config files only (no flag)


def setting(default: Any = dataclasses.MISSING, help: str = "", *, group: str,  # noqa: A002 (click's word)
            default_factory: Any = dataclasses.MISSING, shown: str | None = None,
            choices: tuple[str, ...] | None = None, hidden: bool = False, envvar: str | None = None,
            cli: bool = True) -> Any:
    """A dataclass field with its command-line help (see SettingHelp)."""
    meta = {META_KEY: SettingHelp(help, group, shown, tuple(choices) if choices else None, hidden, envvar, cli)}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def setting_help(f: dataclasses.Field) -> SettingHelp | None:
    return f.metadata.get(META_KEY)


def shown_default(f: dataclasses.Field) -> str | None:
    """The default of field `f` as a help text shows it in brackets (on/off for flags; None: show nothing)."""
    h = setting_help(f)
    if h is not None and h.shown is not None:
        return h.shown
    if f.default is dataclasses.MISSING or f.default is None:
        return None
    if isinstance(f.default, bool):
        return "on" if f.default else "off"
    return str(f.default)


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def positive(cfg: Any, *names: str) -> list[str]:
    """Problems of the fields `names` of `cfg` that are set but not positive integers."""
    out = []
    for name in names:
        v = getattr(cfg, name)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            out.append(f"{flag_name(name)} must be a positive integer, got {v!r}")
    return out


def non_negative(cfg: Any, *names: str) -> list[str]:
    """Problems of the fields `names` of `cfg` that are not numbers >= 0."""
    out = []
    for name in names:
        v = getattr(cfg, name)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
            out.append(f"{flag_name(name)} must be >= 0, got {v!r}")
    return out


def choice(cfg: Any, name: str, values: tuple[str, ...]) -> list[str]:
    """The problem of field `name` when its value is not one of `values`."""
    v = getattr(cfg, name)
    return [] if v in values else [f"{flag_name(name)} must be one of {', '.join(values)}, got {v!r}"]
