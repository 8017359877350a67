"""`dit-eval`: FID, sFID, Inception Score, precision and recall as the ADM evaluator reports them, the published
protocols' numbers, text-to-image scores, and `--make-ref` (a reference batch from a folder of images). The command's
options map onto `EvalConfig` (evaluate/config.py) and `evaluate.main` runs it; the shared command behaviour is
cli_kit.py's. The console script points at cli.py, which imports `eval_main` from here.
"""
from __future__ import annotations

from typing import Any

import click

from dit_pipeline.cli_kit import (DashCommand, debug_option, default, exit_after_distributed_run, handle_errors,
                                  version_option)
from dit_pipeline.evaluate.config import EvalConfig


@click.command("dit-eval", cls=DashCommand, context_settings={"help_option_names": ["-h", "--help"]})
@version_option
@click.argument("samples", required=False)
@click.option("--ref", default=None, help="Reference: the ADM reference batch (e.g. VIRTUAL_imagenet256_labeled.npz;"
              " its precomputed statistics are used), an .npz of images, a folder of images or a statistics file.")
@click.option("--make-ref", default=None, metavar="FOLDER",
              help="Instead of evaluating: build a reference batch from the images under FOLDER (ADM's center crop "
              "to --image-size) with their Inception statistics, written to --out REF.npz.")
@click.option("--captions", default=None, metavar="FILE",
              help="--make-ref: a captioned reference (COCO-30k / MJHQ-30k style): the images under FOLDER that have a "
              "caption in FILE (JSONL, CSV, JSON: COCO captions or MJHQ meta_data.json), one caption each, written "
              "beside --out as REF.prompts.jsonl for dit-sample --prompts and dit-eval --prompts.")
@click.option("--crop", type=click.Choice(("adm", "resize")), default="adm", show_default=True,
              help="--make-ref: ADM's center crop, or resize + center crop (torchvision's, as NanoGen cuts its T2I "
              "evaluation images).")
@click.option("--caption-seed", type=int, default=0, show_default=True,
              help="--make-ref --captions: the seed that picks one caption of an image that has several.")
@click.option("--image-size", type=click.IntRange(min=8), default=None, help="--make-ref: the side of the crops.")
@click.option("--out", default=None, metavar="REF.npz", help="--make-ref: the reference batch to write.")
@click.option("--json", "json_path", default=None, help="Where to write the metrics as JSON [SAMPLES.eval.json].")
@click.option("--inception", default=None, metavar="PATH",
              help="Local weights-inception-2015-12-05-6726825d.pth [torch hub cache, fetched once].")
@click.option("--batch-size", type=int, default=default(EvalConfig, "batch_size"), show_default=True,
              help="Images per Inception forward, per process.")
@click.option("--cache/--no-cache", default=default(EvalConfig, "cache"), show_default=True,
              help="Keep features beside each input (keyed by its content hash and the extractor).")
@click.option("--device", default=None, help="Device (default: this rank's GPU, else the CPU).")
@click.option("--quiet", is_flag=True, default=False)
@click.option("--input-size", type=int, default=default(EvalConfig, "input_size"), show_default=True,
              help="Inception input resolution; other than 299 only for a trial with --random-inception.")
@click.option("--random-inception", type=int, default=None, metavar="SEED",
              help="Random Inception weights from SEED instead of the weights file: the whole evaluation runs "
              "offline, but its numbers mean nothing (a smoke test).")
@click.option("--fd-dinov2", is_flag=True, default=False,
              help="Also FD_DINOv2 (EDM2): the Frechet distance of DINOv2 ViT-L/14 features.")
@click.option("--dinov2", default=None, metavar="PATH",
              help="DINOv2 ViT-L/14 weights (Meta's dinov2_vitl14_pretrain.pth or timm's .safetensors) "
              "[torch hub cache, fetched once].")
@click.option("--dinov2-resize", type=click.Choice(("torch", "pil")), default="torch", show_default=True,
              help="The 224 px resize of FD_DINOv2: torch (F.interpolate, antialiased; fast) or pil (dgm-eval's "
              "exact reference; BENCHMARKS.md: how far apart).")
@click.option("--protocol", default=default(EvalConfig, "protocol"), show_default=True, metavar="NAME[,NAME]",
              help="The published evaluation protocol(s) to compute (docs/evaluation.md): adm (the ADM evaluator), "
              "nanogen (NanoGen: torch-fidelity's inception-v3-compat, the 'fidelity' extra), imf (iMF's), "
              "comma-separated, or all. Each protocol's numbers are printed under its name.")
@click.option("--t2i", "t2i", multiple=True, metavar="NAME",
              help="Text-to-image evaluator(s), repeatable: clip-score, geneval, dpg-bench, vqascore (without "
              "--ref: only these). The samples need their prompts (--prompts, or dit-sample's record).")
@click.option("--prompts", default=None, metavar="FILE",
              help="--t2i: one prompt per sample in the samples' order (JSONL with \"prompt\", JSON, or text lines) "
              "[the prompts dit-sample recorded with the samples].")
@click.option("--clip", default=default(EvalConfig, "clip"), show_default=True, metavar="ID|FOLDER",
              help="--t2i clip-score and geneval: the CLIP model (hub id or save_pretrained folder).")
