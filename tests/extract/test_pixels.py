"""dit-extract --pixels: the stored pixels are the VAE's input bit for bit (view 0 as stored, view 1 flipped),
the latents do not change, a run without the flag writes what it always wrote, and the setting is part of
the configuration a rerun must match. Kill/resume and 2 ranks give the uninterrupted shards."""
from __future__ import annotations

import json
import tarfile

import numpy as np
import pytest
import torch
from PIL import Image, features
from torchvision import transforms

from dit_pipeline.common.errors import UserError
from dit_pipeline.extract import plan
from dit_pipeline.extract.images import load_rgb
from dit_pipeline.shards import iter_shard, read_manifest, shard_name, verify_shards, view_pixels
from tests._util import run_cli, run_torchrun
from tests.extract.conftest import cli_args, extract, read_samples, shard_hashes
from tests.extract.test_images import reference_crop


def _stored_pixels(out) -> dict[int, np.ndarray]:
    m = read_manifest(out)
    return {int(s.key): s.pixels for u in m.shard_urls(str(out)) for s in iter_shard(u, m, pixels="decoded")}


def _members(out) -> list[tuple[str, int]]:
    names = []
    for p in sorted(out.glob("shard-*.tar")):
        with tarfile.open(p) as t:
            names += [(m.name, m.size) for m in t.getmembers()]
    return names


def _minus_one_one(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a)).permute(2, 0, 1).float() / 127.5 - 1


def test_stored_pixels_are_the_vae_input_bit_for_bit(pixels_baseline, odd_tree):
    out, seen, _ = pixels_baseline
    stored = _stored_pixels(out)
    tv = transforms.Compose([transforms.ToTensor(), transforms.Normalize([0.5] * 3, [0.5] * 3)])
    encoded = []
    for indices, x in seen:
        b = len(indices)
        assert x.shape == (2 * b, 3, 32, 32) and x.dtype == torch.float32
        for row, index in enumerate(indices):
            px = stored[index]
            assert torch.equal(x[row], _minus_one_one(px))                       # view 0: as stored
            assert torch.equal(x[b + row], _minus_one_one(view_pixels(px, 1)))   # view 1: stored, flipped
            assert torch.equal(x[row], tv(Image.fromarray(px)))                  # = ToTensor + Normalize
            encoded.append(index)
    assert sorted(encoded) == sorted(stored) and len(stored) == 10               # every sample, once
    paths = {int(s.key): s.meta["path"] for s in read_samples(out).values()}
    for index, px in stored.items():                                              # = an independent crop
        rgb, _ = load_rgb(odd_tree / paths[index])
        np.testing.assert_array_equal(px, reference_crop(rgb, 32))


def test_manifest_records_the_pixels_and_the_latents_do_not_change(pixels_baseline, odd_baseline):
    out, _, _ = pixels_baseline
    base_out, _, _ = odd_baseline
    m, base = read_manifest(out), read_manifest(base_out)
    sizes = [size for name, size in _members(out) if name.endswith(".pixels.webp")]
    assert len(sizes) == 10
    assert m.format_version == 2 and m.pixels == {"member": "pixels.webp", "encoding": "webp-lossless",
                                                  "mode": "RGB", "size": [32, 32], "bytes": sum(sizes)}
    assert (m.extraction["pixels"], m.extraction["format_version"]) == ("webp-lossless", 2)
    assert m.extraction["versions"]["libwebp"] == features.version("webp")
    assert verify_shards(out, progress=False).ok and verify_shards(out, quick=True, progress=False).ok
    assert m.skipped == base.skipped and [s.samples for s in m.shards] == [s.samples for s in base.shards]
    a, b = read_samples(out), read_samples(base_out)
    assert sorted(a) == sorted(b)
    assert all(np.array_equal(a[k].mean, b[k].mean) and np.array_equal(a[k].std, b[k].std) for k in a)


def test_without_the_flag_the_set_is_format_1_without_pixels(odd_baseline):
    out, _, _ = odd_baseline
    text = (out / "manifest.json").read_text()
    d = json.loads(text)
    assert d["format_version"] == 1 and d["extraction"]["format_version"] == 1
    assert "pixels" not in d and "pixels" not in d["extraction"] and "libwebp" not in d["extraction"]["versions"]
    assert set(d["extraction"]["versions"]) == {"torch", "diffusers", "pillow"}
    assert not any(".pixels" in name for name, _ in _members(out))
    state = json.loads((out / ".extract" / "shard-000000.json").read_text())
    assert set(state) == {"record", "skipped"}


def test_plain_webdataset_reads_the_pixels(pixels_baseline):
    import webdataset as wds

    out, _, _ = pixels_baseline
    stored = _stored_pixels(out)
    got = {int(s["__key__"]): s["pixels.webp"]
           for s in wds.WebDataset(read_manifest(out).shard_urls(str(out)), shardshuffle=False).decode("rgb8")}
    assert sorted(got) == sorted(stored)
    assert all(got[k].dtype == np.uint8 and np.array_equal(got[k], stored[k]) for k in got)


