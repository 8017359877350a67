"""`dit-extract` on the command line: user mistakes are one clear line and nothing is written."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from dit_pipeline.cli import extract_main
from dit_pipeline.shards import read_manifest
from dit_pipeline.shards.info import human_bytes
from tests._util import draw_image
from tests.extract.conftest import cli_args


def _invoke(args):
    return CliRunner().invoke(extract_main, [str(a) for a in args], catch_exceptions=False)


def _bad_data(tmp_path, case):
    root = tmp_path / "data"
    if case == "file":
        root.write_text("x")
    elif case == "no_classes":
        root.mkdir()
    elif case == "no_images":
        (root / "a").mkdir(parents=True)
    return root


@pytest.mark.parametrize("case, message", [("missing", "no such folder"), ("file", "is a file, not a folder"),
                                           ("no_classes", "no class folders found"),
                                           ("no_images", "found 1 class folder(s) but no image files")])
def test_bad_data_path(tmp_path, tiny_vae_dir, case, message):
    out = tmp_path / "out"
    r = _invoke(cli_args(_bad_data(tmp_path, case), tiny_vae_dir, out))
    assert r.exit_code == 1
    assert f"error: --data-path {tmp_path / 'data'}: {message}" in r.output
    assert "Traceback" not in r.output
    assert not out.exists()


def test_bad_vae(tmp_path, odd_tree):
    out = tmp_path / "out"
    r = _invoke(cli_args(odd_tree, tmp_path / "nope.safetensors", out))
    assert r.exit_code == 1 and "no such file or folder" in r.output and not out.exists()
    r = _invoke(cli_args(odd_tree, "nobody/no-such-vae", out))
    assert r.exit_code == 1 and "not in the Hugging Face cache" in r.output and not out.exists()


def test_all_option_problems_in_one_usage_error(tmp_path, odd_tree, tiny_vae_dir):
    r = _invoke(cli_args(odd_tree, tiny_vae_dir, tmp_path / "out", image_size=30, batch_size=0,
                         samples_per_shard=-1))
    assert r.exit_code == 2
    for msg in ("--image-size must be a positive multiple of 8", "--batch-size must be >= 1",
                "--samples-per-shard must be >= 1"):
        assert msg in r.output
    assert not (tmp_path / "out").exists()


def test_out_is_a_file(tmp_path, odd_tree, tiny_vae_dir):
    out = tmp_path / "out"
    out.write_text("keep me")
    r = _invoke(cli_args(odd_tree, tiny_vae_dir, out))
    assert r.exit_code == 1 and "exists and is not a folder" in r.output and out.read_text() == "keep me"


def test_underscore_flags_and_summary(tmp_path, tiny_vae_dir):
    data = tmp_path / "data"
    for c in range(2):
        (data / f"class{c}").mkdir(parents=True)
        for i in range(2):
            draw_image(c, i).save(data / f"class{c}" / f"{i}.JPEG")
    out = tmp_path / "out"
    args = ["--" + a[2:].replace("-", "_") if a.startswith("--") else a
            for a in cli_args(data, tiny_vae_dir, out, quiet=False, no_flip=True)]
    assert "--data_path" in args and "--samples_per_shard" in args
    r = _invoke(args)
    assert r.exit_code == 0, r.output
    m = read_manifest(out)
    assert m.total_samples == 4 and m.views == 1 and len(m.shards) == 1
    assert "done: 4 images encoded" in r.output and "0 skipped" in r.output
    assert f": 4 images in 2 classes (first 'class0', last 'class1') from {data} -> {out} (new)\n" in r.output
    size = human_bytes(m.shards[0].bytes)  # a small set in KiB, not "0.000 GiB"
    assert size.endswith(" KiB") and f"4 samples, 0 skipped, {size}\n" in r.output
    assert f"manifest: {out / 'manifest.json'} (quick verify passed)" in r.output
    assert (out / "logs" / "rank0.log").read_text().count("finished shard-000000.tar") == 1
    options = json.loads((out / ".extract" / "options.json").read_text())
    assert options["data_path"] == str(data) and options["flip"] is False and options["samples_per_shard"] == 4


def test_quiet_prints_nothing_but_still_logs(tmp_path, odd_tree, tiny_vae_dir):
    out = tmp_path / "out"
    r = _invoke(cli_args(odd_tree, tiny_vae_dir, out, limit=4))     # BASE settings include --quiet
    assert r.exit_code == 0 and r.output == ""
    log = (out / "logs" / "rank0.log").read_text()
    assert "finished shard-000000.tar: 4 samples" in log and "done: 4 images encoded" in log


def test_split_folders_and_empty_classes_are_refused_before_anything_is_written(tmp_path, tiny_vae_dir):
    """The layout many guides use (ROOT/train/<class>, ROOT/val/<class>) given as --data-path; an empty class."""
    root = tmp_path / "data"
    for split in ("train", "val"):
        for c in range(2):
            (root / split / f"n0{c}").mkdir(parents=True)
            draw_image(c, 0).save(root / split / f"n0{c}" / "0.JPEG")
    out = tmp_path / "out"
    base = dict(keep_empty_classes=False, quiet=False)
    r = _invoke(cli_args(root, tiny_vae_dir, out, **base))
    assert r.exit_code == 1 and not out.exists()
    assert r.output.startswith(f"error: --data-path {root}: its class folders look like dataset splits (train, val), "
                               "not classes:")
    assert f"(e.g. --data-path {root / 'train'}), or add --allow-split-names" in r.output
    r = _invoke(cli_args(root, tiny_vae_dir, out, allow_split_names=True, **base))
    assert r.exit_code == 0, r.output
    assert "4 images in 2 classes (first 'train', last 'val')" in r.output
    (root / "train" / "n02").mkdir()
    r = _invoke(cli_args(root / "train", tiny_vae_dir, tmp_path / "out2", **base))
    assert r.exit_code == 1 and not (tmp_path / "out2").exists()
    assert r.output.startswith(f"error: --data-path {root / 'train'}: 1 of 3 class folder(s) hold no image files "
                               "(n02); torchvision's ImageFolder refuses this too.")
    r = _invoke(cli_args(root / "train", tiny_vae_dir, tmp_path / "out2", keep_empty_classes=True, quiet=False))
    assert r.exit_code == 0, r.output
    m = read_manifest(tmp_path / "out2")
    assert m.class_names == ["n00", "n01", "n02"] and m.num_classes == 3 and m.total_samples == 2
