"""Every command's --help shows an example, and the console scripts are installed."""
import pytest

from tests._util import run_cli

COMMANDS = [("dit-extract",), ("dit-train",), ("dit-shards",), ("dit-shards", "verify"), ("dit-shards", "info"),
            ("dit-shards", "stats"), ("dit-sample", "run"), ("dit-sample", "export"), ("dit-eval",), ("dit-report",)]


@pytest.mark.parametrize("cmd", COMMANDS, ids=lambda c: " ".join(c))
def test_help_has_an_example(cmd):
    res = run_cli(cmd[0], [*cmd[1:], "--help"], timeout=120)
    assert res.returncode == 0, res.stderr
    assert "Example" in res.stdout
    assert f"{cmd[0]} " in res.stdout.split("Example", 1)[1]  # the example uses the command itself


@pytest.mark.parametrize("cmd", COMMANDS, ids=lambda c: " ".join(c))
def test_dash_h_is_help(cmd):
    res = run_cli(cmd[0], [*cmd[1:], "-h"], timeout=120)
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
