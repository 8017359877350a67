"""Command-line entry points: dit-extract, dit-train, dit-shards, dit-sample, dit-eval.

Thin by design: each command maps its click options onto one config dataclass and calls one function. The
behaviour they share (underscore aliases, reference-DiT habits, one-line errors, `--version`, options built
from config fields and listed by section) is cli_kit.py's. A command with many options of its own has a module of
its own (dit-sample: cli_sample.py, dit-eval: cli_eval.py); the console scripts all point here (pyproject.toml).
"""
from __future__ import annotations

import os
import sys
from typing import Any

if os.path.basename(sys.argv[0]) == "dit-train":
    # dit-train handles SIGTERM/SIGUSR1/Ctrl-C from here on (train/signals.py adopts what arrives meanwhile):
    # the imports below take seconds on a loaded node, and a scheduler's signal then must not kill it.
    from dit_pipeline.common import early_signals

    early_signals.install()

import click  # noqa: E402

from dit_pipeline.shards.pixels import ENCODINGS as PIXEL_ENCODINGS
from dit_pipeline.cli_kit import (CONTEXT, DashCommand, DashGroup, GroupedCommand, config_options,  # noqa: E402,F401
                                  debug_option, default, handle_errors,
                                  version_option)
from dit_pipeline.common.precision import PRECISIONS_AUTO
from dit_pipeline.cli_eval import eval_main  # noqa: F401 (the dit-eval console script)
from dit_pipeline.cli_sample import sample_main  # noqa: F401 (the dit-sample console script)
from dit_pipeline.extract.config import (CPU_DEFAULT_BATCH, DTYPES, GPU_DEFAULT_BATCH, MAX_AUTO_WORKERS, STORES,
                                         TEXT_DTYPES, ExtractConfig)
from dit_pipeline.train.config import GROUPS as TRAIN_GROUPS
from dit_pipeline.train.config import TrainConfig


# ---------------------------------------------------------------------------------------------------------
# dit-extract (extract/): images -> SD-VAE latents -> verified shards
# ---------------------------------------------------------------------------------------------------------

@click.command("dit-extract", cls=DashCommand, context_settings=CONTEXT)
@version_option
@click.option("--data-path", required=True, help="ImageFolder tree: one sub-folder per class (e.g. imagenet/train); "
              "with --captions also a flat image folder or a folder of WebDataset tars (image + .txt/.json); with "
              "--text-encoder a shard set with captions.")
@click.option("--out", required=True, help="Folder for the shards, manifest.json and logs/ (rerun to resume).")
@click.option("--captions", default=None, metavar="FILE|sidecar",
              help="Store each image's captions: a JSONL/JSON/CSV/TSV file mapping image paths (relative to "
              "--data-path) to one or more captions, or 'sidecar' (a .txt/.json beside each image; a WebDataset "
              "tar's .txt/.json members). Format version 4; docs/text-to-image.md.")
@click.option("--caption-keys", default=default(ExtractConfig, "caption_keys"), show_default=True,
              help="The JSON keys / CSV columns that hold captions (a string or a list each), in order, e.g. "
              "long_caption,short_caption (all kept, one drawn per sample and epoch at training time).")
@click.option("--text-encoder", default=None, metavar="NAME|FOLDER",
              help="Encode the captions of the shard set in --data-path into a text sibling set in --out: "
              "qwen3-0.6b (NanoGen's), flan-t5-xl, t5-v1_1-xxl, clip-l, a hub id or a save_pretrained folder.")
@click.option("--text-max-length", type=int, default=None,
              help="Tokens per caption, longer ones truncated and counted [default: the encoder's: 256 for "
              "qwen3-0.6b, 120 for T5, 77 for CLIP].")
@click.option("--text-dtype", type=click.Choice(TEXT_DTYPES), default=default(ExtractConfig, "text_dtype"),
              show_default=True, help="Storage of the text features: auto = the encoder's 16-bit dtype (exact), "
              "else float16 (its error is measured and recorded in the manifest).")
@click.option("--text-revision", default=None, help="Hub revision (branch, tag or commit) of --text-encoder.")
@click.option("--caption-template", default=None, metavar="TEMPLATE",
              help="--text-encoder on a class-labelled set: each sample's caption is TEMPLATE with {name} its class "
              "name, e.g. 'a photo of a {name}' (T2I-ImageNet); docs/data-mix.md.")
