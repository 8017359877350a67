"""`dit-train --dry-run` meets the run folder's lease as the real run does (issue #34): a live run's lease is the
real run's refusal, a dead run's lease a plan line saying it would be taken over; the dry run touches neither."""
from __future__ import annotations

import json
import re

from click.testing import CliRunner

from dit_pipeline.cli import train_main
from dit_pipeline.common.runlock import LOCK_NAME, RunLock
from tests.common.test_runlock import _foreign_lock
from tests.train.conftest import shard_dir, tiny_args  # noqa: F401 (fixture)


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
