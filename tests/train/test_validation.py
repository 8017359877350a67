"""The validation loss at fixed timesteps (train/validation.py): each objective maps MLPerf's noise levels to its own
time, the same whatever its training time sampler; the loss follows MLPerf's rule (sample i at level i mod K, the
mean of each level, then the mean of the levels) and is the same on a rerun; it falls on the demo data
(examples/demo.py's pictures, the demo's VAE); and its settings are refused where they would do nothing."""
from __future__ import annotations

import importlib.util

import pytest
import torch

from dit_pipeline.common.errors import ConfigError, UserError
from dit_pipeline.dit.conditioning import ClassLabels
from dit_pipeline.dit.objectives import build_objective
from dit_pipeline.train import merge_config
from dit_pipeline.train.command import main as train_main
from dit_pipeline.train.metrics import read_metrics
from dit_pipeline.train.validation import ValSet, noise_levels, val_losses
from tests._util import REPO
from tests.train.helpers import make_shard_set

LEVELS = torch.tensor(noise_levels(8), dtype=torch.float64)


def test_each_objective_maps_the_levels_to_its_own_time_whatever_its_sampler():
    assert noise_levels(8) == [0, 0.125, 0.25, 0.375, 0.5, 0.625, 0.75, 0.875]  # MLPerf's [0, 7/8]
    assert build_objective("ddpm", {}).val_times(LEVELS, "cpu").tolist() == [0, 125, 250, 375, 500, 625, 750, 875]
    flows = [build_objective("flow", s) for s in ({}, {"t_sampling": "logit-normal", "t_mean": -0.5},
                                                  {"time_shift": 3.0})]
    times = [f.val_times(LEVELS, "cpu") for f in flows]
    assert times[0].tolist() == [1.0 - k / 8 for k in range(8)]  # SiT's time: data at t = 1
    assert all(torch.equal(t, times[0]) for t in times)       # the sampler and the shift do not move them
    mf = build_objective("meanflow", {}).val_times(LEVELS, "cpu")
    assert mf.shape == (8, 2) and torch.equal(mf[:, 0], mf[:, 1]) and mf[:, 0].tolist() == noise_levels(8)
    imf = build_objective("imf-adaln", {}).val_times(LEVELS, "cpu")
    assert imf.shape == (8, 5) and imf[:, 2:].tolist() == [[1.0, 0.0, 1.0]] * 8  # unguided


def _model(seed=0):
    from dit_pipeline import dit

    torch.manual_seed(seed)
    m = dit.create_model("DiT-S/2", input_size=8, num_classes=3, in_channels=4, depth=1, hidden_size=32, num_heads=2,
                         learn_sigma=False)
    for p in m.parameters():  # not DiT's zero init: a model whose loss depends on the input
        torch.nn.init.normal_(p, std=0.05)
    return m


def test_the_loss_follows_mlperfs_rule_and_is_the_same_on_a_rerun():
    n, k = 10, 4
    g = torch.Generator().manual_seed(0)
    val = ValSet("test", torch.randn(n, 4, 8, 8, generator=g), torch.arange(n) % 3, torch.randn(n, 4, 8, 8, generator=g),
                 {"test": n})
    model, flow, cond = _model(), build_objective("flow", {}), ClassLabels(3, 0.1)
    model.train()  # val_losses evaluates in eval mode (no label dropout) and restores the mode
    per = val_losses(model, flow, cond, val, k=k, batch=3, device=torch.device("cpu"))
    assert model.training and per == val_losses(model, flow, cond, val, k=k, batch=3, device=torch.device("cpu"))
    # the rule, sample by sample: sample i at level i mod K (counts 3, 3, 2, 2), the mean of each level
    levels = torch.tensor(noise_levels(k), dtype=torch.float64)
    model.eval()
    with torch.no_grad():
        one = [float(flow.val_loss(lambda x, t, **kw: model(x, t, **kw), val.latents[i:i + 1],
                                   flow.val_times(levels[i % k:i % k + 1], "cpu"), {"y": val.labels[i:i + 1]},
                                   val.noise[i:i + 1])) for i in range(n)]
    expect = [sum(one[i] for i in range(n) if i % k == j) / len(range(j, n, k)) for j in range(k)]
    assert per == pytest.approx(expect, rel=1e-5)
    assert sum(per) / k != pytest.approx(sum(one) / n, rel=1e-4)  # the mean of the level means, not of the samples


