"""Logging setup for the command-line tools (never imported by `dit/`).

Rank 0 logs to the console (unless quiet) and every rank to its own file, e.g. OUT/logs/rank3.log, so a
failure on rank 5 of 64 is readable after the fact. Messages carry the rank when there is more than one.
"""
from __future__ import annotations

import logging
import sys
from pathlib import Path

from dit_pipeline.common import distributed as dist

LOGGER_NAME = "dit_pipeline"


def get_logger() -> logging.Logger:
    return logging.getLogger(LOGGER_NAME)


class _RaisesSignalled:
    """logging's policy is to report an error raised while a record is written and carry on. A RuntimeError that a
    signal handler raised during the write is the caller's, not the handler's: torch's DataLoader raises "worker
    (pid N) is killed by signal" from its SIGCHLD handler wherever the main thread is, and inside a log call it was
    printed as a "--- Logging error ---" traceback and lost. It propagates to the caller instead, like one raised
    anywhere else (RecursionError, a RuntimeError too, logging re-raises itself)."""

    def handleError(self, record: logging.LogRecord) -> None:
        if isinstance(sys.exc_info()[1], RuntimeError):
            raise  # noqa: PLE0704 - called inside the emitting handler's except block
        super().handleError(record)  # type: ignore[misc]


class ConsoleHandler(_RaisesSignalled, logging.StreamHandler):
    """The console's handler: each line through `tqdm.write`, which lifts a progress bar drawn on the same stream
    off its line, writes the message on a line of its own and redraws the bar below it (a plain write when no
    bar is shown). The message and its newline go out in one write: a signal handler that raises between two
    writes (_RaisesSignalled) would leave the line open, and the error line printed next would continue it."""

    def emit(self, record: logging.LogRecord) -> None:
        from tqdm.auto import tqdm

        try:
            tqdm.write(self.format(record) + "\n", file=self.stream, end="")
            self.flush()
        except Exception:  # noqa: BLE001 - logging's own policy: report, never raise (but _RaisesSignalled)
            self.handleError(record)


class FileHandler(_RaisesSignalled, logging.FileHandler):
    """A log file's handler (logging.FileHandler with _RaisesSignalled's rule)."""


def setup_logging(log_dir: str | Path | None = None, *, quiet: bool = False,
                  main_log: str | Path | None = None) -> logging.Logger:
    """Configure the project logger for this process; idempotent.

    log_dir: folder for `rank{r}.log`; main_log: an extra file that rank 0 also writes (e.g. RUN/log.txt).
    """
    logger = get_logger()
    for h in list(logger.handlers):
        logger.removeHandler(h)
        h.close()
    logger.setLevel(logging.INFO)
    logger.propagate = False
    r, ws = dist.rank(), dist.world_size()
    prefix = f"[rank {r}] " if ws > 1 else ""
    fmt_file = logging.Formatter(f"%(asctime)s {prefix}%(levelname)s %(message)s", "%Y-%m-%d %H:%M:%S")
    if r == 0 and not quiet:
        console = ConsoleHandler(sys.stderr)
        console.setFormatter(logging.Formatter("%(message)s"))
        console.setLevel(logging.INFO)
        logger.addHandler(console)
    elif not quiet:
        # Other ranks still surface warnings and errors on the console, tagged with their rank.
        console = ConsoleHandler(sys.stderr)
        console.setFormatter(logging.Formatter(f"{prefix}%(message)s"))
        console.setLevel(logging.WARNING)
        logger.addHandler(console)
    if log_dir is not None:
        log_dir = Path(log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
        fh = FileHandler(log_dir / f"rank{r}.log")
        fh.setFormatter(fmt_file)
        logger.addHandler(fh)
    if main_log is not None and r == 0:
        Path(main_log).parent.mkdir(parents=True, exist_ok=True)
        mh = FileHandler(main_log)
        mh.setFormatter(fmt_file)
        logger.addHandler(mh)
    return logger


def log_to_files(message: str, level: int = logging.ERROR, under: str | Path | None = None) -> None:
    """`message` into this process's log files only (rank log, RUN/log.txt; with `under`, only those inside that
    folder), for an error that the command line prints once on the console."""
    logger = get_logger()
    record = logger.makeRecord(logger.name, level, __file__, 0, "%s", (message,), None)
    inside = Path(under).expanduser().resolve() if under is not None else None
    for h in logger.handlers:
        if not isinstance(h, logging.FileHandler) or level < h.level:
            continue
        if inside is None or inside in Path(h.baseFilename).resolve().parents:
            h.handle(record)


def stderr_is_terminal() -> bool:
    """Whether stderr (where tqdm draws) is a terminal."""
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced or closed
        return False


def progress_enabled(quiet: bool = False) -> bool:
    """tqdm bars only on rank 0, only when not quiet, and only on a terminal: a bar redraws itself with carriage
    returns, which a log file or a pipe (a batch job's output) keeps as noise, about 70 bytes per update."""
    return dist.is_main() and not quiet and stderr_is_terminal()
