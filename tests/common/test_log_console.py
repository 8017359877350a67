"""A log line written while a progress bar is shown gets a line of its own (issue #34): the console handler
lifts the bar off its line (tqdm.write), so the message never continues the bar's text."""
from __future__ import annotations

import io
import re
import sys

from tqdm import tqdm

from dit_pipeline.common.log import setup_logging


def test_a_log_line_never_lands_on_the_progress_bar_line(monkeypatch):
    console = io.StringIO()
    monkeypatch.setattr(sys, "stderr", console)
    log = setup_logging(None)
    with tqdm(total=10, file=console, desc="steps", mininterval=0, ascii=True) as bar:
        bar.update(3)
        log.info("checkpoint written")
        bar.update(1)
    text = console.getvalue()
    before = text[:text.index("checkpoint written")]
    assert "3/10" in before  # the bar was drawn before the message
    assert re.search(r"3/10[^\r]*\r +\r$", before), repr(before)  # the bar's line blanked, then the message
    assert "checkpoint written\n" in text and "4/10" in text[text.index("checkpoint written"):]  # bar redrawn below
    setup_logging(None, quiet=True)  # leave no handler on the replaced stream


class _Failing(io.StringIO):
    def __init__(self, error: Exception):
        super().__init__()
        self.error = error

    def write(self, text: str) -> int:
        raise self.error


def test_a_runtime_error_raised_during_a_write_reaches_the_caller(monkeypatch):
    """A RuntimeError raised while a line is written (torch's DataLoader raises one from its SIGCHLD handler, wherever
    the main thread is) propagates to the caller instead of being printed as a "Logging error" traceback and lost;
    the stream's own failures (OSError) stay logging's: reported on stderr, never raised."""
    import pytest

    for error, raised in ((RuntimeError("DataLoader worker (pid 7) is killed by signal: Killed."), True),
                          (OSError(5, "Input/output error"), False)):
        monkeypatch.setattr(sys, "stderr", _Failing(error))
        log = setup_logging(None)  # the console handler writes to the failing stream
        report = io.StringIO()
        monkeypatch.setattr(sys, "stderr", report)  # where logging reports its own errors
        if raised:
            with pytest.raises(RuntimeError, match="pid 7"):
                log.info("a line")
            assert report.getvalue() == ""
        else:
            log.info("a line")
            assert "--- Logging error ---" in report.getvalue() and "Input/output error" in report.getvalue()
    setup_logging(None, quiet=True)


class _Writes(io.StringIO):
    def __init__(self):
        super().__init__()
        self.writes: list[str] = []

    def write(self, text: str) -> int:
        self.writes.append(text)
        return super().write(text)


def test_a_line_and_its_newline_are_one_write(monkeypatch):
    """A RuntimeError that a signal handler raises between two writes of one line (above) would leave the line open,
    and the error line the command prints next would continue it ("... data-wait 0%error: loader worker ..."):
    the console writes each message with its newline at once."""
    stream = _Writes()
    monkeypatch.setattr(sys, "stderr", stream)
    log = setup_logging(None)
    log.info("step 4/8 epoch 0 loss 1.0161")
    assert [w for w in stream.writes if w] == ["step 4/8 epoch 0 loss 1.0161\n"]  # (tqdm adds an empty `end`)
    setup_logging(None, quiet=True)
