"""common/determinism.py: the pinned thread count holds inside and is restored after; bad counts are refused;
the extraction record and the sample record carry what decides the last float bits."""
from __future__ import annotations

import pytest
import torch

from dit_pipeline.common.determinism import DEFAULT_CPU_THREADS, pinned_threads
from dit_pipeline.common.errors import ConfigError
from dit_pipeline.extract import ExtractConfig
from dit_pipeline.sample import SampleConfig


def test_pinned_threads_hold_inside_and_are_restored():
    before = torch.get_num_threads()
    other = 1 if before != 1 else 2
    with pinned_threads(torch.device("cpu"), other):
        assert torch.get_num_threads() == other
    assert torch.get_num_threads() == before
    with pytest.raises(RuntimeError, match="boom"), pinned_threads(torch.device("cpu"), other):
        raise RuntimeError("boom")
    assert torch.get_num_threads() == before
    with pinned_threads(torch.device("meta"), other):  # not a CPU: the host threads are left alone
        assert torch.get_num_threads() == before
    with pytest.raises(ValueError, match="threads must be >= 1, got 0"), pinned_threads(torch.device("cpu"), 0):
        pass


def test_cpu_threads_default_and_bad_values():
    assert DEFAULT_CPU_THREADS == 1
    assert ExtractConfig(data_path="d", out="o").cpu_threads == 1
    assert SampleConfig(ckpt="c", num_samples=1, npz="s.npz").cpu_threads == 1
    with pytest.raises(ConfigError, match="--cpu-threads must be >= 1, got 0"):
        ExtractConfig(data_path="d", out="o", cpu_threads=0).validate()
    with pytest.raises(ConfigError, match="--cpu-threads must be >= 1, got -2"):
        SampleConfig(ckpt="c", num_samples=1, npz="s.npz", cpu_threads=-2).validate()


def test_records_carry_the_numerics(image_tree, tiny_vae_dir, tmp_path):
    from dit_pipeline.extract import run_extract
    from dit_pipeline.shards import read_manifest

    out = tmp_path / "out"
    run_extract(ExtractConfig(data_path=str(image_tree), out=str(out), vae=str(tiny_vae_dir), image_size=32,
                              batch_size=2, num_workers=0, quiet=True, cpu_threads=2))
    record = read_manifest(out).extraction
    assert (record["cpu_threads"], record["batch_size"], record["device"]) == (2, 2, "cpu")
