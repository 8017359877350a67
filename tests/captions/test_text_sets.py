"""Text sets (dit-extract --text-encoder): extracted from a captioned latent set, verified, described, equal to the
online encoder's features, read by the loader as padded batches; refusals and damaged text shards."""
from __future__ import annotations

import itertools
import json
import shutil

import numpy as np
import pytest
import torch

from dit_pipeline.common.errors import ConfigError, UserError
from dit_pipeline.common.text_encoders import load_text_encoder
from dit_pipeline.shards import iter_shard, iter_text_shard, read_manifest, verify_shards
from dit_pipeline.shards.info import format_info, info_dict
from dit_pipeline.shards.npy import widen
from dit_pipeline.shards.siblings import read_text_sibling
from dit_pipeline.train.data import EpochStream, make_loader
from dit_pipeline.train.shard_samples import caption_index
from dit_pipeline.train.shard_source import open_shards
from dit_pipeline.train.partition import plan_epoch
from tests._util import assert_close_at_scale
from tests.captions.conftest import text_extract
from tests.shards._helpers import read_members, refresh_record, write_tar

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create")


def _captions(folder):
    """key -> captions of a latent set, in key order."""
    m = read_manifest(folder)
    return {s.key: s.captions for url in m.shard_urls(str(folder)) for s in iter_shard(url, m, captions=True)}


def _text(folder):
    m = read_manifest(folder)
    return {s.key: s for url in m.shard_urls(str(folder)) for s in iter_text_shard(url, m)}


def test_text_set_verifies_and_describes_itself(captioned_set, qwen3_text_set, tiny_qwen3):
    assert verify_shards(qwen3_text_set, progress=False).ok
    latent, m = read_manifest(captioned_set), read_manifest(qwen3_text_set)
    assert read_text_sibling(latent, qwen3_text_set, "--text").fingerprint() == m.fingerprint()
    caps = [c for cs in _captions(captioned_set).values() for c in cs]
    tok = load_text_encoder(str(tiny_qwen3), max_length=24).tokenizer
    counts = [len(tok(c)["input_ids"]) for c in caps]
    t = m.text
    assert (m.format_version, m.store, m.dtype, m.latent_shape) == (4, "text", "bfloat16", [32])
    assert (t["captions"], t["tokens"], t["truncated"]) == (18, sum(min(n, 24) for n in counts),
                                                            sum(n > 24 for n in counts))
    assert t["truncated"] == 3 and sum(t["length_histogram"]["counts"]) == 18
    assert t["storage_error"] == {"max_abs": 0.0, "max_rel": 0.0, "encoder_dtype": "bfloat16",
                                  "stored_as": "bfloat16"}  # bfloat16 outputs stored as bfloat16: exact
    assert m.null_text().shape == (0, 32)  # Qwen3 adds no special token: the empty prompt has no token
    assert m.text_encoder["name"] == str(tiny_qwen3) and m.skipped == latent.skipped
    d = info_dict(qwen3_text_set)
    assert d["text"]["feature_bytes"] == t["tokens"] * 32 * 2 and d["text"]["padded_feature_bytes"] == 18 * 24 * 32 * 2
    text = format_info(d)
    assert f"features: 32 per token, bfloat16, max length 24; 18 captions, {t['tokens']} tokens" in text
    assert "3 truncated at the max length" in text and "the empty prompt's features: 0 tokens" in text


def test_cached_features_are_the_online_features(captioned_set, qwen3_text_set, tiny_qwen3):
    """The same batches give the same bits (NanoGen's padded shape, trimmed); one caption at a time, other
    kernels' shapes, the same to bfloat16 precision."""
    enc = load_text_encoder(str(tiny_qwen3), max_length=24)
    stored = _text(qwen3_text_set)
    caps = _captions(captioned_set)
    for shard in read_manifest(captioned_set).shards:  # the extraction's batches: 5 captions of a shard in key order
        keys = [k for k in caps if shard.first_key <= k <= shard.last_key]
        flat = [(k, i, c) for k in keys for i, c in enumerate(caps[k])]
        for start in range(0, len(flat), 5):
            chunk = flat[start:start + 5]
            online = enc.encode([c for _, _, c in chunk])
            for j, (k, i, c) in enumerate(chunk):
                cached = torch.from_numpy(widen(stored[k].caption(i), "bfloat16"))
                assert torch.equal(cached, online.trimmed(j).float())  # bit for bit
                if start == 0:  # the first batch's captions, one at a time
                    alone = enc.encode([c]).trimmed(0).float()
                    assert_close_at_scale(alone, cached, rel=2 ** -6, what=f"{k} caption {i} alone")


