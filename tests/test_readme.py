"""The README's commands and code, exercised where they can run on a CPU."""
from __future__ import annotations

import re
from pathlib import Path

import torch

import dit
from tests._util import REPO

README = (REPO / "README.md").read_text()


def _block_after(heading: str, lang: str) -> str:
    section = README[README.index(heading):]
    m = re.search(rf"```{lang}\n(.*?)```", section, re.S)
    assert m, f"no ```{lang} block after {heading!r}"
    return m.group(1)


def test_python_api_snippet_runs(tmp_path, monkeypatch):
    """The 'Python API' block, run as written but with a tiny model in place of DiT-XL/2 and few steps."""
    code = _block_after("## Python API", "python")
    tiny = dit.create_model("DiT-S/8", input_size=32, num_classes=1000)
    torch.save(tiny.state_dict(), tmp_path / "DiT-XL-2-256x256.pt")
    code = code.replace('dit.create_model("DiT-XL/2", input_size=32, num_classes=1000)',
                        'dit.create_model("DiT-S/8", input_size=32, num_classes=1000)')
    code = code.replace('timestep_respacing="250"', 'timestep_respacing="3"')
    assert "DiT-S/8" in code and '"3"' in code, "README snippet changed: update this test's substitutions"
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(code, "README.md:python-api", "exec"), scope)
    assert scope["samples"].shape == (8, 4, 32, 32)
    assert torch.isfinite(scope["samples"]).all()
    assert set(scope["losses"]) >= {"loss", "mse", "vb"}
    assert scope["losses"]["loss"].shape == (8,)
    assert scope["info"]["model_config"]["num_classes"] == 1000
