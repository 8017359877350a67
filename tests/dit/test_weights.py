"""Safe weight loading: every accepted format round-trips; unsafe or mismatching files are refused."""
from __future__ import annotations

import argparse
import json
import os
import re

import pytest
import torch
from safetensors.torch import save_file

from dit_pipeline import dit
from dit_pipeline.dit.weights import WeightsError
from tests.dit._reference import tiny_model


class Payload:
    """An arbitrary pickled object; loading must refuse it."""


class Exploit:
    """Unpickling this would create a file; weights_only must never run it."""

    def __init__(self, target: str):
        self.target = target

    def __reduce__(self):
        return (os.mkdir, (self.target,))


@pytest.fixture(scope="module")
def s8():
    """A real preset (DiT-S/8) at a small latent size: 16x16 latents, 10 classes."""
    torch.manual_seed(0)
    model = dit.create_model("DiT-S/8", input_size=16, num_classes=10).eval()
    with torch.no_grad():
        model.final_layer.linear.weight.normal_(0, 0.02)  # a non-zero output to compare
    return model


def outputs(model, n=2):
    g = torch.Generator().manual_seed(0)
    size = model.config["input_size"]
    x = torch.randn(n, 4, size, size, generator=g)
    with torch.no_grad():
        return model.eval()(x, torch.tensor([3, 700][:n]), torch.tensor([1, 2][:n]))


def test_official_bare_state_dict_round_trip(tmp_path, s8):
    path = tmp_path / "DiT-S-8-128.pt"
    torch.save(s8.state_dict(), path)
    sd, info = dit.load_dit_weights(path)
    assert info["source"] == "official" and info["weights"] == "state_dict" and info["preset"] == "DiT-S/8"
    assert info["model_config"] == {**s8.config}
    model = dit.build_model_from_weights(sd, info)
    assert torch.equal(outputs(model), outputs(s8)) and outputs(s8).abs().max() > 0


def test_reference_training_checkpoint_with_namespace_loads(tmp_path, s8):
    other = {k: v + 1 if k != "pos_embed" else v for k, v in s8.state_dict().items()}
    args = argparse.Namespace(model="DiT-S/8", image_size=128, num_classes=10, data_path="/data",
                              global_batch_size=256, vae="ema", global_seed=0)
    ckpt = {"model": {f"module.{k}": v for k, v in other.items()}, "ema": s8.state_dict(),
            "opt": {"state": {}, "param_groups": [{"lr": 1e-4, "params": [0, 1]}]}, "args": args}
    path = tmp_path / "0100000.pt"
    torch.save(ckpt, path)
    with pytest.raises(Exception):  # the whole point: plain weights_only refuses the Namespace
        torch.load(path, weights_only=True)
    sd, info = dit.load_dit_weights(path)
    assert info["source"] == "reference-train" and info["weights"] == "ema"
    assert info["args"]["model"] == "DiT-S/8" and info["args"]["global_batch_size"] == 256
    assert torch.equal(outputs(dit.build_model_from_weights(sd, info)), outputs(s8))
    sd_model, info_model = dit.load_dit_weights(path, prefer="model")
    assert info_model["weights"] == "model"
    assert torch.equal(sd_model["blocks.0.attn.qkv.weight"], other["blocks.0.attn.qkv.weight"])


def own_checkpoint(model, ema):
    return {"format": "dit-pipeline.checkpoint", "version": 1, "model": model.state_dict(),
            "ema": ema.state_dict(), "opt": {}, "scaler": None, "step": 1000, "epoch": 2, "data": {"pos": 3},
            "rng": {"torch": torch.get_rng_state()}, "model_config": model.config,
            "latent": {"scaling_factor": 0.18215, "shift_factor": None, "vae": {"name": "sd-vae-ft-ema"}},
            "config": {"lr": 1e-4}, "manifest_fingerprint": "abc"}


