"""dit-extract --captions: the three input layouts (a mapping file over an ImageFolder tree, caption files beside
the images of a flat folder, WebDataset tars in BLIP3o's layout) and the caption policy for every bad input the
issue names: empty or whitespace captions, undecodable text, images without a caption, captions without an
image, duplicate keys (each refused naming the file, or skipped and counted in the manifest)."""
from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pytest

from dit_pipeline.common.errors import UserError
from dit_pipeline.extract import ExtractConfig, run_extract
from dit_pipeline.extract.captions import mapping_index
from dit_pipeline.shards import iter_shard, read_manifest, verify_shards
from tests._util import draw_image, make_image_tree
from tests.captions.conftest import LATENT


def _extract(data: Path, vae: Path, out: Path, **kw):
    return run_extract(ExtractConfig(data_path=str(data), out=str(out), vae=str(vae), **{**LATENT, **kw}))


def _stored(out: Path) -> dict[str, tuple[int, list[str]]]:
    m = read_manifest(out)
    return {s.key: (s.label, s.captions) for url in m.shard_urls(str(out))
            for s in iter_shard(url, m, captions=True)}


def _jpeg(label: int, i: int, fmt: str = "JPEG") -> bytes:
    buf = io.BytesIO()
    draw_image(label, i, (40, 36)).save(buf, fmt)
    return buf.getvalue()


def test_mapping_file_over_a_class_tree(tmp_path, tiny_vae_dir):
    tree = make_image_tree(tmp_path / "images", counts=(2, 2))  # c000/img0000, c000/img0001, c001/img0000, ...
    lines = [{"path": "c000/img0000.JPEG", "caption": "  a red fox  ", "captions": ["short one", "   "]},
             {"path": "c000/img0001.JPEG", "caption": " \t "},                  # only whitespace: skipped
             {"path": "c001/img0001.JPEG", "captions": ["long one", "short two"]},
             {"path": "elsewhere/x.jpg", "caption": "no such image"}]          # c001/img0000: no record at all
    (tmp_path / "caps.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    out = tmp_path / "out"
    _extract(tree, tiny_vae_dir, out, captions=str(tmp_path / "caps.jsonl"))
    m = read_manifest(out)
    file = (tmp_path / "caps.jsonl").resolve()
    assert m.format_version == 4 and m.class_names == ["c000", "c001"]
    assert _stored(out) == {"000000000": (0, ["a red fox", "short one"]), "000000003": (1, ["long one", "short two"])}
    assert m.skipped == [
        {"key": "000000001", "path": "c000/img0001.JPEG",
         "reason": f"no caption: its record in {file} holds only empty or whitespace captions"},
        {"key": "000000002", "path": "c001/img0000.JPEG", "reason": f"no caption: no record in {file}"}]
    c = m.captions
    assert (c["captions"], c["dropped_empty"], c["dropped_undecodable"], c["uncaptioned"]) == (4, 2, 0, 2)
    assert c["unmatched"] == {"count": 1, "examples": [f"{file}:4: elsewhere/x.jpg"]}
    assert c["per_image"] == {"min": 2, "max": 2} and c["source"]["kind"] == "mapping"
    assert verify_shards(out, progress=False).ok


def test_mapping_formats_and_refusals(tmp_path):
    paths = ["a/x.jpg", "a/y.jpg", "b/x.jpg", "b/z.png"]
    csv = tmp_path / "caps.csv"
    csv.write_text('image,long_caption,short_caption\na/x.jpg,"a long, detailed one",short\nz.png,only long,\n')
    index = mapping_index(csv, paths, ("long_caption", "short_caption"))
    assert index.entry(0) == '["a long, detailed one", "short"]'
    assert index.entry(3) == '["only long", ""]'  # a bare file name matches when unique; "" is dropped later
    assert index.entry(1) == index.entry(2) == ""
    as_dict = tmp_path / "caps.json"
    as_dict.write_text(json.dumps({"x.jpg": "ambiguous name", "a/y.jpg": ["one", "two"]}))
    index = mapping_index(as_dict, paths, ("caption",))
    assert index.entry(1) == '["one", "two"]' and index.entry(0) == ""
    assert index.unmatched == {"count": 1, "examples": [f"{as_dict}: 'x.jpg': x.jpg (file name not unique in "
                                                        "--data-path)"]}
    dup = tmp_path / "dup.jsonl"
    dup.write_text('{"path": "a/x.jpg", "caption": "one"}\n\n{"path": "a/x.jpg", "caption": "two"}\n')
    with pytest.raises(UserError) as e:
        mapping_index(dup, paths, ("caption",))
    assert str(e.value) == (f"--captions {dup}:3: names a/x.jpg again (first at {dup}:1); give all of an image's "
                            "captions in one record (a list under a caption key), nothing was written")
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"path": "a/x.jpg", "caption": "ok"}\n{"path": "a/y.jpg", "caption": "caf\xe9"}\n')
    with pytest.raises(UserError) as e:
        mapping_index(bad, paths, ("caption",))
    assert str(e.value) == (f"--captions {bad}:2: not UTF-8 text (invalid continuation byte at byte 72); re-save "
                            "the file as UTF-8 (nothing was written)")
    bad.write_text('{"path": "a/x.jpg", "caption": 7}\n')
    with pytest.raises(UserError) as e:
        mapping_index(bad, paths, ("caption",))
    assert str(e.value) == f"--captions {bad}:1: 'caption' holds int, not a caption string (or a list of them)"
    bad.write_text('{"path": "a/x.jpg", "caption": "ok"}\nnot json\n')
    with pytest.raises(UserError) as e:
        mapping_index(bad, paths, ("caption",))
    assert str(e.value).startswith(f"--captions {bad}:2: invalid JSON (")


