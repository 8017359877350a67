"""NanoGen's (End2End-Diffusion/diffusion-bench) 78 sampling configs as data: one line per NanoGen model, from which
dit/protocols.py builds the protocol rows `nanogen/<sampling config file name>`.

Every model's training config (configs/stage2/training/<task>/<name>.yaml) has a sampling config of the same name:
for ImageNet the guidance-free one (cfg scale 1.0 on [0, 1]), beside the tuned one `<name>-cfg<s>-t0.0-0.9` (scale s
on noise levels [0, 0.9]); for text-to-image the only one (scale 6.0 on [0, 1]); for MeanFlow the guidance is trained
in (src/configs/stage2.py l.169-170 disables it). Every config samples 50 Euler steps (MeanFlow: 1) of NanoGen's
grid, linspace(1, 0, num_steps + 1) shifted by sqrt(time_dist_shift_dim / time_dist_shift_base_eval)
(src/offline_eval.py l.118-124): sqrt(C H W / 4096) of the latent, except where a config sets base_eval to the dim
itself (`unshifted`: the pixel configs, but not the T2I PixNerd one).

What NanoGen keeps in a config only, not in its checkpoint files (`{step, epoch, model, ema, optimizer, scheduler}`,
src/utils/checkpoint.py l.65-84; a released `<name>-v<n>.pt` is loaded as that file's `ema` or as a bare state_dict,
src/utils/model_utils.py l.33-39), is each row's `ModelFacts` (dit/protocol_fit.py): what the network predicts
(transport.prediction, with TransportConfig's t_eps 0.05), the T2I text encoder (conditioning.text_encoder:
Qwen/Qwen3-0.6B, max_length 256: our preset qwen3-0.6b) and the latent space (stage_1), named as a `--vae` value
where dit-sample decodes it as NanoGen does (`DECODERS`).

This table is the one owner of those values; tests/dit/test_nanogen_protocols.py compares the rows built from it
with tests/data/nanogen_sampling.json, the facts scripts/nanogen_sampling.py reads from NanoGen's files (and, where a
clone of NanoGen is at hand, regenerates them), so a missing, extra or differing config fails a test.
"""
from __future__ import annotations

import math
from typing import NamedTuple

from .protocol_fit import AppliesTo, ModelFacts
from .protocol_types import Guidance, Protocol, TimeGrid

RELEASE = "End2End-Diffusion/diffusion-bench"
SAMPLING_DIR = "configs/stage2/sampling"
SHIFT_BASE = 4096  # misc.time_dist_shift_base of every config
# the FID references of its ImageNet rows and of its text-to-image rows (dit/release_protocols.py's too)
NANOGEN_REF = "NanoGen's data/imagenet/jit_in256_stats.npz (ImageNet validation statistics)"
T2I_REF = "none: GenEval, DPG-Bench and GenAI-Bench VQAScore on the prompts (dit-eval --t2i)"

# NanoGen's latent spaces (stage_1: vae_type, encoder_name; Flux2VAE and PixelEncoder have neither): channels and
# downsampling factor, so a resolution r gives the latent (C, r / f, r / f) of the configs' misc.latent_size
TOKENIZERS: dict[str, tuple[int, int]] = {
    "sdvae-ema": (4, 8), "sdvae-mse": (4, 8), "sdxl-vae": (4, 8), "sd3.5": (16, 8), "flux": (16, 8),
    "qwen-vae": (16, 8), "flux2": (128, 16), "e2e-flux": (16, 8), "e2e-qwen-vae": (16, 8), "e2e-sd3.5": (16, 8),
    "e2e-vavae": (32, 16), "dinov2-vit-b": (768, 16), "dinov3-vit-b16": (768, 16), "siglip2-vit-b": (768, 16),
    "pe-vit-l": (1024, 16), "langpe-vit-l": (1024, 16), "spatialpe-vit-l": (1024, 16), "pixels": (3, 1),
}

# the config's keys that state each fact (tokenizer: stage_1.params.vae_type, or stage_1.target for Flux2 and pixels)
KEYS = (("prediction", "transport.prediction"), ("vae", "stage_1"), ("latent", "stage_1"),
        ("text_encoder", "conditioning.text_encoder"))
