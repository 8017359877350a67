"""train.speed and train.memory: regional compile keeps names and values, the one-pass EMA, the CPU leaves
attention alone, the memory table beats the analytic model, `--micro-batch-size auto`."""
from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

from dit_pipeline import dit
from dit_pipeline.cli import train_main
from dit_pipeline.train import memory
from dit_pipeline.train.speed import choose_attention, compile_enabled, ema_update, regional_compile
from tests._util import FP32_EPS, assert_close_at_scale


def _tiny():
    torch.manual_seed(0)
    model = dit.create_model("DiT-S/2", input_size=8, patch_size=2, in_channels=4, hidden_size=32, depth=2, num_heads=2,
                             num_classes=3)
    with torch.no_grad():  # non-zero adaLN/output layers, so the blocks do something
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    return model.eval()  # no random class dropout between the two calls


def test_regional_compile_keeps_state_dict_names_and_outputs():
    model = _tiny()
    x, t, y = torch.randn(3, 4, 8, 8), torch.tensor([1, 500, 999]), torch.tensor([0, 1, 2])
    keys, want = list(model.state_dict()), model(x, t, y)
    assert regional_compile(model, backend="eager") == 3  # 2 blocks + the final layer
    assert list(model.state_dict()) == keys and not any("_orig_mod" in k for k in keys)
    got = model(x, t, y)
    assert torch.equal(got, want)
    got.square().mean().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_compile_default_is_on_for_cuda_only():
    assert compile_enabled(None, torch.device("cuda")) and not compile_enabled(None, torch.device("cpu"))
    assert not compile_enabled(False, torch.device("cuda")) and compile_enabled(True, torch.device("cpu"))


def test_attention_is_left_alone_on_cpu():
    flags = torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.mem_efficient_sdp_enabled()
    assert choose_attention("auto", torch.device("cpu"), batch=4, heads=2, tokens=16, head_dim=16,
                            dtype=None) == ("default", {})
    assert (torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.mem_efficient_sdp_enabled()) == flags


def test_ema_update_is_the_decay_formula_in_one_pass():
    torch.manual_seed(1)
    ema, params = [torch.randn(5, 7), torch.randn(11)], [torch.randn(5, 7), torch.randn(11)]
    want = [0.9 * e + 0.1 * p for e, p in zip(ema, params)]
    ema_update(ema, params, 0.9)
    for a, b in zip(ema, want):  # lerp rounds differently from mul+add: a few float32 ulps
        assert_close_at_scale(a, b, rel=4 * FP32_EPS)
    before = [e.clone() for e in ema]
    ema_update(ema, params, 1.0)
    assert all(torch.equal(a, b) for a, b in zip(ema, before))
    ema_update(ema, params, 0.0)
    assert all(torch.equal(a, b) for a, b in zip(ema, params))


XL = {"model": "DiT-XL/2", "input_size": 32, "patch_size": 2, "hidden_size": 1152, "depth": 28}


def test_memory_estimate_analytic_then_measured():
    est = memory.estimate(XL, 675_129_632, 675_129_632 - 294_912, 256, "bf16", grad_ckpt=False, compile=True)
    assert est.source == "analytic estimate, unmeasured"
    assert est.total == pytest.approx(sum(est.parts.values()))
    # 50 B x 256 tokens x 1152 x 28 blocks + 16 B x 256 x 1152, per sample, x 256 samples
    assert est.parts["activations"] == pytest.approx(256 * (50 * 28 + 16) * 256 * 1152 / 2**30)
    assert 100 < est.total < 139  # batch 256 fits one 139 GiB H200 by this estimate
    row = memory.table_row("DiT-XL/2", 32, "bf16", False, True, {64: 40.0, 128: 70.0}, gpu="H200", date="d")
    assert row["act_gib_per_sample"] == pytest.approx(30 / 64) and row["fixed_gib"] == pytest.approx(10.0)
    table = {tuple(row["key"]): row}
    m = memory.estimate(XL, 1, 1, 256, "bf16", grad_ckpt=False, compile=True, table=table)
    assert m.source == "measured (H200, d)" and m.total == pytest.approx(10 + 256 * 30 / 64)
    other = memory.estimate(XL, 1, 1, 256, "bf16", grad_ckpt=True, compile=True, table=table)
    assert other.source.startswith("analytic")  # a row serves only its exact configuration


def test_auto_micro_batch_takes_the_largest_divisor_that_fits():
    assert memory.auto_micro_batch(256, lambda m: m <= 100) == 64
    assert memory.auto_micro_batch(24, lambda m: True) == 24
    assert memory.auto_micro_batch(7, lambda m: False) == 1


def test_dry_run_labels_the_estimate_and_takes_auto(shard_dir, tmp_path):
    args = ["--shards", shard_dir, "--run-dir", tmp_path / "run", "--model", "DiT-S/2", "--depth", "2",
            "--hidden-size", "32", "--num-heads", "2", "--global-batch-size", "8", "--max-steps", "1",
            "--micro-batch-size", "auto", "--dry-run"]
    r = CliRunner().invoke(train_main, [str(a) for a in args])
    assert r.exit_code == 0, r.output
    assert "GPU memory  (analytic estimate, unmeasured, rank 0)" in r.output
    assert "micro-batch 8 x 1 accumulation step(s) (--micro-batch-size auto: no GPU visible" in r.output
    r = CliRunner().invoke(train_main, [str(a) for a in args[:-3]] + ["--micro-batch-size", "lots"])
    assert r.exit_code == 2 and "'lots' is neither a whole number nor 'auto'" in r.output
