"""NanoGen's VAE latent spaces (issue 44 item 2): every VAE of NanoGen's matrix by its name, loaded as NanoGen
loads it (hub id + subfolder, its class) from a Hugging Face cache, encoded and normalized as NanoGen's wrapper
does and decoded back, on tiny random models of the real classes (AutoencoderKL, AutoencoderKLFlux2,
AutoencoderKLQwenImage) saved with save_pretrained.

The oracle is NanoGen's code transcribed (End2End-Diffusion/diffusion-bench, src/stage1/vae.py, lines named at
each use)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from dit_pipeline.common.errors import UserError
from dit_pipeline.common.latent_norm import LatentNorm
from dit_pipeline.common.latent_spaces import VAE_SPACES, space_name
from dit_pipeline.common.vae import encode_latents, load_vae
from dit_pipeline.common.vae_identity import recorded_vae
from dit_pipeline.extract.encode import to_model_input
from tests._util import FP32_EPS, assert_close_at_scale
from tests.common._spaces import (COMMIT, NEEDS_FLUX2, NEEDS_QWEN, put_in_cache, tiny_flux2, tiny_kl, tiny_qwen,
                                  use_cache)

# src/stage1/vae.py l.24-95 (VAE_CONFIGS: pretrained_path, subfolder, scaling/shift overrides) and the class each
# wrapper loads (VAE: AutoencoderKL l.153-156, Flux2VAE: AutoencoderKLFlux2 l.284-285, QwenVAE:
# AutoencoderKLQwenImage l.390-392), with misc.latent_size of the training configs that use them
# (configs/stage2/training/imagenet/ddt-en28d1152hd72-dn2d2048hd128-<name>-vpred-t4c8.yaml; e2e-sdvae-mse is in
# VAE_CONFIGS but in no training config: its shape is the SD-VAE's).
NANOGEN_VAES = {
    "flux": ("black-forest-labs/FLUX.1-dev", "vae", "AutoencoderKL", None, None, (16, 32, 32)),
    "flux2": ("black-forest-labs/FLUX.2-dev", "vae", "AutoencoderKLFlux2", None, None, (128, 16, 16)),
    "e2e-flux": ("REPA-E/e2e-flux-vae", None, "AutoencoderKL", None, None, (16, 32, 32)),
    "sd3.5": ("stabilityai/stable-diffusion-3.5-large", "vae", "AutoencoderKL", None, None, (16, 32, 32)),
    "e2e-sd3.5": ("REPA-E/e2e-sd3.5-vae", None, "AutoencoderKL", None, None, (16, 32, 32)),
    "sdvae-ema": ("stabilityai/sd-vae-ft-ema", None, "AutoencoderKL", 0.18215, 0.0, (4, 32, 32)),
    "sdvae-mse": ("stabilityai/sd-vae-ft-mse", None, "AutoencoderKL", 0.18215, 0.0, (4, 32, 32)),
    "e2e-vavae": ("REPA-E/e2e-vavae-hf", None, "AutoencoderKL", None, None, (32, 16, 16)),
    "sdxl-vae": ("madebyollin/sdxl-vae-fp16-fix", None, "AutoencoderKL", 0.13025, 0.0, (4, 32, 32)),
    "qwen-vae": ("Qwen/Qwen-Image", "vae", "AutoencoderKLQwenImage", None, None, (16, 32, 32)),
    "e2e-qwen-vae": ("REPA-E/e2e-qwenimage-vae", None, "AutoencoderKLQwenImage", None, None, (16, 32, 32)),
    "e2e-sdvae-mse": ("REPA-E/e2e-sdvae-hf", None, "AutoencoderKL", None, None, (4, 32, 32)),
}


def test_every_nanogen_vae_is_registered_as_nanogen_configures_it():
    got = {n: (s.hub_id, s.subfolder, s.cls, s.scaling_factor, s.shift_factor, s.latent_256)
           for n, s in VAE_SPACES.items()}
    assert got == NANOGEN_VAES


def pixels(n: int = 2, size: int = 32, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (n, size, size, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def nanogen_input(u8: torch.Tensor) -> torch.Tensor:
    """NanoGen's image: ToTensor ([0, 1]), then VAE._preprocess (l.175-197): no resize at its resolution,
    x * 2 - 1."""
    x = u8.permute(0, 3, 1, 2).float() / 255.0
    return x * 2.0 - 1.0


@pytest.fixture
def cache(tmp_path, monkeypatch):
    use_cache(monkeypatch, tmp_path / "hub")
    return tmp_path / "hub"


def test_pixels_are_nanogens_bit_for_bit():
    u8 = pixels()
    assert torch.equal(to_model_input(u8, views=1), nanogen_input(u8))  # (x - .5) / .5 == x * 2 - 1, exactly


@NEEDS_FLUX2
def test_flux2_is_patchified_and_normalized_by_its_batchnorm_as_nanogen(cache):
    ref = tiny_flux2()
    put_in_cache(cache, "black-forest-labs/FLUX.2-dev", "vae", ref)
    vae, ident = load_vae("flux2")
    assert (ident["source"], ident["subfolder"], ident["kind"], ident["class"], ident["latent_space"]) == \
        ("black-forest-labs/FLUX.2-dev", "vae", "hub", "AutoencoderKLFlux2", "flux2")
    assert (ident["latent_channels"], ident["downsample_factor"]) == (16, 4)  # 4 channels x 2 x 2, 2 x 2
    assert recorded_vae(ident, "x") == ("flux2", None) and space_name({"vae": ident}) == "flux2"
    u8 = pixels()
    mean, std = encode_latents(vae, to_model_input(u8, views=1))
    norm = LatentNorm.of_vae(ident)
    x = norm.apply(mean.clone())
    # NanoGen's Flux2VAE: bn_mean, bn_std = sqrt(running_var + 1e-5) (l.278-279); encode (l.339-351): the
    # posterior's mode, _patchify (l.299-306), (z - bn_mean) / bn_std
    bn_mean, bn_std = ref.bn.running_mean.clone(), torch.sqrt(ref.bn.running_var.clone() + 1e-5)
    with torch.no_grad():
        z = ref.encode(nanogen_input(u8)).latent_dist.mode()
        b, c, h, w = z.shape
        z = z.view(b, c, h // 2, 2, w // 2, 2).permute(0, 1, 3, 5, 2, 4).reshape(b, c * 4, h // 2, w // 2)
        want = (z - bn_mean.view(1, -1, 1, 1)) / bn_std.view(1, -1, 1, 1)
    assert x.shape == want.shape == (2, 16, 8, 8)
    assert_close_at_scale(x, want, rel=8 * FP32_EPS)  # our multiply by 1/std vs NanoGen's division: rounding
    assert std.shape == mean.shape and bool((std > 0).all())
    # a wrong eps (the pipeline's 1e-4) would be seen
    assert float((bn_std - torch.sqrt(ref.bn.running_var + 1e-4)).abs().max()) > 1e-5
    # decode (l.363-371): z * bn_std + bn_mean, _unpatchify (l.318-326), vae.decode, (x + 1) / 2 clamped
    with torch.no_grad():
        zz = want * bn_std.view(1, -1, 1, 1) + bn_mean.view(1, -1, 1, 1)
        zz = zz.view(b, c, 2, 2, h // 2, w // 2).permute(0, 1, 4, 2, 5, 3).reshape(b, c, h, w)
        img_ref = ((ref.decode(zz).sample + 1.0) / 2.0).clamp(0, 1)
        img = ((vae.decode(norm.invert(x)).sample + 1.0) / 2.0).clamp(0, 1)
    assert_close_at_scale(img, img_ref, rel=1e-4)


@NEEDS_QWEN
def test_qwen_image_vae_reads_an_image_as_one_frame_and_normalizes_bit_for_bit(cache):
    ref = tiny_qwen()
    put_in_cache(cache, "Qwen/Qwen-Image", "vae", ref)
    vae, ident = load_vae("qwen-vae")
    assert (ident["class"], ident["latent_channels"], ident["downsample_factor"], ident["latent_space"]) == \
        ("AutoencoderKLQwenImage", 4, 2, "qwen-vae")
    u8 = pixels()
    mean, _ = encode_latents(vae, to_model_input(u8, views=1))
    x = LatentNorm.of_vae(ident).apply(mean.clone())
    # QwenVAE._vae_encode (l.396-401): (B, C, H, W) -> (B, C, 1, H, W), mean squeezed back; VAE.__init__
    # (l.137-145): shift = tensor(latents_mean), scale = 1 / tensor(latents_std); encode (l.223)
    shift = torch.tensor(ref.config.latents_mean).reshape(1, -1, 1, 1)
    scale = 1 / torch.tensor(ref.config.latents_std).reshape(1, -1, 1, 1)
    with torch.no_grad():
        z = ref.encode(nanogen_input(u8).unsqueeze(2)).latent_dist.mean.squeeze(2)
        want = (z - shift) * scale
    assert x.shape == (2, 4, 16, 16)
    np.testing.assert_array_equal(x.numpy(), want.numpy())
    # QwenVAE._vae_decode (l.403-406) after VAE.decode's z / scale + shift (l.237)
    with torch.no_grad():
        img_ref = ref.decode((want / scale + shift).unsqueeze(2)).sample.squeeze(2)
        img = vae.decode(LatentNorm.of_vae(ident).invert(x)).sample
    assert img.shape == (2, 3, 32, 32)
    assert_close_at_scale(img, img_ref, rel=1e-5)


@pytest.mark.parametrize("name, config, want", [
    # the preset's overrides win over the config (sdxl-vae: scaling 0.13025, shift 0.0)
    ("sdxl-vae", dict(scaling_factor=0.5), (0.13025, 0.0)),
    # no override: the config's shift and scale (FLUX.1's)
    ("flux", dict(scaling_factor=0.3611, shift_factor=0.1159), (0.3611, 0.1159)),
])
def test_scalar_spaces_take_nanogens_factors(cache, name, config, want):
    s = VAE_SPACES[name]
    ref = tiny_kl(**config)
    put_in_cache(cache, s.hub_id, s.subfolder, ref)
    vae, ident = load_vae(name)
    assert (ident["scaling_factor"], ident["shift_factor"]) == want and "normalization" not in ident
    z = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(1))
    got = LatentNorm.of_vae(ident).apply(z.clone())
    np.testing.assert_array_equal(got.numpy(), ((z - want[1]) * want[0]).numpy())  # vae.py l.223


def test_config_statistics_follow_nanogens_rule_not_the_pipelines(cache):
    """A VAE config with latents_mean/std (REPA-E's e2e VAEs): NanoGen divides by std and ignores
    scaling_factor (l.137-145), where diffusers' pipelines multiply by scaling_factor too."""
    mean, std = [0.3, -0.1, 0.7, 0.05], [1.9, 0.8, 2.5, 1.3]
    put_in_cache(cache, "REPA-E/e2e-vavae-hf", None, tiny_kl(latents_mean=mean, latents_std=std,
                                                               scaling_factor=0.7))
    _, ident = load_vae("e2e-vavae")
    rec = ident["normalization"]
    assert rec["form"] == "scale_shift" and rec["source"]["kind"] == "vae_config"
    z = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(2))
    want = (z - torch.tensor(mean).reshape(1, -1, 1, 1)) * (1 / torch.tensor(std).reshape(1, -1, 1, 1))
    np.testing.assert_array_equal(LatentNorm.of_vae(ident).apply(z.clone()).numpy(), want.numpy())
    assert "latents_mean" not in ident  # diffusers' rule (multiplier = scaling_factor) cannot take over


