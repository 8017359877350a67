"""docs/RELIABILITY.md stays true: every test it names exists, and every guarantee in its table names one."""
from __future__ import annotations

import re

from tests._util import REPO

DOC = REPO / "docs" / "RELIABILITY.md"
LINK = re.compile(r"(tests/[\w/]+\.py)::(\w+)")


def _guarantees(text: str) -> list[str]:
    """The rows of the table under "## Guarantees" (without its header)."""
    section = text.split("## Guarantees", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| failure")]
    return [r for r in rows if not set(r) <= set("|- ")]


def test_every_linked_test_exists():
    links = set(LINK.findall(DOC.read_text()))
    assert len(links) >= 40
    for path, name in sorted(links):
        source = (REPO / path).read_text()
        assert re.search(rf"^\s*def {name}\(", source, re.M), f"{path}::{name} is named but does not exist"


def test_every_guarantee_names_a_test():
    rows = _guarantees(DOC.read_text())
    assert len(rows) >= 20
    for row in rows:
        assert LINK.search(row), f"no test named for: {row[:100]}"
