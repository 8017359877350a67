"""Per channel-and-position normalization (RAE's): the mean_var record, `dit-shards stats --write per-position`
(exact over every sample and view) and RAE's released stat.pt layout (issue #32)."""
from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from dit_pipeline.common.errors import UserError
from dit_pipeline.common.latent_norm import LatentNorm
from dit_pipeline.common.latent_stats import mean_var_record, read_stats_file
from dit_pipeline.shards import read_manifest, verify_shards
from dit_pipeline.shards.revision import revise
from dit_pipeline.shards.stats import compute_stats
from tests._util import run_cli
from tests.extract.conftest import read_samples


def test_formula_is_rae_within_float32_rounding():
    g = np.random.default_rng(0)
    mean, var = g.normal(size=(3, 2, 2)), g.uniform(0.0, 4.0, size=(3, 2, 2))
    var[0, 0, 0] = 0.0                                              # eps keeps it finite
    norm = LatentNorm(1.0, None, mean_var_record(mean, var, {"kind": "stats"}))
    z = torch.from_numpy(g.normal(size=(5, 3, 2, 2)).astype(np.float32))
    rae = (z - torch.from_numpy(mean).float()) / torch.sqrt(torch.from_numpy(var).float() + 1e-5)
    x = norm.apply(z.clone())
    torch.testing.assert_close(x, rae, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(norm.invert(x), z, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(norm.apply(z.numpy()), x.numpy(), rtol=0, atol=0)  # numpy and torch: same bits
    assert norm.is_per_position and norm.shape == [3, 2, 2] and norm.channels == 3
    assert norm.key() == LatentNorm(1.0, None, mean_var_record(mean, var, {"kind": "file"})).key()


def test_write_per_position_is_exact_and_rae_stat_file_loads(extracted, tmp_path):
    folder = tmp_path / "set"
    shutil.copytree(extracted, folder)
    res = run_cli("dit-shards", ["stats", folder, "--write", "per-position"])
    assert res.returncode == 0 and "wrote manifest revision 2" in res.stdout, res.stderr[-2000:]
    r = revise(folder, mode="per-position")
    assert not r["written"] and r["revision"] == 2                  # the same numbers again: nothing to write
    m = read_manifest(folder)
    assert m.norm.is_per_position and m.format_version == 3 and verify_shards(folder, progress=False).ok
    z = np.concatenate([s.latent for s in read_samples(folder).values()]).astype(np.float64)  # every view
    scale, shift = m.norm.vectors()
    np.testing.assert_array_equal(shift, z.mean(0).astype(np.float32))
    np.testing.assert_allclose(scale, 1 / np.sqrt(z.var(0) + 1e-5), rtol=2e-6)
    after = compute_stats(folder)
    assert abs(after["mean"]) < 1e-5 and abs(after["std"] - 1) < 1e-2    # normalized: ~0 mean, ~1 std

    # RAE's stat.pt: mean and var [1, C, h, w] tensors. The same numbers: nothing to write; other numbers (RAE's
    # moving averages differ from the exact ones): the next revision, the same formula
    stat = tmp_path / "stat.pt"
    torch.save({"mean": torch.from_numpy(z.mean(0))[None].float(), "var": torch.from_numpy(z.var(0))[None].float()},
               stat)
    assert not revise(folder, stats_file=str(stat))["written"]
    torch.save({"mean": torch.from_numpy(z.mean(0))[None].float(),
                "var": 4 * torch.from_numpy(z.var(0))[None].float()}, stat)
    assert revise(folder, stats_file=str(stat))["revision"] == 3
    m2 = read_manifest(folder)
    assert m2.norm.is_per_position and m2.normalization["source"]["kind"] == "file"
    np.testing.assert_allclose(m2.norm.vectors()[0], 1 / np.sqrt(4 * z.var(0) + 1e-5), rtol=2e-6)

    # a stats file of the wrong shape: one clear error, nothing written
    bad = tmp_path / "bad.pt"
    torch.save({"mean": torch.zeros(1, 32, 8, 8), "var": torch.ones(1, 32, 8, 8)}, bad)
    before = (folder / "manifest.json").read_bytes()
    with pytest.raises(UserError, match=r"shape \[32, 8, 8\], the latents have shape \[32, 4, 4\]"):
        revise(folder, stats_file=str(bad))
    assert (folder / "manifest.json").read_bytes() == before
    with pytest.raises(UserError, match="must be a \\[C, h, w\\] array"):
        torch.save({"mean": torch.zeros(32), "var": torch.ones(32)}, bad)
        read_stats_file(bad, [32, 4, 4])
