"""The README's commands and code, exercised where they can run on a CPU."""
from __future__ import annotations

import re
from pathlib import Path

import torch

from dit_pipeline import dit
from tests._util import REPO

README = (REPO / "README.md").read_text()


def _block_after(heading: str, lang: str) -> str:
    section = README[README.index(heading):]
    m = re.search(rf"```{lang}\n(.*?)```", section, re.S)
    assert m, f"no ```{lang} block after {heading!r}"
    return m.group(1)


def test_python_api_snippet_runs(tmp_path, monkeypatch):
    """The 'Python API' block, run as written but with a tiny model in place of DiT-XL/2 and few steps."""
    code = _block_after("## Python API", "python")
    tiny = dit.create_model("DiT-S/8", input_size=32, num_classes=1000)
    torch.save(tiny.state_dict(), tmp_path / "DiT-XL-2-256x256.pt")
    code = code.replace('dit.create_model("DiT-XL/2", input_size=32, num_classes=1000)',
                        'dit.create_model("DiT-S/8", input_size=32, num_classes=1000)')
    code = code.replace('timestep_respacing="250"', 'timestep_respacing="3"')
    assert "DiT-S/8" in code and '"3"' in code, "README snippet changed: update this test's substitutions"
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(code, "README.md:python-api", "exec"), scope)
    assert scope["samples"].shape == (8, 4, 32, 32)
    assert torch.isfinite(scope["samples"]).all()
    assert set(scope["losses"]) >= {"loss", "mse", "vb"}
    assert scope["losses"]["loss"].shape == (8,)
    assert scope["info"]["model_config"]["num_classes"] == 1000


# Appended to each Quickstart command so it runs in seconds on a CPU; the README's own flags stay as written
# (click takes the last value of a repeated option).
QUICKSTART_OVERRIDES = {
    "dit-extract": ["--image-size", "32", "--batch-size", "4", "--num-workers", "0"],
    "dit-shards": [],
    "dit-train": ["--depth", "2", "--hidden-size", "32", "--num-heads", "2", "--global-batch-size", "8",
                  "--micro-batch-size", "4", "--max-steps", "2", "--num-workers", "0", "--log-every", "1"],
    "dit-sample": ["--steps", "2", "--sampler", "ddim", "--class-labels", "0,1,2,0"],  # 3 classes here
}


def _commands(block: str) -> list[list[str]]:
    import shlex

    joined = block.replace("\\\n", " ")
    return [shlex.split(line, comments=True) for line in joined.splitlines() if line.strip()]


def test_quickstart_commands_run_as_written(tmp_path, tiny_vae_dir):
    """The Quickstart block, run in a folder where imagenet/train is a tiny image tree and the hub VAE id is
    swapped for the tiny local VAE (no downloads here)."""
    from tests._util import make_image_tree, run_cli

    make_image_tree(tmp_path / "imagenet" / "train", counts=(3, 2, 3))
    commands = _commands(_block_after("## Quickstart", "bash"))
    assert [c[0] for c in commands] == ["dit-extract", "dit-shards", "dit-train", "dit-sample"]
    for argv in commands:
        argv = [str(tiny_vae_dir) if a == "stabilityai/sd-vae-ft-ema" else a for a in argv]
        if argv[0] == "dit-sample":  # the README's checkpoint name is the paper's step count
            ckpts = sorted((tmp_path / "runs/xl2/checkpoints").glob("step-*[0-9].pt"))
            argv = [str(ckpts[-1]) if a.endswith("step-0400000.pt") else a for a in argv]
        res = run_cli(argv[0], [*argv[1:], *QUICKSTART_OVERRIDES[argv[0]]], cwd=tmp_path, timeout=600)
        assert res.returncode == 0, f"{argv}\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}"
    assert (tmp_path / "shards/manifest.json").is_file()
    assert (tmp_path / "samples/grid.png").is_file()
