"""A data mix trained for real: 2 ranks (gloo, CPU) through the CLI, killed with SIGKILL mid-epoch and resumed on 2
ranks (the same sequence, losses and weights as the uninterrupted run) and on 1 rank (the epoch's multiset of
(source, key) pairs equal to the uninterrupted run's, none seen twice); the validation loss at fixed timesteps
identical across reruns and world sizes, and a held-out key never in a training batch (--record-keys); a change of
sources refused on resume unless --new-mix, which the checkpoint records."""
from __future__ import annotations

import json
import shutil
import signal
from collections import Counter

import pytest
import torch

from dit_pipeline.common.errors import UserError
from dit_pipeline.train import merge_config, run
from dit_pipeline.train.command import main as train_main
from dit_pipeline.train.checkpoint import CheckpointManager, load_checkpoint
from dit_pipeline.train.metrics import read_metrics
from dit_pipeline.train.mixdraws import held_out
from tests._util import run_cli
from tests.train.helpers import make_shard_set

MODEL = {"model": "DiT-S/2", "depth": 2, "hidden-size": 32, "num-heads": 2, "lr": 1e-3}


@pytest.fixture(scope="module")
def sets(tmp_path_factory):
    root = tmp_path_factory.mktemp("mix-train")
    make_shard_set(root / "a", samples=(16, 16, 16, 16))
    make_shard_set(root / "b", samples=(10, 10), seed=1)
    return root


def mix_args(sets, run_dir, **over):
    opts = {**MODEL, "run-dir": run_dir, "global-batch-size": 8, "micro-batch-size": 2, "num-workers": 1,
            "epochs": 1, "log-every": 1, "ckpt-every": 2, "val-shards": "holdout", "val-every": 2,
            "val-samples": 8, "record-keys": None, "mix-lanes": 2, **over}
    args = ["--source", f"{sets}/a proportion=0.6 holdout=0.2", "--source", f"{sets}/b proportion=0.4"]
    for k, v in opts.items():
        args += [f"--{k}"] if v is None else [f"--{k}", str(v)]
    return args


def keys_by_step(run_dir, ranks=(0, 1)):
    """step -> the (source, key) pairs of every rank, rank after rank (the global batch in order)."""
    out: dict[int, list] = {}
    for r in ranks:
        path = run_dir / "logs" / f"keys-rank{r}.jsonl"
        for rec in read_metrics(path) if path.is_file() else []:
            out.setdefault(rec["step"], []).extend(tuple(p) for p in rec["keys"])
    return out


def train_records(run_dir):
    return {r["step"]: (r["loss"], r["mse"], r["vb"], r["grad_norm"]) for r in read_metrics(run_dir) if "loss" in r}


def val_records(run_dir):
    return {r["step"]: (r["val_loss_ema"], r["val_loss_raw"], r["val_loss_ema_t"]) for r in read_metrics(run_dir)
            if "val_loss_ema" in r}