def test_a_space_nanogen_cannot_normalize_is_refused(cache):
    put_in_cache(cache, "REPA-E/e2e-sdvae-hf", None, tiny_kl(shift_factor=None))  # z - None in NanoGen
    with pytest.raises(UserError, match=r"e2e-sdvae-mse: its config has shift_factor/scaling_factor None .* "
                                        r"computes \(z - None\)"):
        load_vae("e2e-sdvae-mse")


def test_an_uncached_space_names_its_repository_and_subfolder(cache):
    with pytest.raises(UserError) as e:
        load_vae("flux")
    assert str(e.value).startswith("--vae 'flux' is NanoGen's flux latent space (black-forest-labs/FLUX.1-dev, "
                                   "subfolder vae), which is not in the Hugging Face cache")
    assert "huggingface-cli download black-forest-labs/FLUX.1-dev --include 'vae/*'" in str(e.value)


@NEEDS_FLUX2
def test_a_local_folder_of_those_classes_gets_its_layout(tmp_path):
    """Without NanoGen's name: the class decides the layout, FLUX.2's eps is its config's (the FLUX.2 pipeline)."""
    tiny_flux2().save_pretrained(tmp_path / "f2")
    vae, ident = load_vae(str(tmp_path / "f2"))
    assert ident["normalization"]["source"]["eps"] == 1e-4 and "latent_space" not in ident
    assert space_name({"vae": ident}) is None
    assert vae.encode(torch.zeros(1, 3, 16, 16)).latent_dist.mean.shape == (1, 16, 4, 4)


