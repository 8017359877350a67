"""Training behaviour in-process (one rank, CPU): it learns (loss drops, class-conditional samples land
nearest their own class), gradient accumulation equals one big batch, activation checkpointing changes
nothing, bf16/fp16 autocast run (fp16 with a checkpointed GradScaler), and an injected NaN stops the run
before the optimizer update."""
from __future__ import annotations

import pytest
import torch

import dit
from common import faults
from tests.train.helpers import class_mean, make_shard_set
from train import merge_config, run
from train.checkpoint import CheckpointManager, load_checkpoint
from train.loop import TrainingDiverged
from train.metrics import read_metrics

TINY = {"model": "DiT-S/2", "depth": 2, "hidden_size": 32, "num_heads": 2, "num_workers": 0, "quiet": True,
        "log_every": 1, "lr": 1e-3}


def _run(shards, run_dir, **kw):
    assert run(merge_config({}, {"shards": str(shards), "run_dir": str(run_dir), **TINY, **kw})) == "done"
    return load_checkpoint(CheckpointManager(run_dir / "checkpoints").latest())


def test_learns_a_two_class_dataset(tmp_path):
    shards = tmp_path / "shards"
    make_shard_set(shards, samples=[32] * 4, scaling_factor=1.0)  # class means +-ramp, std 0.1
    ck = _run(shards, tmp_path / "run", hidden_size=64, num_heads=4, max_steps=300, global_batch_size=16,
              lr=3e-3, ema_decay=0.95, log_every=10, ckpt_every=1000, shuffle_buffer=64, seed=1)
    losses = [r["loss"] for r in read_metrics(tmp_path / "run")]
    assert len(losses) == 30 and sum(losses[-5:]) / 5 < 0.2 * losses[0]
    model = dit.model_from_config(ck["model_config"])
    model.load_state_dict(ck["ema"])
    model.eval()
    means = torch.stack([torch.from_numpy(class_mean(c, (4, 8, 8))) for c in (0, 1)])  # scaling 1.0
    diffusion = dit.create_diffusion("50")
    for label in (0, 1):
        y = torch.tensor([label] * 16 + [2] * 16)  # [cond; null] halves for classifier-free guidance
        with torch.no_grad():
            x = diffusion.p_sample_loop(model.forward_with_cfg, (32, 4, 8, 8),
                                        model_kwargs={"y": y, "cfg_scale": 3.0, "guide_channels": "all"},
                                        generator=torch.Generator().manual_seed(label))[:16]
        own = ((x - means[label]) ** 2).mean(dim=(1, 2, 3)).sqrt()
        other = ((x - means[1 - label]) ** 2).mean(dim=(1, 2, 3)).sqrt()
        assert own.mean() < 0.6 * other.mean(), (label, own.mean(), other.mean())
        assert (own < other).float().mean() >= 0.75


def test_gradient_accumulation_matches_one_big_batch(shard_dir, tmp_path):
    a = _run(shard_dir, tmp_path / "a", max_steps=3, global_batch_size=8, micro_batch_size=4)
    b = _run(shard_dir, tmp_path / "b", max_steps=3, global_batch_size=8, micro_batch_size=8)
    ra, rb = read_metrics(tmp_path / "a"), read_metrics(tmp_path / "b")
    assert a["data"]["accum"] == 2 and b["data"]["accum"] == 1
    for x, y in zip(ra, rb):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-5) and x["grad_norm"] == pytest.approx(y["grad_norm"], rel=1e-4)
    for k in a["model"]:
        torch.testing.assert_close(a["model"][k], b["model"][k], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(a["ema"][k], b["ema"][k], rtol=1e-5, atol=1e-6)


def test_grad_checkpointing_changes_nothing(shard_dir, tmp_path):
    a = _run(shard_dir, tmp_path / "a", max_steps=2, global_batch_size=8)
    b = _run(shard_dir, tmp_path / "b", max_steps=2, global_batch_size=8, grad_checkpointing=True)
    assert [r["loss"] for r in read_metrics(tmp_path / "a")] == [r["loss"] for r in read_metrics(tmp_path / "b")]
    for k in a["model"]:
        torch.testing.assert_close(a["model"][k], b["model"][k], rtol=0, atol=1e-7)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_autocast_precisions(shard_dir, tmp_path, precision):
    ck = _run(shard_dir, tmp_path / "run", max_steps=2, global_batch_size=8, precision=precision)
    assert ck["config"]["precision"] == precision
    assert (ck["scaler"] is not None) == (precision == "fp16")
    if precision == "fp16":
        assert ck["scaler"]["scale"] > 0
    assert all(torch.isfinite(v).all() for v in ck["model"].values())
    assert all(v.dtype == torch.float32 for v in ck["ema"].values())  # fp32 master weights and EMA


def test_injected_nan_stops_before_the_update(shard_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("DIT_FAULT", "train.nan@3")
    monkeypatch.setattr(faults, "_counts", faults.Counter())
    run_dir = tmp_path / "run"
    with pytest.raises(TrainingDiverged) as e:
        run(merge_config({}, {"shards": str(shard_dir), "run_dir": str(run_dir), **TINY, "max_steps": 6,
                              "global_batch_size": 8, "ckpt_every": 2}))
    assert "step 3: non-finite loss or gradient on rank(s) [0]" in str(e.value)
    assert "The last checkpoint (step-0000002.pt) is intact" in str(e.value)
    ckpts = CheckpointManager(run_dir / "checkpoints")
    assert ckpts.steps() == [2]
    assert all(torch.isfinite(v).all() for v in load_checkpoint(ckpts.latest())["model"].values())
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2]