TEXT_ENCODER = "qwen3-0.6b"  # every T2I config: conditioning.text_encoder Qwen/Qwen3-0.6B, max_length 256
T_EPS = 0.05  # src/configs/stage2.py TransportConfig.t_eps (no config sets it)
STAGE_1 = "src/stage1/vae.py l.24-95 VAE_CONFIGS, l.137-149 (normalization), l.237-239 (decode)"
# tokenizer -> (a --vae value that decodes it as NanoGen's stage_1 does, with NanoGen's (scaling_factor,
# shift_factor); how NanoGen loads it). The SD and SDXL VAEs are AutoencoderKLs whose factors NanoGen fixes in its
# table; pixels decode by the identity (src/stage1/pixel.py). For the other spaces NanoGen reads a subfolder of a
# pipeline, another class (QwenVAE, Flux2VAE's patchify and BatchNorm) or its own RAE decoders, which dit-sample
# cannot name here: --vae / --decoder gives them.
DECODERS: dict[str, tuple[str | None, tuple[float, float | None] | None, str]] = {
    "sdvae-ema": ("stabilityai/sd-vae-ft-ema", (0.18215, 0.0), "AutoencoderKL stabilityai/sd-vae-ft-ema"),
    "sdvae-mse": ("stabilityai/sd-vae-ft-mse", (0.18215, 0.0), "AutoencoderKL stabilityai/sd-vae-ft-mse"),
    "sdxl-vae": ("madebyollin/sdxl-vae-fp16-fix", (0.13025, 0.0), "AutoencoderKL madebyollin/sdxl-vae-fp16-fix"),
    "sd3.5": (None, None, "AutoencoderKL stabilityai/stable-diffusion-3.5-large, subfolder vae"),
    "flux": (None, None, "AutoencoderKL black-forest-labs/FLUX.1-dev, subfolder vae"),
    "qwen-vae": (None, None, "QwenVAE (Qwen/Qwen-Image, subfolder vae)"),
    "flux2": (None, None, "Flux2VAE (black-forest-labs/FLUX.2-dev, subfolder vae; 2 x 2 patchify and BatchNorm)"),
    "e2e-flux": (None, None, "AutoencoderKL REPA-E/e2e-flux-vae"),
    "e2e-qwen-vae": (None, None, "QwenVAE (REPA-E/e2e-qwenimage-vae)"),
    "e2e-sd3.5": (None, None, "AutoencoderKL REPA-E/e2e-sd3.5-vae"),
    "e2e-vavae": (None, None, "AutoencoderKL REPA-E/e2e-vavae-hf"),
    "dinov2-vit-b": (None, None, "RAE: DINOv2-B features, NanoGen's decoder from pretrained_models"),
    "dinov3-vit-b16": (None, None, "RAE: DINOv3 ViT-B/16 features, NanoGen's decoder from pretrained_models"),
    "siglip2-vit-b": (None, None, "RAE: SigLIP2 ViT-B features, NanoGen's decoder from pretrained_models"),
    "pe-vit-l": (None, None, "RAE: PE ViT-L features, NanoGen's decoder from pretrained_models"),
    "langpe-vit-l": (None, None, "RAE: Lang-PE ViT-L features, NanoGen's decoder from pretrained_models"),
    "spatialpe-vit-l": (None, None, "RAE: Spatial-PE ViT-L features, NanoGen's decoder from pretrained_models"),
    "pixels": ("pixels", (1.0, None), "PixelEncoder (pixels in [-1, 1]; src/stage1/pixel.py l.36-58)"),
}


class Model(NamedTuple):
    name: str                 # the training config's file name without .yaml (= a sampling config's)
    task: str                 # "imagenet" (class labels, FID) or "t2i" (Qwen3-0.6B text, GenEval / DPG / GenAI)
    tokenizer: str            # TOKENIZERS
    guided: float | None = None   # ImageNet: the scale of its tuned config <name>-cfg<s>-t0.0-0.9
    prediction: str = "velocity"  # transport.prediction
    meanflow: bool = False    # transport.meanflow: one step, guidance trained in
    reg: bool = False         # repa.use_reg: REG's class token (dit/protocol_fit.py FEATURES)
    unshifted: bool = False   # misc.time_dist_shift_base_eval = the dim: the grid unshifted
    resolution: int = 256
    version: int = 0          # its released checkpoint: <name>-v<version>.pt (stage_2.ckpt)

    @property
    def latent_shape(self) -> tuple[int, int, int]:
        c, f = TOKENIZERS[self.tokenizer]
        return c, self.resolution // f, self.resolution // f

    def facts(self, config: str) -> ModelFacts:
        """What its sampling config `config` states that its checkpoint file does not (module docstring)."""
        vae, latent, how = DECODERS[self.tokenizer]
        return ModelFacts(source=f"{SAMPLING_DIR}/{self.task}/{config}.yaml", keys=KEYS, prediction=self.prediction,
                          t_eps=T_EPS, text_encoder=TEXT_ENCODER if self.task == "t2i" else None, vae=vae,
                          latent=latent, latent_space=f"{self.tokenizer}: {how}")

    def sampling_names(self) -> list[tuple[str, float | None]]:
        """(sampling config name, its tuned cfg scale or None for the guidance-free / T2I / MeanFlow one)."""
        own: list[tuple[str, float | None]] = [(self.name, None)]
        return own + ([(f"{self.name}-cfg{self.guided:.1f}-t0.0-0.9", self.guided)] if self.guided else [])


