"""Text encoders: captions -> per-token features, the one interface of `dit-extract --text-encoder` (features
cached in a text shard set), the trainer's online mode and `dit-sample --prompt` (issue 37).

`load_text_encoder(spec)` takes a preset name (`PRESETS`), a Hugging Face hub id or a local folder saved with
`save_pretrained` (model + tokenizer) and returns a `TextEncoder`; `TextEncoder.encode(captions)` returns
`TextFeatures` (tokens [N, L, D] right-padded to the encoder's max length, mask [N, L] bool, True = a real
token). Every encoder runs the same rule, which is how the releases call theirs:

- the tokenizer is called with padding="max_length", max_length=L, truncation=True and its default special
  tokens (Qwen3's adds none: no BOS, no EOS; T5's appends </s>; CLIP's wraps the caption in BOS ... EOS), on the
  right (the tokenizer's padding side is set to "right" and recorded);
- the model sees the padded ids with the attention mask, and its `last_hidden_state` is the feature:
  * decoder-only LMs (Qwen3, as NanoGen's `TextEncoder`, End2End-Diffusion/diffusion-bench
    src/stage2/models/embedders/text_encoder.py: AutoModelForCausalLM's `hidden_states[-1]`, which is the base
    model's last hidden state after its final norm); loaded in the checkpoint's dtype (transformers' dtype
    "auto": bfloat16 for Qwen3-0.6B, as NanoGen gets it under transformers 5);
  * T5 encoders (`T5EncoderModel`, PixArt-alpha's `T5Embedder.get_text_embeddings`: max length 120,
    padding to it, the attention mask, `last_hidden_state`; PixArt's caption cleaning (ftfy, BeautifulSoup) is
    not applied: captions are encoded as stored);
  * CLIP text towers (`CLIPTextModel`, `last_hidden_state` after its final LayerNorm, max length 77).

Why padded to max_length: with right padding and a mask, a caption's own positions never see the padding, but
the kernels' shapes do; encoding at the release's padded shape and trimming afterwards gives exactly the
release's numbers at the caption's positions (the test with NanoGen's rule asserts it bit for bit), while a
shorter padded shape changes the last bits. `TextFeatures.as_batch()` is what a trainer consumes: the encoder's
dtype (bfloat16 for Qwen3, as NanoGen feeds its network: no widening, so the network's RMSNorm rounds as NanoGen's
does), zero past each caption's length, padded to the batch's longest caption, the layout of the cached features
in a batch (train.data.Batch.text / text_mask).
"""
from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from dit_pipeline.common.errors import UserError

# The encoder families: how the model is built and what its feature is.
DECODER, T5, CLIP = "decoder", "t5", "clip"
HIDDEN_STATE = {
    DECODER: "last_hidden_state of the base model (after its final norm) = AutoModelForCausalLM hidden_states[-1]",
    T5: "T5 encoder last_hidden_state (after its final layer norm)",
    CLIP: "CLIP text transformer last_hidden_state (after its final LayerNorm)",
}
_T5_TYPES = ("t5", "mt5", "umt5")
_CLIP_TYPES = ("clip", "clip_text_model")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_WEIGHT_SUFFIXES = (".safetensors", ".bin")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                    "spiece.model", "tokenizer.model", "added_tokens.json")


@dataclass(frozen=True)
class TextPreset:
    source: str          # hub id
    max_length: int      # tokens, the release's
    note: str


PRESETS: dict[str, TextPreset] = {
    "qwen3-0.6b": TextPreset("Qwen/Qwen3-0.6B", 256, "NanoGen's T2I encoder (conditioning.text_encoder: "
                             "Qwen/Qwen3-0.6B, max_length 256)"),
    "flan-t5-xl": TextPreset("google/flan-t5-xl", 120, "T2I-ImageNet's encoder, with PixArt-alpha's T5 settings "
                             "(max length 120)"),
    "t5-v1_1-xxl": TextPreset("DeepFloyd/t5-v1_1-xxl", 120, "PixArt-alpha's T5 (T5Embedder, model_max_length 120)"),
    "clip-l": TextPreset("openai/clip-vit-large-patch14", 77, "CLIP ViT-L/14's text tower (Stable Diffusion 1.x)"),
}


