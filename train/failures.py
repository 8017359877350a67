"""One clear line, in the run's logs as well as on the console, when a process of the run is killed from outside:
a loader worker (in its rank) or a whole rank (in the `dit-train --nproc-per-node` launcher).

The usual killer is the kernel's out-of-memory killer, which sends SIGKILL (an exit status of -9) and leaves a
line in `dmesg`; the memory is the host's (loader workers hold their shuffle buffers and the shards they read),
not the GPU's. torch reports a dead loader worker as a RuntimeError from its SIGCHLD handler, raised wherever the
trainer happens to be (a 24-frame traceback ending inside a checkpoint's fsync, say), or from the next batch
fetch; torchrun reports a dead rank as a `ChildFailedError`. Both become one line here, naming the process and
the signal, saying the likely cause and that rerunning the same command resumes from the newest checkpoint
(nothing of a completed checkpoint is lost: they are written atomically). The exit status stays non-zero.
"""
from __future__ import annotations

import contextlib
import logging
import re
import signal
from typing import Any, Iterator

from dit_pipeline.common import distributed as dist
from dit_pipeline.common.errors import UserError
from dit_pipeline.common.log import log_to_files

# torch's two messages (torch/csrc/DataLoader.cpp and torch.utils.data.dataloader):
# "DataLoader worker (pid 123) is killed by signal: Killed. " (strsignal's name)
# "DataLoader worker (pid 123) exited unexpectedly with exit code 1. Details are lost ..."
# "DataLoader worker (pid(s) 123, 456) exited unexpectedly"
_WORKER = re.compile(r"DataLoader worker \(pid(?:\(s\))? ([\d, ]+)\) (?:is killed by signal: ([^.]+)\."
                     r"|exited unexpectedly(?: with exit code (-?\d+))?)")
_BY_DESCRIPTION = {signal.strsignal(s): s.name for s in signal.Signals if signal.strsignal(s)}
RESUMES = "rerunning the same command resumes from the newest checkpoint"


class ProcessKilled(UserError):
    """A loader worker or a rank of the run was killed (its line is already in the run's logs)."""


def likely_cause(signame: str | None, cfg: Any = None) -> str:
    """What a process dying by `signame` (None: it ended without saying how) most likely means, and what to do."""
    knobs = (f"fewer --num-workers (now {cfg.num_workers}) or a smaller --shuffle-buffer (now {cfg.shuffle_buffer})"
             if cfg is not None and getattr(cfg, "num_workers", None) is not None
             else "fewer --num-workers or a smaller --shuffle-buffer")
    if signame == "SIGKILL":
        return (f"most likely the kernel's out-of-memory killer (host memory, not GPU memory; `dmesg` names the "
                f"process it killed): use {knobs}")
    if signame == "SIGBUS":
        return "most likely out of shared memory (/dev/shm, where loader workers pass batches): raise its size"
    if signame is None:
        return f"if `dmesg` shows the out-of-memory killer, use {knobs}"
    return "sent by another process or the scheduler"


def worker_death(e: BaseException, cfg: Any = None) -> str | None:
    """The line for torch's report of a dead loader worker, or None for any other error."""
    m = _WORKER.search(str(e)) if isinstance(e, RuntimeError) else None
    if m is None:
        return None
    pids, described, code = m.groups()
    signame = _BY_DESCRIPTION.get(described.strip(), described.strip()) if described else None
    if signame is None and code is None:
        code = _exit_code(e)  # torch's other path names no code: its failed workers know theirs
    if signame is None and code is not None and int(code) < 0:
        with contextlib.suppress(ValueError):
            signame = signal.Signals(-int(code)).name
    how = (f"was killed by {signame}" if signame else
           f"exited unexpectedly with exit code {code}" if code is not None else "exited unexpectedly")
    pids = pids.strip()
    who = f"loader workers (pids {pids})" if "," in pids else f"loader worker (pid {pids})"
    rank = f" of rank {dist.rank()}" if dist.world_size() > 1 else ""
    return f"{who}{rank} {how}: {likely_cause(signame, cfg)}; {RESUMES}"


def _exit_code(e: BaseException) -> str | None:
    """The exit code of the worker(s) torch reported as "exited unexpectedly" without one: which of torch's two
    checks notices a dead worker first is a race (its SIGCHLD handler says "is killed by signal", the queue's
    liveness check only the pids), but the liveness check holds the dead workers (`failed_workers`, multiprocessing
    Processes whose exitcode is -N for a signal N) in its frame of the traceback."""
    tb = e.__traceback__
    while tb is not None:
        failed = tb.tb_frame.f_locals.get("failed_workers")
        codes = {getattr(w, "exitcode", None) for w in failed} if isinstance(failed, list) and failed else set()
        if len(codes) == 1 and (only := codes.pop()) is not None:
            return str(only)
        tb = tb.tb_next
    return None


@contextlib.contextmanager
def failures_logged(cfg: Any) -> Iterator[None]:
    """Around a training run (a TrainConfig): a killed loader worker becomes one `ProcessKilled` line, and that
    line and every other user-facing error also go to the run's log files once they exist (the console shows
    them once, from the CLI)."""
    try:
        yield
    except RuntimeError as e:
        line = worker_death(e, cfg)
        if line is None:
            raise
        log_to_files(line, logging.ERROR, under=cfg.run_dir)
        raise ProcessKilled(line) from None
    except UserError as e:
        log_to_files(str(e), logging.ERROR, under=cfg.run_dir)
        raise


def rank_death(rank: int, failure: Any) -> str:
    """The line for a rank torchrun saw fail (a `ProcessFailure`: local_rank, pid, exitcode)."""
    who = f"rank {rank} (local rank {failure.local_rank}, pid {failure.pid})"
    if failure.exitcode < 0:
        with contextlib.suppress(ValueError):
            signame = signal.Signals(-failure.exitcode).name
            return f"{who} was killed by {signame}: {likely_cause(signame)}; {RESUMES}"
        return f"{who} was killed by signal {-failure.exitcode}; {RESUMES}"
    return f"{who} exited with code {failure.exitcode}: its error is above and in RUN/logs/rank{rank}.log"


def root_failure(failures: dict[int, Any]) -> tuple[int, Any]:
    """The failure to name: a rank killed by a signal (the others then fail on its absence), else the first."""
    killed = {r: f for r, f in failures.items() if f.exitcode < 0}
    pool = killed or failures
    return min(pool.items(), key=lambda item: (item[1].timestamp, item[0]))


__all__ = ["ProcessKilled", "failures_logged", "likely_cause", "rank_death", "root_failure", "worker_death"]
