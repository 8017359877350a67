"""Issue 47, bad cases 3, 4, 5 and 7: a dit-sample setting is checked against the record that says otherwise.

3. `--text-encoder` beside a checkpoint that records its encoder: another encoder is refused as a changed folder is,
   and the model's own one keeps the recorded max length (a long prompt ended in a traceback at 256 tokens).
4. `--guidance-model` with `--cfg-channels`: AutoGuidance guides every channel, so a channel count is refused and
   the records say "all" (they said 3, 1 or all for byte-identical samples).
5. `--guidance-model` where it does nothing (a MeanFlow model, `--cfg-scale 1`): refused with the reason.
7. An unconditional model (`--conditioning none`, recorded dropout 0.1): sampled without guidance by default (the
   default 4.0 ended in a traceback), an explicit scale refused in one line; `--protocol nanogen`, whose
   release samples class models, refused in one line naming the fit."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from dit_pipeline.common.errors import UserError
from dit_pipeline.dit.family import create_model
from dit_pipeline.sample import SampleConfig, run_sampling
from tests.captions._tiny import make_tiny_t5
from tests.sample.conftest import our_checkpoint, random_dit
from tests.sample.test_prompts import text_ckpt  # noqa: F401 (the fixture: a tiny text model and its Qwen3)

LONG = " ".join(["a photo of a cat sitting on a red sofa next to a dog running on the green grass"] * 4)


def test_another_text_encoder_is_refused_and_the_models_own_keeps_its_length(text_ckpt, tmp_path):  # noqa: F811
    path, vae_dir, qwen = text_ckpt
    t5 = make_tiny_t5(tmp_path / "t5")
    base = dict(ckpt=str(path), vae=str(vae_dir), sampler="euler", steps=2, quiet=True, npz=str(tmp_path / "s.npz"))
    with pytest.raises(UserError) as e:
        run_sampling(SampleConfig(**base, prompts=["a red sofa"], text_encoder=str(t5)))
    msg = str(e.value)
    assert msg.startswith(f"--text-encoder {t5} is not the text encoder {path} was trained with ({qwen}): family: "
                          "'decoder' recorded, 't5' now; class: 'Qwen3Model' recorded, 'T5EncoderModel' now;")
    assert msg.endswith(". Drop --text-encoder to use the recorded one, or pass that encoder")
    assert not (tmp_path / "s.npz").exists()
    # the model's own encoder, named: its recorded 16 tokens, not the default 256 (the model takes 16)
    run_sampling(SampleConfig(**base, prompts=[LONG], text_encoder=str(qwen)))
    record = json.loads((tmp_path / "s.npz.json").read_text())
    assert record["text_encoder"]["max_length"] == 16 and record["text_encoder"]["source"] == str(qwen)
    # the same samples as without --text-encoder (the recorded encoder, rebuilt)
    run_sampling(SampleConfig(**{**base, "npz": str(tmp_path / "r.npz")}, prompts=[LONG]))
    with np.load(tmp_path / "s.npz") as a, np.load(tmp_path / "r.npz") as b:
        assert np.array_equal(a["arr_0"], b["arr_0"])


@pytest.fixture(scope="module")
def flow_pair(tmp_path_factory):
    """A tiny flow DiT and a weaker one (AutoGuidance's guide), and a MeanFlow DiT, in our checkpoint format."""
    root = tmp_path_factory.mktemp("ag")
    main, weak = random_dit(6, learn_sigma=False), random_dit(7, learn_sigma=False, depth=1)
    paths = {k: root / f"{k}.pt" for k in ("main", "weak", "mf")}
    torch.save({**our_checkpoint(main, main), "objective": "flow"}, paths["main"])
    torch.save({**our_checkpoint(weak, weak), "objective": "flow"}, paths["weak"])
    mf = random_dit(5, conditions="meanflow")
    torch.save({**our_checkpoint(mf, mf), "objective": "meanflow"}, paths["mf"])
    return paths


def test_autoguidance_guides_every_channel_and_records_it(flow_pair, tiny_vae_dir, tmp_path, project_log):
    base = dict(ckpt=str(flow_pair["main"]), vae=str(tiny_vae_dir), guidance_model=str(flow_pair["weak"]),
                cfg_scale=1.5, sampler="euler", steps=2, num_samples=2, quiet=True)
    for channels in ("1", "3"):
        with pytest.raises(UserError) as e:
            run_sampling(SampleConfig(**base, cfg_channels=channels, npz=str(tmp_path / "c.npz")))
        assert str(e.value) == (f"--cfg-channels {channels}: AutoGuidance (--guidance-model) guides every latent "
                                "channel; drop --cfg-channels")
    assert not (tmp_path / "c.npz").exists()
    for channels in ("auto", "all"):
        run_sampling(SampleConfig(**base, cfg_channels=channels, npz=str(tmp_path / f"{channels}.npz")))
        record = json.loads((tmp_path / f"{channels}.npz.json").read_text())
        assert record["fingerprint"]["cfg_channels"] == "all" and record["config"]["cfg_channels"] == "all"
        assert record["protocol"]["guidance"]["channels"] == "all"
    assert not [m for m in project_log if "guiding the first 3" in m]


def test_a_guidance_model_that_does_nothing_is_refused(flow_pair, tiny_vae_dir, tmp_path):
    base = dict(vae=str(tiny_vae_dir), guidance_model=str(flow_pair["weak"]), num_samples=2, quiet=True,
                npz=str(tmp_path / "s.npz"))
    with pytest.raises(UserError) as e:
        run_sampling(SampleConfig(ckpt=str(flow_pair["main"]), **base, cfg_scale=1.0, sampler="euler", steps=2))
    assert str(e.value) == (f"--guidance-model {flow_pair['weak']} does nothing here: AutoGuidance at scale 1 is the "
                            "model alone (v_weak + 1 (v - v_weak) = v); drop --guidance-model or pass --cfg-scale > 1")
    with pytest.raises(UserError) as e:
        run_sampling(SampleConfig(ckpt=str(flow_pair["mf"]), **base, steps=1))
    assert str(e.value) == (f"--guidance-model {flow_pair['weak']} does nothing here: a MeanFlow model trains its "
                            "guidance in (omega, kappa of its training); its sampler takes none; drop --guidance-model")
    assert not (tmp_path / "s.npz").exists()


@pytest.fixture(scope="module")
def unconditional_ckpt(tmp_path_factory):
    """A tiny unconditional in-context DiT-DH (dit-train --conditioning none records class_dropout_prob 0.1)."""
    torch.manual_seed(0)
    model = create_model("ddt-en28d1152hd72-dn2d2048hd128", input_size=4, depth=1, hidden_size=32, num_heads=2,
                         head_depth=1, head_hidden_size=32, head_num_heads=2, conditioning="none")
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.copy_(0.3 * torch.randn_like(p))
    assert model.config["class_dropout_prob"] == 0.1 and model.config["conditioning"] == "none"
    path = tmp_path_factory.mktemp("uncond") / "uncond.pt"
    torch.save({**our_checkpoint(model, model), "objective": "flow"}, path)
    return path


def test_an_unconditional_model_samples_unguided_and_refuses_a_scale(unconditional_ckpt, tiny_vae_dir, tmp_path):
    base = dict(ckpt=str(unconditional_ckpt), vae=str(tiny_vae_dir), num_samples=2, steps=2, quiet=True)
    why = "the model is unconditional (trained with --conditioning none), so it has no null condition to guide against"
    with pytest.raises(UserError) as e:
        run_sampling(SampleConfig(**base, cfg_scale=4.0, sampler="euler", npz=str(tmp_path / "x.npz")))
    assert str(e.value) == f"--cfg-scale 4 does nothing here: {why}; drop --cfg-scale (or pass 1)"
    assert not (tmp_path / "x.npz").exists()
    run_sampling(SampleConfig(**base, sampler="euler", npz=str(tmp_path / "s.npz")))
    record = json.loads((tmp_path / "s.npz.json").read_text())
    assert record["fingerprint"]["cfg_scale"] == 1.0 and record["protocol"]["guidance"]["rule"] == "none"
    # a release's protocol samples the models its release trains (dit/protocol_fit.py): NanoGen's, class models; an
    # unconditional one is refused in one line before anything is written (it was a traceback)
    with pytest.raises(UserError) as e:
        run_sampling(SampleConfig(**base, protocol="nanogen", npz=str(tmp_path / "n.npz")))
    assert str(e.value).startswith("--protocol nanogen applies to class-conditional flow models on latents; this is "
                                   "an unconditional flow model") and "conditioning none (the protocol's: class)" in \
        str(e.value)
    assert not (tmp_path / "n.npz").exists()
