"""`ExtractConfig`: every setting of `dit-extract`, validated in one place (docs/ARCHITECTURE.md conventions).

`validate()` reports all problems at once as a `ConfigError` (the CLI turns it into exit 2). Settings that
are resolved at run time ("auto" precision, batch size, workers, samples per shard) are resolved by the
`resolve_*` helpers so tests and the benchmark pick the same values as the command.
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any

import torch

from dit_pipeline.common.pixels import is_pixel_space
from dit_pipeline.common.determinism import DEFAULT_CPU_THREADS
from dit_pipeline.common.errors import collect
from dit_pipeline.common.features import FORMULAS
from dit_pipeline.common.vae import DEFAULT_VAE
from dit_pipeline.common.precision import PRECISIONS_AUTO as PRECISIONS
from dit_pipeline.shards.pixels import ENCODING as PIXELS_ENCODING, ENCODINGS as PIXELS_ENCODINGS
from dit_pipeline.shards.pixels import MAX_SIDE as PIXELS_MAX_SIDE

# "pixels": --encoder pixels only (no arrays: the crop is the latent); "mode": the posterior's mean as the one
# stored latent (NanoGen's sample_mode "mode"), a set of store "sample" whose extraction record says "mode"
STORES = ("posterior", "sample", "mode", "pixels")
DTYPES = ("float16", "float32", "bfloat16", "uint8")
TEXT_DTYPES = ("auto", "float16", "bfloat16", "float32")
# Measured (BENCHMARKS.md, "Extraction"): fp16 autocast is ~8x closer to fp32 than bf16 on the SD-VAE
# encoder and runs at the same tensor-core rate on A100/H100/H200, so it is the GPU default. A batch that
# comes out non-finite under fp16 is re-encoded in fp32 (see encode.py), so overflow cannot corrupt a shard.
GPU_DEFAULT_PRECISION = "fp16"
GPU_DEFAULT_BATCH = 64
CPU_DEFAULT_BATCH = 4
MAX_AUTO_WORKERS = 16


@dataclass(kw_only=True)
class ExtractConfig:
    data_path: str
    out: str
    vae: str = DEFAULT_VAE
    vae_config: str | None = None          # folder with the diffusers config, for a single-file --vae
    vae_revision: str | None = None
    latent_stats: str | None = None        # per-channel mean/std file (LightningDiT's latents_stats.pt, .json, ...)
    encoder: str | None = None             # a feature encoder instead of the VAE (common/features.py: dinov2-b-reg, ...)
    encoder_weights: str | None = None     # offline weights for --encoder (a timm state_dict file)
    encoder_layers: int | None = None      # sum of the last K blocks' tokens (DINOv3, RAEv2: 7); None: the preset's
    encoder_formula: str = "rae"           # "rae" (RAE's latents), "repa" (REPA's teacher tokens, for --repa FOLDER) or
    #                                        "reg" (NanoGen's REG class token, for dit-train --reg-tokens FOLDER)
    image_size: int = 256
    flip: bool = True                      # also encode the horizontal mirror (views = 2)
    store: str = "posterior"               # "posterior" (mean + std) or "sample" (one posterior sample)
    dtype: str = "float16"                 # storage dtype of the arrays in the shards
    precision: str = "auto"                # encoder autocast: fp32 on CPU, GPU_DEFAULT_PRECISION on GPU
    batch_size: int | None = None          # images per encoder call (each gives `views` encodes)
    compile: bool = False                  # torch.compile the VAE encoder in place (static shapes)
    num_workers: int | None = None         # DataLoader decode/crop processes per rank
    samples_per_shard: int | None = None   # None: shards of about plan.TARGET_SHARD_BYTES
    limit: int | None = None               # only the first N images of the sorted list
    seed: int = 0                          # posterior-sample noise for --store sample
    pixels: bool = False                   # also store each crop as the VAE saw it (shards' pixels field, REPA)
    pixel_encoding: str = PIXELS_ENCODING  # how: lossless WebP, or "npy-uint8" (shards/pixels.py)
    cpu_threads: int = DEFAULT_CPU_THREADS  # intra-op threads of the encoder on CPU (common/determinism.py)
    strict: bool = False                   # an unusable image is an error instead of a skip
    keep_empty_classes: bool = False       # a class folder without images keeps its label (else refused)
    allow_split_names: bool = False        # class folders named train/val/... are accepted (else refused)
    overwrite: bool = False                # replace a shard set made with another config
    quiet: bool = False
    # Captions (issue 37, extract/captions.py): a mapping file (.jsonl, .json, .csv, .tsv) or "sidecar" (a caption
    # file beside each image; a WebDataset tar's .txt/.json members); the keys/columns that hold captions.
    captions: str | None = None
    caption_keys: str = "caption,captions"
    # Text features (extract/text.py): with --text-encoder, --data-path is a shard set with captions and --out
    # becomes its text sibling set (the captions' features at their true lengths).
    text_encoder: str | None = None
    text_max_length: int | None = None     # tokens per caption (default: the encoder's preset, e.g. 256 for Qwen3)
    text_dtype: str = "auto"               # storage of the features: auto = the encoder's 16-bit dtype, else float16
    text_revision: str | None = None       # hub revision of --text-encoder
    # A class-labelled set's captions for --text-encoder (issue 46): the template filled with each sample's class
    # name (T2I-ImageNet's "a photo of a {name}"), the names from the manifest or a file (shards.text.read_class_names)
    caption_template: str | None = None
    class_names: str | None = None

    def __post_init__(self) -> None:
        if is_pixel_space(self.encoder):  # pixels as the latent space (common/pixels.py): the crops are the store
            self.store, self.dtype, self.pixels = "pixels", "uint8", True
        elif self.encoder and self.store == "posterior":
            self.store = "sample"  # features are deterministic, without a posterior: stored as the latent

    def validate(self) -> "ExtractConfig":
        p: list[str] = []
        if not self.data_path:
            p.append("--data-path is required: the folder with one sub-folder per class (e.g. imagenet/train)")
        if not self.out:
            p.append("--out is required: the folder to write the shards to")
        if not isinstance(self.image_size, int) or self.image_size < 8 or self.image_size % 8:
            p.append(f"--image-size must be a positive multiple of 8 (e.g. 256 or 512), got {self.image_size}")
        if self.store not in STORES:
            p.append(f"--store must be one of {', '.join(STORES)}, got {self.store!r}")
        elif (self.store == "pixels") != is_pixel_space(self.encoder):
            p.append("--store pixels is the store of a pixel-space set: pass --encoder pixels (and no --store)")
        if self.dtype not in DTYPES:
            p.append(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        elif (self.dtype == "uint8") != (self.store == "pixels"):
            p.append("--dtype uint8 is the dtype of a pixel-space set (--encoder pixels); latents are stored as "
                     "float16, float32 or bfloat16")
        if is_pixel_space(self.encoder) and (self.encoder_weights or self.encoder_layers is not None):
            p.append("--encoder pixels has no weights or layers; drop --encoder-weights and --encoder-layers")
        if self.precision not in PRECISIONS:
            p.append(f"--precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        for name in ("batch_size", "samples_per_shard", "limit"):
            v = getattr(self, name)
            if v is not None and v < 1:
                p.append(f"--{name.replace('_', '-')} must be >= 1, got {v}")
        if self.num_workers is not None and self.num_workers < 0:
            p.append(f"--num-workers must be >= 0 (0 decodes in the main process), got {self.num_workers}")
        if self.encoder_layers is not None and self.encoder_layers < 1:
            p.append(f"--encoder-layers must be >= 1, got {self.encoder_layers}")
        if self.encoder_formula not in FORMULAS:
            p.append(f"--encoder-formula must be one of {', '.join(FORMULAS)}, got {self.encoder_formula!r}")
        if (self.encoder_weights or self.encoder_layers is not None) and not self.encoder:
            p.append("--encoder-weights and --encoder-layers need --encoder (a feature encoder, e.g. dinov2-b-reg)")
        if self.seed < 0:
            p.append(f"--seed must be >= 0, got {self.seed}")
        if self.cpu_threads < 1:
            p.append(f"--cpu-threads must be >= 1, got {self.cpu_threads}")
        p.extend(self._text_problems())
        if self.pixel_encoding not in PIXELS_ENCODINGS:
            p.append(f"--pixel-encoding must be one of {', '.join(PIXELS_ENCODINGS)}, got {self.pixel_encoding!r}")
        elif self.pixel_encoding != PIXELS_ENCODING and not self.pixels:
            p.append(f"--pixel-encoding {self.pixel_encoding} says how the crops are stored: add --pixels (or "
                     "--encoder pixels)")
        if self.pixels and self.pixel_encoding == PIXELS_ENCODING and isinstance(self.image_size, int) and \
                self.image_size > PIXELS_MAX_SIDE:
            p.append(f"--pixels stores lossless WebP, whose sides are at most {PIXELS_MAX_SIDE} pixels; "
                     f"--image-size is {self.image_size}")
        collect(p, "dit-extract options")
        return self

    def _text_problems(self) -> list[str]:
        p: list[str] = []
        if self.captions is not None and not str(self.captions).strip():
            p.append("--captions needs a mapping file (.jsonl, .json, .csv, .tsv) or 'sidecar'")
        if not [k for k in self.caption_keys.split(",") if k.strip()]:
            p.append("--caption-keys needs at least one key, e.g. caption or long_caption,short_caption")
        if self.text_dtype not in TEXT_DTYPES:
            p.append(f"--text-dtype must be one of {', '.join(TEXT_DTYPES)}, got {self.text_dtype!r}")
        if self.text_max_length is not None and self.text_max_length < 1:
            p.append(f"--text-max-length must be >= 1, got {self.text_max_length}")
        if (self.text_max_length is not None or self.text_revision) and not self.text_encoder:
            p.append("--text-max-length and --text-revision need --text-encoder")
        if (self.caption_template is not None or self.class_names is not None) and not self.text_encoder:
            p.append("--caption-template and --class-names make a class-labelled set's captions for --text-encoder: "
                     "add --text-encoder NAME")
        if self.caption_template is not None and "{name}" not in self.caption_template:
            p.append(f"--caption-template must contain {{name}} (the class name), got {self.caption_template!r}")
        if self.class_names is not None and self.caption_template is None:
            p.append("--class-names fill --caption-template: add --caption-template 'a photo of a {name}'")
        if self.text_encoder:
            given = [flag for flag, on in (("--captions", self.captions is not None), ("--pixels", self.pixels),
                                           ("--encoder", self.encoder is not None),
                                           ("--latent-stats", self.latent_stats is not None),
                                           ("--limit", self.limit is not None),
                                           ("--samples-per-shard", self.samples_per_shard is not None)) if on]
            if given:
                p.append(f"--text-encoder encodes the captions of the shard set in --data-path into a sibling set "
                         f"with its keys and shards; {', '.join(given)} do not apply (drop them)")
        return p

    @property
    def keys(self) -> tuple[str, ...]:
        """--caption-keys as a tuple."""
        return tuple(k.strip() for k in self.caption_keys.split(",") if k.strip())

    @property
    def shard_store(self) -> str:
        """The shards' store: "mode" writes one latent per view, as "sample" does (without noise)."""
        return "sample" if self.store == "mode" else self.store

    @property
    def views(self) -> int:
        return 2 if self.flip else 1

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def resolve_precision(precision: str, device: torch.device) -> str:
    """The concrete autocast precision: "auto" is fp32 on CPU and GPU_DEFAULT_PRECISION on CUDA."""
    if precision != "auto":
        return precision
    return GPU_DEFAULT_PRECISION if device.type == "cuda" else "fp32"


def resolve_batch_size(batch_size: int | None, device: torch.device) -> int:
    if batch_size is not None:
        return batch_size
    return GPU_DEFAULT_BATCH if device.type == "cuda" else CPU_DEFAULT_BATCH


def resolve_num_workers(num_workers: int | None, local_world_size: int = 1) -> int:
    """Explicit value, or the CPUs this rank may use (its share of the node, one left for the main process)."""
    if num_workers is not None:
        return num_workers
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(MAX_AUTO_WORKERS, cpus // max(1, local_world_size) - 1))