@pytest.mark.parametrize("which, null_tokens", [("t5", 1), ("clip", 2)])
def test_float32_encoders_are_stored_as_float16_with_the_error_measured(captioned_set, tmp_path, request, which,
                                                                         null_tokens):
    folder = request.getfixturevalue(f"tiny_{which}")
    out = tmp_path / "text"
    text_extract(captioned_set, folder, out, text_max_length=20)
    m = read_manifest(out)
    assert m.dtype == "float16" and verify_shards(out, progress=False).ok
    enc = load_text_encoder(str(folder), max_length=20)
    stored, caps = _text(out), _captions(captioned_set)
    max_abs = max_value = 0.0
    for k, cs in caps.items():
        online = enc.encode(cs)
        for i in range(len(cs)):
            exact = online.trimmed(i)
            diff = (torch.from_numpy(widen(stored[k].caption(i), "float16")) - exact).abs().max()
            max_abs, max_value = max(max_abs, float(diff)), max(max_value, float(exact.abs().max()))
    err = m.text["storage_error"]
    assert err["stored_as"] == "float16" and err["encoder_dtype"] == "float32"
    assert_close_at_scale(err["max_abs"], max_abs, rel=0.25, what="recorded storage error")  # other batch shapes
    assert 0 < err["max_abs"] <= 2 ** -11 * err["max_abs"] / err["max_rel"]  # half a float16 ulp at most
    null = m.null_text()
    assert null.shape == (null_tokens, 32)
    assert np.array_equal(null, enc.null().trimmed(0).numpy().astype(np.float16).astype(np.float32))


def _batches(src, text_m, folder, *, workers, epoch=0, captions=True, text=True):
    plan = plan_epoch(src.sizes, seed=3, epoch=epoch, world_size=1, workers=max(1, workers), micro_batch=2, accum=1)
    stream = EpochStream(src, plan, 0, seed=3, buffer=4, text=(str(folder), text_m) if text else None,
                         captions=captions)
    return list(itertools.islice(make_loader(stream, num_workers=workers, prefetch_factor=2, pin_memory=False),
                                 plan.micro_batches))


def test_loader_yields_padded_text_batches(captioned_set, qwen3_text_set, tiny_qwen3):
    src = open_shards(str(captioned_set))
    text_m = read_text_sibling(src.manifest, qwen3_text_set, "--text")
    stored, caps = _text(qwen3_text_set), _captions(captioned_set)
    inline, forked = (_batches(src, text_m, qwen3_text_set, workers=w) for w in (0, 1))
    assert len(inline) == 4
    drawn = {}
    for b in inline:
        lengths = b.text_mask.sum(1)
        # the stored dtype, never widened in the loader (issue 47; issue 44 item 6: NanoGen feeds bfloat16)
        assert b.text.dtype == torch.bfloat16 and b.text.shape[1] == int(lengths.max())
        for row, key in enumerate(b.keys.tolist()):
            k = f"{key:09d}"
            i = caption_index(3, 0, key, 2)
            feats = widen(stored[k].caption(i), "bfloat16")
            n = len(feats)
            assert int(lengths[row]) == n and bool(b.text_mask[row, :n].all()) and not b.text_mask[row, n:].any()
            assert np.array_equal(b.text[row, :n].float().numpy(), feats) and not b.text[row, n:].any()
            assert b.captions[row] == caps[k][i]
            drawn[key] = i
    for a, b in zip(inline, forked):  # the same batches in this process and from a loader worker (shared memory)
        assert torch.equal(a.keys, b.keys) and torch.equal(a.text, b.text) and a.captions == b.captions
    assert len(set(drawn.values())) == 2  # both captions are used
    later = {key: caption_index(3, 1, key, 2) for key in drawn}
    assert later != drawn  # another epoch, other draws
    # Online: the drawn captions encoded by the trainer give the cached batch (mask exactly, values to bf16)
    enc = load_text_encoder(str(tiny_qwen3), max_length=24)
    for b in inline:
        text, mask = enc.encode(b.captions).as_batch()
        assert torch.equal(mask, b.text_mask)
        assert text.dtype == b.text.dtype == torch.bfloat16
        assert_close_at_scale(text.float(), b.text.float(), rel=2 ** -6, what="online vs cached batch")
    # Captions only (online mode), no text set: the same captions
    only = _batches(src, None, qwen3_text_set, workers=0, text=False)
    assert [b.captions for b in only] == [b.captions for b in inline] and all(b.text is None for b in only)


