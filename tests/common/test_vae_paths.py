"""A local --vae typed as a relative path (`--vae ../vae`) is recorded absolute, with the typed form for display,
so sampling, grids and exports started from another folder find it; records written before keep working:
a relative path is looked for next to the manifest first, then in the current directory."""
from __future__ import annotations

from pathlib import Path

import pytest

from dit_pipeline.common.errors import UserError
from dit_pipeline.common.vae import load_vae
from dit_pipeline.common.vae_identity import recorded_vae
from dit_pipeline.shards import read_manifest
from tests._util import make_image_tree, make_tiny_vae


@pytest.fixture
def layout(tmp_path, monkeypatch):
    """tmp/vae (a tiny VAE), tmp/work (the folder the user types commands in), tmp/elsewhere."""
    make_tiny_vae(tmp_path / "vae")
    for name in ("work", "elsewhere"):
        (tmp_path / name).mkdir()
    monkeypatch.chdir(tmp_path / "work")
    return tmp_path


def test_a_relative_local_vae_is_recorded_absolute_with_the_typed_form(layout):
    _, ident = load_vae("../vae")
    assert ident["source"] == str(layout / "vae") and Path(ident["source"]).is_absolute()
    assert ident["source_given"] == "../vae" and ident["kind"] == "folder"
    single = layout / "vae" / "diffusion_pytorch_model.safetensors"
    _, ident = load_vae("../vae/diffusion_pytorch_model.safetensors", config="../vae")
    assert (ident["source"], ident["source_given"]) == (str(single), "../vae/diffusion_pytorch_model.safetensors")
    assert ident["config"] == str(layout / "vae")
    _, ident = load_vae(str(layout / "vae"))  # typed absolute: nothing else to show
    assert ident["source"] == str(layout / "vae") and "source_given" not in ident


def test_the_manifest_records_it_absolute_and_grids_find_it_from_another_folder(layout, monkeypatch):
    from dit_pipeline.extract import ExtractConfig, run_extract
    from dit_pipeline.train import TrainConfig, build_hooks

    make_image_tree(layout / "work" / "images", counts=(2, 2))
    run_extract(ExtractConfig(data_path="images", out="shards", vae="../vae", image_size=32, batch_size=2,
                              num_workers=0, quiet=True))
    vae = read_manifest(layout / "work" / "shards").extraction["vae"]
    assert (vae["source"], vae["source_given"]) == (str(layout / "vae"), "../vae")
    assert vae["source"] == str(layout / "vae") and vae["weights_sha256"]
    monkeypatch.chdir(layout / "elsewhere")
    [hook] = build_hooks(TrainConfig(shards=str(layout / "work" / "shards"), run_dir="run", max_steps=1,
                                     sample_every=1))
    assert hook.vae == str(layout / "vae")
    # the same extraction resumed from another folder with the absolute path is the same configuration
    summary = run_extract(ExtractConfig(data_path=str(layout / "work" / "images"), out=str(layout / "work" / "shards"),
                                        vae=str(layout / "vae"), image_size=32, batch_size=2, num_workers=0, quiet=True))
    assert summary.shards_kept == 1 and summary.shards_written == 0


def test_an_old_relative_record_is_looked_for_next_to_the_manifest_then_here(layout, monkeypatch):
    old = {"source": "../vae", "kind": "folder", "weights_sha256": "0" * 64}
    shards = layout / "shards"   # tmp/shards/../vae is tmp/vae
    shards.mkdir()
    assert recorded_vae(old, "the manifest of x", base=shards) == (str(shards / "../vae"), None)
    # not next to the manifest (tmp/work/../vae ... tmp/elsewhere/sub/../vae does not exist): the current directory
    (layout / "elsewhere" / "sub").mkdir()
    assert recorded_vae(old, "the manifest of x", base=layout / "elsewhere" / "sub") == \
        (str(Path.cwd() / "../vae"), None)
    deep = layout / "elsewhere" / "sub" / "deep"
    deep.mkdir()
    monkeypatch.chdir(deep)
    with pytest.raises(UserError) as e:
        recorded_vae(old, "--ckpt c.pt", base=layout / "elsewhere" / "sub")
    assert str(e.value) == (f"--ckpt c.pt records the VAE '../vae', a local folder that does not exist here "
                            f"({layout / 'elsewhere' / 'sub' / '../vae'} or {deep / '../vae'}); "
                            "pass --vae (the VAE the shards were extracted with)")
    # a record without a base (e.g. an EMA file's sidecar) is looked for here only
    monkeypatch.chdir(layout / "work")
    assert recorded_vae(old, "x") == (str(layout / "work" / "../vae"), None)
