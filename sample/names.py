"""Class names in `dit-sample --class-labels`: a class given by its name (the manifest's class folder, which our
checkpoints record as `latent.class_names`) is replaced by its id before anything else uses the labels, so the
run's record, its fingerprint and its npz hold ids only. `dit-train --sample-classes` takes them the same way.

A number is an id, unless the classes are named by numbers too and the name means another class (folders `1, 10,
2, 3`: id 1 is folder `10`): that is refused as ambiguous (issue 41), and `id:1` or `name:1` says which."""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from dit_pipeline.common.errors import UserError


class ExplicitId(int):
    """A class id written `id:N`: an id whatever the class names are (never ambiguous)."""


def parse_class_labels(value: str) -> list[int | str]:
    """'207,n01440764, 3' -> [207, 'n01440764', 3]: each comma-separated entry an id (an integer) or a name;
    'id:1' is the id 1 and 'name:1' the class named 1, whatever the names are."""
    out: list[int | str] = []
    for part in (p.strip() for p in value.split(",")):
        if part.startswith("id:") and part[3:].strip().lstrip("+-").isdigit():
            out.append(ExplicitId(int(part[3:])))
        elif part.startswith("name:"):
            out.append(part[5:].strip())
        elif part:
            out.append(int(part) if part.lstrip("+-").isdigit() else part)
    return out


def class_ids(given: Sequence[int | str], names: Sequence[str] | None, where: str,
              flag: str = "--class-labels") -> list[int]:
    """`given` with every name replaced by its id in `names` (the checkpoint's class names); UserError naming
    the unknown names (and a few known ones), or saying that `where` records no names."""
    wanted = [c for c in given if isinstance(c, str)]
    index = {str(n): i for i, n in enumerate(names or [])}
    for c in given:
        if isinstance(c, int) and not isinstance(c, ExplicitId) and str(c) in index and index[str(c)] != c:
            what = f"class id {c} is {names[c]!r}" if names and 0 <= c < len(names) else f"there is no class id {c}"
            raise UserError(f"{flag} {c} is ambiguous in {where}: {what}, and the class named {str(c)!r} has id "
                            f"{index[str(c)]}; write id:{c} or name:{c}")
    if not wanted:
        return [int(c) for c in given]
    if not names:
        raise UserError(f"{flag} {','.join(wanted)}: {where} records no class names (official release "
                        "files and EMA files without their sidecar have none); pass class ids")
    unknown = [c for c in wanted if c not in index]
    if unknown:
        shown = ", ".join(map(str, list(names)[:5])) + (", ..." if len(names) > 5 else "")
        raise UserError(f"{flag}: no class named {', '.join(map(repr, unknown))} in {where} "
                        f"({len(names)} classes: {shown}); pass names as the shard set's class folders are "
                        "called, or ids")
    return [index[c] if isinstance(c, str) else int(c) for c in given]


def with_class_ids(cfg: Any, latent: dict[str, Any] | None) -> Any:
    """A SampleConfig whose --class-labels hold ids only (see the module docstring)."""
    names = (latent or {}).get("class_names")
    if not cfg.class_labels or (not names and not any(isinstance(c, str) for c in cfg.class_labels)):
        return cfg
    ids = class_ids(cfg.class_labels, names, f"--ckpt {cfg.ckpt}")
    return dataclasses.replace(cfg, class_labels=ids)


def label_texts(labels: Sequence[int], names: Sequence[str] | None) -> list[str]:
    """A grid tile's label of each class: "id name" where the class names are known (the manifest's), else the id."""
    return [f"{int(c)} {names[int(c)]}" if names and 0 <= int(c) < len(names) else str(int(c)) for c in labels]
