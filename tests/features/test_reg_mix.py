"""REG on a data mix and REG's validation loss (issues 44 and 46 together: NanoGen's T2I REG configs train on BLIP3o's
three splits at once). Each source names its class tokens (`reg=`, a sibling of its own images); every sample of a
batch carries the token of its own source, key and view, in process and through loader workers; the tokens of all
sources come from one encoder or the mix is refused naming both; `dit-train --use-reg` on a two-source mix resumes to
the straight run's exact values and weights and records each source's tokens; `--val-shards 'SHARDS reg=TOKENS'`
evaluates a REG model with each held-out sample's token (a validation pass without them was a KeyError)."""
from __future__ import annotations

import pytest
import torch

from dit_pipeline.common.errors import UserError
from dit_pipeline.extract import ExtractConfig, run_extract
from dit_pipeline.shards import iter_shard, key_index, read_manifest
from dit_pipeline.train.checkpoint import CheckpointManager, load_checkpoint
from dit_pipeline.train.latents import mix_seed, sample_view
from dit_pipeline.train.metrics import read_metrics
from dit_pipeline.train.mix import mix_spec, open_mix
from dit_pipeline.train.mixdata import MixFeed
from dit_pipeline.train.mixdraws import sample_base
from tests._util import make_image_tree
from tests.features.conftest import BASE
from tests.features.test_reg_training import IC
from tests.train.conftest import invoke_train


@pytest.fixture(scope="module")
def two_sources(reg_sets, encoder, tiny_vae_dir, tmp_path_factory):
    """{name: (latents, class tokens)} of two image trees, and b's tokens stored as float16 (another token space)."""
    root = tmp_path_factory.mktemp("reg-mix")
    tree = make_image_tree(root / "images", counts=(2, 2))
    b, tb, half = root / "b", root / "b-tokens", root / "b-tokens16"
    run_extract(ExtractConfig(data_path=str(tree), out=str(b), vae=str(tiny_vae_dir), **BASE))
    for out, dtype in ((tb, "float32"), (half, "float16")):
        run_extract(ExtractConfig(data_path=str(tree), out=str(out), encoder=str(encoder), encoder_formula="reg",
                                  dtype=dtype, **BASE))
    return {"a": reg_sets, "b": (b, tb)}, half


def _tokens(folder) -> dict[int, torch.Tensor]:
    m = read_manifest(folder)
    return {key_index(s.key): torch.from_numpy(s.latent).reshape(m.views, -1)
            for url in m.shard_urls(str(folder)) for s in iter_shard(url, m)}


def _spec(sets, **extra):
    return mix_spec([f"{shards} name={n} reg={tokens} " + " ".join(f"{k}={v}" for k, v in extra.get(n, {}).items())
                     for n, (shards, tokens) in sets.items()], None)


def _batches(sets, workers):
    feed = MixFeed(open_mix(_spec(sets), use_reg=True), seed=0, lanes=2, global_batch=4, accum=1, world=1, rank=0,
                   workers=workers, buffer=4, shards_in_flight=2, tokens=True)
    return [list(feed.loader(feed.plan(epoch), 0)) for epoch in range(2)], feed


def test_every_sample_carries_its_own_sources_token_of_its_view(two_sources):
    sets, _ = two_sources
    batches, feed = _batches(sets, workers=0)
    tokens = [_tokens(t) for _, t in sets.values()]
    views, seen = set(), 0
    for epoch, epoch_batches in enumerate(batches):
        for b in epoch_batches:
            assert b.teacher is not None and b.teacher.shape == (len(b.keys), 1, 32)
            for row, s, k in zip(b.teacher, b.sources.tolist(), b.keys.tolist()):
                # each source is read once per epoch here (no repeat): pass 0 draws the view, as the latent's
                v = sample_view(mix_seed(sample_base(0, epoch, s, 0), k), 2)
                assert torch.equal(row[0], tokens[s][k][v])
                views.add(v)
                seen += 1
    assert seen == sum(feed.plan(e).samples_used for e in range(2)) > 0 and views == {0, 1}  # both views
    workers, _ = _batches(sets, workers=1)  # the pooled path of a loader worker: the same tokens
    pairs = [(x, y) for ex, ey in zip(batches, workers) for x, y in zip(ex, ey, strict=True)]
    assert all(torch.equal(x.teacher, y.teacher) and torch.equal(x.latents, y.latents) for x, y in pairs)


