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
    evals = [r for r in read_metrics(run_dir) if "fid" in r]
    assert [r["step"] for r in evals] == [4]
    ev = evals[-1]
    assert (ev["fid_name"], ev["sfid_name"], ev["fd_dinov2_name"], ev["fid_ref"]) == \
        ("FID-4", "sFID-4", "FD_DINOv2-4", "ref.npz")
    assert np.isfinite(ev["fd_dinov2"]) and ev["fd_dinov2"] > 0
    tags = scalar_tags(ev)
    assert tags["eval/FID-4"] == ev["fid"] and tags["eval/FD_DINOv2-4"] == ev["fd_dinov2"] and "train/fid" not in tags
    r = CliRunner().invoke(report_main, [str(run_dir)])
    assert r.exit_code == 0, r.output
    md = (run_dir / "report.md").read_text()
    assert (run_dir / "report.png").stat().st_size > 10_000
    assert f"| this run | FID-4 {ev['fid']:.4g} at step 4 | 4 |" in md
    assert "| DiT (Peebles & Xie 2023) (DiT-XL/2 256px) | FID-50K 2.27 | 50000 |" in md
    assert "This run's number is a proxy (FID-4)" in md
    assert "Step 4: 4 samples against `ref.npz`, sampled with the EMA weights by ddpm in 2 steps, guidance 1.5" in md
    assert f"| FD_DINOv2-4 | {ev['fd_dinov2']:.4g} |" in md and "![loss, FID and throughput" in md
    assert "| devices | 1 x CPU |" in md and "| CPU-hours |" in md and "| model | `DiT-S/2` |" in md
    assert "Policy `stop`: 0 step(s) skipped, 0 rollback(s)" in md
