"""NanoGen's text-to-image MeanFlow recipe (recipes/nanogen/mf-t2i-...-kappa0.5.yaml: --objective meanflow
--mf-rule nanogen --v-target clamped on text features, --latent-sample mean) end to end on a tiny captioned set at
256 px (SD-VAE's 4x32x32 latents from a tiny random VAE, a tiny random Qwen3's text set): it trains with its
settings recorded (a resume with another rule is refused), and dit-sample draws from prompts with its protocol row
nanogen/mf-t2i-..., which a class row refuses."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from dit_pipeline.common.errors import UserError
from dit_pipeline.common.seeding import STREAM_STEP, generator
from dit_pipeline.sample import SampleConfig
from dit_pipeline.sample.run import run_sampling
from dit_pipeline.train import merge_config, run
from dit_pipeline.train.checkpoint import CheckpointManager, load_checkpoint
from dit_pipeline.train.config_file import load_config_file
from dit_pipeline.train.metrics import read_metrics
from tests._util import REPO, make_image_tree
from tests.captions._tiny import make_tiny_qwen3

NAME = "mf-t2i-ddt-en28d1152hd72-dn2d2048hd128-sdvae-mse-vpred-t4-kappa0.5"
ROW = f"nanogen/{NAME}"
TINY = {"depth": 1, "hidden_size": 32, "num_heads": 2, "head_depth": 1, "head_hidden_size": 32, "head_num_heads": 2}


@pytest.fixture(scope="module")
def captioned(tmp_path_factory, tiny_vae_dir):
    """(latent set of 4 images at 256 px, posterior stored, no flips; its text set of a tiny Qwen3 at 16 tokens)."""
    from dit_pipeline.extract import ExtractConfig, run_extract
    from dit_pipeline.extract.text import run_text_extract

    root = tmp_path_factory.mktemp("nanogen-mf")
    tree = make_image_tree(root / "images", counts=(2, 2))
    paths = sorted(p.relative_to(tree).as_posix() for p in tree.rglob("*.JPEG"))
    (root / "captions.jsonl").write_text("".join(json.dumps({"path": p, "caption": f"a red cat number {i}"}) + "\n"
                                                 for i, p in enumerate(paths)))
    run_extract(ExtractConfig(data_path=str(tree), out=str(root / "latents"), vae=str(tiny_vae_dir), flip=False,
                              captions=str(root / "captions.jsonl"), caption_keys="caption", image_size=256,
                              batch_size=4, samples_per_shard=2, num_workers=0, quiet=True))
    run_text_extract(ExtractConfig(data_path=str(root / "latents"), out=str(root / "text"), quiet=True,
                                   text_encoder=str(make_tiny_qwen3(root / "qwen3")), text_max_length=16,
                                   batch_size=8))
    return root / "latents", root / "text"


def _config(latents, text, run_dir, **more):
    """The recipe file with a tiny network, 3 steps of 4 samples (2 x 2) and the bookkeeping of a test."""
    return merge_config(load_config_file(REPO / "recipes" / "nanogen" / f"{NAME}.yaml"), {
        "shards": str(latents), "text": str(text), "run_dir": str(run_dir), **TINY, "max_steps": 3,
        "global_batch_size": 4, "micro_batch_size": 2, "ckpt_every": 3, "num_workers": 0, "log_every": 1,
        "quiet": True, "allow_departures": True, **more})


def test_the_mf_t2i_recipe_trains_and_samples_with_its_protocol_row(captioned, tiny_vae_dir, tmp_path):
    latents, text = captioned
    cfg = _config(latents, text, tmp_path / "run")
    assert (cfg.objective, cfg.mf_rule, cfg.v_target, cfg.latent_sample) == ("meanflow", "nanogen", "clamped", "mean")
    assert run(cfg) == "done"
    ckpt = load_checkpoint(CheckpointManager(tmp_path / "run" / "checkpoints").latest())
    assert ckpt["objective"] == "meanflow"
    assert {k: ckpt["meanflow"][k] for k in ("mf_rule", "v_target", "t_eps", "mf_kappa", "mf_data_proportion")} == \
        {"mf_rule": "nanogen", "v_target": "clamped", "t_eps": 0.05, "mf_kappa": 0.5, "mf_data_proportion": 0.75}
    mc = ckpt["model_config"]
    assert (mc["conditioning"], mc["conditions"], mc["num_t_tokens"]) == ("text", "meanflow", 4)
    assert ckpt["config"]["latent_sample"] == "mean" and ckpt["text"]["null_text"].shape[1] == 32
    departs = " ".join(ckpt["config"]["recipe"]["departures"])
    assert "--max-steps 100000 -> 3" in departs and "latent-sample" not in departs and "mf-rule" not in departs
    losses = [r["loss"] for r in read_metrics(tmp_path / "run")]
    assert len(losses) == 3 and all(math.isfinite(x) and 0 < x < 1.01 for x in losses)  # adaptive weight <= 1
    coins = [float(torch.rand(1, generator=generator(cfg.seed, STREAM_STEP, s))) for s in range(3)]
    assert min(coins) < 0.75 <= max(coins)  # the trainer's coins: a flow-matching and a MeanFlow (JVP) step ran
    plan = (tmp_path / "run" / "log.txt").read_text()
    assert "store posterior (trained on its mean: --latent-sample mean)" in plan
    assert "(--mf-rule nanogen: NanoGen's TransportMF, labels dropped per sample)" in plan

    with pytest.raises(UserError, match=r"other MeanFlow settings \(--mf-rule nanogen there, meanflow here\)"):
        run(_config(latents, text, tmp_path / "run", max_steps=4, mf_rule="meanflow"))

    npz = tmp_path / "s.npz"
    base = dict(ckpt=str(tmp_path / "run"), vae=str(tiny_vae_dir), prompts=["a red cat", "a red cat number 3"],
                num_samples=2, quiet=True)
    run_sampling(SampleConfig(**base, protocol=ROW, npz=str(npz)))
    images = np.load(npz)["arr_0"]
    assert images.shape == (2, 256, 256, 3) and images.dtype == np.uint8 and images.std() > 0
    with pytest.raises(Exception, match="conditioning text"):  # ImageNet's row: class labels
        run_sampling(SampleConfig(**base, protocol=ROW.replace("mf-t2i-", "mf-").replace("-t4-", "-t4c8-"),
                                  npz=str(tmp_path / "x.npz")))
    assert not (tmp_path / "x.npz").exists()


def test_a_meanflow_checkpoint_from_before_the_rule_resumes_only_under_the_release_rule():
    """A record without mf_rule / v_target (every MeanFlow checkpoint written before them) trained with the release's
    rule and the plain target: it resumes so, and a run asking for NanoGen's is refused naming both sides."""
    from dit_pipeline.train.config import TrainConfig
    from dit_pipeline.train.setting_parts import ObjectivePart

    cfg = TrainConfig(shards="s", run_dir="r", objective="meanflow").to_dict()
    release = ObjectivePart("meanflow", cfg)
    recorded = release.state_dict()["meanflow"]
    assert (recorded["mf_rule"], recorded["v_target"], "t_eps" in recorded) == ("meanflow", "plain", False)
    old = {"objective": "meanflow", "meanflow": {k: v for k, v in recorded.items() if k not in ("mf_rule", "v_target")}}
    release.check(old, "old.pt")
    with pytest.raises(UserError, match=r"\(--mf-rule meanflow there, nanogen here\)"):
        ObjectivePart("meanflow", {**cfg, "mf_rule": "nanogen"}).check(old, "old.pt")
    with pytest.raises(UserError, match=r"--t-eps None there, 0.05 here; --v-target plain there, clamped here"):
        ObjectivePart("meanflow", {**cfg, "v_target": "clamped"}).check(old, "old.pt")


def test_the_rule_is_refused_where_it_means_nothing():
    from dit_pipeline.common.errors import ConfigError

    base = {"shards": "s", "run_dir": "r"}
    with pytest.raises(ConfigError, match="--mf-rule act on the MeanFlow objectives: add --objective meanflow"):
        merge_config({}, {**base, "mf_rule": "nanogen"}).validate()
    with pytest.raises(ConfigError, match="--mf-rule nanogen acts on --objective meanflow; imf splits its steps"):
        merge_config({}, {**base, "model": "iMF-B/2", "mf_rule": "nanogen"}).validate()
    with pytest.raises(ConfigError, match="--mf-rule must be one of meanflow, nanogen, got 'jax'"):
        merge_config({}, {**base, "objective": "meanflow", "mf_rule": "jax"}).validate()
    merge_config({}, {**base, "objective": "meanflow", "mf_rule": "nanogen", "v_target": "clamped"}).validate()
