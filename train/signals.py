"""Graceful stop on cluster preemption: SIGTERM / SIGUSR1 set a flag; the training loop finishes the step it is
in, all ranks agree to stop (any rank's signal counts, since schedulers do not always signal every rank at
once), a checkpoint is written and the process exits 0 (RELIABILITY.md).

A second signal while a stop is already pending is still only recorded: the checkpoint being written must
not be abandoned halfway (SIGKILL remains the way to stop at once, and the atomic writes keep the previous
checkpoint intact).
"""
from __future__ import annotations

import signal
import threading
from types import FrameType

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopRequest:
    """Installs handlers for `signals` on enter and restores the previous ones on exit."""

    def __init__(self, signals: tuple[signal.Signals, ...] = STOP_SIGNALS):
        self.signals = signals
        self.received: signal.Signals | None = None
        self._previous: dict[signal.Signals, object] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signal.Signals(signum)

    @property
    def requested(self) -> bool:
        return self.received is not None

    def __enter__(self) -> "StopRequest":
        # Handlers can only be installed from the main thread (in-process tests may run elsewhere).
        if threading.current_thread() is threading.main_thread():
            for s in self.signals:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)  # type: ignore[arg-type]
        self._previous.clear()
