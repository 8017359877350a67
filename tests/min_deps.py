"""Print the declared minimum versions of pyproject.toml's dependencies as pins (`make test-min-deps`).

`torch>=2.6` becomes `torch==2.6`: the runtime dependencies and the extras named on the command line are
installed at exactly their floors (pip resolves the rest), so the suite proves that the floors are true.
Usage: python tests/min_deps.py pyproject.toml [extra ...]
"""
from __future__ import annotations

import re
import sys

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    sys.exit("error: make test-min-deps needs Python >= 3.11 for the host interpreter (tomllib); "
             "set PYTHON=python3.11")

_REQ = re.compile(r"^\s*([A-Za-z0-9_.\-\[\]]+)\s*(>=|==)\s*([0-9][^,;\s]*)\s*$")


def pins(pyproject: str, extras: list[str]) -> list[str]:
    """`name==floor` for every dependency (and named extra); a dependency without a plain `>=` floor (or an
    exact `==` pin) is an error, since its minimum could not be proven."""
    with open(pyproject, "rb") as f:
        project = tomllib.load(f)["project"]
    reqs = list(project["dependencies"])
    for extra in extras:
        reqs += project["optional-dependencies"][extra]
    out = []
    for req in reqs:
        m = _REQ.match(req)
        if m is None:
            raise SystemExit(f"error: {req!r} has no single '>=' floor to pin")
        out.append(f"{m.group(1)}=={m.group(3)}")  # a pin (the type checker's) is its own floor
    return out


if __name__ == "__main__":
    print("\n".join(pins(sys.argv[1], sys.argv[2:])))
