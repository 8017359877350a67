"""The trainer's side of the family seam without training: a family's name implies its objective, its overrides
and block switches reach the model (or are refused in one line before any work), the plan describes it, and
per-block compile and REPA's projector take every family through the interface."""
from __future__ import annotations

import pytest
import torch

from dit_pipeline import dit
from dit_pipeline.train.config_file import merge_config
from dit_pipeline.train.speed import regional_compile
from tests.dit.test_families import TINY, build, inputs
from tests.train.conftest import invoke_train, tiny_args


def test_a_flow_family_implies_the_flow_objective():
    base = {"shards": "s", "run_dir": "r"}
    assert merge_config({}, {**base, "model": "LightningDiT-XL/1"}).objective == "flow"
    assert merge_config({"model": "ddt-xl-2"}, base).objective == "flow"
    assert merge_config({}, {**base, "model": "DiT-DH-XL", "objective": "ddpm"}).objective == "ddpm"  # as asked
    assert merge_config({}, {**base, "model": "DiT-XL/2"}).objective == "ddpm"


@pytest.mark.parametrize("model,over,lines", [
    ("DDT-XL/2", {"encoder-depth": 1},
     ["model       custom (depth 2 (1 encoder + 1 decoder blocks), hidden 32, heads 2, patch 2)",
      "objective   flow (as --model DDT-XL/2 implies; linear interpolant, velocity prediction; training times uniform); "
      "blocks DDT's (qk-norm)"]),
    ("DiT-DH-S", {"depth": 1, "head-depth": 1, "head-hidden-size": 64, "head-num-heads": 2, "patch-size": 2,
                  "no-rope": True},
     ["model       custom (depth 1, hidden 32, heads 2, head 1 x 64 (2 heads), patch 2)",
      "blocks DiT-DH's (rms-norm, swiglu)"]),
    ("LightningDiT-B/2", {"wo-shift": True}, ["blocks LightningDiT's (rms-norm, swiglu, rope, wo-shift)"]),
])
def test_the_plan_describes_the_family(shard_dir, tmp_path, model, over, lines):
    r = invoke_train(tiny_args(shard_dir, tmp_path / "run", **{"model": model, "dry-run": True, **over}))
    assert r.exit_code == 0, r.output
    for line in lines:
        assert line in r.output, r.output


def test_an_option_the_family_lacks_is_refused_before_any_work(shard_dir, tmp_path):
    r = invoke_train(tiny_args(shard_dir, tmp_path / "run", **{"encoder-depth": 1}))
    assert r.exit_code == 1 and not (tmp_path / "run").exists()
    assert r.output.strip().splitlines()[-1].startswith(
        "error: --model DiT-S/2 cannot be built for the shard set in ") and "unknown DiT options ['encoder_depth']" in r.output
    r = invoke_train(tiny_args(shard_dir, tmp_path / "run", **{"model": "DDT-XL/2", "encoder-depth": 1, "swiglu": True}))
    assert r.exit_code == 1 and "unknown DDT options ['swiglu']" in r.output


@pytest.mark.parametrize("family", list(TINY))
def test_per_block_compile_and_the_repa_projector_take_every_family(family):
    model = build(family)
    x, t, y = inputs(model)
    want = model(x, t, y)
    keys = list(model.state_dict())
    assert regional_compile(model, backend="eager") == model.num_blocks + 1
    assert list(model.state_dict()) == keys and torch.equal(model(x, t, y), want)
    k = model.num_blocks  # the last block: DiT-DH's head is wider than its encoder
    head = dit.repa.REPAModel(model, encoder_depth=k, z_dims=(8,), projector_dim=16)
    out, zs = head(x, t, y)
    assert torch.equal(out, want) and zs[0].shape == (2, model.grid_size ** 2, 8)
    assert head.projectors[0][0].in_features == model.hidden_size_at(k)
