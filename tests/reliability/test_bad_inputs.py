"""The bad-input corpus (corpus.py) through the commands that meet it: odd images through dit-extract, hostile
shards through `dit-shards verify` and the trainer's reader, damaged manifests through verify and the
trainer, hostile checkpoints through `dit-train --resume` and `dit-sample --ckpt`.

Every input gets the exact behaviour of RELIABILITY.md: a usable image becomes RGB, an unusable one is
skipped with its reason; anything else is refused with one clear message naming the file and the problem
(no traceback), nothing is unpickled (the payload's marker file never appears), no member name is ever used
as a path (nothing appears outside the shard folder), and nothing is written by the refused command.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from dit_pipeline.common.errors import UserError
from dit_pipeline.shards import ShardError, iter_shard, read_manifest
from tests.extract.conftest import UNUSABLE, cli_args, make_odd_tree, odd_files
from tests.reliability import corpus
from tests.reliability.conftest import sample_args, train_args
from tests.reliability.harness import SWEEP, assert_clean_error, run, run_cli_case, tried
from tests.shards._helpers import make_set
from dit_pipeline.train.shard_source import open_shards

SHARDS = corpus.hostile_shards()
MANIFESTS = corpus.malformed_manifests()
CHECKPOINTS = corpus.hostile_checkpoints()
TRAIN_ON_SHARDS = {"path_traversal", "pickle_in_npy", "giant_member", "label_out_of_range", "copy_of_another_shard"}
TRAIN_ON_MANIFESTS = {"deep_nesting", "version_unknown", "total_mismatch", "name_traversal", "not_utf8"}


def _listing(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


# ----------------------------------------------------------------------------------------------------------
# Images

def test_every_odd_image_is_converted_or_skipped_with_its_reason(tiny_vae_dir, tmp_path):
    root = make_odd_tree(tmp_path / "images")
    expected = {rel: UNUSABLE.get(rel) for rel in odd_files()}
    expected.update({"a_plain/img0.JPEG": None, "a_plain/img1.JPEG": None, "a_plain/nested/deep.jpg": None})
    expected.update(corpus.more_odd_images(root))
    tried(len(expected) + 5)   # + the hidden, junk and empty-folder entries make_odd_tree adds
    out = tmp_path / "out"
    r = run("dit-extract", cli_args(root, tiny_vae_dir, out), timeout=120)   # a FIFO would hang it
    assert r.rc == 0, r.err[-3000:]
    m = read_manifest(out)
    skipped = {s["path"]: s["reason"] for s in m.skipped}
    stored = {s.meta["path"]: s for url in m.shard_urls(str(out)) for s in iter_shard(url, m, with_meta=True)}
    assert sorted(stored) + sorted(skipped) == sorted(p for p, why in expected.items() if why is None) + sorted(
        p for p, why in expected.items() if why is not None)                 # each image exactly once
    for path, why in expected.items():
        if why is not None:
            assert why in skipped[path], (path, skipped[path])
    assert m.class_names == ["a_plain", "b_odd", "c_empty", "d_bad", "e_more"]   # kept: --keep-empty-classes
    assert {stored[p].meta["orig_mode"] for p in ("b_odd/cmyk.JPEG", "e_more/gray_alpha.png", "e_more/bilevel.png",
                                                  "e_more/int32.tiff")} == {"CMYK", "LA", "1", "I"}


# ----------------------------------------------------------------------------------------------------------
# Hostile shards

@pytest.fixture
def hostile_set(tmp_path, request):
    """(folder, marker, expected problem) of one corpus case, in a watched folder."""
    maker, problem = SHARDS[request.param]
    folder = tmp_path / "set"
    make_set(folder, n=8, sps=4, skipped=())
    marker = tmp_path / "unpickled"
    maker(folder, marker)
    tried()
    return folder, marker, problem


@pytest.mark.parametrize("hostile_set", sorted(SHARDS), indirect=True)
def test_hostile_shard_is_reported_and_never_followed(hostile_set, tmp_path, request):
    folder, marker, problem = hostile_set
    before = _listing(tmp_path)
    r = run_cli_case(request, "dit-shards", ["verify", folder, "--json"])
    assert r.rc == 1 and "Traceback" not in r.text, r.text[-3000:]
    report = json.loads(r.out)
    assert any(p["file"] == corpus.S1 and problem in p["problem"] for p in report["problems"]), report
    # the trainer's reader (what each loader worker runs) refuses it too, naming shard and problem
    src = open_shards(str(folder))                       # the start-up check (sizes) passes: same record
    with pytest.raises(ShardError) as e:
        for url in src.urls:
            list(iter_shard(url, src.manifest))
    assert e.value.url.endswith(corpus.S1) and problem in e.value.problem
    assert not marker.exists() and _listing(tmp_path) == before          # nothing unpickled, nothing written


@SWEEP
@pytest.mark.parametrize("verify", [True, False], ids=["verify-shards", "no-verify-shards"])
@pytest.mark.parametrize("hostile_set", sorted(TRAIN_ON_SHARDS), indirect=True)
def test_trainer_refuses_a_hostile_shard_naming_it(hostile_set, tmp_path, verify):
    """With the trainer's sha256 check (the default) a shard whose record was left untouched (a copy of another
    shard) is refused by its hash before any sample is used; the other cases have refreshed records, so the
    hash matches and the reader's own checks must find the problem, as they must for every case without it."""
    folder, marker, problem = hostile_set
    if verify and problem == "outside":  # copy_of_another_shard: same size, another file's bytes
        problem = "sha256 mismatch"
    run_dir = tmp_path / "run"
    r = run("dit-train", train_args(folder, run_dir, **{"global-batch-size": 4, "micro-batch-size": 4,
                                                         "num-workers": 0, "max-steps": 2, "shuffle-buffer": 16,
                                                         "verify-shards" if verify else "no-verify-shards": None}))
    assert_clean_error(r, corpus.S1, "--skip-bad-shards")
    assert problem in r.err and not marker.exists(), r.err[-3000:]
    assert ("none of its samples were used" in r.err) == (problem == "sha256 mismatch"), r.err[-3000:]
    assert not list(run_dir.glob("checkpoints/*.pt"))                  # stopped before its first save


