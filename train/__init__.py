"""train/: latents -> checkpoints (`dit-train`).

Streams the latent shards (shards/) through DDP with AMP, EMA and crash-safe, exactly reproducible resume;
the model and diffusion come from dit/. Entry points: `train.main(cfg)` (the `dit-train` command, with the
`--nproc-per-node` launcher) and `train.run(cfg, hooks=...)` (one process or one rank).
"""
from dit_pipeline.train.command import main
from dit_pipeline.train.batch import BatchPlan, batch_plan
from dit_pipeline.train.config import TrainConfig
from dit_pipeline.train.config_file import load_config_file, merge_config
from dit_pipeline.train.hooks import HookContext, PeriodicHook, build_hooks
from dit_pipeline.train.plot import plot_metrics
from dit_pipeline.train.run import run

__all__ = ["BatchPlan", "HookContext", "PeriodicHook", "TrainConfig", "batch_plan", "build_hooks", "load_config_file",
           "main", "merge_config", "plot_metrics", "run"]
