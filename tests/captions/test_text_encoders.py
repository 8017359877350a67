"""common/text_encoders.py: each encoder family against its release's rule, transcribed here from the release
(not from our code), on tiny random models saved with save_pretrained; the identity record; the batch layout."""
from __future__ import annotations

import pytest
import torch

from dit_pipeline.common.errors import UserError
from dit_pipeline.common.text_encoders import PRESETS, TextFeatures, load_text_encoder, pad_batch, pad_to
from tests.captions.conftest import LONG

CAPTIONS = ["a photo of a cat", "", LONG, "the quick brown fox jumps over the lazy dog"]


def _auto_dtype():
    """transformers 5's from_pretrained default, the checkpoint's dtype, which NanoGen runs with; the 4.x releases
    our floor allows load float32 unless asked (their keyword is torch_dtype)."""
    import transformers

    return {} if int(transformers.__version__.split(".")[0]) >= 5 else {"torch_dtype": "auto"}


def _nanogen_encode(folder, texts, max_length):
    """NanoGen's TextEncoder (End2End-Diffusion/diffusion-bench @4848f0c, src/stage2/models/embedders/
    text_encoder.py lines 14-15 and 23-41): AutoTokenizer + AutoModelForCausalLM.from_pretrained with the defaults
    (transformers 5: the checkpoint's dtype), padding="max_length", truncation, the hidden_states' last entry."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, **_auto_dtype()).eval()
    tokens = tokenizer(texts, padding="max_length", max_length=max_length, truncation=True, return_tensors="pt")
    with torch.no_grad():
        outputs = model(**tokens, use_cache=False, output_hidden_states=True, return_dict=False)
    return outputs[1][-1], tokens["attention_mask"]


def _pixart_encode(folder, texts, max_length):
    """PixArt-alpha's T5Embedder.get_text_embeddings (PixArt-alpha @cac2fd3, diffusion/model/t5.py lines 93-110;
    its caption cleaning is not ours to apply): padding to model_max_length, the mask, last_hidden_state."""
    from transformers import AutoTokenizer, T5EncoderModel

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = T5EncoderModel.from_pretrained(folder).eval()
    t = tokenizer(texts, max_length=max_length, padding="max_length", truncation=True, return_attention_mask=True,
                  add_special_tokens=True, return_tensors="pt")
    with torch.no_grad():
        out = model(input_ids=t["input_ids"], attention_mask=t["attention_mask"])["last_hidden_state"]
    return out, t["attention_mask"]


def test_qwen3_is_nanogens_encoder_bit_for_bit(tiny_qwen3):
    enc = load_text_encoder(str(tiny_qwen3), max_length=24)
    want, mask = _nanogen_encode(str(tiny_qwen3), CAPTIONS, 24)
    got = enc.encode(CAPTIONS)
    assert want.dtype == torch.bfloat16 and got.tokens.dtype == torch.bfloat16   # the checkpoint's dtype
    assert torch.equal(got.tokens, want) and torch.equal(got.mask, mask.bool())  # every position, every bit
    assert got.lengths[1] == 0 and got.truncated == [False, False, True, False]  # no BOS/EOS; LONG is cut
    ident = enc.identity
    assert (ident["family"], ident["dtype"], ident["max_length"], ident["dim"]) == ("decoder", "bfloat16", 24, 32)
    assert ident["tokenizer"]["empty_prompt_ids"] == [] and ident["tokenizer"]["padding_side"] == "right"
    assert ident["hidden_state"].startswith("last_hidden_state of the base model (after its final norm)")
    assert len(ident["weights_sha256"]) == 64 and len(ident["tokenizer"]["files_sha256"]) == 64
    # The identity rebuilds the same encoder
    again = load_text_encoder(ident["name"], max_length=ident["max_length"], dtype=ident["dtype"])
    assert again.identity == ident and torch.equal(again.encode(CAPTIONS).tokens, got.tokens)


def test_t5_is_pixarts_embedder(tiny_t5):
    enc = load_text_encoder(str(tiny_t5), max_length=20)
    want, mask = _pixart_encode(str(tiny_t5), CAPTIONS, 20)
    got = enc.encode(CAPTIONS)
    assert torch.equal(got.tokens, want) and torch.equal(got.mask, mask.bool())
    eos = enc.tokenizer.eos_token_id
    assert enc.identity["tokenizer"]["empty_prompt_ids"] == [eos] and got.lengths[1] == 1  # "" is </s>
    assert enc.identity["family"] == "t5" and enc.identity["dtype"] == "float32"
    assert enc.null().lengths == [1]


def test_clip_text_tower(tiny_clip):
    from transformers import AutoTokenizer, CLIPTextModel

    enc = load_text_encoder(str(tiny_clip))
    assert enc.max_length == 77  # the tokenizer's limit
    tok = AutoTokenizer.from_pretrained(str(tiny_clip))
    t = tok(CAPTIONS, padding="max_length", max_length=77, truncation=True, return_tensors="pt")
    with torch.no_grad():
        want = CLIPTextModel.from_pretrained(str(tiny_clip)).eval()(**t).last_hidden_state
    got = enc.encode(CAPTIONS)
    assert torch.equal(got.tokens, want) and got.lengths[1] == 2  # "" is BOS EOS
    assert enc.identity["tokenizer"]["empty_prompt_ids"] == [tok.bos_token_id, tok.eos_token_id]
    with pytest.raises(UserError) as e:
        load_text_encoder(str(tiny_clip), max_length=100)
    assert str(e.value) == f"--text-max-length 100: {tiny_clip} has 77 positions; use at most 77"


def test_presets_are_the_releases_settings():
    assert {k: (p.source, p.max_length) for k, p in PRESETS.items()} == {
        "qwen3-0.6b": ("Qwen/Qwen3-0.6B", 256), "flan-t5-xl": ("google/flan-t5-xl", 120),
        "t5-v1_1-xxl": ("DeepFloyd/t5-v1_1-xxl", 120), "clip-l": ("openai/clip-vit-large-patch14", 77)}


def test_batch_layout_and_padding():
    tokens = torch.arange(2 * 5 * 3, dtype=torch.float32).reshape(2, 5, 3) + 1
    mask = torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 0, 0]], dtype=torch.bool)
    text, m = TextFeatures(tokens, mask).as_batch()
    assert text.shape == (2, 3, 3) and torch.equal(m, mask[:, :3])
    assert torch.equal(text[0, :2], tokens[0, :2]) and not text[0, 2].any() and torch.equal(text[1], tokens[1, :3])
    rows = [tokens[0, :2].numpy(), tokens[1, :3].numpy()]
    t2, m2 = pad_batch(rows, 3)
    assert torch.equal(t2, text) and torch.equal(m2, m)
    t3, m3 = pad_to(text, m, 6)
    assert t3.shape == (2, 6, 3) and not t3[:, 3:].any() and not m3[:, 3:].any()
    empty, em = pad_batch([tokens[0, :0].numpy()], 3)
    assert empty.shape == (1, 0, 3) and em.shape == (1, 0)


def test_unusable_specs_are_refused(tmp_path, tiny_qwen3):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"x")
    with pytest.raises(UserError) as e:
        load_text_encoder(str(f))
    assert str(e.value).startswith(f"--text-encoder {f}: a file; pass a folder saved with save_pretrained")
    with pytest.raises(UserError) as e:
        load_text_encoder("no-such-org/no-such-encoder")
    assert "could not be loaded from the Hugging Face cache or hub; the hub was not asked (HF_HUB_OFFLINE is set)" \
        in str(e.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError) as e:
        load_text_encoder(str(tmp_path / "empty"))
    assert str(e.value).startswith(f"--text-encoder {tmp_path / 'empty'}: cannot load a model and tokenizer from")
