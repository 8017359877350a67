"""What makes extraction and sampling bit-reproducible: the same tensor shapes, the same thread count.

Float kernels (oneDNN/MKL on CPU, cuBLAS/cuDNN on GPU) pick their algorithm, blocking and reduction order
by tensor shape and, on CPU, by how many threads split the work. So the identities the docs promise rest
on two design rules, not on one CPU's luck:

- Fixed shapes: the work is cut into fixed global chunks (a shard's batches, a sample run's batches)
  that do not depend on the number of ranks or on interruptions; a rank computes whole chunks and a
  killed run redoes whole chunks.
- Fixed threads: on CPU the numerically sensitive compute (VAE encode, DiT sampling, VAE decode) runs
  with a pinned number of intra-op threads (`--cpu-threads`, default `DEFAULT_CPU_THREADS`), recorded
  with the run, instead of whatever `OMP_NUM_THREADS` or torchrun (1 thread per process when it starts
  several) happen to give. On CUDA, cuDNN runs deterministic algorithms without autotuning; the thread
  count does not enter.

Across CPU models, instruction sets (AVX2 vs AVX-512), GPU models or library versions nothing is
promised bit for bit: docs/FORMAT.md and docs/sampling.md state the measured tolerances.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

# One thread: the count every launch can give (torchrun gives one per process when it starts several),
# and the numerically safest; to use more cores on CPU, start more ranks (same bytes by design).
DEFAULT_CPU_THREADS = 1


def deterministic_cuda() -> None:
    """cuDNN: deterministic algorithms, no autotuning (which may pick another kernel run to run).

    cuBLAS matmuls are bit-reproducible for the same shapes on one GPU model and stream (NVIDIA's cuBLAS
    reproducibility notes); cuDNN's `deterministic` makes convolutions so as well.
    """
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True


@contextlib.contextmanager
def pinned_threads(device: torch.device, threads: int) -> Iterator[None]:
    """Run the enclosed compute with exactly `threads` intra-op threads on CPU; restore the count after.

    A no-op on CUDA (the host threads do not change GPU results).
    """
    if device.type != "cpu":
        yield
        return
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)
