"""TensorBoard events after a resume: the steps an interrupted run wrote after its last checkpoint are purged
(SummaryWriter's purge_step), so no step appears twice."""
from __future__ import annotations

import sys
import types

import pytest

from dit_pipeline.train.metrics import MetricsLog


class _Recorder:
    made: list[dict] = []

    def __init__(self, logdir: str, purge_step: int | None = None):
        self.args = {"logdir": logdir, "purge_step": purge_step, "scalars": []}
        _Recorder.made.append(self.args)

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self.args["scalars"].append((tag, value, step))

    def close(self) -> None:
        pass


@pytest.fixture
def fake_tensorboard(monkeypatch):
    _Recorder.made = []
    mod = types.ModuleType("torch.utils.tensorboard")
    mod.SummaryWriter = _Recorder
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", mod)
    return _Recorder.made


def test_resume_purges_later_steps(tmp_path, fake_tensorboard):
    log = MetricsLog(tmp_path, 0, main=True, tensorboard=True)
    log.resume_at(40)
    log.write({"step": 41, "loss": 0.5})
    log.close()
    assert fake_tensorboard == [{"logdir": str(tmp_path / "tensorboard"), "purge_step": 41,
                                 "scalars": [("train/loss", 0.5, 41)]}]


def test_fresh_run_purges_nothing_and_non_main_ranks_write_no_events(tmp_path, fake_tensorboard):
    log = MetricsLog(tmp_path, 0, main=True, tensorboard=True)
    log.resume_at(0)
    log.write({"step": 1, "loss": 1.0})
    other = MetricsLog(tmp_path, 1, main=False, tensorboard=True)
    other.resume_at(0)
    other.write({"step": 1, "loss": 1.0})
    assert [m["purge_step"] for m in fake_tensorboard] == [None]


def test_real_event_files_hold_each_step_once(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    first = MetricsLog(tmp_path, 0, main=True, tensorboard=True)
    for step in range(1, 9):  # the interrupted run logged up to 8; its last checkpoint was step 5
        first.write({"step": step, "loss": float(step)})
    first.close()
    resumed = MetricsLog(tmp_path, 0, main=True, tensorboard=True)
    resumed.resume_at(5)
    for step in range(6, 11):
        resumed.write({"step": step, "loss": 100.0 + step})
    resumed.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    events = acc.Scalars("train/loss")
    assert [e.step for e in events] == list(range(1, 11))
    assert [e.value for e in events] == [float(s) for s in range(1, 6)] + [100.0 + s for s in range(6, 11)]