def test_text_extraction_refusals(captioned_set, qwen3_text_set, tiny_qwen3, tmp_path):
    from dit_pipeline.extract import ExtractConfig
    from tests.shards._helpers import make_set

    make_set(tmp_path / "plain")
    with pytest.raises(UserError) as e:
        text_extract(tmp_path / "plain", tiny_qwen3, tmp_path / "t1")
    assert str(e.value) == (f"--data-path {tmp_path / 'plain'}: a shard set without captions; --text-encoder encodes "
                            "the captions of a latent set extracted with --captions, or a class-labelled set's with "
                            "--caption-template 'a photo of a {name}'")
    with pytest.raises(UserError) as e:
        text_extract(qwen3_text_set, tiny_qwen3, tmp_path / "t2")
    assert str(e.value).startswith(f"--data-path {qwen3_text_set}: a text set;")
    with pytest.raises(ConfigError) as e:
        ExtractConfig(data_path=str(captioned_set), out=str(tmp_path / "t3"), text_encoder="qwen3-0.6b", limit=4,
                      pixels=True).validate()
    assert ("--text-encoder encodes the captions of the shard set in --data-path into a sibling set with its keys "
            "and shards; --pixels, --limit do not apply (drop them)") in str(e.value)
    assert not any((tmp_path / n).exists() for n in ("t1", "t2", "t3"))
    with pytest.raises(UserError) as e:
        open_shards(str(qwen3_text_set))
    assert str(e.value) == (f"{qwen3_text_set} is a text set (text-encoder features of {tiny_qwen3}, no latents); "
                            "--shards needs a latent shard set (pass the text set beside it, as its sibling)")
    other = tmp_path / "other"
    shutil.copytree(qwen3_text_set, other)
    d = json.loads((other / "manifest.json").read_text())
    d["text"]["source"]["captions_sha256"] = "0" * 64
    (other / "manifest.json").write_text(json.dumps(d))
    with pytest.raises(UserError) as e:
        read_text_sibling(read_manifest(captioned_set), other, "--text")
    assert str(e.value).startswith(f"--text {other}: its features were made from other captions than the training "
                                   "shards hold (captions sha256 000000000000... vs ")


def test_verify_names_damaged_text_shards(qwen3_text_set, tmp_path):
    folder = tmp_path / "text"
    shutil.copytree(qwen3_text_set, folder)
    name = read_manifest(folder).shards[0].name
    members = read_members(folder / name)
    first = members[0][0].split(".")[0]
    bad_lengths = np.asarray([30, 2], "<i4")
    from dit_pipeline.shards.npy import npy_header

    members = [(n, npy_header("<i4", (2,)) + bad_lengths.tobytes() if n == f"{first}.lengths.npy" else d)
               for n, d in members]
    write_tar(folder / name, members)
    refresh_record(folder, name)
    got = verify_shards(folder, progress=False).problems
    assert got == [(name, f"sample {first}: lengths.npy [30, 2] outside [0, 24] (the encoder's max length)")]
    shutil.rmtree(folder)
    shutil.copytree(qwen3_text_set, folder)
    d = json.loads((folder / "manifest.json").read_text())
    d["text"]["captions"] += 1
    d["text"]["length_histogram"]["counts"][0] += 1
    (folder / "manifest.json").write_text(json.dumps(d))
    got = verify_shards(folder, progress=False).problems
    assert got[0] == ("manifest.json", "the shards hold 18 captions' features, the manifest's text record says 19")
    assert got[1][1].startswith("token-length histogram of the shards [0, ")


def test_caption_template_refusals(captioned_set, tiny_qwen3, tmp_path):
    """--caption-template makes a class-labelled set's captions: refused on a set that stores captions, without
    {name}, without --text-encoder, or with a class-names file that does not name every class."""
    from dit_pipeline.extract import ExtractConfig
    from tests.shards._helpers import make_set

    with pytest.raises(UserError, match="stores captions; --caption-template makes captions for a set without them"):
        text_extract(captioned_set, tiny_qwen3, tmp_path / "t1", caption_template="a photo of a {name}")
    with pytest.raises(ConfigError, match=r"--caption-template must contain \{name\}"):
        ExtractConfig(data_path="x", out="y", text_encoder="qwen3-0.6b", caption_template="a photo").validate()
    with pytest.raises(ConfigError, match="--caption-template and --class-names make a class-labelled set's captions"):
        ExtractConfig(data_path="x", out="y", caption_template="a photo of a {name}").validate()
    m = make_set(tmp_path / "plain")
    (tmp_path / "names.txt").write_text("only one\n")
    with pytest.raises(UserError, match=f"--class-names: class_names {tmp_path / 'names.txt'} gives 1 names for the "
                                        f"{m.num_classes} classes of the shard set"):
        text_extract(tmp_path / "plain", tiny_qwen3, tmp_path / "t2", caption_template="a photo of a {name}",
                     class_names=str(tmp_path / "names.txt"))
    assert not any((tmp_path / n).exists() for n in ("t1", "t2"))
