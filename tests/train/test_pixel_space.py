"""Pixel space end to end (issue #39): dit-extract --encoder pixels (no VAE: the hub is off and none is cached) ->
dit-shards verify -> dit-train with x-prediction on 64 px crops at patch 8, 2 gloo ranks, killed with SIGKILL and
resumed bit-identically, grids decoded by the identity -> dit-sample converting x to velocity -> dit-eval."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from dit_pipeline import dit
from dit_pipeline.common.errors import ConfigError, UserError
from dit_pipeline.common.pixels import to_latent
from dit_pipeline.extract.config import ExtractConfig
from dit_pipeline.shards import decode_pixels, iter_shard, read_manifest, verify_shards
from dit_pipeline.train.latents import LatentSpec, make_latents
from tests._util import make_image_tree, run_cli, straight_killed_resumed

SIZE, STEPS = 64, 4
KEYS = ("step", "loss", "mse", "grad_norm")


@pytest.fixture(scope="module")
def pixel_set(tmp_path_factory):
    root = tmp_path_factory.mktemp("pixels")
    make_image_tree(root / "images", counts=(3, 3, 2), size=(80, 72))
    out = root / "shards"
    r = run_cli("dit-extract", ["--data-path", root / "images", "--out", out, "--encoder", "pixels", "--image-size",
                                SIZE, "--samples-per-shard", 2, "--quiet"], env={"HF_HUB_OFFLINE": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def test_a_pixel_set_is_the_stored_crops_and_its_latents_are_nanogens(pixel_set):
    m = read_manifest(pixel_set)
    assert (m.store, m.dtype, m.latent_shape, m.views, m.scaling_factor) == ("pixels", "uint8", [3, SIZE, SIZE], 2, 1.0)
    assert m.extraction["vae"]["kind"] == "pixels" and m.extraction["vae"]["downsample_factor"] == 1
    assert verify_shards(pixel_set, quick=False, progress=False).ok
    samples = [s for rec in m.shards for s in iter_shard(str(pixel_set / rec.name), m, raw=True, pixels="bytes")]
    assert len(samples) == 8 and all(s.mean is None and s.latent is None for s in samples)
    latents = make_latents(samples, LatentSpec.from_manifest(m), seed=0, epoch=0)
    crops = np.stack([decode_pixels(s.pixels, SIZE) for s in samples])
    nanogen = torch.from_numpy(crops).permute(0, 3, 1, 2).float().div(255) * 2.0 - 1.0   # PixelEncoder (pixel.py)
    flipped = nanogen.flip(-1)
    for row, a, b in zip(latents, nanogen, flipped):  # each sample in one of its two views, exactly
        assert torch.equal(row, a) or torch.equal(row, b)
    assert not all(torch.equal(r, a) for r, a in zip(latents, nanogen))  # both views occur
    assert torch.equal(to_latent(crops), nanogen)
    from dit_pipeline.shards.info import format_info, info_dict
    from dit_pipeline.shards.stats import compute_stats

    assert "  latents:  pixels (the crop itself, pixels member), uint8" in format_info(info_dict(pixel_set))
    with pytest.raises(UserError, match="a pixel-space set \\(store pixels\\) holds no latent arrays; its latents "
                       "are the crops mapped to \\[-1, 1\\]"):
        compute_stats(pixel_set)


def test_the_uncompressed_encoding_holds_the_same_crops(pixel_set, tmp_path):
    """--pixel-encoding npy-uint8: the same crops as NPY uint8 members (pixels.npy), verified, read and turned into
    the same latents as the WebP set's, bit for bit; a damaged member is named by verify."""
    out = tmp_path / "raw"
    r = run_cli("dit-extract", ["--data-path", read_manifest(pixel_set).extraction["data_path"], "--out", out,
                                "--encoder", "pixels", "--image-size", SIZE, "--samples-per-shard", 2,
                                "--pixel-encoding", "npy-uint8", "--quiet"])
    assert r.returncode == 0, r.stderr[-3000:]
    m, w = read_manifest(out), read_manifest(pixel_set)
    assert m.pixels["member"] == "pixels.npy" and m.pixels["bytes"] == 8 * (128 + SIZE * SIZE * 3)
    assert verify_shards(out, quick=False, progress=False).ok
    raw = [s for rec in m.shards for s in iter_shard(str(out / rec.name), m, raw=True, pixels="bytes")]
    webp = [s for rec in w.shards for s in iter_shard(str(pixel_set / rec.name), w, raw=True, pixels="bytes")]
    assert torch.equal(make_latents(raw, LatentSpec.from_manifest(m), seed=0, epoch=3),
                       make_latents(webp, LatentSpec.from_manifest(w), seed=0, epoch=3))
    tar = out / m.shards[0].name
    data = bytearray(tar.read_bytes())
    i = data.index(b"\x93NUMPY")
    data[i + 70:i + 80] = b"{'descr': "  # a damaged NPY header inside the first member
    tar.write_bytes(bytes(data))
    report = verify_shards(out, quick=False, progress=False)
    assert not report.ok and any("pixels.npy" in problem for _, problem in report.problems), report.problems


