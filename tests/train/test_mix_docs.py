"""docs/data-mix.md as a user runs it: every shell command's options exist in the CLI, and the two-source
text-to-image example (a captioned set with long and short captions, a class-labelled set with a caption template,
a validation loss on held-out keys, the report) runs as pasted at a tiny size: in a folder with small image trees,
the tiny VAE and a tiny random Qwen3 in place of the hub's, the sizes below appended, and the held-out fraction
raised to give a tiny set any validation keys at all."""
from __future__ import annotations

import json
import os
import re
import shlex

import pytest
from click.testing import CliRunner

from dit_pipeline.cli import extract_main, report_main, train_main
from dit_pipeline.train.metrics import read_metrics
from tests._util import REPO, make_image_tree
from tests.captions._tiny import make_tiny_qwen3

DOC = (REPO / "docs" / "data-mix.md").read_text()
COMMANDS = {"dit-extract": extract_main, "dit-train": train_main, "dit-report": report_main}
TINY_TRAIN = ["--depth", "1", "--hidden-size", "32", "--num-heads", "2", "--head-depth", "1", "--head-hidden-size",
              "32", "--head-num-heads", "2", "--max-steps", "4", "--global-batch-size", "4", "--micro-batch-size", "2",
              "--num-workers", "0", "--log-every", "1", "--val-every", "2", "--val-samples", "4", "--val-timesteps", "4",
              "--quiet"]


# and grids of prompts while training (the run's text encoder: the mix's text sets' one)
GRIDS = ["--sample-every", "2", "--sample-prompts", "prompts.txt", "--sample-steps", "2"]


def blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", DOC, re.S)


def commands() -> list[list[str]]:
    return [shlex.split(line) for block in blocks("bash") for line in block.replace("\\\n", " ").splitlines()
            if line.strip()]


def test_every_shell_command_of_the_page_is_a_real_command_with_real_options():
    cmds = commands()
    assert cmds[0][:2] == ["dit-train", "--source"]  # the page opens with a runnable command
    for argv in cmds:
        cmd = COMMANDS[argv[0]]
        names = {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)}
        for a in argv[1:]:
            if a.startswith("--"):
                assert a in names, f"{argv[0]} has no option {a}"


@pytest.fixture(scope="module")
def example(tmp_path_factory, tiny_vae_dir):
    root = tmp_path_factory.mktemp("mix-doc")
    photos = make_image_tree(root / "photos", counts=(4, 4, 4), size=(40, 40))
    paths = sorted(p.relative_to(photos).as_posix() for p in photos.rglob("*.JPEG"))
    (root / "captions.jsonl").write_text("".join(
        json.dumps({"path": p, "long": f"a photo of a cat sitting on a red sofa number {i}", "short": f"image {i}"})
        + "\n" for i, p in enumerate(paths)))
    make_image_tree(root / "imagenet" / "train", counts=(3, 3, 3), size=(40, 40))
    (root / "imagenet-names.txt").write_text("tench\ngoldfish\nshark\n")
    (root / "mix.yaml").write_text(blocks("yaml")[0].replace("holdout: 0.01", "holdout: 0.5"))
    qwen = make_tiny_qwen3(root / "qwen3")
    (root / "prompts.txt").write_text("a red sofa\na photo of a tench\n")
    example_block = next(b for b in blocks("bash") if "--caption-template" in b)
    runner = CliRunner()
    outputs = {}
    for line in example_block.strip().splitlines():
        argv = shlex.split(line)
        args = [str(qwen) if a == "qwen3-0.6b" else a for a in argv[1:]]
        if argv[0] == "dit-extract" and "--text-encoder" in args:
            args += ["--text-max-length", "24", "--batch-size", "5", "--quiet"]
        elif argv[0] == "dit-extract":
            args += ["--vae", str(tiny_vae_dir), "--image-size", "32", "--samples-per-shard", "4", "--batch-size", "4",
                     "--num-workers", "0", "--quiet"]
        elif argv[0] == "dit-train":
            args += TINY_TRAIN + GRIDS + ["--vae", str(tiny_vae_dir)]
        cwd = os.getcwd()
        os.chdir(root)
        try:
            r = runner.invoke(COMMANDS[argv[0]], args)
        finally:
            os.chdir(cwd)
        assert r.exit_code == 0, f"{line}\n{r.output}\n{r.exception!r}"
        outputs[argv[0]] = r.output
    return root


def test_the_two_source_text_to_image_example_runs_as_pasted(example):
    run = example / "runs" / "t2i"
    text = json.loads((example / "shards" / "in1k-qwen3" / "manifest.json").read_text())["text"]["source"]
    assert text["template"] == "a photo of a {name}"
    assert text["class_captions"] == ["a photo of a tench", "a photo of a goldfish", "a photo of a shark"]
    recs = read_metrics(run)
    vals = [r for r in recs if "val_run" in r]
    assert [r["step"] for r in vals] == [0, 2, 4]
    assert vals[0]["val_run"]["set"] == "held-out keys of photos (0.5)" and vals[0]["val_run"]["samples"] == 4
    last = [r for r in recs if "loss" in r][-1]
    assert last["seen_photos"] + last["seen_in1k"] == 16 and last["asked_photos"] > 0.6
    cfg = json.loads((run / "config.json").read_text())
    assert [s["name"] for s in cfg["data_mix"]["sources"]] == ["photos", "in1k"]
    assert cfg["data_mix"]["sources"][1]["template"] == "a photo of a {name}"
    report = (run / "report.md").read_text()
    assert "## Validation loss" in report and "## Data mix" in report and (run / "report.png").is_file()
    assert "| photos | `shards/photos` | proportion 0.7, text shards/photos-qwen3, holdout 0.5 |" in report
    grids = sorted(p.name for p in (run / "samples").iterdir())
    assert grids == ["step-0000002.png", "step-0000004.png"]  # a text mix's grids of prompts


@pytest.mark.sweep
def test_the_example_encoding_online_gives_the_cached_losses(example):
    """The same mix with the captions (and the template's) encoded while training: the very losses of the cached
    features, step by step, and the same validation loss (the tiny Qwen3 is bfloat16: its stored features are its
    outputs bit for bit)."""
    line = next(b for b in blocks("bash") if "--caption-template" in b).strip().splitlines()[-2]
    argv = shlex.split(line)
    args = [*argv[1:], *TINY_TRAIN, "--text-features", "online", "--run-dir", "runs/t2i-online"]
    cwd = os.getcwd()
    os.chdir(example)
    try:
        r = CliRunner().invoke(train_main, args)
    finally:
        os.chdir(cwd)
    assert r.exit_code == 0, r.output
    keys = ("step", "loss", "mse", "grad_norm", "val_loss_raw", "val_loss_ema")
    a = [{k: rec.get(k) for k in keys} for rec in read_metrics(example / "runs" / "t2i")]
    b = [{k: rec.get(k) for k in keys} for rec in read_metrics(example / "runs" / "t2i-online")]
    assert a == b and len(a) >= 4