@click.option("--class-names", default=None, metavar="FILE",
              help="The names --caption-template fills: one per line in label order, or JSON (a list, or an object "
              "keyed by the class folder names) [default: the manifest's class names].")
@click.option("--vae", default=default(ExtractConfig, "vae"), show_default=True,
              help="Hub id, local diffusers folder, or single .safetensors/.ckpt file; or one of NanoGen's VAE "
              "latent spaces by its name (flux2, qwen-vae, sd3.5, flux, sdxl-vae, sdvae-ema, e2e-vavae, ...: "
              "docs/latent-spaces.md), loaded and normalized as NanoGen does.")
@click.option("--vae-config", default=None, help="For a single-file --vae: a folder with its diffusers "
              "config.json (default: the built-in SD-VAE config).")
@click.option("--vae-revision", default=None, help="Hub revision (branch, tag or commit) for a hub id.")
@click.option("--encoder", default=None, metavar="NAME|FILE",
              help="A feature encoder instead of the VAE (RAE): dinov2-b-reg (RAE's DINOv2-B with registers), "
              "dinov2-b, dinov3-l (RAEv2), NanoGen's encoders (dinov2-vit-b, dinov3-vit-b16, siglip2-vit-b, "
              "pe-vit-l, langpe-vit-l, spatialpe-vit-l: docs/latent-spaces.md), a timm model name, a JSON encoder "
              "file or a weight file; stores its "
              "patch tokens [C, 16, 16] as the latent (docs/feature-spaces.md); or pixels: the crops "
              "themselves are the latents, no VAE (docs/pixel-space.md).")
@click.option("--encoder-weights", default=None, metavar="FILE",
              help="Offline weights (a timm state_dict, or the original DINOv2/DINOv3/PE checkpoint; a "
              "save_pretrained folder for siglip2-vit-b) for --encoder; without it timm downloads them.")
@click.option("--encoder-layers", type=int, default=None, metavar="K",
              help="Sum the last K blocks' patch tokens (each through the affine-free final LayerNorm) "
              "[default: the preset's: 7 for dinov3-l, else 1].")
@click.option("--encoder-formula", type=click.Choice(("rae", "repa", "reg")), default="rae", show_default=True,
              help="rae: RAE's latents (resize, then ImageNet normalization; final LayerNorm without affine); "
              "repa: the tokens REPA's online teacher aligns to (normalize, then resize; affine kept), a sibling set "
              "for dit-train --repa FOLDER; reg: NanoGen's REG target, the class token [C, 1, 1] (normalize, then "
              "resize; final LayerNorm without affine, eps 1e-5), a sibling set for dit-train --use-reg --reg-tokens "
              "FOLDER (--encoder dinov2-vit-b: NanoGen's target_encoder by its name, at its resolution 256).")
@click.option("--latent-stats", default=None, metavar="FILE",
              help="Per-channel mean and std of the VAE's latents (LightningDiT's latents_stats.pt, or .json / "
              ".safetensors with mean and std): model latents become (z - mean) / std per channel; or RAE's stat.pt "
              "(mean and var [C, h, w]): (z - mean) / sqrt(var + 1e-5) per channel and position [default: the "
              "VAE config's latents_mean/latents_std where it has them, else its scaling_factor/shift_factor].")
@click.option("--image-size", type=int, default=default(ExtractConfig, "image_size"), show_default=True,
              help="Crop size (a multiple of the VAE's downsampling factor: 8 for the SD-VAE, 16 or 32 for others).")
@click.option("--flip/--no-flip", default=default(ExtractConfig, "flip"), show_default=True,
              help="Also encode the horizontal mirror of every image (2 views).")
@click.option("--store", type=click.Choice(STORES), default=default(ExtractConfig, "store"), show_default=True,
              help="posterior: mean + std (sample fresh noise every epoch); sample: one fixed posterior sample "
              "(the latent itself for an encoder without a posterior, e.g. DC-AE, which needs --store sample; "
              "always with --encoder); mode: the posterior's mean, the latent NanoGen trains on (half the bytes of "
              "posterior).")
@click.option("--dtype", type=click.Choice(DTYPES), default=default(ExtractConfig, "dtype"), show_default=True,
              help="Storage dtype of the latents in the shards.")
