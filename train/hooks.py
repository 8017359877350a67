"""Periodic hooks: work that runs every N optimizer steps inside the training loop (e.g. sample grids).

The trainer calls every hook on every rank right after step `ctx.step` is complete (optimizer and EMA
updated, checkpoint written if one was due) whenever `ctx.step % hook.every == 0`. A hook decides itself
which ranks do work (under DDP typically rank 0 only, with `ctx.ema`, which only rank 0 holds; under the
sharded modes every rank runs the model's passes together, `ctx.evaluation`, and rank 0 writes); ranks that
skip the work simply wait at their next collective, so a hook should take well under the collective timeout
(DIT_DIST_TIMEOUT, 600 s by default). `build_hooks(cfg)` makes the hooks a TrainConfig asks for (today the
sample grids of sample/, imported only when asked for); they are passed to `train.run(cfg, hooks=[...])`,
whose loop knows only the `PeriodicHook` protocol below.

A hook may also have `setup(ctx)`: called once on every rank before the first step of this invocation
(after resuming), to load what it needs and check it against the run. A `UserError` there stops every rank
before any training step. Hooks must draw no global random numbers (use their own generators), so that
training with and without them, and a resumed run, stay identical.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from dit_pipeline.common.hooks import HookContext, PeriodicHook

if TYPE_CHECKING:
    from dit_pipeline.train.config import TrainConfig

__all__ = ["HookContext", "PeriodicHook", "build_hooks"]


def _recorded_vae(cfg: "TrainConfig") -> tuple[str, str | None]:
    """The VAE the shard set was extracted with (its manifest's record), for --sample-every without --vae."""
    from dit_pipeline.common.errors import UserError
    from dit_pipeline.common.vae_identity import recorded_vae
    from dit_pipeline.shards import read_manifest

    where, manifest = cfg.manifest or cfg.shards, cfg.manifest
    spec = None
    if cfg.source or cfg.mix:  # a data mix: the first source's (every source is one latent space, train/mix.py)
        from dit_pipeline.train.mix import mix_spec

        spec = mix_spec(cfg.source, cfg.mix)
    if spec is not None:
        where = manifest = spec.sources[0].manifest or spec.sources[0].shards
    if manifest is None and not Path(str(where)).expanduser().is_dir():
        raise UserError("--sample-every needs --vae here: the manifest is not known yet (pass --manifest or --vae)")
    path = Path(str(where)).expanduser()
    m = read_manifest(path)
    found = recorded_vae(m.extraction.get("vae"), f"the manifest of {where}", base=path if path.is_dir() else path.parent)
    if found is None and m.extraction.get("encoder"):
        raise UserError(f"--sample-every / --fid-every need --vae DECODER here: {where} holds the features of "
                        f"{m.extraction['encoder'].get('model')} (a feature space), which only a decoder turns into "
                        "pixels; pass RAE's decoder (--vae model.pt or --vae model.pt,config.json)")
    if found is None:
        raise UserError(f"--sample-every needs --vae: the manifest of {where} records no VAE; pass the VAE the "
                        "shards were extracted with (a hub id, a local diffusers folder or a .safetensors file)")
    return found


def build_hooks(cfg: "TrainConfig") -> list[PeriodicHook]:
    """The hooks `cfg` asks for: a ValidationHook with --val-shards, a SampleGridHook with --sample-every, an
    evaluate.hook.FidHook with --fid-every; none without them.

    Validates the config first (ConfigError, exit 2). Rank 0, the one that draws, loads the VAE at once, so
    a bad --vae fails before any training work.
    """
    hooks: list[PeriodicHook] = []
    if cfg.val_shards is not None:  # the validation loss at fixed timesteps (train/validation.py)
        from dit_pipeline.train.validation import ValidationHook

        cfg.validate()
        hooks.append(ValidationHook.from_settings(cfg))
    if cfg.sample_every is None and cfg.fid_every is None:
        return hooks
    from dit_pipeline.common import distributed as dist

    cfg.validate()
    vae, vae_config = cfg.vae, cfg.vae_config
    if not vae:
        vae, vae_config = _recorded_vae(cfg)
        vae_config = cfg.vae_config or vae_config
    if cfg.sample_every is not None:
        from dit_pipeline.sample.grid import SampleGridHook

        grid = SampleGridHook.from_settings(cfg, vae=vae, vae_config=vae_config, seed=cfg.seed,
                                            objective=cfg.objective)
        if dist.is_main():
            grid.load()
        hooks.append(grid)
    if cfg.fid_every is not None:
        from dit_pipeline.evaluate.hook import FidHook

        hooks.append(FidHook.from_settings(cfg, vae=vae, vae_config=vae_config, seed=cfg.seed,
                                           objective=cfg.objective))
    return hooks
