"""`dit-sample`: `dit-sample [run] --ckpt X ...` samples images (and the ADM evaluator's .npz) from our checkpoints
and the releases' files; `dit-sample export --to diffusers|safetensors OUT ...` writes their weights for other tools.
The options map onto `SampleConfig` / `ExportConfig` (sample/config.py) and `sample.main` / `sample.export_main` run
them; the shared command behaviour is cli_kit.py's. The console script points at cli.py, which imports
`sample_main` from here.
"""
from __future__ import annotations

from typing import Any, Callable

import click

from dit_pipeline.cli_kit import CONTEXT, DashGroup, debug_option, default, handle_errors, version_option
from dit_pipeline.common.precision import PRECISIONS
from dit_pipeline.dit.protocol_fit import PREDICTIONS
from dit_pipeline.dit.protocols import RELEASE_ROWS
from dit_pipeline.sample.config import (CFG_CHANNELS, DIFFUSION_FORMS, EXPORT_TARGETS, FLOW_CONVENTIONS, OBJECTIVES,
                                         SAMPLERS, WEIGHTS, ExportConfig, SampleConfig)
from dit_pipeline.sample.plan import LABEL_SAMPLINGS


class DefaultCommandGroup(DashGroup):
    """A group whose `default_command` runs when the first argument is not a subcommand name,
    so `dit-sample --ckpt X` means `dit-sample run --ckpt X`."""

    default_command = "run"

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if args and args[0] not in self.commands and args[0] not in (*ctx.help_option_names, "--version"):
            args = [self.default_command, *args]
        return super().parse_args(ctx, args)


def _parse_class_labels(ctx: click.Context, param: click.Parameter, value: str | None) -> list[int | str] | None:
    from dit_pipeline.sample.names import parse_class_labels

    return None if value is None else parse_class_labels(value)


def _weights_options(f: Callable) -> Callable:
    for decorator in reversed([
        click.option("--ckpt", default=None, help="DiT weights: our checkpoint (RUN/checkpoints/step-N.pt), an "
                     "EMA-only file, an official release file (DiT-XL-2-256x256.pt), a reference training "
                     "checkpoint, or .safetensors."),
        click.option("--weights", type=click.Choice(WEIGHTS), default=default(SampleConfig, "weights"),
                     show_default=True,
                     help="Which weights of a training checkpoint."),
        click.option("--model", default=None, help="Expected preset (e.g. DiT-XL/2, LightningDiT-XL/1, DDT-XL/2, "
                     "DiT-DH-XL); inferred from the weights, a mismatch is an error. Also tells the loader what a file "
                     "cannot state (DDT's encoder split and patch size)."),
        click.option("--num-heads", type=int, default=None, help="Attention heads of a custom-size file that does "
                     "not state them (no model_config, no QK-norm or RoPE tensors to read them from)."),
        click.option("--input-size", type=int, default=None, help="Latent side of a file that does not state it "
                     "(DDT's: it has no position table), e.g. 32 for 256 px images and an f8 VAE."),
        click.option("--encoder-depth", type=int, default=None, help="DDT's encoder blocks, for a file of a custom "
                     "size that does not state them (no model_config, no sidecar, no preset of its depth and width)."),
        click.option("--vae", "--decoder", "vae", default=None, help="VAE: hub id, local diffusers folder, or single "
                     ".safetensors/.ckpt file, or a NanoGen latent space's name (docs/latent-spaces.md); for a "
                     "feature space RAE's or NanoGen's decoder state_dict FILE[,CONFIG] (docs/feature-spaces.md) [the VAE the checkpoint records (the one its shards were extracted "
                     "with), else stabilityai/sd-vae-ft-ema]."),
        click.option("--vae-config", default=None, help="Diffusers config folder for a single-file --vae "
                     "(default: the built-in SD-VAE config)."),
    ]):
        f = decorator(f)
    return f


@click.group(cls=DefaultCommandGroup, context_settings=CONTEXT, no_args_is_help=True)
@version_option
def sample_main() -> None:
    """Sample images and FID-ready .npz files from DiT checkpoints; export them to diffusers.

    `dit-sample --ckpt X ...` runs the default `run` command (see `dit-sample run --help`); under torchrun
    the ranks split the samples. `dit-sample export --to diffusers OUT --ckpt X` writes a DiTPipeline.
    """


@sample_main.command("run", context_settings=CONTEXT)
@_weights_options
@click.option("--sampler", type=click.Choice(SAMPLERS), default=None,
              help="[from the model's objective: ddpm for ddpm models, euler-maruyama (SiT's SDE) for flow models]")
@click.option("--protocol", default=None, metavar="NAME",
              help=f"Sample as a release does (docs/sampling.md): its time grid, solver, guidance rule "
              "and interval ends, image conversion and FID labels; --steps, --cfg-scale, --guidance-interval, "
              "--time-shift and --labels change its values (recorded), the other sampler flags must agree with it. "
              "A protocol applies to the models its release samples (space, conditioning, objective; NanoGen's "
              "configs also the prediction and latent shape): another model is refused, naming the protocols that "
              f"fit it. One of {', '.join(RELEASE_ROWS)}, or nanogen/CONFIG for each of NanoGen's sampling configs "
              "(docs/nanogen-protocols.md).")
