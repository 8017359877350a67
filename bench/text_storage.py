"""Benchmark: what caching text-encoder features costs and saves (issue 37), in one run.

  bytes     bytes per sample and per million samples of each encoder's features as `dit-extract --text-encoder`
            stores them (real text shards written by shards.ShardWriter.write_text: tar and .npy headers and the
            lengths member included), at true token lengths vs padded to the encoder's max length, on a
            documented caption-length distribution (below); and the ratio
  extract   captions/s of `dit-extract --text-encoder` (extract.text.run_text_extract: reading a captioned shard
            set, tokenizing, encoding padded to max length, trimming, writing) with a Qwen3-0.6B-shaped model
            (its published width and heads; --layers of its 28 layers, random weights, bfloat16) and with the
            tests' tiny Qwen3 (the pipeline's own cost)
  step      the forward FLOPs of Qwen3-0.6B on one caption at NanoGen's 256 tokens (counted by
            torch.utils.flop_counter, its 1- and 2-layer versions extended to 28 layers) beside a DiT-XL/2 training
            step's (3 x its forward, dit.forward_macs): the share of a step that caching removes (an
            estimate: NanoGen's own network, with its in-context text tokens, costs more per step)

Caption lengths (tokens, before the encoder's special tokens): a log-normal whose mean is a published
word count x 1.3 tokens per word (the usual English BPE ratio: OpenAI's tokenizer guide gives ~0.75 words per
token) and whose log-space spread sigma is an assumption (--sigma, 0.35 by default), clipped at 1 token and cut
at the encoder's max length (counted as truncated):
  long    LLaVA recaptions of Recap-DataComp-1B (Li et al. 2024, arXiv:2406.08478): mean 49.4 words (generated
          with at most 128 new tokens) -> mean 64 tokens
  short   the web alt-texts they replace (same paper): mean about 10.2 words -> mean 13 tokens

  ratio     the true / padded ratio as a function of the mean caption length: real shards whose every caption
            has m tokens, for m from 8 to the max length, per encoder (the ratio is about m / max length plus the
            per-sample tar and .npy headers, whatever the distribution's spread below the max length)
  real      token counts of real caption text (--prompts FILE, repeatable: e.g. GenEval's evaluation_metadata.jsonl,
            PartiPrompts, DPG-Bench's prompts) with the real tokenizers at hand: Qwen3's byte-level BPE from its
            151,643 merge ranks (--qwen-tiktoken FILE: the `qwen.tiktoken` file the `dashscope` package ships, read
            with the `tiktoken` package; Qwen3's regular vocabulary and pre-tokenizer pattern, NFC-normalized as
            Qwen2TokenizerFast does) and CLIP's BPE (the `open_clip_torch` package's bundled vocabulary), each with its
            special tokens; and the bytes of their features at true length vs padded
  mix       NanoGen's T2I training mix (its BLIP3o splits, the sizes of its own dataset code) in TiB at true length,
            at the stated mean lengths per split

    python bench/text_storage.py                                   # bytes + step + extract (2 layers)
    python bench/text_storage.py --parts bytes --samples 2000
    python bench/text_storage.py --parts extract --layers 4 --captions 64
    python bench/text_storage.py --parts ratio mix real --prompts geneval.jsonl parti.txt --qwen-tiktoken qwen.tiktoken
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _checkout import use_checkout  # noqa: E402

use_checkout()

from dit_pipeline.shards import (FORMAT_VERSION_TEXT, Manifest, ShardWriter, sample_key, shard_name,  # noqa: E402
                                 write_manifest)

TOKENS_PER_WORD = 1.3
CAPTIONS = {"long": 49.4 * TOKENS_PER_WORD, "short": 10.2 * TOKENS_PER_WORD}  # mean tokens (see the docstring)
# (hidden size from each model's published config, max length of the release that uses it, special tokens added)
ENCODERS = {
    "Qwen3-0.6B (NanoGen)": (1024, 256, 0),
    "Flan-T5-XL (T2I-ImageNet)": (2048, 120, 1),
    "T5-XXL (PixArt-alpha)": (4096, 120, 1),
    "CLIP-L/14 text": (768, 77, 2),
}
QWEN3_06B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                 tie_word_embeddings=True, rms_norm_eps=1e-6, rope_theta=1_000_000.0)
SD_VAE_POSTERIOR_BYTES = 37_120  # per sample, 2 views, float16 (BENCHMARKS.md "Feature spaces")


def caption_lengths(kind: str, n: int, *, sigma: float, special: int, max_length: int, seed: int = 0
                    ) -> tuple[np.ndarray, int]:
    """(stored token counts of `n` captions, how many were cut at max_length) for a caption kind."""
    rng = np.random.default_rng(seed)
    mu = math.log(CAPTIONS[kind]) - sigma ** 2 / 2  # log-normal with the stated mean
    raw = np.maximum(1, np.rint(rng.lognormal(mu, sigma, n))).astype(np.int64) + special
    return np.minimum(raw, max_length), int((raw > max_length).sum())


def text_bytes(folder: Path, lengths_per_sample: list[list[int]], dim: int) -> int:
    """Bytes of a text shard holding these samples (features of zeros: the size does not depend on values)."""
    path = folder / "shard-000000.tar"
    with ShardWriter(path, dtype="bfloat16") as w:
        for i, lengths in enumerate(lengths_per_sample):
            w.write_text(sample_key(i), [np.zeros((n, dim), np.float32) for n in lengths])
        rec = w.close()
    path.unlink()
    return rec.bytes


def bytes_part(a: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    rows = []
    scenarios = [(enc, kind, per) for enc in ENCODERS for kind, per in (("long", 1), ("short", 1))]
    scenarios.append(("Qwen3-0.6B (NanoGen)", "long", 2))  # ImageNet recaptions: a long and a short caption each
    for enc, kind, per in scenarios:
        dim, max_length, special = ENCODERS[enc]
        kinds = [kind] if per == 1 else ["long", "short"]
        lens = [caption_lengths(k, a.samples, sigma=a.sigma, special=special, max_length=max_length, seed=j)
                for j, k in enumerate(kinds)]
        trimmed = [[int(lens[j][0][i]) for j in range(len(kinds))] for i in range(a.samples)]
        padded = [[max_length] * len(kinds) for _ in range(a.samples)]
        tb, pb = text_bytes(work, trimmed, dim) / a.samples, text_bytes(work, padded, dim) / a.samples
        rows.append({"encoder": enc, "captions": "+".join(kinds), "dim": dim, "max_length": max_length,
                     "mean_tokens": float(np.mean([sum(t) for t in trimmed])) / len(kinds),
                     "truncated": sum(c for _, c in lens) / (a.samples * len(kinds)),
                     "trimmed_bytes": tb, "padded_bytes": pb, "ratio": tb / pb,
                     "trimmed_gib_per_m": tb * 1e6 / 2 ** 30, "padded_gib_per_m": pb * 1e6 / 2 ** 30,
                     "vs_latents": tb / SD_VAE_POSTERIOR_BYTES})
    return rows


RATIO_MEANS = (8, 16, 32, 64, 100, 128, 150, 200, 256)  # tokens per caption, every caption of a row alike


def ratio_part(a: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    """True / padded bytes per sample of real shards whose every caption has m tokens (one caption each)."""
    rows = []
    n = max(64, a.samples // 10)
    for enc, (dim, max_length, _) in ENCODERS.items():
        padded = text_bytes(work, [[max_length]] * n, dim) / n
        for m in RATIO_MEANS:
            m_cut = min(m, max_length)
            true = text_bytes(work, [[m_cut]] * n, dim) / n
            rows.append({"encoder": enc, "tokens": m_cut, "max_length": max_length, "ratio": true / padded,
                         "bytes": true, "padded_bytes": padded})
            if m >= max_length:
                break
    return rows


# NanoGen's BLIP3o splits (End2End-Diffusion/diffusion-bench src/data/blip3o_wds_dataset.py l.10-14,
# BLIP3O_METADATA num_samples), which its T2I training configs combine (journeydb, long-caption, short-caption)
BLIP3O_SPLITS = {"long-caption": 27_200_000, "short-caption": 4_770_000, "journeydb": 4_280_000}


def mix_part(a: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    """Qwen3-0.6B features of NanoGen's T2I mix at true length: the short-caption split at the bench's "short"
    lengths, the long-caption split at the bench's "long" lengths and then at fixed mean lengths (its real mean is
    not known here), JourneyDB (Midjourney prompts; no mean length known here) between the short and the long."""
    dim, max_length, special = ENCODERS["Qwen3-0.6B (NanoGen)"]
    lens, _ = caption_lengths("short", a.samples, sigma=a.sigma, special=special, max_length=max_length)
    short = text_bytes(work, [[int(x)] for x in lens], dim) / a.samples
    lens, _ = caption_lengths("long", a.samples, sigma=a.sigma, special=special, max_length=max_length)
    longs = {f"{CAPTIONS['long']:.0f} (the bench's long)": text_bytes(work, [[int(x)] for x in lens], dim) / a.samples}
    longs.update({str(m): text_bytes(work, [[m]] * 64, dim) / 64 for m in (100, 150, 200)})
    padded = text_bytes(work, [[max_length]] * 64, dim) / 64
    total = sum(BLIP3O_SPLITS.values())
    rows = []
    for mean, long in longs.items():
        fixed = BLIP3O_SPLITS["long-caption"] * long + BLIP3O_SPLITS["short-caption"] * short
        low, high = (fixed + BLIP3O_SPLITS["journeydb"] * b for b in (short, long))
        rows.append({"long_mean": mean, "samples": total, "long_share": BLIP3O_SPLITS["long-caption"] / total,
                     "tib_low": low / 2 ** 40, "tib_high": high / 2 ** 40, "ratio_low": low / (total * padded),
                     "ratio_high": high / (total * padded), "tib_all_short": total * short / 2 ** 40,
                     "tib_padded": total * padded / 2 ** 40})
    return rows


QWEN_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
                r"""\s*[\r\n]+|\s+(?!\S)|\s+""")  # Qwen2TokenizerFast's pre-tokenizer split, Qwen3's too


def real_tokenizers(a: argparse.Namespace) -> dict[str, tuple[Any, str]]:
    """{encoder name in ENCODERS: (tokens-of-a-caption function, what it is)} for the real tokenizers at hand."""
    import unicodedata

    out: dict[str, tuple[Any, str]] = {}
    if a.qwen_tiktoken:
        import base64

        import tiktoken

        ranks = {base64.b64decode(tok): int(rank) for tok, rank in
                 (line.split() for line in Path(a.qwen_tiktoken).read_bytes().splitlines() if line)}
        enc = tiktoken.Encoding("qwen", pat_str=QWEN_PATTERN, mergeable_ranks=ranks, special_tokens={})
        out["Qwen3-0.6B (NanoGen)"] = (lambda t: len(enc.encode_ordinary(unicodedata.normalize("NFC", t))),
                                       f"Qwen's byte-level BPE ({len(ranks):,} ranks), no special tokens")
    try:
        import open_clip
    except ImportError:
        pass
    else:
        clip = open_clip.get_tokenizer("ViT-L-14")
        out["CLIP-L/14 text"] = (lambda t: len(clip.encode(open_clip.tokenizer.clean_text(t) if hasattr(
            open_clip.tokenizer, "clean_text") else t)) + 2, "CLIP's BPE (open_clip's bundled vocabulary) + BOS, EOS")
    return out


def real_part(a: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    """Per prompt file and real tokenizer: token counts and the bytes of the features at true length vs padded."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from dit_pipeline.common.prompts import read_prompts

    tokenizers = real_tokenizers(a)
    rows = []
    for file in a.prompts or []:
        texts = [r["prompt"] for r in read_prompts(file)]
        words = np.array([len(t.split()) for t in texts])
        for enc, (count, what) in tokenizers.items():
            dim, max_length, _ = ENCODERS[enc]
            raw = np.array([count(t) for t in texts])
            kept = np.minimum(raw, max_length)
            true = text_bytes(work, [[int(x)] for x in kept], dim) / len(texts)
            padded = text_bytes(work, [[max_length]] * 64, dim) / 64
            rows.append({"file": Path(file).name, "captions": len(texts), "encoder": enc, "tokenizer": what,
                         "mean_words": float(words.mean()), "mean_tokens": float(kept.mean()),
                         "tokens_per_word": float(raw.sum() / max(1, words.sum())),
                         "p95_tokens": float(np.percentile(raw, 95)), "max_tokens": int(raw.max()),
                         "truncated": float((raw > max_length).mean()), "ratio": true / padded, "bytes": true})
    return rows


