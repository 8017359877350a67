"""Other tokenizers end to end (issue #23), each a tiny random VAE saved with save_pretrained: a 16-channel f8
AutoencoderKL with a shift (FLUX's factors), a 32-channel f16 AutoencoderKL with per-channel latents_mean /
latents_std in its config (VA-VAE's geometry), a 32-channel f32 AutoencoderDC (DC-AE's, encode(x).latent).

Each: extract -> verify -> stats (a manifest revision for two of them) -> train (the trainer's grid) ->
dit-sample's grid, which equals the trainer's and equals the sampled latents decoded by hand (the inverse of
the recorded normalization written out here, then the VAE); decoding without the normalization gives other
pixels. And the f16 32-channel set trains a DiT-XL/1-shaped model (depth 1) with exact resume, refused after
a revision renormalized the set, continued against the kept manifest.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from dit_pipeline import dit
from dit_pipeline.extract import ExtractConfig, run_extract
from dit_pipeline.extract.plan import bytes_per_sample
from dit_pipeline.sample import SampleConfig
from dit_pipeline.sample import main as sample_main
from dit_pipeline.sample.generate import cfg_channels_for, make_diffusion, sample_latents
from dit_pipeline.sample.plan import noise_generators
from dit_pipeline.shards import read_manifest, verify_shards
from dit_pipeline.shards.info import format_info, info_dict
from dit_pipeline.shards.revision import revise
from dit_pipeline.shards.stats import compute_stats
from dit_pipeline.train.checkpoint import CheckpointManager, load_checkpoint
from dit_pipeline.train.metrics import read_metrics
from tests._util import TINY_KL16_F8, TINY_KL32_F16, has_autoencoder_dc, make_image_tree, make_tiny_dc, make_tiny_vae
from tests.train.conftest import invoke_train

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create")

# name -> (make the VAE folder, image size, store, latent shape, downsampling, manifest format version)
ENCODERS = {
    "kl16-f8-shift": (lambda d: make_tiny_vae(d, **TINY_KL16_F8), 32, "posterior", [16, 4, 4], 8, 1),
    "kl32-f16-per-channel": (lambda d: make_tiny_vae(d, **TINY_KL32_F16), 64, "posterior", [32, 4, 4], 16, 3),
    "dc32-f32": (make_tiny_dc, 64, "sample", [32, 2, 2], 32, 1),
}
GRID_CLASSES = [0, 2]
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # the trainer's (dit-sample decodes on it too)


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    return make_image_tree(tmp_path_factory.mktemp("tok-images") / "images", counts=(4, 4, 4), size=(80, 72))


@pytest.fixture(scope="module")
def extracted(images, tmp_path_factory):
    """name -> (VAE folder, shard folder), extracted once per module (tests copy a set before changing it)."""
    out = {}
    root = tmp_path_factory.mktemp("tok-sets")
    for name, (make, size, store, *_rest) in ENCODERS.items():
        if name.startswith("dc") and not has_autoencoder_dc():
            continue
        vae = make(root / f"vae-{name}")
        shards = root / f"shards-{name}"
        run_extract(ExtractConfig(data_path=str(images), out=str(shards), vae=str(vae), image_size=size, store=store,
                                  quiet=True))
        out[name] = (vae, shards)
    return out


def _load_vae_class(folder: Path):
    import diffusers

    cls = getattr(diffusers, json.loads((folder / "config.json").read_text())["_class_name"])
    return cls.from_pretrained(str(folder)).to(DEVICE).eval()


def _decode_by_hand(latent: dict, x: torch.Tensor, vae) -> np.ndarray:
    """The documented inverse (docs/FORMAT.md, "The latent the model sees"), then the VAE, one image at a time,
    then 127.5 y + 128 truncated: uint8 [N, H, W, 3]."""
    norm = latent.get("normalization")
    if norm is None:
        z = x / latent["scaling_factor"]
        if latent["shift_factor"] is not None:
            z = z + latent["shift_factor"]
    else:
        assert norm["form"] == "mean_std"
        scale = torch.tensor([norm["multiplier"] / s for s in norm["std"]], dtype=torch.float64).float().to(DEVICE)
        shift = torch.tensor(norm["mean"], dtype=torch.float64).float().to(DEVICE)
        z = x / scale.view(-1, 1, 1) + shift.view(-1, 1, 1)
    with torch.no_grad():
        y = torch.cat([vae.decode(row[None]).sample for row in z])
    return torch.clamp(127.5 * y + 128.0, 0, 255).permute(0, 2, 3, 1).to("cpu", dtype=torch.uint8).numpy()


def _tiles(grid_png: Path, n: int, size: int) -> list[np.ndarray]:
    """The lower halves of the first n tiles of a one-row grid (the upper left corner holds the label)."""
    with Image.open(grid_png) as im:
        arr = np.asarray(im.convert("RGB"))
    pad = 2
    return [arr[pad + size // 2: pad + size, pad + i * (size + pad): pad + i * (size + pad) + size] for i in range(n)]


NEEDS_DC = pytest.mark.skipif(not has_autoencoder_dc(), reason="AutoencoderDC needs diffusers >= 0.32")


@pytest.mark.slow
@pytest.mark.parametrize("name", [n if not n.startswith("dc") else pytest.param(n, marks=NEEDS_DC) for n in ENCODERS])
def test_extract_verify_stats_train_sample_end_to_end(name, extracted, tmp_path):
    _, size, store, shape, factor, version = ENCODERS[name]
    vae_dir, original = extracted[name]
    shards = tmp_path / "shards"
    shutil.copytree(original, shards)
    m = read_manifest(shards)
    assert (m.latent_shape, m.image_size, m.store, m.format_version) == (shape, size, store, version)
    ident = m.extraction["vae"]
    assert (ident["latent_channels"], ident["downsample_factor"]) == (shape[0], factor)
    # the tar bytes of a sample are what extract/plan.py computes (docs/vaes.md: the disk costs)
    arrays = 2 if store == "posterior" else 1
    members = m.total_samples * bytes_per_sample(2, arrays, tuple(shape), 2)  # one shard: + end blocks, padding
    assert m.total_bytes == -(-(members + 1024) // 10240) * 10240
    text = format_info(info_dict(shards))
    enc = "deterministic latent" if store == "sample" else "posterior"
    assert f"  geometry: {ident['class']}, f{factor}: {size} px -> {shape[0]} x {shape[1]} x {shape[2]} ({enc})" in text
    assert verify_shards(shards).ok

    s = compute_stats(shards, max_samples=100)
    assert s["samples_used"] == 12 and len(s["channel_std"]) == shape[0]
    if name == "kl16-f8-shift":  # the VAE config's scalar factors, shift included
        assert (m.scaling_factor, m.shift_factor, m.normalization) == (0.3611, 0.1159, None)
        np.testing.assert_allclose(s["channel_mean"], (np.array(s["raw_channel_mean"]) - 0.1159) * 0.3611,
                                   rtol=1e-5, atol=1e-6)
        assert "  scale:    scaling_factor 0.3611, shift_factor 0.1159" in text
    elif name == "kl32-f16-per-channel":  # the VAE config's latents_mean/std, then statistics of this set
        assert m.normalization == {"form": "mean_std", "mean": TINY_KL32_F16["latents_mean"],
                                   "std": TINY_KL32_F16["latents_std"], "multiplier": 1.0,
                                   "source": {"kind": "vae_config"}}
        r = revise(shards, mode="per-channel", max_samples=100)
        assert r["revision"] == 2 and r["after"]["near_unit_std"]
    else:  # DC-AE: a deterministic latent (no noise, seed not recorded), then a scalar revision to unit std
        assert ident["encoder_output"] == "latent" and m.extraction["seed"] is None and m.scaling_factor == 0.41407
        r = revise(shards, mode="scalar", max_samples=100)
        assert read_manifest(shards).scaling_factor == pytest.approx(0.41407 / s["std"], rel=1e-12)
    m = read_manifest(shards)

    run = tmp_path / "run"
    res = invoke_train(["--shards", shards, "--run-dir", run, "--model", "DiT-S/1", "--depth", 2, "--hidden-size",
                        32, "--num-heads", 2, "--max-steps", 2, "--global-batch-size", 4, "--num-workers", 0,
                        "--ckpt-every", 2, "--sample-every", 2, "--sample-steps", 5, "--sample-weights", "raw",
                        "--sample-classes", ",".join(map(str, GRID_CLASSES)), "--lr", "1e-3", "--quiet"])
    assert res.exit_code == 0, res.output
    ck = load_checkpoint(CheckpointManager(run / "checkpoints").latest())
    assert ck["model_config"]["in_channels"] == shape[0] and ck["model_config"]["input_size"] == shape[1]
    assert ck["model_config"]["patch_size"] == 1 and ck["model_config"]["depth"] == 2
    assert ck["latent"] == {**m.norm.record(), "vae": ident, "class_names": m.class_names}
    assert ck["manifest_fingerprint"] == m.fingerprint()
    sidecar = json.loads((run / "checkpoints" / "step-0000002-ema.json").read_text())
    assert sidecar["latent"] == ck["latent"]  # the bare EMA file decodes the same way

    # dit-sample with no --vae or normalization flag: the checkpoint says both
    out = tmp_path / "samples"
    sample_main(SampleConfig(ckpt=str(run / "checkpoints" / "step-0000002.pt"), weights="model",
                             class_labels=GRID_CLASSES, sampler="ddim", steps=5, cfg_scale=4.0, seed=0, out=str(out),
                             device=str(DEVICE), quiet=True))
    with Image.open(out / "grid.png") as a, Image.open(run / "samples" / "step-0000002-raw.png") as b:
        assert np.array_equal(np.asarray(a), np.asarray(b))  # the trainer's grid, reproduced
    state, info = dit.load_dit_weights(run / "checkpoints" / "step-0000002.pt", prefer="model")
    model = dit.build_model_from_weights(state, info, device=DEVICE)
    channels = cfg_channels_for(ck["model_config"], "ddpm")  # --cfg-channels auto: all but a 4-channel DiT's
    assert channels == ("3" if shape[0] == 4 else "all")
    x = sample_latents(model, make_diffusion("ddim", 5), torch.tensor(GRID_CLASSES, device=DEVICE),
                       noise_generators(0, range(len(GRID_CLASSES))), sampler="ddim", cfg_scale=4.0,
                       cfg_channels=channels)
    vae = _load_vae_class(vae_dir)
    by_hand = _decode_by_hand(ck["latent"], x, vae)
    tiles = _tiles(out / "grid.png", len(GRID_CLASSES), size)
    # one image at a time here, a batch in dit-sample: the decoder's rounding may differ, so a pixel may land on the
    # other side of a uint8 step (seen: 1 value of 6144 off by 1); anything more is a different latent or inverse
    diffs = [np.abs(t.astype(int) - img[size // 2:].astype(int)) for t, img in zip(tiles, by_hand)]
    assert all(d.max() <= 1 and (d > 0).mean() < 0.01 for d in diffs), [(d.max(), (d > 0).sum()) for d in diffs]
    raw = _decode_by_hand({"scaling_factor": 1.0, "shift_factor": None}, x, vae)  # without the normalization
    assert max(np.abs(t.astype(int) - img[size // 2:].astype(int)).max() for t, img in zip(tiles, raw)) > 1


def _records(run_dir):
    return {r["step"]: (r["epoch"], r["loss"], r["mse"], r["vb"], r["grad_norm"]) for r in read_metrics(run_dir)}


def _xl1(shards, run, steps, **extra):
    args = ["--shards", shards, "--run-dir", run, "--model", "DiT-XL/1", "--depth", 1, "--max-steps", steps,
            "--global-batch-size", 4, "--micro-batch-size", 2, "--num-workers", 0, "--ckpt-every", 2,
            "--keep-last", 1, "--log-every", 1, "--quiet"]
    for k, v in extra.items():
        args += [f"--{k}"] if v is None else [f"--{k}", v]
    return invoke_train(args)


@pytest.mark.slow
def test_f16_32_channel_set_trains_dit_xl1_with_exact_resume(extracted, tmp_path):
    shards = tmp_path / "shards"
    shutil.copytree(extracted["kl32-f16-per-channel"][1], shards)
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    r = _xl1(shards, straight, 4)
    assert r.exit_code == 0, r.output
    assert _xl1(shards, resumed, 2).exit_code == 0
    r = _xl1(shards, resumed, 4)
    assert r.exit_code == 0, r.output
    assert sorted(_records(straight)) == [1, 2, 3, 4] and _records(straight) == _records(resumed)
    a = load_checkpoint(CheckpointManager(straight / "checkpoints").latest())
    b = load_checkpoint(CheckpointManager(resumed / "checkpoints").latest())
    assert a["model_config"] == b["model_config"] and a["model_config"]["model"] is None  # XL/1 at depth 1
    assert (a["model_config"]["hidden_size"], a["model_config"]["num_heads"], a["model_config"]["patch_size"],
            a["model_config"]["in_channels"], a["model_config"]["input_size"]) == (1152, 16, 1, 32, 4)
    for key in ("model", "ema"):
        assert all(torch.equal(a[key][k], b[key][k]) for k in a[key]), key
    for i, st in a["opt"]["state"].items():
        assert all(torch.equal(v, b["opt"]["state"][i][k]) for k, v in st.items())
    plan = _xl1(shards, tmp_path / "plan", 4, **{"dry-run": None}).output
    assert ("  model       custom (depth 1, hidden 1152, heads 16, patch 1): 28.32M parameters, input 4 (4x4 latents "
            "/ patch 1 = 16 tokens per image)") in plan
    assert ("  latents     per-channel over 32 channels: (z - mean_c) * 1 / std_c (mean -0.32..0.3, std 0.9..1.21), "
            "from the VAE config's latents_mean/latents_std") in plan

    # a revision renormalizes the set: the run trained on revision 1 is refused by name, nothing loaded ...
    revise(shards, mode="per-channel", max_samples=100)
    r = _xl1(shards, resumed, 6)
    assert r.exit_code == 1
    assert ("was trained on latents normalized as per-channel over 32 channels: (z - mean_c) * 1 / std_c (mean "
            "-0.32..0.3, std 0.9..1.21), from the VAE config's latents_mean/latents_std; the shards' manifest "
            "(revision 2) now normalizes them as per-channel over 32 channels") in r.output
    assert "--manifest SHARDS/manifest.json.revN" in r.output
    assert CheckpointManager(resumed / "checkpoints").steps() == [4]
    # ... and continues against the manifest it was trained on, kept beside the new one
    r = _xl1(shards, resumed, 6, manifest=shards / "manifest.json.rev1", **{"dry-run": None})
    assert r.exit_code == 0 and "would resume from" in r.output, r.output
