"""train.metrics.Meter: named running sums and per-step means over a log interval."""
from dit_pipeline.train.metrics import Meter


def test_meter_sums_means_and_resets():
    m = Meter()
    assert m.mean("loss") == 0.0 and m.steps == 0
    m.step(loss=1.0, wait=0.5)
    m.step(loss=2.0, wait=0.25)
    m.add(wait=1.0)
    assert (m.steps, m.sum("loss"), m.mean("loss"), m.sum("wait")) == (2, 3.0, 1.5, 1.75)
    assert m.elapsed() > 0
    m.reset()
    assert (m.steps, m.sum("loss")) == (0, 0.0)