def _flat_folder(root: Path) -> Path:
    root.mkdir()
    for i, name in enumerate(("a.jpg", "b.png", "c.jpg", "d.jpg", "e.jpg")):
        draw_image(0, i, (40, 36)).save(root / name)
    (root / "a.txt").write_text("  a red car on a road \n")
    (root / "b.json").write_text(json.dumps({"caption": ["a cat", "a small cat"], "other": "not a caption"}))
    (root / "c.txt").write_bytes(b"\xffbad bytes")
    (root / "e.txt").write_text("   \n")
    (root / "orphan.txt").write_text("a caption without its image")
    return root


def test_caption_files_beside_the_images_of_a_flat_folder(tmp_path, tiny_vae_dir):
    data = _flat_folder(tmp_path / "flat")
    out = tmp_path / "out"
    _extract(data, tiny_vae_dir, out, captions="sidecar")
    m = read_manifest(out)
    assert m.class_names == ["unlabeled"]
    assert _stored(out) == {"000000000": (0, ["a red car on a road"]), "000000001": (0, ["a cat", "a small cat"])}
    assert m.skipped == [
        {"key": "000000002", "path": "c.jpg",
         "reason": "no caption: caption file c.txt is not UTF-8 text (invalid start byte at byte 0)"},
        {"key": "000000003", "path": "d.jpg", "reason": "no caption: no caption file beside it"},
        {"key": "000000004", "path": "e.jpg",
         "reason": "no caption: caption file e.txt holds only empty or whitespace captions"}]
    c = m.captions
    assert (c["captions"], c["dropped_empty"], c["dropped_undecodable"], c["uncaptioned"]) == (3, 1, 1, 3)
    assert c["unmatched"] == {"count": 1, "examples": ["orphan.txt (no image named orphan.*)"]}
    # --strict: the first image without a usable caption is an error naming it; no manifest is written
    strict = tmp_path / "strict"
    with pytest.raises(UserError) as e:
        _extract(data, tiny_vae_dir, strict, captions="sidecar", strict=True)
    assert str(e.value).startswith(f"{data.resolve()}/c.jpg: no caption: caption file c.txt is not UTF-8 text "
                                   "(invalid start byte at byte 0). --strict makes an unusable image an error")
    assert not (strict / "manifest.json").exists()
    # two images sharing one caption file: refused before anything is written
    draw_image(0, 9, (40, 36)).save(data / "a.png")
    with pytest.raises(UserError) as e:
        _extract(data, tiny_vae_dir, tmp_path / "shared", captions="sidecar")
    assert str(e.value) == ("--captions sidecar: a.jpg and a.png share the caption file a.txt; rename one image "
                            "(nothing was written)")
    assert not (tmp_path / "shared").exists()


def _tar(path: Path, members: list[tuple[str, bytes]]) -> None:
    with tarfile.open(path, "w") as tf:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))


def test_webdataset_tars_in_blip3o_layout(tmp_path, tiny_vae_dir):
    data = tmp_path / "wds"
    data.mkdir()
    _tar(data / "00000.tar", [("s0.jpg", _jpeg(0, 0)), ("s0.txt", b"  a photo of a dog \n"),
                              ("s1.png", _jpeg(0, 1, "PNG")), ("s1.json", json.dumps({"caption": "a cat"}).encode()),
                              ("s2.txt", b"a caption without an image"),
                              ("s3.jpg", _jpeg(0, 3))])
    _tar(data / "00001.tar", [("dir/s4.webp", _jpeg(0, 4, "WEBP")), ("dir/s4.txt", b"caf\xe9"),
                              ("s5.jpg", _jpeg(0, 5)), ("s5.txt", "  un café  ".encode())])
    out = tmp_path / "out"
    _extract(data, tiny_vae_dir, out, captions="sidecar")
    m = read_manifest(out)
    # NanoGen's rule (diffusion-bench @4848f0c, src/data/blip3o_wds_dataset.py line 117): txt decoded, stripped
    assert _stored(out) == {"000000000": (0, [b"  a photo of a dog \n".decode("utf-8").strip()]),
                            "000000001": (0, ["a cat"]), "000000004": (0, ["un café"])}
    assert [(s["key"], s["path"]) for s in m.skipped] == [("000000002", "00000.tar/s3.jpg"),
                                                          ("000000003", "00001.tar/dir/s4.webp")]
    assert [s["reason"] for s in m.skipped] == ["no caption: no .txt or .json member in 00000.tar",
                                                "no caption: its caption in 00001.tar is not UTF-8 text (unexpected "
                                                "end of data at byte 3)"]
    c = m.captions
    assert (c["captions"], c["dropped_undecodable"], c["uncaptioned"]) == (3, 1, 2)
    assert c["unmatched"] == {"count": 1, "examples": ["00000.tar: s2 (captions, no image)"]}
    assert m.extraction["input"] == "webdataset" and m.class_names == ["unlabeled"]
    assert verify_shards(out, progress=False).ok