def step_part() -> dict[str, Any]:
    """Qwen3-0.6B's forward FLOPs on one caption at 256 tokens vs a DiT-XL/2 training step's. Counted by
    torch.utils.flop_counter on its 1- and 2-layer versions (real tensors; transformers' mask code needs values)
    and extended to 28 identical layers: F(28) = F(1) + 27 x (F(2) - F(1))."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import Qwen3Config, Qwen3Model

    from dit_pipeline.dit import create_model, forward_macs

    def flops(layers: int) -> int:
        model = Qwen3Model(Qwen3Config(**{**QWEN3_06B, "num_hidden_layers": layers})).eval()
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            model(input_ids=torch.zeros((1, 256), dtype=torch.long), use_cache=False)
        return counter.get_total_flops()

    one, two = flops(1), flops(2)
    text = (one + (QWEN3_06B["num_hidden_layers"] - 1) * (two - one)) / 1e9
    with torch.device("meta"):
        dit_cfg = create_model("DiT-XL/2").config
    step = 3 * 2 * forward_macs(dit_cfg) / 1e9
    return {"text_gflop": text, "dit_xl2_step_gflop": step, "share_removed": text / (text + step)}


def _captioned_set(folder: Path, samples: int, per_shard: int, words: int) -> None:
    """A latent set with one caption of `words` words per sample (tiny latents: only the captions are read)."""
    from dit_pipeline.extract.captions import shard_digest

    folder.mkdir(parents=True)
    records, digests = [], []
    vocab = "a photo of the cat dog red green sofa park city night light beach people walking sunset".split()
    for s in range(math.ceil(samples / per_shard)):
        items = []
        with ShardWriter(folder / shard_name(s), captions=True) as w:
            for k in range(s * per_shard, min(samples, (s + 1) * per_shard)):
                cap = " ".join(vocab[(k + j) % len(vocab)] for j in range(words))
                w.write(sample_key(k), label=0, meta={}, latent=np.zeros((1, 4, 2, 2), np.float32), captions=[cap])
                items.append((sample_key(k), [cap]))
            records.append(w.close())
        digests.append(shard_digest(items))
    import hashlib

    h = hashlib.sha256(b"".join(bytes.fromhex(d) for d in digests)).hexdigest()
    captions = {"member": "captions.json", "source": {"kind": "bench"}, "captions": samples, "dropped_empty": 0,
                "dropped_undecodable": 0, "uncaptioned": 0, "unmatched": {"count": 0, "examples": []}, "sha256": h,
                "per_image": {"min": 1, "max": 1}}
    write_manifest(folder, Manifest(
        format_version=FORMAT_VERSION_TEXT, tool_version="bench", extraction={"vae": {"source": "bench"}},
        scaling_factor=1.0, shift_factor=None, image_size=16, views=1, store="sample", dtype="float16",
        latent_shape=[4, 2, 2], class_names=["unlabeled"], num_classes=1, total_samples=samples,
        samples_per_shard=per_shard, shards=records, skipped=[], captions=captions))


def _qwen3_folder(folder: Path, layers: int) -> Path:
    """A Qwen3-0.6B-shaped model (`layers` of its 28 layers, random weights, bfloat16) with the tests' tokenizer."""
    import torch
    from transformers import Qwen3Config, Qwen3Model

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tests.captions._tiny import make_tiny_qwen3

    make_tiny_qwen3(folder)  # the tokenizer (and a tiny model, replaced below)
    for f in folder.glob("*.safetensors"):
        f.unlink()
    torch.manual_seed(0)
    Qwen3Model(Qwen3Config(**{**QWEN3_06B, "num_hidden_layers": layers})).to(torch.bfloat16).save_pretrained(folder)
    return folder


