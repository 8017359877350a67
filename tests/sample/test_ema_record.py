"""The trainer's EMA file carries its record (issue #34, defect 3): a flow (SiT) run's step-N-ema.pt copied without
its .json sidecar was read as an official DiT file and sampled with DDPM, exit 0. The record (objective, latent
normalization, model config, time shift: the sidecar's content) now sits inside the file, in the state_dict's
`_metadata`, which the official loaders ignore; a bare file with no record anywhere is refused naming the sidecar
and the flags that replace it."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from dit_pipeline import dit
from dit_pipeline.common.errors import UserError
from dit_pipeline.sample import SampleConfig, run_sampling
from dit_pipeline.train.checkpoint import FORMAT, VERSION, CheckpointManager
from tests.sample.conftest import LATENT, random_dit

STEP = 4


@pytest.fixture(scope="module")
def flow_run(tmp_path_factory):
    """A flow model's checkpoint folder as the trainer writes it, and its EMA file copied alone."""
    root = tmp_path_factory.mktemp("flow-run")
    model = random_dit(7, learn_sigma=False)
    sd = model.state_dict()
    CheckpointManager(root / "checkpoints").save({
        "format": FORMAT, "version": VERSION, "model": sd, "ema": sd, "opt": {}, "scaler": None, "step": STEP,
        "epoch": 0, "data": {}, "rng": {}, "model_config": dict(model.config), "latent": dict(LATENT),
        "objective": "flow", "time_shift": 2.0, "config": {"seed": 0}, "manifest_fingerprint": "0" * 64})
    alone = root / "copied" / f"step-{STEP:07d}-ema.pt"
    alone.parent.mkdir()
    shutil.copy(root / "checkpoints" / alone.name, alone)
    assert not dit.sidecar_path(alone).exists()
    return model, alone


def test_the_ema_file_alone_holds_its_record(flow_run):
    model, alone = flow_run
    sd, info = dit.load_dit_weights(alone)
    assert (info["source"], info["record_from"], info["objective"], info["time_shift"], info["step"]) == \
        ("dit-pipeline", "embedded", "flow", 2.0, STEP)
    assert info["latent"] == LATENT and info["model_config"] == model.config
    assert (info["flow_convention"], info["flow_convention_from"]) == ("sit", "recorded")


def test_the_official_loaders_still_read_it(flow_run):
    """DiT's sample.py: torch.load (weights_only, torch >= 2.6's default) then load_state_dict(strict=True)."""
    model, alone = flow_run
    loaded = torch.load(alone, map_location=lambda storage, loc: storage)
    assert "ema" not in loaded and set(loaded) == set(model.state_dict())  # the record is no key
    fresh = random_dit(8, learn_sigma=False)
    assert not fresh.load_state_dict(loaded, strict=True).missing_keys
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))


def test_dit_sample_samples_the_copied_file_as_the_flow_model_it_is(flow_run, tiny_vae_dir, tmp_path):
    _, alone = flow_run
    run_sampling(SampleConfig(ckpt=str(alone), vae=str(tiny_vae_dir), num_samples=2, steps=3, cfg_scale=1.0,
                              npz=str(tmp_path / "s.npz"), quiet=True))
    fp = json.loads((tmp_path / "s.npz.json").read_text())["fingerprint"]
    assert (fp["objective"], fp["sampler"], fp["time_shift"]) == ("flow", "euler-maruyama", 2.0)


def test_a_bare_file_without_any_record_is_refused(tiny_vae_dir, tmp_path):
    """An EMA file written before the record existed, copied without its sidecar: never guessed as DDPM."""
    s8 = random_dit(3, name="DiT-S/8", input_size=8, std=0.05, tiny=False, learn_sigma=False)  # a preset's size
    old = tmp_path / f"step-{STEP:07d}-ema.pt"
    torch.save({k: v.to(torch.bfloat16) for k, v in s8.state_dict().items()}, old)
    cfg = dict(ckpt=str(old), vae=str(tiny_vae_dir), num_samples=2, steps=3, cfg_scale=1.0, quiet=True)
    with pytest.raises(UserError) as e:
        run_sampling(SampleConfig(**cfg, npz=str(tmp_path / "a.npz")))
    msg = str(e.value)
    assert "\n" not in msg and f"no sidecar step-{STEP:07d}-ema.json beside it" in msg
    assert "--objective ddpm|flow" in msg and "--flow-convention" in msg and "--time-shift" in msg
    assert not (tmp_path / "a.npz").exists()
    run_sampling(SampleConfig(**cfg, objective="flow", npz=str(tmp_path / "b.npz")))  # the flag replaces it
    assert json.loads((tmp_path / "b.npz.json").read_text())["fingerprint"]["objective"] == "flow"
