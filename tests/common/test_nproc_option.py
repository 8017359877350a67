"""`--nproc-per-node` given to a command that does not launch its own ranks says to use torchrun (issue #34)."""
from __future__ import annotations

import pytest
from click.testing import CliRunner

from dit_pipeline.cli import eval_main, extract_main, sample_main


@pytest.mark.parametrize("cmd, prog, args", [
    (extract_main, "dit-extract", ["--data-path", "x", "--out", "y"]),
    (sample_main, "dit-sample", ["--ckpt", "x.pt", "--num-samples", "2"]),
    (eval_main, "dit-eval", ["s.npz", "--ref", "r.npz"]),
])
@pytest.mark.parametrize("flag", ["--nproc-per-node", "--nproc_per_node=8"])
def test_nproc_per_node_outside_dit_train_names_torchrun(cmd, prog, args, flag):
    r = CliRunner().invoke(cmd, [*args, *([flag, "8"] if "=" not in flag else [flag])])
    assert r.exit_code == 2
    name = flag.split("=")[0]
    assert r.output.strip().splitlines()[-1] == (
        f"Error: No such option '{name}'. Only dit-train starts its own ranks; start {prog} under torchrun: "
        f"torchrun --nproc-per-node N $(which {prog}) ...")