_N = "ddt-en28d1152hd72-dn2d2048hd128"  # the in-context DiT-DH: encoder 28 x 1152 (heads of 72), head 2 x 2048 (128)
_PG = "0.1lpips-0.01pdino-thresh0.7"     # PixelGen's perceptual losses (LPIPS 0.1, P-DINO 0.01 below t = 0.7)

MODELS: tuple[Model, ...] = (
    # ImageNet 256, class labels (t4c8: 4 time and 8 class tokens)
    Model(f"{_N}-sdvae-ema-vpred-t4c8", "imagenet", "sdvae-ema", 1.6),
    Model(f"{_N}-sdvae-ema-reg0.03-rmsnorm-vpred-t4c8", "imagenet", "sdvae-ema", 2.2, reg=True),
    Model(f"{_N}-sdvae-mse-vpred-t4c8", "imagenet", "sdvae-mse", 1.6),
    Model(f"{_N}-sdxl-vae-vpred-t4c8", "imagenet", "sdxl-vae", 1.6),
    Model(f"{_N}-sd3.5-vpred-t4c8", "imagenet", "sd3.5", 1.8),
    Model(f"{_N}-flux-vpred-t4c8", "imagenet", "flux", 2.0),
    Model(f"{_N}-flux2-vpred-t4c8", "imagenet", "flux2", 2.0),
    Model(f"{_N}-flux2-reg0.03-rmsnorm-vpred-t4c8", "imagenet", "flux2", 3.2, reg=True),
    Model(f"{_N}-qwen-vae-vpred-t4c8", "imagenet", "qwen-vae", 1.6),
    Model(f"{_N}-e2e-flux-vpred-t4c8", "imagenet", "e2e-flux", 1.8),
    Model(f"{_N}-e2e-qwen-vae-vpred-t4c8", "imagenet", "e2e-qwen-vae", 1.8),
    Model(f"{_N}-e2e-sd3.5-vpred-t4c8", "imagenet", "e2e-sd3.5", 1.8),
    Model(f"{_N}-e2e-vavae-vpred-t4c8", "imagenet", "e2e-vavae", 1.8),
    Model(f"{_N}-rae-dinov2-vpred-t4c8", "imagenet", "dinov2-vit-b", 4.8),
    Model(f"{_N}-rae-dinov2-reg0.03-rmsnorm-vpred-t4c8", "imagenet", "dinov2-vit-b", 6.2, reg=True),
    Model(f"{_N}-rae-dinov3-vit-b16-vpred-t4c8", "imagenet", "dinov3-vit-b16", 7.0),
    Model(f"{_N}-rae-dinov3-vit-b16-reg0.03-rmsnorm-vpred-t4c8", "imagenet", "dinov3-vit-b16", 7.8, reg=True),
    Model(f"{_N}-rae-siglip2-vit-b-vpred-t4c8", "imagenet", "siglip2-vit-b", 7.0, version=1),
    Model(f"{_N}-rae-pe-vit-l-vpred-t4c8", "imagenet", "pe-vit-l", 5.0),
    Model(f"{_N}-rae-langpe-vit-l-vpred-t4c8", "imagenet", "langpe-vit-l", 5.0),
    Model(f"{_N}-rae-spatialpe-vit-l-vpred-t4c8", "imagenet", "spatialpe-vit-l", 9.0),
    Model(f"jit-{_N}-xpred-t4c8", "imagenet", "pixels", 2.6, prediction="x", unshifted=True),
    Model(f"pixelgen-{_N}-xpred-t4c8-{_PG}", "imagenet", "pixels", 2.0, prediction="x", unshifted=True),
    Model(f"pixnerd-{_N}-vpred-t4c8", "imagenet", "pixels", 2.4, unshifted=True),
    Model(f"mf-{_N}-sdvae-mse-vpred-t4c8-kappa0.0", "imagenet", "sdvae-mse", meanflow=True),
    Model(f"mf-{_N}-sdvae-mse-vpred-t4c8-kappa0.5", "imagenet", "sdvae-mse", meanflow=True),
    # text-to-image (t4: 4 time tokens, then the prompt's Qwen3-0.6B tokens)
    Model(f"t2i-{_N}-sdvae-ema-vpred-t4", "t2i", "sdvae-ema"),
    Model(f"t2i-{_N}-sdvae-ema-reg0.03-rmsnorm-vpred-t4", "t2i", "sdvae-ema", reg=True),
    Model(f"t2i-{_N}-sdvae-mse-vpred-t4", "t2i", "sdvae-mse"),
    Model(f"t2i-{_N}-sdxl-vae-vpred-t4", "t2i", "sdxl-vae"),
    Model(f"t2i-{_N}-sd3.5-vpred-t4", "t2i", "sd3.5"),
    Model(f"t2i-{_N}-flux-vpred-t4", "t2i", "flux"),
    Model(f"t2i-{_N}-flux2-vpred-t4", "t2i", "flux2"),
    Model(f"t2i-{_N}-flux2-reg0.03-rmsnorm-vpred-t4", "t2i", "flux2", reg=True),
    Model(f"t2i-{_N}-qwen-vae-vpred-t4", "t2i", "qwen-vae"),
    Model(f"t2i-{_N}-e2e-flux-vpred-t4", "t2i", "e2e-flux"),
    Model(f"t2i-{_N}-e2e-qwen-vae-vpred-t4", "t2i", "e2e-qwen-vae"),
    Model(f"t2i-{_N}-e2e-sd3.5-vpred-t4", "t2i", "e2e-sd3.5"),
    Model(f"t2i-{_N}-e2e-vavae-vpred-t4", "t2i", "e2e-vavae"),
    Model(f"t2i-{_N}-rae-dinov2-vpred-t4", "t2i", "dinov2-vit-b"),
    Model(f"t2i-{_N}-rae-dinov2-reg0.03-rmsnorm-vpred-t4", "t2i", "dinov2-vit-b", reg=True),
    Model(f"t2i-{_N}-rae-dinov3-vit-b16-vpred-t4", "t2i", "dinov3-vit-b16"),
    Model(f"t2i-{_N}-rae-dinov3-vit-b16-reg0.03-rmsnorm-vpred-t4", "t2i", "dinov3-vit-b16", reg=True),
    Model(f"t2i-{_N}-rae-siglip2-vit-b-vpred-t4", "t2i", "siglip2-vit-b", version=1),
    Model(f"t2i-{_N}-rae-pe-vit-l-vpred-t4", "t2i", "pe-vit-l"),
    Model(f"t2i-{_N}-rae-langpe-vit-l-vpred-t4", "t2i", "langpe-vit-l"),
    Model(f"t2i-{_N}-rae-spatialpe-vit-l-vpred-t4", "t2i", "spatialpe-vit-l"),
    Model(f"t2i-jit-{_N}-xpred-t4", "t2i", "pixels", prediction="x", unshifted=True),
    Model(f"t2i-pixelgen-{_N}-xpred-t4-{_PG}", "t2i", "pixels", prediction="x", unshifted=True),
    Model(f"t2i-pixnerd-{_N}-vpred-t4", "t2i", "pixels"),  # no time_dist_shift_base_eval: shifted by sqrt(48)
    Model(f"mf-t2i-{_N}-sdvae-mse-vpred-t4-kappa0.5", "t2i", "sdvae-mse", meanflow=True),
    # text-to-image at 512 px (encoder 28 x 1584)
    Model("t2i-ddt-en28d1584hd72-dn2d2048hd128-flux2-vpred-t4-512res", "t2i", "flux2", resolution=512),
    Model("t2i-ddt-en28d1584hd72-dn2d2048hd128-qwen-vae-vpred-t4-512res", "t2i", "qwen-vae", resolution=512),
    Model("t2i-ddt-en28d1584hd72-dn2d2048hd128-e2e-qwen-vae-vpred-t4-512res", "t2i", "e2e-qwen-vae", resolution=512),
)

