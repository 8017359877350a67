"""Files in each release's own layout (dit/releases.py), written from tiny random models, load key by key into
the right family, sample the same outputs as the weights they were made from, and carry their release's time
convention; what a file cannot state is taken from hints or refused naming the flag that supplies it."""
from __future__ import annotations

import argparse

import pytest
import torch

from dit_pipeline import dit
from dit_pipeline.common.latent_norm import LatentNorm
from dit_pipeline.dit.weights import WeightsError
from tests.dit.test_families import build, inputs

LIGHTNING_CONFIG = {"model": {"model_type": "LightningDiT-B/2", "use_qknorm": False, "use_swiglu": True,
                              "use_rope": True, "use_rmsnorm": True, "wo_shift": False, "in_chans": 4},
                    "data": {"num_classes": 5, "latent_norm": True, "latent_multiplier": 1.0},
                    "transport": {"path_type": "Linear", "prediction": "velocity", "use_cosine_loss": True}}


def same_outputs(state_dict, info, model):
    rebuilt = dit.build_model_from_weights(state_dict, info)
    assert type(rebuilt) is type(model) and list(rebuilt.state_dict()) == list(model.state_dict())
    x, t, y = inputs(model)
    with torch.no_grad():
        assert torch.equal(rebuilt(x, t, y), model.eval()(x, t, y))


def test_lightningdit_train_checkpoint(tmp_path):
    ema, raw = build("LightningDiT", seed=1), build("LightningDiT", seed=2)
    path = tmp_path / "0080000.pt"  # train.py: {model (DDP-wrapped names), ema, opt, config = its YAML}
    torch.save({"model": {f"module.{k}": v for k, v in raw.state_dict().items()}, "ema": ema.state_dict(),
                "opt": {"state": {}, "param_groups": []}, "config": LIGHTNING_CONFIG}, path)
    sd, info = dit.load_dit_weights(path)
    assert (info["source"], info["release"], info["weights"], info["family"]) == (
        "lightningdit-train", "LightningDiT", "ema", "LightningDiT")
    assert info["model_config"] == ema.config  # heads from the RoPE tables, classes and switches from its config
    assert (info["objective"], info["flow_convention"]) == ("flow", "sit")
    assert info["latent_required"]["multiplier"] == 1.0
    same_outputs(sd, info, ema)
    sd, info = dit.load_dit_weights(path, prefer="model")
    same_outputs(sd, info, raw)
    bad = {**LIGHTNING_CONFIG, "transport": {"path_type": "GVP", "prediction": "velocity"}}
    torch.save({"ema": ema.state_dict(), "config": bad}, path)
    with pytest.raises(WeightsError, match="LightningDiT trained with path_type='GVP'.*only its Linear path"):
        dit.load_dit_weights(path)


def test_rae_stage2_checkpoint_and_a_bare_ditdh_file(tmp_path):
    ema, raw = build("DiT-DH", seed=1), build("DiT-DH", seed=2)
    path = tmp_path / "0100000.pt"  # RAE's train.py: {step, epoch, model, ema, optimizer, scheduler}
    torch.save({"step": 100000, "epoch": 7, "model": raw.state_dict(), "ema": ema.state_dict(), "optimizer": {},
                "scheduler": {"last_epoch": 7}}, path)
    sd, info = dit.load_dit_weights(path)
    assert (info["source"], info["release"], info["weights"], info["step"]) == ("rae-train", "RAE", "ema", 100000)
    assert info["model_config"] == ema.config and info["flow_convention"] == "repa"  # t = 1 noise, noise - data
    assert "RAE" in info["flow_convention_from"]
    same_outputs(sd, info, ema)
    torch.save(raw.state_dict(), tmp_path / "bare.pt")
    sd, info = dit.load_dit_weights(tmp_path / "bare.pt")
    assert info["family"] == "DiT-DH" and info["flow_convention"] == "repa" and info["release"] == "RAE"
    same_outputs(sd, info, raw)