@dataclass
class TextFeatures:
    """What `TextEncoder.encode` returns for N captions."""

    tokens: torch.Tensor               # [N, L, D] right-padded, the encoder's dtype; past a caption's length: the
    #                                    model's outputs at padding positions (use `mask`, `trimmed` or `as_batch`)
    mask: torch.Tensor                 # [N, L] bool, True = a real token
    truncated: list[bool] = field(default_factory=list)  # the caption had more than max_length tokens (cut)

    @property
    def lengths(self) -> list[int]:
        return [int(n) for n in self.mask.sum(dim=1).tolist()]

    def trimmed(self, i: int) -> torch.Tensor:
        """[length_i, D]: caption i's features at its true length (no padding)."""
        return self.tokens[i, :self.lengths[i]]

    def as_batch(self, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(text [N, Lmax, D] in `dtype` (default: the encoder's, as stored in a text set), zero past each caption's
        length; mask [N, Lmax] bool), Lmax = the longest caption here: the layout of a training batch's text
        (train.data.Batch.text, text_mask)."""
        dtype = self.tokens.dtype if dtype is None else dtype
        lmax = max(self.lengths, default=0)
        mask = self.mask[:, :lmax]
        text = torch.where(mask[..., None], self.tokens[:, :lmax].to(dtype), torch.zeros((), dtype=dtype,
                                                                                         device=self.tokens.device))
        return text, mask


def pad_batch(rows: Sequence[Any], dim: int, *, out: torch.Tensor | None = None, dtype: torch.dtype = torch.float32
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """The features of several captions, each [length_i, D] (numpy or torch), as a batch in `dtype`: (text [N, Lmax,
    D] zero past each length, mask [N, Lmax] bool). `out`: a [N, Lmax, D] buffer to fill (its dtype is used)."""
    lengths = [int(r.shape[0]) for r in rows]
    lmax = max(lengths, default=0)
    text = out if out is not None else torch.empty((len(rows), lmax, dim), dtype=dtype)
    text.zero_()
    mask = torch.zeros((len(rows), lmax), dtype=torch.bool)
    for i, (r, n) in enumerate(zip(rows, lengths)):
        if n:
            text[i, :n] = torch.as_tensor(r)
            mask[i, :n] = True
    return text, mask


def pad_to(text: torch.Tensor, mask: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch's (text, mask) padded with zeros / False to `length` tokens (a model with a fixed number of text
    tokens, e.g. NanoGen's in-context max_length); refuses a shorter `length` than the batch holds."""
    n, lcur, d = text.shape
    if length < lcur:
        raise ValueError(f"cannot pad {lcur} tokens to {length}")
    if length == lcur:
        return text, mask
    t = torch.zeros((n, length, d), dtype=text.dtype, device=text.device)
    m = torch.zeros((n, length), dtype=torch.bool, device=mask.device)
    t[:, :lcur], m[:, :lcur] = text, mask
    return t, m


class TextEncoder:
    """A frozen text encoder with its tokenizer and settings; `encode(captions)` -> TextFeatures."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any, *, family: str, max_length: int,
                 identity: dict[str, Any]):
        self.model, self.tokenizer, self.family = model.eval().requires_grad_(False), tokenizer, family
        self.max_length = int(max_length)
        self.identity = identity
        self.dim = int(identity["dim"])
        self.dtype = next(model.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def to(self, device: torch.device | str) -> "TextEncoder":
        self.model.to(device)
        return self

    def token_counts(self, captions: Sequence[str]) -> list[int]:
        """Each caption's token count with the special tokens, before truncation."""
        ids = self.tokenizer(list(captions), add_special_tokens=True, truncation=False)["input_ids"]
        return [len(x) for x in ids]

    @torch.inference_mode()
    def encode(self, captions: Sequence[str]) -> TextFeatures:
        """Features of `captions` (a list of str): tokens [N, max_length, D], mask [N, max_length]."""
        captions = list(captions)
        if not all(isinstance(c, str) for c in captions):
            raise TypeError("captions must be strings")
        if not captions:
            return TextFeatures(torch.zeros((0, self.max_length, self.dim), dtype=self.dtype),
                                torch.zeros((0, self.max_length), dtype=torch.bool), [])
        enc = self.tokenizer(captions, padding="max_length", max_length=self.max_length, truncation=True,
                             return_tensors="pt")
        ids, mask = enc["input_ids"].to(self.device), enc["attention_mask"].to(self.device)
        kwargs = {"use_cache": False} if self.family == DECODER else {}
        out = self.model(input_ids=ids, attention_mask=mask, **kwargs).last_hidden_state
        truncated = [n > self.max_length for n in self.token_counts(captions)]
        return TextFeatures(out, mask.bool(), truncated)

    def null(self) -> TextFeatures:
        """The empty prompt's features (the null condition for caption dropout and guidance, as NanoGen's
        `get_null_cond` encodes [""])."""
        return self.encode([""])


def _hub_offline_reason() -> str | None:
    from dit_pipeline.common.vae import _hub_offline_reason as reason

    return reason()


def _family(config: Any, where: str) -> str:
    kind = str(getattr(config, "model_type", ""))
    if kind in _T5_TYPES:
        return T5
    if kind in _CLIP_TYPES:
        return CLIP
    if getattr(config, "is_encoder_decoder", False):
        raise UserError(f"--text-encoder {where}: an encoder-decoder model of type {kind!r}; the supported ones are "
                        f"T5 ({', '.join(_T5_TYPES)}), CLIP text towers and decoder-only language models")
    return DECODER


def _files_sha256(folder: Path, names: Sequence[str] | None, suffixes: Sequence[str] = ()) -> str | None:
    """sha256 over (name, sha256) of the files of `folder` that are named in `names` or end in `suffixes`."""
    from dit_pipeline.common.io import sha256_file

    picked = sorted(p for p in folder.iterdir() if p.is_file()
                    and ((names is not None and p.name in names) or p.name.endswith(tuple(suffixes))))
    if not picked:
        return None
    h = hashlib.sha256()
    for p in picked:
        h.update(f"{p.name}\t{sha256_file(p)}\n".encode())
    return h.hexdigest()


def _dtype_kwargs(dtype: torch.dtype | str | None) -> dict[str, Any]:
    """from_pretrained's dtype argument: "auto" (the checkpoint's dtype; transformers 5's default) unless given.
    transformers before 4.56 calls it torch_dtype."""
    import transformers

    value: Any = "auto" if dtype is None else (DTYPES[dtype] if isinstance(dtype, str) else dtype)
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    return {"dtype": value} if (major, minor) >= (4, 56) else {"torch_dtype": value}


def resolve_spec(spec: str) -> tuple[str, str | None, int | None]:
    """(source: hub id or absolute folder, preset name or None, the preset's max length or None)."""
    if spec in PRESETS:
        p = PRESETS[spec]
        return p.source, spec, p.max_length
    path = Path(spec).expanduser()
    if path.exists():
        if not path.is_dir():
            raise UserError(f"--text-encoder {spec}: a file; pass a folder saved with save_pretrained (model and "
                            f"tokenizer), a hub id or one of {', '.join(PRESETS)}")
        return str(path.resolve()), None, None
    return spec, None, None


def _load(source: str, family_hint: str | None, revision: str | None, dtype: Any, local: bool) -> tuple[Any, Any, str]:
    from transformers import AutoConfig, AutoModel, AutoTokenizer, CLIPTextModel, T5EncoderModel

    kw: dict[str, Any] = {"revision": revision} if revision else {}
    if local:
        kw["local_files_only"] = True
    config = AutoConfig.from_pretrained(source, **kw)
    family = _family(config, source)
    cls = {T5: T5EncoderModel, CLIP: CLIPTextModel, DECODER: AutoModel}[family]
    model = cls.from_pretrained(source, **kw, **_dtype_kwargs(dtype))
    tokenizer = AutoTokenizer.from_pretrained(source, **kw)
    return model, tokenizer, family


def load_text_encoder(spec: str, *, max_length: int | None = None, device: torch.device | str = "cpu",
                      dtype: torch.dtype | str | None = None, revision: str | None = None) -> TextEncoder:
    """The text encoder `spec` names (a preset, a hub id, a local folder); UserError for anything unusable.

    max_length: tokens per caption (default: the preset's, else the tokenizer's model_max_length when it is a
    real limit, else a CLIP tower's positions, else 256). dtype: the model's (default: the checkpoint's, transformers' "auto")."""
    source, preset, preset_len = resolve_spec(spec)
    is_local = Path(source).is_dir()
    offline = None if is_local else _hub_offline_reason()
    for name in ("transformers", "huggingface_hub"):
        logging.getLogger(name).setLevel(logging.ERROR)  # its "sequence longer than max length" etc.: counted here
    try:
        model, tokenizer, family = _load(source, None, revision, dtype, local=offline is not None)
    except (OSError, ValueError, KeyError) as e:
        if is_local:
            raise UserError(f"--text-encoder {spec}: cannot load a model and tokenizer from {source} ({e}); save "
                            "both there with save_pretrained") from None
        why = f"the hub was not asked ({offline})" if offline else f"{type(e).__name__}: {e}"
        raise UserError(f"--text-encoder {spec}: {source} is not a local folder and could not be loaded from the "
                        f"Hugging Face cache or hub; {why}. Pass a local folder saved with save_pretrained, or fill "
                        f"the cache where there is a network (huggingface-cli download {source})") from None
    tokenizer.padding_side = "right"
    limit = getattr(model.config, "max_position_embeddings", None)
    length = int(max_length or preset_len or _tokenizer_limit(tokenizer) or (limit if family == CLIP else 0) or 256)
    if family == CLIP and limit is not None and length > int(limit):
        raise UserError(f"--text-max-length {length}: {spec} has {limit} positions; use at most {limit}")
    if tokenizer.pad_token is None:
        raise UserError(f"--text-encoder {spec}: its tokenizer has no pad token; padding to max_length needs one")
    model.to(device)
    identity = _identity(spec, source, preset, family, model, tokenizer, length, revision, is_local)
    return TextEncoder(model, tokenizer, family=family, max_length=length, identity=identity)


def _tokenizer_limit(tokenizer: Any) -> int | None:
    n = getattr(tokenizer, "model_max_length", None)
    return int(n) if isinstance(n, int) and 0 < n < 100_000 else None


def _identity(spec: str, source: str, preset: str | None, family: str, model: Any, tokenizer: Any,
              max_length: int, revision: str | None, is_local: bool) -> dict[str, Any]:
    """The record in manifests and checkpoints: `load_text_encoder(identity["name"], max_length=...,
    dtype=identity["dtype"])` rebuilds this encoder."""
    empty = tokenizer("", add_special_tokens=True)["input_ids"]
    folder = Path(source) if is_local else None
    dtype = next(model.parameters()).dtype
    return {
        "kind": "text", "name": preset or source, "source": source, "preset": preset, "family": family,
        "class": type(model).__name__, "model_type": str(getattr(model.config, "model_type", "")),
        "revision": revision or getattr(model.config, "_commit_hash", None),
        "weights_sha256": _files_sha256(folder, None, _WEIGHT_SUFFIXES) if folder else None,
        "max_length": max_length, "hidden_state": HIDDEN_STATE[family], "dim": int(model.config.hidden_size),
        "dtype": str(dtype).removeprefix("torch."),
        "tokenizer": {
            "class": type(tokenizer).__name__, "padding": "max_length", "padding_side": "right", "truncation": True,
            "add_special_tokens": True, "empty_prompt_ids": [int(i) for i in empty],
            "pad_token": tokenizer.pad_token, "vocab_size": len(tokenizer),
            "files_sha256": _files_sha256(folder, _TOKENIZER_FILES) if folder else None,
        },
        "attention_mask": "passed to the model; True = a real token",
    }


def identity_problems(recorded: dict[str, Any], encoder: TextEncoder) -> list[str]:
    """How `encoder` differs from a recorded identity in what decides the features (empty: the same)."""
    keys = ("family", "class", "max_length", "hidden_state", "dim", "dtype", "weights_sha256")
    out = [f"{k}: {recorded.get(k)!r} recorded, {encoder.identity.get(k)!r} now" for k in keys
           if recorded.get(k) != encoder.identity.get(k)]
    for k in ("class", "empty_prompt_ids", "vocab_size", "files_sha256"):
        a, b = (recorded.get("tokenizer") or {}).get(k), encoder.identity["tokenizer"].get(k)
        if a != b:
            out.append(f"tokenizer {k}: {a!r} recorded, {b!r} now")
    return out


def from_identity(identity: dict[str, Any], *, device: torch.device | str = "cpu", where: str = "the text set"
                  ) -> TextEncoder:
    """The encoder a recorded identity names (a text set's `Manifest.text_encoder`, a checkpoint's record), with
    its max length and dtype, for online encoding that must match cached features; UserError listing every
    difference when what loads is not that encoder (other weights, tokenizer, width, dtype...)."""
    enc = load_text_encoder(identity["name"], max_length=int(identity["max_length"]), device=device,
                            dtype=identity.get("dtype"), revision=identity.get("revision") if not identity.get(
                                "weights_sha256") else None)
    problems = identity_problems(identity, enc)
    if problems:
        raise UserError(f"the text encoder of {where} ({identity['name']}) loads as another encoder now: "
                        + "; ".join(problems) + ". Encode with the recorded one, or extract the text set again")
    return enc


__all__ = ["PRESETS", "TextEncoder", "TextFeatures", "TextPreset", "from_identity", "identity_problems",
           "load_text_encoder", "pad_batch", "pad_to", "resolve_spec"]
