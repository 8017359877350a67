"""Sample quality as papers report it: FID, sFID, Inception Score, precision and recall (`dit-eval`), defined
as the ADM evaluator (openai/guided-diffusion `evaluations/evaluator.py`) defines them, on a TF-FID-compatible
InceptionV3 in PyTorch; plus the trainer hook that logs them during training (evaluate/hook.py)."""
from dit_pipeline.evaluate.metrics import (Statistics, frechet_distance, inception_score, manifold_radii,
                                           precision_recall, statistics)
from dit_pipeline.evaluate.config import EvalConfig
from dit_pipeline.evaluate.run import format_result, main, run_eval

__all__ = ["EvalConfig", "Statistics", "format_result", "frechet_distance", "inception_score", "main", "manifold_radii",
           "precision_recall", "run_eval", "statistics"]
