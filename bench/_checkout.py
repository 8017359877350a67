"""Make a checkout importable as `dit_pipeline` without installing it (bench scripts run from any tree).

The installed package maps the repository root to `dit_pipeline` (pyproject's package-dir); a bench run from a
plain checkout, e.g. on a GPU machine, gets the same mapping here. An installed `dit_pipeline` is left alone
unless `tree` is given explicitly.
"""
from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def use_checkout(tree: Path | None = None) -> None:
    """Import `dit_pipeline` from `tree` (default: this checkout, unless an installed one is importable)."""
    if tree is None and "dit_pipeline" not in sys.modules and importlib.util.find_spec("dit_pipeline") is not None:
        return
    pkg = types.ModuleType("dit_pipeline")
    pkg.__path__ = [str((tree or ROOT).resolve())]
    sys.modules["dit_pipeline"] = pkg
