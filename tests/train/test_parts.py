"""The trainer's named stateful parts (listed in train/parts.py): each checkpoint key has exactly one owner, the file's
keys are those of format version 1, and every resume rule runs before anything loads."""
from __future__ import annotations

import copy

import pytest
import torch

from dit_pipeline import dit
from dit_pipeline.common.errors import UserError
from dit_pipeline.train.checkpoint import FORMAT, VERSION, CheckpointManager, load_checkpoint
from dit_pipeline.train.partition import DataLayout
from dit_pipeline.train.parts import PART_TYPES, REQUIRED_KEYS, build_parts, compose, load_all
from dit_pipeline.train.progress_parts import ProgressPart
from dit_pipeline.train.setting_parts import ShardSetPart
from dit_pipeline.train.state import TrainState

# The keys of a version-1 checkpoint (docs/ARCHITECTURE.md), as the trainer wrote them before the parts existed.
V1_KEYS = {"format", "version", "model", "ema", "opt", "scaler", "step", "epoch", "data", "rng", "model_config",
           "objective", "latent", "config", "manifest_fingerprint"}
# optional keys added since (--repa; flow runs; the divergence guard; meanflow runs; x-prediction; text-conditional runs)
ADDED_KEYS = {"projector", "time_shift", "guard", "meanflow", "prediction", "perceptual", "text", "reg",
              "internal_guidance", "mix"}
V1_REQUIRED = {"model", "ema", "opt", "step", "epoch", "data", "model_config", "config", "manifest_fingerprint"}
LAYOUT = DataLayout(seed=0, world_size=1, workers=2, micro_batch=4, accum=1, shuffle_buffer=10, shards_in_flight=2)


def _run(steps_per_epoch: int = 5, seed: int = 0, objective: str = "ddpm", depth: int = 2):
    torch.manual_seed(seed)
    model = dit.create_model("DiT-S/2", input_size=8, num_classes=4, depth=depth, hidden_size=32, num_heads=2)
    ema = copy.deepcopy(model).requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    state = TrainState()
    parts = build_parts(objective=objective, config={"global_batch_size": 8, "lr": 1e-3},
                        shard_set=ShardSetPart("f" * 64, {"scaling_factor": 0.5, "shift_factor": None, "vae": None,
                                                          "class_names": ["a", "b", "c", "d"]}),
                        model=model, ema=ema, opt=opt, scaler=torch.amp.GradScaler("cpu", enabled=False),
                        progress=ProgressPart(state, LAYOUT, lambda epoch: steps_per_epoch))
    return model, ema, opt, state, parts


def _one_step(model, opt):
    loss = sum(p.float().pow(2).sum() for p in model.parameters() if p.requires_grad)
    loss.backward()
    opt.step()
    opt.zero_grad()


def test_each_key_has_one_owner_and_the_file_keeps_format_version_1(tmp_path):
    model, ema, opt, state, parts = _run()
    owners = [k for t in PART_TYPES for k in t.keys]
    assert len(owners) == len(set(owners))                            # one part per key
    assert set(owners) | {"format", "version"} == V1_KEYS | ADDED_KEYS
    assert set(REQUIRED_KEYS) == V1_REQUIRED
    state.step, state.step_in_epoch = 3, 3
    path = CheckpointManager(tmp_path).save_parts(parts)
    ckpt = load_checkpoint(path)
    assert set(ckpt) == V1_KEYS and (ckpt["format"], ckpt["version"]) == (FORMAT, VERSION)
    assert ckpt["latent"]["class_names"] == ["a", "b", "c", "d"] and ckpt["objective"] == "ddpm"
    assert ckpt["data"]["epoch"] == 0 and ckpt["data"]["step_in_epoch"] == 3 and ckpt["data"]["workers"] == 2
    assert set(compose(parts)) == V1_KEYS - {"format", "version"}


def test_the_end_of_an_epoch_is_stored_as_the_start_of_the_next():
    _, _, _, state, parts = _run(steps_per_epoch=5)
    state.step, state.epoch, state.step_in_epoch = 5, 0, 5
    content = compose(parts)
    assert (content["epoch"], content["data"]["epoch"], content["data"]["step_in_epoch"]) == (1, 1, 0)


def test_resume_restores_every_part_exactly(tmp_path):
    model, ema, opt, state, parts = _run()
    _one_step(model, opt)
    ema.load_state_dict({k: v if k == "pos_embed" else v * 0.5 for k, v in model.state_dict().items()})
    state.step, state.step_in_epoch, state.bad_shard_names, state.bad_shards = 1, 1, ["shard-000001.tar"], 1
    ckpt = load_checkpoint(CheckpointManager(tmp_path).save_parts(parts))
    model2, ema2, opt2, state2, parts2 = _run(seed=1)
    load_all(parts2, ckpt, "ckpt")
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), model2.state_dict().values()))
    assert all(torch.equal(a, b) for a, b in zip(ema.state_dict().values(), ema2.state_dict().values()))
    assert (state2.step, state2.epoch, state2.step_in_epoch, state2.bad_shard_names, state2.bad_shards) == \
        (1, 0, 1, ["shard-000001.tar"], 1)
    _one_step(model, opt)
    _one_step(model2, opt2)  # the optimizer state came along: the next step is the same
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), model2.state_dict().values()))


def test_every_check_runs_before_any_part_loads(tmp_path):
    model, ema, opt, state, parts = _run()
    ckpt = dict(load_checkpoint(CheckpointManager(tmp_path).save_parts(parts)))
    other, _, _, other_state, other_parts = _run(seed=1)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    ckpt["config"] = {**ckpt["config"], "global_batch_size": 16}  # ConfigPart, after ModelPart in the order
    with pytest.raises(UserError, match="--global-batch-size 16, this run asks for 8"):
        load_all(other_parts, ckpt, "ckpt")
    assert all(torch.equal(before[k], v) for k, v in other.state_dict().items())  # nothing was loaded
    assert other_state.step == 0


def test_the_first_mismatch_in_part_order_is_reported(tmp_path):
    _, _, _, _, parts = _run(objective="flow")
    ckpt = load_checkpoint(CheckpointManager(tmp_path).save_parts(parts))
    _, _, _, _, deeper = _run(depth=3)  # another objective AND another model: the objective is named
    with pytest.raises(UserError, match="trained with --objective flow, this run asks for --objective ddpm"):
        load_all(deeper, ckpt, "ckpt")
    _, _, _, _, deeper_flow = _run(depth=3, objective="flow")
    with pytest.raises(UserError, match=r"different model .*depth: checkpoint 2, this run 3"):
        load_all(deeper_flow, ckpt, "ckpt")
