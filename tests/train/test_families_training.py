"""Every model family trains through the one trainer (dit-train --model LightningDiT-..., DDT-..., DiT-DH-...) on 2
ranks with activation checkpointing, gradient clipping and the flow objective; a run killed with SIGKILL and
resumed is bit-identical to a straight run (losses, weights, EMA, optimizer); its checkpoints record the family,
its EMA file loads back through dit.load_dit_weights, and the sample grid at the end is drawn."""
from __future__ import annotations

import pytest
import torch

from dit_pipeline import dit
from tests._util import straight_killed_resumed
from tests.train.conftest import tiny_args

FAMILIES = {  # depth 1-2, width 32-64, on the 4x8x8 test shards
    "LightningDiT": {"model": "LightningDiT-B/2", "qk-norm": True},
    "DDT": {"model": "DDT-XL/2", "encoder-depth": 1},
    "DiT-DH": {"model": "DiT-DH-S", "depth": 1, "head-depth": 1, "head-hidden-size": 64, "head-num-heads": 2,
               "patch-size": 2},
}
STEPS = 4
KEYS = ("step", "epoch", "loss", "mse", "grad_norm")


def _args(shards, run_dir, family, vae):
    return tiny_args(shards, run_dir, **{"objective": "flow", "max-steps": STEPS, "ckpt-every": 2, "num-workers": 0,
                                         "grad-checkpointing": True, "grad-clip": 1.0, "sample-every": STEPS,
                                         "sample-classes": "0,1", "sample-steps": 2, "vae": vae, **FAMILIES[family]})


def _same_state(a, b):
    for key in ("model", "ema"):
        assert a[key].keys() == b[key].keys()
        assert all(torch.equal(a[key][n], b[key][n]) for n in a[key]), key
    for i, st in a["opt"]["state"].items():
        assert all(torch.equal(v, b["opt"]["state"][i][k]) for k, v in st.items())


# make test-sweep: DiT-DH (the widest departure from DiT's blocks) trains, is killed and resumes bit-identically in
# make test already, on 2 ranks, in tests/features/test_end_to_end.py; every family shards, trains and equals DDP
# in tests/train/test_parallel.py
@pytest.mark.parametrize("family", [pytest.param(f, marks=pytest.mark.sweep) for f in FAMILIES])
def test_the_family_trains_resumes_bit_identically_and_samples(family, shard_dir, tiny_vae_dir, tmp_path):
    straight, a, b = straight_killed_resumed(lambda run: _args(shard_dir, run, family, tiny_vae_dir), tmp_path, STEPS,
                                             KEYS, timeout=900)
    _same_state(a, b)
    assert a["model_config"]["family"] == family and a["objective"] == "flow"
    sd, info = dit.load_dit_weights(straight / "checkpoints" / f"step-{STEPS:07d}-ema.pt")  # the bare EMA + sidecar
    assert info["family"] == family and info["flow_convention"] == "sit" and info["model_config"] == a["model_config"]
    assert all(torch.equal(sd[k], a["ema"][k]) for k in sd)
    assert (straight / "samples" / f"step-{STEPS:07d}.png").is_file()
    assert f"; blocks {family}'s" in (straight / "log.txt").read_text()  # the plan names the family's blocks
