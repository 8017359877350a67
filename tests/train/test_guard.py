"""The divergence guard (train/guard.py): its decisions as pure functions, then 2 real gloo ranks with injected
faults (common.faults keyed points): a NaN batch is skipped, a gradient spike is skipped and the second skip
rolls the run back past the batches read since; straight vs killed (-9, after the skip with a checkpoint that
holds it, and right after the rollback) and resumed: identical. A NaN tied to the step recurs after the rollback
and the second rollback to the same checkpoint stops with one line. The killed-and-resumed run logs to W&B
offline (the W&B run id kept in the run folder): the values W&B holds are those of metrics.jsonl."""
from __future__ import annotations

import importlib.util
import json
import math
import struct
from pathlib import Path

import pytest
import torch

from dit_pipeline.train.checkpoint import CheckpointManager, load_checkpoint
from dit_pipeline.train.guard import Guard, GuardSettings, advance
from dit_pipeline.train.metrics import read_metrics
from tests._util import run_torchrun
from tests.train.conftest import tiny_args

# 2 ranks x micro 2 x accum 2 = 8; an epoch has 7 steps, so the rollback's skipped batches cross an epoch end
GUARDED = {"max-steps": 10, "num-workers": 0, "micro-batch-size": 2, "on-divergence": "rollback",
           "spike-window": 3, "max-skips": 2, "skip-window": 10}
# the NaN batch (step 5: skipped), a checkpoint at 6 that holds the skip, the spike (step 7: skipped, rollback)
FAULTS = "train.nan_batch@5,train.spike_batch@7"


def _settings(**kw) -> GuardSettings:
    return GuardSettings(**{"on_divergence": "rollback", "spike_window": 3, "max_skips": 2, "skip_window": 10, **kw})


def test_verdicts_windows_and_the_rollback_target():
    g = Guard(_settings())
    assert g.judge(1, 1.0, 100.0, []).kind == "apply"      # no spike test before the window is full
    for norm in (1.0, 2.0, 3.0):
        g.applied(norm)
    assert g.judge(2, 1.0, 19.9, []).kind == "apply"       # median 2, factor 10
    assert g.judge(3, 1.0, 20.1, []).reason.startswith("gradient norm 20.1 is 10.1 x its running median 2")
    g.checkpointed(4)
    assert g.last_clean is None                            # a skip (3) counts in its window: not passed
    assert g.judge(14, 1.0, math.nan, []).kind == "skip"   # step 3 left the 10-step window
    g.checkpointed(24)
    assert g.last_clean == 24 and g.window == []
    assert g.judge(25, math.inf, 1.0, [1]).kind == "skip"
    v = g.judge(26, 1.0, math.nan, [])
    assert v.kind == "rollback" and "2 steps skipped within 10 steps (25, 26; --max-skips 2)" in v.reason
    assert g.rollback_target(26) == (24, "")
    g.rolled_back(g.history(), 26, 24)
    assert g.data_offset == 2 and g.skipped == 4 and g.window == []
    assert g.rollback_target(30)[0] is None and "diverged again after rolling back to step 24" \
        in g.rollback_target(30)[1]
    fresh = Guard(_settings())
    fresh.load_state_dict(g.state_dict(), 24)
    assert fresh.state_dict() == g.state_dict()
    fresh.load_state_dict(None, 8)                          # a checkpoint from before the guard passed
    assert fresh.last_clean == 8 and fresh.skipped == 0
    skip = Guard(_settings(on_divergence="skip", max_skips=1))
    assert skip.judge(1, math.nan, 1.0, []).kind == "stop"
    assert Guard(_settings(on_divergence="stop")).judge(1, math.nan, 1.0, []).kind == "stop"
    steps = lambda epoch: 7  # noqa: E731
    assert advance(0, 4, 3, steps) == (1, 0) and advance(0, 4, 2, steps) == (0, 6) and advance(1, 6, 9, steps) == (3, 1)


def _train(shard_dir, run_dir, tmp_path, faults, **over):
    env = {"DIT_FAULT": faults, "DIT_FAULT_RANK": "1", "WANDB_MODE": "offline", "WANDB_SILENT": "true",
           "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"), "WANDB_CACHE_DIR": str(tmp_path / "wandb-cache"),
           "WANDB_DATA_DIR": str(tmp_path / "wandb-data")}
    return run_torchrun("dit-train", tiny_args(shard_dir, run_dir, **{**GUARDED, **over}), env=env, timeout=300)


@pytest.fixture(scope="module")
def runs(shard_dir, tmp_path_factory):
    """The straight run, and the same run killed after step 6 (checkpoint with the skip), killed right after the
    rollback, then resumed to the end (with --wandb)."""
    tmp = tmp_path_factory.mktemp("guard")
    straight = tmp / "straight"
    r = _train(shard_dir, straight, tmp, FAULTS)
    assert r.returncode == 0, r.stderr[-3000:]
    killed = tmp / "killed"
    logs = []
    wandb = importlib.util.find_spec("wandb") is not None  # the test extra has it; a bare install may not
    for kill in ("train.step_end@6:kill", "train.rolled_back@1:kill", None):
        r = _train(shard_dir, killed, tmp, FAULTS + (f",{kill}" if kill else ""), wandb=wandb)
        assert (r.returncode == 0) == (kill is None), r.stderr[-3000:]
        logs.append(r.stderr)
    return straight, killed, logs


