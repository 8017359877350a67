"""`dit-sample export`: DiT weights as a diffusers `DiTPipeline` folder or as one `.safetensors` file.

The diffusers layout (diffusers' `DiTTransformer2DModel`, key names read from the installed package)
differs from DiT's in three ways the conversion handles:
- the timestep MLP and label table live inside every block's `norm1.emb` (`AdaLayerNormZero`), so they
  are copied into each block; the final layer reads block 0's copy;
- the fused `attn.qkv` [3D, D] (q, k, v along the output features) is split into `to_q`, `to_k`, `to_v`;
- renames: x_embedder.proj -> pos_embed.proj, mlp.fc1/fc2 -> ff.net.0.proj / ff.net.2,
  adaLN_modulation.1 -> norm1.linear, final_layer.adaLN_modulation.1 -> proj_out_1,
  final_layer.linear -> proj_out_2. pos_embed is recomputed by diffusers (same sin-cos table).
DiTPipeline guides against class id 1000 whatever the model, so a model of fewer classes gets a label table
of 1001 rows (its classes, then copies of its null row up to id 1000) and one of more than 1000 classes is
refused. `norm_eps` is set to DiT's 1e-6 (diffusers' default is 1e-5). diffusers' `CombinedTimestepLabelEmbeddings`
hard-codes `downscale_freq_shift=1` (frequencies 10000^(-k/127) instead of DiT's 10000^(-k/128)), so the
stock pipeline is close to but not exactly DiT; setting it to 0 on the loaded model makes it exact.

The scheduler is DDIM with DiT's linear betas and "leading" spacing, i.e. DiT's "ddimN" respacing.

Flow models (SiT's objective) and models with block options are exported to safetensors only (with the
objective in the metadata). diffusers can hold the plain transformer's weights, but none of its pipelines
runs a SiT velocity model: DiTPipeline steps an epsilon/DDIM scheduler, and its flow-matching scheduler
(FlowMatchEulerDiscreteScheduler) feeds the network 1000 sigma with sigma = 1 at the noise end and expects
noise - data, while SiT's network takes t = 1 - sigma in [0, 1] and returns data - noise. Its DiT blocks
have no QK-norm, RMSNorm, SwiGLU or RoPE. Exporting such a folder would load and silently sample garbage.
So would a model trained on latents with a shift or a per-channel normalization, or from a VAE other than an
AutoencoderKL: DiTPipeline decodes `latents / vae.config.scaling_factor` with an AutoencoderKL, so those are
exported to safetensors only (their normalization in the `latent` metadata, which dit-sample inverts).
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from dit_pipeline import dit
from dit_pipeline.common.errors import UserError
from dit_pipeline.common.io import TMP_PREFIX, check_writable_dir, fsync_dir
from dit_pipeline.common.log import get_logger, setup_logging
from dit_pipeline.common.vae import DEFAULT_VAE, load_vae
from dit_pipeline.common.vae_identity import recorded_vae
from dit_pipeline.dit.blocks import BLOCK_OPTIONS
from dit_pipeline.dit.respace import TRAIN_TIMESTEPS
from dit_pipeline.sample.config import ExportConfig
from dit_pipeline.sample.load import (SAFETENSORS_LATENT_KEY, latent_norm, load_weights, manifest_folder,
                                      resolve_objective)

WEIGHTS_FORMAT = "dit-pipeline.weights"
# DiTPipeline's null class: its __call__ guides against class id 1000 whatever the model (ImageNet's DiT)
PIPELINE_NULL_CLASS = 1000
DIT_LN_EPS = 1e-6
# DiT's betas: linspace(1e-4, 0.02) over 1000 steps (docs/REFERENCE.md).
BETA_START, BETA_END = 1e-4, 0.02


def transformer_config(model_config: dict[str, Any]) -> dict[str, Any]:
    """DiTTransformer2DModel keyword arguments for a DiT model_config."""
    hidden, heads = int(model_config["hidden_size"]), int(model_config["num_heads"])
    channels = int(model_config["in_channels"])
    return {
        "num_attention_heads": heads, "attention_head_dim": hidden // heads, "in_channels": channels,
        "out_channels": channels * (2 if model_config["learn_sigma"] else 1),
        "num_layers": int(model_config["depth"]), "sample_size": int(model_config["input_size"]),
        "patch_size": int(model_config["patch_size"]),
        "num_embeds_ada_norm": max(int(model_config["num_classes"]), PIPELINE_NULL_CLASS),
        "activation_fn": "gelu-approximate", "norm_type": "ada_norm_zero", "norm_elementwise_affine": False,
        "norm_eps": DIT_LN_EPS, "attention_bias": True, "dropout": 0.0, "upcast_attention": False,
    }


def scheduler_config() -> dict[str, Any]:
    """DDIMScheduler settings equal to DiT's diffusion sampled with "ddimN" respacing (eta 0)."""
    return {
        "num_train_timesteps": TRAIN_TIMESTEPS, "beta_start": BETA_START, "beta_end": BETA_END,
        "beta_schedule": "linear", "clip_sample": False, "set_alpha_to_one": True, "steps_offset": 0,
        "prediction_type": "epsilon", "timestep_spacing": "leading",
    }


