"""What every training objective shares (dit/objectives.py lists them): the defaults of the trainer's interface, in a
module of their own so that the objectives (dit/diffusion.py, dit/flow.py, dit/meanflow.py) and the registry that
builds them import it without importing each other."""
from __future__ import annotations

from typing import Any


class ObjectiveDefaults:
    """What GaussianDiffusion and FlowMatching share with every objective: labels dropped where drawn, nothing to
    attach."""

    def drop_labels(self, drop: Any) -> Any:
        return drop

    def attach(self, model: Any, conditioning: Any = None) -> None:
        return None
