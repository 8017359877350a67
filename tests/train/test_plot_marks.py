"""report.png / dit-train --plot (issue 41, item 11): a rollback is marked where it happened, a flat FID curve is
labelled with few digits, a MeanFlow run's unweighted mse has an axis of its own beside its weighted loss, and a
random Inception's numbers are never drawn against a paper's FID."""
from __future__ import annotations

from pathlib import Path

import pytest

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from dit_pipeline.train.plot import _fid_panel, _loss_panel, _rollbacks  # noqa: E402


def _train(step, loss, mse=None, rollbacks=0, steps=None):
    r = {"step": step, "loss": loss, "rollbacks": rollbacks}
    if mse is not None:
        r["mse"] = mse
    if steps is not None:
        r["rollback_steps"] = steps
    return r


def test_a_rollback_is_marked_where_it_happened():
    # a rollback at step 23 back to 20: the records after 20 were dropped, the next logged step is 30
    records = [_train(s, 1.0) for s in (10, 20)] + [_train(30, 0.9, rollbacks=1, steps=[[23, 20]])]
    assert _rollbacks(records) == [(23, 20)]
    fig, ax = plt.subplots()
    _loss_panel(ax, records, Path("run"), "ddpm")
    assert [line.get_xdata()[0] for line in ax.lines if line.get_linestyle() == ":"] == [23]
    assert any(t.get_text() == "rollback 23 -> 20" for t in ax.texts)
    plt.close(fig)
    # older records (no rollback_steps): the first logged step after the count went up, as before
    assert _rollbacks([_train(10, 1.0), _train(30, 1.0, rollbacks=1)]) == [(30, 30)]


def test_a_flat_fid_axis_has_few_digits_and_a_random_network_has_no_paper_line():
    records = [{"step": s, "fid": 12.3456781 + 1e-7 * s, "fid_name": "FID-5K", "fid_num_samples": 5000,
                "fid_run": {"protocol": "adm"}, "fid_ref": "ref.npz"} for s in (1, 2, 3)]
    fig, ax = plt.subplots()
    _fid_panel(ax, records, "fid", ("paper: FID-50K 2.27", 2.27))
    fig.canvas.draw()
    labels = [t.get_text() for t in ax.get_yticklabels() if t.get_text()]
    assert labels and all(len(t.replace("\u2212", "-")) <= 6 for t in labels), labels
    assert "protocol adm, 5000 samples vs ref.npz" in ax.get_title()
    assert any(line.get_label().startswith("paper") for line in ax.lines)
    plt.close(fig)
    rand = [{"step": 1, "fd_rand": 0.5, "fd_rand_name": "FD-rand0-8", "fid_num_samples": 8}]
    fig, ax = plt.subplots()
    _fid_panel(ax, rand, "fd_rand", ("paper: FID-50K 2.27", 2.27))
    assert not any(line.get_label().startswith("paper") for line in ax.lines)
    assert ax.get_ylabel() == "FD-rand0-8\n(not FID)"
    plt.close(fig)


def test_a_meanflow_runs_unweighted_mse_has_its_own_axis():
    records = [_train(s, 1.0 - 1e-4 * s, mse=50.0 / s) for s in range(1, 6)]
    fig, ax = plt.subplots()
    _loss_panel(ax, records, Path("run"), "meanflow")
    twins = [a for a in fig.axes if a is not ax]
    assert len(twins) == 1 and twins[0].get_ylabel() == "unweighted mse"
    assert [line.get_label() for line in ax.lines] == ["loss (adaptively weighted: ~1 by design)"]
    plt.close(fig)
    fig, ax = plt.subplots()
    _loss_panel(ax, records, Path("run"), "flow")  # an unweighted objective: mse beside the loss, one axis
    assert len(fig.axes) == 1 and [line.get_label() for line in ax.lines] == ["loss", "mse"]
    plt.close(fig)
