"""What needs no process group: the per-mode memory estimate and its 1/N law, the dry run's table and its refusal
naming the mode that fits (before anything is written), the world-size handover's arithmetic (train/handover.py),
and docs/big-models.md's commands against the real options."""
from __future__ import annotations

import re
import shlex

import pytest
import torch

from dit_pipeline.train import memory
from dit_pipeline.train.data import Batch
from dit_pipeline.train.handover import cut, join, sources
from dit_pipeline.train.partition import DataLayout
from tests._util import REPO
from tests.train.conftest import invoke_train, tiny_args

XL = {"model": "DiT-XL/2", "input_size": 32, "patch_size": 2, "hidden_size": 1152, "depth": 28}
XL_PARAMS, XL_TRAINABLE = 675_129_632, 675_129_632 - 294_912


def test_sharded_model_state_follows_the_one_over_n_law():
    blocks = [(XL_TRAINABLE - 10_000_000) // 28] * 28
    ddp = memory.model_state("ddp", XL_PARAMS, XL_TRAINABLE, 1, blocks, precision="bf16")
    whole = ddp["params"] + ddp["grads"] + ddp["adamw"] + ddp["ema_rank0"]
    assert whole == pytest.approx((4 * XL_PARAMS + 12 * XL_TRAINABLE + 4 * XL_PARAMS) / 2**30)  # 20 B / parameter
    for n in (1, 2, 4, 8, 64):
        for mode in ("zero2", "fsdp", "hsdp"):
            s = memory.model_state(mode, XL_PARAMS, XL_TRAINABLE, n, blocks, precision="bf16")
            assert s["params"] + s["grads"] + s["adamw"] + s["ema"] == pytest.approx(whole / n)  # every rank 1/N
        fsdp = memory.model_state("fsdp", XL_PARAMS, XL_TRAINABLE, n, blocks, precision="bf16")
        zero2 = memory.model_state("zero2", XL_PARAMS, XL_TRAINABLE, n, blocks, precision="bf16")
        # gathered in bf16: two blocks (FSDP) or every block (ZeRO-2), the root's 10M in fp32, one block's gradients
        assert fsdp["gathered"] == pytest.approx((2 * 2 * blocks[0] + 4 * (XL_PARAMS - sum(blocks)) + 2 * blocks[0])
                                                 / 2**30)
        assert zero2["gathered"] == pytest.approx((2 * sum(blocks) + 4 * (XL_PARAMS - sum(blocks)) + 2 * blocks[0])
                                                  / 2**30)


def _dry(shard_dir, tmp_path, **over):
    return invoke_train(["--nproc-per-node", "4", *tiny_args(shard_dir, tmp_path / "run", **{
        "model": "DiT-XL/2", "depth": False, "hidden-size": False, "num-heads": False, "num-workers": 1,
        "global-batch-size": 16, "micro-batch-size": 4, "dry-run": None, **over})])


@pytest.mark.skipif(__import__("dit_pipeline.common.sharding", fromlist=["x"]).sharding_problem() is not None,
                    reason="--parallel fsdp needs torch 2.9+")
def test_the_dry_run_prints_every_mode_and_what_fits(shard_dir, tmp_path):
    r = _dry(shard_dir, tmp_path, **{"gpu-memory": "80GiB", "parallel": "fsdp"})
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    head = next(i for i, x in enumerate(lines) if x.startswith("  per GPU     GiB at 4 rank(s), micro-batch 4"))
    rows = {x.split()[x.split()[0] == "*"]: x for x in lines[head + 1:head + 5]}
    assert list(rows) == ["ddp", "zero2", "fsdp", "hsdp"] and rows["fsdp"].lstrip().startswith("* fsdp")
    totals = {m: [float(v) for v in row.split("|")[-1].split("/")] for m, row in rows.items()}
    state = {m: sum(float(v) for v in row.split("|")[0].split()[-9::2]) for m, row in rows.items()}
    # 16 B per parameter + rank 0's EMA (the printed parts rounded to 0.01 each)
    assert state["ddp"] == pytest.approx(20 * XL_PARAMS / 2**30, abs=0.05)
    assert state["fsdp"] < state["zero2"] < state["ddp"] and totals["fsdp"][1] < totals["fsdp"][0]  # ckpt saves
    assert "  parallel    fsdp on a 4 mesh" in r.output
    assert re.search(r"^  fits        80\.0 GiB per GPU \(--gpu-memory 80GiB\), per-rank batch 4: ddp up to "
                     r"micro-batch 4; zero2 up to micro-batch 4; fsdp up to micro-batch 4; hsdp up to micro-batch 4$",
                     r.output, re.M)


def test_a_run_that_cannot_fit_is_refused_naming_the_mode_that_would(shard_dir, tmp_path):
    r = _dry(shard_dir, tmp_path, **{"gpu-memory": "12GiB"})
    assert r.exit_code == 1
    assert "  per GPU     GiB at 4 rank(s)" in r.output  # the dry run shows its table, then refuses as the run would
    last = r.output.strip().splitlines()[-1]
    assert last.startswith("error: the memory estimate of this run (ddp, micro-batch 4, grad checkpointing off) is ")
    assert "GiB per GPU, more than the 12.0 GiB of --gpu-memory 12GiB; --parallel zero2 fits at micro-batch 4" in last
    r = invoke_train(tiny_args(shard_dir, tmp_path / "run", **{"model": "DiT-XL/2", "depth": False,
                                                               "hidden-size": False, "num-heads": False,
                                                               "gpu-memory": "12GiB", "micro-batch-size": 8}))
    assert r.exit_code == 1 and r.output.strip().endswith(  # one rank: sharding divides nothing
        "no mode fits at this world size: add ranks (the sharded modes divide the model state by them). --dry-run "
        "prints the table (an analytic estimate: pass a larger --gpu-memory to run anyway)")
    assert not (tmp_path / "run").exists()  # refused before anything started or was written


@pytest.mark.parametrize("old_world,accum,micro,new_world", [(2, 2, 2, 1), (4, 1, 2, 2), (8, 1, 4, 4), (2, 1, 4, 4),
                                                              (4, 2, 3, 3), (3, 1, 4, 2), (1, 3, 2, 6)])
def test_handover_gives_each_step_sample_to_exactly_one_new_rank(old_world, accum, micro, new_world):
    old = DataLayout(seed=0, world_size=old_world, workers=1, micro_batch=micro, accum=accum, shuffle_buffer=10,
                     shards_in_flight=2)
    per_old, per_new = micro * accum, micro * accum * old_world // new_world
    taken = []
    for rank in range(new_world):
        parts = sources(old, new_world, rank)
        assert sum(stop - start for _, start, stop in parts) == per_new
        taken += [(j, k) for j, start, stop in parts for k in range(start, stop)]
    # new rank order over old rank order: the global batch in the same order, each sample once
    assert taken == [(j, k) for j in range(old_world) for k in range(per_old)]


def test_join_and_cut_keep_every_per_sample_field():
    def batch(keys, length):
        n = len(keys)
        return Batch(torch.randn(n, 4, 2, 2), torch.arange(n), torch.tensor(keys), [("s", "p")] if keys[0] == 0 else [],
                     text=torch.ones(n, length, 3), text_mask=torch.ones(n, length, dtype=torch.bool),
                     captions=[f"c{k}" for k in keys])
    a, b = batch([0, 1], 2), batch([2, 3, 4], 4)
    both = join([a, b])
    assert both.keys.tolist() == [0, 1, 2, 3, 4] and both.captions == ["c0", "c1", "c2", "c3", "c4"]
    assert both.text.shape == (5, 4, 3) and both.text[:2, 2:].abs().sum() == 0  # zero-padded to the longest
    assert both.text_mask[:2].sum(1).tolist() == [2, 2] and both.skipped == [("s", "p")]
    part = cut(both, 1, 4)
    assert part.keys.tolist() == [1, 2, 3] and part.captions == ["c1", "c2", "c3"] and part.latents.shape[0] == 3
    assert torch.equal(part.latents, both.latents[1:4]) and part.pixels is None


def _shell_commands(text: str) -> list[list[str]]:
    blocks = re.findall(r"```(?:bash|sh|shell)\n(.*?)```", text, re.S)
    return [shlex.split(line, comments=True) for b in blocks for line in b.replace("\\\n", " ").splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def test_big_models_page_uses_only_real_options():
    """Every dit-train / dit-sample / torchrun line of docs/big-models.md names options the commands have."""
    import click

    from dit_pipeline.cli import sample_main, train_main

    page = (REPO / "docs" / "big-models.md").read_text()
    assert page.lstrip().startswith("# ") and "```bash\ndit-train " in page  # opens with a runnable command
    known = {"dit-train": train_main, "dit-sample": sample_main}
    checked = 0
    for argv in _shell_commands(page):
        while argv and argv[0] in ("srun", "torchrun", "DIT_DRY_RUN=1") or (argv and argv[0].startswith("--")
                                                                          and argv[0] != "--"):
            argv = argv[1:] if not argv[0].startswith("--") or "=" in argv[0] else argv[2:]
        if argv and argv[0].startswith("$(which"):
            argv = [argv[0][len("$(which "):].rstrip(")")] + argv[1:]
        if not argv or argv[0] not in known:
            continue
        cmd = known[argv[0]]
        if isinstance(cmd, click.Group):
            cmd = cmd.commands.get(argv[1], cmd.commands["run"]) if len(argv) > 1 else cmd.commands["run"]
        names = {o for p in cmd.params for o in getattr(p, "opts", [])}
        used = [a.split("=")[0] for a in argv[1:] if a.startswith("--")]
        assert set(used) <= names, (argv, set(used) - names)
        checked += 1
    assert checked >= 5


def test_the_big_models_memory_table_is_the_estimate():
    """docs/big-models.md's table: train/memory.py's model state per GPU (bf16, AdamW) and activations per image."""
    from dit_pipeline.dit.family import create_model

    text = (REPO / "docs" / "big-models.md").read_text()
    kwargs = {"DiT-XL/2": {"num_classes": 1000},
              "DiT-DH-IC-1.6B": {"conditioning": "text", "text_dim": 1024, "num_c_tokens": 256},
              "PixArt-1.6B": {"conditioning": "text", "text_dim": 4096},
              "DiT-DH-IC-3B": {"conditioning": "text", "text_dim": 1024, "num_c_tokens": 256},
              "PixArt-3B": {"conditioning": "text", "text_dim": 4096}}
    for name, kw in kwargs.items():
        row = re.search(rf"^\| {re.escape(name)} \| ([0-9.]+)B \| (.*) \|$", text, re.M)
        assert row, name
        with torch.device("meta"):
            model = create_model(name, input_size=32, in_channels=4, **kw)
        n = sum(p.numel() for p in model.parameters())
        t = sum(p.numel() for p in model.parameters() if p.requires_grad)
        blocks = [sum(p.numel() for p in b.parameters()) for b in model.blocks]
        want = [sum(memory.model_state(m, n, t, k, blocks, precision="bf16").values())
                for m, k in (("ddp", 1), ("zero2", 8), ("fsdp", 8), ("fsdp", 64))]
        cells = [c.strip() for c in row.group(2).split("|")]
        assert float(row.group(1)) == pytest.approx(n / 1e9, abs=0.005), name
        assert [float(c) for c in cells[:4]] == pytest.approx(want, abs=0.051), name
        act = [memory.activation_bytes(model.config, 1, "bf16", ckpt) / 2**30 for ckpt in (False, True)]
        assert [float(v) for v in cells[4].split("/")] == pytest.approx(act, abs=0.0051), name


def test_the_readme_memory_table_is_the_guides():
    """README.md's "Big models" table repeats docs/big-models.md's rows (which the test above checks against the
    estimate): the same model-state figures, never a stale copy."""
    guide = (REPO / "docs" / "big-models.md").read_text()
    readme = (REPO / "README.md").read_text()
    rows = re.findall(r"^\| (DiT-XL/2 \(0\.68B\)|DiT-DH-IC-1\.6B|DiT-DH-IC-3B) \| (.*) \|$", readme, re.M)
    assert len(rows) == 3
    for name, cells in rows:
        model = name.split(" ")[0]
        want = re.search(rf"^\| {re.escape(model)} \| [0-9.]+B \| (.*) \|$", guide, re.M)
        assert want, model
        assert [c.strip() for c in cells.split("|")] == [c.strip() for c in want.group(1).split("|")][:4], model


def test_only_the_parallel_module_names_a_mode_in_a_comparison():
    """The seam (issue 45): what differs between --parallel modes is asked of train/parallel.py's `Mode` and
    `Parallel`; no other module compares a value with a mode's name (`if mode == "fsdp"`)."""
    import ast

    from dit_pipeline.train.parallel import MODES

    root = REPO
    files = [p for d in ("train", "dit", "sample", "extract", "shards", "common", "evaluate")
             for p in (root / d).rglob("*.py")] + [root / "cli.py"]
    assert len(files) > 50
    found = []
    for path in files:
        if path == root / "train" / "parallel.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
                names = [c.value for s in sides for c in ast.walk(s)
                         if isinstance(c, ast.Constant) and c.value in MODES]
                if names:
                    found.append(f"{path.relative_to(root)}:{node.lineno} {names}")
    assert found == []
