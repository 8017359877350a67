"""Class names in `dit-sample --class-labels`: a class given by its name (the manifest's class folder, which our
checkpoints record as `latent.class_names`) is replaced by its id before anything else uses the labels, so the
run's record, its fingerprint and its npz hold ids only."""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from dit_pipeline.common.errors import UserError


def parse_class_labels(value: str) -> list[int | str]:
    """'207,n01440764, 3' -> [207, 'n01440764', 3]: each comma-separated entry an id (an integer) or a name."""
    out: list[int | str] = []
    for part in (p.strip() for p in value.split(",")):
        if part:
            out.append(int(part) if part.lstrip("+-").isdigit() else part)
    return out


def class_ids(given: Sequence[int | str], names: Sequence[str] | None, where: str) -> list[int]:
    """`given` with every name replaced by its id in `names` (the checkpoint's class names); UserError naming
    the unknown names (and a few known ones), or saying that `where` records no names."""
    wanted = [c for c in given if isinstance(c, str)]
    if not wanted:
        return [int(c) for c in given]
    if not names:
        raise UserError(f"--class-labels {','.join(wanted)}: {where} records no class names (official release "
                        "files and EMA files without their sidecar have none); pass class ids")
    index = {str(n): i for i, n in enumerate(names)}
    unknown = [c for c in wanted if c not in index]
    if unknown:
        shown = ", ".join(map(str, list(names)[:5])) + (", ..." if len(names) > 5 else "")
        raise UserError(f"--class-labels: no class named {', '.join(map(repr, unknown))} in {where} "
                        f"({len(names)} classes: {shown}); pass names as the shard set's class folders are "
                        "called, or ids")
    return [index[c] if isinstance(c, str) else int(c) for c in given]


def with_class_ids(cfg: Any, latent: dict[str, Any] | None) -> Any:
    """A SampleConfig whose --class-labels hold ids only (see the module docstring)."""
    if not cfg.class_labels or not any(isinstance(c, str) for c in cfg.class_labels):
        return cfg
    ids = class_ids(cfg.class_labels, (latent or {}).get("class_names"), f"--ckpt {cfg.ckpt}")
    return dataclasses.replace(cfg, class_labels=ids)
