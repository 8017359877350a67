"""The optional pixels field (format version 2): writer, reader modes, manifest rules, verify, info, webdataset."""
from __future__ import annotations

import io
import json

import numpy as np
import pytest
from PIL import Image

from dit_pipeline.shards import (ShardError, ShardWriter, decode_pixels, encode_pixels, iter_shard, read_manifest,
                                 sample_key, shard_name, verify_shards, view_pixels)
from dit_pipeline.shards.info import format_info, human_bytes, info_dict
from dit_pipeline.shards.pixels import header_problem, pixels_size
from tests.shards._helpers import arrays_for, crop_for, edit_manifest, make_set, read_members, replace_member

S2 = shard_name(2)
KEYS = [sample_key(g) for g in range(12) if g != 5]


@pytest.fixture
def pix(tmp_path):
    make_set(tmp_path / "set", pixels=True)
    return tmp_path / "set"


def problems(folder, **kw):
    return verify_shards(folder, progress=False, **kw).problems


def _webp(a: np.ndarray, **kw) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(a).save(buf, "WEBP", **{"lossless": True, **kw})
    return buf.getvalue()


def test_encode_decode_is_lossless_and_deterministic():
    a = crop_for(3)
    data = encode_pixels(a)
    assert data == encode_pixels(a.copy()) and data[:4] == b"RIFF" and data[12:16] == b"VP8L"
    assert pixels_size(data) == (32, 32) and header_problem(data, 32) is None
    out = decode_pixels(data, 32)
    assert out.dtype == np.uint8 and out.shape == (32, 32, 3) and out.flags.writeable
    assert np.array_equal(out, a)
    assert np.array_equal(view_pixels(out, 1), a[:, ::-1]) and view_pixels(out, 0) is out
    with pytest.raises(ValueError, match="view must be 0 or 1, got 2"):
        view_pixels(out, 2)
    with pytest.raises(ValueError, match=r"pixels must be a uint8 array \[H, W, 3\].*got float32 \[32, 32, 3\]"):
        encode_pixels(a.astype(np.float32))


def test_manifest_records_pixels_and_old_manifests_have_none(pix, tmp_path):
    m = read_manifest(pix)
    assert m.format_version == 2 and m.has_pixels
    members = [(n, d) for s in m.shards for n, d in read_members(pix / s.name)]
    assert m.pixels == {"member": "pixels.webp", "encoding": "webp-lossless", "mode": "RGB", "size": [32, 32],
                        "bytes": sum(len(d) for n, d in members if n.endswith(".pixels.webp"))}
    assert [n.split(".", 1)[1] for n, _ in members[:5]] == ["cls", "json", "mean.npy", "pixels.webp", "std.npy"]
    old = make_set(tmp_path / "old")
    text = (tmp_path / "old" / "manifest.json").read_text()
    assert old.pixels is None and not old.has_pixels and '"pixels"' not in text and '"format_version": 1' in text
    assert read_manifest(tmp_path / "old").pixels is None and verify_shards(tmp_path / "old", progress=False).ok


def test_pixels_field_rules_in_the_manifest(pix, tmp_path):
    path = pix / "manifest.json"
    d = json.loads(path.read_text())
    path.write_text(json.dumps({**d, "format_version": 1}))
    with pytest.raises(Exception, match="pixels is a format version 2 field, but format_version is 1"):
        read_manifest(pix)
    path.write_text(json.dumps({**d, "pixels": {**d["pixels"], "size": [64, 64], "encoding": "png", "bytes": -1}}))
    with pytest.raises(Exception) as e:
        read_manifest(pix)
    assert str(e.value).endswith("invalid manifest: pixels.encoding must be one of 'webp-lossless', 'npy-uint8', got "
                                 "'png'; pixels.size "
                                 "must be [image_size, image_size] = [32, 32], got [64, 64]; pixels.bytes must be a "
                                 "non-negative integer, got -1")


