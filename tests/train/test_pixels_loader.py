"""The loader's pixels (sets extracted with --pixels, for a representation-alignment teacher): each batch item's
crop is the stored one in the orientation of its latent's view, sample by sample, in loader workers too, and
the VAE encodes those pixels to the latent view the item was trained on (so the flips agree)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from dit_pipeline.common.vae import load_vae
from dit_pipeline.shards import iter_shard, read_manifest, view_pixels
from dit_pipeline.train.data import Batch, EpochStream, make_loader
from dit_pipeline.train.shard_source import open_shards
from dit_pipeline.train.latents import sample_seed, sample_view
from dit_pipeline.train.partition import plan_epoch
from tests._util import make_image_tree
from tests.extract.conftest import extract


@pytest.fixture(scope="module")
def pixel_shards(tiny_vae_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("pixel-loader")
    data = make_image_tree(root / "images", counts=(5, 4, 3))
    extract(data, tiny_vae_dir, root / "shards", pixels=True, samples_per_shard=3)
    return root / "shards"


def _epoch(shards, epoch: int, workers: int, pixels: bool = True) -> list[Batch]:
    source = open_shards(str(shards))
    plan = plan_epoch(source.sizes, seed=3, epoch=epoch, world_size=1, workers=max(workers, 1), micro_batch=2, accum=1)
    stream = EpochStream(source, plan, 0, seed=3, buffer=4, pixels=pixels)
    loader = make_loader(stream, num_workers=workers, prefetch_factor=2, pin_memory=False)
    return [b for b in loader if isinstance(b, Batch)]


@pytest.mark.parametrize("workers", [0, 2])
def test_each_item_gets_the_crop_of_its_latent_view(pixel_shards, workers):
    m = read_manifest(pixel_shards)
    stored = {int(s.key): s for u in m.shard_urls(str(pixel_shards)) for s in iter_shard(u, m, pixels="decoded")}
    assert m.views == 2 and len(stored) == 12
    views = set()
    for epoch in (0, 1):
        batches = _epoch(pixel_shards, epoch, workers)
        assert sum(len(b.keys) for b in batches) == 12
        for b in batches:
            assert b.pixels is not None and b.pixels.dtype == torch.uint8 and tuple(b.pixels.shape) == (2, 32, 32, 3)
            for key, px in zip(b.keys.tolist(), b.pixels):
                v = sample_view(sample_seed(3, epoch, f"{key:09d}"), m.views)
                views.add(v)
                np.testing.assert_array_equal(px.numpy(), view_pixels(stored[key].pixels, v))
    assert views == {0, 1}  # both orientations occur, so the check above covers the flip


def test_the_vae_encodes_the_pixels_to_the_latent_view_trained_on(pixel_shards, tiny_vae_dir):
    m = read_manifest(pixel_shards)
    stored = {int(s.key): s for u in m.shard_urls(str(pixel_shards)) for s in iter_shard(u, m)}
    vae, _ = load_vae(str(tiny_vae_dir), device="cpu")
    for b in _epoch(pixel_shards, 0, 0):
        x = b.pixels.permute(0, 3, 1, 2).float() / 127.5 - 1
        with torch.no_grad():
            mean = vae.encode(x).latent_dist.mean
        for key, row in zip(b.keys.tolist(), mean):
            v = sample_view(sample_seed(3, 0, f"{key:09d}"), m.views)
            same = (row - torch.from_numpy(stored[key].mean[v])).abs().max().item()
            other = (row - torch.from_numpy(stored[key].mean[1 - v])).abs().max().item()
            # the stored mean is float16 (rounding up to ~1e-3 here); the other view is 10x farther at least
            assert same < 2e-3 and other > 2e-2, (key, v, same, other)


def test_no_pixels_unless_asked(pixel_shards):
    assert all(b.pixels is None for b in _epoch(pixel_shards, 0, 0, pixels=False))
