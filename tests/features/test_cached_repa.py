"""Several spaces per image (issue #32): a sibling shard set of the teacher's tokens joined by sample key, and
`dit-train --repa FOLDER` (cached tokens, no teacher forward, no pixels) giving the online teacher's loss; on a data
mix, each source's tokens (repa=) with `--repa cached`, giving the online teacher's loss on the same mix."""
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


# ----------------------------------------------------------------------------------------------------------
# A data mix's cached tokens: each source names its own (repa=), `dit-train --repa cached` aligns to them

def _mix_run(run_dir, sources, **overrides) -> dict:
    """Train the tiny model on a mix of `sources` (--source strings) in process; its newest checkpoint."""
    from dit_pipeline.train import merge_config, run
    from dit_pipeline.train.checkpoint import CheckpointManager, load_checkpoint
    from dit_pipeline.train.hooks import build_hooks
    from tests.train.conftest import TINY_CONFIG

    cfg = merge_config({}, {"run_dir": str(run_dir), "source": list(sources), **TINY_CONFIG, **overrides})
    assert run(cfg, build_hooks(cfg)) == "done"
    return load_checkpoint(CheckpointManager(run_dir / "checkpoints").latest())


def test_a_mixs_batches_carry_each_samples_cached_tokens_of_its_view(spaces):
    """Every sample of a mix's batch carries its own source's cached tokens of its latent's view ([n, h*w, c], the
    order a ViT's patch sequence has), in process and through a loader worker alike, and no pixels."""
    from dit_pipeline.shards import key_index
    from dit_pipeline.train.latents import mix_seed, sample_view
    from dit_pipeline.train.mix import mix_spec, open_mix
    from dit_pipeline.train.mixdata import MixFeed
    from dit_pipeline.train.mixdraws import sample_base

    vae, tokens, _ = spaces
    cached = {key_index(k): s.latent for k, s in read_samples(tokens).items()}

    def batches(workers):
        spec = mix_spec([f"{vae} name=a repa={tokens}", f"{vae} name=b repa={tokens}"], None)
        feed = MixFeed(open_mix(spec, repa_cached=True), seed=0, lanes=2, global_batch=4, accum=1, world=1, rank=0,
                       workers=workers, buffer=4, shards_in_flight=2, tokens=True)
        return list(feed.loader(feed.plan(0), 0))

    inline, views = batches(0), set()
    for b in inline:
        assert b.pixels is None and b.teacher is not None and b.teacher.shape[1:] == (GRID * GRID, 32)
        for row, s, k in zip(b.teacher, b.sources.tolist(), b.keys.tolist()):
            v = sample_view(mix_seed(sample_base(0, 0, s, 0), k), 2)
            assert torch.equal(row, torch.from_numpy(cached[k][v]).reshape(32, -1).T)
            views.add(v)
    assert views == {0, 1} and sum(len(b.keys) for b in inline) == 8 and \
        {s for b in inline for s in b.sources.tolist()} == {0, 1}
    pooled = batches(1)
    assert len(pooled) == len(inline) and all(torch.equal(x.teacher, y.teacher) for x, y in zip(inline, pooled))


def test_repa_cached_on_a_mix_trains_as_the_online_teacher_on_the_same_mix(spaces, tmp_path):
    """`--repa cached` on a two-source mix (each source's repa=) gives the losses of the online teacher on the same
    mix's pixels, and the same validation loss on the keys a source holds out; its records name each source's
    tokens."""
    vae, tokens, teacher = spaces
    common = dict(patch_size=1, max_steps=3, global_batch_size=2, micro_batch_size=2, repa_depth=1, ckpt_every=3,
                  val_shards="holdout", val_every=3, val_samples=2, val_timesteps=2)
    _mix_run(tmp_path / "online", [f"{vae} name=a holdout=0.5", f"{vae} name=b holdout=0.5"], repa=str(teacher), **common)
    ckpt = _mix_run(tmp_path / "cached", [f"{vae} name=a repa={tokens} holdout=0.5", f"{vae} name=b repa={tokens} holdout=0.5"],
                    repa="cached", **common)
    a, b = read_metrics(tmp_path / "online"), read_metrics(tmp_path / "cached")
    assert [r["step"] for r in a if "loss" in r] == [r["step"] for r in b if "loss" in r] == [1, 2, 3]
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in ("proj", "loss", "val_loss_ema", "val_loss_raw"):
            if k in x:
                assert x[k] == pytest.approx(y[k], rel=1e-5, abs=1e-6), k
        assert x.get("proj", -1) < 0 and x.get("seen_a") == y.get("seen_a") and x.get("seen_b") == y.get("seen_b")
    assert [r["step"] for r in b if "val_loss_ema" in r] == [0, 3]
    assert ckpt["projector"]["teacher"]["cached"] == {"a": str(tokens), "b": str(tokens)}
    fingerprint = read_manifest(tokens).fingerprint()
    assert [(s["repa"], s["repa_fingerprint"]) for s in ckpt["mix"]["sources"]] == [(str(tokens), fingerprint)] * 2


