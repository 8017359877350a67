"""The model being trained and everything wrapped around it (`TrainModel`), built by `build_model`: the model of any
family (dit/family.py; seeded, identical on every rank), its EMA (DDP: on rank 0; sharded: every rank its shards),
with --repa the projector beside it and the teacher, per-block compile and the attention backend (train.speed), the
data-parallel wrapper of --parallel (train.parallel: DDP or FSDP2), then the optimizer (train.optim) over the
wrapped tensors and the GradScaler."""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable

import torch
from dit_pipeline.common.log import get_logger
from dit_pipeline.common.precision import AUTOCAST_DTYPES
from dit_pipeline.common.teacher import Teacher
from dit_pipeline.train.repa import CachedTeacher
from dit_pipeline.dit.family import DiffusionTransformer
from dit_pipeline.dit.repa import REPAModel
from dit_pipeline.train.config import TrainConfig
from dit_pipeline.train.init import apply_init
from dit_pipeline.train.metrics import peak_tflops
from dit_pipeline.train.optim import build_optimizer
from dit_pipeline.train.parallel import Parallel
from dit_pipeline.train.preflight import Preflight
from dit_pipeline.train.speed import choose_attention, compile_enabled, compile_problem, regional_compile
from dit_pipeline.train.text import run_conditioning


@dataclass
class TrainModel:
    """The model being trained and everything wrapped around it: EMA, optimizer, scaler, the data-parallel
    wrapper, the compiled forward, the diffusion (built by `train.net.build_model`)."""

    model: DiffusionTransformer          # raw model (any family), fp32 master weights (sharded: in place)
    ema: DiffusionTransformer | None     # fp32 EMA copy (DDP: rank 0 only; sharded: every rank's shards)
    opt: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    parallel: Parallel                   # the --parallel mode: wrapping, micro-batches, norms, checkpoints
    forward: Callable[..., torch.Tensor]  # what runs the forward (DDP / FSDP / the model, maybe compiled)
    diffusion: Any                       # dit.GaussianDiffusion or dit.FlowMatching (the TrainConfig's objective)
    amp_dtype: torch.dtype | None
    flops_per_image: float               # model FLOPs of a training step per image (with --repa: + projector, teacher)
    peak_tflops: float | None
    device: torch.device
    head: REPAModel | None = None        # --repa: the DiT and its projector as one module (what DDP wraps)
    teacher: "Teacher | CachedTeacher | None" = None  # --repa: the frozen teacher on `device`, or cached tokens

    @property
    def trained(self) -> torch.nn.Module:
        """The module whose parameters the optimizer updates: the DiT, or the DiT and its projector."""
        return self.head if self.head is not None else self.model



def build_model(prep: Preflight, device: torch.device, precision: str) -> TrainModel:
    """Model (seeded, identical on every rank), its EMA copy, regional compile and the attention backend
    (train.speed), the --parallel wrapper (train.parallel), the optimizer over the wrapped tensors, the GradScaler."""
    from dit_pipeline import dit

    cfg = prep.cfg
    torch.manual_seed(cfg.seed)
    model = dit.create_model(**prep.model_kwargs).to(device)
    if prep.init is not None:  # --init: a new run from pretrained weights (draws no random numbers)
        apply_init(model, prep.init)
    head, teacher = None, prep.teacher
    if teacher is not None:  # --repa: the projector beside the DiT (seeded after it), the teacher on this device
        head = dit.repa.REPAModel(model, encoder_depth=cfg.repa_depth, z_dims=(teacher.dim,)).to(device)
        teacher.to(device)
    if cfg.grad_checkpointing:
        model.set_grad_checkpointing(True)
    model.train()
    parallel = prep.parallel if prep.parallel is not None else Parallel.for_run(cfg, prep.world_size)
    ema = copy.deepcopy(model).requires_grad_(False).eval() if parallel.holds_ema() else None
    trained = head if head is not None else model
    amp_dtype = AUTOCAST_DTYPES[precision]
    _apply_speed_settings(cfg, model, device, prep.batch.micro_batch, amp_dtype)
    forward: Any = parallel.wrap(trained, model, ema, device, amp_dtype, cfg.ddp_bucket_mb)
    params = [p for p in trained.parameters() if p.requires_grad]  # after wrapping: FSDP2's sharded tensors
    opt = build_optimizer(params, cfg, device)  # AdamW, or Muon on the 2-D tensors + AdamW (train.optim)
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
    flops = float(dit.train_flops_per_image(model.config))
    if head is not None and teacher is not None:  # the projector trained, the teacher's forward
        tokens = model.grid_size ** 2
        width = model.hidden_size_at(cfg.repa_depth)
        flops += 6.0 * dit.repa.projector_macs(head.config, width, tokens) + 2.0 * teacher.forward_macs()
    objective = cfg.make_objective()
    if cfg.lpips or cfg.pdino:  # PixelGen's perceptual terms, their networks from the given files
        from dit_pipeline.common.perceptual import perceptual_terms

        objective.add_x_terms(perceptual_terms(cfg.to_dict(), model.input_size, device), cfg.percep_t_thresh)
    # the raw module and the run's conditioning (a text model's empty prompt), for an objective's passes without
    # gradient (MeanFlow's JVP and guided velocity)
    objective.attach(model, run_conditioning(model, prep.text))
    return TrainModel(model=model, ema=ema, opt=opt, scaler=scaler, parallel=parallel, forward=forward,
                      diffusion=objective, amp_dtype=amp_dtype, flops_per_image=flops,
                      peak_tflops=peak_tflops(device, cfg.peak_tflops), device=device, head=head, teacher=teacher)


def _apply_speed_settings(cfg: TrainConfig, model: DiffusionTransformer, device: torch.device, micro: int,
                          amp_dtype: torch.dtype | None) -> None:
    """Per-block compile (on by default on CUDA, state_dict names unchanged) and the SDPA backend; logged."""
    log = get_logger()
    if compile_enabled(cfg.compile, device):
        problem = compile_problem()
        if problem:
            log.warning(f"compile off: {problem}; training runs eager (pass --no-compile to silence this)")
        else:
            n = regional_compile(model)
            log.info(f"compile: {n} modules (each block and the final layer) compiled in place; the first "
                     "step includes compilation (--no-compile turns it off)")
    name, times = choose_attention(cfg.attention, device, batch=micro, heads=model.num_heads,
                                   tokens=model.grid_size ** 2, head_dim=model.head_dim, dtype=amp_dtype)
    probe = ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in times.items())
    log.info(f"attention: {name}" + (f" (fastest forward+backward probe: {probe})" if probe else ""))


