"""How the loader workers start: forked on Linux, whatever the Python version's default start method.

Python 3.14 made `forkserver` the default start method on Linux (it was `fork`; see "What's New In Python
3.14", multiprocessing), and a torch DataLoader without a `multiprocessing_context` takes the default. The
trainer's loader relies on fork: its workers inherit the signal mask that keeps a group SIGTERM from killing
one while it starts (`train.signals.workers_start_blocked`), and they start in milliseconds instead of importing
torch again. Forking after CUDA is initialised is safe here: the workers never touch CUDA (they read shards or
decode images into CPU memory; pinning happens in the main process). `dit-shards verify` keeps its own,
stricter choice (shards/verify.py: a pool that may be created inside a GPU job spawns once CUDA is up).
"""
from __future__ import annotations

import multiprocessing
import sys
from multiprocessing.context import BaseContext


def worker_context() -> BaseContext | None:
    """The `multiprocessing_context` of our DataLoaders: fork on Linux; elsewhere None (the platform default,
    spawn on macOS and Windows, where fork is unsafe or missing)."""
    if sys.platform.startswith("linux"):
        return multiprocessing.get_context("fork")
    return None
