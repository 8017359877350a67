"""What every training objective shares (dit/objectives.py lists them): the defaults of the trainer's interface, in a
module of their own so that the objectives (dit/diffusion.py, dit/flow.py, dit/meanflow.py) and the registry that
builds them import it without importing each other."""
from __future__ import annotations

from typing import Any


class ObjectiveDefaults:
    """What GaussianDiffusion and FlowMatching share with every objective: labels dropped where drawn, nothing to
    attach, and the validation loss (train/validation.py): the unweighted error term "mse" of the training loss
    at times the objective maps from noise levels (`val_times`, each objective's own)."""

    def drop_labels(self, drop: Any) -> Any:
        return drop

    def attach(self, model: Any, conditioning: Any = None) -> None:
        return None

    def val_times(self, levels: Any, device: Any) -> Any:
        """The objective's times [N] (or its time input's shape) of noise levels in [0, 1) (0 = data, 1 = noise):
        the fixed timesteps of the validation loss."""
        raise NotImplementedError(f"{type(self).__name__} has no validation times")

    def val_loss(self, model: Any, x: Any, t: Any, model_kwargs: Any, noise: Any) -> Any:
        """[N] the unweighted error of each sample at times `t` with fixed `noise` (no gradient needed)."""
        return self.training_losses(model, x, t, model_kwargs=model_kwargs, noise=noise)["mse"]  # type: ignore[attr-defined]
