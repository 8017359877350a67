"""DiT core: the network, the Gaussian diffusion and its samplers, and safe weight loading.

Pure math (no torch.distributed, no logging setup); `dit.weights` is the only module reading files, through
`weight_files` and `weight_records`.
The calling conventions follow the DiT reference scripts, so they port with an import change:

    model = dit.create_model("DiT-XL/2", input_size=32)   # or "LightningDiT-XL/1", "DDT-XL/2", "DiT-DH-XL", "iMF-B/2"
    diffusion = dit.create_diffusion("250")     # or dit.create_flow() for SiT's flow matching
    state_dict, info = dit.load_dit_weights("DiT-XL-2-256x256.pt")
"""
from .diffusion import GaussianDiffusion, create_diffusion, linear_betas
from . import conditioning, internal_guidance, protocols, reg, repa, reuse
from .flow import FlowMatching, create_flow
from .flow_samplers import FLOW_SAMPLERS
from .family import DiffusionTransformer, families, preset_names
from .flops import forward_macs, train_flops_per_image
from .models import (MODEL_PRESETS, DiT, DiT_models, canonical_model_name, create_model,
                     model_from_config, pos_embed_2d, timestep_embedding)
from .ddt import DDT
from .ditdh import DiTDH
from .imf import IMF
from .incontext import InContextDiTDH
from .pixart import PixArt
from .lightningdit import LightningDiT
from .respace import space_timesteps
from .weight_match import check_state_dict, infer_model_config
from .weight_records import make_sidecar, read_sidecar, sidecar_path
from .weights import WeightsError, build_model_from_weights, load_dit_weights

__all__ = [
    "DDT", "DiTDH", "DiffusionTransformer", "IMF", "InContextDiTDH", "PixArt", "LightningDiT", "MODEL_PRESETS", "DiT",
    "DiT_models", "families",
    "preset_names", "GaussianDiffusion", "WeightsError", "build_model_from_weights",
    "FLOW_SAMPLERS", "FlowMatching", "canonical_model_name", "check_state_dict", "create_diffusion",
    "create_flow", "create_model", "forward_macs",
    "infer_model_config", "linear_betas", "load_dit_weights", "make_sidecar", "model_from_config", "pos_embed_2d",
    "protocols", "read_sidecar", "repa", "reuse", "conditioning", "sidecar_path", "space_timesteps",
    "timestep_embedding", "train_flops_per_image",
]
