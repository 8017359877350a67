"""End-to-end extraction in one process: keys, labels, latents, skips, config refusal, resume details."""
from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import torch
from torchvision.datasets import ImageFolder

from dit_pipeline.common.errors import UserError
from dit_pipeline.common.seeding import derive_seed
from dit_pipeline.common.vae import load_vae
from dit_pipeline.extract.encode import STREAM_EXTRACT_SAMPLE
from dit_pipeline.extract.images import load_rgb
from dit_pipeline.shards import read_manifest, sample_key, shard_name, verify_shards
from tests._util import FP32_EPS, assert_close_at_scale, draw_image
from tests.extract.conftest import UNUSABLE, extract, read_samples, shard_hashes
from tests.extract.test_images import reference_crop


def _direct_posterior(vae, path, size):
    """mean, std [2, C, h, w] of one image, computed without the pipeline: independent crop, [-1, 1] by hand,
    encoder + quant_conv, logvar clamped to [-30, 20], std = exp(logvar / 2)."""
    rgb, _ = load_rgb(path)
    crop = torch.from_numpy(reference_crop(rgb, size)).double()
    x = (crop / 127.5 - 1).permute(2, 0, 1)[None]
    x = torch.cat([x, x.flip(-1)])
    with torch.no_grad():
        moments = vae.quant_conv(vae.encoder(x))
    mean, logvar = moments.chunk(2, dim=1)
    return mean.float().numpy(), torch.exp(0.5 * logvar.clamp(-30.0, 20.0)).float().numpy()


def test_odd_tree_end_to_end(odd_tree, tiny_vae_dir, tmp_path):
    out = tmp_path / "out"
    summary = extract(odd_tree, tiny_vae_dir, out, dtype="float32")
    m = read_manifest(out)
    clean = tmp_path / "clean"       # ImageFolder's view of the tree without the hidden entries we ignore
    shutil.copytree(odd_tree, clean, ignore=lambda d, names: [n for n in names if n.startswith(".")])
    ref = ImageFolder(str(clean), allow_empty=True)
    paths = [p[len(str(clean)) + 1:] for p, _ in ref.samples]
    assert len(paths) == 15 and m.extraction["num_images"] == 15
    bad = {paths.index(p): reason for p, reason in UNUSABLE.items()}
    assert (summary.images, summary.skipped, summary.total_samples) == (10, 5, 10)
    assert [s["key"] for s in m.skipped] == [sample_key(i) for i in sorted(bad)]
    for s in m.skipped:
        assert s["path"] == paths[int(s["key"])] and bad[int(s["key"])] in s["reason"]
    assert [s.name for s in m.shards] == [shard_name(i) for i in range(4)]      # 15 indices, 4 per shard
    assert [s.samples for s in m.shards] == [4, 4, 1, 1]
    assert (m.scaling_factor, m.shift_factor) == (0.5, None)                    # from the VAE config
    assert (m.views, m.store, m.dtype, m.latent_shape, m.image_size) == (2, "posterior", "float32", [4, 4, 4], 32)
    assert m.class_names == ["a_plain", "b_odd", "c_empty", "d_bad"] and m.num_classes == 4
    assert m.extraction["vae"]["weights_sha256"] and m.extraction["precision"] == "fp32"
    assert verify_shards(out, quick=False, progress=False).ok

    vae, _ = load_vae(str(tiny_vae_dir), dtype=torch.float64)
    samples = read_samples(out)
    assert sorted(samples) == [sample_key(i) for i in range(15) if i not in bad]
    for key, s in samples.items():
        i = int(key)
        assert s.label == ref.samples[i][1] and s.meta["path"] == paths[i]
        mean, std = _direct_posterior(vae, odd_tree / paths[i], 32)
        assert s.mean.shape == s.std.shape == (2, 4, 4, 4)
        assert_close_at_scale(s.mean, mean, rel=64 * FP32_EPS)  # float32 VAE vs float64
        assert_close_at_scale(s.std, std, rel=64 * FP32_EPS)
    assert samples[sample_key(3)].meta["orig_mode"] == "CMYK"
    assert samples[sample_key(8)].meta["orig_mode"] in ("I;16", "I")  # a 16-bit PNG: "I" before Pillow 10.1


def test_empty_shard_when_every_image_of_it_is_unusable(odd_tree, tiny_vae_dir, tmp_path):
    out = tmp_path / "out"
    extract(odd_tree, tiny_vae_dir, out, samples_per_shard=2)
    m = read_manifest(out)
    assert len(m.shards) == 8
    assert m.shards[5].samples == 0 and m.shards[5].first_key is None                 # indices 10, 11: both bad
    assert [s["key"] for s in m.skipped if int(s["key"]) in (10, 11)] == [sample_key(10), sample_key(11)]
    assert m.total_samples == 10 and verify_shards(out, progress=False).ok


def test_workers_do_not_change_a_byte(odd_tree, tiny_vae_dir, odd_baseline, tmp_path):
    _, _, hashes = odd_baseline
    extract(odd_tree, tiny_vae_dir, tmp_path / "w2", num_workers=2)
    assert shard_hashes(tmp_path / "w2") == hashes


def test_batch_size_changes_only_rounding(odd_tree, tiny_vae_dir, odd_baseline, tmp_path):
    base_out, _, _ = odd_baseline
    extract(odd_tree, tiny_vae_dir, tmp_path / "b1", batch_size=1)
    a, b = read_samples(base_out), read_samples(tmp_path / "b1")
    assert sorted(a) == sorted(b)
    for k in a:
        assert_close_at_scale(a[k].mean, b[k].mean, rel=2.0 ** -10)  # float16 storage: one unit of its last place
        assert a[k].label == b[k].label and a[k].meta == b[k].meta


