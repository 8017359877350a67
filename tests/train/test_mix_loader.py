"""The mix's loader on real shard sets (train/mixdata.py, train/mixstream.py), without training: the samples of an
epoch follow the weights exactly (expected counts worked out here), the global batch sequence is the same at every
world size and worker count, a start at step k continues it exactly, remote sources (file: URLs, pipe: commands)
read the same bytes, held-out keys never come out, and a bad shard fails or is skipped as for one shard set."""
from __future__ import annotations

import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch

from dit_pipeline.common.errors import ConfigError, UserError
from dit_pipeline.train.mix import mix_spec, open_mix
from dit_pipeline.train.mixdata import MixFeed
from dit_pipeline.train.mixdraws import held_out
from dit_pipeline.train.stages import ReaderEvent
from tests.train.helpers import make_shard_set


@pytest.fixture(scope="module")
def sets(tmp_path_factory):
    root = tmp_path_factory.mktemp("mix-sets")
    make_shard_set(root / "a", samples=(16, 16, 16, 12))
    make_shard_set(root / "b", samples=(10, 10), seed=1)
    make_shard_set(root / "c", samples=(8, 8, 8), seed=2)
    return root


def feed(sources, *, world=1, rank=0, lanes=1, batch=8, accum=1, workers=0, buffer=16, **kw):
    mix = open_mix(mix_spec(list(sources), None, kw.pop("epoch_size", None)))
    return MixFeed(mix, seed=kw.pop("seed", 0), lanes=lanes, global_batch=batch, accum=accum, world=world, rank=rank,
                   workers=workers, buffer=buffer, shards_in_flight=3, **kw)


def epoch_batches(f, epoch=0, start=0):
    plan = f.plan(epoch)
    return [b for b in f.loader(plan, start)], plan


def pairs(batches):
    return [(int(s), int(k)) for b in batches for s, k in zip(b.sources, b.keys)]


def test_two_sources_with_proportions_give_exactly_their_share(sets):
    """0.7 / 0.3 of an epoch of 100 from sources of 60 (a) and 20 (b): a gives 70 (one pass + 10 drawn), b 30 (one
    pass + 10 drawn); in one lane with batches of 10 every sample of the epoch is used."""
    f = feed([f"{sets}/a proportion=0.7", f"{sets}/b proportion=0.3"], batch=10, epoch_size=100)
    batches, plan = epoch_batches(f)
    assert plan.steps == 10 and len(batches) == 10
    got = Counter(pairs(batches))
    per_source = Counter(s for (s, _), n in got.items() for _ in range(n))
    assert per_source == {0: 70, 1: 30}
    assert sorted(Counter(n for (s, _), n in got.items() if s == 0).values()) == [10, 50]  # 10 keys twice, 50 once
    assert sorted(Counter(n for (s, _), n in got.items() if s == 1).values()) == [10, 10]
    a_keys = {k for s, k in got if s == 0}
    assert a_keys == set(range(60))


def test_three_sources_repeat_plain_and_choose(sets):
    """repeat 2 (every key of a twice), every sample of b once, 12 drawn of c's 24: 120 + 20 + 12 = 152 = 19 x 8."""
    f = feed([f"{sets}/a repeat=2", f"{sets}/b", f"{sets}/c choose=12"], batch=8)
    batches, plan = epoch_batches(f)
    got = Counter(pairs(batches))
    assert plan.steps == 19 and sum(got.values()) == 152
    assert {k: n for (s, k), n in got.items() if s == 0} == {k: 2 for k in range(60)}  # twice as often
    assert {k: n for (s, k), n in got.items() if s == 1} == {k: 1 for k in range(20)}
    c = [k for (s, k), n in got.items() if s == 2]
    assert len(c) == 12 and all(got[(2, k)] == 1 for k in c) and set(c) <= set(range(24))
    # the two passes over a sample differ: another view seed, so other posterior noise
    twice = [b.latents[i] for b in batches for i in range(len(b.keys)) if int(b.sources[i]) == 0 and int(b.keys[i]) == 5]
    assert len(twice) == 2 and not torch.equal(twice[0], twice[1])