T2I_SCALE = 6.0  # every T2I config: cfg 6.0 on [0, 1]
TUNED_INTERVAL = (0.0, 0.9)  # every ImageNet -cfg<s>-t0.0-0.9 config

# the files every row's values come from besides its config (End2End-Diffusion/diffusion-bench)
SOURCES = (
    "src/stage2/transport/sampler.py l.10-34 sample_ode (t = linspace(1, 0, num_steps + 1), then s t / (1 + (s - 1) "
    "t), NanoGen's t = noise level; x = x - (t_i - t_i+1) drift(x, t_i); MeanFlow: drift = u(x, h = t_i - t_i+1, "
    "t_abs = t_i), src/stage2/transport/transport.py l.167-169, l.326-330)",
    "src/offline_eval.py l.118-124 (s = sqrt(time_dist_shift_dim / time_dist_shift_base_eval), base_eval defaulting "
    "to time_dist_shift_base 4096)",
    "src/configs/stage2.py l.80-103 (cfg acts where its scale > 1), l.167-170 (MeanFlow: guidance disabled)",
    "src/utils/guidance_utils.py l.14-45 forward_with_cfg (the doubled [x; x] with [c; null] at every step, "
    "uncond + s (cond - uncond) on the in_channels where t_min <= t <= t_max, the conditional half elsewhere)",
    "src/eval/generation.py l.136-168 (null: label num_classes or the empty prompt's features; the first half; "
    "decode to [0, 1], clamp, mul(255), uint8), src/eval/distributed.py l.35-58 (ImageNet: one sample per "
    "validation image, with its label)",
)


