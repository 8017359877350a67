"""Graceful stop on cluster preemption and Ctrl-C (docs/RELIABILITY.md).

SIGTERM / SIGUSR1 / a first SIGINT (Ctrl-C) set a flag; the training loop finishes the step it is in, all
ranks agree to stop (any rank's signal counts, since schedulers do not always signal every rank at once), a
checkpoint is written and the process exits 0. The handlers are installed when `dit-train` starts, so a
signal during start-up also ends the run with exit 0 (before the first step there is nothing to save).

A second SIGTERM/SIGUSR1 while a stop is pending is only recorded: the checkpoint being written must not be
abandoned halfway. A second Ctrl-C aborts at once (exit 130) with a line saying that the steps since the last
checkpoint are lost; the atomic writes keep the previous checkpoint intact.

Schedulers signal the whole process group (Slurm's scancel, preemption, Kubernetes), and a terminal sends
Ctrl-C to the whole foreground group, so the loader workers receive every signal too. They ignore all three
(`ignore_in_worker`): the trainer ends them itself when it stops. Because an ignored SIGTERM also defeats
multiprocessing's exit handler (it terminate()s leftover children, then joins them), `reap_children` kills
whatever child processes are left when the trainer exits, so no process of the run survives or hangs it.
"""
from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import os
import signal
import sys
import threading
from types import FrameType
from typing import Callable, Iterator

from dit_pipeline.common import early_signals

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
HANDLED = (*STOP_SIGNALS, signal.SIGINT)
ABORT_EXIT_CODE = 130


def ignore_in_worker(worker_id: int = 0) -> None:
    """worker_init_fn of the loader workers: the group's SIGTERM/SIGUSR1/SIGINT are for the trainer.

    The workers start with these signals blocked (`workers_start_blocked`): torch's worker loop installs a
    SIGTERM handler that ends a worker signalled by anyone but its parent, so a group SIGTERM arriving between
    the fork and this function killed the worker and the trainer failed ("worker exited unexpectedly").
    A signal that arrived meanwhile stays pending and is discarded when unblocked, as it is ignored by then."""
    for s in HANDLED:
        signal.signal(s, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, HANDLED)


@contextlib.contextmanager
def workers_start_blocked() -> Iterator[None]:
    """Block SIGTERM/SIGUSR1/SIGINT in this thread while loader workers are forked (they inherit the mask);
    signals that arrive meanwhile are delivered to the trainer's handlers right after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, HANDLED)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def reap_children() -> None:
    """Kill the child processes still alive (loader workers whose iterator was never shut down); they hold
    nothing that needs saving. Registered at exit, before multiprocessing's own exit handler would hang
    joining workers that ignore SIGTERM."""
    for child in multiprocessing.active_children():
        with contextlib.suppress(Exception):
            child.kill()
            child.join(timeout=10)


atexit.register(reap_children)


class StopRequest:
    """Installs handlers for SIGTERM, SIGUSR1 and SIGINT on enter and restores the previous ones on exit.

    `lost` is called on a second Ctrl-C for the words that say what the abort loses.
    """

    def __init__(self, signals: tuple[signal.Signals, ...] = HANDLED, *, announce: bool = True):
        self.signals = signals
        self.announce = announce
        self.received: signal.Signals | None = None
        self.lost: Callable[[], str] = lambda: "the steps since the last checkpoint are lost"
        self._previous: dict[signal.Signals, object] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        sig = signal.Signals(signum)
        if sig == signal.SIGINT and self.received == signal.SIGINT:
            self._abort()
        if self.received is None:
            self.received = sig
            if sig == signal.SIGINT and self.announce:
                _say("Ctrl-C: finishing the current step, writing a checkpoint and exiting "
                     "(Ctrl-C again aborts at once, losing the steps since the last checkpoint)")
        elif sig == signal.SIGINT:  # Ctrl-C after SIGTERM: a first Ctrl-C all the same
            self.received = sig

    def _abort(self) -> None:
        _say(f"aborted by a second Ctrl-C: {self.lost()}")
        reap_children()
        sys.stdout.flush()
        os._exit(ABORT_EXIT_CODE)

    @property
    def requested(self) -> bool:
        return self.received is not None

    def __enter__(self) -> "StopRequest":
        # Handlers can only be installed from the main thread (in-process tests may run elsewhere).
        if threading.current_thread() is threading.main_thread():
            for s in self.signals:
                self._previous[s] = signal.signal(s, self._handle)
            for s in early_signals.received:  # signals that arrived while the command was starting
                self._handle(int(s), None)
            early_signals.received.clear()
        return self

    def __exit__(self, *exc: object) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)  # type: ignore[arg-type]
        self._previous.clear()


def _say(line: str) -> None:
    from dit_pipeline.common import distributed as dist

    try:
        rank = dist.rank()
    except Exception:  # noqa: BLE001 - a signal handler never raises
        rank = 0
    prefix = f"[rank {rank}] " if rank else ""
    with contextlib.suppress(Exception):
        os.write(2, f"\n{prefix}{line}\n".encode())