@click.option("--detector", default=default(EvalConfig, "detector"), show_default=True, metavar="ID|FOLDER",
              help="--t2i geneval: the Mask2Former instance-segmentation model.")
@click.option("--geneval-metadata", default=None, metavar="FILE",
              help="--t2i geneval: GenEval's metadata (evaluation_metadata.jsonl or NanoGen's metadata.json), "
              "looked up by prompt for prompts recorded without it.")
@click.option("--vqa-model", default=default(EvalConfig, "vqa_model"), show_default=True,
              help="--t2i vqascore: the t2v_metrics model name.")
@debug_option
@handle_errors
def eval_main(json_path: str | None, debug: bool, make_ref: str | None, image_size: int | None, out: str | None,
              captions: str | None, crop: str, caption_seed: int, **options: Any) -> None:
    """FID, sFID, Inception Score, precision and recall of SAMPLES against --ref, as the ADM evaluator
    (guided-diffusion evaluations/evaluator.py) defines them; text-to-image scores with --t2i (CLIP score,
    GenEval, DPG-Bench, VQAScore as NanoGen computes them). SAMPLES: an .npz (arr_0 uint8 [N,H,W,3]), a
    folder of images, or a features file. Runs under torchrun across GPUs.

    \b
    Examples:
      dit-eval samples/dit-xl2-256-cfg1.5.npz --ref VIRTUAL_imagenet256_labeled.npz
      torchrun --nproc-per-node 8 $(which dit-eval) samples.npz --ref VIRTUAL_imagenet256_labeled.npz
      dit-eval --make-ref data/val --image-size 256 --out val256.npz
      dit-eval --make-ref coco/val2014 --captions coco30k.jsonl --image-size 256 --out coco30k-256.npz
      dit-eval samples.npz --ref coco30k-256.npz --t2i clip-score --prompts coco30k-256.prompts.jsonl
    """
    from dit_pipeline import evaluate

    if make_ref is not None:
        _make_ref(make_ref, image_size, out, options, captions=captions, crop=crop, seed=caption_seed)
        return
    if options["samples"] is None:
        raise click.UsageError("Missing argument 'SAMPLES'.")
    if options["ref"] is None and not options["t2i"]:
        raise click.UsageError("Missing option '--ref' (or --t2i NAME for text-to-image scores only).")
    if image_size is not None or out is not None or captions is not None:
        raise click.UsageError("--image-size, --out and --captions belong to --make-ref")
    options["t2i"] = tuple(options["t2i"])
    evaluate.main(EvalConfig(json=json_path, **options))
    if options["t2i"]:  # transformers' and tokenizers' libraries loaded: see exit_after_distributed_run
        exit_after_distributed_run()


def _make_ref(folder: str, image_size: int | None, out: str | None, options: dict[str, Any], *,
              captions: str | None = None, crop: str = "adm", seed: int = 0) -> None:
    """`dit-eval --make-ref FOLDER [--captions FILE] --image-size N --out REF.npz` (extract/reference.py,
    evaluate/reference.py)."""
    from dit_pipeline.common.log import setup_logging
    from dit_pipeline.evaluate.reference import check_output, prompts_path, write_reference
    from dit_pipeline.extract.reference import captioned_reference, reference_images

    if options["samples"] is not None or options["ref"] is not None or options["t2i"]:
        raise click.UsageError("--make-ref builds a reference batch; it takes no SAMPLES, --ref or --t2i")
    if image_size is None or out is None:
        raise click.UsageError("--make-ref needs --image-size N (the crops' side) and --out REF.npz")
    if options["protocol"] != "adm":
        raise click.UsageError("--make-ref writes the ADM evaluator's statistics (protocol adm); drop --protocol")
    log = setup_logging(None, quiet=options["quiet"])
    path = check_output(out, captioned=captions is not None)
    records, extra = None, ""
    if captions is not None:
        ref = captioned_reference(folder, captions, image_size, crop=crop, seed=seed, quiet=options["quiet"])
        images, records, skipped = ref.images, ref.records, ref.skipped
        extra = f", {ref.uncaptioned} without a caption left out" if ref.uncaptioned else ""
    else:
        images, _, skipped = reference_images(folder, image_size, crop=crop, quiet=options["quiet"])
    for rel, why in skipped:
        log.warning("skipped %s: %s", rel, why)
    done = write_reference(images, path, inception=options["inception"], batch_size=options["batch_size"],
                           device=options["device"] or ("cuda" if _cuda_available() else "cpu"),
                           random_seed=options["random_inception"], input_size=options["input_size"],
                           quiet=options["quiet"], log=log, records=records)
    click.echo(f"wrote {path}: {len(images)} images of {image_size}x{image_size}"
               + (f" ({len(skipped)} skipped, named in the log{extra})" if skipped else f" ({extra[2:]})" if extra
                  else "")
               + f" and their Inception statistics ({done['extractor']['weights']}), {done['bytes'] / 2**20:.1f} MiB")
    if records is not None:
        click.echo(f"wrote {prompts_path(path)}: their {len(records)} captions, one per image (dit-sample --prompts)")


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()
