"""The style-2 Slurm batch script of docs/clusters.md, run as written (extracted from the page) by bash with stand-ins for
the Slurm and torch launchers on PATH, and real processes:

- `scontrol listpids JOB` prints, in Slurm's format, the PIDs this "job" started (its srun, torchrun and ranks,
  plus an `extern` row of PID -1 as real Slurm prints), never those of the other job;
- `srun CMD` runs CMD and exits with its status (or FAKE_SRUN_RC);
- `torchrun ... ENTRY ARGS` starts two ranks `python -u ENTRY ARGS`, as torchrun does, and exits with the
  worst rank status; it keeps Python's default SIGUSR1 action, so a USR1 meant for the ranks kills it;
- `dit-train` (a rank) writes a ready file, and on SIGUSR1 a file saying so and exits 0.
A second "job" of the same torchrun and ranks runs on the same machine outside the batch script.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests._docs import blocks

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="bash, ps and /proc: the Slurm nodes' platform")

JOB_ID = "4242"

RANK = """#!{python}
import os, signal, sys, time
state = os.environ["FAKE_STATE"]
def stop(*_):
    open(os.path.join(state, f"usr1-{{os.getpid()}}"), "w").close()
    sys.exit(0)
signal.signal(signal.SIGUSR1, stop)
if os.environ.get("FAKE_RANK_RC"):
    sys.exit(int(os.environ["FAKE_RANK_RC"]))
open(os.path.join(state, f"ready-{{os.getpid()}}"), "w").close()
time.sleep(120)
sys.exit(5)
"""

TORCHRUN = """#!{python}
import os, subprocess, sys
args = sys.argv[1:]
at = next(i for i, a in enumerate(args) if a.endswith("/dit-train"))
ranks = [subprocess.Popen([sys.executable, "-u", *args[at:]]) for _ in range(2)]
with open(os.environ["FAKE_JOB_PIDS"], "a") as f:
    f.write("".join(f"{{p.pid}}\\n" for p in ranks))
sys.exit(max(abs(p.wait()) for p in ranks))
"""

SRUN = """#!/bin/bash
echo $$ >> "$FAKE_JOB_PIDS"
"$@" &
child=$!
echo $child >> "$FAKE_JOB_PIDS"
wait $child
rc=$?
exit ${FAKE_SRUN_RC:-$rc}
"""

SCONTROL = """#!/bin/bash
[ "$1" = listpids ] && [ "$2" = "$SLURM_JOB_ID" ] || { echo "unexpected: scontrol $*" >&2; exit 9; }
echo "PID      JOBID    STEPID   LOCALID GLOBALID"
echo "-1       $2    extern   0       0"
echo "$(cat "$FAKE_BATCH_PID_FILE") $2    batch    0       0"
while read -r pid; do echo "$pid  $2    batch    -       -"; done < "$FAKE_JOB_PIDS"
"""


def batch_script() -> str:
    [script] = [b.body for b in blocks("docs/clusters.md") if b.body.startswith("#!/bin/bash\n")]
    return script


def _tools(tmp_path: Path) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("dit-train", RANK), ("torchrun", TORCHRUN), ("srun", SRUN), ("scontrol", SCONTROL)):
        (bin_dir / name).write_text(text.format(python=sys.executable) if "{python}" in text else text)
        (bin_dir / name).chmod(0o755)
    state = tmp_path / "state"
    state.mkdir()
    # COLUMNS as a terminal (or pytest-xdist) sets it: ps would cut its lines to 80 columns without -ww
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_STATE": str(state), "SLURM_JOB_ID": JOB_ID,
            "COLUMNS": "80"}


def _ready(state: Path, n: int, timeout: float = 60) -> set[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids = {int(p.name.split("-")[1]) for p in state.glob("ready-*")}
        if len(pids) >= n:
            return pids
        time.sleep(0.05)
    raise AssertionError(f"only {len(pids)} of {n} ranks started")


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


def _run_job(tmp_path: Path, env: dict[str, str], **extra: str) -> subprocess.Popen:
    script = tmp_path / "job.sh"
    script.write_text(batch_script())
    (tmp_path / "job-pids").write_text("")
    job = subprocess.Popen(["bash", str(script)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           env={**os.environ, **env, "FAKE_JOB_PIDS": str(tmp_path / "job-pids"),
                                "FAKE_BATCH_PID_FILE": str(tmp_path / "batch-pid"), **extra},
                           start_new_session=True)
    (tmp_path / "batch-pid").write_text(str(job.pid))  # scontrol lists the batch shell too; the trap spares it
    return job


def _end(proc: subprocess.Popen | None) -> None:
    """Kill what a test started and is still running (each started in its own session: its group only)."""
    if proc is None:
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def test_the_script_scopes_its_signal_to_this_job():
    """Checked before the script runs: its trap must never reach past this job's PIDs (a pkill pattern reaches
    every matching process of the machine: other jobs' ranks, other users' tests)."""
    script = batch_script()
    assert "pkill" not in script and "killall" not in script
    assert 'scontrol listpids "$SLURM_JOB_ID"' in script


@pytest.mark.timeout(300)
@pytest.mark.parametrize("srun_rc", [0, 3])
def test_usr1_reaches_only_this_jobs_ranks_and_the_script_exits_with_sruns_status(tmp_path, srun_rc):
    """The batch shell gets USR1 (as --signal=B:USR1@300 sends it) while another job's ranks, identical in name
    and arguments, run on the node: exactly this job's two ranks get it (not its srun or torchrun, which
    would die of it), the other job runs on, and the script exits with srun's status (0, or 3 when srun
    fails after the ranks stopped)."""
    test_the_script_scopes_its_signal_to_this_job()
    env = _tools(tmp_path)
    state = Path(env["FAKE_STATE"])
    neighbour = subprocess.Popen([sys.executable, str(tmp_path / "bin" / "torchrun"), "--nnodes", "4",
                                  str(tmp_path / "bin" / "dit-train"), "--run-dir", "/shared/runs/other"],
                                 env={**os.environ, **env, "FAKE_JOB_PIDS": str(tmp_path / "other-pids")},
                                 start_new_session=True)
    job = None
    try:
        theirs = _ready(state, 2)
        job = _run_job(tmp_path, env, **({"FAKE_SRUN_RC": str(srun_rc)} if srun_rc else {}))
        mine = _ready(state, 4) - theirs
        assert len(mine) == 2 and mine <= {int(p) for p in (tmp_path / "job-pids").read_text().split()}
        os.kill(job.pid, signal.SIGUSR1)
        out, _ = job.communicate(timeout=120)
        assert job.returncode == srun_rc, out
        assert {int(p.name.split("-")[1]) for p in state.glob("usr1-*")} == mine, out
        assert not any(_alive(p) for p in mine)
        assert all(_alive(p) for p in theirs) and neighbour.poll() is None, "the other job was stopped"
    finally:
        _end(job)
        _end(neighbour)


@pytest.mark.timeout(300)
def test_a_failed_run_fails_the_batch_script(tmp_path):
    """The ranks exit 3, so torchrun and srun do: the batch script exits 3, and Slurm records the job FAILED,
    not COMPLETED 0:0."""
    job = _run_job(tmp_path, _tools(tmp_path), FAKE_RANK_RC="3")
    try:
        out, _ = job.communicate(timeout=120)
        assert job.returncode == 3, out
    finally:
        _end(job)
