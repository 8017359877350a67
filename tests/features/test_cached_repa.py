"""Several spaces per image (issue #32): a sibling shard set of the teacher's tokens joined by sample key, and
`dit-train --repa FOLDER` (cached tokens, no teacher forward, no pixels) giving the online teacher's loss."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from dit_pipeline.common.errors import UserError
from dit_pipeline.common.teacher import load_teacher
from dit_pipeline.extract import ExtractConfig, run_extract
from dit_pipeline.shards import iter_shard, read_manifest, view_pixels
from dit_pipeline.shards.siblings import sibling_problems
from dit_pipeline.train.metrics import read_metrics
from tests._util import TINY_TEACHER, make_tiny_teacher
from tests.extract.conftest import read_samples
from tests.features.conftest import BASE
from tests.train.conftest import run_tiny

GRID = 4  # DiT tokens: a 4x4 latent at patch 1; the teacher: 56 px / patch 14


@pytest.fixture(scope="module")
def spaces(tree, tiny_vae_dir, tmp_path_factory):
    """(VAE set with pixels, sibling set of the teacher's tokens, the teacher file)."""
    root = tmp_path_factory.mktemp("spaces")
    teacher = make_tiny_teacher(root / "teacher.safetensors")
    (root / "enc.json").write_text(json.dumps({"model": "vit_base_patch14_dinov2", "model_args": TINY_TEACHER,
                                               "input_size": 14 * GRID, "weights": "teacher.safetensors"}))
    vae = root / "vae"
    run_extract(ExtractConfig(data_path=str(tree), out=str(vae), vae=str(tiny_vae_dir), pixels=True, **BASE))
    tokens = root / "tokens"
    run_extract(ExtractConfig(data_path=str(tree), out=str(tokens), encoder=str(root / "enc.json"),
                              encoder_formula="repa", dtype="float32", **BASE))
    return vae, tokens, teacher


def test_cached_tokens_are_the_online_teachers(spaces):
    vae, tokens, teacher = spaces
    assert sibling_problems(read_manifest(vae), read_manifest(tokens)) == []
    online = load_teacher(str(teacher), grid=GRID)
    m, cached = read_manifest(vae), read_samples(tokens)
    pix = {s.key: s.pixels for url in m.shard_urls(str(vae)) for s in iter_shard(url, m, pixels="decoded")}
    assert sorted(pix) == sorted(cached) and len(pix) == 5
    for key, crop in pix.items():
        for v in range(2):
            want = online(torch.from_numpy(view_pixels(crop, v).copy())[None])[0]          # [16, 32]
            got = torch.from_numpy(cached[key].latent[v]).reshape(32, -1).T
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_repa_from_cached_tokens_trains_as_the_online_teacher(spaces, tmp_path):
    vae, tokens, teacher = spaces
    common = dict(patch_size=1, max_steps=3, global_batch_size=2, micro_batch_size=2, repa_depth=1, ckpt_every=3)
    run_tiny(vae, tmp_path / "online", repa=str(teacher), **common)
    run_tiny(vae, tmp_path / "cached", repa=str(tokens), **common)
    a, b = read_metrics(tmp_path / "online"), read_metrics(tmp_path / "cached")
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2, 3]
    for x, y in zip(a, b):
        assert x["proj"] == pytest.approx(y["proj"], rel=1e-5, abs=1e-6)
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-5, abs=1e-6)
        assert x["proj"] < 0                                          # -cosine similarity: the term is there


def test_a_set_of_other_images_or_formula_is_refused(spaces, tree, tmp_path):
    vae, tokens, teacher = spaces
    fewer = tmp_path / "fewer"
    shutil.copytree(tokens, fewer)
    m = json.loads((fewer / "manifest.json").read_text())
    m["extraction"]["listing_sha256"] = "0" * 64
    (fewer / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(UserError, match="not the same images in the same views.*listing_sha256"):
        run_tiny(vae, tmp_path / "r1", repa=str(fewer), patch_size=1, max_steps=1, global_batch_size=2, micro_batch_size=2,
                repa_depth=1)
    m["extraction"]["listing_sha256"] = read_manifest(tokens).extraction["listing_sha256"]
    m["extraction"]["encoder"]["formula_name"] = "rae"
    (fewer / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(UserError, match="not the tokens REPA's teacher aligns to"):
        run_tiny(vae, tmp_path / "r2", repa=str(fewer), patch_size=1, max_steps=1, global_batch_size=2, micro_batch_size=2,
                repa_depth=1)
    assert not (tmp_path / "r2" / "checkpoints").exists()
