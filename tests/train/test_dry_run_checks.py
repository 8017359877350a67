"""What the plan says before any work (issue #34): `dit-train --dry-run` meets the run folder's lease as the real
run does (a live run's lease is the real run's refusal, a dead run's lease a plan line saying it would be taken
over; the dry run touches neither), and one line when the latents are far from unit std."""
from __future__ import annotations

import json
import re

from click.testing import CliRunner

from dit_pipeline.cli import train_main
from dit_pipeline.common.runlock import LOCK_NAME, RunLock
from tests.common.test_runlock import _foreign_lock
from tests.train.conftest import SHARD_SIZES, shard_dir, tiny_args  # noqa: F401 (fixture)
from tests.train.helpers import make_shard_set


def _dry_run(shards, run):
    return CliRunner().invoke(train_main, [str(a) for a in tiny_args(shards, run, **{"dry-run": True,
                                                                                       "num-workers": 0})])


def test_the_dry_run_refuses_a_live_runs_folder_and_names_a_dead_runs_lease(shard_dir, tmp_path):
    run = tmp_path / "run"
    with RunLock(run, "dit-train") as held:  # this test process plays the live run
        r = _dry_run(shard_dir, run)
        rec = held._record
        before = (run / LOCK_NAME).read_bytes()
    assert r.exit_code == 1, r.output
    assert r.output.strip().splitlines()[-1] == (
        f"error: {run} is in use by another live run (dit-train on host {rec['host']}, pid {rec['pid']}, "
        f"started {rec['started']}); stop it first or use another --run-dir (a run that died releases its lock "
        f"run.lock at once on the same host, else after 120 s without a heartbeat)")
    assert "would start" not in r.output
    _foreign_lock(run, heartbeat_age=500)  # a dead node's lease
    before = (run / LOCK_NAME).read_bytes()
    r = _dry_run(shard_dir, run)
    assert r.exit_code == 0, r.output
    assert re.search(r"^  lock        would take over the run folder's lock from an earlier run that is not running "
                     r"any more \(no heartbeat for 5\d\d s: dit-train on host other-node-17, pid 4321, started then\)$",
                     r.output, re.M), r.output
    assert (run / LOCK_NAME).read_bytes() == before and json.loads(before)["pid"] == 4321  # untouched


def test_the_plan_names_latents_far_from_unit_std_and_the_command_that_fixes_them(tmp_path):
    from dit_pipeline.shards import read_manifest
    from dit_pipeline.shards.stats import compute_stats, first_samples_std, format_stats

    far = tmp_path / "far"
    make_shard_set(far, samples=SHARD_SIZES, latent_shape=(4, 8, 8), scaling_factor=0.5)
    std, used, shard = first_samples_std(far, read_manifest(far))
    assert (used, shard) == (16, "shard-000000.tar") and 0.2 < std < 0.4
    hint = (f"dit-shards stats {far} --write scalar (one factor), --write per-channel (each channel's mean and "
            "std) or --write per-position (each channel and position: feature spaces) records it as a new manifest "
            "revision")
    r = _dry_run(far, tmp_path / "run1")
    assert r.exit_code == 0, r.output
    assert f"  latents     std {std:.3g} over the first 16 samples of shard-000000.tar: NOT near 1 (DiT assumes " \
           f"~1); {hint}" in r.output.splitlines()
    assert f"  to train on unit std: {hint}" in format_stats(compute_stats(far), far).splitlines()
    unit = tmp_path / "unit"
    make_shard_set(unit, samples=SHARD_SIZES, latent_shape=(4, 8, 8), scaling_factor=0.5 / std)
    assert abs(first_samples_std(unit, read_manifest(unit))[0] - 1) < 1e-3
    r = _dry_run(unit, tmp_path / "run2")
    assert r.exit_code == 0 and "  latents  " not in r.output and "NOT near 1" not in r.output, r.output
    assert "to train on unit std" not in format_stats(compute_stats(unit), unit)
