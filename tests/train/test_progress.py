"""The progress bar draws on a terminal only: redirected to a file or a pipe (a batch job's log) stderr gets the
log lines and no tqdm redraws (they were 137 KB of carriage-return updates per 2,000 steps)."""
from __future__ import annotations

import errno
import fcntl
import os
import struct
import subprocess
import termios

from tests._util import BIN, cli_env
from tests.train.conftest import tiny_args

STEPS = {"max-steps": 30, "log-every": 10, "ckpt-every": 30, "num-workers": 0}


def _log_lines(run_dir) -> list[str]:
    """log.txt's messages (after the timestamp and level), the plan's continuation lines as they are."""
    out = []
    for line in (run_dir / "log.txt").read_text().splitlines():
        parts = line.split(" ", 3)
        out.append(parts[3] if len(parts) == 4 and parts[2] in ("INFO", "WARNING") else line)
    return out


def test_no_redraws_when_stderr_is_a_file(shard_dir, tmp_path):
    run_dir = tmp_path / "run"
    with open(tmp_path / "stderr.txt", "wb") as err:
        r = subprocess.run([str(BIN / "dit-train"), *tiny_args(shard_dir, run_dir, **STEPS)], stdout=subprocess.PIPE,
                           stderr=err, env=cli_env(), timeout=300)
    data = (tmp_path / "stderr.txt").read_bytes()
    assert r.returncode == 0, data[-3000:]
    assert b"\r" not in data and b"it/s" not in data
    # every byte is a log line, exactly the messages of log.txt
    assert data.decode().splitlines() == _log_lines(run_dir)
    assert sum(1 for line in data.decode().splitlines() if line.startswith("step ")) == 3


def test_a_terminal_still_gets_the_bar(shard_dir, tmp_path):
    run_dir = tmp_path / "run"
    master, slave = os.openpty()
    # a terminal 120 columns wide (a new pty has 0 columns, where tqdm draws an empty bar)
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    proc = subprocess.Popen([str(BIN / "dit-train"), *tiny_args(shard_dir, run_dir, **STEPS)], stdout=subprocess.DEVNULL,
                            stderr=slave, env=cli_env())
    os.close(slave)
    chunks = []
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError as e:  # EIO: the terminal's other end closed
            assert e.errno == errno.EIO
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(master)
    assert proc.wait(timeout=300) == 0
    data = b"".join(chunks)
    assert b"\rtrain: " in data and b"30/30" in data
