"""Loader workers reuse shared-memory output slots (train.pool): batches consumed one at a time come from a
few recycled slots with the same values as batches that were all kept (fresh memory), and a slot is never
written again while any tensor or view of its batch is alive."""
from __future__ import annotations

import gc
import itertools

import pytest
import torch

from dit_pipeline.train.data import Batch, EpochStream, make_loader
from dit_pipeline.train.shard_source import open_shards
from dit_pipeline.train.partition import plan_epoch

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create")


def _loader(src, plan):
    stream = EpochStream(src, plan, 0, seed=0, buffer=8)
    return make_loader(stream, num_workers=plan.workers, prefetch_factor=2, pin_memory=False), stream


def _in_pool(t: torch.Tensor, pool) -> bool:
    start = pool.data.data_ptr()
    return start <= t.data_ptr() < start + pool.data.numel() * pool.data.element_size()


def test_batches_consumed_one_by_one_reuse_a_few_slots_with_the_same_values(shard_dir):
    src = open_shards(str(shard_dir))
    plan = plan_epoch(src.sizes, seed=0, epoch=0, world_size=1, workers=2, micro_batch=2, accum=1)
    kept, stream = _loader(src, plan)
    kept = list(kept)  # every batch held at once: slots run out, the rest come in fresh shared memory
    assert len(kept) == plan.micro_batches == 28 and all(isinstance(b, Batch) for b in kept)
    assert sum(_in_pool(b.latents, stream.pool) for b in kept) == 2 * stream.pool.slots
    loader, stream = _loader(src, plan)
    pool, addresses = stream.pool, set()
    for i, b in enumerate(loader):
        assert _in_pool(b.latents, pool)  # a free slot was always there
        addresses.add(b.latents.data_ptr())
        assert torch.equal(b.keys, kept[i].keys) and torch.equal(b.labels, kept[i].labels)
        assert torch.equal(b.latents, kept[i].latents)
        del b
    assert i + 1 == 28 and len(addresses) <= pool.workers * pool.slots
    gc.collect()
    assert pool.free_slots() == pool.workers * pool.slots  # everything released


def test_a_slot_is_not_reused_while_a_view_of_its_batch_lives(shard_dir):
    src = open_shards(str(shard_dir))
    plan = plan_epoch(src.sizes, seed=0, epoch=0, world_size=1, workers=1, micro_batch=2, accum=1)
    reference = [b.latents.clone() for b in _loader(src, plan)[0]]
    loader, stream = _loader(src, plan)
    first = next(loader)
    view, want = first.latents[1:], reference[0][1:].clone()
    del first  # the view alone keeps the slot busy
    busy_before = stream.pool.slots - stream.pool.free_slots()
    for i, b in enumerate(itertools.islice(loader, 20), start=1):
        assert torch.equal(b.latents, reference[i])
        assert view.data_ptr() != b.latents[1:].data_ptr()
        del b
    assert torch.equal(view, want)  # never overwritten
    assert busy_before >= 1 and stream.pool.slots - stream.pool.free_slots() >= 1
    del view
    gc.collect()
    rest = list(loader)
    del rest
    gc.collect()
    assert stream.pool.free_slots() == stream.pool.slots