def _block_keys(sd: dict[str, torch.Tensor], i: int, shared: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    src, dst = f"blocks.{i}.", f"transformer_blocks.{i}."
    q, k, v = sd[src + "attn.qkv.weight"].chunk(3, dim=0)
    qb, kb, vb = sd[src + "attn.qkv.bias"].chunk(3, dim=0)
    out = {dst + "norm1.emb." + name: t for name, t in shared.items()}
    out.update({
        dst + "norm1.linear.weight": sd[src + "adaLN_modulation.1.weight"],
        dst + "norm1.linear.bias": sd[src + "adaLN_modulation.1.bias"],
        dst + "attn1.to_q.weight": q, dst + "attn1.to_q.bias": qb,
        dst + "attn1.to_k.weight": k, dst + "attn1.to_k.bias": kb,
        dst + "attn1.to_v.weight": v, dst + "attn1.to_v.bias": vb,
        dst + "attn1.to_out.0.weight": sd[src + "attn.proj.weight"],
        dst + "attn1.to_out.0.bias": sd[src + "attn.proj.bias"],
        dst + "ff.net.0.proj.weight": sd[src + "mlp.fc1.weight"], dst + "ff.net.0.proj.bias": sd[src + "mlp.fc1.bias"],
        dst + "ff.net.2.weight": sd[src + "mlp.fc2.weight"], dst + "ff.net.2.bias": sd[src + "mlp.fc2.bias"],
    })
    return out


def to_diffusers_state_dict(state_dict: dict[str, torch.Tensor],
                            model_config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """DiT state_dict (official names) -> DiTTransformer2DModel state_dict (contiguous copies)."""
    if not float(model_config["class_dropout_prob"]) > 0:
        raise UserError("diffusers' DiT always has a null-class row in its label table, but this model was "
                        "trained without class dropout (no null class); it cannot be exported to diffusers")
    sd = state_dict
    shared = {
        "timestep_embedder.linear_1.weight": sd["t_embedder.mlp.0.weight"],
        "timestep_embedder.linear_1.bias": sd["t_embedder.mlp.0.bias"],
        "timestep_embedder.linear_2.weight": sd["t_embedder.mlp.2.weight"],
        "timestep_embedder.linear_2.bias": sd["t_embedder.mlp.2.bias"],
        "class_embedder.embedding_table.weight": padded_label_table(sd["y_embedder.embedding_table.weight"]),
    }
    out = {"pos_embed.proj.weight": sd["x_embedder.proj.weight"], "pos_embed.proj.bias": sd["x_embedder.proj.bias"]}
    for i in range(int(model_config["depth"])):
        out.update(_block_keys(sd, i, shared))
    out.update({
        "proj_out_1.weight": sd["final_layer.adaLN_modulation.1.weight"],
        "proj_out_1.bias": sd["final_layer.adaLN_modulation.1.bias"],
        "proj_out_2.weight": sd["final_layer.linear.weight"], "proj_out_2.bias": sd["final_layer.linear.bias"],
    })
    return {k: v.detach().to(torch.float32).contiguous().clone() for k, v in out.items()}


def padded_label_table(table: torch.Tensor) -> torch.Tensor:
    """A label table [N + 1, D] (null row last) of N < 1000 classes as DiTPipeline's default call needs it:
    [1001, D] with the classes at 0..N-1 and the null row at 1000, where the pipeline looks for it; rows N..999
    are copies of the null row (an id no class has samples unconditionally). N >= 1000: unchanged."""
    classes = table.shape[0] - 1
    if classes >= PIPELINE_NULL_CLASS:
        return table
    null = table[classes:]
    return torch.cat([table[:classes], null.expand(PIPELINE_NULL_CLASS + 1 - classes, -1)], dim=0)


def build_diffusers_transformer(state_dict: dict[str, torch.Tensor], model_config: dict[str, Any]):
    """A DiTTransformer2DModel holding these DiT weights (strict load), in eval mode."""
    from diffusers import DiTTransformer2DModel

    model = DiTTransformer2DModel(**transformer_config(model_config))
    model.load_state_dict(to_diffusers_state_dict(state_dict, model_config), strict=True)
    return model.eval()


def set_dit_timestep_frequencies(transformer) -> int:
    """Make a loaded DiTTransformer2DModel use DiT's exact timestep frequencies (downscale_freq_shift 0).

    Returns how many embeddings were changed. Needed for bit-compatibility with DiT; a runtime setting,
    not saved in the config (diffusers hard-codes the value 1 when it builds the model).
    """
    changed = 0
    for block in transformer.transformer_blocks:
        block.norm1.emb.time_proj.downscale_freq_shift = 0
        changed += 1
    return changed


def _replace_path(tmp: Path, final: Path, overwrite: bool) -> None:
    """Move a finished temp file/folder onto `final`; an existing one is replaced only with overwrite."""
    if final.exists():
        if not overwrite:
            raise UserError(f"{final} already exists; pass --overwrite to replace it")
        old = final.parent / f"{TMP_PREFIX}old-{final.name}-{os.getpid()}"
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old) if old.is_dir() else old.unlink()
    else:
        os.replace(tmp, final)
    fsync_dir(final.parent)


def export_safetensors(state_dict: dict[str, torch.Tensor], info: dict[str, Any], output: Path,
                       overwrite: bool = False) -> Path:
    """One .safetensors file with the DiT weights (official names) and JSON metadata
    (format, model_config, latent scale when known, source)."""
    from safetensors.torch import save_file

    metadata = {"format": WEIGHTS_FORMAT, "model_config": json.dumps(info["model_config"], sort_keys=True),
                "source": str(info.get("source")), "weights": str(info.get("weights"))}
    if info.get("latent"):
        metadata[SAFETENSORS_LATENT_KEY] = json.dumps(info["latent"], sort_keys=True)
    if info.get("step") is not None:
        metadata["step"] = str(info["step"])
    metadata["objective"] = str(info.get("objective") or "ddpm")
    if metadata["objective"] == "flow" and info.get("flow_convention") == "repa":
        metadata["flow_convention"] = "repa"  # REPA's time (dit.flow_samplers): lost, the file would sample wrongly
    if metadata["objective"] == "flow" and info.get("time_shift") not in (None, 1.0):
        metadata["time_shift"] = repr(float(info["time_shift"]))  # the shift it samples with (dit/shift.py)
    if metadata["objective"] == "flow" and info.get("prediction") is not None:
        metadata["prediction"] = json.dumps(info["prediction"], sort_keys=True)  # x-prediction (dit.flow_predictions)
    if isinstance(info.get("meanflow"), dict):  # a MeanFlow model's training settings (dit/objectives.py record)
        metadata["meanflow"] = json.dumps(info["meanflow"], sort_keys=True)
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.parent / f"{TMP_PREFIX}{output.name}.{os.getpid()}"
    try:
        save_file({k: v.detach().contiguous() for k, v in state_dict.items()}, str(tmp), metadata=metadata)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        _replace_path(tmp, output, overwrite)
    finally:
        tmp.unlink(missing_ok=True)
    return output


def export_diffusers(state_dict: dict[str, torch.Tensor], info: dict[str, Any], output: Path, *,
                     vae: str, vae_config: str | None = None, overwrite: bool = False) -> Path:
    """A DiTPipeline folder (transformer, vae, scheduler), written to a temp folder and renamed into place."""
    from diffusers import DDIMScheduler, DiTPipeline

    check_diffusers_representable(info)
    log = get_logger()
    transformer = build_diffusers_transformer(state_dict, info["model_config"])
    vae_model, vae_id = load_vae(vae, config=vae_config)
    norm = latent_norm(info.get("latent"), vae_id, log)
    if norm.is_per_channel or norm.shift_factor or type(vae_model).__name__ != "AutoencoderKL":
        raise UserError(f"--to diffusers: DiTPipeline decodes with an AutoencoderKL's scaling_factor alone, but this "
                        f"model's latents are {norm.describe()} ({type(vae_model).__name__}); export it with --to "
                        "safetensors and sample with dit-sample, which inverts the normalization")
    scale = norm.scaling_factor
    if scale != vae_id["scaling_factor"]:
        vae_model.register_to_config(scaling_factor=scale)  # DiTPipeline decodes with the VAE config's factor
    classes = int(info["model_config"]["num_classes"])
    if classes < PIPELINE_NULL_CLASS:
        log.info("this model has %d classes: its label table is padded to DiTPipeline's 1001 rows (classes 0..%d, "
                 "the null class at 1000 where the pipeline's guidance looks for it)", classes, classes - 1)
    id2label = pipeline_labels(info)
    pipe = DiTPipeline(transformer=transformer, vae=vae_model, scheduler=DDIMScheduler(**scheduler_config()),
                       id2label=id2label)
    if id2label:
        # in model_index.json, whence DiTPipeline.from_pretrained passes it back (as the hub's DiT pipelines do)
        pipe.register_to_config(id2label=id2label)
    else:
        log.info("the checkpoint records no class names: the pipeline's labels stay empty (pass class ids)")
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{output.name}.", dir=output.parent))
    try:
        pipe.save_pretrained(str(tmp), safe_serialization=True)
        _replace_path(tmp, output, overwrite)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return output


def pipeline_labels(info: dict[str, Any]) -> dict[str, str]:
    """DiTPipeline's `id2label` ({"0": name, ...}) from the class names the checkpoint records (the manifest's
    class folders); empty when it records none (official release files)."""
    names = (info.get("latent") or {}).get("class_names") or []
    if len(names) != int(info["model_config"]["num_classes"]):
        return {}
    return {str(i): str(name) for i, name in enumerate(names)}


def check_diffusers_representable(info: dict[str, Any]) -> None:
    """UserError naming what a diffusers DiTPipeline cannot represent (see the module docstring)."""
    objective = info.get("objective") or "ddpm"
    if objective != "ddpm":
        from dit_pipeline.dit.objectives import spec

        what = ("SiT's velocity objective; DiTPipeline is epsilon/DDIM, FlowMatchEulerDiscreteScheduler passes "
                "t = 1000 sigma, noise at sigma = 1, and expects noise - data" if objective == "flow" else
                "a one-step average-velocity model with its own time inputs; diffusers has no pipeline for it")
        raise UserError(f"--to diffusers: this is a {objective} model ({what}), so no diffusers pipeline samples "
                        f"it correctly. Export it with --to safetensors and sample with dit-sample --sampler "
                        f"{'|'.join(spec(objective).samplers)}")
    family = dit.family.family_of_config(info["model_config"])
    if family.diffusers_class is None:
        raise UserError(f"--to diffusers: diffusers has no {family.family} transformer (its DiTPipeline holds DiT's "
                        "blocks); export this model with --to safetensors and sample it with dit-sample")
    classes = int(info["model_config"]["num_classes"])
    if classes > PIPELINE_NULL_CLASS:
        raise UserError(f"--to diffusers: this model has {classes} classes, but DiTPipeline guides against class id "
                        f"{PIPELINE_NULL_CLASS} as its null class, which is one of this model's classes; export it "
                        "with --to safetensors and sample with dit-sample")
    options = [k for k in BLOCK_OPTIONS if info["model_config"].get(k)]
    if options:
        raise UserError(f"--to diffusers: diffusers' DiT blocks have no {', '.join(options)}; export this model "
                        "with --to safetensors")


def export(cfg: ExportConfig) -> Path:
    """Run `dit-sample export` (see the module docstring)."""
    cfg.validate()
    output = Path(cfg.output).expanduser()
    check_writable_dir(output.parent, f"export OUTPUT {cfg.output}")
    state_dict, info = load_weights(cfg.ckpt, weights=cfg.weights, expect_model=cfg.model, num_heads=cfg.num_heads,
                                    input_size=cfg.input_size, encoder_depth=cfg.encoder_depth)
    info["objective"] = resolve_objective(info, cfg.ckpt, cfg.objective)
    unstated = (info.get("unstated") or {}).get("prediction")
    if unstated:  # an export records no prediction, which reads as the velocity (sample/facts.py)
        raise UserError(f"--ckpt {cfg.ckpt}: {unstated}; an export would record none, which reads as a velocity "
                        "model, so it is not exported: sample the file itself with dit-sample --protocol "
                        "nanogen/<config> (docs/nanogen-checkpoints.md)")
    if cfg.to == "safetensors":
        return export_safetensors(state_dict, info, output, overwrite=cfg.overwrite)
    check_diffusers_representable(info)  # before the VAE is looked for: a model no pipeline samples is refused first
    vae, vae_config = cfg.vae, cfg.vae_config
    if not vae:
        found = recorded_vae((info.get("latent") or {}).get("vae"), f"--ckpt {cfg.ckpt}", base=manifest_folder(info))
        vae, vae_config = found if found else (DEFAULT_VAE, None)
        vae_config = cfg.vae_config or vae_config
    return export_diffusers(state_dict, info, output, vae=vae, vae_config=vae_config,
                            overwrite=cfg.overwrite)


def export_main(cfg: ExportConfig) -> Path:
    """The `dit-sample export` command: `export` with console logging; returns the path written."""
    setup_logging()
    return export(cfg)
