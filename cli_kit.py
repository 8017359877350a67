"""The click machinery every dit-* command shares (cli.py holds the commands themselves).

Dashed flags that also accept the underscore spelling (`--data_path`); habits from the reference DiT scripts
answered with what to do instead; user mistakes printed as one line without a traceback (exit 2 for usage,
1 at run time; `--debug` shows the traceback) and rank-aware under torchrun; `--version`; and options built
from a config dataclass's fields (common.settings: type, default, help and --help section written once on the
field), listed by section.
"""
from __future__ import annotations

import functools
import os
import sys
import traceback
from typing import Any, Callable

import click

from dit_pipeline.common.errors import ConfigError, UserError


class DashCommand(click.Command):
    """A click command whose `--some-flag` options also accept `--some_flag` (hidden alias), and that answers
    the flags and values of the reference DiT scripts (`HABITS`) with what to do instead."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        _check_habits(self, ctx, args)
        return super().parse_args(ctx, _dash_args(self, args))


class DashGroup(click.Group):
    command_class = DashCommand

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        return super().parse_args(ctx, _dash_args(self, args))


_EXTRACT_FIRST = ("dit-train reads latent shards, not images: encode the images once with `dit-extract --data-path "
                  "IMAGES --out SHARDS`, then pass --shards SHARDS")
_FROM_MANIFEST = ("the number of classes comes from the shard set's manifest (dit-extract counts the class folders); "
                  "drop it")
_FROM_WEIGHTS = "the number of classes comes from the weights (the label table's size); drop it"
# Flags of the reference DiT scripts (train.py, sample.py, sample_ddp.py) that a command here does not take,
# per command name, with what to do instead (checked before click's "No such option ... Did you mean").
HABITS: dict[str, dict[str, str]] = {
    "dit-train": {"--data-path": _EXTRACT_FIRST, "--num-classes": _FROM_MANIFEST,
                  "--results-dir": "the run folder is --run-dir", "--global-seed": "the seed is --seed",
                  "--feature-path": "fast-DiT's features are shards here: pass --shards (made by dit-extract)"},
    "run": {"--num-classes": _FROM_WEIGHTS, "--num-sampling-steps": "the number of steps is --steps",
            "--global-seed": "the seed is --seed", "--per-proc-batch-size": "the batch per process is --batch-size",
            "--num-fid-samples": "the number of samples is --num-samples (with --npz FILE)",
            "--sample-dir": "pass --npz FILE for the evaluator's .npz, --out DIR for a grid"},
    "export": {"--num-classes": _FROM_WEIGHTS},
}
# The reference scripts' short --vae values, and the hub ids they stand for.
VAE_SHORT_NAMES = {"ema": "stabilityai/sd-vae-ft-ema", "mse": "stabilityai/sd-vae-ft-mse"}


def _check_habits(cmd: click.Command, ctx: click.Context, args: list[str]) -> None:
    """A UsageError (exit 2) saying what to do for a reference-DiT flag this command lacks, or for
    `--vae ema|mse` (unless a local file or folder has that name)."""
    known = {opt for p in cmd.params for opt in getattr(p, "opts", []) + getattr(p, "secondary_opts", [])}
    habits = HABITS.get(cmd.name or "", {})
    for i, a in enumerate(args):
        if a == "--":
            return
        if not a.startswith("--"):
            continue
        name, eq, value = a.partition("=")
        dashed = name.replace("_", "-")
        if name not in known and dashed not in known and dashed in habits:
            raise click.UsageError(f"No such option '{name}'. {habits[dashed]}.", ctx=ctx)
        if dashed == "--nproc-per-node" and dashed not in known:
            prog = _program(ctx)
            raise click.UsageError(f"No such option '{name}'. Only dit-train starts its own ranks; start {prog} "
                                   f"under torchrun: torchrun --nproc-per-node N $(which {prog}) ...", ctx=ctx)
        if dashed == "--vae" and "--vae" in known:
            value = value if eq else (args[i + 1] if i + 1 < len(args) else "")
            if value in VAE_SHORT_NAMES and not os.path.exists(value):
                raise click.UsageError(f"--vae {value}: the reference DiT scripts' short name; pass the hub id "
                                       f"--vae {VAE_SHORT_NAMES[value]} (or a local copy of it: a diffusers folder "
                                       "or a single .safetensors file).", ctx=ctx)


def _program(ctx: click.Context) -> str:
    """The installed command's name (dit-sample, also for its default subcommand `run`)."""
    root = ctx.find_root()
    name = root.info_name or root.command.name or "the command"
    return name if name.startswith("dit-") else f"dit-{name.split('_')[0].split('-')[0]}"


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


# Every command and subcommand takes -h as well as --help.
CONTEXT = {"help_option_names": ["-h", "--help"]}