def test_cached_tokens_on_a_mix_are_refused_where_they_cannot_act(spaces, tmp_path):
    """Before any work: --repa cached with a source that names no tokens, tokens without --repa cached, --repa
    cached without a mix, and two sources' tokens of different encoders (both named)."""
    vae, tokens, teacher = spaces
    common = dict(patch_size=1, max_steps=1, global_batch_size=2, micro_batch_size=2, repa_depth=1, dry_run=True)
    with pytest.raises(UserError, match=r"source b: --repa cached aligns to each source's cached teacher tokens, and "
                                        r"this source names none: give it repa=FOLDER"):
        _mix_run(tmp_path / "r1", [f"{vae} name=a repa={tokens}", f"{vae} name=b"], repa="cached", **common)
    with pytest.raises(UserError, match=r"source a: repa= names REPA's cached teacher tokens, which only --repa "
                                        r"cached reads"):
        _mix_run(tmp_path / "r2", [f"{vae} name=a repa={tokens}", f"{vae} name=b"], repa=str(teacher), **common)
    with pytest.raises(UserError, match=r"--repa cached aligns to each data-mix source's cached tokens .*with one "
                                        r"shard set give the tokens' folder"):
        run_tiny(vae, tmp_path / "r3", repa="cached", **common)
    other = tmp_path / "other-tokens"
    shutil.copytree(tokens, other)
    m = json.loads((other / "manifest.json").read_text())
    m["extraction"]["encoder"]["weights_sha256"] = "f" * 64
    (other / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(UserError, match=rf"the REPA teacher tokens of sources a \({tokens}\) and b \({other}\) come "
                                        r"from different encoders: their weights differs"):
        _mix_run(tmp_path / "r4", [f"{vae} name=a repa={tokens}", f"{vae} name=b repa={other}"], repa="cached",
                 **common)
    with pytest.raises(UserError, match=r"--val-shards: source val names REPA's teacher tokens \(repa=\), which the "
                                        r"validation loss never reads"):
        _mix_run(tmp_path / "r5", [f"{vae} name=a repa={tokens}", f"{vae} name=b repa={tokens}"], repa="cached",
                 val_shards=f"{vae} name=val repa={tokens}", **common)
    assert not any((tmp_path / r / "checkpoints").exists() for r in ("r1", "r2", "r3", "r4", "r5"))


@pytest.mark.sweep
@pytest.mark.parametrize("teacher", ["cached", "online"])
def test_repa_on_a_mix_on_two_ranks_killed_and_resumed_is_bit_identical(spaces, tmp_path, teacher):
    """REPA on a two-source mix under DDP (2 gloo ranks, a loader worker each), from each source's cached tokens
    (`--repa cached`) or with the teacher on each source's pixels: a run killed with SIGKILL after step 3 and resumed
    logs the straight run's exact values and ends with its weights and projector."""
    from tests._util import straight_killed_resumed
    from tests.train.conftest import tiny_args

    vae, tokens, weights = spaces
    repa, key = ("cached", f" repa={tokens}") if teacher == "cached" else (str(weights), "")

    def args(run):
        a = tiny_args(False, run, **{"patch-size": 1, "repa": repa, "repa-depth": 1, "max-steps": 4,
                                     "num-workers": 1, "global-batch-size": 4, "micro-batch-size": 2})
        return a + ["--source", f"{vae} name=a{key}", "--source", f"{vae} name=b{key}"]

    _, a, b = straight_killed_resumed(args, tmp_path, 4, ("step", "loss", "proj", "grad_norm", "seen_a"), timeout=900)
    for part in ("model", "ema"):
        assert all(torch.equal(a[part][k], b[part][k]) for k in a[part])
    assert all(torch.equal(a["projector"]["state_dict"][k], v) for k, v in b["projector"]["state_dict"].items())
