"""Loading every checkpoint kind for sampling: ours (ema/model), bare state_dicts (official release
files and our -ema.pt), reference training checkpoints with an argparse.Namespace; refusing pickles;
preset/size/class inference and the --model check."""
from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from dit_pipeline import dit
from dit_pipeline.common.errors import UserError
from dit_pipeline.sample.load import latent_norm, load_model, load_weights
from tests.sample.conftest import LATENT, random_dit


def test_our_checkpoint_ema_by_default_and_raw_weights_on_request(ckpts):
    ema = load_model(ckpts["ours"])
    raw = load_model(ckpts["ours"], weights="model")
    assert ema.info["source"] == "dit-pipeline" and ema.info["weights"] == "ema" and raw.info["weights"] == "model"
    assert ema.latent == LATENT and ema.info["step"] == 100
    for name, t in random_dit(2).state_dict().items():
        assert torch.equal(ema.model.state_dict()[name], t)
    assert torch.equal(raw.model.state_dict()["blocks.0.attn.qkv.weight"],
                       random_dit(1).state_dict()["blocks.0.attn.qkv.weight"])
    assert not ema.model.training
    assert "custom DiT (depth 2, hidden 32, heads 2, patch 2), 4x4x4 latents, 10 classes" in ema.describe()


def test_bare_state_dict_infers_the_preset(ckpts):
    loaded = load_model(ckpts["bare"], expect_model="DiT-S/8")
    assert loaded.info["source"] == "official" and loaded.latent is None
    assert loaded.config["model"] == "DiT-S/8" and loaded.config["input_size"] == 8
    assert loaded.config["num_classes"] == 10 and loaded.config["learn_sigma"]
    assert next(loaded.model.parameters()).dtype == torch.float32  # bf16 file, fp32 model


def test_weights_model_on_a_file_with_only_ema(tmp_path):
    path = tmp_path / "ema_only_ckpt.pt"
    model = random_dit(1)
    torch.save({"format": "dit-pipeline.checkpoint", "version": 1, "ema": model.state_dict(),
                "model_config": model.config}, path)
    with pytest.raises(UserError, match=r"--weights model: .* has no 'model' weights \(only 'ema'\)"):
        load_weights(path, weights="model")


def test_reference_training_checkpoint_with_namespace(ckpts):
    loaded = load_model(ckpts["reference"])
    assert loaded.info["source"] == "reference-train" and loaded.info["weights"] == "ema"
    assert loaded.info["args"]["model"] == "DiT-S/2" and loaded.config["num_heads"] == 6
    assert torch.equal(loaded.model.state_dict()["final_layer.linear.weight"],
                       random_dit(4, hidden_size=48, num_heads=6).state_dict()["final_layer.linear.weight"])


def test_pickle_payload_is_refused_not_unpickled(ckpts):
    with pytest.raises(UserError, match="--ckpt: refusing to load .*pickled pathlib.PosixPath"):
        load_model(ckpts["pickle"])


def test_missing_and_corrupt_files(tmp_path, ckpts):
    with pytest.raises(UserError, match="does not exist"):
        load_model(tmp_path / "nope.pt")
    bad = tmp_path / "truncated.pt"
    bad.write_bytes(ckpts["ours"].read_bytes()[:1000])
    with pytest.raises(UserError, match="corrupt or truncated"):
        load_model(bad)


def test_model_flag_must_match_the_weights(ckpts):
    with pytest.raises(UserError, match=r"--model DiT-XL/2, but .* holds the weights of DiT-S/8 .*drop --model"):
        load_weights(ckpts["bare"], expect_model="DiT-XL/2")
    with pytest.raises(UserError, match="--model: unknown DiT model 'DiT-Q/3'"):
        load_weights(ckpts["bare"], expect_model="DiT-Q/3")
    load_weights(ckpts["bare"], expect_model="dit-s-8")  # other spellings of the same preset


def _cheap_preset_file(path, name, input_size, num_classes):
    """A bare state_dict with preset shapes whose tensors are stride-0 views of one element (tiny file);
    pos_embed is the real table, as the loader checks it."""
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in dit.create_model(name, input_size=input_size,
                                                          num_classes=num_classes).state_dict().items()}
    sd = {k: torch.full((1,), 0.01).expand(s) for k, s in shapes.items()}
    grid = input_size // dit.MODEL_PRESETS[name][3]
    sd["pos_embed"] = torch.from_numpy(dit.pos_embed_2d(shapes["pos_embed"][2], grid)).float()[None]
    torch.save(sd, path)


@pytest.mark.parametrize("name,input_size,num_classes", [
    ("DiT-XL/2", 32, 1000), ("DiT-B/2", 64, 1000), ("DiT-B/4", 32, 1000), ("DiT-S/4", 16, 10),
    ("DiT-S/2", 8, 100),
])
def test_shape_inference_for_presets(tmp_path, name, input_size, num_classes):
    path = tmp_path / "w.pt"
    _cheap_preset_file(path, name, input_size, num_classes)
    _, info = load_weights(path, expect_model=name)
    c = info["model_config"]
    assert (info["preset"], c["input_size"], c["num_classes"], c["learn_sigma"]) == \
        (name, input_size, num_classes, True)


def test_latent_norm_prefers_the_checkpoint(caplog):
    vae = {"scaling_factor": 0.18215, "shift_factor": None}
    assert latent_norm(None, vae).key() == ("scalar", 0.18215, None)
    assert latent_norm({"scaling_factor": None}, vae).key() == ("scalar", 0.18215, None)
    log = logging.getLogger("t")
    with caplog.at_level(logging.WARNING, logger="t"):
        assert latent_norm({"scaling_factor": 0.5, "shift_factor": 0.1}, vae, log).key() == ("scalar", 0.5, 0.1)
    assert ("trained on latents normalized as scalar: (z - 0.1) * 0.5, but the VAE config says scalar: z * 0.18215; "
            "decoding with the checkpoint's values") in caplog.text
    # a VAE config with per-channel statistics (diffusers: (z - latents_mean) * scaling_factor / latents_std)
    vae_pc = {**vae, "latents_mean": [0.5, -0.5], "latents_std": [2.0, 4.0]}
    norm = latent_norm(None, vae_pc)
    assert norm.is_per_channel and norm.key() == ("per-channel", (np.float32(0.18215 / 2.0).item(),
                                                                  np.float32(0.18215 / 4.0).item()), (0.5, -0.5))
    recorded = {"scaling_factor": 0.18215, "shift_factor": None, "normalization": {
        "form": "scale_shift", "scale": [1.0, 2.0], "shift": [0.0, 1.0], "source": {"kind": "stats"}}}
    assert latent_norm(recorded, vae_pc).key() == ("per-channel", (1.0, 2.0), (0.0, 1.0))


def test_ckpt_accepts_a_run_folder(tmp_path, project_log):
    from dit_pipeline.sample.load import resolve_ckpt

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    with pytest.raises(UserError) as e:
        resolve_ckpt(run)
    assert str(e.value) == (f"--ckpt {run}: a folder without checkpoints (expected a run folder holding "
                            "checkpoints/step-NNNNNNN.pt, or a weight file)")
    for name in ("step-0000200.pt", "step-0001000.pt", "step-0001000-ema.pt", "step-0000900.pt"):
        (run / "checkpoints" / name).write_bytes(b"")
    newest = run / "checkpoints" / "step-0001000.pt"
    assert resolve_ckpt(run) == newest and resolve_ckpt(run / "checkpoints") == newest
    assert project_log[0] == f"--ckpt {run} is a run folder: using its newest checkpoint {newest}"
    assert resolve_ckpt(newest) == newest