def test_the_mixs_tokens_are_refused_when_missing_unasked_foreign_or_from_another_space(two_sources):
    sets, half = two_sources
    (a, ta), (b, _) = sets["a"], sets["b"]
    with pytest.raises(UserError, match=r"source b: --use-reg trains on each sample's class token, and this source "
                                        r"names none: give it reg=FOLDER"):
        open_mix(mix_spec([f"{a} reg={ta}", f"{b} name=b"], None), use_reg=True)
    with pytest.raises(UserError, match=r"source a: reg= names REG's class tokens: add --use-reg \(or drop reg=\)"):
        open_mix(_spec(sets))
    with pytest.raises(UserError, match=rf"source b reg= {ta}: not the same images in the same views"):
        open_mix(mix_spec([f"{a} name=a reg={ta}", f"{b} name=b reg={ta}"], None), use_reg=True)
    with pytest.raises(UserError, match=rf"the class tokens of sources a \({ta}\) and b \({half}\) come from "
                                        r"different encoders: their stored dtype differs \('float32' vs 'float16'\)"):
        open_mix(mix_spec([f"{a} name=a reg={ta}", f"{b} name=b reg={half}"], None), use_reg=True)


def _train(run, sets, *extra):
    args = ["--run-dir", run, "--use-reg", "--base-model-depth", "1"]
    for n, (shards, tokens) in sets.items():
        args += ["--source", f"{shards} name={n} reg={tokens}"]
    for k, v in IC.items():
        args += [f"--{k}"] if v is None else [f"--{k}", str(v)]
    b, tb = sets["b"]
    args += ["--val-shards", f"{b} reg={tb}", "--val-every", "2", "--val-samples", "4", "--val-timesteps", "2"]
    return invoke_train(args + list(extra))


def test_reg_on_a_mix_resumes_exactly_with_its_validation_loss(two_sources, tmp_path):
    sets, half = two_sources
    r = _train(tmp_path / "straight", sets, "--max-steps", "3")
    assert r.exit_code == 0, r.output
    plan = (tmp_path / "straight" / "log.txt").read_text()
    assert f"cached beside each source (a: {sets['a'][1]}, b: {sets['b'][1]}); loss + 0.03 x reg" in plan
    assert _train(tmp_path / "resumed", sets, "--max-steps", "2").exit_code == 0
    r = _train(tmp_path / "resumed", sets, "--max-steps", "3")
    assert r.exit_code == 0, r.output
    keys = ("step", "loss", "mse", "reg", "base", "grad_norm", "seen_a", "seen_b")
    a = [tuple(rec[k] for k in keys) for rec in read_metrics(tmp_path / "straight") if "loss" in rec]
    b = [tuple(rec[k] for k in keys) for rec in read_metrics(tmp_path / "resumed") if "loss" in rec]
    assert [x[0] for x in a] == [1, 2, 3] and a == b and all(x[3] > 0 for x in a)  # exact floats; the reg term
    val = [(rec["step"], rec["val_loss_ema"], rec["val_loss_raw"]) for rec in read_metrics(tmp_path / "straight")
           if "val_loss_ema" in rec]
    assert [v[0] for v in val] == [0, 2] and all(v[1] > 0 for v in val)
    runs = [rec["val_run"] for rec in read_metrics(tmp_path / "straight") if "val_run" in rec]
    assert runs[0]["reg_tokens"] == {"b": str(sets["b"][1])}  # what produced the number
    assert val == [(rec["step"], rec["val_loss_ema"], rec["val_loss_raw"]) for rec in
                   read_metrics(tmp_path / "resumed") if "val_loss_ema" in rec]  # a rerun's values, bit for bit
    ca = load_checkpoint(CheckpointManager(tmp_path / "straight" / "checkpoints").latest())
    cb = load_checkpoint(CheckpointManager(tmp_path / "resumed" / "checkpoints").latest())
    assert all(torch.equal(ca["model"][k], cb["model"][k]) for k in ca["model"])
    sources = ca["mix"]["sources"]
    assert [s["reg"] for s in sources] == [str(t) for _, t in sets.values()]
    assert all(len(s["reg_fingerprint"]) == 64 for s in sources) and ca["reg"]["reg_dim"] == 32

    # validation without the held-out samples' tokens, or with another space's, is refused before any work
    r = invoke_train(["--run-dir", tmp_path / "x", "--use-reg", "--shards", sets["a"][0], "--reg-tokens",
                      sets["a"][1], "--val-shards", sets["b"][0], "--dry-run"]
                     + [a for k, v in IC.items() for a in ([f"--{k}"] if v is None else [f"--{k}", str(v)])])
    assert r.exit_code != 0 and ("--val-shards: source b: --use-reg trains on each sample's class token, and this "
                                 "source names none: give it reg=FOLDER") in r.output, r.output
    r = _train(tmp_path / "y", sets, "--val-shards", f"{sets['b'][0]} reg={half}", "--dry-run")
    assert r.exit_code != 0 and "--val-shards: the class tokens of sources a (" in r.output
    assert "their stored dtype differs ('float32' vs 'float16')" in r.output