@click.option("--pixels/--no-pixels", default=default(ExtractConfig, "pixels"), show_default=True,
              help="Also store each crop exactly as the VAE encoded it (8-bit RGB, lossless; view 1 is its mirror), "
              "for a teacher that sees the pixels (REPA). Format version 2; see docs/FORMAT.md.")
@click.option("--pixel-encoding", type=click.Choice(PIXEL_ENCODINGS), default=default(ExtractConfig, "pixel_encoding"),
              show_default=True, help="How the crops are stored (--pixels, --encoder pixels): lossless WebP, or "
              "npy-uint8, uncompressed, 1.7x the bytes for 5x the crops a loader core decodes (BENCHMARKS.md).")
@click.option("--precision", type=click.Choice(PRECISIONS_AUTO), default=default(ExtractConfig, "precision"),
              show_default=True, help="Encoder autocast (auto: fp16 on GPU, fp32 on CPU; see BENCHMARKS.md).")
@click.option("--batch-size", type=int, default=None,
              help=f"Images per encoder call [default: {GPU_DEFAULT_BATCH} on GPU, {CPU_DEFAULT_BATCH} on CPU].")
@click.option("--compile/--no-compile", default=default(ExtractConfig, "compile"), show_default=True,
              help="torch.compile the VAE encoder (static shapes; changes last bits, so a folder resumes with a "
              "warning when this differs).")
@click.option("--num-workers", type=int, default=None,
              help="Decode/crop processes per rank [default: this rank's share of the CPUs, at most "
              f"{MAX_AUTO_WORKERS}].")
@click.option("--samples-per-shard", type=int, default=None,
              help="Images per shard [default: shards of about 256 MiB].")
@click.option("--limit", type=int, default=None, help="Only the first N images (a quick trial).")
@click.option("--seed", type=int, default=default(ExtractConfig, "seed"), show_default=True,
              help="Noise seed for --store sample.")
@click.option("--cpu-threads", type=int, default=default(ExtractConfig, "cpu_threads"), show_default=True,
              help="Encoder threads per process on CPU (fixed so the bytes do not depend on the launch).")
@click.option("--strict", is_flag=True, default=False, help="Fail on an unusable image instead of skipping it.")
@click.option("--keep-empty-classes", is_flag=True, default=False,
              help="Keep a class folder without images as a label with no samples (refused by default, as "
              "torchvision's ImageFolder refuses it).")
@click.option("--allow-split-names", is_flag=True, default=False,
              help="Accept class folders named like dataset splits (train, val, test, ...); refused by default, "
              "since --data-path should be the folder of one split.")
@click.option("--overwrite", is_flag=True, default=False,
              help="Replace a shard set in --out made with a different configuration (same config: resumes).")
@click.option("--quiet", is_flag=True, default=False, help="No progress bar or info messages on the console.")
@debug_option
@handle_errors
def extract_main(debug: bool, **options: Any) -> None:
    """Encode an ImageFolder tree with a VAE (the SD-VAE by default) into WebDataset latent shards.

    Runs as one process or under torchrun (any nodes x GPUs); rerunning the same command resumes.

    \b
    Examples:
      dit-extract --data-path imagenet/train --out shards/in1k-256
      torchrun --nproc-per-node 8 $(which dit-extract) --data-path imagenet/train --out shards/in1k-256
      dit-extract --data-path imagenet/train --out /tmp/trial --limit 512    # a quick trial
      dit-extract --data-path imagenet/train --out shards/in1k-cap --captions recaptions.jsonl
      dit-extract --data-path shards/in1k-cap --out shards/in1k-qwen3 --text-encoder qwen3-0.6b
      dit-extract --data-path shards/in1k --out shards/in1k-qwen3-photo --text-encoder qwen3-0.6b \\
          --caption-template 'a photo of a {name}' --class-names imagenet-names.txt
    """
    from dit_pipeline import extract

    extract.main(ExtractConfig(**options))


# ---------------------------------------------------------------------------------------------------------
# dit-shards (shards/): verify | info | stats of a latent shard set
# ---------------------------------------------------------------------------------------------------------

_SHARD_DIR = click.Path(exists=True, file_okay=False, dir_okay=True)
WRITE_MODES = ("per-channel", "scalar", "per-position")  # dit-shards stats --write (shards.stats.computed_normalization)


