"""dit-sample for a text-conditional model: --prompt (repeatable) and --prompts FILE (one per line, or JSON Lines with
GenEval's metadata), the text encoder rebuilt from the checkpoint's record (common/text_encoders.py from_identity; a
tiny random Qwen3 saved with save_pretrained), guidance against the empty prompt's features as a two-pass formula computes it,
the npz's arr_1 and the record naming every sample's prompt, the grid labelled with the wrapped prompts, and the
mistakes refused with their messages."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from dit_pipeline.common.errors import ConfigError, UserError
from dit_pipeline.dit.family import create_model
from dit_pipeline.sample import SampleConfig
from dit_pipeline.sample.generate import FlowLoop, generate_images
from dit_pipeline.sample.load import load_model
from dit_pipeline.sample.prompts import grid_text, prompt_ids
from dit_pipeline.sample.run import run_sampling
from dit_pipeline.common.vae import load_vae
from tests._util import make_tiny_vae
from tests.captions._tiny import make_tiny_qwen3
from tests.sample.conftest import our_checkpoint

DIM = 32  # the tiny Qwen3's width


@pytest.fixture(scope="module")
def text_ckpt(tmp_path_factory):
    """A tiny text-conditional DiT-DH-IC (4x4x4 latents) with random weights, in our checkpoint format with the
    record of its text encoder (a tiny random Qwen3 saved with save_pretrained: the real loading code runs); the
    tiny VAE; the encoder's folder."""
    from dit_pipeline.common.text_encoders import load_text_encoder

    root = tmp_path_factory.mktemp("t2i")
    qwen = make_tiny_qwen3(root / "qwen3")
    identity = load_text_encoder(str(qwen), max_length=16).identity
    torch.manual_seed(0)
    model = create_model("ddt-en28d1152hd72-dn2d2048hd128", input_size=4, depth=1, hidden_size=32, num_heads=2,
                         head_depth=1, head_hidden_size=32, head_num_heads=2, conditioning="text", text_dim=DIM,
                         num_c_tokens=16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad:
                p.copy_(0.3 * torch.randn_like(p))
    ckpt = our_checkpoint(model, model)
    ckpt.update(objective="flow", text={"encoder": identity, "features": "cached", "null_text": torch.zeros(0, DIM),
                                        "null_mask": torch.zeros(0, dtype=torch.bool)})
    path = root / "t2i.pt"
    torch.save(ckpt, path)
    return path, make_tiny_vae(root / "vae"), qwen


def test_prompt_ids_and_grid_labels():
    assert prompt_ids(2, 6).tolist() == [0, 0, 0, 1, 1, 1]
    assert grid_text("a photo of a cat and a dog on a red sofa in a sunny room") == \
        "a photo of a cat and a dog\non a red sofa in a sunny\nroom"
    with pytest.raises(ValueError, match="5 samples cannot be split evenly over 2 prompts"):
        prompt_ids(2, 5)


def test_sampling_config_refuses_mixed_conditions():
    base = {"ckpt": "m.pt", "npz": "s.npz"}
    with pytest.raises(ConfigError) as e:
        SampleConfig(**base, prompts=["a", "b"], class_labels=[1], num_samples=3, labels="equal").validate()
    msg = str(e.value)
    assert "--class-labels is for class-conditional models, --prompt / --prompts for text models" in msg
    assert "--num-samples 3 is not a multiple of the 2 prompts" in msg and "--labels equal chooses classes" in msg
    with pytest.raises(ConfigError, match="--prompt and --prompts FILE both give the prompts"):
        SampleConfig(**base, prompts=["a"], prompts_file="p.txt").validate()


def test_prompts_sample_with_guidance_against_the_empty_prompt(text_ckpt, tmp_path):
    from dit_pipeline.common.text_encoders import load_text_encoder

    path, vae_dir, qwen = text_ckpt
    prompts = tmp_path / "geneval.jsonl"
    prompts.write_text(json.dumps({"tag": "color", "prompt": "a photo of a red sofa"}) + "\n"
                       + json.dumps({"tag": "counting", "prompt": "two dogs running in the park"}) + "\n")
    out = tmp_path / "out"
    result = run_sampling(SampleConfig(ckpt=str(path), vae=str(vae_dir), prompts_file=str(prompts), num_samples=4,
                                       cfg_scale=3.0, cfg_channels="all", sampler="euler", steps=3,
                                       npz=str(tmp_path / "s.npz"), out=str(out), quiet=True))
    data = np.load(tmp_path / "s.npz")
    assert data["arr_1"].tolist() == [0, 0, 1, 1]  # each sample's prompt
    record = json.loads((out / "samples.json").read_text())
    # one prompt record per sample, in the samples' order, as dit-eval --t2i reads them back
    assert record["prompts"] == [{"tag": "color", "prompt": "a photo of a red sofa"}] * 2 + \
        [{"tag": "counting", "prompt": "two dogs running in the park"}] * 2
    assert record["config"]["prompts"] == ["a photo of a red sofa", "two dogs running in the park"]
    assert record["fingerprint"]["text_encoder"]["source"] == str(qwen) and record["fingerprint"]["prompts_sha256"]
    assert result.grid is not None and result.grid.is_file()
    from types import SimpleNamespace

    from dit_pipeline.evaluate.t2i import sample_prompts  # dit-eval --t2i reads the same prompts back
    got, origin = sample_prompts(SimpleNamespace(path=tmp_path / "s.npz", kind="npz", count=4), None)
    assert got == record["prompts"] and origin == str(tmp_path / "s.npz.json")

    loaded, vae = load_model(path), load_vae(str(vae_dir))[0]
    model, enc = loaded.model, load_text_encoder(str(qwen), max_length=16)  # the recorded encoder, built anew
    cond = enc.encode(["a photo of a red sofa"] * 2 + ["two dogs running in the park"] * 2).as_batch()
    null = enc.null().as_batch()  # the empty prompt: no token for Qwen3's tokenizer
    assert null[0].shape == (1, 0, DIM)

    def formula(x, t, **kw):  # NanoGen: uncond with the empty prompt's features, then uncond + s (cond - uncond)
        c = model(x, t, text=kw["text"], text_mask=kw["text_mask"])
        u = model(x, t, text=null[0].expand(x.shape[0], -1, -1), text_mask=null[1].expand(x.shape[0], -1))
        return (u + 3.0 * (c - u)).float()

    want = generate_images(model, vae, FlowLoop("euler", 3), indices=range(4), labels=[0] * 4, seed=0,
                           scaling_factor=0.5, model_fn=formula, condition={"text": cond[0], "text_mask": cond[1]})
    assert np.abs(data["arr_0"].astype(int) - want.numpy().astype(int)).max() <= 1
    assert np.abs(data["arr_0"][0].astype(int) - data["arr_0"][2].astype(int)).max() > 1  # the prompt matters


def test_text_models_refuse_class_labels_and_need_an_encoder(text_ckpt, tmp_path):
    path, vae_dir, qwen = text_ckpt
    base = dict(ckpt=str(path), vae=str(vae_dir), npz=str(tmp_path / "x.npz"), sampler="euler", steps=2, quiet=True)
    with pytest.raises(UserError, match="is a text-conditional model: pass --prompt TEXT"):
        run_sampling(SampleConfig(**base, class_labels=[1, 2]))
    raw = torch.load(path, weights_only=True)
    del raw["text"]
    bare = tmp_path / "release.pt"
    torch.save(raw, bare)
    with pytest.raises(UserError, match="records no text encoder .* pass --text-encoder"):
        run_sampling(SampleConfig(**{**base, "ckpt": str(bare)}, prompts=["a bus"]))
    assert not (tmp_path / "x.npz").exists()
    run_sampling(SampleConfig(**{**base, "ckpt": str(bare)}, prompts=["a bus"], text_encoder=str(qwen)))
    record = json.loads((tmp_path / "x.npz.json").read_text())
    assert record["text_encoder"]["source"] == str(qwen) and (tmp_path / "x.npz").is_file()


def test_nanogens_t2i_protocol_is_its_sampler(text_ckpt, tmp_path):
    """dit-sample --protocol nanogen-t2i against NanoGen's loop written out (End2End-Diffusion/diffusion-bench
    src/stage2/transport/sampler.py l.10-34: t = linspace(1, 0, num_steps + 1), shifted by sqrt(C H W / 4096), NanoGen's
    t = noise level, x = x - h drift; src/eval/generation.py l.136-147: guidance against the encoder's features of
    the empty prompt at every step (t_max 1.0), l.167-168: [0, 1], mul(255), truncated), on our tiny text model
    called in its own time (t_ours = 1 - t, velocity negated)."""
    import math

    from dit_pipeline.common.text_encoders import load_text_encoder
    from tests.sample.test_protocols_sample import decode, nanogen_pixels, noise_of

    path, vae_dir, qwen = text_ckpt
    npz = tmp_path / "p.npz"
    run_sampling(SampleConfig(ckpt=str(path), vae=str(vae_dir), prompts=["a red sofa", "two dogs"], num_samples=2,
                              protocol="nanogen-t2i", steps=3, npz=str(npz), quiet=True, batch_size=2))
    model, vae = load_model(path).model, load_vae(str(vae_dir))[0]
    enc = load_text_encoder(str(qwen), max_length=16)
    cond, null = enc.encode(["a red sofa", "two dogs"]).as_batch(), enc.null().as_batch()
    s = math.sqrt(4 * 4 * 4 / 4096)
    grid = torch.linspace(1.0, 0.0, 4)
    grid = s * grid / (1 + (s - 1) * grid)
    x, _ = noise_of(0, 2, (4, 4, 4))
    with torch.no_grad():
        for i in range(3):
            h, tb = grid[i] - grid[i + 1], torch.full((2,), grid[i].item())
            c = -model(x, 1 - tb, text=cond[0], text_mask=cond[1])
            u = -model(x, 1 - tb, text=null[0].expand(2, -1, -1), text_mask=null[1].expand(2, -1))
            x = x - h * (u + 6.0 * (c - u))
    with np.load(npz) as z:
        got = z["arr_0"].astype(int)
    want = nanogen_pixels(decode(vae, x, scale=load_model(path).latent["scaling_factor"]))
    assert np.abs(got - want).max() <= 1 and (got == want).mean() > 0.99
    record = json.loads((tmp_path / "p.npz.json").read_text())
    assert record["protocol"]["name"] == "nanogen-t2i" and record["protocol"]["overrides"] == ["steps 3"]
