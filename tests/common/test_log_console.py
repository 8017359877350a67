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
