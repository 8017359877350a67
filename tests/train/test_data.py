"""The shard stream: shard-set resolution and its errors, the latent formula, exactly-once across ranks and
real DataLoader workers, per-sample randomness independent of the worker count, exact resume by skipping,
and unreadable shards (fail fast naming the shard, or skip and count)."""
from __future__ import annotations

import itertools
import shutil

import pytest
import torch

from dit_pipeline.common.errors import UserError
from dit_pipeline.shards import iter_shard
from tests.train.conftest import SHARD_SIZES
from tests.train.helpers import make_shard_set
from dit_pipeline.common.seeding import STREAM_SAMPLE, derive_seed
from dit_pipeline.train.data import Batch, EpochStream, make_loader
from dit_pipeline.train.shard_source import open_shards
from dit_pipeline.train.stages import ReaderEvent, shuffle_buffer
from dit_pipeline.train.latents import LatentSpec, epoch_seed, make_latent, make_latents, mix_seed, sample_seed
from dit_pipeline.train.partition import plan_epoch

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create")


def _plan(src, *, world=1, workers=1, micro=4, accum=1, epoch=0, seed=0):
    return plan_epoch(src.sizes, seed=seed, epoch=epoch, world_size=world, workers=workers, micro_batch=micro,
                      accum=accum)


def _collect(src, plan, rank, *, workers, start=0, seed=0, buffer=8, skip_bad=False):
    stream = EpochStream(src, plan, rank, seed=seed, buffer=buffer, start_batch=start, skip_bad_shards=skip_bad)
    loader = make_loader(stream, num_workers=workers, prefetch_factor=2, pin_memory=False)
    return list(itertools.islice(loader, plan.micro_batches - start))


def test_open_shards_folder_and_url_pattern(shard_dir):
    src = open_shards(str(shard_dir))
    assert src.sizes == list(SHARD_SIZES) and src.folder == shard_dir
    assert src.fingerprint == src.manifest.fingerprint()
    pattern = f"{shard_dir}/shard-{{000000..000003}}.tar"
    via_urls = open_shards(pattern, str(shard_dir / "manifest.json"))
    assert via_urls.urls == src.urls and via_urls.folder is None
    with pytest.raises(UserError, match="lists 3 of the 4 shards .* missing: shard-000003.tar"):
        open_shards(f"{shard_dir}/shard-{{000000..000002}}.tar", str(shard_dir))
    with pytest.raises(UserError, match="also pass --manifest"):
        open_shards(pattern)
    with pytest.raises(UserError, match="names no shard of the manifest"):
        open_shards(f"{shard_dir}/other.tar::{pattern}", str(shard_dir))


