"""The recipe settings of the trainer end to end on the tiny model, all in one run: --optimizer muon, --cosine-loss,
--time-shift, a warm-up and a linear decay to --final-lr ending at an epoch. 8 steps straight, and the same run
killed (SIGKILL) after step 3 and rerun: the same lrs, losses (mse and cos), weights, EMA and state of both
optimizers; the lrs are the schedule's; the checkpoint and its EMA sidecar record the time shift, and dit-sample
samples with it, the trainer's grid pixel for pixel; two ranks training with Muon hold identical weights."""
from __future__ import annotations

import json
import signal

import numpy as np
import pytest
import torch
from PIL import Image

from dit_pipeline import dit
from dit_pipeline.train.checkpoint import CheckpointManager, load_checkpoint
from dit_pipeline.train.metrics import read_metrics
from dit_pipeline.train.optim import muon_available
from tests._util import run_cli
from tests.train.conftest import tiny_args

pytestmark = pytest.mark.skipif(not muon_available(), reason=f"torch {torch.__version__} has no torch.optim.Muon")

STEPS = 8  # the tiny set's epoch is 6 steps (tests/train/conftest.py), so the decay ends at step 6
SETTINGS = {"objective": "flow", "cosine-loss": None, "time-shift": 2.0, "optimizer": "muon", "warmup-steps": 2,
            "final-lr": 2e-4, "lr-decay-start-steps": 3, "lr-decay-end-epochs": 1, "grad-clip": 1.0}
KEYS = ("epoch", "loss", "mse", "cos", "grad_norm", "lr")


def _records(run_dir):
    return {r["step"]: tuple(r[k] for k in KEYS) for r in read_metrics(run_dir)}


@pytest.fixture(scope="module")
def straight(shard_dir, tiny_vae_dir, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("recipe-straight") / "run"
    grids = {"sample-every": STEPS, "vae": tiny_vae_dir, "sample-steps": 5, "sample-classes": "1,0",
             "sample-cfg-scale": 1}  # the trainer's grid at the end (it draws no training randomness)
    r = run_cli("dit-train", tiny_args(shard_dir, run_dir, **SETTINGS, **grids), timeout=600)  # a hang guard only
    assert r.returncode == 0, r.stderr[-3000:]
    return run_dir


def test_the_lrs_are_the_schedule_and_the_cos_term_is_logged(straight):
    lr, final = 1e-3, 2e-4  # tiny_args' lr; warm-up 2, constant to step 3, linear to 2e-4 at step 6 (epoch 1)
    want = [lr * 0.5, lr, lr, lr, lr * (1 - 0.8 / 3), lr * (1 - 0.8 * 2 / 3), final, final]
    recs = read_metrics(straight)
    assert [r["step"] for r in recs] == list(range(1, STEPS + 1))
    torch.testing.assert_close(torch.tensor([r["lr"] for r in recs]), torch.tensor(want), rtol=1e-12, atol=0)
    for r in recs:  # loss = mse + cos, each a per-sample mean over all samples of the step
        assert 0 <= r["cos"] <= 2 and r["loss"] == pytest.approx(r["mse"] + r["cos"], rel=1e-6)
    assert recs[0]["cos"] == pytest.approx(1.0)  # the zero-initialised output layer: cos(0, v) = 0
    assert "(mse " in (straight / "log.txt").read_text() and " cos " in (straight / "log.txt").read_text()


@pytest.mark.determinism  # same world size, same threads per process (both runs are CLI processes)
def test_killed_and_resumed_is_identical(straight, shard_dir, tmp_path):
    run_dir = tmp_path / "run"
    args = tiny_args(shard_dir, run_dir, **SETTINGS)
    r = run_cli("dit-train", args, env={"DIT_FAULT": "train.step_end@3:kill"}, timeout=600)
    assert r.returncode == -signal.SIGKILL and CheckpointManager(run_dir / "checkpoints").steps() == [2]
    r = run_cli("dit-train", args, timeout=600)
    assert r.returncode == 0 and "resumed from" in r.stderr, r.stderr[-3000:]
    assert _records(straight) == _records(run_dir)  # exact float equality, the lr included
    a = load_checkpoint(CheckpointManager(straight / "checkpoints").latest())
    b = load_checkpoint(CheckpointManager(run_dir / "checkpoints").latest())
    for key in ("model", "ema"):
        assert all(torch.equal(a[key][k], b[key][k]) for k in a[key]), key
    assert set(a["opt"]) == {"muon", "adamw"}
    for part in ("muon", "adamw"):
        sa, sb = a["opt"][part]["state"], b["opt"][part]["state"]
        assert sa.keys() == sb.keys() and len(sa) > 0
        assert all(torch.equal(v, sb[i][k]) for i in sa for k, v in sa[i].items() if torch.is_tensor(v)), part


def test_the_time_shift_is_recorded_and_sampled_with(straight, tiny_vae_dir, tmp_path):
    from dit_pipeline.sample import main as sample_main
    from dit_pipeline.sample.config import SampleConfig

    ckpt = load_checkpoint(CheckpointManager(straight / "checkpoints").latest())
    assert ckpt["time_shift"] == 2.0 and ckpt["config"]["time_shift"] == 2.0 and ckpt["objective"] == "flow"
    ema = straight / "checkpoints" / f"step-{STEPS:07d}-ema.pt"
    assert json.loads(ema.with_suffix(".json").read_text())["time_shift"] == 2.0
    _, info = dit.load_dit_weights(ema)
    assert info["time_shift"] == 2.0
    from dit_pipeline.sample import export_main
    from dit_pipeline.sample.config import ExportConfig

    export_main(ExportConfig(to="safetensors", output=str(tmp_path / "m.safetensors"), ckpt=str(ema)))
    assert dit.load_dit_weights(tmp_path / "m.safetensors")[1]["time_shift"] == 2.0  # an export keeps it
    grids = {}
    for name, shift in (("recorded", None), ("unshifted", 1.0)):
        out = tmp_path / name
        sample_main(SampleConfig(ckpt=str(ema), vae=str(tiny_vae_dir), class_labels=[1, 0], sampler="euler", steps=5,
                                 cfg_scale=1.0, out=str(out), quiet=True, time_shift=shift))
        record = json.loads((out / "samples.json").read_text())
        assert record["config"]["time_shift"] == (shift or 2.0)
        assert record["fingerprint"].get("time_shift") == (2.0 if shift is None else None)  # 1: not in it
        with Image.open(out / "grid.png") as im:
            grids[name] = np.asarray(im)
    with Image.open(straight / "samples" / f"step-{STEPS:07d}.png") as im:  # the trainer's grid: the same shift
        assert np.array_equal(np.asarray(im), grids["recorded"])
        assert not np.array_equal(np.asarray(im), grids["unshifted"])


def test_two_ranks_with_muon_hold_identical_weights(shard_dir, tmp_path):
    run_dir = tmp_path / "run"
    args = tiny_args(shard_dir, run_dir, **{**SETTINGS, "max-steps": 2, "num-workers": 1, "micro-batch-size": 2})
    r = run_cli("dit-train", ["--nproc-per-node", "2", *args], timeout=900)  # a hang guard only
    assert r.returncode == 0, r.stderr[-3000:]
    prints = [{x["step"]: x["weights_fingerprint"] for x in read_metrics(run_dir / "logs" / f"rank{k}.jsonl")
               if "weights_fingerprint" in x} for k in (0, 1)]
    assert prints[0] == prints[1] and sorted(prints[0]) == [2]