def test_iter_shard_pixel_modes(pix):
    m = read_manifest(pix)
    urls = m.shard_urls(str(pix))
    plain = [s for u in urls for s in iter_shard(u, m)]
    assert [s.key for s in plain] == KEYS and all(s.pixels is None for s in plain)     # skipped, not read
    stored = {n.split(".")[0]: d for u in urls for n, d in read_members(u) if n.endswith(".pixels.webp")}
    enc = [s for u in urls for s in iter_shard(u, m, raw=True, pixels="bytes")]
    assert [s.pixels for s in enc] == [stored[k] for k in KEYS]
    dec = [s for u in urls for s in iter_shard(u, m, pixels="decoded", sha256="whole")]
    for s in dec:
        assert np.array_equal(s.pixels, crop_for(int(s.key))) and s.pixels.shape == (32, 32, 3)
        np.testing.assert_array_equal(s.mean, arrays_for(int(s.key))["mean"])
    with pytest.raises(ValueError, match="pixels must be one of"):
        next(iter_shard(urls[0], m, pixels="png"))


def test_a_set_without_pixels_yields_none_and_refuses_a_request(tmp_path):
    m = make_set(tmp_path / "set")
    url = m.shard_urls(str(tmp_path / "set"))[0]
    assert all(s.pixels is None for s in iter_shard(url, m))
    with pytest.raises(ShardError) as e:
        next(iter_shard(url, m, pixels="decoded"))
    assert e.value.problem == ("pixels were asked for, but the manifest records none (the set was extracted "
                               "without --pixels)")


def test_reader_checks_the_header_without_decoding(pix):
    replace_member(pix, S2, "000000009.pixels.webp", encode_pixels(np.zeros((16, 32, 3), np.uint8)))
    m = read_manifest(pix)
    with pytest.raises(ShardError) as e:
        list(iter_shard(str(pix / S2), m, pixels="bytes"))
    assert (e.value.key, e.value.problem) == ("000000009", "pixels.webp: WebP is 32x16, the manifest says 32x32")
    assert len(list(iter_shard(str(pix / S2), m))) == 4     # not asked for: only its presence is checked


