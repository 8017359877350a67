"""dit-sample export: the diffusers DiTTransformer2DModel conversion is exact (with DiT's timestep
frequencies), the DiTPipeline folder loads and samples like our DDIM, and .safetensors round-trips."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from dit_pipeline import dit
from dit_pipeline.common.errors import ConfigError, UserError
from dit_pipeline.sample import ExportConfig, SampleConfig, export, run_sampling
from dit_pipeline.sample.export import (build_diffusers_transformer, scheduler_config, set_dit_timestep_frequencies,
                           to_diffusers_state_dict)
from dit_pipeline.sample.plan import noise_seed
from tests._util import run_cli
from tests.sample.conftest import our_checkpoint, random_dit

# The latent scale the checkpoint records differs from the tiny VAE's 0.5, so the export must carry it.
LATENT_025 = {"scaling_factor": 0.25, "shift_factor": None, "vae": {"source": "tiny"}}


def outputs(model, transformer, seed=0):
    g = torch.Generator().manual_seed(seed)
    size, channels = model.input_size, model.in_channels
    x = torch.randn(4, channels, size, size, generator=g)
    t = torch.tensor([0, 1, 500, 999])
    y = torch.tensor([0, 3, model.num_classes - 1, model.num_classes])  # the last one is the null class
    with torch.no_grad():
        return model(x, t, y), transformer(x, timestep=t, class_labels=y).sample


@pytest.mark.parametrize("overrides", [
    dict(),  # 1000 classes, learned sigma, patch 2
    dict(learn_sigma=False, num_classes=10),
    dict(name="DiT-S/4", input_size=8, num_classes=7, depth=1, hidden_size=64, num_heads=4),
])
def test_converted_transformer_matches_our_model(overrides):
    kw = {"num_classes": 1000, **overrides}
    model = random_dit(21, **kw)
    transformer = build_diffusers_transformer(model.state_dict(), model.config)
    ours, stock = outputs(model, transformer)
    # stock diffusers uses timestep frequencies 10000^(-k/127): close to DiT but not equal
    assert (ours - stock).abs().max() > 1e-3
    assert set_dit_timestep_frequencies(transformer) == model.depth
    ours, fixed = outputs(model, transformer)
    assert fixed.shape == ours.shape
    torch.testing.assert_close(fixed, ours, rtol=1e-5, atol=1e-5)


def test_conversion_refuses_a_model_without_null_class():
    model = random_dit(1, class_dropout_prob=0.0)
    with pytest.raises(UserError, match="no null class"):
        to_diffusers_state_dict(model.state_dict(), model.config)


@pytest.fixture(scope="module")
def ckpt_1000(tmp_path_factory):
    """Our checkpoint of a tiny 1000-class DiT (DiTPipeline's null class is id 1000)."""
    path = tmp_path_factory.mktemp("exp") / "ours1000.pt"
    torch.save(our_checkpoint(random_dit(31, num_classes=1000), random_dit(32, num_classes=1000),
                              latent=LATENT_025), path)
    return path


def test_diffusers_pipeline_folder_loads_and_samples_like_our_ddim(ckpt_1000, tiny_vae_dir, tmp_path):
    from diffusers import DDIMScheduler, DiTPipeline

    out = tmp_path / "pipe"
    res = run_cli("dit-sample", ["export", "--to", "diffusers", out, "--ckpt", ckpt_1000, "--vae", tiny_vae_dir])
    assert res.returncode == 0, res.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["model_index.json", "scheduler", "transformer", "vae"]
    assert json.loads((out / "model_index.json").read_text())["transformer"] == ["diffusers", "DiTTransformer2DModel"]
    pipe = DiTPipeline.from_pretrained(out)
    assert isinstance(pipe.scheduler, DDIMScheduler)
    assert {k: pipe.scheduler.config[k] for k in scheduler_config()} == scheduler_config()
    assert pipe.vae.config.scaling_factor == 0.25 and pipe.transformer.config.norm_eps == 1e-6
    set_dit_timestep_frequencies(pipe.transformer)
    ema = random_dit(32, num_classes=1000)
    ours, theirs = outputs(ema, pipe.transformer)
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)

    # DiTPipeline guides all 4 channels and runs DDIM with "leading" spacing = our "ddim5", cfg "all"
    npz = tmp_path / "ours.npz"
    run_sampling(SampleConfig(ckpt=str(ckpt_1000), vae=str(tiny_vae_dir), class_labels=[207], seed=9,
                              sampler="ddim", steps=5, cfg_scale=4.0, cfg_channels="all", npz=str(npz), quiet=True))
    with np.load(npz) as z:
        ours_img = z["arr_0"][0].astype(np.float64)
    gen = torch.Generator().manual_seed(noise_seed(9, 0))
    theirs_img = pipe(class_labels=[207], guidance_scale=4.0, num_inference_steps=5, generator=gen,
                      output_type="np").images[0] * 255.0
    # ours truncates 127.5x + 128, theirs is 127.5x + 127.5 before rounding: at most one level apart
    assert np.abs(theirs_img - ours_img).max() <= 1.01
    assert ours_img.std() > 5


