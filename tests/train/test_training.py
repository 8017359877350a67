"""Training behaviour in-process (one rank, CPU): it learns (loss drops, class-conditional samples land
nearest their own class), gradient accumulation equals one big batch, activation checkpointing changes
nothing, bf16/fp16 autocast run (fp16 with a checkpointed GradScaler), and an injected NaN stops the run
before the optimizer update."""
from __future__ import annotations

import pytest
import torch

from dit_pipeline import dit
from dit_pipeline.common import faults
from tests.train.helpers import class_mean, make_shard_set
from dit_pipeline.train import merge_config, run
from dit_pipeline.train.checkpoint import CheckpointManager, load_checkpoint
from dit_pipeline.train.loop import TrainingDiverged
from dit_pipeline.train.metrics import read_metrics
from tests._util import FP32_EPS, assert_close_at_scale
from tests.train.conftest import TINY_CONFIG, run_tiny




def test_learns_a_two_class_dataset(tmp_path):
    shards = tmp_path / "shards"
    make_shard_set(shards, samples=[32] * 4, scaling_factor=1.0, pattern="constant")  # classes at +1 / -1
    ck = run_tiny(shards, tmp_path / "run", hidden_size=64, num_heads=4, max_steps=300, global_batch_size=16,
              lr=3e-3, ema_decay=0.95, log_every=10, ckpt_every=1000, shuffle_buffer=64)
    losses = [r["loss"] for r in read_metrics(tmp_path / "run")]
    assert len(losses) == 30 and sum(losses[-5:]) / 5 < 0.2 * losses[0]
    model = dit.model_from_config(ck["model_config"])
    model.load_state_dict(ck["ema"])
    model.eval()
    means = torch.stack([torch.from_numpy(class_mean(c, (4, 8, 8), "constant")) for c in (0, 1)])
    diffusion = dit.create_diffusion("50")
    for scale in (1.0, 3.0):  # without and with classifier-free guidance
        for label in (0, 1):
            y = torch.tensor([label] * 16 + [2] * 16)  # [cond; null] halves
            with torch.no_grad():
                x = diffusion.p_sample_loop(model.forward_with_cfg, (32, 4, 8, 8),
                                            model_kwargs={"y": y, "cfg_scale": scale, "guide_channels": "all"},
                                            generator=torch.Generator().manual_seed(label))[:16]
            own = ((x - means[label]) ** 2).mean(dim=(1, 2, 3)).sqrt()
            other = ((x - means[1 - label]) ** 2).mean(dim=(1, 2, 3)).sqrt()
            assert own.mean() < other.mean(), (scale, label, own.mean(), other.mean())
            if scale > 1:
                assert own.mean() < 0.6 * other.mean() and (own < other).float().mean() >= 0.75


def test_gradient_accumulation_matches_one_big_batch(shard_dir, tmp_path):
    a = run_tiny(shard_dir, tmp_path / "a", max_steps=3, global_batch_size=8, micro_batch_size=4)
    b = run_tiny(shard_dir, tmp_path / "b", max_steps=3, global_batch_size=8, micro_batch_size=8)
    ra, rb = read_metrics(tmp_path / "a"), read_metrics(tmp_path / "b")
    assert a["data"]["accum"] == 2 and b["data"]["accum"] == 1
    for x, y in zip(ra, rb):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-5) and x["grad_norm"] == pytest.approx(y["grad_norm"], rel=1e-4)
    for k in a["model"]:
        torch.testing.assert_close(a["model"][k], b["model"][k], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(a["ema"][k], b["ema"][k], rtol=1e-5, atol=1e-6)


def test_grad_checkpointing_changes_nothing(shard_dir, tmp_path):
    a = run_tiny(shard_dir, tmp_path / "a", max_steps=2, global_batch_size=8)
    b = run_tiny(shard_dir, tmp_path / "b", max_steps=2, global_batch_size=8, grad_checkpointing=True)
    assert [r["loss"] for r in read_metrics(tmp_path / "a")] == [r["loss"] for r in read_metrics(tmp_path / "b")]
    for k in a["model"]:
        assert_close_at_scale(a["model"][k], b["model"][k], rel=FP32_EPS, what=k)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_autocast_precisions(shard_dir, tmp_path, precision):
    ck = run_tiny(shard_dir, tmp_path / "run", max_steps=2, global_batch_size=8, precision=precision)
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
        run(merge_config({}, {"shards": str(shard_dir), "run_dir": str(run_dir), **TINY_CONFIG, "max_steps": 6,
                              "global_batch_size": 8, "ckpt_every": 2}))
    assert "step 3: non-finite loss or gradient on rank(s) [0]" in str(e.value)
    assert "The last checkpoint (step-0000002.pt) is intact" in str(e.value)
    ckpts = CheckpointManager(run_dir / "checkpoints")
    assert ckpts.steps() == [2]
    assert all(torch.isfinite(v).all() for v in load_checkpoint(ckpts.latest())["model"].values())
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2]