def test_old_diffusers_is_refused_naming_the_version(cache, monkeypatch):
    import diffusers

    monkeypatch.setattr(diffusers, "AutoencoderKLFlux2", None, raising=False)  # as diffusers 0.35: nothing found
    put_in_cache(cache, "black-forest-labs/FLUX.2-dev", "vae", tiny_kl())
    with pytest.raises(UserError, match=r"is an AutoencoderKLFlux2, which diffusers provides from version 0\.36\.0 "
                                        r"on; .* pip install 'diffusers>=0\.36\.0'"):
        load_vae("flux2")


@NEEDS_QWEN
def test_commit_is_the_caches(cache):
    put_in_cache(cache, "Qwen/Qwen-Image", "vae", tiny_qwen())
    _, ident = load_vae("qwen-vae")
    assert ident["commit"] == COMMIT


@pytest.mark.parametrize("name, make, repo", [
    pytest.param("flux2", tiny_flux2, "black-forest-labs/FLUX.2-dev", marks=NEEDS_FLUX2),
    pytest.param("qwen-vae", tiny_qwen, "Qwen/Qwen-Image", marks=NEEDS_QWEN)])
def test_extracted_by_name_and_decoded_from_the_record(cache, tmp_path, name, make, repo):
    """dit-extract --vae NAME: the shards hold the DiT-layout posterior, the manifest NanoGen's normalization and
    name; the decoder a checkpoint's record names decodes them (sample.generate.decode_latents)."""
    from dit_pipeline.extract import ExtractConfig, run_extract
    from dit_pipeline.sample.generate import decode_latents
    from dit_pipeline.shards import read_manifest
    from tests._util import make_image_tree
    from tests.extract.conftest import read_samples

    ref = make()
    put_in_cache(cache, repo, "vae", ref)
    tree = make_image_tree(tmp_path / "img", counts=(2, 1))
    out = tmp_path / "out"
    run_extract(ExtractConfig(data_path=str(tree), out=str(out), vae=name, image_size=32, dtype="float32",
                              batch_size=2, num_workers=0, quiet=True))
    m = read_manifest(out)
    channels = 16 if name == "flux2" else 4
    assert m.latent_shape == [channels, 8 if name == "flux2" else 16, 8 if name == "flux2" else 16]
    assert (m.extraction["vae"]["latent_space"], m.store, m.views) == (name, "posterior", 2)
    assert space_name(m.extraction) == name and m.norm.key() == LatentNorm.of_vae(m.extraction["vae"]).key()
    from dit_pipeline.shards.info import format_info, info_dict

    assert f"{repo}, subfolder vae, revision main, commit {COMMIT} (NanoGen's {name})" in format_info(info_dict(out))
    samples = read_samples(out)
    vae, _ = load_vae(recorded_vae(m.extraction["vae"], "the manifest")[0])
    s = samples[sorted(samples)[0]]
    x = m.norm.apply(torch.from_numpy(s.mean).clone())                   # [2 views, C, h, w]
    img = decode_latents(vae, x, norm=m.norm)
    assert img.shape == (2, 32, 32, 3) and img.dtype == torch.uint8
    with torch.no_grad():  # the same decode written out: the record's normalization inverted, the VAE's layout
        z = m.norm.invert(x)
        if name == "flux2":
            z = z.view(2, 4, 2, 2, 8, 8).permute(0, 1, 4, 2, 5, 3).reshape(2, 4, 16, 16)
            direct = ref.decode(z).sample
        else:
            direct = ref.decode(z.unsqueeze(2)).sample.squeeze(2)
    expect = torch.clamp(127.5 * direct + 128.0, 0, 255).permute(0, 2, 3, 1).to(torch.uint8)  # DiT's conversion
    assert int((img.int() - expect.int()).abs().max()) <= 1  # one step where a value sits on an integer
    if name == "flux2":  # --store mode: NanoGen's latent (the posterior's mode), one array per view
        run_extract(ExtractConfig(data_path=str(tree), out=str(tmp_path / "mode"), vae=name, image_size=32,
                                  dtype="float32", batch_size=2, num_workers=0, quiet=True, store="mode"))
        mm = read_manifest(tmp_path / "mode")
        assert (mm.store, mm.extraction["store"], mm.extraction["seed"]) == ("sample", "mode", None)
        modes = read_samples(tmp_path / "mode")
        assert all(np.array_equal(modes[k].latent, samples[k].mean) for k in samples)


