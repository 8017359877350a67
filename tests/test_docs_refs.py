"""The project stands alone: every citation of the facts page points at the project's own docs/REFERENCE.md,
which cites the papers and upstream repositories it draws on."""
from __future__ import annotations

import re

from tests._util import REPO


def _project_files():
    for path in REPO.rglob("*"):
        rel = path.relative_to(REPO)
        if path.suffix in (".py", ".md") and path.name != "test_docs_refs.py" and not any(p.startswith(".") or p in ("build", "dist") for p in rel.parts):
            yield rel, path.read_text(encoding="utf-8")


def test_every_reference_citation_resolves_to_docs_reference():
    bare = []
    for rel, text in _project_files():
        for m in re.finditer(r"[\w./-]*REFERENCE\.md", text):
            ok = m.group(0) == "docs/REFERENCE.md" or (rel.parts[0] == "docs" and m.group(0) == "REFERENCE.md")
            if not ok:
                bare.append(f"{rel}: {m.group(0)}")
    assert bare == []
    assert (REPO / "docs" / "REFERENCE.md").is_file()


def test_reference_cites_its_sources_and_nothing_outside_the_project():
    text = (REPO / "docs" / "REFERENCE.md").read_text(encoding="utf-8")
    for source in ("arXiv:2212.09748", "arXiv:2102.09672", "arXiv:2105.05233", "github.com/facebookresearch/DiT",
                   "github.com/openai/improved-diffusion", "github.com/openai/guided-diffusion"):
        assert source in text
    for rel, body in _project_files():
        outside = [w for w in ("../" + "shared", "shared" + "/docs") if w in body]
        assert outside == [], rel
