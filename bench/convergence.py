"""Convergence proxy on a CPU in minutes: DDPM vs flow matching (uniform / logit-normal t) and each DiT
block option, at equal training compute, on class-conditional latents whose true distribution is known.

Data: K classes of C x S x S "latents", class k Gaussian with mean m_k and covariance A_k A_k^T + s^2 I
(rank-r structure plus isotropic noise), all drawn once from --data-seed. Every training batch is a fresh
draw from the true distribution (labels uniform), identical across variants (same seeds).
Model: the same small DiT for every variant (depth, width, patch from the flags); AdamW, constant lr, EMA.
Equal compute: the same steps x batch; the flow model's output layer is C instead of 2C channels wide (SiT).
Metric: per-class Frechet distance between --eval-samples generated latents (EMA weights, no guidance) and
the TRUE class Gaussian, averaged over classes, at --eval-every steps. Samplers with the same number of
network evaluations: DDIM (DiT's deterministic sampler) for ddpm, Euler for flow, --eval-steps each.
`floor` is the FD of as many TRUE samples (the estimator's own bias at that sample size).

    python bench/convergence.py --out bench/results/convergence        # ~ minutes on 2 CPU cores
    python bench/convergence.py --variants ddpm flow-uniform --steps 500 --seeds 1   # quicker look
    python bench/convergence.py --merge OUT1 OUT2 --out OUT   # one plot and table from runs made in parallel
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _checkout import use_checkout  # noqa: E402

use_checkout()

import torch  # noqa: E402

from dit_pipeline import dit  # noqa: E402

VARIANTS = {  # name -> (objective, t sampling, block options)
    "ddpm": ("ddpm", "uniform", {}),
    "flow-uniform": ("flow", "uniform", {}),
    "flow-logit-normal": ("flow", "logit-normal", {}),
    "flow-ln+qk_norm": ("flow", "logit-normal", {"qk_norm": True}),
    "flow-ln+rms_norm": ("flow", "logit-normal", {"rms_norm": True}),
    "flow-ln+swiglu": ("flow", "logit-normal", {"swiglu": True}),
    "flow-ln+rope": ("flow", "logit-normal", {"rope": True}),
    "ddpm+all": ("ddpm", "uniform", {"qk_norm": True, "rms_norm": True, "swiglu": True, "rope": True}),
    "flow-ln+all": ("flow", "logit-normal", {"qk_norm": True, "rms_norm": True, "swiglu": True, "rope": True}),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--ema", type=float, default=0.99)
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--eval-samples", type=int, default=512, help="generated latents per class")
    p.add_argument("--eval-steps", type=int, default=50, help="sampler steps (network evaluations)")
    p.add_argument("--classes", type=int, default=4)
    p.add_argument("--channels", type=int, default=4)
    p.add_argument("--size", type=int, default=4, help="latent height = width")
    p.add_argument("--rank", type=int, default=4, help="rank of each class's covariance structure")
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--patch", type=int, default=2)
    p.add_argument("--seeds", type=int, default=2, help="training seeds per variant (curves are their mean)")
    p.add_argument("--data-seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: no spin-waiting on a shared machine)")
    p.add_argument("--out", default="bench/results/convergence", help="folder for results.json and curves.png")
    p.add_argument("--merge", nargs="+", default=None, metavar="DIR",
                   help="only merge the results.json of these folders (same setup) into --out, plot and print")
    return p.parse_args(argv)


class ClassGaussians:
    """The known data distribution: class k ~ N(m_k, A_k A_k^T + s^2 I) over flattened C x S x S latents."""

    def __init__(self, classes: int, shape: tuple[int, int, int], rank: int, seed: int, noise: float = 0.2):
        g = torch.Generator().manual_seed(seed)
        d = int(np.prod(shape))
        self.shape, self.classes, self.noise = shape, classes, noise
        self.means = torch.randn(classes, d, generator=g, dtype=torch.float64)  # [K, D]
        self.factors = 0.7 * torch.randn(classes, d, rank, generator=g, dtype=torch.float64)  # [K, D, r]
        eye = torch.eye(d, dtype=torch.float64)
        self.covs = self.factors @ self.factors.transpose(1, 2) + noise ** 2 * eye  # [K, D, D]

    def sample(self, labels: torch.Tensor, g: torch.Generator) -> torch.Tensor:
        """Latents [N, C, S, S] float32 for labels [N]."""
        n, r = labels.shape[0], self.factors.shape[2]
        z = torch.randn(n, r, generator=g, dtype=torch.float64)
        e = torch.randn(n, self.means.shape[1], generator=g, dtype=torch.float64)
        x = self.means[labels] + (self.factors[labels] @ z[:, :, None])[:, :, 0] + self.noise * e
        return x.float().reshape(n, *self.shape)


def frechet_to_gaussian(x: np.ndarray, mean: np.ndarray, cov: np.ndarray) -> float:
    """||mu_x - m||^2 + tr(S_x + S - 2 (S_x^1/2 S S_x^1/2)^1/2) for samples x [N, D] (float64)."""
    mu, sx = x.mean(axis=0), np.cov(x, rowvar=False)
    w, v = np.linalg.eigh(sx)
    root = (v * np.sqrt(np.clip(w, 0, None))) @ v.T
    inner = np.linalg.eigvalsh(root @ cov @ root)
    return float(((mu - mean) ** 2).sum() + np.trace(sx) + np.trace(cov) - 2 * np.sqrt(np.clip(inner, 0, None)).sum())


@torch.no_grad()
def generate(model: dit.DiT, objective: str, label: int, n: int, steps: int, seed: int) -> torch.Tensor:
    shape = (n, model.in_channels, model.input_size, model.input_size)
    noise = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    y = torch.full((n,), label, dtype=torch.long)
    if objective == "flow":
        return dit.create_flow().sample_loop(model, noise, sampler="euler", steps=steps, model_kwargs={"y": y})
    diffusion = dit.create_diffusion(f"ddim{steps}")
    return diffusion.ddim_sample_loop(model, shape, noise=noise, model_kwargs={"y": y})


def evaluate(model: dit.DiT, objective: str, data: ClassGaussians, args) -> list[float]:
    out = []
    for k in range(data.classes):
        x = generate(model, objective, k, args.eval_samples, args.eval_steps, seed=1000 + k)
        out.append(frechet_to_gaussian(x.reshape(x.shape[0], -1).double().numpy(), data.means[k].numpy(),
                                       data.covs[k].numpy()))
    return out


def train_variant(name: str, seed: int, data: ClassGaussians, args) -> dict:
    objective, t_sampling, options = VARIANTS[name]
    torch.manual_seed(seed)
    model = dit.DiT(input_size=args.size, patch_size=args.patch, in_channels=args.channels, hidden_size=args.hidden,
                    depth=args.depth, num_heads=args.heads, num_classes=args.classes,
                    learn_sigma=objective == "ddpm", **options)
    ema = dit.DiT(**{k: v for k, v in model.config.items() if k != "model"}).eval().requires_grad_(False)
    ema.load_state_dict(model.state_dict())
    loss_fn = dit.create_flow(t_sampling) if objective == "flow" else dit.create_diffusion("")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(10_000 + seed)  # data, t and noise: the same stream for every variant
    curve, start = [], time.perf_counter()
    for step in range(1, args.steps + 1):
        labels = torch.randint(0, args.classes, (args.batch,), generator=g)
        x = data.sample(labels, g)
        t = loss_fn.draw_timesteps(args.batch, generator=g)
        noise = torch.randn(x.shape, generator=g)
        loss = loss_fn.training_losses(model, x, t, model_kwargs={"y": labels}, noise=noise)["loss"].mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        with torch.no_grad():
            for e, p in zip(ema.parameters(), model.parameters()):
                e.lerp_(p, 1 - args.ema)
        if step % args.eval_every == 0 or step == args.steps:
            fd = evaluate(ema, objective, data, args)
            curve.append({"step": step, "fd": fd, "fd_mean": float(np.mean(fd)), "loss": float(loss.detach())})
            print(f"{name} seed {seed} step {step}: FD {np.mean(fd):.3f} (per class "
                  f"{', '.join(f'{v:.2f}' for v in fd)}), {time.perf_counter() - start:.0f}s", flush=True)
    return {"variant": name, "seed": seed, "curve": curve, "seconds": time.perf_counter() - start}


def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for name, runs in results["variants"].items():
        steps = [p["step"] for p in runs[0]["curve"]]
        mean = np.mean([[p["fd_mean"] for p in r["curve"]] for r in runs], axis=0)
        ax.plot(steps, mean, marker="o", label=name, linestyle="--" if name.startswith("ddpm") else "-")
    ax.axhline(results["floor"], color="gray", linewidth=0.8, label="floor (true samples)")
    ax.set_yscale("log")
    ax.set_xlabel("training step (equal compute: same batch and model)")
    ax.set_ylabel("Frechet distance to the true class Gaussians (mean over classes)")
    ax.set_title("Convergence proxy: " + results["setup"].replace(", batch", ",\nbatch"), fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.merge:
        merge(args.merge, Path(args.out))
        return
    torch.set_num_threads(args.threads)
    shape = (args.channels, args.size, args.size)
    data = ClassGaussians(args.classes, shape, args.rank, args.data_seed)
    g = torch.Generator().manual_seed(99)
    floor = float(np.mean([frechet_to_gaussian(
        data.sample(torch.full((args.eval_samples,), k), g).reshape(args.eval_samples, -1).double().numpy(),
        data.means[k].numpy(), data.covs[k].numpy()) for k in range(args.classes)]))
    setup = (f"DiT depth {args.depth} width {args.hidden} patch {args.patch}, {args.classes} classes of "
             f"{'x'.join(map(str, shape))} latents, batch {args.batch}, lr {args.lr}, EMA {args.ema}")
    print(f"# {setup}; FD floor at {args.eval_samples} samples: {floor:.3f}", flush=True)
    results = {"setup": setup, "args": vars(args), "floor": floor, "variants": {}}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in args.variants:
        results["variants"][name] = [train_variant(name, seed, data, args) for seed in range(args.seeds)]
        (out / "results.json").write_text(json.dumps(results, indent=1))
    plot(results, out / "curves.png")
    print_table(results)


def merge(folders: list[str], out: Path) -> None:
    parts = [json.loads((Path(f) / "results.json").read_text()) for f in folders]
    if len({p["setup"] for p in parts}) != 1:
        raise SystemExit("--merge: the runs have different setups: " + "; ".join({p["setup"] for p in parts}))
    results = {**parts[0], "floor": float(np.mean([p["floor"] for p in parts])), "variants": {}}
    for p in parts:
        results["variants"].update(p["variants"])
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    plot(results, out / "curves.png")
    print_table(results)


def print_table(results: dict) -> None:
    names = list(results["variants"])
    steps = [p["step"] for p in results["variants"][names[0]][0]["curve"]]
    print("| variant | " + " | ".join(f"FD @ {s}" for s in steps) + " | s / run |")
    print("|---|" + "---|" * (len(steps) + 1))
    for name in names:
        runs = results["variants"][name]
        mean = np.mean([[p["fd_mean"] for p in r["curve"]] for r in runs], axis=0)
        secs = np.mean([r["seconds"] for r in runs])
        print(f"| {name} | " + " | ".join(f"{v:.3f}" for v in mean) + f" | {secs:.0f} |")
    print(f"| floor (true samples) | {results['floor']:.3f} |")


if __name__ == "__main__":
    main()
