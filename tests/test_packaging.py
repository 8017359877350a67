"""One import package: the wheel installs `dit_pipeline` only, and the suite never imports the folders by their bare
names (`dit`, `train`, ...), which would load the same code twice under two names."""
from __future__ import annotations

import ast
import subprocess
import sys
import zipfile

import pytest

from tests._util import REPO

FOLDERS = ("cli", "common", "dit", "evaluate", "extract", "sample", "shards", "train")


@pytest.mark.timeout(600)
def test_wheel_installs_one_top_level_package(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "-w", str(tmp_path), str(REPO)], check=True, capture_output=True, cwd=tmp_path)
    (wheel,) = tmp_path.glob("dit_pipeline-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names}
    assert {t for t in top if not t.endswith(".dist-info")} == {"dit_pipeline"}
    for folder in FOLDERS[1:]:
        assert f"dit_pipeline/{folder}/__init__.py" in names
    assert {"dit_pipeline/cli.py", "dit_pipeline/cli_kit.py", "dit_pipeline/cli_eval.py", "dit_pipeline/cli_sample.py"} <= set(names)
    assert not any(n.startswith(("dit_pipeline/tests/", "dit_pipeline/bench/", "dit_pipeline/examples/"))
                   for n in names)
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "dit-train = dit_pipeline.cli:train_main" in text


def test_no_code_imports_a_folder_by_its_bare_name():
    """Every import of the project's code, in the package, tests, bench and examples, goes through dit_pipeline."""
    offenders = []
    for path in REPO.rglob("*.py"):
        if any(part.startswith(".") or part in ("build", "dist") for part in path.relative_to(REPO).parts):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                mods = [node.module]
            else:
                continue
            offenders += [f"{path.relative_to(REPO)}:{node.lineno} {m}" for m in mods if m.split(".")[0] in FOLDERS]
    assert offenders == []
