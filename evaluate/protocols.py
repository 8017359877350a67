"""The evaluation protocols 2025-26 papers publish their FIDs with, as data (`dit-eval --protocol NAME`).

The same samples give different numbers under different protocols (iMF-XL/2: FID 1.80 under ADM's evaluator,
1.72 under iMF's own; Lyy-iiis/imeanflow issue #5), so every number this package prints or writes names the
protocol that produced it. A protocol is the release's whole chain from uint8 images to its numbers, read from its
code: the Inception network and its input resize, the Inception Score rule, the FID formula, the statistics keys
it reads from a reference file, and (for the sampler, which dit-eval cannot see) the image conversion and the
choice of classes it samples with.

- `adm`: openai/guided-diffusion `evaluations/evaluator.py` (DiT, SiT, REPA, LightningDiT, DDT, RAE): the TF graph
  `inception-2015-12-05` (ours in PyTorch, evaluate/inception.py), TF1 bilinear resize; IS over consecutive splits
  of 5000; FID, sFID, precision, recall; reference `mu`, `sigma` (`mu_s`, `sigma_s`).
- `nanogen`: End2End-Diffusion/diffusion-bench `src/eval/fid.py` (NanoGen / DiffusionBench): torch-fidelity's
  `inception-v3-compat` on uint8 NCHW (the optional `fidelity` extra), its `2048` and `logits_unbiased` outputs;
  FID with scipy's `sqrtm` (its trace computed here as evaluate.metrics does, equal in exact arithmetic); IS of the
  float32 softmax over rows permuted by `RandomState(0)`, 10 splits of N // 10 rows, logs with 1e-10 added;
  reference `mu`/`sigma` or `ref_mu`/`ref_sigma` (`calculate_gfid`). Its sampler (`src/eval/generation.py`)
  converts decoder output as `clamp(0, 1) * 255` truncated and draws one sample per validation image with its
  label.
- `imf`: Lyy-iiis/imeanflow `utils/fid_util.py` (iMF, MeanFlow in JAX): a JAX port of the same TF weights (jax-fid),
  run here as our network with iMF's resize (`utils/jax_fid/resize.py`: `grid_sample`, bilinear, border,
  align_corners=False, with the grid moved by 1/W - 1/299, i.e. TF1's source = destination * in / out), then
  (x - 128) / 128; FID from `np.linalg.eigvals` of sigma1 sigma2 (square roots as complex numbers, real part
  summed); IS of the softmax over rows permuted by `RandomState(2020)`, 10 splits of N // 10 rows, in float64 with
  1e-10 in the logs; reference `ref_mu`/`ref_sigma` (`get_reference`). Its sampler
  (`utils/sample_util.py`) converts as `clip(127.5 x + 128, 0, 255)` truncated, as DiT's.

Each protocol names its sampler's image conversion by the name the sampling protocols give it
(dit/image_conversions.py `CONVERSIONS`, read here through sample.config as the import rules allow: evaluate/ imports
common/ and sample/ only); `EvalProtocol.conversion` is that function, the one `dit-sample --protocol` applies.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from dit_pipeline.sample.config import CONVERSIONS, Conversion

@dataclass(frozen=True)
class ScoreRule:
    """How a release computes the Inception Score from the logits of the samples (bias-free, 1008 classes)."""

    splits: str              # "consecutive": splits of `split_size` rows; "permuted": `num_splits` of N // num_splits
    split_size: int = 5000   # consecutive
    num_splits: int = 10     # permuted: the remainder of N // num_splits is dropped
    seed: int | None = None  # permuted: np.random.RandomState(seed).permutation(N) first
    eps: float = 0.0         # added inside both logs (0: exact p log p, 0 log 0 = 0)
    dtype: str = "float64"   # the precision of the softmax and the KL terms


@dataclass(frozen=True)
class EvalProtocol:
    """One release's evaluation (see the module docstring). Every field is recorded with the numbers."""

    name: str
    title: str
    source: str                      # the release files it was read from
    network: str                     # "ours" (evaluate/inception.py) or "torch-fidelity" (evaluate/fidelity.py)
    resize: str                      # "tf1" (TF1 resize_bilinear) or "imf" (iMF's grid_sample resize)
    metrics: tuple[str, ...]         # what the release reports, in evaluate.run.METRIC_NAMES' keys
    fid_formula: str                 # "trace-sqrt" (ADM's and NanoGen's sqrtm, computed stably) or "eigvals" (iMF)
    score: ScoreRule
    ref_keys: tuple[str, ...]        # the statistics keys the release reads from its reference file
    reference: str                   # the reference the release publishes against
    image_conversion: str            # the release sampler's image conversion: a key of CONVERSIONS
    labels: str                      # how the release's sampler chooses the classes
    requires: str | None = None      # an optional extra it needs at run time

    @property
    def conversion(self) -> Conversion:
        """The image conversion of the release's sampler (dit/image_conversions.py), by its name."""
        return CONVERSIONS[self.image_conversion]

    def record(self) -> dict[str, Any]:
        return {**asdict(self), "score": asdict(self.score), "metrics": list(self.metrics),
                "ref_keys": list(self.ref_keys)}


