"""The shared click machinery in cli.py: underscore aliases and error mapping."""
import click
from click.testing import CliRunner

from dit_pipeline.cli import DashCommand, debug_option, handle_errors
from dit_pipeline.common.errors import ConfigError, UserError


@click.command(cls=DashCommand)
@click.option("--data-path", required=True)
@click.option("--fail", type=click.Choice(["none", "user", "config"]), default="none")
@debug_option
@handle_errors
def demo_cmd(data_path, fail, debug):
    if fail == "user":
        raise UserError(f"{data_path} is not a directory")
    if fail == "config":
        raise ConfigError(["--batch-size must be > 0", "--lr must be > 0"], "extraction config")
    click.echo(f"path={data_path}")


def test_underscore_alias_and_equals_form():
    r = CliRunner()
    assert r.invoke(demo_cmd, ["--data_path", "x"]).output == "path=x\n"
    assert r.invoke(demo_cmd, ["--data_path=y"]).output == "path=y\n"
    assert r.invoke(demo_cmd, ["--data-path", "z"]).output == "path=z\n"
    res = r.invoke(demo_cmd, ["--data-paht", "z"])
    assert res.exit_code == 2 and "No such option" in res.output


def test_user_error_is_one_line_exit_1():
    res = CliRunner().invoke(demo_cmd, ["--data-path", "/nope", "--fail", "user"])
    assert res.exit_code == 1
    assert res.output == "error: /nope is not a directory\n"
    assert "Traceback" not in res.output


def test_config_error_lists_all_problems_exit_2():
    res = CliRunner().invoke(demo_cmd, ["--data-path", "x", "--fail", "config"])
    assert res.exit_code == 2
    assert "--batch-size must be > 0" in res.output and "--lr must be > 0" in res.output