def test_bad_pixel_options_are_refused_at_once(tmp_path):
    with pytest.raises(ConfigError) as e:
        ExtractConfig(data_path="x", out="y", store="pixels").validate()
    assert "--store pixels is the store of a pixel-space set: pass --encoder pixels (and no --store)" in str(e.value)
    with pytest.raises(ConfigError) as e:
        ExtractConfig(data_path="x", out="y", encoder="pixels", encoder_layers=2).validate()
    assert "--encoder pixels has no weights or layers; drop --encoder-weights and --encoder-layers" in str(e.value)
    with pytest.raises(ConfigError) as e:
        ExtractConfig(data_path="x", out="y", pixel_encoding="npy-uint8").validate()
    assert "--pixel-encoding npy-uint8 says how the crops are stored: add --pixels (or --encoder pixels)" in str(e.value)


def _train_args(shards, run_dir):
    opts = {"shards": shards, "run-dir": run_dir, "model": "DiT-S/2", "depth": 2, "hidden-size": 32, "num-heads": 2,
            "patch-size": 8, "objective": "flow", "prediction": "x", "t-sampling": "logit-normal", "t-mean": 1.1,
            "t-scale": 0.8, "time-shift": "auto", "max-steps": STEPS, "global-batch-size": 4, "micro-batch-size": 2,
            "num-workers": 1, "log-every": 1, "ckpt-every": 2, "lr": 1e-3, "sample-every": STEPS,
            "sample-classes": "0,1", "sample-steps": 2}
    return [a for k, v in opts.items() for a in (f"--{k}", str(v))]


@pytest.mark.determinism
def test_pixel_space_xpred_end_to_end(pixel_set, tmp_path):
    straight, a, b = straight_killed_resumed(lambda run: _train_args(pixel_set, run), tmp_path, STEPS, KEYS)
    assert all(torch.equal(a[part][k], b[part][k]) for part in ("model", "ema") for k in a[part])
    assert a["prediction"] == {"kind": "x", "t_eps": 0.05} and a["time_shift"] == pytest.approx(3 ** 0.5)
    assert a["latent"]["vae"]["kind"] == "pixels"
    assert (straight / "samples" / f"step-{STEPS:07d}.png").is_file()
    side = json.loads((straight / "checkpoints" / f"step-{STEPS:07d}-ema.json").read_text())
    assert side["prediction"] == {"kind": "x", "t_eps": 0.05}

    out = tmp_path / "sampled"
    r = run_cli("dit-sample", ["--ckpt", straight, "--num-samples", 4, "--steps", 3, "--sampler", "euler",
                               "--cfg-scale", 1, "--time-shift", 1, "--npz", out / "s.npz", "--batch-size", 4,
                               "--class-labels", "0,1,2,0", "--seed", 5, "--quiet"], env={"HF_HUB_OFFLINE": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    with np.load(out / "s.npz") as z:
        images = z["arr_0"]
    record = json.loads((out / "s.npz.json").read_text())
    assert record["fingerprint"]["prediction"] == {"kind": "x", "t_eps": 0.05}
    # the same samples by hand: x-prediction converted to velocity (dit.flow_predictions), decoded by the identity
    model = dit.model_from_config(a["model_config"])
    model.load_state_dict(a["ema"])
    from dit_pipeline.sample.generate import initial_noise, to_uint8
    from dit_pipeline.sample.plan import noise_generators

    noise = initial_noise(noise_generators(5, [0, 1, 2, 3]), (3, SIZE, SIZE), torch.device("cpu"))
    with torch.no_grad():
        x = dit.create_flow(prediction="x").sample_loop(model.eval(), noise, sampler="euler", steps=3,
                                                         model_kwargs={"y": torch.tensor([0, 1, 2, 0])})
    want = to_uint8(x).numpy()
    assert images.shape == (4, SIZE, SIZE, 3) and np.abs(images.astype(int) - want).max() <= 1

    r = run_cli("dit-eval", [out / "s.npz", "--ref", out / "s.npz", "--random-inception", "0", "--input-size", "75",
                             "--batch-size", "2", "--quiet"])
    assert r.returncode == 0, r.stderr[-3000:]


def test_pixelgens_perceptual_terms_train_and_are_recorded(pixel_set, tmp_path):
    """--lpips and --pdino (tiny networks of the real layouts, from files) join the loss where the noise level is
    below --percep-t-thresh, are logged as their own terms and recorded in the checkpoint."""
    from dit_pipeline.train.metrics import read_metrics
    from tests._util import make_tiny_teacher
    from tests.common.test_perceptual import make_tiny_lpips
    from tests.train.conftest import run_tiny

    lpips, _, _ = make_tiny_lpips(tmp_path / "lpips")
    ck = run_tiny(pixel_set, tmp_path / "run", patch_size=8, objective="flow", prediction="x", max_steps=2,
                  global_batch_size=4, t_sampling="logit-normal", t_mean=-0.8, t_scale=0.8, lpips=lpips,
                  pdino=str(make_tiny_teacher(tmp_path / "dino.safetensors")), percep_t_thresh=0.9)
    records = read_metrics(tmp_path / "run")
    assert len(records) == 2 and all(r["lpips"] > 0 and r["pdino"] > 0 for r in records)
    for r in records:
        assert r["loss"] == pytest.approx(r["mse"] + r["lpips"] + r["pdino"], rel=1e-5)
    assert ck["perceptual"] == {"lpips": lpips, "pdino": str(tmp_path / "dino.safetensors"), "lpips_weight": 0.1,
                                "pdino_weight": 0.01, "percep_t_thresh": 0.9}