def global_batches(sources, world, workers, accum=1, start=0, lanes=4, batch=8):
    """The global batch of each step: every rank's micro-batches in rank order, concatenated."""
    per_rank = [epoch_batches(feed(sources, world=world, rank=r, lanes=lanes, batch=batch, accum=accum,
                                   workers=workers), start=start)[0] for r in range(world)]
    steps = len(per_rank[0]) // accum
    out = []
    for k in range(steps):
        parts = [b for r in range(world) for b in per_rank[r][k * accum:(k + 1) * accum]]
        out.append((torch.cat([b.latents for b in parts]), pairs(parts)))
    return out


def test_the_global_sequence_is_the_same_at_every_world_size_and_worker_count(sets):
    sources = [f"{sets}/a proportion=2", f"{sets}/b proportion=1", f"{sets}/c proportion=1"]
    ref = global_batches(sources, 1, 0)
    assert len(ref) >= 10
    for world, workers, accum in ((2, 0, 1), (4, 0, 1), (2, 2, 2), (1, 2, 4)):
        got = global_batches(sources, world, workers, accum)
        assert [p for _, p in got] == [p for _, p in ref], (world, workers, accum)
        assert all(torch.equal(a, b) for (a, _), (b, _) in zip(got, ref)), (world, workers, accum)


def test_a_start_at_step_k_continues_the_sequence_exactly(sets):
    sources = [f"{sets}/a repeat=2", f"{sets}/b"]
    full = global_batches(sources, 2, 0, lanes=2)
    for k in (1, 5, len(full) - 1):
        tail = global_batches(sources, 1, 0, start=k, lanes=2)  # resumed on another world size
        assert [p for _, p in tail] == [p for _, p in full[k:]]
        assert all(torch.equal(a, b) for (a, _), (b, _) in zip(tail, full[k:]))


def test_held_out_keys_never_come_out(sets):
    f = feed([f"{sets}/a holdout=0.25", f"{sets}/b"], batch=4)
    batches, plan = epoch_batches(f)
    seen = {k for s, k in pairs(batches) if s == 0}
    held = {k for k in range(60) if held_out(k, 0.25)}
    assert held and not (seen & held) and len(seen) + len(held) >= 56  # all but the epoch's tail
    assert plan.available[0] == 60 - len(held)


def test_remote_sources_read_the_same_samples(sets, tmp_path):
    """file: URLs (a brace pattern) and a pipe: command, each with its manifest, give the folder's batches."""
    local = feed([f"{sets}/a", f"{sets}/b"], lanes=2)
    a_urls = f"file:{sets}/a/shard-{{000000..000003}}.tar"
    b_pipe = f"pipe:cat {sets}/b/shard-{{000000..000001}}.tar"
    remote = feed([f"shards='{a_urls}' manifest={sets}/a/manifest.json name=a",
                   f"shards='{b_pipe}' manifest={sets}/b/manifest.json name=b"], lanes=2)
    x, _ = epoch_batches(local)
    y, _ = epoch_batches(remote)
    assert pairs(x) == pairs(y) and all(torch.equal(p.latents, q.latents) for p, q in zip(x, y))


def test_a_corrupt_or_missing_source_shard(sets, tmp_path):
    bad = tmp_path / "b"
    shutil.copytree(sets / "b", bad)
    (bad / "shard-000001.tar").write_bytes((bad / "shard-000001.tar").read_bytes()[:-2000])  # truncated
    sources = [f"{sets}/a", f"{bad} name=b"]
    with pytest.raises(UserError, match=r"source b: the shard set in .* does not match its manifest"):
        feed(sources)  # the size check at start, as for --shards
    (bad / "shard-000001.tar").write_bytes(bytes(b ^ 0xFF if i == 3000 else b for i, b in
                                                 enumerate((sets / "b" / "shard-000001.tar").read_bytes())))
    items, _ = epoch_batches(feed(sources, sha256="stream"))
    errors = [it for it in items if isinstance(it, ReaderEvent)]
    assert errors and errors[0].kind == "error" and "shard-000001.tar" in errors[0].message
    f = feed(sources, sha256="whole", skip_bad_shards=True)
    items, _ = epoch_batches(f)
    skipped = [sk for it in items for sk in it.skipped]
    assert len(skipped) == 1 and f.shard_name(skipped[0].url) == "b/shard-000001.tar"
    # the next epoch plan leaves the bad shard out by name: its keys are not asked for any more
    assert f.plan(1, ["b/shard-000001.tar"]).available == (60, 10)
    (bad / "shard-000001.tar").unlink()
    with pytest.raises(UserError, match="(?s)source b: .*shard-000001.tar: missing"):
        feed(sources)