def rows() -> dict:
    """The protocol rows `nanogen/<sampling config>` (dit/protocol_types.py's records)."""
    out = {}
    for m in MODELS:
        c, h, w = m.latent_shape
        shift = 1.0 if m.unshifted else math.sqrt(c * h * w / SHIFT_BASE)
        applies = AppliesTo(space=("pixels",) if m.tokenizer == "pixels" else ("latent",),
                            conditioning=("class",) if m.task == "imagenet" else ("text",),
                            objectives=("meanflow",) if m.meanflow else ("flow",), prediction=m.prediction,
                            latent_shape=m.latent_shape, requires=("reg",) if m.reg else ())
        for name, tuned in m.sampling_names():
            if m.meanflow:
                guidance = Guidance("none", 1.0)
            else:
                scale = tuned or (T2I_SCALE if m.task == "t2i" else 1.0)
                guidance = Guidance("cfg", scale, interval=TUNED_INTERVAL if tuned else (0.0, 1.0), ends="[]",
                                    channels="all", doubled=True)
            row = Protocol(
                f"nanogen/{name}", RELEASE, (f"{SAMPLING_DIR}/{m.task}/{name}.yaml",) + SOURCES,
                solver="meanflow" if m.meanflow else "euler", count=1 if m.meanflow else 50, guidance=guidance,
                conversion="nanogen", labels="equal" if m.task == "imagenet" else "uniform",
                fid_reference=NANOGEN_REF if m.task == "imagenet" else T2I_REF,
                grid=TimeGrid(count_is="intervals", start=0.0, end=1.0, shift=shift),
                null_label="num_classes" if m.task == "imagenet" else "the empty prompt",
                model=f"{m.name}-v{m.version}.pt (NanoGen's release: pretrained_models/{m.task}/ckpts) on {m.tokenizer} "
                      f"{'x'.join(map(str, m.latent_shape))}",
                applies_to=applies, notes=_notes(m), facts=m.facts(name))
            out[row.name] = row
    return out


def generic_facts(task: str, pixels: bool, source: str) -> ModelFacts:
    """The facts every NanoGen config of a task and space shares (the rows nanogen, nanogen-pixels, nanogen-t2i,
    nanogen-t2i-pixels): the text encoder, the pixel space, the velocity of every latent model; not a pixel model's
    prediction (x or the velocity with the same network), nor a latent space's decoder."""
    vae, latent, how = DECODERS["pixels"] if pixels else (None, None, "")
    return ModelFacts(source=source, keys=KEYS, prediction=None if pixels else "velocity", t_eps=T_EPS,
                      text_encoder=TEXT_ENCODER if task == "t2i" else None, vae=vae, latent=latent,
                      latent_space=f"pixels: {how}" if pixels else "")


def _notes(m: Model) -> str:
    notes = []
    if m.meanflow:
        notes.append("guidance trained in (MeanFlow's CFG distillation, transport.meanflow cfg_omega / cfg_kappa)")
    if m.reg:
        notes.append("REG: the sampler evolves a DINOv2-B class token beside the image and guides it too")
    if m.tokenizer == "pixels" and not m.unshifted:
        notes.append("no time_dist_shift_base_eval, unlike the other pixel configs: shifted by sqrt(C H W / 4096)")
    return "; ".join(notes)
