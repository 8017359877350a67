"""dit-report on a tiny real run with FID and FD_DINOv2 during training (random Inception, a tiny random DINOv2):
the records name each distance with its sample count and reference; the page shows the config, the curves, the
last evaluation with its sample count and sampler settings, throughput and device-hours, and the recipe's paper
number beside ours."""
from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from dit_pipeline.cli import report_main
from dit_pipeline.train.metrics import read_metrics, scalar_tags
from tests._util import make_tiny_teacher
from tests.train.conftest import invoke_train, tiny_args
from tests.train.helpers import make_shard_set

FID = {"fid-every": 4, "fid-num-samples": 4, "fid-steps": 2, "fid-batch-size": 4, "fid-input-size": 75,
       "fid-random-inception": 0, "fd-dinov2": True}
RECIPE = {"name": "DiT-XL/2 256px", "paper": "DiT (Peebles & Xie 2023)", "fid": 2.27}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, tiny_vae_dir):
    pytest.importorskip("matplotlib")
    root = tmp_path_factory.mktemp("report")
    make_shard_set(root / "shards", samples=[16, 16], latent_shape=(4, 8, 8))
    np.savez(root / "ref.npz", arr_0=np.random.default_rng(0).integers(0, 256, (6, 64, 64, 3), dtype=np.uint8))
    teacher = make_tiny_teacher(root / "tiny-dinov2.safetensors")
    args = tiny_args(root / "shards", root / "run", **{"max-steps": 4, "num-workers": 0, "quiet": None, **FID,
                                                       "fid-ref": root / "ref.npz", "vae": tiny_vae_dir,
                                                       "dinov2": teacher})
    r = invoke_train(args)
    assert r.exit_code == 0, r.output
    cfg = json.loads((root / "run" / "config.json").read_text())
    (root / "run" / "config.json").write_text(json.dumps({**cfg, "recipe": RECIPE}))  # as a recipe run records it
    return root / "run"


def test_fid_records_are_labelled_and_the_report_shows_the_run_beside_the_paper(run_dir):
    evals = [r for r in read_metrics(run_dir) if "fd_rand" in r]
    assert [r["step"] for r in evals] == [4]
    ev = evals[-1]
    # a random Inception's numbers have names of their own (issue 41, item 2): never "fid", never FID-4
    assert "fid" not in ev and (ev["fd_rand_name"], ev["sfd_rand_name"], ev["fd_dinov2_name"], ev["fid_ref"]) == \
        ("FD-rand0-4", "sFD-rand0-4", "FD_DINOv2-4", "ref.npz")
    assert np.isfinite(ev["fd_dinov2"]) and ev["fd_dinov2"] > 0
    tags = scalar_tags(ev)
    assert tags["eval/FD-rand0-4"] == ev["fd_rand"] and tags["eval/FD_DINOv2-4"] == ev["fd_dinov2"]
    assert not [t for t in tags if "FID" in t.replace("FD_DINOv2", "")]
    r = CliRunner().invoke(report_main, [str(run_dir)])
    assert r.exit_code == 0, r.output
    md = (run_dir / "report.md").read_text()
    assert (run_dir / "report.png").stat().st_size > 10_000
    assert f"| this run | FD-rand0-4 {ev['fd_rand']:.4g} at step 4 (random Inception: not FID) | 4 |" in md
    # not beside the paper's FID-50K: the number is not FID
    assert "| DiT (Peebles & Xie 2023)" not in md and "this run's number is not FID (random Inception weights), so " \
        "the paper's FID-50K 2.27 is not shown beside it" in md
    assert f"| FD_DINOv2-4 | {ev['fd_dinov2']:.4g} |" in md and "![loss, FID and throughput" in md
    # the other numbers of a random Inception under their own names (issue 47: "Inception Score", "Precision")
    assert f"| IS-rand (not IS) | {ev['is_rand']:.4g} |" in md and "| Precision-rand |" in md and "| Recall-rand |" in md
    assert "| Inception Score |" not in md and "| Precision |" not in md
    assert "These numbers are not FID: the Frechet distance of an Inception network with random weights (seed 0)" in md
    assert "| devices | 1 x CPU |" in md and "| CPU-hours |" in md
    assert "| model | `DiT-S/2` with depth 2, hidden_size 32, num_heads 2 |" in md
    assert "Policy `stop`: 0 step(s) skipped, 0 rollback(s)" in md