@click.option("--guidance-model", default=None, metavar="FILE",
              help="AutoGuidance's weaker network (--protocol rae-ag; or with --cfg-scale S alone: v_weak + S (v - "
              "v_weak) on every channel), a weight file of the same latents and classes.")
@click.option("--steps", type=int, default=None,
              help="Sampling steps: ddpm/ddim respaced steps; euler/heun integration intervals; euler-maruyama "
              "SiT's and REPA's num_steps (the points of SiT's time grid: steps - 1 SDE steps and the noise-free "
              "last step, so 250 is their 250-step setting); with --protocol the release's own count. Network "
              "evaluations = steps (heun: 2 per step) [the protocol's; else 250, a one-step model's 1].")
@click.option("--objective", type=click.Choice(OBJECTIVES), default=None,
              help="ddpm or flow, for a file that does not record it [recorded; else flow for SiT-* files and REPA's "
              "files, ddpm].")
@click.option("--flow-convention", type=click.Choice(FLOW_CONVENTIONS), default=None,
              help="The flow network's time: sit (t = 0 noise, predicts data - noise: SiT and our models) or repa "
              "(t = 1 noise, predicts noise - data: REPA's checkpoints, sampled at 1 - t with the sign flipped) "
              "[recorded; else repa for files with REPA's projector keys or training args, else sit].")
@click.option("--prediction", type=click.Choice(PREDICTIONS), default=None,
              help="What the network predicts, for a file that does not record it (NanoGen's: x for its JiT and "
              "PixelGen models, velocity for the others; docs/nanogen-checkpoints.md) [recorded; else the --protocol "
              "row's (nanogen/CONFIG); else the file is refused].")
@click.option("--diffusion-form", type=click.Choice(DIFFUSION_FORMS), default=default(SampleConfig, "diffusion_form"),
              show_default=True, help="euler-maruyama: SiT's diffusion coefficient D(t).")
@click.option("--diffusion-norm", type=float, default=default(SampleConfig, "diffusion_norm"), show_default=True,
              help="euler-maruyama: the scale of D(t).")
@click.option("--last-step-size", type=float, default=default(SampleConfig, "last_step_size"), show_default=True,
              help="euler-maruyama: the final noise-free step (SiT's 'Mean' last step).")
@click.option("--time-shift", type=float, default=None,
              help="Flow samplers: shift the time grid by SD3's s (noise level s n / (1 + (s - 1) n)): toward noise "
              "for s > 1, toward data for s < 1; "
              "LightningDiT's timestep_shift a is 1/a (0.3: 3.333); with --protocol it replaces the protocol's "
              "shift (recorded) [the protocol's; else the shift the model was trained with, as its checkpoint "
              "records it; else 1, none].")
@click.option("--latent-stats", default=None, metavar="FILE",
              help="Per-channel latent statistics (mean and std, e.g. LightningDiT's latents_stats.pt) to decode with, "
              "for a checkpoint trained on them that does not hold them.")
@click.option("--encoder-refresh", type=int, default=default(SampleConfig, "encoder_refresh"), show_default=True,
              help="DDT: compute the encoder every K-th network call and reuse its state in between (DDT's encoder "
              "sharing, on a uniform schedule; 1 = every call).")
@click.option("--cfg-scale", type=float, default=None,
              help="Classifier-free guidance scale (1 = none). The published FID-50K 2.27 uses 1.5. [the protocol's; "
              "else 4.0; 1 where guidance cannot act (no null class; MeanFlow, whose guidance is trained in; a "
              "protocol without guidance), where a scale other than 1 is refused; iMF: its omega input]")
@click.option("--cfg-channels", default=default(SampleConfig, "cfg_channels"), show_default=True, metavar="|".join(CFG_CHANNELS) + "|N",
              help="Latent channels classifier-free guidance guides: auto = the first 3 where that reproduces the "
              "reference sampler (a 4-channel DiT/SiT, LightningDiT's release: their published FIDs), all channels "
              "otherwise; all; or N, the first N.")
@click.option("--guidance-interval", type=float, nargs=2, default=None, metavar="LOW HIGH",
              callback=lambda ctx, param, v: None if v is None else list(v),
              help="Guide only where the noise level is in [LOW, HIGH] (ends included), elsewhere run the "
              "conditional model alone. Noise level, 1 = pure noise: flow models 1 - t (SiT's t), which is "
              "REPA's t (REPA's --guidance_high 0.7 is 0 0.7); ddpm/ddim the timestep index / 1000.")
@click.option("--ig-scale", type=float, default=None,
              help="NanoGen's internal guidance: base + S (full - base) from the model's own base head (a model "
              "trained with dit-train --base-model-depth), alone or with --cfg-scale (docs/reg-pixnerd.md) [the "
              "protocol's; else off].")
@click.option("--ig-interval", type=float, nargs=2, default=None, metavar="LOW HIGH",
              callback=lambda ctx, param, v: None if v is None else list(v),
              help="Internal guidance only where the noise level is in [LOW, HIGH] (ends included) [0 1].")
