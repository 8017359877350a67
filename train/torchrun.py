"""`python -m dit_pipeline.train.torchrun ARGS`: torchrun (`torch.distributed.run`) as the `dit-train
--nproc-per-node N` launcher runs it, with its failure said in one line.

torchrun ends a failed job with a Python traceback of its own and a summary of the failed ranks; the rank whose
death started it (often one killed by SIGKILL, the out-of-memory killer's signal) is named there among the ranks
that merely lost it. Here torchrun runs unchanged, and on failure its summary is printed without the traceback,
followed by one line naming the rank, its pid and the signal with the likely cause (train/failures.py), which is
also appended to the run's log (the file in DIT_LAUNCH_LOG, RUN/log.txt); the exit status is 1, as torchrun's.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Sequence

from dit_pipeline.train.launch import LOG_ENV  # set by train.launch.launch


def _append(log_file: str, line: str) -> None:
    """One ERROR line in the format of the run's log (common/log.py); never fails the exit path."""
    try:
        path = Path(log_file)
        if path.parent.is_dir():
            with open(path, "a", encoding="utf-8") as f:
                f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} ERROR {line}\n")
    except OSError:
        pass


def main(argv: Sequence[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    from dit_pipeline.train.failures import rank_death, root_failure

    try:
        torchrun_main(list(sys.argv[1:] if argv is None else argv))
    except ChildFailedError as e:
        line = rank_death(*root_failure(e.failures))
        print(e.format_msg(), file=sys.stderr)
        print(f"error: {line}", file=sys.stderr, flush=True)
        if os.environ.get(LOG_ENV):
            _append(os.environ[LOG_ENV], line)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
