"""Issue 44 item 6: the text path in NanoGen's precision. NanoGen feeds its encoder's bfloat16 features (Qwen3-0.6B
loaded at the checkpoint's dtype) straight into the network's text embedder, whose RMSNorm rounds the normalized
features back to bfloat16 before the weight (End2End-Diffusion/diffusion-bench src/stage2/models/model_utils.py
l.50-60 `RMSNorm.forward`: `self._norm(x.float()).type_as(x) * self.weight`, used by `ConditionEmbedder` l.129-130
and transcribed in tests/dit/test_incontext.py `_rmsnorm`); ours widened the features to float32 first (the loader,
the online encoder, dit-sample), which skips that rounding. The features now stay in the encoder's dtype through
the loader (a TextPool slot, no widening), the conditioning (dropout rows of the empty prompt too) and the sampler;
each path is compared with NanoGen's network transcribed (tests/dit/test_incontext.py `nanogen_forward`) on the
tiny random Qwen3's own bfloat16 features."""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from dit_pipeline.common.text_encoders import load_text_encoder
from dit_pipeline.shards import read_manifest
from dit_pipeline.shards.siblings import read_text_sibling
from dit_pipeline.train.data import EpochStream, make_loader
from dit_pipeline.train.shard_source import open_shards
from dit_pipeline.train.partition import plan_epoch
from dit_pipeline.train.text import BatchText, open_text_set, run_conditioning
from tests._util import assert_close_at_scale
from tests.dit.test_incontext import HEADS, _random_model, nanogen_forward

FP32_EPS = 2.0 ** -23
PROMPTS = ["a photo of a cat sitting on a red sofa", "two dogs running in the park", "an aerial view of a city"]


def _model():
    """The tiny in-context DiT-DH of tests/dit/test_incontext.py taking the tiny Qwen3's 32-wide features."""
    return _random_model(2, conditioning="text", text_dim=32, num_c_tokens=24)


def _old(model, x, t, text, mask):
    """The widened path the issue measured: the features in float32 before the embedder."""
    with torch.no_grad():
        return model(x, t, text=text.float(), text_mask=mask)


def test_bfloat16_features_give_nanogens_network_output(tiny_qwen3):
    enc = load_text_encoder(str(tiny_qwen3), max_length=24)
    feats = enc.encode(PROMPTS)
    assert feats.tokens.dtype == torch.bfloat16  # Qwen3's weights, as NanoGen loads them
    text, mask = feats.as_batch()
    assert text.dtype == torch.bfloat16
    model = _model()
    g = torch.Generator().manual_seed(3)
    x, t = torch.randn(3, 4, 8, 8, generator=g), torch.rand(3, generator=g)
    # NanoGen: every prompt padded to the encoder's max length, the padding masked (its TextEncoder.forward)
    want = nanogen_forward(model.state_dict(), x, t, text=feats.tokens, text_mask=feats.mask.float(), **HEADS)
    with torch.no_grad():
        got = model(x, t, text=text, text_mask=mask)
    assert_close_at_scale(got, want, rel=64 * FP32_EPS)
    old = _old(model, x, t, text, mask)
    assert (old - want).abs().max() > 1e-4 * want.abs().max()  # the rounding the old path skipped: 8e-4 here


def _batches(captioned_set, text_set, workers):
    src = open_shards(str(captioned_set))
    text_m = read_text_sibling(src.manifest, text_set, "--text")
    plan = plan_epoch(src.sizes, seed=3, epoch=0, world_size=1, workers=max(1, workers), micro_batch=3, accum=1)
    stream = EpochStream(src, plan, 0, seed=3, buffer=4, text=(str(text_set), text_m), captions=True)
    batches = list(itertools.islice(make_loader(stream, num_workers=workers, prefetch_factor=2, pin_memory=False),
                                    plan.micro_batches))
    return stream, batches


def test_the_training_path_feeds_the_stored_bfloat16_through_the_pool(captioned_set, qwen3_text_set, tiny_qwen3):
    """The loader's batch (a worker's TextPool slot: the stored bits, not widened) -> the conditioning with caption
    dropout (the empty prompt's rows in bfloat16 too) -> the network, against NanoGen's network on the same
    features; the online encoder's batch is bfloat16 as well."""
    stream, forked = _batches(captioned_set, qwen3_text_set, workers=1)
    _, inline = _batches(captioned_set, qwen3_text_set, workers=0)
    pool = stream.text_pool
    assert pool is not None and pool.data.dtype == torch.int16  # bfloat16's bits
    assert pool.free_slots() == pool.workers * pool.slots - len(forked)  # every held batch is in a slot
    for a, b in zip(forked, inline):  # the pooled batch equals the in-process one, bit for bit
        assert a.text.dtype == b.text.dtype == torch.bfloat16
        assert torch.equal(a.text, b.text) and torch.equal(a.text_mask, b.text_mask)
    del forked, a, b
    assert pool.free_slots() == pool.workers * pool.slots  # dropped batches give their slots back
    model = _model()
    text_set = open_text_set(read_manifest(qwen3_text_set), str(qwen3_text_set))
    assert text_set.null_text.dtype == torch.bfloat16
    cond = run_conditioning(model, text_set)
    batch = inline[0]
    drop = torch.tensor([False, True, False])
    kwargs = cond.batch_kwargs(BatchText()(batch), drop, torch.device("cpu"))
    assert kwargs["text"].dtype == torch.bfloat16 and not kwargs["text_mask"][1].any()
    g = torch.Generator().manual_seed(4)
    x, t = torch.randn(3, 4, 8, 8, generator=g), torch.rand(3, generator=g)
    want = nanogen_forward(model.state_dict(), x, t, text=kwargs["text"], text_mask=kwargs["text_mask"].float(),
                           **HEADS)
    with torch.no_grad():
        got = model(x, t, **kwargs)
    assert_close_at_scale(got, want, rel=64 * FP32_EPS)
    old = _old(model, x, t, kwargs["text"], kwargs["text_mask"])
    assert (old - want)[[0, 2]].abs().max() > 1e-4 * want.abs().max()
    online = BatchText(load_text_encoder(str(tiny_qwen3), max_length=24))(batch)
    assert online.text.dtype == torch.bfloat16 and torch.equal(online.text_mask, batch.text_mask)