@click.option("--ig-uncond-scale", type=float, default=None,
              help="Internal guidance with --cfg-scale: the scale of the null half [the --ig-scale].")
@click.option("--class-labels", callback=_parse_class_labels, default=None,
              help="Comma-separated class ids or class names (the shard set's class folders, which the "
              "checkpoint records), one sample each; repeated cyclically with --num-samples.")
@click.option("--num-samples", type=int, default=None, help="Number of samples; classes chosen by --labels "
              "unless --class-labels is given.")
@click.option("--prompt", "prompts", multiple=True, callback=lambda ctx, param, v: list(v) if v else None,
              help="A text model's prompt (repeatable); each gets --num-samples / P consecutive samples.")
@click.option("--prompts", "prompts_file", default=None, metavar="FILE",
              help="A text model's prompts: one per line, or JSON Lines with a \"prompt\" (GenEval's metadata).")
@click.option("--text-encoder", default=None, help="A text model's encoder (preset, hub id or folder) [the one "
              "its checkpoint records].")
@click.option("--labels", type=click.Choice(LABEL_SAMPLINGS), default=None,
              help="Classes of --num-samples: 'uniform' draws each (DiT's FID sampler), "
              "'equal' gives every class N / C samples, counts differing by at most 1 (50 per class for 50,000 of "
              "ImageNet, as newer papers evaluate) [the protocol's; else uniform].")
@click.option("--seed", type=int, default=default(SampleConfig, "seed"), show_default=True)
@click.option("--batch-size", type=int, default=default(SampleConfig, "batch_size"), show_default=True,
              help="Images per process and batch.")
@click.option("--cpu-threads", type=int, default=default(SampleConfig, "cpu_threads"), show_default=True,
              help="Sampling threads per process on CPU (fixed so the pixels do not depend on the launch).")
@click.option("--npz", default=None, help="Write the ADM evaluator's .npz (arr_0 uint8 [N,H,W,3], arr_1 labels).")
@click.option("--out", default=None, help="Folder for grid.png (labelled), samples.json and logs.")
@click.option("--save-images", is_flag=True, default=False, help="Also write one PNG per sample to OUT/images/.")
@click.option("--grid-max", type=int, default=default(SampleConfig, "grid_max"), show_default=True,
              help="At most this many samples in "
              "grid.png (0: no grid).")
@click.option("--grid-cols", type=int, default=None, help="Grid columns (default: square).")
@click.option("--precision", type=click.Choice(PRECISIONS), default=default(SampleConfig, "precision"),
              show_default=True, help="DiT autocast dtype (the VAE always decodes in fp32).")
@click.option("--tf32/--no-tf32", default=default(SampleConfig, "tf32"), show_default=True,
              help="TF32 matmuls on GPUs that have it.")
@click.option("--compile", "compile_", is_flag=True, default=False, help="torch.compile the DiT.")
@click.option("--overwrite", is_flag=True, default=False, help="Discard earlier results of a different run.")
@click.option("--device", default=None, help="Device (default: this rank's GPU, else the CPU).")
@click.option("--quiet", is_flag=True, default=False)
@debug_option
@handle_errors
def sample_run_cmd(compile_: bool, debug: bool, **options: Any) -> None:
    """Sample images; every sample depends only on (seed, index), and a killed run resumes.

    \b
    Examples:
      dit-sample --ckpt DiT-XL-2-256x256.pt --class-labels 207,360,387,974 --out samples/
      torchrun --nproc-per-node 8 $(which dit-sample) --ckpt DiT-XL-2-256x256.pt \\
          --num-samples 50000 --cfg-scale 1.5 --steps 250 --npz dit-xl2-cfg1.5.npz
      dit-sample --ckpt runs/t2i --prompt "a red bus" --prompt "two cats" --cfg-scale 6 --out samples/
    """
    from dit_pipeline import sample

    sample.main(SampleConfig(compile=compile_, **options))


@sample_main.command("export", context_settings=CONTEXT)
@click.option("--to", "to", type=click.Choice(EXPORT_TARGETS), required=True,
              help="diffusers: a DiTPipeline folder; safetensors: one file with our weights and metadata.")
@click.argument("output")
@_weights_options
@click.option("--overwrite", is_flag=True, default=False, help="Replace OUTPUT if it exists.")
@click.option("--objective", type=click.Choice(OBJECTIVES), default=None,
              help="ddpm or flow, for a file that does not record it; flow models export to safetensors only.")
@debug_option
@handle_errors
def sample_export_cmd(debug: bool, **options: Any) -> None:
    """Export DiT weights to OUTPUT (a DiTPipeline folder or a .safetensors file).

    \b
    Examples:
      dit-sample export --to diffusers dit-xl2-pipeline/ --ckpt runs/xl2/checkpoints/step-0400000.pt
      dit-sample export --to safetensors dit-xl2.safetensors --ckpt DiT-XL-2-256x256.pt
    """
    from dit_pipeline import sample

    click.echo(f"wrote {sample.export_main(ExportConfig(**options))}")