@NEEDS_FLUX2
def test_dit_sample_decodes_with_the_space_its_checkpoint_records(cache, tmp_path):
    """A model trained on `--vae flux2` shards samples without --vae: the checkpoint's record names flux2, which
    loads from the cache in FLUX.2's layout and decodes 16 x 8 x 8 latents to 32 px images."""
    from click.testing import CliRunner

    from dit_pipeline.cli import sample_main
    from tests.sample.conftest import our_checkpoint, random_dit

    put_in_cache(cache, "black-forest-labs/FLUX.2-dev", "vae", tiny_flux2())
    _, ident = load_vae("flux2")
    norm = LatentNorm.of_vae(ident)
    latent = {**norm.record(), "vae": ident, "class_names": [f"c{i}" for i in range(10)]}
    ckpt = tmp_path / "flux2.pt"
    torch.save(our_checkpoint(random_dit(1, in_channels=16, input_size=8),
                              random_dit(2, in_channels=16, input_size=8), latent=latent), ckpt)
    npz = tmp_path / "s.npz"
    r = CliRunner().invoke(sample_main, ["--ckpt", str(ckpt), "--steps", "2", "--class-labels", "1,2", "--npz",
                                         str(npz)])
    assert r.exit_code == 0, r.output
    with np.load(npz) as z:
        assert z["arr_0"].shape == (2, 32, 32, 3) and z["arr_0"].std() > 0