def test_sources_in_another_latent_space_are_refused_naming_both(sets, tmp_path):
    make_shard_set(tmp_path / "wide", samples=(8, 8), latent_shape=(4, 16, 16))
    with pytest.raises(UserError, match=r"sources a \(.*/a\) and wide \(.*/wide\) are not one latent space: their "
                                        r"latent_shape differs: \[4, 8, 8\] vs \[4, 16, 16\]"):
        feed([f"{sets}/a", f"{tmp_path}/wide"])
    make_shard_set(tmp_path / "scaled", samples=(8, 8), scaling_factor=0.25)
    with pytest.raises(UserError, match="not one latent space: their normalization differs"):
        feed([f"{sets}/a", f"{tmp_path}/scaled"])


def test_source_syntax_refusals(sets):
    with pytest.raises(UserError, match="'weight=2' is not key=value with a key among shards, manifest"):
        mix_spec([f"{sets}/a weight=2"], None)
    with pytest.raises(ConfigError, match="proportion .* do not mix"):
        mix_spec([f"{sets}/a proportion=0.5", f"{sets}/b repeat=2"], None)
    with pytest.raises(ConfigError, match="two sources are named x"):
        mix_spec([f"{sets}/a name=x", f"{sets}/b name=x"], None)
    spec = mix_spec([f"{sets}/a", f"{sets}/a"], None)  # the same set twice: named apart
    assert [s.name for s in spec.sources] == ["a", "a-2"]
    spec = mix_spec([f"{sets}/a", f"{sets}/b name=a"], None)  # a given name wins, the folder's name steps aside
    assert [s.name for s in spec.sources] == ["a-2", "a"]


def test_mix_file(sets, tmp_path):
    path = tmp_path / "mix.yaml"
    path.write_text(f"epoch_size: 50\nsources:\n  - shards: {sets}/a\n    proportion: 0.6\n"
                    f"  - {{shards: {sets}/b, proportion: 0.4, name: small}}\n")
    spec = mix_spec(None, str(path))
    assert [s.name for s in spec.sources] == ["a", "small"] and spec.epoch_size == 50
    f = MixFeed(open_mix(spec), seed=0, lanes=1, global_batch=10, accum=1, world=1, rank=0, workers=0, buffer=8,
                shards_in_flight=2)
    assert f.plan(0).asked == (30, 20)


def test_a_source_exhausted_early_and_a_repeated_source_are_said(sets, project_log):
    """A source asked for more than it holds is named at the start with the repeat rule; one whose share of the
    epoch is all seen long before the epoch's end (its shards skipped, say) is warned about once, with the step."""
    f = feed([f"{sets}/a proportion=0.2", f"{sets}/b proportion=0.8"], batch=10, epoch_size=100)
    plan = f.plan(0)
    notes = f.start_notes(plan)
    assert plan.asked == (20, 80) and len(notes) == 1 and notes[0].startswith(
        "source b holds 20 samples and the mix takes 80 per epoch (proportion 0.8): it is exhausted after 25% of each "
        "epoch and repeats (MosaicML Streaming's repeat rule: 4 full pass(es) over all its samples + 0 drawn")
    f.step_done({"mix_0": 2.0, "mix_1": 8.0}, 0, 1, plan)
    f.step_done({"mix_0": 18.0, "mix_1": 2.0}, 0, 2, plan)  # a's 20 all seen at step 2 of 10
    f.step_done({"mix_0": 0.0, "mix_1": 10.0}, 0, 3, plan)
    warned = [m for m in project_log if "is exhausted at step" in m]
    assert warned == [f"source a is exhausted at step 2 of {plan.steps} of epoch 0: all 20 of its samples this epoch "
                      "are seen (by the mix's repeat rule, floor(asked / held) full passes plus a drawn part: 0 x 60 + "
                      "20), so the rest of the epoch draws from the other sources only and the realised proportions "
                      "drift from the asked ones"]
    assert f.state.seen == [20, 20] and f.log_fields(plan)["share_a"] == 0.5
