"""Fixtures of the captions tests: tiny text encoders (built once), a captioned image tree, its latent set with
captions (tiny VAE) and its text set (tiny Qwen3)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests._util import make_image_tree
from tests.captions._tiny import make_tiny_clip, make_tiny_qwen3, make_tiny_t5

# The latent extraction every captions test uses (tiny VAE: 32 px crops).
LATENT = dict(image_size=32, batch_size=3, samples_per_shard=4, num_workers=0, quiet=True)
LONG = "a photo of a cat sitting on a red sofa next to a dog running on the green grass in the park at sunset"


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory) -> Path:
    return make_tiny_qwen3(tmp_path_factory.mktemp("text") / "qwen3")


@pytest.fixture(scope="session")
def tiny_t5(tmp_path_factory) -> Path:
    return make_tiny_t5(tmp_path_factory.mktemp("text") / "t5")


@pytest.fixture(scope="session")
def tiny_clip(tmp_path_factory) -> Path:
    return make_tiny_clip(tmp_path_factory.mktemp("text") / "clip")


def caption_lines(paths: list[str]) -> list[dict]:
    """Two captions per image (a long one and a short one), the long ones of some images over the test's max
    length of 24 tokens."""
    return [{"path": p, "long_caption": (LONG if i % 3 == 0 else f"a photo of image {i}") + f" number {i}",
             "short_caption": f"image {i}"} for i, p in enumerate(paths)]


@pytest.fixture(scope="session")
def captioned_set(tmp_path_factory, tiny_vae_dir) -> Path:
    """A latent set of 9 images in 3 classes with two captions each (3 shards of up to 4 samples)."""
    from dit_pipeline.extract import ExtractConfig, run_extract

    root = tmp_path_factory.mktemp("captioned")
    tree = make_image_tree(root / "images", counts=(3, 2, 4))
    paths = sorted(p.relative_to(tree).as_posix() for p in tree.rglob("*.JPEG"))
    (root / "captions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in caption_lines(paths)))
    run_extract(ExtractConfig(data_path=str(tree), out=str(root / "latents"), vae=str(tiny_vae_dir),
                              captions=str(root / "captions.jsonl"), caption_keys="long_caption,short_caption",
                              **LATENT))
    return root / "latents"


def text_extract(source: Path, encoder: Path, out: Path, **overrides):
    from dit_pipeline.extract import ExtractConfig
    from dit_pipeline.extract.text import run_text_extract

    kw = {**dict(text_max_length=24, batch_size=5, quiet=True), **overrides}
    return run_text_extract(ExtractConfig(data_path=str(source), out=str(out), text_encoder=str(encoder), **kw))


@pytest.fixture(scope="session")
def qwen3_text_set(tmp_path_factory, captioned_set, tiny_qwen3) -> Path:
    """The tiny Qwen3's features of `captioned_set`'s captions (max length 24, batches of 5 captions)."""
    out = tmp_path_factory.mktemp("qwen3-text") / "text"
    text_extract(captioned_set, tiny_qwen3, out)
    return out
