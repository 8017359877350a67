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
    assert lines[0].startswith("[adm] ADM evaluator (openai/guided-diffusion evaluations/evaluator.py): 5 samples vs "
                               "ref.npz (computed from its images), Inception network: RANDOM weights")
    assert [x.split(":")[0] for x in lines[1:6]] == ["IS-rand (not IS)", "FD-rand0-5 (not FID)",
                                                     "sFD-rand0-5 (not FID)", "Precision-rand", "Recall-rand"]
    assert float(lines[2].split(": ")[1]) > 0


def _sample_out(folder, images, *, record=True, save_images=True):
    """A folder as `dit-sample --out OUT [--save-images]` writes it (tests/sample/test_run.py checks the layout)."""
    import json

    import numpy as np
    from PIL import Image

    from dit_pipeline.sample.outputs import RECORD_FORMAT

    folder.mkdir()
    Image.fromarray(np.zeros((70, 104, 3), np.uint8)).save(folder / "grid.png")
    if record:
        (folder / "samples.json").write_text(json.dumps({"fingerprint": {"format": RECORD_FORMAT}}))
    if save_images:
        (folder / "images").mkdir()
        for i, img in enumerate(images):
            Image.fromarray(img).save(folder / "images" / f"{i:06d}.png")
    return folder


def test_a_dit_sample_out_folder_is_its_samples_not_its_grid(pair, tmp_path):
    import numpy as np

    from dit_pipeline.evaluate.inputs import open_source
    from tests.evaluate.test_run import _features

    samples, _ = pair
    arr = np.load(samples)["arr_0"]
    out = _sample_out(tmp_path / "out", arr)
    src = open_source(out, "SAMPLES")
    assert (src.count, src.image_hw) == (5, (32, 32))
    assert [f.relative_to(out).as_posix() for f in src.files] == [f"images/{i:06d}.png" for i in range(5)]
    assert open_source(_sample_out(tmp_path / "norecord", arr, record=False), "SAMPLES").count == 5
    run.run_eval(_cfg(out, samples, json=str(tmp_path / "f.json")))  # before: the grid's 70x104 was refused
    assert all(np.array_equal(_features(out)[k], _features(samples)[k]) for k in ("pool", "spatial", "logits"))
    bare = _sample_out(tmp_path / "bare", arr, save_images=False)
    with pytest.raises(UserError) as e:
        open_source(bare, "SAMPLES")
    assert str(e.value) == (f"SAMPLES {bare} is a dit-sample --out folder without its samples (grid.png shows a "
                            "few only): sample again with --save-images, or evaluate the --npz it wrote")
