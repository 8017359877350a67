"""Record SIGTERM / SIGUSR1 / SIGINT from a command's first line on, before the heavy imports (torch takes
seconds to import on a loaded node): a scheduler's signal during start-up is then handled like one during
training (train/signals.py's StopRequest adopts it) instead of killing the process with the default action."""
from __future__ import annotations

import signal
import threading
from types import FrameType

SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
received: list[signal.Signals] = []


def _record(signum: int, frame: FrameType | None) -> None:
    received.append(signal.Signals(signum))


def install() -> None:
    """Install the recording handlers (main thread only; a no-op elsewhere)."""
    if threading.current_thread() is threading.main_thread():
        for s in SIGNALS:
            signal.signal(s, _record)