# ----------------------------------------------------------------------------------------------------------
# Malformed manifests

@pytest.fixture
def bad_manifest(tmp_path, request):
    maker, problem = MANIFESTS[request.param]
    folder = tmp_path / "set"
    make_set(folder, n=8, sps=4, skipped=())
    damaged = maker((folder / "manifest.json").read_text())
    path = folder / "manifest.json"
    path.write_bytes(damaged if isinstance(damaged, bytes) else damaged.encode("utf-8"))
    tried()
    return folder, problem


@pytest.mark.parametrize("bad_manifest", sorted(MANIFESTS), indirect=True)
def test_malformed_manifest_is_refused_by_verify_and_trainer(bad_manifest, request):
    folder, problem = bad_manifest
    r = run_cli_case(request, "dit-shards", ["verify", folder])
    assert_clean_error(r, "manifest.json", problem)
    with pytest.raises(UserError) as e:                  # the trainer's start-up check
        open_shards(str(folder))
    assert str(folder / "manifest.json") in str(e.value) and problem in str(e.value)


@SWEEP
@pytest.mark.parametrize("bad_manifest", sorted(TRAIN_ON_MANIFESTS), indirect=True)
def test_trainer_cli_refuses_a_malformed_manifest_before_any_work(bad_manifest, tmp_path):
    folder, problem = bad_manifest
    run_dir = tmp_path / "run"
    r = run("dit-train", train_args(folder, run_dir))
    assert_clean_error(r, "manifest.json", problem)
    assert not run_dir.exists()


# ----------------------------------------------------------------------------------------------------------
# Hostile checkpoints

@pytest.fixture
def bad_ckpt(tmp_path, sample_ckpt, request):
    maker, problem = CHECKPOINTS[request.param]
    path = tmp_path / "bad.pt"
    marker = tmp_path / "unpickled"
    maker(sample_ckpt, path, marker)
    tried()
    return request.param, path, marker, problem


SAMPLE_LOADS = {"other_model"}   # a different model is a valid thing to sample from


@pytest.mark.parametrize("bad_ckpt", sorted(CHECKPOINTS), indirect=True)
def test_hostile_checkpoint_loads_nothing(bad_ckpt):
    from dit_pipeline.sample.load import load_model
    from dit_pipeline.train.checkpoint import load_checkpoint

    case, path, marker, problem = bad_ckpt
    for load in (load_checkpoint, load_model):
        if (load is load_model and case in SAMPLE_LOADS) or (load is load_checkpoint and case == "other_model"):
            load(path)        # readable; the mismatch is the resume check's job (CLI tests below)
            continue
        with pytest.raises(UserError) as e:
            load(path)
        assert str(path) in str(e.value) and (problem in str(e.value) or problem == "corrupt"), str(e.value)
    assert not marker.exists()


@SWEEP
@pytest.mark.parametrize("bad_ckpt", sorted(CHECKPOINTS), indirect=True)
def test_resume_from_a_hostile_checkpoint_is_refused(bad_ckpt, train_shards, tmp_path):
    case, path, marker, problem = bad_ckpt
    run_dir = tmp_path / "run"
    r = run("dit-train", train_args(train_shards, run_dir, resume=path))
    assert_clean_error(r, str(path), problem if problem != "corrupt" else "corrupt or not a dit-pipeline checkpoint")
    assert "Nothing was loaded" in r.err or case in ("other_model", "version_2")
    assert not list(run_dir.glob("checkpoints/*.pt")) and not marker.exists()


@SWEEP
@pytest.mark.parametrize("bad_ckpt", sorted(set(CHECKPOINTS) - SAMPLE_LOADS), indirect=True)
def test_sampling_from_a_hostile_checkpoint_writes_nothing(bad_ckpt, tiny_vae_dir, tmp_path):
    case, path, marker, problem = bad_ckpt
    before = _listing(tmp_path)
    r = run("dit-sample", sample_args(path, tiny_vae_dir, tmp_path / "s.npz"))
    assert_clean_error(r, str(path))
    assert problem in r.err or problem == "corrupt", r.err[-2000:]
    assert _listing(tmp_path) == before and not marker.exists()
