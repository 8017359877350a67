"""`train.main(cfg)`: the whole `dit-train` command once its options are a TrainConfig.

One process, a rank under torchrun, or the `--nproc-per-node N` launcher: the launcher runs every check that
needs no GPU (config, hooks, batch split, shard set, model vs latents) before any rank starts, then starts N
local ranks that run this same function under torchrun.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from dit_pipeline.train.config import TrainConfig
from dit_pipeline.train.failures import failures_logged
from dit_pipeline.train.hooks import build_hooks
from dit_pipeline.train.launch import launch, under_launcher
from dit_pipeline.train.preflight import prepare
from dit_pipeline.train.run import run


def main(cfg: TrainConfig, *, nproc_per_node: int | None = None, argv: Sequence[str] = ()) -> int:
    """Run `dit-train` for `cfg`; returns the exit code (0, or torchrun's when this process launched it).

    nproc_per_node: launch that many local ranks with `argv` (this command's arguments) unless this process
    already runs under a launcher.
    """
    # Checks the hook options and, on rank 0, loads the VAE at once: a bad --vae fails before any training
    # work. The launcher loads it for that check only; its ranks build their own hooks.
    hooks = build_hooks(cfg)
    if nproc_per_node is None or under_launcher():
        with failures_logged(cfg):  # a killed loader worker: one line, in the run's logs too (train/failures.py)
            run(cfg, hooks=hooks)
        return 0
    if cfg.dry_run:
        run(cfg, world_size=nproc_per_node)
        return 0
    prepare(cfg, world_size=nproc_per_node)  # every check before any rank starts
    del hooks
    return launch(nproc_per_node, list(argv), log_file=Path(cfg.run_dir).expanduser() / "log.txt")
