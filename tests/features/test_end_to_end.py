"""A feature space end to end (issue #32): tiny random DINOv2-shaped timm encoder -> dit-extract -> dit-shards
stats --write per-position -> dit-shards verify -> dit-train DiT-DH (flow, --time-shift auto) on 2 gloo ranks,
killed with SIGKILL and resumed bit-identically, sample grids through the RAE decoder -> dit-sample through the
decoder."""
from __future__ import annotations

import numpy as np
from PIL import Image

from dit_pipeline.shards import read_manifest, verify_shards
from dit_pipeline.shards.revision import revise
from tests._util import run_cli, straight_killed_resumed
from tests.features._tiny import TINY_IMAGE, make_tiny_decoder

STEPS = 4
KEYS = ("step", "loss", "grad_norm")


def _train_args(shards, run_dir, decoder):
    opts = {"shards": shards, "run-dir": run_dir, "model": "DiT-DH-S", "depth": 1, "head-depth": 1,
            "head-hidden-size": 64, "head-num-heads": 2, "patch-size": 1, "hidden-size": 32, "num-heads": 2,
            "objective": "flow", "time-shift": "auto", "max-steps": STEPS, "global-batch-size": 4,
            "micro-batch-size": 2, "num-workers": 0, "log-every": 1, "ckpt-every": 2, "lr": 1e-3,
            "sample-every": STEPS, "sample-classes": "0,1", "sample-steps": 2, "vae": decoder}
    return [a for k, v in opts.items() for a in (f"--{k}", str(v))]


def test_feature_space_end_to_end(extracted, tmp_path):
    import shutil

    shards = tmp_path / "shards"
    shutil.copytree(extracted, shards)
    dec = make_tiny_decoder(tmp_path / "decoder" / "model.pt")
    decoder = f"{dec},{dec.parent / 'config.json'}"
    assert revise(shards, mode="per-position")["revision"] == 2   # the CLI: tests/features/test_position_norm.py
    assert verify_shards(shards, quick=False, progress=False).ok
    m = read_manifest(shards)
    assert m.norm.is_per_position and m.extraction["encoder"]["model"] == "vit_base_patch14_reg4_dinov2"

    straight, a, b = straight_killed_resumed(lambda run: _train_args(shards, run, decoder), tmp_path, STEPS, KEYS)
    assert all(np.array_equal(a["ema"][k].numpy(), b["ema"][k].numpy()) for k in a["ema"])
    assert a["latent"]["encoder"]["model"] == "vit_base_patch14_reg4_dinov2"
    assert a["latent"]["normalization"]["form"] == "mean_var"
    grid = Image.open(straight / "samples" / f"step-{STEPS:07d}.png")
    assert grid.size[0] >= 2 * TINY_IMAGE                                                  # decoded 32 px images

    out = tmp_path / "sampled"
    r = run_cli("dit-sample", ["--ckpt", straight, "--decoder", decoder, "--num-samples", 2, "--steps", 2,
                               "--npz", out / "s.npz", "--batch-size", 2, "--quiet"])
    assert r.returncode == 0, r.stderr[-3000:]
    with np.load(out / "s.npz") as z:
        images = z["arr_0"]
    assert images.shape == (2, TINY_IMAGE, TINY_IMAGE, 3) and images.std() > 0
    # a decoder of another token grid (another encoder or image size): one clear error before any sampling (one of
    # another width is refused by the latent-channel check every VAE gets)
    other = make_tiny_decoder(tmp_path / "other" / "model.pt", grid=8)
    r = run_cli("dit-sample", ["--ckpt", straight, "--vae", other, "--num-samples", 2, "--steps", 2,
                               "--npz", tmp_path / "x.npz", "--quiet"])
    assert r.returncode != 0 and "decodes 8 x 8 tokens but the model makes 4 x 4" in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "x.npz").exists()