def test_own_checkpoint_picks_ema_and_carries_config(tmp_path):
    model, ema = tiny_model(seed=1), tiny_model(seed=2)  # a custom size: heads come from model_config
    path = tmp_path / "step-0001000.pt"
    torch.save(own_checkpoint(model, ema), path)
    sd, info = dit.load_dit_weights(path)
    assert info["source"] == "dit-pipeline" and info["weights"] == "ema" and info["step"] == 1000
    assert info["latent"]["scaling_factor"] == 0.18215 and info["model_config"] == ema.config
    assert info["preset"] is None
    assert torch.equal(outputs(dit.build_model_from_weights(sd, info)), outputs(ema))
    sd, info = dit.load_dit_weights(path, prefer="model")
    assert torch.equal(outputs(dit.build_model_from_weights(sd, info)), outputs(model))
    with pytest.raises(ValueError, match="prefer must be"):
        dit.load_dit_weights(path, prefer="best")


def test_safetensors_and_wrapper_prefixes(tmp_path):
    model = tiny_model(seed=3)
    path = tmp_path / "w.safetensors"
    save_file({f"_orig_mod.{k}": v.contiguous() for k, v in model.state_dict().items()}, str(path),
              metadata={"model_config": json.dumps(model.config)})
    sd, info = dit.load_dit_weights(path)
    assert info["source"] == "safetensors" and all(not k.startswith("_orig") for k in sd)
    assert torch.equal(outputs(dit.build_model_from_weights(sd, info)), outputs(model))
    path2 = tmp_path / "w.pt"
    torch.save({f"module._orig_mod.{k}": v for k, v in model.state_dict().items()}, path2)
    with pytest.raises(WeightsError, match="number of attention heads is unknown"):
        dit.load_dit_weights(path2)  # custom width, no model_config: heads cannot be inferred


def test_pickled_objects_are_refused_and_never_run(tmp_path, s8):
    path = tmp_path / "bad.pt"
    torch.save({"ema": s8.state_dict(), "args": Payload()}, path)
    with pytest.raises(WeightsError, match=r"refusing to load .*bad.pt: it contains a pickled "
                                           r"tests.dit.test_weights.Payload"):
        dit.load_dit_weights(path)
    target = tmp_path / "pwned"
    torch.save({"model": {"x": torch.zeros(1)}, "args": Exploit(str(target))}, path)
    with pytest.raises(WeightsError, match="pickled posix.mkdir"):
        dit.load_dit_weights(path)
    assert not target.exists()


def test_corrupt_and_mismatching_files_are_refused(tmp_path):
    model = tiny_model(seed=5)
    good = tmp_path / "good.pt"
    torch.save(own_checkpoint(model, model), good)
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    garbage, empty = tmp_path / "garbage.pt", tmp_path / "empty.pt"
    garbage.write_bytes(b"not a checkpoint at all")
    empty.write_bytes(b"")
    for path in (truncated, garbage, empty):
        with pytest.raises(WeightsError, match=f"cannot read {path}"):
            dit.load_dit_weights(path)
    with pytest.raises(WeightsError, match="does not exist"):
        dit.load_dit_weights(tmp_path / "missing.pt")
    sd = model.state_dict()
    cases = {
        "missing": ({k: v for k, v in sd.items() if k != "blocks.1.mlp.fc1.bias"},
                    r"missing \['blocks.1.mlp.fc1.bias'\]"),
        "extra": ({**sd, "blocks.0.attn.extra": torch.zeros(1)}, r"unexpected \['blocks.0.attn.extra'\]"),
        "shape": ({**sd, "blocks.1.attn.qkv.bias": torch.zeros(7)},
                  r"shape mismatch \['blocks.1.attn.qkv.bias: \[7\] vs \[96\]'\]"),
        "nan": ({**sd, "blocks.1.attn.proj.weight": torch.full((32, 32), float("nan"))},
                r"non-finite.*blocks.1.attn.proj.weight"),
        "pos": ({**sd, "pos_embed": sd["pos_embed"].flip(1)}, "not DiT's fixed 2-D sin-cos"),
        "no_dit": ({"weight": torch.zeros(2)}, "not a DiT state_dict"),
        "sigma": ({**sd, "final_layer.linear.weight": torch.zeros(5, 32)}, "has 5 outputs"),
    }
    for name, (bad, msg) in cases.items():
        path = tmp_path / f"{name}.pt"
        torch.save({**own_checkpoint(model, model), "ema": bad}, path)
        with pytest.raises(WeightsError, match=msg):
            dit.load_dit_weights(path)
    sd, info = dit.load_dit_weights(good)
    other = tiny_model(input_size=16)
    with pytest.raises(WeightsError, match="shape mismatch.*pos_embed"):
        dit.build_model_from_weights(other.state_dict(), info)
    for junk in ([1, 2], {"step": 3}):
        torch.save(junk, tmp_path / "junk.pt")
        with pytest.raises(WeightsError, match="junk.pt"):
            dit.load_dit_weights(tmp_path / "junk.pt")


