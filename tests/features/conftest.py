"""Session fixtures of the feature-space tests: a tiny image tree, the tiny encoder, one extraction."""
from __future__ import annotations

import pytest

from dit_pipeline.extract import ExtractConfig, run_extract
from tests._util import make_image_tree
from tests.features._tiny import TINY_IMAGE, make_tiny_encoder

BASE = dict(image_size=TINY_IMAGE, batch_size=3, samples_per_shard=3, num_workers=0, quiet=True)


@pytest.fixture(scope="session")
def tree(tmp_path_factory):
    return make_image_tree(tmp_path_factory.mktemp("feat") / "images", counts=(3, 2))


@pytest.fixture(scope="session")
def encoder(tmp_path_factory):
    return make_tiny_encoder(tmp_path_factory.mktemp("enc"))


@pytest.fixture(scope="session")
def extracted(tree, encoder, tmp_path_factory):
    out = tmp_path_factory.mktemp("ext") / "out"
    run_extract(ExtractConfig(data_path=str(tree), out=str(out), encoder=str(encoder), dtype="float32", **BASE))
    return out




@pytest.fixture(scope="session")
def reg_sets(tree, encoder, tiny_vae_dir, tmp_path_factory):
    """(VAE latents of the tree with pixels, the sibling set of its class tokens: REG's, dit-extract
    --encoder-formula reg)."""
    root = tmp_path_factory.mktemp("reg")
    vae = root / "vae"
    run_extract(ExtractConfig(data_path=str(tree), out=str(vae), vae=str(tiny_vae_dir), pixels=True, **BASE))
    tokens = root / "tokens"
    run_extract(ExtractConfig(data_path=str(tree), out=str(tokens), encoder=str(encoder), encoder_formula="reg",
                              dtype="float32", **BASE))
    return vae, tokens
