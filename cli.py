"""Command-line entry points: dit-extract, dit-train, dit-shards, dit-sample.

Thin by design: each command maps its click options onto one config dataclass and calls one function.
Shared behaviour lives here once: dashed flags that also accept the underscore spelling (`--data_path`),
user mistakes printed as one line without a traceback (exit 2 for usage, 1 at run time; `--debug` shows
the traceback), and rank-aware output under torchrun.
"""
from __future__ import annotations

import functools
import os
import sys
import traceback
from typing import Any, Callable

import click

from common.errors import ConfigError, UserError


class DashCommand(click.Command):
    """A click command whose `--some-flag` options also accept `--some_flag` (hidden alias)."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        return super().parse_args(ctx, _dash_args(self, args))


class DashGroup(click.Group):
    command_class = DashCommand

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        return super().parse_args(ctx, _dash_args(self, args))


def _dash_args(cmd: click.Command, args: list[str]) -> list[str]:
    known = {opt for p in cmd.params for opt in getattr(p, "opts", []) + getattr(p, "secondary_opts", [])}
    out = []
    for a in args:
        if a == "--":
            out.extend(args[len(out):])
            break
        if a.startswith("--") and "_" in a:
            name, eq, value = a.partition("=")
            dashed = name.replace("_", "-")
            if name not in known and dashed in known:
                a = dashed + eq + value
        out.append(a)
    return out


def debug_option(f: Callable) -> Callable:
    return click.option("--debug", is_flag=True, default=False, envvar="DIT_DEBUG",
                        help="Show full tracebacks for errors.")(f)


def _rank_prefix() -> str:
    ws = int(os.environ.get("WORLD_SIZE", "1") or 1)
    return f"[rank {os.environ.get('RANK', '0')}] " if ws > 1 else ""


def handle_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn user mistakes into one clear line and the right exit code (see RELIABILITY.md)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        debug = bool(kwargs.get("debug")) or os.environ.get("DIT_DEBUG") == "1"
        try:
            return fn(*args, **kwargs)
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise
        except ConfigError as e:
            if debug:
                traceback.print_exc()
            raise click.UsageError(str(e)) from None
        except UserError as e:
            if debug:
                traceback.print_exc()
            click.echo(f"{_rank_prefix()}error: {e}", err=True)
            sys.exit(e.exit_code)
        except KeyboardInterrupt:
            click.echo(f"{_rank_prefix()}interrupted", err=True)
            sys.exit(130)

    return wrapper
