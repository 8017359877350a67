"""FID during training samples as dit-sample does: a one-step model in one step by default (it took 250), and with
`dit-train --protocol NAME` on the release's grid, guidance and image conversion (dit/protocols.py)."""
from __future__ import annotations

from dit_pipeline.common.hooks import HookContext
import json
import numpy as np
import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny networks: one intra-op thread is several times faster on the shared 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def run_hook(tmp_path, tiny_vae_dir, monkeypatch, model, objective, **kw):
    from dit_pipeline.evaluate import hook as hook_module
    from dit_pipeline.evaluate.hook import FidHook
    from dit_pipeline.sample.config import FID_SAMPLER

    np.savez(tmp_path / "ref.npz", arr_0=np.random.default_rng(0).integers(0, 256, (6, 64, 64, 3), dtype=np.uint8))
    seen: list = []
    real = hook_module.generate_images

    def recording(model, vae, diffusion, **k):
        seen.append((diffusion, k["conversion"]))
        return real(model, vae, diffusion, **k)

    monkeypatch.setattr(hook_module, "generate_images", recording)
    ctx = HookContext(epoch=0, model=model, ema=None, rank=0, world_size=1, model_config=dict(model.config),
                      config={"objective": objective}, num_classes=5, latent={"scaling_factor": 0.5}, device="cpu",
                      step=2, run_dir=tmp_path, metrics=None)
    hook = FidHook(every=2, ref=str(tmp_path / "ref.npz"), vae=str(tiny_vae_dir), num_samples=4, batch_size=4,
                   seed=3, input_size=75, random_inception=0, sampler=FID_SAMPLER[objective], objective=objective, **kw)
    record = hook(ctx)
    assert np.isfinite(record["fd_rand"])  # a random Inception's number, never stored as fid
    return record, seen


def test_a_one_step_model_takes_one_step(tmp_path, tiny_vae_dir, monkeypatch):
    from dit_pipeline.dit.family import create_model
    from dit_pipeline.dit.meanflow import MeanFlowLoop

    torch.manual_seed(0)
    model = create_model("DiT-S/2", input_size=8, depth=2, hidden_size=32, num_heads=2, in_channels=4,
                         num_classes=5, learn_sigma=False, conditions="meanflow").eval()
    record, seen = run_hook(tmp_path, tiny_vae_dir, monkeypatch, model, "meanflow")
    sampling = record["fid_run"]["sampling"]  # the sampling protocol's record: the one record of what ran
    assert (sampling["name"], sampling["solver"], sampling["count"]) == ("custom", "meanflow", 1)
    assert sampling["guidance"]["scale"] == 1.0 and record["fid_run"]["guidance"] == \
        "none at sampling (MeanFlow trains its guidance in)"
    assert all(isinstance(d, MeanFlowLoop) and d.steps == 1 for d, _ in seen)
    assert not {"fid_sampler", "fid_steps", "fid_cfg_scale", "fid_protocol"} & set(record)  # no second record


def test_a_protocol_samples_the_fid_as_the_release(tmp_path, tiny_vae_dir, monkeypatch):
    from dit_pipeline.dit.protocols import PROTOCOLS
    from dit_pipeline.evaluate.hook import FidSettings
    from dit_pipeline.sample.generate import FlowLoop
    from dit_pipeline.train.report import build_report
    from tests.dit.test_families import build

    model = build("DDT", seed=2)
    record, seen = run_hook(tmp_path, tiny_vae_dir, monkeypatch, model, "flow", protocol="ddt", steps=6,
                            labels="equal")
    run = record["fid_run"]
    want_record = PROTOCOLS["ddt"].with_overrides(count=6).record((4, 8, 8), 1.0)
    assert json.loads(json.dumps(run["sampling"])) == json.loads(json.dumps(want_record))  # as dit-sample's
    assert (run["sampling"]["name"], run["sampling"]["count"], run["sampling"]["guidance"]["scale"],
            run["sampling"]["overrides"]) == ("ddt", 6, 2.0, ["steps 6"])
    assert run["guidance"] == "2 on all channel(s) where the noise level is in (0, 0.7)" and run["protocol"] == "adm"
    assert run["dit_sample_args"][run["dit_sample_args"].index("--protocol"):][:6] == \
        ["--protocol", "ddt", "--steps", "6", "--cfg-scale", "2"]
    want = PROTOCOLS["ddt"].with_overrides(count=6).times((4, 8, 8))
    assert all(isinstance(d, FlowLoop) and list(d.grid) == want and c == "ddt" for d, c in seen)
    # dit-report names the sampling protocol, from that record
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text(json.dumps(record) + "\n")
    md = build_report(tmp_path / "run", "report.png")
    assert ("by the ddt protocol (MCG-NJU/DDT): euler in 6 steps, changed: steps 6, guidance 2 on all channel(s) "
            "where the noise level is in (0, 0.7), classes equal, images by the 'ddt' conversion, seed 3") in md
    problems = FidSettings(fid_every=5, fid_ref="r.npz", vae="v", protocol="rae-ag").fid_problems()
    assert problems == ["--protocol rae-ag guides with a second network, which FID during training does not load; "
                        "sample it with dit-sample --protocol rae-ag --guidance-model FILE"]


def test_guidance_the_model_cannot_take_is_recorded_as_not_applied(tmp_path, tiny_vae_dir, monkeypatch):
    """A hook asked for guidance 1.5 on a model trained without label dropout samples without it, and its record
    says so with the reason (issue 41, item 1), in the protocol record too (scale 1, the override named)."""
    from dit_pipeline.dit.family import create_model

    torch.manual_seed(0)
    model = create_model("DiT-S/2", input_size=8, depth=2, hidden_size=32, num_heads=2, in_channels=4,
                         num_classes=5, learn_sigma=False, class_dropout_prob=0.0).eval()
    record, _ = run_hook(tmp_path, tiny_vae_dir, monkeypatch, model, "ddpm", steps=2, cfg_scale=1.5)
    run = record["fid_run"]
    assert (run["guidance"], run["cfg_scale_asked"], run["sampling"]["guidance"]["scale"]) == ("none (1.0)", 1.5, 1.0)
    assert run["guidance_note"] == ("--fid-cfg-scale 1.5 asked; not applied: the model has no null class (trained "
                                    "without class dropout), so classifier-free guidance is impossible")
    assert "--cfg-channels" not in run["dit_sample_args"] and \
        run["dit_sample_args"][run["dit_sample_args"].index("--sampler"):][:6] == \
        ["--sampler", "ddpm", "--steps", "2", "--cfg-scale", "1"]
