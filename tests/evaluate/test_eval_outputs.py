"""dit-eval's outputs (issue #34): the result file is checked before any feature work, and the metrics are
printed even when the file cannot be written after all."""
from __future__ import annotations

import errno

import pytest

from dit_pipeline.common import faults
from dit_pipeline.common.errors import UserError
from dit_pipeline.evaluate import features, run
from tests.evaluate.test_run import _cfg, pair  # noqa: F401 (fixture)


def test_an_unwritable_result_file_is_refused_before_any_feature_work(pair, monkeypatch):
    samples, ref = pair
    monkeypatch.setattr(features, "batch_features", lambda *a, **k: pytest.fail("features computed"))
    monkeypatch.setenv("DIT_FAULT", "io.write_check:erofs")  # the probe write fails as on a read-only mount
    faults._counts.clear()
    with pytest.raises(UserError) as e:
        run.run_eval(_cfg(samples, ref))
    json_path = f"{samples}.eval.json"
    assert str(e.value) == (f"the result file {json_path}: cannot write in {samples.parent} (Read-only file "
                            "system); pass a writable folder, or --json elsewhere")
    monkeypatch.delenv("DIT_FAULT")
    (samples.parent / "res").mkdir()
    with pytest.raises(UserError, match=r"the result file .*res is a folder; pass --json FILE"):
        run.run_eval(_cfg(samples, ref, json=str(samples.parent / "res")))
    assert not list(samples.parent.glob(".*features.npz"))  # nothing computed, nothing cached


def test_the_metrics_are_printed_when_the_result_file_fails_late(pair, monkeypatch, capsys):
    samples, ref = pair

    def fail(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(run, "atomic_write_json", fail)
    with pytest.raises(UserError) as e:
        run.main(_cfg(samples, ref))
    assert "the metrics are printed above; pass --json elsewhere" in str(e.value)
    lines = capsys.readouterr().out.splitlines()
    assert [x.split(":")[0] for x in lines[:5]] == ["Inception Score", "FID", "sFID", "Precision", "Recall"]
    assert float(lines[1].split(": ")[1]) > 0