@click.group(cls=DashGroup, context_settings=CONTEXT, no_args_is_help=True)
@version_option
def shards_main() -> None:
    """Inspect latent shard sets: prove one complete and intact (verify), summarise it (info), and check
    the latent scale and class balance (stats).

    \b
    Examples:
      dit-shards verify shards/in1k-256 --jobs 16
      dit-shards info shards/in1k-256
      dit-shards stats shards/in1k-256 --max-samples 20000
    """


@shards_main.command("verify", context_settings=CONTEXT)
@click.argument("folder", type=_SHARD_DIR)
@click.option("--quick", is_flag=True, default=False,
              help="Sizes and tar structure only, no hashing or decoding (seconds instead of minutes).")
@click.option("--jobs", type=click.IntRange(min=1), default=1, show_default=True,
              help="Shards checked in parallel (processes).")
@click.option("--json", "as_json", is_flag=True, default=False, help="Print the report as JSON on stdout.")
@click.option("--quiet", is_flag=True, default=False, help="No progress bar.")
@debug_option
@handle_errors
def shards_verify_cmd(folder: str, quick: bool, jobs: int, as_json: bool, quiet: bool, debug: bool) -> None:
    """Check every shard in FOLDER against manifest.json: exit 0 if all is well, 1 with a report naming
    each bad shard and its problem.

    \b
    Example:
      dit-shards verify shards/in1k-256 --jobs 16 --json > verify.json
    """
    import json

    from dit_pipeline.shards import verify_shards
    from dit_pipeline.shards.info import format_verify

    report = verify_shards(folder, quick=quick, jobs=jobs, progress=not quiet and not as_json)
    click.echo(json.dumps(report.to_dict(), indent=2) if as_json else format_verify(report))
    sys.exit(0 if report.ok else 1)


@shards_main.command("info", context_settings=CONTEXT)
@click.argument("folder", type=_SHARD_DIR)
@click.option("--json", "as_json", is_flag=True, default=False, help="Print the summary as JSON.")
@debug_option
@handle_errors
def shards_info_cmd(folder: str, as_json: bool, debug: bool) -> None:
    """Summarise the shard set in FOLDER from its manifest (reads no shard).

    \b
    Example:
      dit-shards info shards/in1k-256
    """
    import json

    from dit_pipeline.shards.info import format_info, info_dict

    d = info_dict(folder)
    click.echo(json.dumps(d, indent=2) if as_json else format_info(d))


@shards_main.command("stats", context_settings=CONTEXT)
@click.argument("folder", type=_SHARD_DIR)
@click.option("--max-samples", type=click.IntRange(min=1), default=10_000, show_default=True,
              help="Samples (spread over all shards) used for the latent statistics; labels of all are counted.")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True,
              help="Seed of the posterior noise (store 'posterior').")
@click.option("--write", type=click.Choice(WRITE_MODES), default=None,
              help="Write the statistics as the manifest's next revision (the old one is kept as "
              "manifest.json.revN): per-channel mean/std of the raw latents, one scalar scaling_factor, or "
              "per-position: the exact mean/var per channel and position over every sample and view (RAE's "
              "feature normalization, (z - mean) / sqrt(var + 1e-5); --max-samples does not apply).")
@click.option("--latent-stats", default=None, metavar="FILE",
              help="Write FILE's per-channel mean and std (e.g. LightningDiT's latents_stats.pt), or its mean and var "
              "per channel and position (RAE's stat.pt), as the manifest's next revision instead.")
@click.option("--json", "as_json", is_flag=True, default=False, help="Print the statistics as JSON.")
@debug_option
@handle_errors
def shards_stats_cmd(folder: str, max_samples: int, seed: int, write: str | None, latent_stats: str | None,
                     as_json: bool, debug: bool) -> None:
    """Per-channel mean/std of the model latents (as the manifest normalizes them) and of the raw ones,
    whether their std is near 1 (the DiT assumption) with the scaling factor that would make it 1, and the
    class histogram. --write or --latent-stats record a new normalization (a manifest revision).

    \b
    Examples:
      dit-shards stats shards/in1k-256 --max-samples 20000
      dit-shards stats shards/vavae-256 --write per-channel
      dit-shards stats shards/vavae-256 --latent-stats latents_stats.pt
    """
    import json

    from dit_pipeline.shards.revision import format_revise, revise
    from dit_pipeline.shards.stats import compute_stats, format_stats

    if write and latent_stats:
        raise click.UsageError("--write and --latent-stats both set the normalization; give one of them")
    if write or latent_stats:
        r = revise(folder, mode=write, stats_file=latent_stats, max_samples=max_samples, seed=seed)
        click.echo(json.dumps(r, indent=2) if as_json else format_revise(r))
        return
    s = compute_stats(folder, max_samples=max_samples, seed=seed)
    click.echo(json.dumps(s, indent=2) if as_json else format_stats(s, folder))