def test_the_report_describes_what_the_hook_ran_not_what_config_json_asked(run_dir, tmp_path):
    """Issue 41, item 1: dit-report took the evaluation's settings from config.json ("guidance 4.0" where the hook
    applied 1.0, "model SiT-XL/2" for a depth-2 model); now from the hook's record in metrics.jsonl."""
    (ev,) = [r for r in read_metrics(run_dir) if "fd_rand" in r]
    run = ev["fid_run"]
    sampling = run["sampling"]  # the sampling protocol's record (dit/protocols.py): the one record of what ran
    assert (run["protocol"], sampling["name"], sampling["solver"], sampling["count"], sampling["guidance"]["scale"],
            sampling["guidance"]["channels"], sampling["labels"], sampling["conversion"], run["seed"]) == \
        ("adm", "custom", "ddpm", 2, 1.5, "3", "uniform", "dit", 0)
    assert run["model"]["architecture"] == "depth 2, hidden 32, heads 2, patch 2" and run["num_samples"] == 4
    assert run["inception"]["random_seed"] == 0 and run["reference"]["file"] == "ref.npz"
    assert run["reference"]["statistics"] == "computed from its images"
    cfg = json.loads((run_dir / "config.json").read_text())
    lied = tmp_path / "run"
    lied.mkdir()
    (lied / "metrics.jsonl").write_text((run_dir / "metrics.jsonl").read_text())
    (lied / "config.json").write_text(json.dumps({**cfg, "fid_cfg_scale": 4.0, "fid_steps": 250, "model": "SiT-XL/2"}))
    r = CliRunner().invoke(report_main, [str(lied)])
    assert r.exit_code == 0, r.output
    md = (lied / "report.md").read_text()
    assert ("Step 4, protocol adm (openai/guided-diffusion evaluations/evaluator.py): 4 samples against `ref.npz` "
            "(computed from its images), sampled with the ema weights of the model DiT-S/2 as built (depth 2, "
            "hidden 32, heads 2, patch 2) by ddpm in 2 steps, guidance 1.5 on the first 3 channel(s), classes "
            "uniform, images by the 'dit' conversion, seed 0") in md
    assert "guidance 4" not in md and "250 steps" not in md
    assert "Inception network: RANDOM weights (random-seed-0: not FID), input 75" in md


def test_a_read_only_run_folder_names_out(run_dir, tmp_path, monkeypatch):
    """Issue 41, item 7: dit-report and dit-train --plot on a folder that cannot be written (a read-only mount,
    injected: the tests run as root): one line, no traceback, naming --out."""
    import errno

    import matplotlib.figure

    from dit_pipeline.cli import train_main
    from dit_pipeline.common import faults

    ro = tmp_path / "ro"
    ro.mkdir()
    (ro / "metrics.jsonl").write_text((run_dir / "metrics.jsonl").read_text())
    monkeypatch.setenv("DIT_FAULT", "io.write_check:erofs")
    faults._counts.clear()
    r = CliRunner().invoke(report_main, [str(ro)])
    assert r.exit_code == 1 and "Traceback" not in r.output
    assert r.output.strip().splitlines()[-1] == (f"error: the report: cannot write in {ro} (Read-only file system); "
                                                 "pass a writable folder, or --out DIR for the report")
    monkeypatch.delenv("DIT_FAULT")

    def read_only(self, *a, **k):
        raise OSError(errno.EROFS, "Read-only file system")

    with monkeypatch.context() as m:
        m.setattr(matplotlib.figure.Figure, "savefig", read_only)
        p = CliRunner().invoke(train_main, ["--plot", str(ro)])
    assert p.exit_code == 1 and "Traceback" not in p.output
    assert p.output.strip().splitlines()[-1] == (
        f"error: cannot write {ro / 'loss.png'} (Read-only file system): {ro} is not writable; write the curves "
        f"elsewhere with dit-report {ro} --out DIR")
    ok = CliRunner().invoke(report_main, [str(ro), "--out", str(tmp_path / "elsewhere")])
    assert ok.exit_code == 0 and (tmp_path / "elsewhere" / "report.md").is_file()
    assert sorted(x.name for x in ro.iterdir()) == ["metrics.jsonl"]  # nothing written into the run folder


def test_the_paper_is_beside_the_run_only_when_nothing_departs(run_dir, tmp_path):
    """Issue 41, item 9: the paper's FID-50K goes beside a run (table and plot) only when the run's number is FID
    and the run departs from its recipe in nothing; departures are listed."""
    (ev,) = [r for r in read_metrics(run_dir) if "fd_rand" in r]
    real = {k: v for k, v in ev.items() if not k.endswith("_rand") and not k.endswith("_rand_name")}
    real.update(fid=3.5, fid_name="FID-4", sfid=1.0, sfid_name="sFID-4", inception_score=2.0, precision=0.5,
                recall=0.5)  # as a real Inception's record reads
    cfg = json.loads((run_dir / "config.json").read_text())
    for departures, beside in (([], True), (["--model DiT-XL/2 -> DiT-S/2"], False)):
        run = tmp_path / f"run{len(departures)}"
        run.mkdir()
        rows = [r for r in read_metrics(run_dir) if "fd_rand" not in r] + [real]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (run / "config.json").write_text(json.dumps({**cfg, "recipe": {**RECIPE, "departures": departures}}))
        r = CliRunner().invoke(report_main, [str(run)])
        assert r.exit_code == 0, r.output
        md = (run / "report.md").read_text()
        assert "| this run | FID-4 3.5 at step 4 | 4 |" in md
        assert ("| DiT (Peebles & Xie 2023) (DiT-XL/2 256px) | FID-50K 2.27 | 50000 |" in md) == beside
        if not beside:
            assert "the run departs from the recipe in 1 way(s) (below), so the paper's FID-50K 2.27 is not a " \
                   "number to compare it with" in md
            assert "Departures from the recipe:\n\n- --model DiT-XL/2 -> DiT-S/2" in md