@pytest.fixture(scope="module")
def t2i_ckpt(tmp_path_factory, tiny_qwen3):
    """The tiny text model in our checkpoint format, recording the tiny Qwen3 at 24 tokens; and the tiny VAE."""
    from tests._util import make_tiny_vae
    from tests.sample.conftest import our_checkpoint

    root = tmp_path_factory.mktemp("t2i-precision")
    model = _model()
    identity = load_text_encoder(str(tiny_qwen3), max_length=24).identity
    ckpt = our_checkpoint(model, model)
    ckpt.update(objective="flow", text={"encoder": identity, "features": "cached", "null_text": torch.zeros(0, 32),
                                        "null_mask": torch.zeros(0, dtype=torch.bool)})
    torch.save(ckpt, root / "t2i.pt")
    return root / "t2i.pt", make_tiny_vae(root / "vae"), model


def _nanogen_t2i(sd, enc, prompts, steps, scale=6.0):
    """NanoGen's T2I sampler (src/stage2/transport/sampler.py l.10-34 and src/eval/generation.py l.136-147, as
    tests/sample/test_prompts.py writes them out) over NanoGen's network on the encoder's bfloat16 features, the
    empty prompt padded to max length and masked as NanoGen's encoder gives it; our model's time (1 - t, negated)."""
    from tests.sample.test_protocols_sample import noise_of

    cond, null = enc.encode(prompts), enc.encode([""] * len(prompts))
    s = math.sqrt(4 * 8 * 8 / 4096)
    grid = torch.linspace(1.0, 0.0, steps + 1)
    grid = s * grid / (1 + (s - 1) * grid)
    x, _ = noise_of(0, len(prompts), (4, 8, 8))
    for i in range(steps):
        h, tb = grid[i] - grid[i + 1], torch.full((len(prompts),), grid[i].item())
        c = -nanogen_forward(sd, x, 1 - tb, text=cond.tokens, text_mask=cond.mask.float(), **HEADS)
        u = -nanogen_forward(sd, x, 1 - tb, text=null.tokens, text_mask=null.mask.float(), **HEADS)
        x = x - h * (u + scale * (c - u))
    return x


def test_a_short_t2i_sample_is_nanogens(t2i_ckpt, tiny_qwen3, tmp_path):
    """dit-sample --protocol nanogen-t2i: the prompt features in bfloat16 (sample/prompts.py), the sampler's latents
    equal NanoGen's loop over NanoGen's network on the same bfloat16 features, and so do the written pixels."""
    from dit_pipeline.common.vae import load_vae
    from dit_pipeline.dit import protocols
    from dit_pipeline.sample import SampleConfig, run_sampling
    from dit_pipeline.sample.generate import protocol_loop, protocol_model_fn, sample_latents
    from dit_pipeline.sample.load import load_model
    from dit_pipeline.sample.plan import noise_generators
    from dit_pipeline.sample.prompts import TextSampling, prompt_ids
    from tests.sample.test_protocols_sample import decode, nanogen_pixels

    path, vae_dir, model = t2i_ckpt
    enc = load_text_encoder(str(tiny_qwen3), max_length=24)
    prompts = PROMPTS[:2]
    conds = TextSampling([{"prompt": p} for p in prompts], prompt_ids(2, 2), enc, torch.device("cpu"))
    condition = conds.condition([0, 1])
    assert condition["text"].dtype == conds.null_text.dtype == torch.bfloat16
    proto = protocols.protocol("nanogen-t2i").with_overrides(count=4)
    loop = protocol_loop(proto, latent_shape=(4, 8, 8), convention="sit", learn_sigma=False)
    fn = protocol_model_fn(proto, model, objective="flow", convention="sit", conditioning=conds.conditioning(model))
    got = sample_latents(model, loop, condition, noise_generators(0, range(2)), sampler="euler", model_fn=fn)
    want = _nanogen_t2i(model.state_dict(), enc, prompts, 4)
    assert_close_at_scale(got, want, rel=2 ** 9 * FP32_EPS, what="4 guided steps")  # 7.6e-6 measured
    widened = {k: v.float() if v.is_floating_point() else v for k, v in condition.items()}
    old = sample_latents(model, loop, widened, noise_generators(0, range(2)), sampler="euler", model_fn=fn)
    assert (old - want).abs().max() > 2 ** 12 * FP32_EPS * want.abs().max()  # 2.5e-3 of the largest value here
    # the command itself: its pixels are NanoGen's decoded (a float32 noise level apart at most)
    npz = tmp_path / "s.npz"
    run_sampling(SampleConfig(ckpt=str(path), vae=str(vae_dir), prompts=prompts, num_samples=2, protocol="nanogen-t2i",
                              steps=4, npz=str(npz), quiet=True, batch_size=2))
    with np.load(npz) as z:
        pixels = z["arr_0"].astype(int)
    ref = nanogen_pixels(decode(load_vae(str(vae_dir))[0], want, scale=load_model(path).latent["scaling_factor"]))
    assert np.abs(pixels - ref).max() <= 1 and (pixels == ref).mean() > 0.99
