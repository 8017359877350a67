"""The lr schedule (train/schedule.py) and the optimizer choice (train/optim.py) as pure units: RAE's linear decay
written out from its release's formula, the warm-up as the trainer always computed it, lengths in epochs counted
from the run's epochs, every misconfiguration one clear message; Muon's split of the tensors, its refusal on a
torch without it, and a checkpoint of one optimizer refused by a run of the other."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from dit_pipeline.common.errors import ConfigError, UserError
from dit_pipeline.train import merge_config
from dit_pipeline.train.checkpoint import CheckpointManager
from dit_pipeline.train.memory import estimate
from dit_pipeline.train.optim import MuonWithAdamW, build_optimizer, check_state, muon_available, split_for_muon
from dit_pipeline.train.schedule import LrSchedule, build_schedule

BASE = {"shards": "s", "run_dir": "r"}
PER_EPOCH = 1251  # ImageNet-1k at batch 1024 (RAE's steps_per_epoch)


def epochs_of(per_epoch: int = PER_EPOCH):
    return lambda e: int(e * per_epoch)


def test_raes_schedule_step_by_step():
    """bytetriper/RAE src/utils/optim_utils.py, linear, warmup_from_zero false: lr_lambda(step) = 1 before
    warmup_steps = 40 epochs, then 1 - (1 - final/base) (step - warmup) / (end - warmup), final/base after."""
    cfg = merge_config({}, {**BASE, "lr": 2e-4, "final_lr": 2e-5, "lr_decay_start_epochs": 40,
                            "lr_decay_end_epochs": 800, "epochs": 1400})
    sched = build_schedule(cfg, epochs_of(), 1400 * PER_EPOCH)
    start, end, ratio = 40 * PER_EPOCH, 800 * PER_EPOCH, 0.1

    def rae(step: int) -> float:
        if step < start:
            return 2e-4
        if step >= end:
            return 2e-4 * ratio
        return 2e-4 * (1.0 - (1.0 - ratio) * (step - start) / (end - start))

    for step in (0, 1, start - 1, start, start + 1, (start + end) // 2, end - 1, end, end + 7, 1400 * PER_EPOCH):
        assert sched.lr_at(step) == rae(step), step
    assert sched.lr_at((start + end) // 2) == pytest.approx(1.1e-4, rel=1e-5)
    assert sched.describe() == ("0.0002, constant to step 50,040 (epoch 40), linear to 2e-05 at step 1,000,800 "
                                "(epoch 800), then constant")


def test_the_warm_up_is_the_trainers_as_before_and_the_decay_follows_it():
    sched = build_schedule(merge_config({}, {**BASE, "lr": 3e-4, "warmup_steps": 7, "max_steps": 20}), epochs_of(5), 20)
    assert [sched.lr_at(s) for s in range(9)] == [3e-4 * min(1.0, (s + 1) / 7) for s in range(9)]
    assert sched.describe() == "warm-up from 4.29e-05 to 0.0003 over 7 steps, then constant"
    decay = build_schedule(merge_config({}, {**BASE, "lr": 1e-3, "warmup_epochs": 0.5, "final_lr": 0.0,
                                             "max_steps": 30}), epochs_of(10), 30)
    assert (decay.warmup, decay.decay_start, decay.decay_end) == (5, 5, 30)  # half an epoch; the run's end
    assert [decay.lr_at(s) for s in (4, 5, 30)] == [1e-3, 1e-3, 0.0]
    assert decay.lr_at(17) == pytest.approx(1e-3 * (1 - 12 / 25))
    no_decay = LrSchedule(1e-4)
    assert {no_decay.lr_at(s) for s in (0, 10**6)} == {1e-4}


def test_epochs_are_the_runs_epochs_and_a_fraction_counts_its_share():
    from dit_pipeline.train.batch import batch_plan
    from dit_pipeline.train.partition import plan_epoch
    from dit_pipeline.train.preflight import epoch_counter

    sizes = [16, 16, 16, 12]
    steps_at = epoch_counter(sizes, 0, 1, 3, batch_plan(8, 4, 1))
    per = [plan_epoch(sizes, seed=0, epoch=e, world_size=1, workers=3, micro_batch=4, accum=2).steps for e in range(3)]
    assert steps_at(0) == 0 and steps_at(2) == per[0] + per[1] and steps_at(2.5) == per[0] + per[1] + per[2] // 2


def test_every_schedule_mistake_is_named_at_once():
    with pytest.raises(ConfigError) as e:
        merge_config({}, {**BASE, "warmup_steps": 5, "warmup_epochs": 1.0, "lr_decay_end_steps": 9,
                          "lr_decay_end_epochs": 2.0, "lr_decay_start_epochs": -1}).validate()
    msg = str(e.value)
    assert "--warmup-steps and --warmup-epochs give the same length twice: keep one" in msg
    assert "--lr-decay-end-steps and --lr-decay-end-epochs give the same length twice: keep one" in msg
    assert "--lr-decay-start-epochs must be a number of epochs >= 0, got -1" in msg
    assert ("--lr-decay-start-epochs, --lr-decay-end-steps, --lr-decay-end-epochs place the lr decay: add --final-lr"
            in msg)
    with pytest.raises(UserError, match="would start at step 2, inside the warm-up \\(5 steps\\)"):
        build_schedule(merge_config({}, {**BASE, "warmup_steps": 5, "final_lr": 0.0, "lr_decay_start_steps": 2}),
                       epochs_of(10), 100)
    with pytest.raises(UserError, match="would end at step 10, not after its start at step 40"):
        build_schedule(merge_config({}, {**BASE, "final_lr": 0.0, "lr_decay_start_epochs": 4,
                                         "lr_decay_end_epochs": 1}), epochs_of(10), 100)


def test_muon_takes_the_2d_tensors_and_adamw_the_rest():
    cfg = merge_config({}, {**BASE, "optimizer": "muon"})
    net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3), torch.nn.Conv2d(3, 2, 1))
    two_d, rest = split_for_muon(list(net.parameters()))
    assert [tuple(p.shape) for p in two_d] == [(3, 4)] and len(rest) == 5  # bias, norm weight/bias, conv w/b
    if not muon_available():
        return
    opt = build_optimizer(list(net.parameters()), cfg, torch.device("cpu"))
    assert isinstance(opt, MuonWithAdamW) and len(opt.param_groups) == 2
    assert opt.param_groups[0]["adjust_lr_fn"] == "match_rms_adamw" and opt.param_groups[0]["momentum"] == 0.95
    state = opt.state_dict()
    assert check_state(state, "muon", 6, "c") is None
    assert check_state(state, "muon", 5, "c") == "checkpoint c: optimizer state does not match this model (5 " \
                                                 "trainable tensors). Nothing was loaded."
    assert check_state(state, "adamw", 6, "c") == ("checkpoint c was trained with --optimizer muon, this run asks "
                                                   "for --optimizer adamw; resume with --optimizer muon, or use a new "
                                                   "--run-dir")
    adamw = torch.optim.AdamW(net.parameters()).state_dict()
    assert check_state(adamw, "adamw", 6, "c") is None and "trained with --optimizer adamw" in check_state(
        adamw, "muon", 6, "c")


def test_muon_on_an_old_torch_is_one_refusal_naming_the_version(monkeypatch):
    monkeypatch.delattr(torch.optim, "Muon", raising=False)
    with pytest.raises(ConfigError) as e:
        merge_config({}, {**BASE, "optimizer": "muon"}).validate()
    assert (f"--optimizer muon needs torch.optim.Muon (PyTorch 2.9 and later), which torch {torch.__version__} lacks: "
            "upgrade torch, or use --optimizer adamw") in str(e.value)
    with pytest.raises(ConfigError, match="--muon-momentum and --muon-adjust-lr set Muon: add --optimizer muon"):
        merge_config({}, {**BASE, "muon_momentum": 0.9}).validate()


def test_the_memory_estimate_counts_muons_single_moment():
    mc = {"model": "DiT-S/2", "input_size": 32, "patch_size": 2, "hidden_size": 384, "depth": 12}
    adamw = estimate(mc, 1000, 1000, 8, "bf16", grad_ckpt=False, compile=False)
    muon = estimate(mc, 1000, 1000, 8, "bf16", grad_ckpt=False, compile=False, muon_params=600)
    assert muon.parts["adamw"] == 8 * 400 / 2**30 and muon.parts["muon"] == 4 * 600 / 2**30
    assert adamw.total - muon.total == pytest.approx(4 * 600 / 2**30)
    assert dataclasses.asdict(adamw)["parts"].keys() == {"params", "grads", "adamw", "ema_rank0", "activations",
                                                        "overhead"}


@pytest.mark.skipif(not muon_available(), reason=f"torch {torch.__version__} has no torch.optim.Muon")
def test_a_resume_with_the_other_optimizer_is_refused_before_anything_loads(shard_dir, tmp_path):
    from tests.train.conftest import run_tiny

    run_tiny(shard_dir, tmp_path / "run", max_steps=1, global_batch_size=8)
    with pytest.raises(UserError, match=r"step-0000001.pt was trained with --optimizer adamw, this run asks for "
                                        r"--optimizer muon; resume with --optimizer adamw, or use a new --run-dir"):
        run_tiny(shard_dir, tmp_path / "run", max_steps=2, global_batch_size=8, optimizer="muon")
    assert CheckpointManager(tmp_path / "run" / "checkpoints").steps() == [1]
