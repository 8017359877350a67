"""Shared test helpers: tiny VAE, tiny image trees, running the real CLI (also under torchrun)."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Sequence

import numpy as np

BIN = Path(sys.executable).parent

# Float comparisons (issue #34): another CPU's kernels round float32 differently (summation order, FMA, vector
# width), by a few units of the last place of the values' magnitude. A tolerance must therefore be relative to the
# scale of the values compared; an absolute one that fits values near 1 fails on values near 500.
FP32_EPS = float(np.finfo(np.float32).eps)  # 1.19e-7: one unit in the last place at magnitude 1


def assert_close_at_scale(actual, expected, *, rel: float, scale: float | None = None, what: str = "") -> None:
    """Assert that every element of `actual` is within `rel` x scale of `expected`, where scale is the largest
    magnitude in `expected` (the size of the numbers compared: float32 results of a chain of operations carry an
    error proportional to it, not to each element). Tensors, arrays and numbers; shapes must match; NaN fails; a
    zero scale means exact equality. `rel` is stated at each call, in units of FP32_EPS where it is rounding.
    `scale`: the magnitude of the computation when `expected` is a slice of it (e.g. the largest network output)."""
    a, e = _as_float64(actual), _as_float64(expected)
    assert a.shape == e.shape, f"{what}: shape {a.shape} != {e.shape}"
    assert np.isfinite(a).all() and np.isfinite(e).all(), f"{what}: non-finite values"
    if scale is None:
        scale = float(np.abs(e).max()) if e.size else 0.0
    scale = float(scale)
    diff = float(np.abs(a - e).max()) if e.size else 0.0
    assert diff <= rel * scale, (f"{what + ': ' if what else ''}max |difference| {diff:.3g} > {rel:.3g} x scale "
                                 f"{scale:.4g} = {rel * scale:.3g} (relative {diff / scale if scale else float('inf'):.3g})")


def _as_float64(x) -> np.ndarray:
    if hasattr(x, "detach"):  # a torch tensor
        x = x.detach().cpu().double().numpy()
    return np.asarray(x, dtype=np.float64)

REPO = Path(__file__).resolve().parent.parent

# A tiny AutoencoderKL with the SD-VAE's geometry (4 blocks: 8x downsampling, 4 latent channels) but few
# channels. Its scaling_factor is deliberately not 0.18215 so tests catch a hard-coded constant.
TINY_VAE_CONFIG = dict(
    in_channels=3, out_channels=3, latent_channels=4,
    down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
    block_out_channels=(8, 8, 16, 16), layers_per_block=1, norm_num_groups=4, act_fn="silu",
    sample_size=32, scaling_factor=0.5,
)


def make_tiny_vae(folder: Path, seed: int = 0, **overrides) -> Path:
    """Build the tiny random VAE and save it with save_pretrained (so the real loading path runs)."""
    import safetensors.torch  # noqa: F401  (diffusers 0.29 uses it without importing it: common/vae.py)
    import torch
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    vae = AutoencoderKL(**{**TINY_VAE_CONFIG, **overrides})
    vae.save_pretrained(folder)
    return folder


# Tiny stand-ins for the other tokenizers (issue #23), each saved with save_pretrained so the real loading runs:
# FLUX's geometry and factors (16 channels at f8, shift 0.1159, scale 0.3611); VA-VAE's (32 channels at f16)
# with per-channel latents_mean / latents_std in its config (diffusers' convention, as Qwen-Image's VAE carries
# them); DC-AE's (an AutoencoderDC, 32 channels at f32, encode(x).latent, scale 0.41407).
TINY_KL16_F8 = dict(latent_channels=16, shift_factor=0.1159, scaling_factor=0.3611)
TINY_KL32_F16 = dict(latent_channels=32, down_block_types=("DownEncoderBlock2D",) * 5,
                     up_block_types=("UpDecoderBlock2D",) * 5, block_out_channels=(8, 8, 16, 16, 16),
                     scaling_factor=1.0, latents_mean=[round(0.02 * (c - 16), 4) for c in range(32)],
                     latents_std=[round(0.9 + 0.01 * c, 4) for c in range(32)])
TINY_DC_CONFIG = dict(
    in_channels=3, latent_channels=32, attention_head_dim=8, encoder_block_types="ResBlock",
    decoder_block_types="ResBlock", encoder_block_out_channels=(8, 8, 16, 16, 32, 32),
    decoder_block_out_channels=(8, 8, 16, 16, 32, 32), encoder_layers_per_block=(1,) * 6,
    decoder_layers_per_block=(1,) * 6, encoder_qkv_multiscales=((),) * 6, decoder_qkv_multiscales=((),) * 6,
    scaling_factor=0.41407,
)


def has_autoencoder_dc() -> bool:
    """Whether the installed diffusers has AutoencoderDC (0.32 on; `make test-min-deps` runs 0.29)."""
    import diffusers

    return getattr(diffusers, "AutoencoderDC", None) is not None


def make_tiny_dc(folder: Path, seed: int = 0, **overrides) -> Path:
    """A tiny random AutoencoderDC (32 latent channels at f32), saved with save_pretrained."""
    import safetensors.torch  # noqa: F401  (common/vae.py)
    import torch
    from diffusers import AutoencoderDC

    torch.manual_seed(seed)
    AutoencoderDC(**{**TINY_DC_CONFIG, **overrides}).save_pretrained(folder)
    return folder


def draw_image(label: int, index: int, size: tuple[int, int] = (48, 40)):
    """A deterministic, class-distinct RGB PIL image (class sets the hue, index the pattern)."""
    from PIL import Image

    w, h = size
    yy, xx = np.mgrid[0:h, 0:w]
    rng = np.random.default_rng(label * 1000 + index)
    base = np.array([(label * 97) % 256, (label * 57 + 80) % 256, (label * 31 + 160) % 256], np.float64)
    wave = 60 * np.sin((xx + index * 3) / (3 + label)) + 40 * np.cos(yy / (2 + index % 4))
    img = base[None, None, :] + wave[..., None] + rng.normal(0, 8, (h, w, 3))
    return Image.fromarray(np.clip(img, 0, 255).astype(np.uint8), "RGB")


def make_image_tree(root: Path, counts: Sequence[int] = (3, 2, 4), ext: str = ".JPEG",
                    size: tuple[int, int] = (48, 40)) -> Path:
    """Class folders c000, c001, ... with counts[i] images each (count 0 = empty class folder)."""
    for label, n in enumerate(counts):
        d = root / f"c{label:03d}"
        d.mkdir(parents=True, exist_ok=True)
        for i in range(n):
            fmt = "JPEG" if ext.lower() in (".jpeg", ".jpg") else ext.lstrip(".").upper()
            draw_image(label, i, size).save(d / f"img{i:04d}{ext}", format=fmt, quality=95)
    return root


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cli_env(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env.pop("WORLD_SIZE", None)
    env.pop("RANK", None)
    for k in [k for k in env if k.startswith("SLURM_")]:  # the suite inside a Slurm job: one process per test
        del env[k]
    # One thread per CLI process (the box is small); make test-determinism sets DIT_TEST_CLI_THREADS=2 to
    # prove that the outputs do not depend on it.
    threads = os.environ.get("DIT_TEST_CLI_THREADS", "1")
    env.update({"PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": threads,
                "TOKENIZERS_PARALLELISM": "false"})
    env.update(extra or {})
    return env


def run_cli(cmd: str, args: Sequence[str], *, env: dict | None = None, timeout: float = 300,
            cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run a console script (dit-extract, dit-train, ...) of this venv; returns the completed process."""
    return subprocess.run([str(BIN / cmd), *map(str, args)], capture_output=True, text=True,
                          env=cli_env(env), timeout=timeout, cwd=cwd)