def test_validation_settings_refused_where_they_do_nothing(tmp_path):
    make_shard_set(tmp_path / "a", samples=(8, 8))
    make_shard_set(tmp_path / "wide", samples=(8, 8), latent_shape=(4, 16, 16))
    base = {"run_dir": str(tmp_path / "run"), "shards": str(tmp_path / "a"), "max_steps": 1, "global_batch_size": 8}
    with pytest.raises(ConfigError, match="--val-every set the validation loss: add --val-shards"):
        merge_config({}, {**base, "val_every": 5}).validate()
    with pytest.raises(ConfigError, match="--val-shards holdout evaluates the keys a mix's sources hold out"):
        merge_config({}, {**base, "val_shards": "holdout"}).validate()
    with pytest.raises(ConfigError, match="--val-samples 4 leaves noise levels without a sample"):
        merge_config({}, {**base, "val_shards": str(tmp_path / "a"), "val_samples": 4}).validate()
    with pytest.raises(UserError, match="--val-shards: sources a .* and wide .* are not one latent space: their "
                                        "latent_shape differs"):
        train_main(merge_config({}, {**base, "val_shards": str(tmp_path / "wide"), "dry_run": True, "quiet": True,
                                     "model": "DiT-S/2"}))


@pytest.mark.skipif(importlib.util.find_spec("diffusers") is None, reason="the demo's VAE needs diffusers")
def test_the_validation_loss_falls_on_the_demo_data(tmp_path):
    """examples/demo.py's pictures (4 classes) through the demo's VAE, a tenth of the keys held out: after 60 steps
    the raw weights' validation loss is below the initial one at every run of this test (the same numbers each
    time), and no held-out key was trained on."""
    import sys

    from dit_pipeline.extract import ExtractConfig, run_extract
    from dit_pipeline.train.mixdraws import held_out

    sys.path.insert(0, str(REPO / "examples"))
    try:
        import demo
    finally:
        sys.path.pop(0)
    demo.make_images(tmp_path / "images", per_class=12, size=32)
    demo.make_vae(tmp_path / "vae")
    run_extract(ExtractConfig(data_path=str(tmp_path / "images"), out=str(tmp_path / "shards"), vae=str(tmp_path / "vae"),
                              image_size=32, samples_per_shard=12, batch_size=16, num_workers=0, quiet=True))
    cfg = merge_config({}, {"source": [f"{tmp_path}/shards holdout=0.25"], "run_dir": str(tmp_path / "run"),
                            "model": "DiT-S/2", "depth": 2, "hidden_size": 64, "num_heads": 4, "lr": 1e-3,
                            "global_batch_size": 8, "num_workers": 0, "max_steps": 60, "log_every": 20,
                            "ckpt_every": 60, "val_shards": "holdout", "val_every": 30, "val_samples": 8,
                            "record_keys": True, "quiet": True})
    assert train_main(cfg) == 0
    vals = [r for r in read_metrics(tmp_path / "run") if "val_loss_raw" in r]
    assert [r["step"] for r in vals] == [0, 30, 60]
    assert vals[-1]["val_loss_raw"] < 0.9 * vals[0]["val_loss_raw"]
    trained = {k for r in read_metrics(tmp_path / "run" / "logs" / "keys-rank0.jsonl") for _, k in r["keys"]}
    assert trained and not any(held_out(k, 0.25) for k in trained)


def test_a_held_out_shard_set_beside_one_shard_set(tmp_path):
    """--val-shards FOLDER works for a --shards run too (no mix): its first samples in key order, every 2 steps."""
    make_shard_set(tmp_path / "a", samples=(16, 16))
    make_shard_set(tmp_path / "val", samples=(8,), seed=5)
    cfg = merge_config({}, {"shards": str(tmp_path / "a"), "run_dir": str(tmp_path / "run"), "model": "DiT-S/2",
                            "depth": 1, "hidden_size": 32, "num_heads": 2, "global_batch_size": 8, "num_workers": 0,
                            "max_steps": 4, "val_shards": str(tmp_path / "val"), "val_every": 2, "val_samples": 8,
                            "val_weights": "raw", "quiet": True})
    assert train_main(cfg) == 0
    vals = [r for r in read_metrics(tmp_path / "run") if "val_run" in r]
    assert [r["step"] for r in vals] == [0, 2, 4] and "val_loss_ema" not in vals[0]
    assert vals[0]["val_run"]["set"] == str(tmp_path / "val") and vals[0]["val_run"]["sources"] == {"val": 8}
