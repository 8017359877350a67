"""--vae on an offline machine: a mistyped local path fails at once naming it; a hub id that is neither cached
nor reachable fails at once (no half-minute of hub retries) saying what was tried and how to pass a local VAE."""
from __future__ import annotations

import pytest
from huggingface_hub import constants

from dit_pipeline.common.errors import UserError
from dit_pipeline.common.vae import load_vae
from tests._util import free_port, run_cli
from tests.sample.conftest import ckpts  # noqa: F401 (fixture)


@pytest.mark.parametrize("spec", ["vea", "./vae", "models/sd/vae", "vae.safetensors"])
def test_missing_local_path_is_named(tmp_path, monkeypatch, spec):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError) as e:
        load_vae(spec)
    assert str(e.value) == (f"--vae {spec!r}: no such file or folder ({tmp_path / spec.removeprefix('./')}), and "
                            "not a hub id (owner/name, e.g. stabilityai/sd-vae-ft-ema). Pass a local diffusers "
                            "folder (with config.json), a single .safetensors/.ckpt file, or a hub id")


def _hub_message(spec: str, where, why: str) -> str:
    return (f"--vae {spec!r}: no local file or folder of that name ({where / spec}), not in the Hugging Face cache "
            f"({constants.HF_HUB_CACHE}), and the hub was not asked ({why}). Pass a local diffusers folder or a "
            "single .safetensors file (--vae /path/to/vae), or fill the cache where there is a network "
            f"(huggingface-cli download {spec})")


def test_unreachable_hub_fails_at_once(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    port = free_port()  # nothing listens there: the connection is refused at once
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(UserError) as e:
        load_vae("nobody/no-such-vae")
    assert str(e.value) == _hub_message("nobody/no-such-vae", tmp_path,
                                        f"http://127.0.0.1:{port} is unreachable: Connection refused")


def test_offline_cli_names_what_was_tried(tmp_path, ckpts):
    r = run_cli("dit-sample", ["--ckpt", ckpts["ours"], "--vae", "nobody/no-such-vae", "--class-labels",
                               "1", "--out", tmp_path / "s"], cwd=tmp_path)  # run_cli sets HF_HUB_OFFLINE=1
    assert r.returncode == 1, r.stderr
    assert r.stderr.strip().splitlines()[-1] == "error: " + _hub_message("nobody/no-such-vae", tmp_path,
                                                                         "HF_HUB_OFFLINE is set")
