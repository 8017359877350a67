"""`dit-sample --class-labels` takes class names as well as ids (issue #34): the names our checkpoints record
(the shard set's class folders) become ids before anything else sees them."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from dit_pipeline.cli import sample_main
from dit_pipeline.common.errors import UserError
from dit_pipeline.sample.names import class_ids, parse_class_labels
from tests.sample.conftest import LATENT, our_checkpoint, random_dit

NAMES = [f"n{k:08d}" for k in range(9)] + ["golden_retriever"]


def test_parse_and_resolve():
    assert parse_class_labels("207, n01440764,3,,-1") == [207, "n01440764", 3, -1]
    assert class_ids([1, "golden_retriever", "n00000002"], NAMES, "--ckpt x") == [1, 9, 2]
    assert class_ids([4, 5], None, "--ckpt x") == [4, 5]
    with pytest.raises(UserError) as e:
        class_ids(["cat"], NAMES, "--ckpt x")
    assert str(e.value) == ("--class-labels: no class named 'cat' in --ckpt x (10 classes: n00000000, n00000001, "
                            "n00000002, n00000003, n00000004, ...); pass names as the shard set's class folders "
                            "are called, or ids")
    with pytest.raises(UserError, match=r"^--class-labels cat: --ckpt x records no class names"):
        class_ids(["cat"], [], "--ckpt x")


def test_names_sample_as_their_ids(tmp_path, tiny_vae_dir):
    ckpt = tmp_path / "named.pt"
    torch.save(our_checkpoint(random_dit(1), random_dit(2), latent={**LATENT, "class_names": NAMES}), ckpt)
    common = ["--ckpt", str(ckpt), "--vae", str(tiny_vae_dir), "--steps", "2", "--quiet"]
    runs = {}
    for tag, labels in (("names", "golden_retriever,3,n00000001"), ("ids", "9,3,1")):
        npz = tmp_path / f"{tag}.npz"
        r = CliRunner().invoke(sample_main, [*common, "--class-labels", labels, "--npz", str(npz)])
        assert r.exit_code == 0, r.output
        with np.load(npz) as z:
            runs[tag] = z["arr_0"], z["arr_1"]
        assert json.loads((tmp_path / f"{tag}.npz.json").read_text())["config"]["class_labels"] == [9, 3, 1]
    assert runs["names"][1].tolist() == [9, 3, 1] and np.array_equal(runs["names"][0], runs["ids"][0])
    r = CliRunner().invoke(sample_main, [*common, "--class-labels", "cat", "--npz", str(tmp_path / "x.npz")])
    assert r.exit_code == 1 and "no class named 'cat'" in r.output and not (tmp_path / "x.npz").exists()