def test_webdataset_labels_and_refusals(tmp_path, tiny_vae_dir):
    from dit_pipeline.extract.webdataset import scan_webdataset

    data = tmp_path / "labelled"
    data.mkdir()
    _tar(data / "a.tar", [("k0.jpg", _jpeg(0, 0)), ("k0.cls", b"2"), ("k1.jpg", _jpeg(0, 1)), ("k1.cls", b"0")])
    images, _, _ = scan_webdataset(data, captions=False, caption_keys=("caption",))
    assert images.labels == (2, 0) and images.class_names == ("0", "1", "2")
    dup = tmp_path / "dup"
    dup.mkdir()
    _tar(dup / "a.tar", [("k0.jpg", _jpeg(0, 0)), ("k1.jpg", _jpeg(0, 1)), ("k0.txt", b"late caption")])
    with pytest.raises(UserError) as e:
        _extract(dup, tiny_vae_dir, tmp_path / "out", captions="sidecar")
    assert str(e.value) == (f"--data-path {dup / 'a.tar'}: key 'k0' appears twice (k0.jpg and k0.txt): a duplicate "
                            "sample or members out of order; fix the tar (nothing was written)")
    assert not (tmp_path / "out").exists()
    two = tmp_path / "two"
    two.mkdir()
    _tar(two / "a.tar", [("k0.jpg", _jpeg(0, 0)), ("k0.png", _jpeg(0, 0, "PNG"))])
    with pytest.raises(UserError) as e:
        scan_webdataset(two, captions=True, caption_keys=("caption",))
    assert str(e.value) == (f"--data-path {two / 'a.tar'}: key 'k0' has 2 images (jpg, png); fix the tar (nothing "
                            "was written)")


def test_an_interrupted_captioned_extraction_resumes_to_the_same_set(tmp_path, tiny_vae_dir, monkeypatch):
    """A failure in the middle of shard 1 (a full disk, in this process), then the same command: the finished
    shard is kept, and the shards and the manifest's captions record and skipped list are those of one run."""
    import hashlib

    from dit_pipeline.common.errors import UserError as Refused

    tree = make_image_tree(tmp_path / "images", counts=(3, 2, 4))
    paths = sorted(p.relative_to(tree).as_posix() for p in tree.rglob("*.JPEG"))
    lines = [{"path": p, "captions": [f"image {i}", "  " if i % 2 else f"a photo {i}"]}
             for i, p in enumerate(paths) if i != 4]
    (tmp_path / "caps.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    kw = dict(captions=str(tmp_path / "caps.jsonl"))
    _extract(tree, tiny_vae_dir, tmp_path / "straight", **kw)
    monkeypatch.setenv("DIT_FAULT", "extract.sample_written@6:enospc")
    with pytest.raises(Refused):
        _extract(tree, tiny_vae_dir, tmp_path / "resumed", **kw)
    monkeypatch.delenv("DIT_FAULT")
    assert not (tmp_path / "resumed" / "manifest.json").exists()
    summary = _extract(tree, tiny_vae_dir, tmp_path / "resumed", **kw)
    assert (summary.shards_kept, summary.shards_written) == (1, 2)

    def digest(folder):
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.glob("shard-*.tar"))}

    a, b = read_manifest(tmp_path / "straight"), read_manifest(tmp_path / "resumed")
    assert digest(tmp_path / "straight") == digest(tmp_path / "resumed")
    assert a.captions == b.captions and a.skipped == b.skipped and a.fingerprint() == b.fingerprint()
    assert (a.captions["captions"], a.captions["dropped_empty"], a.captions["uncaptioned"]) == (12, 4, 1)


def test_plain_webdataset_reads_the_caption_and_text_members(captioned_set, qwen3_text_set):
    """docs/FORMAT.md: `webdataset.WebDataset(url).decode()` reads the new members with no code of ours."""
    import numpy as np
    import webdataset as wds

    url = str(captioned_set / "shard-000000.tar")
    first = next(iter(wds.WebDataset(url, shardshuffle=False).decode()))
    assert first["captions.json"] == _stored(captioned_set)["000000000"][1]
    text = next(iter(wds.WebDataset(str(qwen3_text_set / "shard-000000.tar"), shardshuffle=False).decode()))
    assert text["lengths.npy"].dtype == np.int32 and text["text.npy"].dtype == np.uint16  # bfloat16 bits
    assert text["text.npy"].shape == (int(text["lengths.npy"].sum()), 32)
