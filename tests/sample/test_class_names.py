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


def test_a_number_that_is_also_another_class_name_is_ambiguous():
    """Issue 41: `--class-labels 1` on classes named 1, 10, 2, 3 took id 1 (folder `10`) silently; now it is refused
    as ambiguous, and id:1 / name:1 say which."""
    from dit_pipeline.common.errors import UserError
    from dit_pipeline.sample.names import ExplicitId, class_ids, parse_class_labels

    names = ["1", "10", "2", "3"]  # sorted folder names, as ImageFolder and dit-extract order them
    assert parse_class_labels("1, id:1, name:1") == [1, 1, "1"]
    assert isinstance(parse_class_labels("id:1")[0], ExplicitId)
    with pytest.raises(UserError) as e:
        class_ids(parse_class_labels("1"), names, "--ckpt m.pt")
    assert str(e.value) == ("--class-labels 1 is ambiguous in --ckpt m.pt: class id 1 is '10', and the class named "
                            "'1' has id 0; write id:1 or name:1")
    assert class_ids(parse_class_labels("id:1,name:1,name:10"), names, "--ckpt m.pt") == [1, 0, 1]
    assert class_ids(parse_class_labels("3"), ["a", "b", "c", "d"], "x") == [3]  # names that are not numbers
    assert class_ids(parse_class_labels("2"), names, "x") == [2]  # id 2 is the class named 2: no ambiguity


def test_dit_train_sample_classes_take_names_as_dit_sample_does(tmp_path):
    """Issue 41: dit-train --sample-classes took ids only; now names (the shard set's class folders) too, resolved
    before any work (also in a dry run) and recorded as ids."""
    from dit_pipeline.common.errors import UserError
    from dit_pipeline.train import merge_config
    from dit_pipeline.train.preflight import prepare
    from tests.train.helpers import make_shard_set

    make_shard_set(tmp_path / "shards", samples=[4, 4], num_classes=3)  # classes c000, c001, c002
    base = {"shards": str(tmp_path / "shards"), "run_dir": str(tmp_path / "run"), "model": "DiT-S/2", "depth": 2,
            "hidden_size": 32, "num_heads": 2, "num_workers": 0, "sample_every": 2, "vae": "x",
            "global_batch_size": 4}
    prep = prepare(merge_config({}, {**base, "sample_classes": "c002,0,c001"}))
    assert prep.cfg.sample_classes == [2, 0, 1]
    with pytest.raises(UserError, match=r"--sample-classes: no class named 'dog' in the shard set"):
        prepare(merge_config({}, {**base, "sample_classes": "dog"}))
    with pytest.raises(UserError, match=r"^--cfg-channels 20: the model has 4 latent channels; give auto, all or 1..4$"):
        prepare(merge_config({}, {**base, "cfg_channels": "20"}))  # issue 41: passed the dry run before