@pytest.mark.determinism
def test_skip_spike_and_rollback_are_logged_and_killed_runs_resume_exactly(runs):
    straight, killed, logs = runs
    log = (straight / "log.txt").read_text()
    assert "step 5 skipped (--on-divergence rollback): non-finite loss or gradient on rank(s) [1]" in log
    assert "step 7 skipped (--on-divergence rollback): 2 steps skipped within 10 steps (5, 7; --max-skips 2), " \
           "the last: gradient norm" in log
    assert ("step 7: rolled back to step-0000004.pt (rollback 1); the data stream continues past the 3 batches "
            "read since (epoch 1, step 0 in epoch)") in log
    assert "divergence guard: 2 step(s) skipped (5, 7), 1 rollback(s) (step 7 -> 4, 3 batches skipped)" in log
    recs = read_metrics(straight)
    assert [r["step"] for r in recs] == list(range(1, 11))   # the abandoned steps 5-7 were dropped
    assert [(r["skipped_steps"], r["rollbacks"]) for r in recs] == [(0, 0)] * 4 + [(2, 1)] * 6
    assert [r["epoch"] for r in recs[4:]] == [1] * 6         # steps 5.. read epoch 1: batches 5-7 left out
    assert sorted(p.name for p in (straight / "checkpoints" / "rolled-back").glob("*.pt")) == \
        ["step-0000006-ema.pt", "step-0000006.pt"]
    # killed after step 6 (its checkpoint holds the skip), then right after the rollback: the same run
    assert "step 7: rolled back to step-0000004.pt" in logs[1] and "resumed from" in logs[2]
    keys = ("step", "epoch", "loss", "mse", "vb", "grad_norm", "skipped_steps", "rollbacks")
    assert [{k: r.get(k) for k in keys} for r in read_metrics(killed)] == [{k: r.get(k) for k in keys} for r in recs]
    a, b = (load_checkpoint(CheckpointManager(d / "checkpoints").latest()) for d in (straight, killed))
    assert a["step"] == b["step"] == 10 and a["guard"] == b["guard"] and a["data"] == b["data"]
    for part in ("model", "ema"):
        assert all(torch.equal(a[part][k], b[part][k]) for k in a[part]), part
    assert [e["kind"] for e in a["guard"]["events"]] == ["skip", "skip", "rollback"]


def _wandb_records(path: Path) -> list:
    """The records of a W&B transaction log (`run-ID.wandb`: a 7-byte header, then LevelDB's log format:
    32 KiB blocks of chunks, each crc32c, length, type (1 whole, 2 first, 3 middle, 4 last) and bytes)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, out, buf = path.read_bytes(), 7, [], b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:
            pos += 32768 - pos % 32768
            continue
        length, kind = struct.unpack("<HB", data[pos + 4:pos + 7])
        buf, pos = buf + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(buf)
            out.append(rec)
            buf = b""
    return out


def test_wandb_offline_continues_one_run_and_holds_the_values_of_metrics_jsonl(runs):
    pytest.importorskip("wandb")
    _, killed, _ = runs
    run_id = (killed / "wandb-id").read_text().strip()
    folders = sorted((killed / "wandb").glob("offline-run-*"))
    # one W&B run: the first start and the last (the second was killed at its rollback, before any record)
    assert len(folders) == 2 and all(f.name.endswith(f"-{run_id}") for f in folders)
    last: dict[int, dict] = {}
    for folder in folders:
        for rec in _wandb_records(folder / f"run-{run_id}.wandb"):
            if rec.WhichOneof("record_type") == "history":
                row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
                if "train/step" in row:  # a step logged again (resume, rollback): the later row holds
                    last[row["train/step"]] = row
    recs = read_metrics(killed)
    assert sorted(last) == [r["step"] for r in recs]
    for r in recs:
        for k in ("loss", "grad_norm", "lr", "skipped_steps", "rollbacks", "epoch"):
            assert last[r["step"]][f"train/{k}"] == r[k], (r["step"], k)


def test_a_nan_that_recurs_after_the_rollback_stops_every_rank_with_one_line(shard_dir, tmp_path):
    run_dir = tmp_path / "run"
    r = _train(shard_dir, run_dir, tmp_path, "train.nan_step@5,train.nan_step@6", **{"max-steps": 8})
    assert r.returncode == 1
    line = ("step 6: the run diverged again after rolling back to step 4 (the rollback at step 6); a second "
            "rollback to the same checkpoint would repeat it; stopping.")
    assert r.stderr.count(line) == 2, r.stderr[-3000:]   # both ranks, one line each, no traceback
    assert "[rank0]: Traceback" not in r.stderr and "[rank1]: Traceback" not in r.stderr
    assert CheckpointManager(run_dir / "checkpoints").steps() == [2, 4]  # step 4: rewritten at the rollback
    ck = load_checkpoint(CheckpointManager(run_dir / "checkpoints").latest())
    assert [e["kind"] for e in ck["guard"]["events"]] == ["skip", "skip", "rollback"]
