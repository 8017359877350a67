import torch

from dit_pipeline.common.seeding import derive_seed, generator
from dit_pipeline.common.vae import load_vae


def test_derive_seed_pure_and_distinct():
    assert derive_seed(0, 1, 2) == derive_seed(0, 1, 2)
    seeds = {derive_seed(0, e, k) for e in range(10) for k in range(100)}
    assert len(seeds) == 1000
    assert derive_seed(1, 2) != derive_seed(2, 1)
    assert derive_seed(1, 2) != derive_seed(1, 2, 0) != derive_seed(1, 2, 0, 0)  # no zero-padding collisions
    assert 0 <= derive_seed(123) < 2**63
    a = torch.randn(5, generator=generator(7, 3))
    b = torch.randn(5, generator=generator(7, 3))
    assert torch.equal(a, b)


def test_load_vae_folder_reads_scaling_from_config(tiny_vae_dir):
    vae, ident = load_vae(str(tiny_vae_dir))
    assert ident["kind"] == "folder"
    assert ident["scaling_factor"] == 0.5
    assert ident["shift_factor"] is None
    assert ident["latent_channels"] == 4 and ident["downsample_factor"] == 8
    assert len(ident["weights_sha256"]) == 64
    x = torch.zeros(1, 3, 32, 32)
    assert vae.encode(x).latent_dist.mean.shape == (1, 4, 4, 4)


def test_load_vae_missing_path_is_user_error(tmp_path):
    import pytest

    from dit_pipeline.common.errors import UserError

    with pytest.raises(UserError, match="no such file or folder"):
        load_vae(str(tmp_path / "nope.safetensors"))