def test_unreadable_shard_mid_run_fails_fast_or_is_skipped_and_counted(shard_dir, tmp_path):
    import shutil

    from dit_pipeline.common.errors import UserError

    shards = tmp_path / "shards"
    shutil.copytree(shard_dir, shards)
    path = shards / "shard-000002.tar"
    data = bytearray(path.read_bytes())
    at = data.find(b"000000036.mean.npy")
    data[at:at + 6] = b"\xff" * 6  # same size: passes the start-up check, fails when read
    path.write_bytes(bytes(data))
    with pytest.raises(UserError) as e:
        run_tiny(shards, tmp_path / "a", max_steps=6, global_batch_size=8)
    assert "shard-000002.tar" in str(e.value) and "--skip-bad-shards" in str(e.value)
    run_tiny(shards, tmp_path / "b", max_steps=6, global_batch_size=8, skip_bad_shards=True)
    recs = read_metrics(tmp_path / "b")
    assert recs[-1]["step"] == 6 and recs[-1]["bad_shards"] >= 1
    log = (tmp_path / "b" / "log.txt").read_text()
    assert log.count("skipping shard-000002.tar from now on (--skip-bad-shards; 1 distinct shard(s) skipped)") == 1


def test_warmup_clipping_and_periodic_hooks(shard_dir, tmp_path):
    calls = []

    class Probe:
        every = 2

        def __call__(self, ctx):
            calls.append((ctx.step, ctx.rank, ctx.ema is not None, ctx.model.training, ctx.latent["scaling_factor"]))

    cfg = merge_config({}, {"shards": str(shard_dir), "run_dir": str(tmp_path / "run"), **TINY_CONFIG, "max_steps": 4,
                            "global_batch_size": 8, "warmup_steps": 4, "grad_clip": 1e-3})
    assert run(cfg, hooks=[Probe()]) == "done"
    recs = read_metrics(tmp_path / "run")
    assert [r["lr"] for r in recs] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3])  # linear warm-up of 1e-3
    assert all(r["grad_norm"] > 1e-3 for r in recs)  # the logged norm is the one before clipping
    assert calls == [(2, 0, True, True, 0.5), (4, 0, True, True, 0.5)]


def test_fp16_overflow_is_skipped_by_the_scaler_and_counted(shard_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("DIT_FAULT", "train.nan@2")
    monkeypatch.setattr(faults, "_counts", faults.Counter())
    ck = run_tiny(shard_dir, tmp_path / "run", max_steps=3, global_batch_size=8, precision="fp16")
    recs = read_metrics(tmp_path / "run")
    assert [r["fp16_skipped"] for r in recs] == [0, 1, 1]
    assert ck["scaler"]["scale"] == 2.0 ** 15  # halved once from the initial 2**16
    assert ck["data"]["overflow_steps"] == 1
    assert all(torch.isfinite(v).all() for v in ck["model"].values())
