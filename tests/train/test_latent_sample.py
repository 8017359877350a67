"""`--latent-sample mean` (train/latents.py): the model trains on the stored posterior's mean, NanoGen's encoding
(End2End-Diffusion/diffusion-bench src/stage1/vae.py l.119 `sample_mode="mode"`, l.217-221 `posterior.mode()`),
through the one latent path (the loader's batches), where `sample` (the default) draws mean + std x noise as always;
a set that stores one draw instead of the posterior is refused, a set without a posterior is its latent either way.
"""
from __future__ import annotations

import itertools

import pytest
import torch

from dit_pipeline.shards import iter_shard
from dit_pipeline.train.data import EpochStream, make_loader
from dit_pipeline.train.shard_source import open_shards
from dit_pipeline.train.latents import LatentSpec, latent_sample_problem, make_latent, make_latents, sample_seed
from dit_pipeline.train.partition import plan_epoch
from tests.train.conftest import invoke_train, tiny_args
from tests.train.helpers import VAE_IDENTITY, make_shard_set

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create")


@pytest.mark.parametrize("dtype, shift", [("float32", None), ("bfloat16", 0.25)])
def test_the_mean_is_the_stored_posterior_mean_normalized_in_every_epoch(tmp_path, dtype, shift):
    m = make_shard_set(tmp_path / "s", samples=[6], views=2, dtype=dtype, shift_factor=shift, scaling_factor=0.7,
                       std=0.3)
    mean, draw = LatentSpec.from_manifest(m, "mean"), LatentSpec.from_manifest(m)
    assert (mean.arrays, draw.arrays, mean.draws, draw.draws) == (1, 2, False, True)
    samples = list(iter_shard(str(tmp_path / "s" / "shard-000000.tar"), m))
    for s in samples:
        view = (sample_seed(3, 2, s.key) >> 32) % 2  # the view is still drawn per sample and epoch
        want = (torch.from_numpy(s.mean[view]) - (shift or 0.0)) * 0.7
        got = make_latent(s, mean, seed=3, epoch=2)
        assert torch.equal(got, m.norm.apply(torch.from_numpy(s.mean[view])[None])[0])
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        drawn = make_latent(s, draw, seed=3, epoch=2)  # the default: mean + std x noise, std 0.3 here
        assert (drawn - got).abs().max() > 0.1
    again = make_latents(samples, mean, seed=3, epoch=2)
    assert all(torch.equal(again[i], make_latent(s, mean, seed=3, epoch=2)) for i, s in enumerate(samples))


def test_the_loader_gives_the_mean_with_the_setting(tmp_path):
    """The trainer's stream (EpochStream, as train/loop.py builds it): each batch row is its sample's mean."""
    m = make_shard_set(tmp_path / "s", samples=[8], std=0.5)
    src = open_shards(str(tmp_path / "s"))
    plan = plan_epoch(src.sizes, seed=0, epoch=0, world_size=1, workers=1, micro_batch=4, accum=1)
    by_key = {s.key: s for s in iter_shard(src.urls[0], m)}
    for setting in ("mean", "sample"):
        stream = EpochStream(src, plan, 0, seed=0, buffer=4, latent_sample=setting)
        batches = list(itertools.islice(make_loader(stream, num_workers=0, prefetch_factor=2, pin_memory=False), 2))
        rows = [(b.latents[i], b.keys[i]) for b in batches for i in range(len(b.keys))]
        assert len(rows) == 8
        for latent, key in rows:
            mean = m.norm.apply(torch.from_numpy(by_key[f"{int(key):09d}"].mean[0])[None])[0]
            assert torch.equal(latent, mean) == (setting == "mean")


def test_mean_on_a_set_of_one_stored_draw_is_refused(tmp_path, shard_dir):
    one_draw = make_shard_set(tmp_path / "draw", samples=[8], store="sample")  # a VAE with a posterior
    problem = latent_sample_problem(one_draw, "mean")
    assert problem is not None and "stores one draw of the posterior (store sample)" in problem
    assert latent_sample_problem(one_draw, "sample") is None
    deterministic = make_shard_set(tmp_path / "det", samples=[8], store="sample")
    deterministic.extraction["vae"] = {**VAE_IDENTITY, "encoder_output": "latent"}  # AutoencoderDC's latent
    assert latent_sample_problem(deterministic, "mean") is None
    features = make_shard_set(tmp_path / "feat", samples=[8], store="sample")
    features.extraction.update(vae=None, encoder={"kind": "features", "model": "vit_base_patch14_reg4_dinov2"})
    assert latent_sample_problem(features, "mean") is None
    r = invoke_train(tiny_args(tmp_path / "draw", tmp_path / "run", **{"latent-sample": "mean", "dry-run": None}))
    assert r.exit_code != 0 and "--latent-sample mean trains on the VAE posterior's mean" in r.output, r.output
    assert not (tmp_path / "run" / "config.json").exists()
    plan = invoke_train(tiny_args(shard_dir, tmp_path / "ok", **{"latent-sample": "mean", "dry-run": None}))
    assert plan.exit_code == 0 and "store posterior (trained on its mean: --latent-sample mean)" in plan.output


def test_a_mode_set_gives_the_posterior_sets_mean(tmp_path, tiny_vae_dir):
    """`dit-extract --store mode` (the NanoGen recipes' extraction) stores the posterior's mean alone: with
    --latent-sample mean the trainer's batches are those of a --store posterior set of the same images, value for
    value, and the plan says what it trains on."""
    from dit_pipeline.extract import ExtractConfig, run_extract
    from tests._util import make_image_tree

    tree = make_image_tree(tmp_path / "images", counts=(4, 4))
    base = dict(data_path=str(tree), vae=str(tiny_vae_dir), image_size=32, flip=False, batch_size=4,
                samples_per_shard=4, num_workers=0, quiet=True)
    rows = {}
    for store in ("posterior", "mode"):
        run_extract(ExtractConfig(out=str(tmp_path / store), store=store, **base))
        src = open_shards(str(tmp_path / store))
        assert latent_sample_problem(src.manifest, "mean") is None
        plan = plan_epoch(src.sizes, seed=0, epoch=0, world_size=1, workers=1, micro_batch=4, accum=1)
        stream = EpochStream(src, plan, 0, seed=0, buffer=4, latent_sample="mean")
        batches = list(make_loader(stream, num_workers=0, prefetch_factor=2, pin_memory=False))
        rows[store] = {int(b.keys[i]): b.latents[i] for b in batches for i in range(len(b.keys))}
    assert sorted(rows["mode"]) == sorted(rows["posterior"]) == list(range(8))
    assert all(torch.equal(rows["mode"][k], rows["posterior"][k]) for k in rows["mode"])
    out = invoke_train(tiny_args(tmp_path / "mode", tmp_path / "run", **{"latent-sample": "mean", "dry-run": None,
                                                                        "global-batch-size": 4, "num-workers": 1}))
    assert out.exit_code == 0 and "store mode (the VAE posterior's mean)" in out.output, out.output
