"""Every command's --help shows an example, and the console scripts are installed.

The help texts are read in this process, through each console script's own entry point (the function its installed
script calls, importlib.metadata); test_version runs every installed script itself."""
from importlib.metadata import entry_points
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from tests._util import run_cli

COMMANDS = [("dit-extract",), ("dit-train",), ("dit-shards",), ("dit-shards", "verify"), ("dit-shards", "info"),
            ("dit-shards", "stats"), ("dit-sample", "run"), ("dit-sample", "export"), ("dit-eval",), ("dit-report",)]


def _help(cmd: tuple[str, ...], flag: str) -> SimpleNamespace:
    (script,) = [e for e in entry_points(group="console_scripts") if e.name == cmd[0]]
    res = CliRunner().invoke(script.load(), [*cmd[1:], flag], prog_name=cmd[0])
    return SimpleNamespace(returncode=res.exit_code, stdout=res.output, stderr=repr(res.exception))


@pytest.mark.parametrize("cmd", COMMANDS, ids=lambda c: " ".join(c))
def test_help_has_an_example(cmd):
    res = _help(cmd, "--help")
    assert res.returncode == 0, res.stderr
    assert "Example" in res.stdout
    assert f"{cmd[0]} " in res.stdout.split("Example", 1)[1]  # the example uses the command itself


@pytest.mark.parametrize("cmd", COMMANDS, ids=lambda c: " ".join(c))
def test_dash_h_is_help(cmd):
    res = _help(cmd, "-h")
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("Usage: ")
    assert "-h, --help" in res.stdout


@pytest.mark.parametrize("name", ["dit-extract", "dit-train", "dit-shards", "dit-sample", "dit-eval", "dit-report"])
def test_version(name):
    from importlib.metadata import version

    import torch

    res = run_cli(name, ["--version"], timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout == f"{name} (dit-pipeline) {version('dit-pipeline')}, torch {torch.__version__}\n"


def test_a_subcommand_takes_dash_h_after_it_ran_on_its_own():
    """click (>= 8.1.8) builds a command's help option once, from the help names of the first context that asks: a
    subcommand first invoked on its own (as a test or a Python caller may) then refused `-h` through its group
    ("No such option '-h'", seen in the suite when such a test ran first). Each subcommand names its own help options.
    A fresh interpreter, so that no earlier call has built them."""
    import subprocess
    import sys

    script = """
from click.testing import CliRunner
from dit_pipeline.cli import shards_main
from dit_pipeline.cli_sample import sample_main
bad = []
for group, name in [(shards_main, n) for n in ("verify", "info", "stats")] + [(sample_main, n) for n in ("run", "export")]:
    CliRunner().invoke(group.commands[name], ["--help"])
    if CliRunner().invoke(group, [name, "-h"]).exit_code != 0:
        bad.append(name)
print(bad)
"""
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"