def _extract_s(source: Path, out: Path, folder: Path, a: argparse.Namespace) -> float:
    from dit_pipeline.extract import ExtractConfig
    from dit_pipeline.extract.text import run_text_extract

    t0 = time.perf_counter()
    run_text_extract(ExtractConfig(data_path=str(source), out=str(out), text_encoder=str(folder), text_max_length=256,
                                   batch_size=a.batch, quiet=True, cpu_threads=a.threads))
    wall = time.perf_counter() - t0
    shutil.rmtree(out)
    return wall


def extract_part(a: argparse.Namespace, work: Path, device: str = "cpu") -> list[dict[str, Any]]:
    """Steady-state captions/s of the whole text extraction: the extra captions of a 3n-caption set over an
    n-caption one divided by the extra time (the start-up, model loading and the manifest cancel out)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tests.captions._tiny import make_tiny_qwen3

    n = a.captions
    small, large = work / "captioned-n", work / "captioned-3n"
    _captioned_set(small, n, max(1, n // 2), 40)
    _captioned_set(large, 3 * n, max(1, n // 2), 40)
    models = {"tiny Qwen3 (width 32, 2 layers)": (make_tiny_qwen3(work / "tiny"), None),
              f"Qwen3-0.6B shape, {a.layers} of 28 layers": (_qwen3_folder(work / "qwen3", a.layers), a.layers)}
    rows = []
    for name, (folder, layers) in models.items():
        best = float("inf")
        for r in range(a.repeat):
            t_small = _extract_s(small, work / "out", folder, a)
            t_large = _extract_s(large, work / "out", folder, a)
            best = min(best, (t_large - t_small) / (2 * n))
        row = {"model": name, "captions_s": 1 / best, "batch": a.batch, "max_length": 256, "device": device}
        if layers:  # the full model: the per-caption time scaled from `layers` to 28 layers (an upper-bound-ish
            row["projected_28_layers_captions_s"] = 1 / (best * 28 / layers)  # estimate: embeddings do not scale)
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", nargs="+", choices=["bytes", "step", "extract", "ratio", "real", "mix"],
                   default=["bytes", "step", "extract"])
    p.add_argument("--prompts", nargs="+", default=None, help="real caption text for --parts real (prompt files)")
    p.add_argument("--qwen-tiktoken", default=None, help="Qwen's BPE ranks (qwen.tiktoken) for --parts real")
    p.add_argument("--samples", type=int, default=1000, help="samples per storage measurement")
    p.add_argument("--sigma", type=float, default=0.35, help="log-space spread of the caption lengths (assumed)")
    p.add_argument("--captions", type=int, default=32, help="captions per extraction-rate run")
    p.add_argument("--layers", type=int, default=2, help="layers of the Qwen3-0.6B-shaped model timed")
    p.add_argument("--batch", type=int, default=16, help="captions per encoder call")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="bench-text-"))
    out: dict[str, Any] = {}
    try:
        if "bytes" in a.parts:
            out["bytes"] = rows = bytes_part(a, work)
            print("| encoder | captions | mean tokens | truncated | bytes/sample trimmed | padded | trimmed / padded "
                  "| GiB per 1M trimmed | GiB per 1M padded | vs SD-VAE latents |\n" + "|---" * 10 + "|")
            for r in rows:
                print(f"| {r['encoder']} | {r['captions']} | {r['mean_tokens']:.1f} | {r['truncated']:.1%} | "
                      f"{r['trimmed_bytes']:,.0f} | {r['padded_bytes']:,.0f} | {r['ratio']:.3f} | "
                      f"{r['trimmed_gib_per_m']:,.1f} | {r['padded_gib_per_m']:,.1f} | {r['vs_latents']:.1f}x |")
        if "ratio" in a.parts:
            out["ratio"] = rows = ratio_part(a, work)
            print("\n| encoder (max length) | tokens per caption | true / padded bytes |\n|---|---|---|")
            for r in rows:
                print(f"| {r['encoder']} ({r['max_length']}) | {r['tokens']} | {r['ratio']:.3f} |")
        if "mix" in a.parts:
            out["mix"] = rows = mix_part(a, work)
            m = rows[0]
            print(f"\nNanoGen's T2I mix: {m['samples'] / 1e6:.2f}M samples, {m['long_share']:.0%} long captions; "
                  f"Qwen3-0.6B features padded {m['tib_padded']:.1f} TiB, all captions short "
                  f"{m['tib_all_short']:.2f} TiB\n| long-caption mean tokens | TiB at true length (JourneyDB short..long) "
                  "| true / padded |\n|---|---|---|")
            for r in rows:
                print(f"| {r['long_mean']} | {r['tib_low']:.2f}-{r['tib_high']:.2f} | "
                      f"{r['ratio_low']:.3f}-{r['ratio_high']:.3f} |")
        if "real" in a.parts:
            out["real"] = rows = real_part(a, work)
            print("\n| prompts | captions | encoder | words | tokens (mean) | tokens / word | p95 | max | truncated "
                  "| true / padded |\n" + "|---" * 10 + "|")
            for r in rows:
                print(f"| {r['file']} | {r['captions']} | {r['encoder']} | {r['mean_words']:.1f} | "
                      f"{r['mean_tokens']:.1f} | {r['tokens_per_word']:.2f} | {r['p95_tokens']:.0f} | "
                      f"{r['max_tokens']} | {r['truncated']:.1%} | {r['ratio']:.3f} |")
        if "step" in a.parts:
            out["step"] = s = step_part()
            print(f"\nQwen3-0.6B forward at 256 tokens: {s['text_gflop']:.1f} GFLOP per caption; DiT-XL/2 training "
                  f"step: {s['dit_xl2_step_gflop']:.1f} GFLOP per image; caching removes {s['share_removed']:.1%}")
        if "extract" in a.parts:
            out["extract"] = rows = extract_part(a, work)
            print("\n| model | captions/s (steady state) | 28 layers, projected | batch | max length |\n"
                  "|---|---|---|---|---|")
            for r in rows:
                proj = r.get("projected_28_layers_captions_s")
                print(f"| {r['model']} | {r['captions_s']:.2f} | {f'{proj:.3f}' if proj else '-'} | {r['batch']} | "
                      f"{r['max_length']} |")
        if a.json:
            print(json.dumps(out))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
