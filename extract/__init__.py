"""`dit-extract`: images -> Stable Diffusion VAE latents -> a verified shard set (docs/ARCHITECTURE.md).

`main(ExtractConfig(...))` is the whole command (`run_extract` with quiet libraries and the process group
torn down); the pieces are importable for tests and the
benchmark: `files` (image discovery and labels), `images` (decode + ADM crop), `plan` (the work split),
`loader` (parallel decode), `encode` (batched VAE), `state` (resume), `pipeline` (the encode loop).
"""
from dit_pipeline.extract.config import ExtractConfig
from dit_pipeline.extract.files import IMAGE_EXTENSIONS, ImageList, scan_image_folder
from dit_pipeline.extract.images import SkippedImage, adm_center_crop, load_and_crop, load_rgb
from dit_pipeline.extract.run import ExtractSummary, main, run_extract

__all__ = ["ExtractConfig", "ExtractSummary", "IMAGE_EXTENSIONS", "ImageList", "SkippedImage", "adm_center_crop",
           "load_and_crop", "load_rgb", "main", "run_extract", "scan_image_folder"]
