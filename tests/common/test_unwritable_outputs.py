"""An output folder that cannot be written (a read-only mount, a missing permission) is one line naming the
folder and the problem, before any work, for every command that writes (also `dit-train --dry-run`).

Tests run as root, where permissions stop nothing, so the read-only mount is simulated by the fault point
`io.write_check` (action `erofs`: the probe write fails with EROFS, as on a read-only mount); one test uses
a real read-only tmpfs where the machine allows mounting one.
"""
from __future__ import annotations

import subprocess

import pytest
from click.testing import CliRunner

from dit_pipeline.cli import extract_main, sample_main, train_main
from dit_pipeline.common import faults
from dit_pipeline.common.errors import UserError
from dit_pipeline.common.io import check_writable_dir
from tests.extract.conftest import cli_args as extract_args
from tests.sample.conftest import ckpts  # noqa: F401 (fixture)
from tests.train.conftest import shard_dir, tiny_args  # noqa: F401 (fixture)

EROFS = {"DIT_FAULT": "io.write_check:erofs"}


def _invoke(cmd, args, env=EROFS):
    faults._counts.clear()
    return CliRunner().invoke(cmd, [str(a) for a in args], env=env)


def test_check_writable_dir(tmp_path, monkeypatch):
    check_writable_dir(tmp_path / "new" / "deeper", "--out x")  # creatable: fine, and nothing is left
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "f").write_text("x")
    with pytest.raises(UserError) as e:
        check_writable_dir(tmp_path / "f", "--out f")
    assert str(e.value) == f"--out f: {tmp_path / 'f'} exists and is not a folder; pass a folder"
    with pytest.raises(UserError) as e:
        check_writable_dir(tmp_path / "f" / "sub", "--out f/sub")
    assert str(e.value) == (f"--out f/sub: cannot create {tmp_path / 'f' / 'sub'} in {tmp_path / 'f'} "
                            "(Not a directory); pass a writable folder")
    monkeypatch.setenv("DIT_FAULT", "io.write_check:erofs")
    faults._counts.clear()
    with pytest.raises(UserError) as e:
        check_writable_dir(tmp_path, "--out o")
    assert str(e.value) == f"--out o: cannot write in {tmp_path} (Read-only file system); pass a writable folder"


def test_real_read_only_mount(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a read-only tmpfs here (the fault-point tests cover the message)")
    try:
        with pytest.raises(UserError) as e:
            check_writable_dir(ro / "run", f"--run-dir {ro / 'run'}")
        assert str(e.value) == (f"--run-dir {ro / 'run'}: cannot create {ro / 'run'} in {ro} (Read-only file "
                                "system); pass a writable folder")
    finally:
        subprocess.run(["umount", str(ro)], check=True)


def test_extract_out(tmp_path, image_tree, tiny_vae_dir):
    out = tmp_path / "shards"
    r = _invoke(extract_main, extract_args(image_tree, tiny_vae_dir, out))
    assert r.exit_code == 1, r.output
    assert r.output == (f"error: --out {out}: cannot create {out} in {tmp_path} (Read-only file system); "
                        "pass a writable folder\n")
    assert not out.exists()


@pytest.mark.parametrize("dry_run", [False, True])
def test_train_run_dir(shard_dir, tmp_path, dry_run):
    run = tmp_path / "run"
    run.mkdir()
    r = _invoke(train_main, tiny_args(shard_dir, run, **{"dry-run": dry_run, "num-workers": 0}))
    assert r.exit_code == 1, r.output
    assert r.output == (f"error: --run-dir {run}: cannot write in {run} (Read-only file system); pass a "
                        "writable folder\n")
    assert list(run.iterdir()) == []


@pytest.mark.parametrize("flag", ["--out", "--npz"])
def test_sample_out_and_npz(tmp_path, ckpts, tiny_vae_dir, flag):
    target = tmp_path / ("samples" if flag == "--out" else "s.npz")
    r = _invoke(sample_main, ["--ckpt", ckpts["ours"], "--vae", tiny_vae_dir, "--class-labels", "1,2",
                              "--steps", "2", flag, target])
    assert r.exit_code == 1, r.output
    folder = target if flag == "--out" else tmp_path
    how = f"create {target} in {tmp_path}" if flag == "--out" else f"write in {folder}"
    assert r.output == f"error: {flag} {target}: cannot {how} (Read-only file system); pass a writable folder\n"
    assert list(tmp_path.iterdir()) == []


def test_sample_export(tmp_path, ckpts):
    out = tmp_path / "w.safetensors"
    r = _invoke(sample_main, ["export", "--to", "safetensors", out, "--ckpt", ckpts["ours"]])
    assert r.exit_code == 1, r.output
    assert r.output == (f"error: export OUTPUT {out}: cannot write in {tmp_path} (Read-only file system); pass "
                        "a writable folder\n")
    assert list(tmp_path.iterdir()) == []
