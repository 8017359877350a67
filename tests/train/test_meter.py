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


def test_step_report_combines_named_values_as_their_metric_says():
    import torch

    from dit_pipeline.train.metrics import LOSS_TERMS, STEP_METRICS, Meter, StepReport, interval_record

    r = StepReport()
    for loss in (torch.tensor([1.0, 2.0]), torch.tensor([3.0, 6.0])):  # two micro-batches of a 4-sample step
        r.report("loss", loss)
        r.report("mse", loss / 2)
    r.report("wait", 0.5)
    r.report("grad_norm", torch.tensor(7.0, dtype=torch.float64))
    assert float(r.local("loss")) == 12.0
    v = r.reduce(samples=4, flags={"non_finite": 0.0})
    assert v.values == {"loss": 3.0, "mse": 1.5, "wait": 0.5, "grad_norm": 7.0}  # one process: mean of 4 samples
    assert v.own == {"loss": 3.0, "mse": 1.5, "wait": 0.5} and v.ranks_with("non_finite") == []
    m = Meter()
    m.step(**v.values)
    m.step(**{**v.values, "loss": 5.0})
    rec = interval_record(m, elapsed=2.0)
    # no vb was reported (a flow objective has none): none is logged; waits become a fraction of the time
    assert rec == {"loss": 4.0, "mse": 1.5, "grad_norm": 7.0, "data_wait": 0.5}
    assert LOSS_TERMS == ("loss", "mse", "mse_v", "vb", "proj", "cos", "lpips", "pdino", "reg", "base")
    assert [m.name for m in STEP_METRICS][:len(LOSS_TERMS)] == list(LOSS_TERMS)
    try:
        r.report("unlisted", 1.0)
    except KeyError:
        pass
    else:
        raise AssertionError("a metric must be listed in STEP_METRICS")