def test_the_pixels_setting_must_match_to_resume(odd_tree, tiny_vae_dir, tmp_path):
    out = tmp_path / "out"
    extract(odd_tree, tiny_vae_dir, out)
    before = {p.name: (p.stat().st_mtime_ns, p.stat().st_size) for p in out.iterdir() if p.is_file()}
    with pytest.raises(UserError) as e:
        extract(odd_tree, tiny_vae_dir, out, pixels=True)
    assert ("holds a shard set made with a different configuration:\n  - format_version: 1 in the folder, 2 now\n"
            "  - pixels: '<absent>' in the folder, 'webp-lossless' now\n") in str(e.value)
    assert "--overwrite" in str(e.value)
    assert {p.name: (p.stat().st_mtime_ns, p.stat().st_size) for p in out.iterdir() if p.is_file()} == before
    extract(odd_tree, tiny_vae_dir, out, pixels=True, overwrite=True)
    assert read_manifest(out).has_pixels and verify_shards(out, progress=False).ok
    with pytest.raises(UserError) as e:
        extract(odd_tree, tiny_vae_dir, out)
    assert ("  - format_version: 2 in the folder, 1 now\n  - pixels: 'webp-lossless' in the folder, '<absent>' now\n"
            in str(e.value))
    summary = extract(odd_tree, tiny_vae_dir, out, pixels=True)                 # same setting: resumes
    assert (summary.shards_kept, summary.shards_written) == (4, 0)


def test_shard_size_estimate_counts_the_pixels():
    assert plan.pixel_bytes_estimate(256) == 512 + 512 * 192          # 1.5 bytes per pixel, whole tar blocks
    latents = plan.bytes_per_sample(2, 2, (4, 32, 32), 2)
    assert plan.default_samples_per_shard(latents) == 7200
    assert plan.default_samples_per_shard(latents + plan.pixel_bytes_estimate(256)) == 1900


@pytest.mark.determinism
def test_kill_then_rerun_with_pixels_gives_the_uninterrupted_shards(odd_tree, tiny_vae_dir, pixels_baseline, tmp_path):
    base_out, _, hashes = pixels_baseline
    out = tmp_path / "out"
    args = cli_args(odd_tree, tiny_vae_dir, out, pixels=True)
    r = run_cli("dit-extract", args, env={"DIT_FAULT": "extract.sample_written@6"})
    assert r.returncode == -9, r.stderr[-3000:]
    assert not (out / "manifest.json").exists() and (out / shard_name(0)).is_file()
    summary = extract(odd_tree, tiny_vae_dir, out, pixels=True)
    assert (summary.shards_kept, summary.shards_written) == (1, 3)
    assert shard_hashes(out) == hashes
    assert read_manifest(out).fingerprint() == read_manifest(base_out).fingerprint()


@pytest.mark.determinism
def test_two_ranks_with_pixels_write_the_single_process_shards(odd_tree, tiny_vae_dir, pixels_baseline, tmp_path):
    base_out, _, hashes = pixels_baseline
    out = tmp_path / "out"
    r = run_torchrun("dit-extract", cli_args(odd_tree, tiny_vae_dir, out, pixels=True), nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]
    assert shard_hashes(out) == hashes
    a, b = read_manifest(out), read_manifest(base_out)
    assert a.fingerprint() == b.fingerprint() and a.pixels == b.pixels and verify_shards(out, progress=False).ok


def test_another_libwebp_resumes_with_a_warning_only():
    from dit_pipeline.extract.state import record_differences

    old = {"pixels": "webp-lossless", "format_version": 2, "versions": {"torch": "2.14", "libwebp": "1.6.0"}}
    new = {**old, "versions": {"torch": "2.14", "libwebp": "1.5.0"}}
    assert record_differences(old, new) == ([], ["versions.libwebp: '1.6.0' in the folder, '1.5.0' now"])


def test_a_pillow_without_webp_is_refused_before_anything_is_written(odd_tree, tiny_vae_dir, tmp_path, monkeypatch):
    from PIL import features as pil_features

    real = pil_features.check
    monkeypatch.setattr(pil_features, "check", lambda name: False if name == "webp" else real(name))
    with pytest.raises(UserError) as e:
        extract(odd_tree, tiny_vae_dir, tmp_path / "out", pixels=True)
    assert str(e.value) == ("--pixels: this Pillow was built without WebP support, which the pixels field needs "
                            "(lossless WebP); install a Pillow wheel from PyPI (they include libwebp)")
    assert not (tmp_path / "out").exists() or list((tmp_path / "out").iterdir()) == []


def test_the_vae_input_formula_is_x_over_127_5_minus_1_for_every_byte():
    """to_model_input (ToTensor then Normalize(0.5, 0.5): x / 255, - 0.5, / 0.5 in float32) equals
    x / 127.5 - 1 in float32 bit for bit for all 256 byte values, as docs/FORMAT.md states."""
    from dit_pipeline.extract.encode import to_model_input

    values = torch.arange(256, dtype=torch.uint8).repeat_interleave(3).view(1, 16, 16, 3)
    x = to_model_input(values, views=1)
    expect = values.permute(0, 3, 1, 2).float() / 127.5 - 1
    assert torch.equal(x.view(torch.int32), expect.contiguous(memory_format=torch.channels_last).view(torch.int32))
    assert float(x.min()) == -1.0 and float(x.max()) == 1.0


def test_pixels_with_an_image_size_webp_cannot_hold_is_a_config_error():
    from dit_pipeline.common.errors import ConfigError
    from dit_pipeline.extract import ExtractConfig

    with pytest.raises(ConfigError) as e:
        ExtractConfig(data_path="d", out="o", pixels=True, image_size=16384).validate()
    assert ("--pixels stores lossless WebP, whose sides are at most 16383 pixels; --image-size is 16384"
            in str(e.value))
    ExtractConfig(data_path="d", out="o", image_size=16384).validate()      # without --pixels: fine
