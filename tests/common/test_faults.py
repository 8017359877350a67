import errno
import subprocess
import sys

import pytest

from dit_pipeline.common import faults


def test_no_env_is_noop(monkeypatch):
    monkeypatch.delenv("DIT_FAULT", raising=False)
    for _ in range(3):
        faults.fault_point("x")
    assert not faults.fault_requested("x")


def test_nth_occurrence_enospc(monkeypatch):
    monkeypatch.setenv("DIT_FAULT", "disk@3:enospc")
    monkeypatch.setattr(faults, "_counts", faults.Counter())
    faults.fault_point("disk")
    faults.fault_point("disk")
    faults.fault_point("other")
    with pytest.raises(OSError) as e:
        faults.fault_point("disk")
    assert e.value.errno == errno.ENOSPC
    faults.fault_point("disk")  # only the 3rd occurrence fires


def test_rank_filter(monkeypatch):
    monkeypatch.setattr(faults, "_counts", faults.Counter())
    monkeypatch.setenv("DIT_FAULT", "p:nan")
    monkeypatch.setenv("DIT_FAULT_RANK", "1")
    monkeypatch.setenv("RANK", "0")
    assert not faults.fault_requested("p")
    monkeypatch.setenv("RANK", "1")
    assert faults.fault_requested("p")


def test_kill_really_kills():
    code = "from common.faults import fault_point; fault_point('a'); fault_point('a'); print('survived')"
    res = subprocess.run([sys.executable, "-c", code], env={"DIT_FAULT": "a@2:kill", "PATH": ""},
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == -9 and "survived" not in res.stdout