def version_option(f: Callable) -> Callable:
    """`--version`: the installed dit-pipeline version and the torch it runs on."""
    def message() -> str:
        from importlib.metadata import PackageNotFoundError, version

        import torch

        try:
            ours = version("dit-pipeline")
        except PackageNotFoundError:
            ours = "unknown (not installed)"
        return f"%(prog)s (dit-pipeline) {ours}, torch {torch.__version__}"

    def show(ctx: click.Context, param: click.Parameter, value: bool) -> None:
        if value and not ctx.resilient_parsing:
            click.echo(message() % {"prog": ctx.find_root().info_name})
            ctx.exit()

    return click.option("--version", is_flag=True, expose_value=False, is_eager=True, callback=show,
                        help="Show the version and exit.")(f)


def debug_option(f: Callable) -> Callable:
    return click.option("--debug", is_flag=True, default=False, envvar="DIT_DEBUG",
                        help="Show full tracebacks for errors.")(f)


def default(config: type, name: str) -> Any:
    """The default of a config dataclass field: the one place a command's defaults are written."""
    return config.__dataclass_fields__[name].default


def shown(config: type, name: str) -> str:
    """A default as the help texts show it in brackets (on/off for flags)."""
    v = default(config, name)
    if isinstance(v, bool):
        return "on" if v else "off"
    return str(v)


def _rank_prefix() -> str:
    from dit_pipeline.common import distributed as dist

    try:
        info = dist.launch_info()
    except UserError:  # the launch itself is what is wrong
        return ""
    return f"[rank {info.rank}] " if info.world_size > 1 else ""


def _other_rank() -> bool:
    """Whether this process is a rank other than 0 of a multi-process launch (torchrun, srun)."""
    from dit_pipeline.common import distributed as dist

    try:
        info = dist.launch_info()
    except UserError:
        return False
    return info.world_size > 1 and info.rank != 0


def exit_after_distributed_run() -> None:
    """End a process of a multi-process launch that has finished, left its process group and written everything:
    flush, then os._exit(0), skipping interpreter finalization. There a C++ static destructor with a live thread
    ("terminate called without an active exception", SIGABRT, no Python frame) aborted 2 of 68 two-rank
    `dit-eval --t2i` runs after their results were written, turning a complete evaluation into a failed launch.
    A no-op for a single process."""
    from dit_pipeline.common import distributed as dist

    try:
        if dist.launch_info().world_size <= 1:
            return
    except UserError:
        return
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


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
            if _other_rank():  # every rank validates the same settings: rank 0 says it once (issue 41)
                sys.exit(2)
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


def _int_or_auto(ctx: click.Context, param: click.Parameter, value: str | None) -> int | str | None:
    if value is None or value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise click.BadParameter(f"{value!r} is neither a whole number nor 'auto'") from None


class GroupedOption(click.Option):
    """An option listed under a section (`group`) of --help."""

    def __init__(self, *args: Any, group: str = "Other options", **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.group = group


class GroupedCommand(DashCommand):
    """A command whose --help lists its options in sections, in the order `groups` names them."""

    groups: tuple[str, ...] = ()

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        sections: dict[str, list[tuple[str, str]]] = {}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is not None:
                sections.setdefault(getattr(param, "group", COMMAND_GROUP), []).append(record)
        order = [*self.groups, *sorted(set(sections) - set(self.groups) - {COMMAND_GROUP}), COMMAND_GROUP]
        for name in order:
            if name in sections:
                with formatter.section(name):
                    formatter.write_dl(sections[name])


COMMAND_GROUP = "Command"


def config_options(config: type, *, skip: tuple[str, ...] = ()) -> Callable[[Callable], Callable]:
    """Options mapped 1:1 onto the fields of a config dataclass, from each field's `setting` (type from the
    annotation, choices, help, group; the default shown in brackets). Every option defaults to None, so it
    only overrides a config file when it is given; the defaults themselves live in the dataclass."""
    import dataclasses
    import typing

    from dit_pipeline.common.settings import flag_name, setting_help, shown_default

    hints = typing.get_type_hints(config)
    options = []
    for f in dataclasses.fields(config):
        h = setting_help(f)
        if h is None or not h.cli or f.name in skip:
            continue
        kind = hints[f.name]
        args = [n for n in typing.get_args(kind) if n is not type(None)] or [kind]
        name, kw = flag_name(f.name), {}
        if typing.get_origin(args[0]) is list and typing.get_args(args[0]) == (str,):  # repeatable (--source A --source B)
            decls, kw = [name], {"multiple": True, "type": str}
        elif bool in args:
            decls = [f"{name}/--no-{name[2:]}"]
        elif str in args and int in args:  # an integer or a word ("auto")
            decls, kw = [name], {"callback": _int_or_auto}
        else:
            decls = [name]
            kw = {"type": click.Choice(h.choices) if h.choices else args[0] if args[0] in (int, float) else str}
        shown = shown_default(f)
        text = h.text + (f" [{shown}]." if shown else ".")
        options.append(GroupedOption([*decls, f.name], default=None, help=text, hidden=h.hidden, envvar=h.envvar,
                                     group=h.group, **kw))

    def decorate(fn: Callable) -> Callable:
        fn.__click_params__ = [*getattr(fn, "__click_params__", []), *reversed(options)]  # type: ignore[attr-defined]
        return fn

    return decorate