def test_strict_stops_at_the_first_unusable_image(odd_tree, tiny_vae_dir, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(UserError) as e:
        extract(odd_tree, tiny_vae_dir, out, strict=True)
    assert "d_bad/bomb.png: decompression bomb" in str(e.value) and "--strict" in str(e.value)
    assert not (out / "manifest.json").exists()
    assert not list(out.glob(".tmp-*"))                 # the shard being written was aborted
    # shards before the bad image may be finished (a rerun without --strict keeps them); none after it
    assert shard_name(0) in {p.name for p in out.glob("shard-*")}
    assert not (out / shard_name(2)).exists() and not (out / shard_name(3)).exists()


def test_sample_store_without_flip(odd_tree, tiny_vae_dir, tmp_path):
    post, smp = tmp_path / "post", tmp_path / "smp"
    extract(odd_tree, tiny_vae_dir, post, flip=False, dtype="float32")
    extract(odd_tree, tiny_vae_dir, smp, flip=False, dtype="float32", store="sample", seed=7)
    m = read_manifest(smp)
    assert (m.views, m.store, m.extraction["seed"]) == (1, "sample", 7)
    a, b = read_samples(post), read_samples(smp)
    assert sorted(a) == sorted(b)
    for k, s in b.items():
        assert s.mean is None and s.latent.shape == (1, 4, 4, 4)
        g = torch.Generator().manual_seed(derive_seed(7, STREAM_EXTRACT_SAMPLE, int(k)))
        noise = torch.randn((1, 4, 4, 4), generator=g).numpy()
        assert_close_at_scale(s.latent, a[k].mean + a[k].std * noise, rel=8 * FP32_EPS)


def test_limit_keeps_the_first_images(odd_tree, tiny_vae_dir, tmp_path):
    summary = extract(odd_tree, tiny_vae_dir, tmp_path / "out", limit=5)
    m = read_manifest(tmp_path / "out")
    assert summary.images == 5 and m.extraction["num_images"] == 5
    assert sorted(read_samples(tmp_path / "out")) == [sample_key(i) for i in range(5)]


def test_other_config_is_refused_and_nothing_changes(odd_tree, tiny_vae_dir, odd_baseline, tmp_path):
    out = tmp_path / "out"
    extract(odd_tree, tiny_vae_dir, out)
    before = {p.name: (p.stat().st_mtime_ns, p.stat().st_size) for p in out.iterdir() if p.is_file()}
    with pytest.raises(UserError) as e:
        extract(odd_tree, tiny_vae_dir, out, image_size=64)
    assert "image_size: 32 in the folder, 64 now" in str(e.value) and "--overwrite" in str(e.value)
    assert {p.name: (p.stat().st_mtime_ns, p.stat().st_size) for p in out.iterdir() if p.is_file()} == before
    extract(odd_tree, tiny_vae_dir, out, image_size=64, overwrite=True)
    assert read_manifest(out).latent_shape == [4, 8, 8]


def test_rerun_keeps_good_shards_and_redoes_damaged_ones(odd_tree, tiny_vae_dir, odd_baseline, tmp_path):
    _, _, hashes = odd_baseline
    out = tmp_path / "out"
    extract(odd_tree, tiny_vae_dir, out)
    flipped = out / shard_name(1)
    data = bytearray(flipped.read_bytes())
    data[1000] ^= 0x10
    flipped.write_bytes(bytes(data))
    (out / shard_name(3)).unlink()
    keep = {i: (out / shard_name(i)).stat().st_ino for i in (0, 2)}
    summary = extract(odd_tree, tiny_vae_dir, out)
    assert (summary.shards_kept, summary.shards_written) == (2, 2)
    assert shard_hashes(out) == hashes
    assert {i: (out / shard_name(i)).stat().st_ino for i in (0, 2)} == keep   # untouched
    assert verify_shards(out, progress=False).ok


def test_single_file_vae_gives_the_same_latents(odd_tree, tiny_vae_dir, odd_baseline, tmp_path):
    from tests.extract.test_vae_file import to_ldm_file

    base_out, _, _ = odd_baseline
    ckpt = to_ldm_file(tiny_vae_dir, tmp_path / "vae.safetensors")
    extract(odd_tree, ckpt, tmp_path / "out", vae_config=str(tiny_vae_dir))
    m = read_manifest(tmp_path / "out")
    assert m.extraction["vae"]["kind"] == "file" and m.scaling_factor == 0.5
    a, b = read_samples(base_out), read_samples(tmp_path / "out")
    assert sorted(a) == sorted(b)
    assert all(np.array_equal(a[k].mean, b[k].mean) and np.array_equal(a[k].std, b[k].std) for k in a)


def test_undecodable_file_names_are_kept_and_shown_escaped(tiny_vae_dir, tmp_path):
    data = tmp_path / "data"
    (data / "a").mkdir(parents=True)
    draw_image(0, 0).save(data / "a" / "ok.JPEG")
    # Linux allows any bytes in a file name; \xff is not UTF-8.
    with open(os.path.join(os.fsencode(data / "a"), b"caf\xff.JPEG"), "wb") as f:
        draw_image(0, 1).save(f, format="JPEG")
    with open(os.path.join(os.fsencode(data / "a"), b"z\xfe.JPEG"), "wb") as f:
        f.write(b"")
    out = tmp_path / "out"
    summary = extract(data, tiny_vae_dir, out)
    assert (summary.images, summary.skipped) == (2, 1)
    metas = sorted(s.meta["path"] for s in read_samples(out).values())
    assert metas == ["a/caf\\xff.JPEG", "a/ok.JPEG"]
    assert read_manifest(out).skipped == [{"key": sample_key(2), "path": "a/z\\xfe.JPEG",
                                           "reason": "empty file (0 bytes)"}]