# ---------------------------------------------------------------------------------------------------------
# dit-train (train/): latent shards -> checkpoints, with DDP, AMP, EMA and exact crash-safe resume
# ---------------------------------------------------------------------------------------------------------

class TrainCommand(GroupedCommand):
    groups = TRAIN_GROUPS


@click.command("dit-train", cls=TrainCommand, context_settings=CONTEXT)
@version_option
@config_options(TrainConfig)
@click.option("--config", "config_file", default=None,
              help="YAML or JSON file of settings (keys as the flags, dashes or underscores); flags override it.")
@click.option("--nproc-per-node", type=click.IntRange(min=1), default=None,
              help="Launch this many local ranks under torchrun (one per GPU).")
@click.option("--plot", "plot_dir", default=None, metavar="RUN_DIR",
              help="Only plot RUN_DIR/metrics.jsonl to RUN_DIR/loss.png and exit.")
@click.option("--consolidate", "sharded_ckpt", default=None, metavar="CKPT_DIR",
              help="Only write the sharded checkpoint CKPT_DIR (RUN/checkpoints/step-N.dcp of --parallel zero2, fsdp "
                   "or hsdp) as the files a DDP run writes beside it (step-N.pt, step-N-ema.pt and its sidecar), one "
                   "tensor at a time, and exit.")
@debug_option
@handle_errors
@click.pass_context
def train_main(ctx: click.Context, config_file: str | None, nproc_per_node: int | None, plot_dir: str | None,
               sharded_ckpt: str | None, debug: bool, **options: Any) -> None:
    """Train a class-conditional DiT on latent shards (one process, torchrun, or --nproc-per-node N).

    Rerunning the same command resumes from the newest checkpoint; SIGTERM/SIGUSR1 or a first Ctrl-C write
    a checkpoint and exit 0 (a second Ctrl-C aborts).
    
    \b
    Examples:
      dit-train --shards shards/in1k-256 --model DiT-XL/2 --run-dir runs/xl2 --dry-run
      dit-train --nproc-per-node 8 --shards shards/in1k-256 --model DiT-XL/2 --run-dir runs/xl2
      torchrun --nproc-per-node 8 $(which dit-train) --shards shards/in1k-256 --run-dir runs/xl2
      dit-train --plot runs/xl2
      dit-train --consolidate runs/big/checkpoints/step-0100000.dcp
    """
    from click.core import ParameterSource

    from dit_pipeline import train

    if plot_dir is not None:
        click.echo(f"wrote {train.plot_metrics(plot_dir)}")
        return
    if sharded_ckpt is not None:
        from dit_pipeline.train.consolidate import consolidate

        click.echo("wrote " + ", ".join(map(str, consolidate(sharded_ckpt, quiet=bool(options.get("quiet"))))))
        return
    given = {k: v for k, v in options.items()
             if ctx.get_parameter_source(k) in (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT)}
    cfg = train.merge_config(train.load_config_file(config_file) if config_file else {}, given)
    code = train.main(cfg, nproc_per_node=nproc_per_node, argv=sys.argv[1:])
    if code:
        sys.exit(code)


@click.command("dit-report", cls=DashCommand, context_settings={"help_option_names": ["-h", "--help"]})
@version_option
@click.argument("run_dir", metavar="RUN")
@click.option("--out", default=None, metavar="DIR", help="Folder for report.md and report.png [RUN].")
@debug_option
@handle_errors
def report_main(run_dir: str, out: str | None, debug: bool) -> None:
    """One Markdown page and one PNG for a dit-train run folder: config, loss and FID curves, the last evaluation
    (sample count, reference, sampler), throughput and device-hours, the divergence guard, the paper's number.

    \b
    Examples:
      dit-report runs/xl2
    """
    from dit_pipeline.train.report import write_report

    md, png = write_report(run_dir, out)
    click.echo(f"wrote {md} and {png}")
