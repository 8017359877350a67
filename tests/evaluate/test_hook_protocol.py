"""FID during training samples as dit-sample does: a one-step model in one step by default (it took 250), and with
`dit-train --protocol NAME` on the release's grid, guidance and image conversion (dit/protocols.py)."""
from __future__ import annotations

from types import SimpleNamespace

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
    ctx = SimpleNamespace(model=model, ema=None, rank=0, world_size=1, model_config=dict(model.config),
                          config={"objective": objective}, num_classes=5, latent={"scaling_factor": 0.5},
                          device="cpu", step=2, run_dir=tmp_path, metrics=None)
    hook = FidHook(every=2, ref=str(tmp_path / "ref.npz"), vae=str(tiny_vae_dir), num_samples=4, batch_size=4,
                   seed=3, input_size=75, random_inception=0, sampler=FID_SAMPLER[objective], objective=objective, **kw)
    record = hook(ctx)
    assert np.isfinite(record["fid"])
    return record, seen


def test_a_one_step_model_takes_one_step(tmp_path, tiny_vae_dir, monkeypatch):
    from dit_pipeline.dit.family import create_model
    from dit_pipeline.dit.meanflow import MeanFlowLoop

    torch.manual_seed(0)
    model = create_model("DiT-S/2", input_size=8, depth=2, hidden_size=32, num_heads=2, in_channels=4,
                         num_classes=5, learn_sigma=False, conditions="meanflow").eval()
    record, seen = run_hook(tmp_path, tiny_vae_dir, monkeypatch, model, "meanflow")
    assert (record["fid_sampler"], record["fid_steps"]) == ("meanflow", 1)
    assert all(isinstance(d, MeanFlowLoop) and d.steps == 1 for d, _ in seen)


def test_a_protocol_samples_the_fid_as_the_release(tmp_path, tiny_vae_dir, monkeypatch):
    from dit_pipeline.dit.protocols import PROTOCOLS
    from dit_pipeline.evaluate.hook import FidSettings
    from dit_pipeline.sample.generate import FlowLoop
    from tests.dit.test_families import build

    model = build("DDT", seed=2)
    record, seen = run_hook(tmp_path, tiny_vae_dir, monkeypatch, model, "flow", protocol="ddt", steps=6)
    assert (record["fid_protocol"], record["fid_steps"], record["fid_cfg_scale"]) == ("ddt", 6, 2.0)
    want = PROTOCOLS["ddt"].with_overrides(count=6).times((4, 8, 8))
    assert all(isinstance(d, FlowLoop) and list(d.grid) == want and c == "ddt" for d, c in seen)
    problems = FidSettings(fid_every=5, fid_ref="r.npz", vae="v", protocol="rae-ag").fid_problems()
    assert problems == ["--protocol rae-ag guides with a second network, which FID during training does not load; "
                        "sample it with dit-sample --protocol rae-ag --guidance-model FILE"]