def test_ddt_lightning_checkpoint(tmp_path):
    ema, raw = build("DDT", seed=1), build("DDT", seed=2)
    path = tmp_path / "last.ckpt"  # Lightning: state_dict with the module's attributes as prefixes
    state = {**{f"denoiser.{k}": v for k, v in raw.state_dict().items()},
             **{f"ema_denoiser.{k}": v for k, v in ema.state_dict().items()},
             "diffusion_trainer.proj.0.0.weight": torch.zeros(8, 64)}
    torch.save({"epoch": 3, "global_step": 1000, "pytorch-lightning_version": "2.4.0", "state_dict": state,
                "optimizer_states": [], "lr_schedulers": []}, path)
    with pytest.raises(WeightsError, match="its encoder_depth is unknown; pass --model with its preset, "
                                           "--encoder-depth, or put a JSON sidecar"):
        dit.load_dit_weights(path)
    with pytest.raises(WeightsError, match=r"DDT files do not record the latent size .*; pass --input-size"):
        dit.load_dit_weights(path, hints={"encoder_depth": 1})  # the patch: DDT's default 2 (its configs' too)
    sd, info = dit.load_dit_weights(path, hints={"encoder_depth": 1, "patch_size": 2, "input_size": 8})
    assert (info["source"], info["release"], info["weights"]) == ("ddt-train", "DDT", "ema")
    assert info["model_config"] == ema.config and info["flow_convention"] == "sit"  # heads from the QK-norm width
    same_outputs(sd, info, ema)
    sd, info = dit.load_dit_weights(path, prefer="model", hints={"encoder_depth": 1, "patch_size": 2, "input_size": 8})
    same_outputs(sd, info, raw)


