"""`dit-sample`: images and FID-ready `.npz` files from DiT checkpoints, on one process or under torchrun.

Follows the reference DiT FID sampler (docs/REFERENCE.md; ADM evaluation format) with three guarantees added:
every sample is a pure function of (seed, index) (sample/plan.py), finished batches survive a kill
(sample/npz.py part files, checked against a fingerprint of everything that determines the pixels), and
ranks split the missing indices between them in fixed global chunks, so for one batch size the final
arrays do not depend on the number of GPUs or on interruptions (bit for bit on one machine: same shapes,
pinned CPU threads, deterministic cuDNN; common/determinism.py). Another batch size gives the same
samples to within float rounding (docs/sampling.md).

Flow: every rank loads the model and VAE; rank 0 checks earlier results and opens the parts folder and
tells the others which indices are missing; each rank samples its batches and writes one part per batch;
after a barrier rank 0 assembles the `.npz`, the grid and the run record, then deletes the parts.

This module is the entry `dit-sample` calls (`run_sampling`) and the flow above; the settings decided once the
checkpoint is read are sample/resolve.py's, the outputs and their records sample/outputs.py's, the batch loop
sample/batches.py's.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dit_pipeline.common import distributed as dist
from dit_pipeline.common.determinism import deterministic_cuda, pinned_threads
from dit_pipeline.common.io import check_writable_dir
from dit_pipeline.common.log import setup_logging
from dit_pipeline.common.precision import set_tf32
from dit_pipeline.common.vae import load_vae
from dit_pipeline.dit import protocols
from dit_pipeline.sample.batches import sample_batches
from dit_pipeline.sample.conditions import sampling_for
from dit_pipeline.sample.config import SampleConfig
from dit_pipeline.sample.facts import supply
from dit_pipeline.sample.load import latent_norm, load_model, resolve_ckpt, resolve_objective, with_latent_stats
from dit_pipeline.sample.names import with_class_ids
from dit_pipeline.sample.npz import PartStore, parts_dir_for
from dit_pipeline.sample.outputs import grid_file, prepare_outputs, run_record, write_outputs
from dit_pipeline.sample.resolve import (check_compatible, check_fit, compare_vae, load_guidance_model,
                                         sampling_protocol, with_cfg_channels, with_cfg_scale, with_flow_settings,
                                         with_sampler, with_vae)


@dataclass
class SampleResult:
    total: int  # samples in the run
    produced: int  # sampled by this invocation on this rank
    resumed: int  # finished by earlier invocations
    image_size: int
    seconds: float
    npz: Path | None = None
    grid: Path | None = None


def run_sampling(cfg: SampleConfig) -> SampleResult:
    """Run one sampling job (see the module docstring); joins torchrun's process group if launched by it."""
    cfg.validate()
    if cfg.out:
        check_writable_dir(cfg.out, f"--out {cfg.out}")
    if cfg.npz:
        check_writable_dir(Path(cfg.npz).expanduser().parent, f"--npz {cfg.npz}")
    dist.init()
    with dist.leaving_group():
        return _run(cfg)


