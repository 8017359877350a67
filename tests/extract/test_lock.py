"""The lease on dit-extract's --out (common/runlock.py, OUT/.extract.lock), with real processes: a second run of
the same command while the first is alive is refused naming the first (it used to delete the first run's live
temp file as "left by an interrupted run"); a killed holder's lease is taken over with a warning; 2 ranks hold
one lease (rank 0's) and both learn a refusal."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time

from dit_pipeline.common.runlock import EXTRACT_LOCK_NAME
from tests._util import BIN, cli_env, rank_pids, run_cli, torchrun_cmd
from tests.extract.conftest import cli_args
from tests.extract.test_processes import _same_shard_set
from tests.train.signal_rounds import HANG_GUARD_S, wait_stopped

STOP = {"DIT_FAULT": "extract.sample_written@2:stop"}  # inside shard 0: its temp file is open


def _refusal(out, holder: dict) -> str:
    return (f"{out} is in use by another live run (dit-extract on host {holder['host']}, pid {holder['pid']}, "
            f"started {holder['started']}); stop it first or use another --out (a run that died releases its lock "
            f"{EXTRACT_LOCK_NAME} at once on the same host, else after 120 s without a heartbeat)")


def _start_stopped(args, env=STOP) -> subprocess.Popen:
    proc = subprocess.Popen([str(BIN / "dit-extract"), *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=cli_env(env), start_new_session=True)
    wait_stopped(proc.pid)
    return proc


def test_a_live_extraction_refuses_a_second_one_and_keeps_its_temp_file(odd_tree, tiny_vae_dir, odd_baseline,
                                                                       tmp_path):
    out = tmp_path / "out"
    args = cli_args(odd_tree, tiny_vae_dir, out)
    first = _start_stopped(args)
    try:
        holder = json.loads((out / EXTRACT_LOCK_NAME).read_text())
        assert (holder["what"], holder["host"], holder["pid"]) == ("dit-extract", socket.gethostname(), first.pid)
        temps = {p.name: p.stat().st_ino for p in out.glob(".tmp-shard-000000.tar.*")}
        assert len(temps) == 1
        second = run_cli("dit-extract", args)
        assert second.returncode == 1
        assert second.stderr == f"error: {_refusal(out, holder)}\n"
        assert {p.name: p.stat().st_ino for p in out.glob(".tmp-shard-000000.tar.*")} == temps  # untouched
    finally:
        os.kill(first.pid, signal.SIGCONT)
    _, err = first.communicate(timeout=HANG_GUARD_S)
    assert first.returncode == 0, err[-3000:]
    _same_shard_set(out, *odd_baseline[::2])
    assert not (out / EXTRACT_LOCK_NAME).exists()  # released at the end


def test_a_killed_extraction_never_blocks_its_rerun(odd_tree, tiny_vae_dir, odd_baseline, tmp_path):
    out = tmp_path / "out"
    args = cli_args(odd_tree, tiny_vae_dir, out)
    first = _start_stopped(args)
    holder = json.loads((out / EXTRACT_LOCK_NAME).read_text())
    os.kill(first.pid, signal.SIGKILL)
    first.communicate(timeout=HANG_GUARD_S)
    rerun = run_cli("dit-extract", args)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    warning = (f"WARNING --out {out}: took over the output folder's lock from an earlier run that is not running any "
               f"more (its process is gone: dit-extract on host {holder['host']}, pid {holder['pid']}, started "
               f"{holder['started']})\n")
    assert warning in (out / "logs" / "rank0.log").read_text()
    _same_shard_set(out, *odd_baseline[::2])
    assert sorted(p.name for p in out.glob(f"{EXTRACT_LOCK_NAME}*")) == []


def test_two_ranks_hold_one_lease_and_every_rank_learns_the_refusal(odd_tree, tiny_vae_dir, tmp_path):
    out = tmp_path / "out"
    args = cli_args(odd_tree, tiny_vae_dir, out)
    first = subprocess.Popen(torchrun_cmd("dit-extract", args, 2), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env=cli_env({**STOP, "DIT_FAULT_RANK": "0"}), start_new_session=True)
    ranks: dict[int, int] = {}
    try:
        end = time.monotonic() + HANG_GUARD_S
        while len(ranks := rank_pids(first.pid)) < 2 and time.monotonic() < end:
            time.sleep(0.1)
        wait_stopped(ranks[0])
        holder = json.loads((out / EXTRACT_LOCK_NAME).read_text())
        assert holder["pid"] == ranks[0]  # one lease, held by rank 0
        assert sorted(p.name for p in out.iterdir() if "lock" in p.name) == [EXTRACT_LOCK_NAME]
        second = subprocess.run(torchrun_cmd("dit-extract", args, 2), capture_output=True, text=True,
                                env=cli_env(), timeout=HANG_GUARD_S)
        assert second.returncode != 0
        assert f"[rank 0] error: {_refusal(out, holder)}\n" in second.stderr
        assert f"[rank 1] error: (reported by rank 0) {_refusal(out, holder)}\n" in second.stderr
        assert "[rank0]: Traceback" not in second.stderr and "[rank1]: Traceback" not in second.stderr
    finally:  # torchrun starts each rank in a session of its own
        for pid in [*ranks.values(), first.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        first.communicate(timeout=HANG_GUARD_S)
