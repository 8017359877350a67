"""Tiny random text encoders with their tokenizers, built with the `tokenizers` library and saved with
save_pretrained, so the real loading code runs (nothing is downloaded): a Qwen3 (byte-level BPE, no BOS/EOS,
pad <|endoftext|>, bfloat16 weights as Qwen3-0.6B's), a T5 encoder (unigram, </s> appended, pad <pad>) and a
CLIP text tower (BPE, BOS ... EOS, 77 positions)."""
from __future__ import annotations

from pathlib import Path

CORPUS = ["a photo of a cat sitting on a red sofa", "a dog running on the green grass in the park",
          "the quick brown fox jumps over the lazy dog", "an aerial view of a city at night with lights",
          "a bowl of fruit: apples, oranges and bananas", "two people walking along a sandy beach at sunset"] * 4


def make_tiny_qwen3(folder: Path, seed: int = 0, hidden: int = 32) -> Path:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import Qwen2TokenizerFast, Qwen3Config, Qwen3ForCausalLM

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    fast = Qwen2TokenizerFast(tokenizer_object=tok, pad_token="<|endoftext|>", eos_token="<|im_end|>")
    fast.save_pretrained(folder)
    cfg = Qwen3Config(vocab_size=len(fast), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512,
                      tie_word_embeddings=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(cfg)
    model.to(torch.bfloat16).save_pretrained(folder)  # Qwen3-0.6B's weights are bfloat16
    return folder


def make_tiny_t5(folder: Path, seed: int = 0) -> Path:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import T5Config, T5EncoderModel, T5TokenizerFast  # T5Tokenizer's name in transformers 5

    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(CORPUS, trainers.UnigramTrainer(vocab_size=150, special_tokens=["<pad>", "</s>", "<unk>"],
                                                             unk_token="<unk>", show_progress=False))
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", tok.token_to_id("</s>"))])
    fast = T5TokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>", extra_ids=0)
    fast.save_pretrained(folder)
    cfg = T5Config(vocab_size=len(fast), d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                   feed_forward_proj="gated-gelu")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        T5EncoderModel(cfg).save_pretrained(folder)
    return folder


def make_tiny_clip(folder: Path, seed: int = 0) -> Path:
    import torch
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizerFast  # CLIPTokenizer's in 5

    tok = Tokenizer(models.BPE(unk_token="<|endoftext|>", end_of_word_suffix="</w>"))
    tok.normalizer = normalizers.Sequence([normalizers.NFC(), normalizers.Lowercase()])
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.ByteLevel(add_prefix_space=False)])  # transformers 4 wants a Sequence
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|startoftext|>", "<|endoftext|>"], end_of_word_suffix="</w>",
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    bos, eos = tok.token_to_id("<|startoftext|>"), tok.token_to_id("<|endoftext|>")
    tok.post_processor = processors.TemplateProcessing(single="<|startoftext|> $A <|endoftext|>",
                                                       special_tokens=[("<|startoftext|>", bos), ("<|endoftext|>", eos)])
    fast = CLIPTokenizerFast(tokenizer_object=tok, bos_token="<|startoftext|>", eos_token="<|endoftext|>",
                             pad_token="<|endoftext|>", unk_token="<|endoftext|>")
    fast.save_pretrained(folder)
    cfg = CLIPTextConfig(vocab_size=len(fast), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, max_position_embeddings=77, bos_token_id=bos, eos_token_id=eos,
                         pad_token_id=eos)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        CLIPTextModel(cfg).save_pretrained(folder)
    return folder