def _run(cfg: SampleConfig) -> SampleResult:
    log = setup_logging(None, quiet=cfg.quiet)  # log files only once the inputs proved usable
    start = time.perf_counter()
    device = torch.device(cfg.device) if cfg.device else dist.device()
    set_tf32(cfg.tf32)
    if device.type == "cuda":
        deterministic_cuda()
    cfg = dataclasses.replace(cfg, ckpt=str(resolve_ckpt(cfg.ckpt)))  # a run folder: its newest checkpoint
    loaded = load_model(cfg.ckpt, weights=cfg.weights, expect_model=cfg.model, device=device,
                        num_heads=cfg.num_heads, input_size=cfg.input_size, encoder_depth=cfg.encoder_depth)
    log.info("model: %s", loaded.describe())
    log.info("%s", dist.launch_info().describe())
    cfg = supply(cfg, loaded, log)  # what the file cannot state: a flag's or the protocol row's (sample/facts.py)
    cfg = with_vae(cfg, loaded, log)
    vae, vae_id = load_vae(cfg.vae, config=cfg.vae_config, device=device)
    vae_note = compare_vae(vae_id, (loaded.latent or {}).get("vae"))
    if vae_note:
        log.warning("%s", vae_note)
    norm = with_latent_stats(latent_norm(loaded.latent, vae_id, log), loaded.info, cfg.latent_stats,
                             int(loaded.config["in_channels"]), cfg.ckpt)
    if norm.is_per_channel:
        log.info("latents: %s", norm.describe())
    loaded.info["objective"] = resolve_objective(loaded.info, cfg.ckpt, cfg.objective)
    check_fit(cfg, loaded, vae_id)  # before any work that depends on the model's conditioning
    cfg = with_class_ids(cfg, loaded.latent)  # names given in --class-labels -> ids (sample/names.py)
    if cfg.labels is None and cfg.class_labels is None and cfg.prompts is None and cfg.prompts_file is None:
        # the protocol's FID labels, else uniform draws
        cfg = dataclasses.replace(cfg, labels=protocols.protocol(cfg.protocol).labels if cfg.protocol else "uniform")
    # each sample's condition: its class, or its prompt (sample/conditions.py, by the model's conditioning)
    cfg, conds = sampling_for(cfg, loaded, device)
    labels = conds.ids
    cfg, sampler_note = with_sampler(cfg, loaded.info["objective"])
    cfg = with_cfg_scale(cfg, loaded, log)
    cfg.validate()  # the sampler's own rules (e.g. --flow-convention only for flow samplers) once it is known
    check_compatible(cfg, loaded, vae_id, vae)
    cfg = with_flow_settings(cfg, loaded, log)
    cfg = with_cfg_channels(cfg, loaded, log)
    proto = sampling_protocol(cfg, loaded)
    guide = load_guidance_model(cfg, loaded, device, log)
    image_size = int(loaded.config["input_size"]) * int(vae_id["downsample_factor"])
    if cfg.out:
        log = setup_logging(Path(cfg.out) / "logs", quiet=cfg.quiet)
    if sampler_note:
        log.info("%s", sampler_note)
    record = run_record(cfg, loaded, vae_id, norm, labels, image_size, device, proto, guide, conds) \
        if dist.is_main() else {}
    if record and vae_note:
        record["vae_differs_from_shards"] = vae_note
    store = PartStore(parts_dir_for(cfg.npz, cfg.out), record.get("fingerprint", {}), cfg.total)
    state = dist.on_rank0(lambda: prepare_outputs(cfg, store, record, log))
    if state == "complete":
        log.info("%s: already complete (same checkpoint and settings); nothing to do", cfg.npz or cfg.out)
        return SampleResult(cfg.total, 0, cfg.total, image_size, time.perf_counter() - start,
                            Path(cfg.npz) if cfg.npz else None, grid_file(cfg))
    done = set(state)
    remaining = [i for i in range(cfg.total) if i not in done]
    _log_plan(log, cfg, proto, len(remaining), len(done), image_size)
    sampling_start = time.perf_counter()
    with pinned_threads(device, cfg.cpu_threads):  # the pixels must not depend on OMP_NUM_THREADS or torchrun
        produced = sample_batches(cfg, loaded, vae, store, labels, remaining, norm, proto, guide, conds)
    with dist.peer_guard("waiting for every rank's samples"):
        dist.barrier()
    sampling = time.perf_counter() - sampling_start
    result = SampleResult(cfg.total, produced, len(done), image_size, 0.0)
    if dist.is_main():
        log.info("sampled %d images in %.1f s: %.3g images/s over %d process(es)", len(remaining), sampling,
                 len(remaining) / max(sampling, 1e-9), dist.world_size())
        result.npz, result.grid = write_outputs(cfg, store, labels, record, log, conds)
    result.seconds = time.perf_counter() - start
    return result


def _log_plan(log: Any, cfg: SampleConfig, proto: protocols.Protocol, remaining: int, done: int,
              image_size: int) -> None:
    """The line that starts the sampling: how many images, where, and with which sampler and guidance."""
    g = proto.guidance
    log.info("sampling %d of %d images (%d already done) at %dx%d on %d process(es), %s %d steps, %s %s%s%s",
             remaining, cfg.total, done, image_size, image_size, dist.world_size(), cfg.sampler,
             cfg.steps, "guidance" if g.rule == "cfg" else g.rule, g.scale, "" if g.interval is None else
             f" where the noise level is in {g.ends[0]}{g.interval[0]}, {g.interval[1]}{g.ends[1]}",
             "" if cfg.protocol is None else f" (--protocol {proto.name}, {proto.release})")