PROTOCOLS: dict[str, EvalProtocol] = {p.name: p for p in (
    EvalProtocol(
        name="adm", title="ADM evaluator", source="openai/guided-diffusion evaluations/evaluator.py",
        network="ours", resize="tf1", metrics=("inception_score", "fid", "sfid", "precision", "recall"),
        fid_formula="trace-sqrt", score=ScoreRule("consecutive", split_size=5000),
        ref_keys=("mu", "sigma", "mu_s", "sigma_s"),
        reference="VIRTUAL_imagenet256_labeled.npz (statistics of the ImageNet training set, 10,000 images)",
        image_conversion="dit", labels="uniform draws (DiT's sample_ddp.py) or 50 per class, as the paper says"),
    EvalProtocol(
        name="nanogen", title="NanoGen / DiffusionBench", source="End2End-Diffusion/diffusion-bench src/eval/fid.py, "
        "src/eval/generation.py", network="torch-fidelity", resize="tf1", metrics=("inception_score", "fid"),
        fid_formula="trace-sqrt", score=ScoreRule("permuted", num_splits=10, seed=0, eps=1e-10, dtype="float32"),
        ref_keys=("mu", "sigma", "ref_mu", "ref_sigma"), reference="jit_in256_stats.npz (JiT's statistics file)",
        image_conversion="nanogen", labels="one sample per validation image, with its label",
        requires="fidelity"),
    EvalProtocol(
        name="imf", title="iMF (JAX)", source="Lyy-iiis/imeanflow utils/fid_util.py, utils/jax_fid/resize.py, "
        "utils/sample_util.py", network="ours", resize="imf", metrics=("inception_score", "fid"),
        fid_formula="eigvals", score=ScoreRule("permuted", num_splits=10, seed=2020, eps=1e-10, dtype="float64"),
        ref_keys=("ref_mu", "ref_sigma"),
        reference="imagenet_256_fid_stats.npz (iMF's statistics of the ImageNet training set, JAX Inception)",
        image_conversion="dit", labels="the release's fid sampler (classes by sample index)"),
)}
DEFAULT_PROTOCOL = "adm"


def parse_protocols(value: str | list[str] | tuple[str, ...]) -> list[str]:
    """"adm", "adm,imf", "all" or a list of names -> the names in order (ValueError for an unknown one)."""
    names = [v.strip() for v in (value.split(",") if isinstance(value, str) else value) if v.strip()]
    if names == ["all"]:
        return list(PROTOCOLS)
    bad = [n for n in names if n not in PROTOCOLS]
    if bad or not names:
        raise ValueError(f"--protocol {','.join(names) or repr(value)}: known protocols are "
                         f"{', '.join(PROTOCOLS)} (or all), comma-separated")
    return list(dict.fromkeys(names))


def describe(p: EvalProtocol) -> str:
    """The one-line name of a protocol as printed beside its numbers."""
    return f"{p.title} ({p.source.split(',')[0]})"
