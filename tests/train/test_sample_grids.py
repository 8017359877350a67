"""Sample grids during training (--sample-every with --vae): the options are checked before any work and a
bad --vae fails before training starts; rank 0 writes RUN/samples/step-NNNNNNN.png without changing the
training (identical losses, weights and saved RNG states with and without grids, and after a resume); and
`dit-sample` on the bare EMA file of this non-preset model (read through its sidecar, with the sidecar's
latent scale) reproduces the trainer's grid pixel for pixel."""
from __future__ import annotations

import copy
import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from PIL import Image

from dit_pipeline import dit
from dit_pipeline.cli import train_main
from dit_pipeline.common.errors import UserError
from tests._util import run_cli
from tests.train.conftest import tiny_args
from tests.train.helpers import make_shard_set
from dit_pipeline.sample.grid import SampleGridHook, grid_size
from dit_pipeline.sample.names import label_texts
from dit_pipeline.train.checkpoint import CheckpointManager, load_checkpoint
from dit_pipeline.train.hooks import HookContext
from dit_pipeline.train.metrics import read_metrics

GRID = {"sample-every": 2, "sample-classes": "1,0,1", "sample-steps": 5, "sample-cfg-scale": 3.0}


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """Latents scaled by 0.7, not the tiny VAE's 0.5: decoding must use the scale the model was trained on."""
    folder = tmp_path_factory.mktemp("grid-shards") / "shards"
    make_shard_set(folder, samples=[16, 16, 16, 12], scaling_factor=0.7)
    return folder


