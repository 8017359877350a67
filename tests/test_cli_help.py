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
