"""SampleConfig / ExportConfig validation: every problem at once, with the fix."""
from __future__ import annotations

import pytest

from dit_pipeline.common.errors import ConfigError
from dit_pipeline.sample.config import ExportConfig, SampleConfig, ddim_stride, respacing, valid_ddim_steps


def test_valid_config_passes_and_counts_samples(tmp_path):
    cfg = SampleConfig(ckpt="x.pt", class_labels=[1, 2, 3], npz=str(tmp_path / "s.npz")).validate()
    assert cfg.total == 3 and cfg.guided
    assert SampleConfig(ckpt="x.pt", class_labels=[1, 2], num_samples=5, out="o").total == 5
    assert not SampleConfig(ckpt="x", num_samples=1, out="o", cfg_scale=1.0).validate().guided


def test_all_problems_reported_together():
    cfg = SampleConfig(ckpt="", sampler="dpm++", steps=0, cfg_scale=0.5, cfg_channels="two", weights="both",
                       precision="int8", seed=-1, batch_size=0, save_images=True, grid_max=-1)
    with pytest.raises(ConfigError) as e:
        cfg.validate()
    msg = str(e.value)
    for needle in ("--ckpt is required", "--class-labels", "nothing would be written", "--save-images",
                   "--sampler", "--steps", "--cfg-scale", "--cfg-channels", "--weights", "--precision",
                   "--seed", "--batch-size", "--grid-max"):
        assert needle in msg, needle
    assert len(e.value.problems) == 13


def test_bad_labels_and_counts():
    with pytest.raises(ConfigError, match=r"class ids >= 0, got \[-3\]"):
        SampleConfig(ckpt="x", class_labels=[1, -3], out="o").validate()
    with pytest.raises(ConfigError, match="--num-samples must be >= 1"):
        SampleConfig(ckpt="x", num_samples=0, out="o").validate()
    with pytest.raises(ConfigError, match="--class-labels is empty"):
        SampleConfig(ckpt="x", class_labels=[], out="o").validate()
    with pytest.raises(ConfigError, match=r"--labels must be one of \('uniform', 'equal'\), got 'balanced'"):
        SampleConfig(ckpt="x", num_samples=4, labels="balanced", out="o").validate()
    with pytest.raises(ConfigError, match=r"--labels equal chooses the classes of --num-samples; it cannot be "
                                          r"combined with --class-labels \(drop one\)"):
        SampleConfig(ckpt="x", num_samples=4, class_labels=[1], labels="equal", out="o").validate()
    from dit_pipeline.sample.outputs import label_sampling  # the default: the protocol's, else uniform draws

    assert label_sampling(SampleConfig(ckpt="x", num_samples=4, out="o")) == "uniform"
    assert SampleConfig(ckpt="x", num_samples=4, out="o", protocol="rae").labels is None  # resolved once loaded
    SampleConfig(ckpt="x", num_samples=4, labels="equal", out="o").validate()


def test_ddim_step_counts_follow_integer_strides():
    assert ddim_stride(50) == 20 and ddim_stride(250) == 4 and ddim_stride(1000) == 1
    assert ddim_stride(300) is None and 334 in valid_ddim_steps() and 300 not in valid_ddim_steps()
    assert respacing("ddim", 50) == "ddim50" and respacing("ddpm", 250) == "250"
    with pytest.raises(ConfigError, match=r"--steps 300 is not possible with --sampler ddim.*\[167, 200, 250, 334\]"):
        SampleConfig(ckpt="x", num_samples=1, out="o", sampler="ddim", steps=300).validate()
    SampleConfig(ckpt="x", num_samples=1, out="o", sampler="ddpm", steps=300).validate()


def test_output_paths_checked(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError) as e:
        SampleConfig(ckpt="x", num_samples=1, npz=str(tmp_path), out=str(tmp_path / "file")).validate()
    assert "is a folder" in str(e.value) and "is not a folder" in str(e.value)


def test_export_config(tmp_path):
    ExportConfig(to="diffusers", output=str(tmp_path / "pipe"), ckpt="x.pt").validate()
    (tmp_path / "exists").mkdir()
    with pytest.raises(ConfigError) as e:
        ExportConfig(to="onnx", output=str(tmp_path / "exists"), ckpt="", weights="x").validate()
    assert len(e.value.problems) == 4 and "--overwrite" in str(e.value)
    with pytest.raises(ConfigError, match=r"\*\.safetensors"):
        ExportConfig(to="safetensors", output=str(tmp_path / "w.pt"), ckpt="x").validate()
    ExportConfig(to="diffusers", output=str(tmp_path / "exists"), ckpt="x", overwrite=True).validate()