def test_stored_config_that_contradicts_the_weights_is_refused(tmp_path):
    model = tiny_model(seed=1)
    ckpt = own_checkpoint(model, model)
    ckpt["model_config"] = {**model.config, "input_size": 16}
    path = tmp_path / "c.pt"
    torch.save(ckpt, path)
    with pytest.raises(WeightsError, match="model_config says input_size=16 but the weights have "
                                           "input_size=8"):
        dit.load_dit_weights(path)
    ckpt["model_config"], ckpt["version"] = model.config, 2
    torch.save(ckpt, path)
    with pytest.raises(WeightsError, match="version 2"):
        dit.load_dit_weights(path)


def test_bare_state_dict_of_a_custom_size_loads_through_its_sidecar(tmp_path):
    model = tiny_model(seed=1, depth=4, hidden_size=64, num_heads=8)  # no preset: 8 heads are not in the shapes
    path = tmp_path / "step-0000010-ema.pt"
    torch.save(model.state_dict(), path)
    with pytest.raises(WeightsError, match="no DiT preset and the file has no model_config"):
        dit.load_dit_weights(path)
    latent = {"scaling_factor": 0.5, "shift_factor": None, "vae": {"source": "tiny"}}
    (tmp_path / "step-0000010-ema.json").write_text(json.dumps(dit.make_sidecar(model.config, latent, 10)))
    assert dit.sidecar_path(path) == tmp_path / "step-0000010-ema.json"
    sd, info = dit.load_dit_weights(path)
    assert info["source"] == "dit-pipeline" and info["weights"] == "ema" and info["step"] == 10
    assert info["model_config"] == model.config and info["latent"] == latent
    assert info["sidecar"] == str(tmp_path / "step-0000010-ema.json")
    assert torch.equal(outputs(dit.build_model_from_weights(sd, info)), outputs(model))
    # with the head count of another layout the output would differ: the sidecar decides it
    wrong = dit.build_model_from_weights(sd, {**info, "model_config": {**model.config, "num_heads": 4}})
    assert not torch.allclose(outputs(wrong), outputs(model))


@pytest.mark.parametrize("content,problem", [
    ({"depth": 3}, "with its sidecar step-0000010-ema.json: model_config says depth=3 but the weights have depth=2"),
    ({"num_heads": 5}, "with its sidecar step-0000010-ema.json: invalid DiT configuration: hidden_size 32 is not "
                       "divisible by num_heads 5"),
    ({"num_classes": 7}, "label table has 6 rows but the stored config says 7 classes"),
    ("{not json", "step-0000010-ema.json, the sidecar of step-0000010-ema.pt, is unreadable"),
    ({"format": "something else"}, "is not a weights sidecar"),
    ({"version": 9}, "sidecar version 9"),
])
def test_sidecar_that_contradicts_the_tensors_or_is_broken_is_refused(tmp_path, content, problem):
    model = tiny_model(seed=1)
    path = tmp_path / "step-0000010-ema.pt"
    torch.save(model.state_dict(), path)
    side = dit.make_sidecar(model.config, None, 10)
    if isinstance(content, dict) and not {"format", "version"} & set(content):
        side["model_config"].update(content)
    elif isinstance(content, dict):
        side.update(content)
    (tmp_path / "step-0000010-ema.json").write_text(content if isinstance(content, str) else json.dumps(side))
    with pytest.raises(WeightsError, match=re.escape(problem)):
        dit.load_dit_weights(path)