def _train(shards, run_dir, vae=None, **kw):
    opts = {"max-steps": 4, "num-workers": 1, "quiet": None, **kw}
    if vae is not None:
        opts.update({**GRID, "vae": vae})
    r = run_cli("dit-train", tiny_args(shards, run_dir, **opts), timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return run_dir


@pytest.fixture(scope="module")
def runs(shards, tiny_vae_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("grid-runs")
    plain = _train(shards, root / "plain")
    grids = _train(shards, root / "grids", vae=tiny_vae_dir)
    resumed = _train(shards, root / "resumed", vae=tiny_vae_dir, **{"max-steps": 2})
    _train(shards, resumed, vae=tiny_vae_dir)  # the same command with 4 steps: resumes at step 2
    return plain, grids, resumed


def _invoke(args):
    return CliRunner().invoke(train_main, [str(a) for a in args])


@pytest.mark.parametrize("opts,code,message", [
    ({"sample-every": 2}, 1, "records the VAE 'tests/tiny-vae', a local folder that does not exist here ("),
    ({"vae": "VAE"}, 2, "--vae only serve the sample grids: add --sample-every N"),
    ({"sample-every": 2, "vae": "VAE", "sample-steps": 51}, 2, "nearest valid counts: 46, 48, 50, 53"),
    ({"sample-every": 2, "vae": "VAE", "sample-classes": "0,x"}, 1, "--sample-classes: no class named 'x' in the "
                                                                    "shard set"),  # a name, as dit-sample takes
    ({"sample-every": 2, "vae": "VAE", "sample-cfg-scale": 0.5}, 2, "--sample-cfg-scale must be >= 1"),
    ({"sample-every": 0, "vae": "VAE"}, 2, "--sample-every must be a positive integer"),
    ({"sample-every": 2, "vae": "/nope/vae"}, 1, "--vae '/nope/vae': no such file or folder"),
    ({"sample-every": 2, "vae": "VAE", "sample-classes": "0,5"}, 1, "--sample-classes 0,5: the shard set has 2 "
                                                                    "classes, ids 0..1"),
    ({"sample-every": 2, "vae": "VAE", "sample-prompts": "/nope/p.txt"}, 1, "--sample-prompts /nope/p.txt: cannot "
                                                                            "read it"),
    ({"sample-every": 2, "vae": "VAE", "sample-prompts": "OWN"}, 1, "--sample-prompts: prompts draw a text run's "
                                                                    "grids; this run is conditioned on class labels"),
    ({"vae": "VAE", "sample-prompts": "OWN"}, 2, "--vae, --sample-prompts only serve the sample grids"),
])
def test_grid_options_are_checked_before_any_work(shards, tiny_vae_dir, tmp_path, opts, code, message):
    run_dir = tmp_path / "run"
    (tmp_path / "p.txt").write_text("a cat\n")
    opts = {k: {"VAE": str(tiny_vae_dir), "OWN": str(tmp_path / "p.txt")}.get(v, v) if isinstance(v, str) else v
            for k, v in opts.items()}
    r = _invoke(tiny_args(shards, run_dir, **{"num-workers": 0, "quiet": None, **opts}))
    assert r.exit_code == code, r.output
    assert message in r.output and "Traceback" not in r.output
    assert not run_dir.exists()  # nothing written


def test_grids_are_written_and_change_nothing_in_training(runs):
    plain, grids, resumed = runs
    names = ["step-0000002.png", "step-0000004.png"]
    assert sorted(p.name for p in (grids / "samples").iterdir()) == names
    assert sorted(p.name for p in (resumed / "samples").iterdir()) == names
    with Image.open(grids / "samples" / "step-0000004.png") as im:
        assert im.size[::-1] == grid_size(3, 64, 64) == (134, 134)  # 3 tiles of 64x64 images, 2 per row
        assert np.asarray(im).std() > 5
    for run in (grids, resumed):
        assert [(r["step"], r["loss"], r["grad_norm"]) for r in read_metrics(run)] == \
            [(r["step"], r["loss"], r["grad_norm"]) for r in read_metrics(plain)]
        for step in (2, 4):
            a = load_checkpoint(CheckpointManager(plain / "checkpoints").path(step))
            b = load_checkpoint(CheckpointManager(run / "checkpoints").path(step))
            for key in ("model", "ema"):
                assert all(torch.equal(a[key][k], b[key][k]) for k in a[key]), (run, step, key)
            # torch's global generator is seeded by the trainer and nothing draws from it, the DataLoader
            # included, so its saved state matches after a resume too (numpy's and Python's: see below)
            assert torch.equal(a["rng"]["torch"], b["rng"]["torch"]), (run, step)
    # the resumed run drew the same step-4 grid as the uninterrupted one
    step4 = [(run / "samples" / "step-0000004.png").read_bytes() for run in (grids, resumed)]
    assert step4[0] == step4[1]


def test_dit_sample_on_the_bare_ema_file_reproduces_the_trainers_grid(runs, tiny_vae_dir, tmp_path):
    _, grids, _ = runs
    ema = grids / "checkpoints" / "step-0000004-ema.pt"
    sidecar = json.loads(ema.with_suffix(".json").read_text())
    assert sidecar["model_config"]["num_heads"] == 2 and sidecar["model_config"]["model"] is None
    assert sidecar["latent"]["scaling_factor"] == 0.7 and sidecar["step"] == 4
    out = tmp_path / "out"
    r = run_cli("dit-sample", ["--ckpt", str(ema), "--vae", str(tiny_vae_dir), "--class-labels", "1,0,1",
                               "--seed", "0", "--sampler", "ddim", "--steps", "5", "--cfg-scale", "3",
                               "--out", str(out), "--quiet"], timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    record = json.loads((out / "samples.json").read_text())
    assert record["fingerprint"]["scaling_factor"] == 0.7  # the sidecar's scale, not the VAE config's 0.5
    with Image.open(out / "grid.png") as a, Image.open(grids / "samples" / "step-0000004.png") as b:
        assert np.array_equal(np.asarray(a), np.asarray(b))


def test_the_hook_draws_no_global_random_numbers(tiny_vae_dir, tmp_path):
    model = dit.create_model("DiT-S/2", input_size=8, num_classes=2, depth=2, hidden_size=32, num_heads=2)
    ctx = HookContext(step=6, epoch=0, rank=0, world_size=1, run_dir=tmp_path, device=torch.device("cpu"),
                      model=model.train(), ema=copy.deepcopy(model).eval(), model_config=model.config,
                      latent={"scaling_factor": 0.7, "shift_factor": None}, num_classes=2, config={})
    hook = SampleGridHook(every=2, vae=str(tiny_vae_dir), class_labels=[1, 0], steps=5, cfg_scale=3.0)
    hook.load()
    hook.setup(ctx)
    states = torch.get_rng_state(), np.random.get_state(), random.getstate()
    assert hook(ctx) == tmp_path / "samples" / "step-0000006.png" and model.training
    after = torch.get_rng_state(), np.random.get_state(), random.getstate()
    assert torch.equal(states[0], after[0]) and states[2] == after[2]
    assert all(np.array_equal(x, y) for x, y in zip(states[1], after[1]))
    with pytest.raises(UserError, match=r"--sample-classes \[2\]: the model has 2 classes"):
        SampleGridHook(every=2, vae=str(tiny_vae_dir), class_labels=[0, 2]).setup(ctx)


def test_grid_vae_defaults_to_the_one_the_manifest_records(tmp_path, tiny_vae_dir):
    import json

    from dit_pipeline.train import TrainConfig, build_hooks

    folder = tmp_path / "shards"
    make_shard_set(folder, samples=[4, 4])
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["extraction"]["vae"]["source"] = str(tiny_vae_dir)
    (folder / "manifest.json").write_text(json.dumps(manifest))
    [hook] = build_hooks(TrainConfig(shards=str(folder), run_dir=str(tmp_path / "run"), max_steps=1, sample_every=1))
    assert hook.vae == str(tiny_vae_dir) and hook.vae_config is None


def test_hook_labels_tiles_with_class_names_and_can_draw_the_raw_weights(tmp_path, monkeypatch):
    import dit_pipeline.sample.grid as grid

    drawn, saved = [], []
    monkeypatch.setattr(grid, "sample_grid", lambda model, **kw: drawn.append(model) or np.zeros((2, 8, 8, 3), np.uint8))
    monkeypatch.setattr(grid, "save_grid", lambda images, path, labels: saved.append((Path(path).name, labels)))
    hook = SampleGridHook(every=1, vae="v", class_labels=[1, 0], weights="both")
    hook._vae = torch.nn.Identity()
    raw, ema = torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)
    raw.condition_kind = ema.condition_kind = "class"  # what the hook asks of the model (a DiT's attribute)
    ctx = HookContext(step=3, epoch=0, rank=0, world_size=1, run_dir=tmp_path, device=torch.device("cpu"),
                      model=raw, ema=ema, model_config={"class_dropout_prob": 0.1, "in_channels": 4},
                      latent={"scaling_factor": 0.5}, num_classes=2, config={}, class_names=["cat", "dog"])
    hook(ctx)
    assert drawn == [ema, raw]
    assert saved == [("step-0000003.png", ["1 dog", "0 cat"]), ("step-0000003-raw.png", ["1 dog", "0 cat"])]
    assert label_texts([1, 0], None) == ["1", "0"]
