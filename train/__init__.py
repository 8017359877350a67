"""train/: latents -> checkpoints (`dit-train`).

Streams the latent shards (shards/) through DDP with AMP, EMA and crash-safe, exactly reproducible resume;
the model and diffusion come from dit/. Entry point: `train.run(TrainConfig(...))`.
"""
from train.config import BatchPlan, TrainConfig, batch_plan, load_config_file, merge_config
from train.hooks import HookContext, PeriodicHook, build_hooks
from train.plot import plot_metrics
from train.run import run

__all__ = ["BatchPlan", "HookContext", "PeriodicHook", "TrainConfig", "batch_plan", "build_hooks", "load_config_file",
           "merge_config", "plot_metrics", "run"]