def test_a_recipe_on_the_mix_checks_each_source_and_takes_the_sources_and_validation_as_data(two_sources, tmp_path):
    """`--config` on a mix: every source's latents and class tokens against the recipe's `requires`, each departure
    naming its source; --source and --val-shards are data (no setting departure), as --shards is."""
    sets, _ = two_sources
    args = ["--config", "recipes/nanogen/ddt-en28d1152hd72-dn2d2048hd128-sdvae-ema-reg0.03-rmsnorm-vpred-t4c8.yaml",
            "--run-dir", tmp_path / "r", "--global-batch-size", "4", "--dry-run", "--allow-departures",
            "--val-shards", f"{sets['b'][0]} reg={sets['b'][1]}"]
    for n, (shards, tokens) in sets.items():
        args += ["--source", f"{shards} name={n} reg={tokens}"]
    r = invoke_train(args)
    assert r.exit_code == 0, r.output
    departs = [x.strip() for x in r.output.splitlines() if x.strip().startswith("departs ")]
    assert departs[0].split() == ["departs", "--global-batch-size", "1024", "->", "4"]
    assert not any("--source" in d or "--val-shards" in d for d in departs)
    for n, (_, tokens) in sets.items():
        assert f"departs     shards: source {n}: latent shape 4x4x4 where the recipe needs 4x32x32" in departs
        assert any(d.startswith(f"departs     shards: source {n}: REG class tokens {tokens}: ") for d in departs)


@pytest.mark.sweep
def test_reg_on_a_mix_on_two_ranks_killed_and_resumed_is_bit_identical(two_sources, tmp_path):
    """REG on a two-source mix under DDP (2 gloo ranks, a loader worker each): a run killed with SIGKILL after step 3
    and resumed logs the straight run's exact values and ends with its weights."""
    from tests._util import straight_killed_resumed

    sets, _ = two_sources

    def args(run):
        a = ["--run-dir", str(run), "--use-reg", "--max-steps", "4", "--num-workers", "1"]
        for n, (shards, tokens) in sets.items():
            a += ["--source", f"{shards} name={n} reg={tokens}"]
        return a + [x for k, v in IC.items() if k != "num-workers"
                    for x in ([f"--{k}"] if v is None else [f"--{k}", str(v)])]

    _, a, b = straight_killed_resumed(args, tmp_path, 4, ("step", "loss", "mse", "reg", "grad_norm", "seen_a"),
                                      timeout=900)
    for part in ("model", "ema"):
        assert all(torch.equal(a[part][k], b[part][k]) for k in a[part])
