"""Sampling from DiT checkpoints (`dit-sample`): images, FID-ready `.npz` files and diffusers export.

Public API:
    main(SampleConfig) -> SampleResult                   the `dit-sample` command (= run_sampling)
    export_main(ExportConfig) -> Path                    `dit-sample export --to diffusers|safetensors`
    sample_grid(model, *, vae, scaling_factor, ...)       uint8 [N, H, W, 3] for fixed classes and seeds
    save_grid(images, path, *, labels, ncol)              labelled PNG grid (torchvision make_grid)
Reproducibility: sample i's noise and (drawn) class depend only on (seed, i); see sample/plan.py.
"""
from dit_pipeline.sample.config import ExportConfig, SampleConfig
from dit_pipeline.sample.export import export, export_main
from dit_pipeline.sample.grid import sample_grid, save_grid
from dit_pipeline.sample.run import SampleResult, run_sampling

main = run_sampling  # `dit-sample` is one call: options -> SampleConfig -> main(cfg)

__all__ = ["ExportConfig", "SampleConfig", "SampleResult", "export", "export_main", "main", "run_sampling",
           "sample_grid", "save_grid"]