def torchrun_cmd(cmd: str, args: Sequence[str], nproc: int = 2, *, nnodes: int = 1,
                 node_rank: int | None = None, port: int | None = None) -> list[str]:
    """argv that runs a console script under torchrun with `nproc` CPU (gloo) processes."""
    port = port or free_port()
    launch = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}"]
    if nnodes == 1:
        launch += ["--standalone"] if port is None else [f"--master-addr=127.0.0.1", f"--master-port={port}"]
    else:
        launch += [f"--nnodes={nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
                   "--rdzv-id=dit-test"]
        if node_rank is not None:
            launch += [f"--node-rank={node_rank}"]
    return [*launch, str(BIN / cmd), *map(str, args)]


def rank_pids(launcher_pid: int) -> dict[int, int]:
    """{rank: pid} of the processes a torchrun process started (by their RANK variable; Linux /proc)."""
    from dit_pipeline.train.launch import _children

    ranks = {}
    for pid in _children(launcher_pid):
        try:
            raw = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        env = dict(e.split(b"=", 1) for e in raw.split(b"\0") if b"=" in e)
        if b"RANK" in env:
            ranks[int(env[b"RANK"])] = pid
    return ranks


def run_torchrun(cmd: str, args: Sequence[str], nproc: int = 2, *, env: dict | None = None,
                 timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(torchrun_cmd(cmd, args, nproc), capture_output=True, text=True,
                          env=cli_env(env), timeout=timeout)


def srun_task_env(rank: int, ntasks: int, port: int, job_id: str = "777") -> dict[str, str]:
    """The environment `srun --ntasks N` gives task `rank` on this one host (no torchrun variables)."""
    return {"SLURM_JOB_ID": job_id, "SLURM_STEP_ID": "0", "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank),
            "SLURM_NODEID": "0", "SLURM_NTASKS": str(ntasks), "SLURM_STEP_NUM_TASKS": str(ntasks),
            "SLURM_NNODES": "1", "SLURM_STEP_NUM_NODES": "1", "SLURM_STEP_NODELIST": "localhost",
            "SLURM_JOB_NODELIST": "localhost", "SLURM_STEP_TASKS_PER_NODE": str(ntasks),
            "SLURM_TASKS_PER_NODE": str(ntasks), "SLURM_LAUNCH_NODE_IPADDR": "127.0.0.1",
            "MASTER_PORT": str(port)}  # a free port: the job-id port could be taken on a shared test machine


def run_srun(cmd: str, args: Sequence[str], ntasks: int = 2, *, env: dict | None = None,
             timeout: float = 300) -> list[subprocess.CompletedProcess]:
    """Run a console script as `srun --ntasks ntasks` would on one host: `ntasks` processes started at once,
    each with its task's SLURM_* environment; returns each task's completed process (rank order)."""
    port = free_port()
    argv = [str(BIN / cmd), *map(str, args)]
    procs = [subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=cli_env({**srun_task_env(r, ntasks, port), **(env or {})}))
             for r in range(ntasks)]
    done = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            done.append(subprocess.CompletedProcess(argv, p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return done


TINY_TEACHER = {"embed_dim": 32, "depth": 2, "num_heads": 2}  # a DINOv2-architecture ViT of width 32


def make_tiny_teacher(path: Path, seed: int = 0) -> Path:
    """A tiny random DINOv2-architecture teacher (ViT, patch 14, width 32, 2 blocks) as a .safetensors file that
    `dit-train --repa PATH` loads (common.teacher.save_teacher: the architecture travels in its metadata)."""
    import timm
    import torch

    from dit_pipeline.common.teacher import TeacherArch, save_teacher

    arch = TeacherArch("vit_base_patch14_dinov2", "tiny_pretrain.pth", "none/tiny-dinov2", label="tiny DINOv2",
                       overrides=TINY_TEACHER)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = timm.create_model(arch.timm_name, pretrained=False, num_classes=0, img_size=14 * 4, **TINY_TEACHER)
        sd = {k: v.clone() for k, v in model.state_dict().items()}
        g = torch.Generator().manual_seed(seed + 1)
        for k in sd:  # layer scales of order 1 (timm starts them at 1e-5), so every block counts
            if k.endswith("gamma"):
                sd[k] = torch.randn(sd[k].shape, generator=g) * 0.5
    return save_teacher(path, sd, arch)


def straight_killed_resumed(make_args, root: Path, steps: int, keys: Sequence[str], *, kill_at: int = 3,
                            kept: Sequence[int] = (2,), timeout: float = 600) -> tuple[Path, dict, dict]:
    """A 2-rank `dit-train` run straight through, and the same run killed with SIGKILL after step `kill_at` (the
    checkpoints `kept` on disk) then resumed; asserts both runs logged the same values of `keys` at every step
    (exact floats). make_args(run_dir) -> the argument list. Returns (the straight run's folder, its newest
    checkpoint, the resumed run's newest checkpoint) for the caller's state comparisons."""
    from dit_pipeline.train.checkpoint import CheckpointManager, load_checkpoint
    from dit_pipeline.train.metrics import read_metrics

    straight, resumed = root / "straight", root / "resumed"
    r = run_torchrun("dit-train", make_args(straight), 2, timeout=timeout)
    assert r.returncode == 0, r.stderr[-3000:]
    args = make_args(resumed)
    r = run_torchrun("dit-train", args, 2, env={"DIT_FAULT": f"train.step_end@{kill_at}:kill"}, timeout=timeout)
    assert r.returncode != 0 and CheckpointManager(resumed / "checkpoints").steps() == list(kept), r.stderr[-3000:]
    r = run_torchrun("dit-train", args, 2, timeout=timeout)
    assert r.returncode == 0, r.stderr[-3000:]
    want = [tuple(rec[k] for k in keys) for rec in read_metrics(straight)]
    assert [w[0] for w in want] == list(range(1, steps + 1))
    assert [tuple(rec[k] for k in keys) for rec in read_metrics(resumed)] == want  # exact floats
    return (straight, load_checkpoint(CheckpointManager(straight / "checkpoints").latest()),
            load_checkpoint(CheckpointManager(resumed / "checkpoints").latest()))