@pytest.fixture(scope="module")
def runs(sets, tmp_path_factory):
    """S2: straight on 2 ranks; K: killed (SIGKILL) after step 3 of the epoch on 2 ranks (last checkpoint: 2),
    then R2: resumed on 2 ranks, R1: a copy resumed on 1 rank."""
    root = tmp_path_factory.mktemp("mix-runs")
    straight = root / "s2"
    r = run_cli("dit-train", ["--nproc-per-node", "2", *mix_args(sets, straight)], timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    killed = root / "r2"
    r = run_cli("dit-train", ["--nproc-per-node", "2", *mix_args(sets, killed)],
                env={"DIT_FAULT": "train.step_end@3:kill"}, timeout=600)
    assert r.returncode != 0 and CheckpointManager(killed / "checkpoints").steps() == [2], r.stderr[-2000:]
    one = root / "r1"
    shutil.copytree(killed, one)
    r = run_cli("dit-train", ["--nproc-per-node", "2", *mix_args(sets, killed)], timeout=600)
    assert r.returncode == 0 and "resumed from" in r.stderr, r.stderr[-3000:]
    # on 1 rank, in this process (the same command's settings: 2 lanes, now both read by rank 0)
    assert train_main(cfg_of(sets, one)) == 0
    return {"s2": straight, "r2": killed, "r1": one, "r1_log": (one / "log.txt").read_text()}


def cfg_of(sets, run_dir, **over):
    """mix_args as a TrainConfig for an in-process run."""
    opts = {**{k.replace("-", "_"): v for k, v in MODEL.items()}, "run_dir": str(run_dir), "global_batch_size": 8,
            "micro_batch_size": 8, "num_workers": 0, "epochs": 1, "log_every": 1, "ckpt_every": 2,
            "val_shards": "holdout", "val_every": 2, "val_samples": 8, "record_keys": True, "quiet": True,
            "source": [f"{sets}/a proportion=0.6 holdout=0.2", f"{sets}/b proportion=0.4"], **over}
    return merge_config({}, opts)


def test_killed_mid_epoch_and_resumed_on_two_ranks_is_the_uninterrupted_run(runs):
    s2, r2 = runs["s2"], runs["r2"]
    steps = sorted(train_records(s2))
    assert len(steps) >= 6 and train_records(r2) == train_records(s2)  # every logged value, exactly
    assert keys_by_step(r2) == keys_by_step(s2)  # the same samples in the same order on each rank
    a = load_checkpoint(CheckpointManager(s2 / "checkpoints").latest())
    b = load_checkpoint(CheckpointManager(r2 / "checkpoints").latest())
    for key in ("model", "ema"):
        assert all(torch.equal(a[key][n], b[key][n]) for n in a[key]), key
    assert a["mix"]["seen"] == b["mix"]["seen"] and sum(a["mix"]["seen"].values()) == 8 * steps[-1]
    assert val_records(r2) == val_records(s2)  # the validation loss of a rerun: bit for bit


def test_resumed_on_one_rank_the_epoch_holds_the_same_samples(runs, sets):
    s2, r1 = runs["s2"], runs["r1"]
    assert "the mix's global sample sequence continues where it stopped" in runs["r1_log"]
    straight, resumed = keys_by_step(s2), keys_by_step(r1)
    assert sorted(straight) == sorted(resumed)
    for step in straight:  # the global batch of every step, before and after the change of world size
        assert resumed[step] == straight[step], step
    epoch = Counter(p for ps in straight.values() for p in ps)
    assert epoch == Counter(p for ps in resumed.values() for p in ps)
    ck = load_checkpoint(CheckpointManager(s2 / "checkpoints").latest())
    # no sample twice beyond the weights' rule: a gives one pass (no key twice), b is repeated by its proportion
    assert max(n for (s, _), n in epoch.items() if s == 0) == 1
    assert ck["mix"]["seen"]["a"] == sum(n for (s, _), n in epoch.items() if s == 0)


def test_a_held_out_key_is_never_trained_on_and_validation_is_the_same_at_any_world_size(runs, sets, tmp_path):
    held = {k for k in range(64) if held_out(k, 0.2)}
    trained = {k for ps in keys_by_step(runs["s2"]).values() for s, k in ps if s == 0}
    assert held and not (held & trained)
    val = [r for r in read_metrics(runs["s2"]) if "val_run" in r]
    assert [r["step"] for r in val][:2] == [0, 2]
    run0 = val[0]["val_run"]
    assert run0["samples"] == 8 and run0["noise_levels"] == [k / 8 for k in range(8)]
    assert run0["times"] == [0, 125, 250, 375, 500, 625, 750, 875] and run0["weights"] == ["ema", "raw"]
    assert run0["set"] == "held-out keys of a (0.2)"
    # a 1-rank run of the same settings starts from the same weights: its step-0 validation loss is bit-identical
    assert train_main(cfg_of(sets, tmp_path / "one", max_steps=1)) == 0
    assert val_records(tmp_path / "one")[0] == val_records(runs["s2"])[0]


def test_other_sources_on_resume_are_refused_unless_new_mix(runs, sets, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(runs["s2"], run_dir)
    base = {"run_dir": str(run_dir), "model": "DiT-S/2", "depth": 2, "hidden_size": 32, "num_heads": 2,
            "global_batch_size": 8, "micro_batch_size": 8, "num_workers": 0, "quiet": True, "log_every": 1,
            "ckpt_every": 2}
    end = load_checkpoint(CheckpointManager(run_dir / "checkpoints").latest())["step"]
    only_a = [f"{sets}/a proportion=0.6 holdout=0.2"]
    with pytest.raises(UserError, match=r"trained on another data mix \(removed b\)\. Pass the same sources .*--new-mix"):
        run(merge_config({}, {**base, "source": only_a, "max_steps": end + 2}))
    with pytest.raises(UserError, match=r"trained on a data mix \(a, b\); pass its sources"):
        run(merge_config({}, {**base, "shards": str(sets / "a"), "max_steps": end + 2}))
    assert run(merge_config({}, {**base, "source": only_a, "new_mix": True, "max_steps": end + 2})) == "done"
    ck = load_checkpoint(CheckpointManager(run_dir / "checkpoints").latest())
    history = ck["mix"]["history"]
    assert history[-1]["new_mix"] and history[-1]["step"] == end and history[-1]["changes"] == ["removed b"]
    assert [s["name"] for s in ck["mix"]["sources"]] == ["a"] and ck["epoch"] >= 1
    assert json.loads((run_dir / "config.json").read_text())["new_mix"] is True


def test_a_single_shard_set_checkpoint_keeps_its_keys_and_joins_a_mix_only_when_asked(sets, tmp_path):
    """A --shards run's checkpoint holds the keys it held before mixes existed (so older ones resume, and a run is
    unchanged), and continuing it on a mix needs --new-mix."""
    run_dir = tmp_path / "single"
    base = {"run_dir": str(run_dir), "model": "DiT-S/2", "depth": 2, "hidden_size": 32, "num_heads": 2,
            "global_batch_size": 8, "micro_batch_size": 8, "num_workers": 0, "quiet": True, "ckpt_every": 2}
    assert run(merge_config({}, {**base, "shards": str(sets / "a"), "max_steps": 2})) == "done"
    ck = load_checkpoint(CheckpointManager(run_dir / "checkpoints").latest())
    assert set(ck) == {"format", "version", "model", "ema", "opt", "scaler", "step", "epoch", "data", "rng",
                       "model_config", "objective", "latent", "config", "manifest_fingerprint", "guard"}
    assert set(ck["data"]) == {"epoch", "step_in_epoch", "seed", "world_size", "workers", "micro_batch", "accum",
                               "shuffle_buffer", "shards_in_flight", "overflow_steps", "bad_shards", "bad_shard_names"}
    mixed = {**base, "source": [f"{sets}/a", f"{sets}/b"], "max_steps": 4}
    with pytest.raises(UserError, match=r"trained on another data mix \(the checkpoint was trained on one shard set"):
        run(merge_config({}, mixed))
    assert run(merge_config({}, {**mixed, "new_mix": True})) == "done"
    assert load_checkpoint(CheckpointManager(run_dir / "checkpoints").latest())["mix"]["history"][-1]["step"] == 2
