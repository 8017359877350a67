"""NanoGen's in-context DiT-DH (t4c8: 4 time tokens, 8 class tokens) trained by dit-train on today's class-label
shards: 2 ranks (gloo), a run killed with SIGKILL and resumed is bit-identical to a straight run (losses, weights,
EMA, optimizer), its periodic grid is drawn, and dit-sample samples its checkpoint with classifier-free guidance
against NanoGen's null label (num_classes), as the guidance formula computes it with two separate passes."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from dit_pipeline.sample import SampleConfig
from dit_pipeline.sample.generate import FlowLoop, generate_images
from dit_pipeline.sample.load import load_model
from dit_pipeline.sample.run import run_sampling
from dit_pipeline.common.vae import load_vae
from tests._util import straight_killed_resumed
from tests.train.conftest import tiny_args

STEPS = 4
KEYS = ("step", "epoch", "loss", "mse", "grad_norm")
T4C8 = {"model": "ddt-en28d1152hd72-dn2d2048hd128", "depth": 1, "hidden-size": 32, "num-heads": 2, "head-depth": 1,
        "head-hidden-size": 32, "head-num-heads": 2, "num-t-tokens": 4, "num-c-tokens": 8}


def _args(shards, run_dir, vae):
    return tiny_args(shards, run_dir, **{**T4C8, "max-steps": STEPS, "ckpt-every": 2, "num-workers": 0,
                                         "grad-clip": 1.0, "sample-every": STEPS, "sample-classes": "0,1",
                                         "sample-steps": 2, "vae": vae})


@pytest.mark.determinism
def test_t4c8_trains_resumes_bit_identically_and_samples_with_nanogens_null_label(shard_dir, tiny_vae_dir, tmp_path):
    straight, a, b = straight_killed_resumed(lambda run: _args(shard_dir, run, tiny_vae_dir), tmp_path, STEPS, KEYS,
                                             timeout=900)
    for key in ("model", "ema"):
        assert a[key].keys() == b[key].keys() and all(torch.equal(a[key][n], b[key][n]) for n in a[key]), key
    for i, st in a["opt"]["state"].items():
        assert all(torch.equal(v, b["opt"]["state"][i][k]) for k, v in st.items())
    mc = a["model_config"]
    assert (mc["family"], mc["num_t_tokens"], mc["num_c_tokens"], a["objective"]) == ("DiT-DH-IC", 4, 8, "flow")
    assert a["ema"]["ctx_embedder.learnable_tokens"].shape == (8, 32) and "text" not in a
    assert a["ema"]["ctx_embedder.embedding_table.weight"].shape[0] == mc["num_classes"] + 1  # the null row
    assert (straight / "samples" / f"step-{STEPS:07d}.png").is_file()
    assert "condition   " in (straight / "log.txt").read_text()

    # 4 steps leave the zero-initialised adaLN and output layers near zero, so the class barely reaches the output:
    # the sampled checkpoint is the trained one with its EMA weights perturbed (its format and record unchanged)
    ckpt = tmp_path / "perturbed.pt"
    raw = torch.load(straight / "checkpoints" / f"step-{STEPS:07d}.pt", weights_only=True)
    g = torch.Generator().manual_seed(0)
    raw["ema"] = {k: v if "rope" in k else v + 0.3 * torch.randn(v.shape, generator=g) for k, v in raw["ema"].items()}
    torch.save(raw, ckpt)
    npz = tmp_path / "cfg.npz"
    run_sampling(SampleConfig(ckpt=str(ckpt), vae=str(tiny_vae_dir), class_labels=[0, 1, 1], cfg_scale=3.0,
                              cfg_channels="all", sampler="euler", steps=3, npz=str(npz), quiet=True))
    got = np.load(npz)["arr_0"]

    loaded = load_model(ckpt)
    model, null = loaded.model, int(mc["num_classes"])

    def formula(x, t, y):  # NanoGen's guidance (src/utils/guidance_utils.py forward_with_cfg): two passes
        cond, uncond = model(x, t, y), model(x, t, torch.full_like(y, null))
        return (uncond + 3.0 * (cond - uncond)).float()

    vae, _ = load_vae(str(tiny_vae_dir))
    want = generate_images(model, vae, FlowLoop("euler", 3), indices=[0, 1, 2], labels=[0, 1, 1], seed=0,
                           scaling_factor=0.5, sampler="euler", model_fn=formula).numpy()
    plain = generate_images(model, vae, FlowLoop("euler", 3), indices=[0, 1, 2], labels=[0, 1, 1], seed=0,
                            scaling_factor=0.5, sampler="euler", cfg_scale=1.0).numpy()
    diff = np.abs(got.astype(int) - want.astype(int))
    assert diff.max() <= 1 and diff.mean() < 0.01  # the same pixels up to a rounding at the uint8 boundary
    assert np.abs(got.astype(int) - plain.astype(int)).max() > 1  # the guidance acted
