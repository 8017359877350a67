"""Issue 47, bad case 1: `dit-extract --captions caps.jsonl --caption-keys long_caption` where no record has that key
(or no record names an image of --data-path) skipped every image with "no caption: its record in caps.jsonl",
ended rc 0 with a verified set of 0 samples, and the text extraction on it ended rc 0 too. A source that captions
(nearly) none of the images is refused before anything is written, naming the keys its records have."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from dit_pipeline.cli import extract_main
from dit_pipeline.extract import ExtractConfig, run_extract
from dit_pipeline.extract.captions import mapping_index
from dit_pipeline.shards import read_manifest
from tests._util import draw_image, make_image_tree
from tests.captions.conftest import LATENT


def _args(data: Path, vae: Path, out: Path, *extra: str) -> list[str]:
    return ["--data-path", str(data), "--out", str(out), "--vae", str(vae), "--image-size", "32",
            "--batch-size", "3", "--samples-per-shard", "4", "--num-workers", "0", "--quiet", *extra]


def test_a_caption_key_no_record_has_is_refused_naming_the_keys_they_have(tmp_path, tiny_vae_dir):
    tree = make_image_tree(tmp_path / "images", counts=(2, 2))
    paths = sorted(p.relative_to(tree).as_posix() for p in tree.rglob("*.JPEG"))
    caps = tmp_path / "caps.jsonl"
    caps.write_text("".join(json.dumps({"path": p, "caption": f"image {i}"}) + "\n" for i, p in enumerate(paths)))
    out = tmp_path / "out"
    r = CliRunner().invoke(extract_main, _args(tree, tiny_vae_dir, out, "--captions", str(caps),
                                               "--caption-keys", "long_caption"), catch_exceptions=False)
    assert r.exit_code == 1 and "Traceback" not in r.output
    assert r.output.strip() == (
        f"error: --captions {caps.resolve()} gives a caption to 0 of the 4 images (fewer than 1%): its records name 4 "
        "of them, but 4 of those hold nothing under --caption-keys long_caption; the records' keys are caption, "
        "path: pass the ones that hold captions as --caption-keys (nothing was written)")
    assert not out.exists()
    # every path wrong: refused naming the first record and the path form of --data-path
    wrong = tmp_path / "wrong.jsonl"
    wrong.write_text("".join(json.dumps({"path": f"train/{p}", "caption": "x"}) + "\n" for p in paths))
    r = CliRunner().invoke(extract_main, _args(tree, tiny_vae_dir, out, "--captions", str(wrong)),
                           catch_exceptions=False)
    assert r.exit_code == 1
    assert r.output.strip() == (
        f"error: --captions {wrong.resolve()} gives a caption to 0 of the 4 images (fewer than 1%): none of its 4 "
        f"records names one of them (first: {wrong}:1: train/c000/img0000.JPEG); name each image by its path "
        "relative to --data-path (e.g. c000/img0000.JPEG) or by its file name (nothing was written)")
    assert not out.exists()


def test_a_partial_caption_key_names_the_key_in_each_skip(tmp_path, tiny_vae_dir):
    """Most records hold the key: extracted, and the images whose record lacks it are skipped naming the key."""
    tree = make_image_tree(tmp_path / "images", counts=(2, 2))
    paths = sorted(p.relative_to(tree).as_posix() for p in tree.rglob("*.JPEG"))
    caps = tmp_path / "caps.jsonl"
    caps.write_text("".join(json.dumps({"path": p, **({"long_caption": f"image {i}"} if i else {"caption": "c"})})
                            + "\n" for i, p in enumerate(paths)))
    index = mapping_index(caps, paths, ("long_caption",))
    assert index.record_keys == ("caption", "long_caption", "path") and index.records == 4
    out = tmp_path / "out"
    run_extract(ExtractConfig(data_path=str(tree), out=str(out), vae=str(tiny_vae_dir), captions=str(caps),
                              caption_keys="long_caption", **LATENT))
    m = read_manifest(out)
    assert m.total_samples == 3
    assert m.skipped == [{"key": "000000000", "path": "c000/img0000.JPEG",
                          "reason": f"no caption: its record in {caps.resolve()} has no caption under long_caption"}]


def test_caption_files_beside_none_of_the_images_are_refused(tmp_path, tiny_vae_dir):
    flat = tmp_path / "flat"
    flat.mkdir()
    for i in range(3):
        draw_image(0, i, (40, 36)).save(flat / f"im{i}.jpg")
    out = tmp_path / "out"
    with pytest.raises(Exception) as e:
        run_extract(ExtractConfig(data_path=str(flat), out=str(out), vae=str(tiny_vae_dir), captions="sidecar",
                                  **LATENT))
    assert str(e.value) == ("--captions sidecar gives a caption to 0 of the 3 images (fewer than 1%): 3 have no "
                            "caption file beside them (<name>.txt, or <name>.json with a 'caption' or 'captions' "
                            "key) (nothing was written)")
    assert not out.exists()


def test_text_extraction_refuses_a_set_without_samples(tmp_path, tiny_vae_dir, tiny_qwen3):
    """Captions that are all whitespace pass the source check (each record holds one) and are dropped by the
    policy: the latent set holds no sample, and its text extraction is refused rather than ending rc 0."""
    from dit_pipeline.extract.text import run_text_extract

    tree = make_image_tree(tmp_path / "images", counts=(2,))
    caps = tmp_path / "caps.jsonl"
    caps.write_text("".join(json.dumps({"path": f"c000/img000{i}.JPEG", "caption": "  "}) + "\n" for i in range(2)))
    latents = tmp_path / "latents"
    run_extract(ExtractConfig(data_path=str(tree), out=str(latents), vae=str(tiny_vae_dir), captions=str(caps),
                              **LATENT))
    assert read_manifest(latents).total_samples == 0
    with pytest.raises(Exception) as e:
        run_text_extract(ExtractConfig(data_path=str(latents), out=str(tmp_path / "text"),
                                       text_encoder=str(tiny_qwen3), quiet=True))
    assert str(e.value) == (f"--data-path {latents}: the set holds no samples (2 images were skipped without a "
                            "caption, see its manifest's 'skipped'); extract the latents again with captions "
                            "(--caption-keys naming the keys that hold them)")
    assert not (tmp_path / "text").exists()


def test_an_edited_caption_file_is_a_changed_source_as_an_edited_mapping_file_is(tmp_path, tiny_vae_dir):
    """Issue 47 (ok case): editing a caption file beside an image and rerunning kept the old caption ("keeping 4
    finished shards"); the same edit in a JSONL was refused. Both are refused now, with the same message."""
    flat = tmp_path / "flat"
    flat.mkdir()
    for i in range(3):
        draw_image(0, i, (40, 36)).save(flat / f"im{i}.jpg")
        (flat / f"im{i}.txt").write_text(f"a photo number {i}")
    caps = tmp_path / "caps.jsonl"
    caps.write_text("".join(json.dumps({"path": f"im{i}.jpg", "caption": f"a photo number {i}"}) + "\n"
                            for i in range(3)))
    messages = {}
    for source in ("sidecar", str(caps)):
        out = tmp_path / f"out-{source == 'sidecar'}"
        kw = dict(data_path=str(flat), out=str(out), vae=str(tiny_vae_dir), captions=source, **LATENT)
        run_extract(ExtractConfig(**kw))
        before = {p.name: p.read_bytes() for p in out.glob("shard-*.tar")}
        run_extract(ExtractConfig(**kw))  # unchanged: resumed, nothing redone
        if source == "sidecar":
            (flat / "im1.txt").write_text("an edited caption")
        else:
            caps.write_text(caps.read_text().replace("a photo number 1", "an edited caption"))
        with pytest.raises(Exception) as e:
            run_extract(ExtractConfig(**kw))
        messages[source == "sidecar"] = str(e.value).replace(str(out), "OUT")
        assert {p.name: p.read_bytes() for p in out.glob("shard-*.tar")} == before  # nothing lost
    assert messages[True].startswith("--out OUT: holds a shard set made with a different configuration:\n  - "
                                     "captions.sha256: ")
    assert messages[False].startswith("--out OUT: holds a shard set made with a different configuration:\n  - "
                                      "captions.sha256: ")
    assert messages[True].endswith("pass --overwrite to delete it and start over (nothing was changed).")
