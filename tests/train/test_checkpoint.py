"""Checkpoint files: format, retention (keep-last + keep-every), refusal of corrupt/foreign files, a failed
save (disk full, injected in the middle of the write) leaving the previous checkpoint intact, RNG states."""
from __future__ import annotations

import json
import os
import random

import numpy as np
import pytest
import torch

from dit_pipeline.common import faults
from dit_pipeline.common.errors import UserError
from dit_pipeline.train.checkpoint import FORMAT, VERSION, CheckpointManager, load_checkpoint
from dit_pipeline.common.seeding import rng_state, set_rng_state


class Evil:
    """A pickled class: weights_only loading must refuse it."""


def _state(step: int) -> dict:
    w = torch.full((3,), float(step))
    return {"format": FORMAT, "version": VERSION, "model": {"w": w}, "ema": {"w": w * 2}, "opt": {"state": {}},
            "scaler": None, "step": step, "epoch": 0, "data": {"epoch": 0, "step_in_epoch": step},
            "rng": rng_state(), "model_config": {"depth": step}, "latent": {"scaling_factor": 0.5},
            "config": {"lr": 1e-4},
            "manifest_fingerprint": "f" * 64}


def test_save_load_and_retention(tmp_path):
    mgr = CheckpointManager(tmp_path / "ck", keep_last=2, keep_every=4)
    for step in range(1, 10):
        mgr.save(_state(step))
    assert mgr.steps() == [4, 8, 9]
    names = sorted(os.listdir(tmp_path / "ck"))
    assert names == [f"step-{s:07d}{suffix}" for s in (4, 8, 9) for suffix in ("-ema.json", "-ema.pt", ".pt")]
    ck = load_checkpoint(mgr.latest())
    assert ck["step"] == 9 and torch.equal(ck["model"]["w"], torch.full((3,), 9.0))
    ema = torch.load(tmp_path / "ck" / "step-0000009-ema.pt", weights_only=True)
    assert set(ema) == {"w"} and torch.equal(ema["w"], torch.full((3,), 18.0))  # bare state_dict
    sidecar = json.loads((tmp_path / "ck" / "step-0000009-ema.json").read_text())
    assert sidecar == {"format": "dit-pipeline.weights-sidecar", "version": 1, "step": 9,
                       "model_config": {"depth": 9}, "latent": {"scaling_factor": 0.5}}
    # EMA files of an interrupted save (newer than every checkpoint) stay; older ones without a checkpoint go
    for name in ("step-0000010-ema.pt", "step-0000010-ema.json", "step-0000005-ema.pt", "step-0000005-ema.json"):
        (tmp_path / "ck" / name).write_bytes(b"x")
    assert sorted(p.name for p in mgr.prune()) == ["step-0000005-ema.json", "step-0000005-ema.pt"]
    assert (tmp_path / "ck" / "step-0000010-ema.json").exists() and (tmp_path / "ck" / "step-0000010-ema.pt").exists()


def test_corrupt_and_foreign_files_are_refused(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=3)
    path = mgr.save(_state(5))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(UserError) as e:
        load_checkpoint(path)
    assert str(path) in str(e.value) and "Nothing was loaded" in str(e.value)
    other = tmp_path / "other.pt"
    torch.save({"w": torch.zeros(2)}, other)
    with pytest.raises(UserError, match="not a dit-pipeline training checkpoint"):
        load_checkpoint(other)
    with pytest.raises(UserError, match=r"nope.pt: no such file \("):
        load_checkpoint(tmp_path / "nope.pt")
    evil = tmp_path / "evil.pt"
    torch.save({"format": FORMAT, "x": Evil()}, evil)
    with pytest.raises(UserError, match="corrupt or not a dit-pipeline checkpoint"):
        load_checkpoint(evil)  # weights_only refuses the pickled class; never unpickled


def test_failed_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    mgr = CheckpointManager(tmp_path, keep_last=1)
    mgr.save(_state(2))
    monkeypatch.setenv("DIT_FAULT", "train.ckpt_mid_save:enospc")
    monkeypatch.setattr(faults, "_counts", faults.Counter())
    with pytest.raises(UserError, match=r"step-0000004.pt \(No space left.*the previous checkpoint "
                                        r"\(step-0000002.pt\) is intact"):
        mgr.save(_state(4))
    assert mgr.steps() == [2]
    assert load_checkpoint(mgr.latest())["step"] == 2
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".tmp-")]  # the temp file was removed
    # a temp file left by a SIGKILLed writer is cleaned at the next start
    (tmp_path / ".tmp-step-0000006.pt.x").write_bytes(b"partial")
    assert [p.name for p in mgr.clean_partial()] == [".tmp-step-0000006.pt.x"]


def test_rng_state_round_trip():
    state = rng_state()
    a = (torch.rand(3), np.random.rand(3), random.random())
    set_rng_state(state)
    b = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(a[0], b[0]) and np.array_equal(a[1], b[1]) and a[2] == b[2]
