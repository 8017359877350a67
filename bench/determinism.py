"""Measure what is NOT promised bit for bit: how far results move with threads, batch shape and kernels.

On the test fixtures (the tiny VAE and tiny DiT of tests/, so it runs anywhere in seconds to minutes):

  extract   the shard arrays (posterior means) with cpu_threads 2 vs 1 and batch_size 3 and 1 vs 4,
            stored as float32 and float16: max |difference|, in float eps of the largest value, and the
            fraction of values that differ
  sample    sample_grid images (uint8) at batch 1 and 3 vs all in one batch (DDPM, 50 steps): max level
            difference and the fraction that differ; the CFG model on [x; x] vs the plain model on x
            (the unguided channels): max |difference| in float32 eps of the largest output

Each line is one JSON record. Run it again under ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2
ATEN_CPU_CAPABILITY=avx2 and with `--compare-to` the first run's folder to measure the instruction set.

    python bench/determinism.py --work /tmp/det-a
    ONEDNN_MAX_CPU_ISA=AVX2 ... python bench/determinism.py --work /tmp/det-b --compare-to /tmp/det-a
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench._checkout import use_checkout  # noqa: E402

use_checkout()

import torch  # noqa: E402

from dit_pipeline.extract import ExtractConfig, run_extract  # noqa: E402
from dit_pipeline.shards import iter_shard, read_manifest  # noqa: E402
from tests._util import make_image_tree, make_tiny_vae  # noqa: E402

DTYPES = ("float32", "float16")


def _means(out: Path) -> np.ndarray:
    m = read_manifest(out)
    rows = {s.key: s.mean for sh in m.shards for s in iter_shard(out / sh.name)}
    return np.stack([rows[k] for k in sorted(rows)])


def _diff(a: np.ndarray, b: np.ndarray, eps: float) -> dict:
    d = np.abs(a.astype(np.float64) - b.astype(np.float64))
    return {"max_abs": float(d.max()), "max_in_eps_of_largest": float(d.max() / (eps * np.abs(a).max())),
            "fraction_differ": float((d > 0).mean())}


def extract(work: Path, compare_to: Path | None) -> None:
    tree, vae = work / "images", work / "vae"
    if not tree.exists():
        make_image_tree(tree, counts=(6, 6), size=(80, 72))
    if not vae.exists():
        make_tiny_vae(vae)
    for dtype in DTYPES:
        eps = float(np.finfo(dtype).eps)

        def run(name: str, **kw) -> np.ndarray:
            out = work / f"{name}-{dtype}"
            run_extract(ExtractConfig(data_path=str(tree), out=str(out), vae=str(vae), image_size=64,
                                      samples_per_shard=6, num_workers=0, quiet=True, dtype=dtype, overwrite=True,
                                      **kw))
            return _means(out)

        base = run("base", batch_size=4, cpu_threads=1)
        for name, kw in [("cpu_threads 2", dict(batch_size=4, cpu_threads=2)),
                         ("batch_size 3", dict(batch_size=3, cpu_threads=1)),
                         ("batch_size 1", dict(batch_size=1, cpu_threads=1))]:
            other = run(name.replace(" ", ""), **kw)
            print(json.dumps({"what": "extract", "dtype": dtype, "vs_base": name, **_diff(base, other, eps)}))
        if compare_to is not None:
            print(json.dumps({"what": "extract", "dtype": dtype, "vs_base": f"run in {compare_to}",
                              **_diff(_means(compare_to / f"base-{dtype}"), base, eps)}))


def sample(work: Path) -> None:
    from dit_pipeline.common.vae import load_vae
    from dit_pipeline.sample.generate import guided_model_fn
    from dit_pipeline.sample.grid import sample_grid
    from tests.sample.conftest import random_dit

    vae, _ = load_vae(str(work / "vae"))
    model = random_dit(10)
    kwargs = dict(vae=vae, scaling_factor=0.5, class_labels=list(range(10)) * 2, seed=5, steps=50, sampler="ddpm")
    whole = sample_grid(model, **kwargs)
    for batch in (1, 3):
        d = np.abs(sample_grid(model, batch_size=batch, **kwargs).astype(np.int16) - whole.astype(np.int16))
        print(json.dumps({"what": "sample uint8", "vs": f"batch {batch} vs 20", "max_levels": int(d.max()),
                          "fraction_differ": float((d > 0).mean()), "values": int(d.size)}))
    g = torch.Generator().manual_seed(0)
    x, t, y = torch.randn(2, 4, 4, 4, generator=g), torch.tensor([5, 500]), torch.tensor([1, 2])
    with torch.no_grad():
        plain, guided = model(x, t, y), guided_model_fn(model, cfg_scale=3.0)(x, t, y)
    print(json.dumps({"what": "cfg [x; x] vs x, unguided channels",
                      **_diff(plain[:, 3:].numpy(), guided[:, 3:].numpy(), float(torch.finfo(torch.float32).eps))}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", type=Path, required=True, help="folder for images, VAE and shard sets")
    p.add_argument("--compare-to", type=Path, default=None, help="--work folder of an earlier run")
    args = p.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    print(json.dumps({"torch": torch.__version__, "threads_at_start": torch.get_num_threads(),
                      "isa": torch.backends.cpu.get_cpu_capability()}))
    extract(args.work, args.compare_to)
    sample(args.work)


if __name__ == "__main__":
    main()
