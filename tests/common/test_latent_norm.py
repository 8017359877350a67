"""common.latent_norm: the one normalization formula and its inverse (scalar bit for bit as before, per channel
exactly rounded per element), what decides equality, the descriptions, and statistics files."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from dit_pipeline.common.errors import UserError
from dit_pipeline.common.latent_norm import LatentNorm, normalization_problems
from dit_pipeline.common.latent_stats import read_stats_file
from dit_pipeline.shards import scale_latents
from tests._util import FP32_EPS, assert_close_at_scale

RECORD = {"form": "mean_std", "mean": [0.1, -0.2, 0.3], "std": [0.5, 1.5, 2.5], "multiplier": 1.0,
          "source": {"kind": "file", "path": "/x/latents_stats.pt", "sha256": "ab" * 32}}


def test_scalar_is_the_old_formula_bit_for_bit():
    z = torch.randn(5, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    for scale, shift in ((0.18215, None), (0.3611, 0.1159), (1.5305, 0.0609)):
        old = z.clone()
        if shift:
            old.sub_(shift)
        old.mul_(scale)  # the formula shards.scale_latents had (an in-place sub, then an in-place mul)
        t = z.clone()
        assert LatentNorm(scale, shift).apply(t) is t and torch.equal(t, old)
        assert torch.equal(scale_latents(z.clone(), scale, shift), old)
        a = z.numpy()
        want = ((a - np.float32(shift)) if shift else a) * np.float32(scale)
        assert np.array_equal(LatentNorm(scale, shift).apply(a), want)
        # the inverse dit-sample always used: x / scale, then + shift when there is one
        inv = old / float(scale)
        inv = inv + float(shift) if shift is not None else inv
        assert torch.equal(LatentNorm(scale, shift).invert(old), inv)


def test_per_channel_formula_by_hand_and_independent_of_the_batch():
    norm = LatentNorm(0.5, None, RECORD)
    scale = np.array([1.0 / 0.5, 1.0 / 1.5, 1.0 / 2.5], np.float64).astype(np.float32)  # float64, then rounded
    shift = np.array([0.1, -0.2, 0.3], np.float32)
    got_scale, got_shift = norm.vectors()
    assert np.array_equal(got_scale, scale) and np.array_equal(got_shift, shift)
    z = torch.randn(6, 3, 4, 4, generator=torch.Generator().manual_seed(1))
    want = (z - torch.from_numpy(shift).view(3, 1, 1)) * torch.from_numpy(scale).view(3, 1, 1)
    batch = norm.apply(z.clone())
    assert torch.equal(batch, want)
    assert all(torch.equal(norm.apply(z[i].clone()), batch[i]) for i in range(6))  # [C, h, w] alone, same bits
    assert np.array_equal(norm.apply(z.numpy()), want.numpy())  # numpy ([..., C, h, w]) gives the same bits
    back = norm.invert(batch)
    assert torch.equal(back, batch / torch.from_numpy(scale).view(3, 1, 1) + torch.from_numpy(shift).view(3, 1, 1))
    assert_close_at_scale(back, z, rel=4 * FP32_EPS)
    ss = LatentNorm(0.5, None, {"form": "scale_shift", "scale": [2.0, 0.5, 4.0], "shift": [1.0, 0.0, -1.0],
                                "source": {"kind": "stats"}})
    assert torch.equal(ss.apply(torch.ones(3, 1, 1)).flatten(), torch.tensor([0.0, 0.5, 8.0]))


def test_key_is_the_numbers_not_their_source_and_records_stay_scalar():
    a = LatentNorm(0.5, None, RECORD)
    b = LatentNorm(0.9, 0.2, {**RECORD, "source": {"kind": "stats", "samples_used": 10, "seed": 0}})
    assert a.key() == b.key()  # the per-channel vectors decide, not the unused scalar fields or the source
    assert a.key() != LatentNorm(0.5, None, {**RECORD, "std": [0.5, 1.5, 2.6]}).key()
    assert LatentNorm(0.5, None).key() == ("scalar", 0.5, None) == LatentNorm(0.5, 0.0).key()
    assert LatentNorm(0.18215, None).record() == {"scaling_factor": 0.18215, "shift_factor": None}
    assert a.record() == {"scaling_factor": 0.5, "shift_factor": None, "normalization": RECORD}
    assert LatentNorm.from_record(a.record()).key() == a.key()
    assert LatentNorm(0.3611, 0.1159).describe() == "scalar: (z - 0.1159) * 0.3611"
    assert LatentNorm(0.18215, None).describe() == "scalar: z * 0.18215"
    assert a.describe() == ("per-channel over 3 channels: (z - mean_c) * 1 / std_c (mean -0.2..0.3, std 0.5..2.5), "
                            "from the statistics file /x/latents_stats.pt (sha256 abababababab...)")
    vae = LatentNorm.of_vae({"scaling_factor": 0.13025, "shift_factor": None, "latents_mean": [1, 2],
                             "latents_std": [4, 8]})
    assert vae.per_channel == {"form": "mean_std", "mean": [1.0, 2.0], "std": [4.0, 8.0], "multiplier": 0.13025,
                               "source": {"kind": "vae_config"}}


def test_invalid_records_are_named():
    assert normalization_problems({**RECORD, "std": [0.5, 0.0, 1.0]}, 3) == [
        "normalization std must be > 0 in every channel"]
    assert normalization_problems(RECORD, 4) == ["normalization mean has 3 values for 4 latent channels",
                                                 "normalization std has 3 values for 4 latent channels"]
    assert normalization_problems({"form": "zscore"}) == [
        "normalization form must be one of mean_std, scale_shift, mean_var, got 'zscore'"]
    assert normalization_problems({**RECORD, "multiplier": float("nan"), "source": None}, 3) == [
        "normalization multiplier must be a finite number > 0, got nan",
        "normalization source must be an object with kind one of vae_config, vae_weights, file, stats"]
    with pytest.raises(ValueError, match="invalid normalization: normalization mean must be a non-empty list"):
        LatentNorm(1.0, None, {**RECORD, "mean": []})


def test_statistics_files(tmp_path):
    # LightningDiT's latents_stats.pt: {"mean": [1, C, 1, 1], "std": [1, C, 1, 1]}
    pt = tmp_path / "latents_stats.pt"
    torch.save({"mean": torch.tensor([0.1, -0.2, 0.3]).view(1, 3, 1, 1),
                "std": torch.tensor([0.5, 1.5, 2.5]).view(1, 3, 1, 1)}, pt)
    rec = read_stats_file(pt, 3)
    assert rec["form"] == "mean_std" and rec["multiplier"] == 1.0 and rec["source"]["kind"] == "file"
    assert rec["mean"] == [float(np.float32(v)) for v in (0.1, -0.2, 0.3)] and rec["std"] == [0.5, 1.5, 2.5]
    assert rec["source"]["path"] == str(pt.resolve()) and len(rec["source"]["sha256"]) == 64
    js = tmp_path / "stats.json"
    js.write_text(json.dumps({"scale": [2.0, 1.0, 0.5], "shift": [0, 0, 1]}))
    assert read_stats_file(js, 3)["form"] == "scale_shift"
    js.write_text(json.dumps({"latents_mean": [0, 0, 0], "latents_std": [1, 2, 3], "multiplier": 0.5}))
    assert read_stats_file(js, 3)["multiplier"] == 0.5
    from safetensors.numpy import save_file

    st = tmp_path / "stats.safetensors"
    save_file({"mean": np.zeros(3, np.float32), "std": np.ones(3, np.float32)}, str(st))
    assert read_stats_file(st, 3)["std"] == [1.0, 1.0, 1.0]

    def error(path, channels=3) -> str:
        with pytest.raises(UserError) as e:
            read_stats_file(path, channels)
        return str(e.value)

    assert error(pt, 4) == (f"--latent-stats {pt}: normalization mean has 3 values for 4 latent channels; "
                            "normalization std has 3 values for 4 latent channels")
    js.write_text(json.dumps({"means": [0, 0, 0]}))
    assert error(js) == f"--latent-stats {js}: holds ['means']; expected mean and std (or scale and shift)"
    js.write_text(json.dumps({"mean": [[0, 1], [2, 3]], "std": [1, 1, 1, 1]}))
    assert error(js).startswith(f"--latent-stats {js}: mean must hold one value per latent channel")
    none = tmp_path / "none.pt"
    assert error(none) == f"--latent-stats {none}: no such file ({none})"
    evil = tmp_path / "evil.pt"
    torch.save({"mean": torch.zeros(3), "std": torch.ones(3), "obj": _Pickled()}, evil)
    assert error(evil).startswith(f"--latent-stats {evil}: cannot read it (UnpicklingError")  # never unpickled


class _Pickled:
    """A class a weights_only load refuses."""