def test_open_shards_refuses_missing_or_truncated_shard(shard_dir, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(shard_dir, copy)
    (copy / "shard-000002.tar").unlink()
    with open(copy / "shard-000001.tar", "r+b") as f:
        f.truncate(1000)
    with pytest.raises(UserError) as e:
        open_shards(str(copy))
    msg = str(e.value)
    assert "shard-000002.tar: missing" in msg and "shard-000001.tar: 1000 bytes" in msg


def test_sample_seed_is_splitmix64_of_the_epoch_seed():
    # SplitMix64's published outputs for state 0 (the reference splitmix64.c), less their lowest bit.
    want = [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F, 0xF88BB8A8724C81EC]
    assert [mix_seed(0, i) for i in range(4)] == [w >> 1 for w in want]
    base = derive_seed(3, STREAM_SAMPLE, 2)
    assert epoch_seed(3, 2) == base and sample_seed(3, 2, "000000017") == mix_seed(base, 17)
    seeds = [mix_seed(base, i) for i in range(20000)]
    assert len(set(seeds)) == 20000 and all(0 <= s < 2 ** 63 for s in seeds)
    assert 0.45 < sum(s >> 62 for s in seeds) / 20000 < 0.55  # high bits (the view) balanced


# per channel: x = (z - mean_c) * multiplier / std_c, with float32 vectors shift_c = mean_c and
# scale_c = float32(multiplier / std_c) (common/latent_norm.py)
PER_CHANNEL = {"form": "mean_std", "mean": [0.5, -0.25, 0.0, 1.5], "std": [0.5, 2.0, 3.0, 0.3],
               "multiplier": 0.9, "source": {"kind": "stats", "samples_used": 5, "seed": 0}}


def _by_hand(z: torch.Tensor, shift, norm) -> torch.Tensor:
    if norm is None:
        return (z - (shift or 0.0)) * 0.7
    scale = torch.tensor([norm["multiplier"] / s for s in norm["std"]], dtype=torch.float64).float()
    mean = torch.tensor(norm["mean"], dtype=torch.float32)
    return (z - mean.view(4, 1, 1)) * scale.view(4, 1, 1)


@pytest.mark.parametrize("store,views,shift,dtype,norm", [("posterior", 1, None, "float32", None),
                                                           ("posterior", 2, 0.25, "float16", None),
                                                           ("posterior", 2, None, "bfloat16", None),
                                                           ("sample", 2, None, "float16", None),
                                                           ("posterior", 2, None, "float16", PER_CHANNEL),
                                                           ("sample", 1, None, "float32", PER_CHANNEL)])
def test_latent_formula(tmp_path, store, views, shift, dtype, norm):
    folder = tmp_path / "s"
    m = make_shard_set(folder, samples=[5], views=views, store=store, shift_factor=shift, scaling_factor=0.7,
                       dtype=dtype, normalization=norm)
    assert m.format_version == (3 if norm else 1)
    spec = LatentSpec.from_manifest(m)
    url = str(folder / "shard-000000.tar")
    wide, raw = list(iter_shard(url, m)), list(iter_shard(url, m, raw=True))
    assert raw[0].mean is None or raw[0].mean.dtype.str == {"float32": "<f4", "float16": "<f2",
                                                             "bfloat16": "<u2"}[dtype]
    for s, r in zip(wide, raw):
        got = make_latent(s, spec, seed=3, epoch=2)
        sd = sample_seed(3, 2, s.key)  # the documented per-sample seed
        view = (sd >> 32) % views
        if store == "posterior":
            noise = torch.randn((4, 8, 8), generator=torch.Generator().manual_seed(sd))
            z = torch.from_numpy(s.mean[view]) + torch.from_numpy(s.std[view]) * noise
        else:
            z = torch.from_numpy(s.latent[view])
        want = _by_hand(z, shift, norm)
        if norm is not None:  # two exactly rounded float32 ops per element: the same bits as by hand
            assert torch.equal(got, want)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        assert torch.equal(make_latent(r, spec, seed=3, epoch=2), got)  # raw arrays: the same values
        if store == "posterior":  # fresh posterior noise every epoch
            assert not torch.equal(got, make_latent(s, spec, seed=3, epoch=3))
    together = make_latents(raw, spec, seed=3, epoch=2)  # a batch equals its samples computed alone
    assert all(torch.equal(together[i], make_latent(s, spec, seed=3, epoch=2)) for i, s in enumerate(wide))
    if views == 2:  # both views are used across samples and epochs
        picked = {(sample_seed(3, e, f"{k:09d}") >> 32) % 2 for e in range(8) for k in range(3)}
        assert picked == {0, 1}


def test_shuffle_buffer():
    items = list(range(100))
    out = list(shuffle_buffer(iter(items), 10, seed=5))
    assert sorted(out) == items and out != items
    assert out == list(shuffle_buffer(iter(items), 10, seed=5))
    assert out != list(shuffle_buffer(iter(items), 10, seed=6))
    assert list(shuffle_buffer(iter(items), 1, seed=5)) == items
    assert sorted(shuffle_buffer(iter(items[:3]), 10, seed=1)) == [0, 1, 2]


def test_two_ranks_two_workers_exactly_once_equal_counts(shard_dir):
    src = open_shards(str(shard_dir))
    plan = _plan(src, world=2, workers=2, micro=3)
    keys = []
    for rank in (0, 1):
        batches = _collect(src, plan, rank, workers=2)
        assert all(isinstance(b, Batch) and b.latents.shape == (3, 4, 8, 8) for b in batches)
        assert len(batches) == plan.micro_batches
        keys += [int(k) for b in batches for k in b.keys]
    assert len(keys) == len(set(keys)) == plan.samples_used
    assert set(keys) <= {i * 16 + j for i, n in enumerate(SHARD_SIZES) for j in range(n)}


def test_per_sample_values_do_not_depend_on_workers(shard_dir):
    src = open_shards(str(shard_dir))
    by_workers = {}
    for workers in (1, 2):
        plan = _plan(src, workers=workers, micro=2)
        batches = _collect(src, plan, 0, workers=workers)
        by_workers[workers] = {int(k): (lat, int(y)) for b in batches
                               for k, lat, y in zip(b.keys, b.latents, b.labels)}
    common = set(by_workers[1]) & set(by_workers[2])
    assert len(common) > 40
    for k in common:
        assert torch.equal(by_workers[1][k][0], by_workers[2][k][0])
        assert by_workers[1][k][1] == by_workers[2][k][1] == k % 2


@pytest.mark.parametrize("start", [1, 5])
def test_resume_skip_continues_the_identical_stream(shard_dir, start):
    src = open_shards(str(shard_dir))
    plan = _plan(src, workers=3, micro=2, epoch=1)
    full = _collect(src, plan, 0, workers=3)
    rest = _collect(src, plan, 0, workers=3, start=start)
    assert len(rest) == len(full) - start
    for a, b in zip(full[start:], rest):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.latents, b.latents)


def test_unreadable_shard_fails_fast_or_is_skipped(shard_dir, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(shard_dir, copy)
    path = copy / "shard-000001.tar"
    data = bytearray(path.read_bytes())
    at = data.find(b"000000024.mean.npy")  # a member header in the middle of the shard
    data[at:at + 6] = b"\xff" * 6  # same size, so the quick size check passes; the tar checksum fails
    path.write_bytes(bytes(data))
    src = open_shards(str(copy))
    plan = _plan(src, workers=1, micro=4)
    items = _collect(src, plan, 0, workers=0)
    errors = [it for it in items if isinstance(it, ReaderEvent)]
    assert errors and errors[0].kind == "error" and "shard-000001.tar" in errors[0].message
    items = _collect(src, plan, 0, workers=0, skip_bad=True)
    skipped = [sk for it in items for sk in it.skipped]
    assert len(skipped) == 1 and "shard-000001.tar" in skipped[0][0]
    assert isinstance(items[-1], ReaderEvent) and items[-1].kind == "exhausted"
    assert len(items) == plan.micro_batches  # the item count stays fixed, so the loader order does too
    good = [int(k) for b in items if isinstance(b, Batch) for k in b.keys]
    assert len(set(good)) == len(good)
    assert not any(24 <= k < 32 for k in good)  # nothing from the corrupt member on


def test_readers_mix_several_shards_at_once(shard_dir):
    src = open_shards(str(shard_dir))
    plan = _plan(src, workers=1, micro=8)

    def first_batch_shards(in_flight):
        stream = EpochStream(src, plan, 0, seed=0, buffer=1, shards_in_flight=in_flight)  # buffer 1: no shuffle
        return {int(k) // 16 for k in next(iter(stream)).keys}

    assert len(first_batch_shards(1)) == 1  # one shard at a time: a batch comes from one shard
    assert len(first_batch_shards(4)) >= 3  # shards are written in class order; readers interleave them