def _truncated_but_valid_header(data: bytes) -> bytes:
    """The lossless bitstream cut short, with the RIFF and chunk sizes fixed up: only decoding can tell."""
    cut = bytearray(data[: len(data) // 2 & ~1])
    cut[4:8] = (len(cut) - 8).to_bytes(4, "little")
    cut[16:20] = (len(cut) - 20).to_bytes(4, "little")
    return bytes(cut)


@pytest.mark.parametrize("make, problem", [
    (lambda d: d[:-10], "sample 000000009: pixels.webp: WebP file is {n} bytes, its header declares {m} "
                        "(truncated or spliced)"),
    (_truncated_but_valid_header, "sample 000000009: pixels.webp: WebP data does not decode ("),
    (lambda d: encode_pixels(np.zeros((32, 16, 3), np.uint8)), "sample 000000009: pixels.webp: WebP is 16x32, "
                                                               "the manifest says 32x32"),
    (lambda d: _webp(np.zeros((32, 32, 4), np.uint8) + 7, exact=True),
     "sample 000000009: pixels.webp: WebP declares alpha 1, version 0"),
    (lambda d: _webp(crop_for(9), lossless=False, quality=90), "sample 000000009: pixels.webp: not a simple "
                                                               "lossless WebP file (first chunk b'VP8 '"),
    (lambda d: encode_pixels(crop_for(9))[:0] + b"\x89PNG\r\n\x1a\n" + bytes(40), "sample 000000009: pixels.webp: "
                                                                                  "not a WebP file"),
    (lambda d: None, "sample 000000009: missing field pixels.webp (the manifest records pixels)"),
])
def test_verify_names_a_damaged_pixels_member(pix, make, problem):
    old = dict(read_members(pix / S2))["000000009.pixels.webp"]
    new = make(old)
    replace_member(pix, S2, "000000009.pixels.webp", new)   # sha256 recomputed: only the member is wrong
    got = problems(pix)
    if new is not None and "{n}" in problem:
        problem = problem.format(n=len(new), m=len(old))
    assert len(got) == 1 and got[0][0] == S2 and got[0][1].startswith(problem), got
    assert problems(pix, quick=True) == ([got[0]] if new is None else [])   # headers only: presence


def test_pixels_member_in_a_set_without_pixels_is_unexpected(tmp_path):
    make_set(tmp_path / "set")
    members = read_members(tmp_path / "set" / S2)
    members.insert(3, ("000000008.pixels.webp", encode_pixels(crop_for(8))))
    from tests.shards._helpers import refresh_record, write_tar

    write_tar(tmp_path / "set" / S2, members)
    refresh_record(tmp_path / "set", S2)
    expected = [(S2, "sample 000000008: unexpected field pixels.webp (the manifest records no pixels)")]
    assert problems(tmp_path / "set") == expected and problems(tmp_path / "set", quick=True) == expected


def test_writer_refuses_inconsistent_pixels(tmp_path):
    a = arrays_for(0)
    with ShardWriter(tmp_path / shard_name(0), pixels=True) as w:
        with pytest.raises(ValueError, match="key 000000000 has no pixels; a writer made with pixels=True"):
            w.write(sample_key(0), label=0, meta={}, **a)
        w.write(sample_key(0), label=0, meta={}, **a, pixels=crop_for(0))
        with pytest.raises(ValueError, match=r"pixels of key 000000001 are 16x16, earlier samples 32x32"):
            w.write(sample_key(1), label=0, meta={}, **a, pixels=encode_pixels(crop_for(1)[:16, :16]))
        with pytest.raises(ValueError, match="not a WebP file"):
            w.write(sample_key(1), label=0, meta={}, **a, pixels=b"RIFF" + bytes(40))
        w.write(sample_key(1), label=0, meta={}, **a, pixels=encode_pixels(crop_for(1)))  # bytes accepted
    assert w.record.samples == 2 and w.pixel_bytes == len(encode_pixels(crop_for(0))) + len(encode_pixels(crop_for(1)))
    with ShardWriter(tmp_path / shard_name(1)) as w:
        with pytest.raises(ValueError, match="pixels given for key 000000000, but the writer was made without"):
            w.write(sample_key(0), label=0, meta={}, **a, pixels=crop_for(0))


def test_plain_webdataset_reads_the_pixels(pix):
    import webdataset as wds

    urls = read_manifest(pix).shard_urls(str(pix))
    got = list(wds.WebDataset(urls, shardshuffle=False).decode("rgb8"))
    assert [s["__key__"] for s in got] == KEYS
    for s in got:
        assert s["pixels.webp"].dtype == np.uint8 and np.array_equal(s["pixels.webp"], crop_for(int(s["__key__"])))
        assert s["mean.npy"].shape == (2, 4, 4, 4)
    raw = next(iter(wds.WebDataset(urls[:1], shardshuffle=False).decode()))
    assert isinstance(raw["pixels.webp"], bytes) and np.array_equal(decode_pixels(raw["pixels.webp"], 32), crop_for(0))


def test_info_shows_the_pixels(pix, tmp_path):
    d = info_dict(pix)
    assert d["pixels"]["bytes"] == read_manifest(pix).pixels["bytes"] and d["format_version"] == 2
    b = d["pixels"]["bytes"]
    assert format_info(d).splitlines()[4] == (f"  pixels:   pixels.webp (webp-lossless, RGB 32x32, the crop of view 0), "
                                              f"{human_bytes(b)} ({human_bytes(b / 11)}/sample)")
    edit_manifest(pix, pixels=None)
    with pytest.raises(Exception, match="pixels must be an object, got NoneType"):
        read_manifest(pix)


def test_stats_of_a_set_with_pixels_are_those_of_its_latents(pix, tmp_path):
    from dit_pipeline.shards.stats import compute_stats

    make_set(tmp_path / "plain")
    with_pixels, plain = compute_stats(pix, max_samples=6), compute_stats(tmp_path / "plain", max_samples=6)
    with_pixels.pop("folder", None), plain.pop("folder", None)
    assert with_pixels == plain