def test_diffusers_pipeline_knows_the_class_names(tmp_path, tiny_vae_dir):
    """`pipe.labels` maps each class name (the manifest's class folders, recorded in the checkpoint) to its id;
    DiTPipeline splits a name at commas into synonyms, as for the hub's ImageNet pipelines."""
    from diffusers import DiTPipeline

    names = [f"n{k:08d}" for k in range(1000)]
    names[207], names[999] = "golden retriever, Ñandú", "鳥"
    ckpt = tmp_path / "named.pt"
    torch.save(our_checkpoint(random_dit(31, num_classes=1000), random_dit(32, num_classes=1000),
                              latent={**LATENT_025, "class_names": names}), ckpt)
    out = tmp_path / "pipe"
    res = run_cli("dit-sample", ["export", "--to", "diffusers", out, "--ckpt", ckpt, "--vae", tiny_vae_dir])
    assert res.returncode == 0, res.stderr[-3000:]
    pipe = DiTPipeline.from_pretrained(out)
    assert len(pipe.labels) == 1001
    assert pipe.labels["golden retriever"] == 207 and pipe.labels["Ñandú"] == 207 and pipe.labels["鳥"] == 999
    assert pipe.get_label_ids(["n00000003", "鳥"]) == [3, 999]
    assert json.loads((out / "model_index.json").read_text(encoding="utf-8"))["id2label"]["207"] == names[207]


def test_safetensors_export_round_trips(ckpts, tiny_vae_dir, tmp_path):
    st = tmp_path / "w.safetensors"
    res = run_cli("dit-sample", ["export", "--to", "safetensors", st, "--ckpt", ckpts["ours"]])
    assert res.returncode == 0, res.stderr[-3000:]
    state_dict, info = dit.load_dit_weights(st)
    assert info["source"] == "safetensors" and info["model_config"]["depth"] == 2
    for name, t in random_dit(2).state_dict().items():  # the EMA weights
        assert torch.equal(state_dict[name], t)
    with pytest.raises(ConfigError, match="already exists; choose a new path or pass --overwrite"):
        export(ExportConfig(to="safetensors", output=str(st), ckpt=str(ckpts["ours"])))
    # sampling from the export equals sampling from the checkpoint (the latent scale travels along)
    arrays = []
    for src in (ckpts["ours"], st):
        npz = tmp_path / f"{src.stem}.npz"
        run_sampling(SampleConfig(ckpt=str(src), vae=str(tiny_vae_dir), class_labels=[4, 2], steps=3, npz=str(npz),
                                  quiet=True))
        with np.load(npz) as z:
            arrays.append(z["arr_0"])
    assert np.array_equal(arrays[0], arrays[1])
    export(ExportConfig(to="safetensors", output=str(st), ckpt=str(ckpts["ours"]), weights="model", overwrite=True))
    assert torch.equal(dit.load_dit_weights(st)[0]["blocks.0.mlp.fc1.weight"],
                       random_dit(1).state_dict()["blocks.0.mlp.fc1.weight"])


@pytest.mark.parametrize("latent,what", [
    ({"scaling_factor": 0.3611, "shift_factor": 0.1159}, "scalar: (z - 0.1159) * 0.3611"),
    ({"scaling_factor": 0.5, "shift_factor": None, "normalization": {
        "form": "mean_std", "mean": [0.0] * 4, "std": [2.0] * 4, "multiplier": 1.0, "source": {"kind": "stats"}}},
     "per-channel over 4 channels"),
])
def test_diffusers_export_refuses_latents_ditpipeline_cannot_decode(latent, what, tiny_vae_dir, tmp_path):
    """DiTPipeline decodes latents / scaling_factor with an AutoencoderKL: a shift or a per-channel
    normalization would be lost, so such a model exports to safetensors only (its normalization kept)."""
    ckpt = tmp_path / "ours.pt"
    torch.save(our_checkpoint(random_dit(31, num_classes=1000), random_dit(32, num_classes=1000),
                              latent={**latent, "vae": {"source": "tiny"}}), ckpt)
    with pytest.raises(UserError) as e:
        export(ExportConfig(ckpt=str(ckpt), to="diffusers", output=str(tmp_path / "pipe"), vae=str(tiny_vae_dir)))
    assert str(e.value).startswith("--to diffusers: DiTPipeline decodes with an AutoencoderKL's scaling_factor "
                                   f"alone, but this model's latents are {what}")
    assert "export it with --to safetensors" in str(e.value) and not (tmp_path / "pipe").exists()
    out = export(ExportConfig(ckpt=str(ckpt), to="safetensors", output=str(tmp_path / "w.safetensors")))
    from dit_pipeline.sample.load import load_weights

    assert load_weights(out)[1]["latent"] == {**latent, "vae": {"source": "tiny"}}
