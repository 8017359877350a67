"""The releases' own sampling protocols as published: one `Protocol` row (dit/protocol_types.py) per release (DiT,
SiT, REPA, LightningDiT, DDT, RAE and its AutoGuidance, NanoGen's generic rows, MeanFlow, iMF), each naming the files
(and lines) its values were read from, with the FID each was published with and the reference it was measured
against. dit/protocols.py puts `ROWS` first in its table `PROTOCOLS`, before NanoGen's configs
(dit/nanogen_protocols.py). Pure data: no I/O.
"""
from __future__ import annotations

from . import nanogen_protocols
from .nanogen_protocols import NANOGEN_REF, T2I_REF
from .protocol_fit import AppliesTo
from .protocol_types import Guidance, Protocol, TimeGrid

ADM_REF = "ADM's VIRTUAL_imagenet256_labeled.npz (openai/guided-diffusion evaluations)"
_LATENT, _PIXELS = ("latent",), ("pixels",)
CLASS_FLOW = AppliesTo(space=_LATENT, conditioning=("class",), objectives=("flow",))
_SDE_GRID = TimeGrid(count_is="points", start=0.0, end=0.96, append=1.0)  # SiT's and REPA's: 0.96, then Mean to 1

ROWS: dict[str, Protocol] = {p.name: p for p in (
    Protocol(
        "dit", "facebookresearch/DiT",
        ("sample_ddp.py l.78 (create_diffusion(str(num_sampling_steps)): 250 respaced DDPM steps), l.114-119 "
         "(the doubled [cond; null = 1000] batch, forward_with_cfg), l.132 (clamp(127.5 x + 128))",
         "models.py l.250-265 forward_with_cfg: guidance on model_out[:, :3]",
         "sample_ddp.py: y = torch.randint(0, num_classes) per sample"),
        solver="ddpm", count=250, guidance=Guidance("cfg", 1.5, channels="3", doubled=True), conversion="dit",
        labels="uniform", fid_reference=ADM_REF, fid=2.27, model="DiT-XL/2 256 px",
        applies_to=AppliesTo(space=_LATENT, conditioning=("class",), objectives=("ddpm",))),
    Protocol(
        "sit", "willisma/SiT",
        ("sample_ddp.py l.109-117 (sample_sde: Euler, diffusion form sigma, norm 1, last step Mean 0.04, 250 steps), "
         "l.163-168 (doubled batch, null 1000), l.178 (clamp(127.5 x + 128))",
         "transport/transport.py l.73-95 check_interval (SDE: t0 = 0, t1 = 1 - last_step_size), l.247-262 the Mean "
         "last step, l.279-286 sample_sde",
         "transport/integrators.py l.23 linspace(t0, t1, num_steps)", "models.py l.250-265 (first 3 channels)"),
        solver="euler-maruyama", count=250, grid=_SDE_GRID,
        guidance=Guidance("cfg", 1.5, channels="3", doubled=True), conversion="dit", labels="uniform",
        fid_reference=ADM_REF, fid=2.06, model="SiT-XL/2 256 px", applies_to=CLASS_FLOW),
    Protocol(
        "repa", "sihyun-yu/REPA",
        ("samplers.py l.105-183 euler_maruyama_sampler: t = linspace(1, 0.04, num_steps) then 0 (REPA's t = noise "
         "level), diffusion 2t, guidance where guidance_low <= t <= guidance_high (l.131), the doubled batch only "
         "there, the last step without noise",
         "README (generate.py --mode sde --num-steps 250 --cfg-scale 1.8 --guidance-high 0.7)",
         "generate.py l.151-154 ((x + 1) / 2, clamp(255 x)), l.122 y = randint"),
        solver="euler-maruyama", count=250, grid=_SDE_GRID,
        guidance=Guidance("cfg", 1.8, interval=(0.0, 0.7), ends="[]", channels="all"), conversion="repa",
        labels="uniform", fid_reference=ADM_REF, fid=1.42, model="SiT-XL/2 + REPA 256 px, 800 epochs",
        applies_to=CLASS_FLOW),
    Protocol(
        "lightningdit", "hustvl/LightningDiT",
        ("transport/integrators.py l.94-101 (linspace(t0, t1, num_steps), then a t / (1 + (a - 1) t), "
         "a = timestep_shift)", "transport/transport.py l.95-96 check_interval (ODE: t0 = 0, t1 = 1)",
         "configs/reproductions/lightningdit_xl_vavae_f16d32_800ep_cfg.yaml (euler, 250 points, cfg 6.7, "
         "cfg_interval_start 0.125, timestep_shift 0.3)",
         "models/lightningdit.py l.420-442 forward_with_cfg (first 3 channels; the conditional half where "
         "t < cfg_interval_start)", "inference.py l.202-218 (doubled batch at every step, null 1000, randint labels)",
         "tokenizer/vavae.py l.81 (clamp(127.5 x + 128))"),
        solver="euler", count=250, grid=TimeGrid(count_is="points", shift=1 / 0.3),
        guidance=Guidance("cfg", 6.7, interval=(0.0, 0.875), ends="[]", channels="3", doubled=True),
        conversion="dit", labels="uniform", fid_reference=ADM_REF, fid=1.35,
        model="LightningDiT-XL/1 on VA-VAE f16d32, 800 epochs", applies_to=CLASS_FLOW,
        notes="the 64-epoch config: cfg 10.0, cfg_interval_start 0.10 (--cfg-scale 10 --guidance-interval 0 0.9)"),
    Protocol(
        "ddt", "MCG-NJU/DDT",
        ("src/diffusion/stateful_flow_matching/sampling.py l.53-58 (timesteps = cat(linspace(0, 1 - last_step, "
         "num_steps), [1]), then t / (t + (1 - t) shift)), l.88-102 (the doubled [uncond; cond] batch at every step, "
         "the encoder state reset where i % state_refresh_rate == 0, guidance where guidance_interval_min < t < "
         "guidance_interval_max)",
         "configs/repa_improved_ddt_xlen22de6_256.yaml l.68-81 (250 steps, guidance 2.0, timeshift 1.0, "
         "state_refresh_rate 1, interval (0.3, 1.0), last_step 0.04, simple_guidance_fn: every channel)",
         "src/models/vae.py l.78-80 fp2uint8", "src/data/dataset/randn.py (label = idx // num_seeds: 50 per class)"),
        solver="euler", count=250, grid=TimeGrid(count_is="points", start=0.0, end=0.96, append=1.0),
        guidance=Guidance("cfg", 2.0, interval=(0.0, 0.7), ends="()", channels="all", doubled=True),
        conversion="ddt", labels="equal", fid_reference=ADM_REF + " (README: ADM evaluation suite)", fid=1.26,
        model="DDT-XL/2 (22 + 6 blocks) 256 px", applies_to=CLASS_FLOW,
        notes="encoder sharing: dit-sample --encoder-refresh K is the release's state_refresh_rate K (1 in the "
              "config): the encoder recomputed at steps i % K == 0 on the doubled batch"),
    Protocol(
        "rae", "bytetriper/RAE",
        ("src/stage2/transport/transport.py l.125-152 check_interval (t0 = 0, t1 = 1 - 1/1000 for the ODE), "
         "sample_ode", "src/stage2/transport/integrators.py l.100-101 (t = 1 - linspace(t0, t1, num_steps), then "
         "s t / (1 + (s - 1) t) in its noise-level time)",
         "src/sample_ddp.py l.134-137 (s = sqrt(prod(latent_size) / 4096)), l.246-274 (guidance where the scale is "
         "> 1: the doubled [x; x] with [y; null] at every step, forward_with_cfg, the first half kept), l.276-277 "
         "(clamp(0, 1).mul(255))",
         "src/stage2/models/DDT.py l.364-389 forward_with_cfg (every channel, where t_min <= t <= t_max in its t = "
         "noise level; the conditional half elsewhere)",
         "configs/stage2/sampling/ImageNet256/DiTDHXL-DINOv2-B.yaml (euler, num_steps 50, guidance method cfg, "
         "scale 1.0, t-min 0.0, t-max 1.0)",
         "README (--label-sampling equal by default)"),
        solver="euler", count=50, grid=TimeGrid(count_is="points", start=0.0, end=0.999, shift="dim"),
        guidance=Guidance("cfg", 1.0, interval=(0.0, 1.0), ends="[]", channels="all", doubled=True),
        conversion="rae", labels="equal", fid_reference=ADM_REF, fid=1.51,
        model="DiT-DH-XL on DINOv2-B features 256 px, 800 epochs", applies_to=CLASS_FLOW,
        notes="the config's guidance is cfg at scale 1.0 (none); --cfg-scale S guides as its forward_with_cfg does"),
    Protocol(
        "rae-ag", "bytetriper/RAE",
        ("configs/stage2/sampling/ImageNet256/DiTDHXL-DINOv2-B_AG.yaml (method autoguidance, scale 1.42, t-min 0, "
         "t-max 1, guidance_model DiT-DH-S: hidden [384, 2048], depth [12, 2])",
         "src/stage2/models/DDT.py l.391-408 forward_with_autoguidance (ag + s (eps - ag) on every channel where "
         "t_min <= t <= t_max)", "src/sample_ddp.py l.179-186, l.255-277",
         "src/stage2/transport/transport.py l.125-152, integrators.py l.100-101 (the rae grid)"),
        solver="euler", count=50, grid=TimeGrid(count_is="points", start=0.0, end=0.999, shift="dim"),
        guidance=Guidance("autoguidance", 1.42, interval=(0.0, 1.0), ends="[]", channels="all",
                          guide_model="DiT-DH-S"),
        conversion="rae", labels="equal", fid_reference=ADM_REF, fid=1.13,
        model="DiT-DH-XL on DINOv2-B features 256 px, guided by DiT-DH-S", applies_to=CLASS_FLOW,
        notes="the release runs both networks on its doubled [cond; null] batch and keeps the conditional half; "
              "here only the conditional half runs: 2 network evaluations per step instead of 4"),
    Protocol(
        "nanogen", "End2End-Diffusion/diffusion-bench",
        ("src/stage2/transport/sampler.py l.10-34 sample_ode (t = linspace(1, 0, num_steps + 1), then "
         "s t / (1 + (s - 1) t), NanoGen's t = noise level; x = x - (t_i - t_i+1) drift(x, t_i))",
         "src/offline_eval.py l.119-124 (s = sqrt(time_dist_shift_dim / time_dist_shift_base_eval), the dim being "
         "prod(latent_size) and base_eval the training base 4096 unless a config sets it)",
         "src/utils/guidance_utils.py l.14-39 forward_with_cfg (the doubled [x; x] with [y; null] at every step, "
         "guidance on the in_channels where t_min <= t <= t_max, the conditional half elsewhere), "
         "src/configs/stage2.py (use_cfg: scale > 1)",
         "src/eval/generation.py l.150-168 (null label num_classes; decode to [0, 1], clamp, mul(255), uint8), "
         "src/eval/distributed.py l.35-58 (one sample per validation image, with its label)",
         "configs/stage2/sampling/imagenet/ddt-en28d1152hd72-dn2d2048hd128-sdvae-ema-vpred-t4c8-cfg1.6-t0.0-0.9.yaml "
         "(50 steps, cfg 1.6 in [0, 0.9])"),
        solver="euler", count=50, grid=TimeGrid(count_is="intervals", start=0.0, end=1.0, shift="dim"),
        guidance=Guidance("cfg", 1.6, interval=(0.0, 0.9), ends="[]", channels="all", doubled=True),
        conversion="nanogen", labels="equal", fid_reference=NANOGEN_REF, fid=None,
        model="NanoGen's in-context DiT-DH t4c8 on SD-VAE-EMA latents, 80 epochs", applies_to=CLASS_FLOW,
        facts=nanogen_protocols.generic_facts("imagenet", False, "every latent config of "
                                              "configs/stage2/sampling/imagenet/"),
        notes="any latent space, with the grid's shift sqrt(C H W / 4096) of the model's latents (1 for SD-VAE, "
              "sqrt(48) for RAE's DINOv2-B features); each NanoGen config's own scale: nanogen/<config>"),
    Protocol(
        "nanogen-pixels", "End2End-Diffusion/diffusion-bench",
        ("src/stage2/transport/sampler.py l.10-34 sample_ode (the nanogen grid)",
         "configs/stage2/sampling/imagenet/jit-ddt-en28d1152hd72-dn2d2048hd128-xpred-t4c8-cfg2.6-t0.0-0.9.yaml "
         "(time_dist_shift_base_eval 196608 = time_dist_shift_dim: the grid unshifted; 50 steps, cfg 2.6 in "
         "[0, 0.9])", "src/stage2/transport/transport.py l.105-127 (prediction 'x': drift (x - out) / "
         "t.clamp_min(0.05), after the guidance)",
         "src/utils/guidance_utils.py l.14-39 forward_with_cfg", "src/eval/generation.py l.150-168"),
        solver="euler", count=50, grid=TimeGrid(count_is="intervals", start=0.0, end=1.0, shift=1.0),
        guidance=Guidance("cfg", 2.6, interval=(0.0, 0.9), ends="[]", channels="all", doubled=True),
        conversion="nanogen", labels="equal", fid_reference=NANOGEN_REF, fid=None,
        model="NanoGen's JiT-DDT (in-context DiT-DH t4c8, patch 16 on pixels, x-prediction), 80 epochs",
        applies_to=AppliesTo(space=_PIXELS, conditioning=("class",), objectives=("flow",)),
        facts=nanogen_protocols.generic_facts("imagenet", True, "every pixel config of "
                                              "configs/stage2/sampling/imagenet/"),
        notes="PixelGen's and PixNerd's configs (cfg 2.0, 2.4): nanogen/pixelgen-..., nanogen/pixnerd-...; a NanoGen "
              "file predicts x (JiT, PixelGen) or the velocity (PixNerd) with the same network: its config's row "
              "says which"),
    Protocol(
        "nanogen-t2i", "End2End-Diffusion/diffusion-bench",
        ("src/stage2/transport/sampler.py l.10-34 sample_ode (the nanogen grid, shifted by sqrt(C H W / 4096))",
         "configs/stage2/sampling/t2i/t2i-ddt-en28d1152hd72-dn2d2048hd128-sdvae-ema-vpred-t4.yaml (50 steps, cfg 6.0 "
         "with t_min 0.0, t_max 1.0)", "src/eval/generation.py l.136-147 (the doubled batch against the text "
         "encoder's features of the empty prompt, with its mask), l.163-168 (the first half; [0, 1], mul(255), uint8)",
         "src/utils/guidance_utils.py l.14-39 forward_with_cfg"),
        solver="euler", count=50, grid=TimeGrid(count_is="intervals", start=0.0, end=1.0, shift="dim"),
        guidance=Guidance("cfg", 6.0, interval=(0.0, 1.0), ends="[]", channels="all", doubled=True),
        conversion="nanogen", labels="uniform", null_label="the empty prompt", fid_reference=T2I_REF, fid=None,
        model="NanoGen's T2I in-context DiT-DH t4 (Qwen3-0.6B) on SD-VAE-EMA latents",
        applies_to=AppliesTo(space=_LATENT, conditioning=("text",), objectives=("flow",)),
        facts=nanogen_protocols.generic_facts("t2i", False, "every config of "
                                              "configs/stage2/sampling/t2i/"),
        notes="prompts from --prompt / --prompts (a text model); pixel models: nanogen-t2i-pixels"),
    Protocol(
        "nanogen-t2i-pixels", "End2End-Diffusion/diffusion-bench",
        ("src/stage2/transport/sampler.py l.10-34 sample_ode (the nanogen grid, unshifted)",
         "configs/stage2/sampling/t2i/t2i-jit-ddt-en28d1152hd72-dn2d2048hd128-xpred-t4.yaml and "
         "t2i-pixelgen-ddt-en28d1152hd72-dn2d2048hd128-xpred-t4-0.1lpips-0.01pdino-thresh0.7.yaml (50 steps, cfg 6.0 "
         "with t_min 0.0, t_max 1.0, time_dist_shift_base_eval 196608 = time_dist_shift_dim: s = 1)",
         "src/offline_eval.py l.118-124 (s = sqrt(dim / base_eval))",
         "src/eval/generation.py l.136-147, l.163-168", "src/utils/guidance_utils.py l.14-39 forward_with_cfg"),
        solver="euler", count=50, grid=TimeGrid(count_is="intervals", start=0.0, end=1.0, shift=1.0),
        guidance=Guidance("cfg", 6.0, interval=(0.0, 1.0), ends="[]", channels="all", doubled=True),
        conversion="nanogen", labels="uniform", null_label="the empty prompt", fid_reference=T2I_REF, fid=None,
        model="NanoGen's T2I JiT-DDT and PixelGen (in-context DiT-DH t4, patch 16 on pixels, x-prediction)",
        applies_to=AppliesTo(space=_PIXELS, conditioning=("text",), objectives=("flow",)),
        facts=nanogen_protocols.generic_facts("t2i", True, "every pixel config of "
                                              "configs/stage2/sampling/t2i/"),
        notes="NanoGen's T2I PixNerd config is shifted by sqrt(48) (no base_eval): "
              "nanogen/t2i-pixnerd-ddt-en28d1152hd72-dn2d2048hd128-vpred-t4"),
    Protocol(
        "meanflow", "Gsunshine/meanflow",
        ("meanflow.py l.102-124 (sample_one_step: z_r = z_t - (t - r) u(z_t, t, t - r); _default_schedule "
         "[1.0, 0.0]), l.15-53 generate (randint labels)", "configs/default.py (sampling.num_steps 1)",
         "train.py l.165-166 (127.5 x + 128, clip, astype(uint8))"),
        solver="meanflow", count=1, grid=TimeGrid(count_is="intervals", start=0.0, end=1.0),
        guidance=Guidance("none", 1.0), conversion="dit", labels="uniform",
        fid_reference="the release's ImageNet 256 statistics, computed as ADM's (README: FID stats)", fid=None,
        model="MeanFlow (the release's MF-B/4: FID 11.4 in its README)",
        applies_to=AppliesTo(space=_LATENT, conditioning=("class",), objectives=("meanflow",)),
        notes="the release samples 2 steps only on a list it is given (sampling.sampling_timesteps); "
              "--steps 2 here takes linspace(1, 0, 3), our choice"),
    Protocol(
        "imf", "Lyy-iiis/imeanflow",
        ("imf.py l.42 (t_steps = linspace(1, 0, num_steps + 1)), l.90-114 sample_one_step (omega, t_min, t_max "
         "are network inputs)", "configs/eval_config.yml (iMF-B/2: 1 step, omega 8.0, interval [0.4, 0.65])",
         "utils/sample_util.py l.28-29 (127.5 x + 128, clip, astype(uint8))",
         "imf.py l.36-39 (y = (arange(n) + sample_idx n) % num_classes: equal counts)"),
        solver="meanflow", count=1, grid=TimeGrid(count_is="intervals", start=0.0, end=1.0),
        guidance=Guidance("input", 8.0, interval=(0.4, 0.65), ends="[]", channels="all"), conversion="dit",
        labels="equal", fid_reference="the release's imagenet_256_fid_stats.npz (computed on TPU with JAX)",
        fid=3.39, model="iMF-B/2 256 px",
        applies_to=AppliesTo(space=_LATENT, conditioning=("class",), objectives=("imf", "imf-adaln")),
        notes="eval_config.yml: iMF-M/2 and L/2 omega 10.5 in [0.4, 0.6]; XL/2 8.0 in [0.42, 0.62]; XL/2 2 steps "
              "4.0 in [0.36, 0.64] (--cfg-scale, --guidance-interval, --steps)"),
)}