def test_repa_e_checkpoint_carries_its_latent_normalization(tmp_path):
    torch.manual_seed(0)  # REPA-E's SiT-S/1 layout at a tiny depth: 6 heads from the args' model name
    model = dit.DiT(input_size=4, patch_size=1, in_channels=4, hidden_size=96, depth=2, num_heads=6, num_classes=5,
                    learn_sigma=False)
    var, mean = torch.tensor([4.0, 0.25, 1.0, 9.0]), torch.tensor([0.5, -1.0, 0.0, 2.0])
    ema = {**model.state_dict(), "projectors.0.0.weight": torch.zeros(8, 96), "projectors.0.0.bias": torch.zeros(8),
           "bn.running_mean": mean, "bn.running_var": var, "bn.num_batches_tracked": torch.tensor(9)}
    args = argparse.Namespace(model="SiT-S/1", enc_type="dinov2-vit-b", proj_coeff=0.5, encoder_depth=1,
                              path_type="linear", prediction="v", vae="f16d32", num_classes=5)
    path = tmp_path / "0400000.pt"
    torch.save({"model": ema, "ema": ema, "vae": {"decoder.conv_in.weight": torch.zeros(2)}, "opt": {}, "args": args,
                "steps": 400000}, path)
    sd, info = dit.load_dit_weights(path)
    assert info["release"] == "REPA-E" and info["flow_convention"] == "repa" and not any(k.startswith("bn.") for k in sd)
    norm = LatentNorm.from_record(info["latent"])  # x = (z - mean) * rsqrt(var), REPA-E's normalize_latents
    z = torch.randn(1, 4, 2, 2)
    torch.testing.assert_close(norm.invert(norm.apply(z.clone())), z, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(norm.apply(z.clone()), (z - mean.view(4, 1, 1)) / var.sqrt().view(4, 1, 1))
    same_outputs(sd, info, model)


def test_what_a_file_cannot_state_is_refused_with_the_flag_or_taken_from_hints(tmp_path):
    model = build("LightningDiT", rope=False)  # no RoPE table, no QK-norm: the head count is nowhere
    torch.save(model.state_dict(), tmp_path / "w.pt")
    with pytest.raises(WeightsError, match="number of attention heads is unknown; pass --num-heads"):
        dit.load_dit_weights(tmp_path / "w.pt")
    sd, info = dit.load_dit_weights(tmp_path / "w.pt", hints={"num_heads": 4})
    assert info["family"] == "LightningDiT" and info["model_config"]["num_heads"] == 4
    assert info["release"] == "LightningDiT" and "latents_stats.pt" in info["latent_required"]["what"]
    same_outputs(sd, info, model)
    only_swiglu = build("LightningDiT", rope=False, rms_norm=False)  # recognised by its unrounded SwiGLU width
    torch.save(only_swiglu.state_dict(), tmp_path / "s.pt")
    assert dit.load_dit_weights(tmp_path / "s.pt", hints={"num_heads": 4})[1]["family"] == "LightningDiT"


# ---- issue 40 items 10 and 11: release files of a size of their own ----------------------------------------------

def test_lightningdit_train_checkpoint_of_a_size_that_is_no_preset(tmp_path):
    """LightningDiT's train.py builds any model_type its models/lightningdit.py defines; a name that is no preset of
    ours was refused before any flag was read (dit/releases.py). Now the tensors (the RoPE table: the heads), the
    config's facts and, where the tensors are silent, --num-heads decide."""
    ema = build("LightningDiT", seed=1)
    config = {**LIGHTNING_CONFIG, "model": {**LIGHTNING_CONFIG["model"], "model_type": "LightningDiT-Tiny/2"}}
    path = tmp_path / "0010000.pt"
    torch.save({"model": ema.state_dict(), "ema": ema.state_dict(), "opt": {}, "config": config}, path)
    sd, info = dit.load_dit_weights(path)
    assert info["release"] == "LightningDiT" and info["model_config"] == ema.config  # heads from the RoPE table
    same_outputs(sd, info, ema)
    plain = build("LightningDiT", seed=2, rope=False)  # no RoPE table: the head count from the flag
    no_rope = {**config, "model": {**config["model"], "use_rope": False}}
    torch.save({"ema": plain.state_dict(), "config": no_rope}, path)
    with pytest.raises(WeightsError, match="number of attention heads is unknown; pass --num-heads"):
        dit.load_dit_weights(path)
    sd, info = dit.load_dit_weights(path, hints={"num_heads": 4})
    assert info["model_config"] == plain.config
    same_outputs(sd, info, plain)
    wrong = {**config, "model": {**config["model"], "use_swiglu": False}}  # the config's facts are still checked
    torch.save({"ema": ema.state_dict(), "config": wrong}, path)
    with pytest.raises(WeightsError, match="swiglu"):
        dit.load_dit_weights(path)


def test_ddt_lightning_file_of_a_custom_size_loads_with_its_sidecar(tmp_path):
    """A DDT Lightning checkpoint of a size of its own with the JSON sidecar its error asks for: the sidecar was read
    for bare state_dicts only (dit/weights.py), so the file stayed refused. Now its model_config decides (checked
    against the tensors) and the release's time convention stays; a sidecar that contradicts the tensors is an
    error."""
    import json

    ema = build("DDT", seed=1)
    path = tmp_path / "last.ckpt"
    state = {**{f"denoiser.{k}": v for k, v in ema.state_dict().items()},
             **{f"ema_denoiser.{k}": v for k, v in ema.state_dict().items()}}
    torch.save({"state_dict": state, "epoch": 1, "global_step": 10}, path)
    path.with_suffix(".json").write_text(json.dumps(dit.make_sidecar(ema.config, None, None)))
    sd, info = dit.load_dit_weights(path)
    assert (info["source"], info["release"], info["flow_convention"]) == ("ddt-train", "DDT", "sit")
    assert info["model_config"] == ema.config and info["sidecar"].endswith("last.json")
    same_outputs(sd, info, ema)
    path.with_suffix(".json").write_text(json.dumps(dit.make_sidecar({**ema.config, "hidden_size": 96}, None, None)))
    with pytest.raises(WeightsError, match="hidden_size=96"):
        dit.load_dit_weights(path)
