"""The shared click machinery (cli_kit.py): underscore aliases, reference-DiT habits and error mapping."""
import re

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


def test_a_config_error_is_said_once_under_torchrun(monkeypatch):
    """Issue 41: every rank validates the same settings, and each printed the error (twice with 2 ranks); now rank
    0 says it and the others exit 2 silently."""
    for k, v in {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500",
                 "TORCHELASTIC_RUN_ID": "t"}.items():
        monkeypatch.setenv(k, v)
    said = []
    for rank in ("0", "1"):
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv("LOCAL_RANK", rank)
        res = CliRunner().invoke(demo_cmd, ["--data-path", "x", "--fail", "config"])
        assert res.exit_code == 2
        said.append(res.output)
    assert "--lr must be > 0" in said[0] and said[1] == ""


def _cli(main, args):
    return CliRunner().invoke(main, args)


def test_reference_dit_habits_say_what_to_do_instead(tmp_path, monkeypatch):
    """The flags and values of the reference DiT scripts: not click's "Did you mean --depth?"."""
    from dit_pipeline.cli import eval_main, extract_main, sample_main, train_main

    for flag in ("--data-path", "--data_path"):
        r = _cli(train_main, [flag, "imagenet/train", "--run-dir", "r"])
        assert r.exit_code == 2 and "Did you mean" not in r.output
        assert (f"Error: No such option '{flag}'. dit-train reads latent shards, not images: encode the images once "
                "with `dit-extract --data-path IMAGES --out SHARDS`, then pass --shards SHARDS.") in r.output
    r = _cli(train_main, ["--shards", "s", "--num-classes", "1000"])
    assert r.exit_code == 2 and ("No such option '--num-classes'. the number of classes comes from the shard set's "
                                 "manifest (dit-extract counts the class folders); drop it.") in r.output
    r = _cli(sample_main, ["--ckpt", "c.pt", "--num-sampling-steps", "250"])
    assert r.exit_code == 2 and "No such option '--num-sampling-steps'. the number of steps is --steps." in r.output
    r = _cli(sample_main, ["export", "--to", "diffusers", "o", "--ckpt", "c", "--num-classes", "10"])
    assert r.exit_code == 2 and "No such option '--num-classes'. the number of classes comes from the weights" in r.output
    monkeypatch.chdir(tmp_path)
    for main, args in ((train_main, ["--shards", "s", "--run-dir", "r"]), (extract_main, ["--data-path", "d", "--out", "o"]),
                       (sample_main, ["--ckpt", "c.pt", "--out", "o"])):
        for vae in (["--vae", "mse"], ["--vae=ema"], ["--vae", "ema"]):
            r = _cli(main, [*args, *vae])
            short = vae[-1].split("=")[-1]
            assert r.exit_code == 2, r.output
            assert (f"--vae {short}: the reference DiT scripts' short name; pass the hub id --vae "
                    f"stabilityai/sd-vae-ft-{short} (or a local copy of it: a diffusers folder or a single "
                    ".safetensors file).") in r.output
    r = _cli(eval_main, ["s.npz", "--ref", "r.npz", "--num-classes", "3"])  # no habit table: click's own words
    # click's own wording: "No such option: --num-classes Did you mean" at its floor (8.1), quoted from 8.3.1 on
    assert r.exit_code == 2 and re.search(r"No such option:? '?--num-classes'?\.? Did you mean", r.output), r.output


def test_a_local_folder_named_like_a_short_vae_name_is_a_path(tmp_path, monkeypatch):
    from dit_pipeline.cli import extract_main
    from dit_pipeline.cli_kit import _check_habits

    monkeypatch.chdir(tmp_path)
    (tmp_path / "ema").mkdir()
    _check_habits(extract_main, click.Context(extract_main), ["--vae", "ema"])  # no error: it is a local folder


def test_a_short_vae_name_from_a_config_file_is_answered_too():
    import pytest

    from dit_pipeline.common.vae import classify_vae_spec

    with pytest.raises(UserError, match=r"^--vae 'mse': the reference DiT scripts' short name; pass the hub id "
                                        r"stabilityai/sd-vae-ft-mse \(or a local copy"):
        classify_vae_spec("mse")
