"""Decode + ADM crop: exact match with an independent computation, odd files, bombs, [-1, 1] and the flip."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image, ImageFile
from torchvision import transforms

from dit_pipeline.extract.encode import to_model_input
from dit_pipeline.extract.images import SkippedImage, adm_center_crop, load_and_crop, load_rgb
from tests._util import draw_image
from tests.extract.conftest import UNUSABLE, odd_files


def reference_crop(img: Image.Image, size: int) -> np.ndarray:
    """docs/REFERENCE.md's ADM center crop, written out independently (sizes by hand, PIL's crop box)."""
    w, h = img.size
    while min(w, h) >= 2 * size:
        w, h = w // 2, h // 2
        img = img.resize((w, h), Image.Resampling.BOX)
    nw, nh = round(w * size / min(w, h)), round(h * size / min(w, h))
    img = img.resize((nw, nh), Image.Resampling.BICUBIC)
    left, top = (nw - size) // 2, (nh - size) // 2
    return np.array(img.crop((left, top, left + size, top + size)))


@pytest.mark.parametrize("wh, size", [((48, 40), 32), ((40, 64), 16), ((1000, 600), 256), ((600, 1000), 256),
                                      ((513, 512), 256), ((511, 700), 256), ((257, 300), 256), ((20, 30), 32),
                                      ((2048, 1537), 256), ((97, 33), 8), ((4000, 64), 32)])
def test_adm_crop_matches_independent_computation(wh, size):
    img = draw_image(3, wh[0] % 7, wh)
    got = adm_center_crop(img, size)
    assert got.shape == (size, size, 3) and got.dtype == np.uint8
    np.testing.assert_array_equal(got, reference_crop(img, size))


@pytest.mark.parametrize("wh, size, calls", [
    # 1000x600 -> BOX 500x300 (300 < 512 stops) -> BICUBIC 427x256 (500*256/300 = 426.67)
    ((1000, 600), 256, [((500, 300), Image.Resampling.BOX), ((427, 256), Image.Resampling.BICUBIC)]),
    # short side exactly 2*size halves; floor halving of the odd side 1025 -> 512
    ((1025, 512), 256, [((512, 256), Image.Resampling.BOX), ((512, 256), Image.Resampling.BICUBIC)]),
    # 2 halvings: 2048x1537 -> 1024x768 -> 512x384 (384 < 512)
    ((2048, 1537), 256, [((1024, 768), Image.Resampling.BOX), ((512, 384), Image.Resampling.BOX),
                         ((341, 256), Image.Resampling.BICUBIC)]),
    # sides rounded with Python's round(): 38 * 24/32 = 28.5 exactly -> 28 (half to even)
    ((38, 32), 24, [((28, 24), Image.Resampling.BICUBIC)]),
    # upsampling: 20x30 to short side 32 -> 32x48
    ((20, 30), 32, [((32, 48), Image.Resampling.BICUBIC)]),
])
def test_adm_crop_geometry(monkeypatch, wh, size, calls):
    seen = []
    real = Image.Image.resize

    def spy(self, new_size, resample=None, *a, **k):
        seen.append((tuple(new_size), resample))
        return real(self, new_size, resample, *a, **k)

    monkeypatch.setattr(Image.Image, "resize", spy)
    adm_center_crop(draw_image(0, 0, wh), size)
    assert seen == calls


def test_crop_offsets_are_floored():
    # 427 wide after the resize: left offset (427 - 256) // 2 = 85, so the crop is columns 85..340.
    img = draw_image(1, 2, (1000, 600))
    half = img.resize((500, 300), Image.Resampling.BOX).resize((427, 256), Image.Resampling.BICUBIC)
    np.testing.assert_array_equal(adm_center_crop(img, 256), np.asarray(half)[:, 85:341])


def test_pixels_to_minus_one_one_like_torchvision_and_flip_is_mirror():
    crops = np.stack([adm_center_crop(draw_image(i, i, (50, 41)), 32) for i in range(3)])
    x = to_model_input(torch.from_numpy(crops), views=2)
    assert x.shape == (6, 3, 32, 32) and x.dtype == torch.float32
    assert x.is_contiguous(memory_format=torch.channels_last)
    tv = transforms.Compose([transforms.ToTensor(), transforms.Normalize([0.5] * 3, [0.5] * 3)])
    for i in range(3):
        ref = tv(Image.fromarray(crops[i]))
        assert torch.equal(x[i], ref)                                            # bit-identical
        assert torch.equal(x[3 + i], tv(Image.fromarray(np.ascontiguousarray(crops[i][:, ::-1]))))
    assert float(x.min()) >= -1.0 and float(x.max()) <= 1.0
    one = to_model_input(torch.from_numpy(crops), views=1)
    assert torch.equal(one, x[:3])


@pytest.mark.parametrize("rel", [r for r in odd_files() if r not in UNUSABLE])
def test_odd_but_usable_files_become_rgb(tmp_path, rel):
    path = tmp_path / "f"
    path.write_bytes(odd_files()[rel])
    rgb, info = load_rgb(path)
    assert rgb.mode == "RGB"
    with Image.open(path) as raw:
        assert (info.width, info.height, info.mode) == (raw.width, raw.height, raw.mode)
        if raw.mode in ("I;16", "I"):
            # 16-bit values scaled to 8 bits (PIL's convert would clip them all to 255)
            expect = ((np.asarray(raw).astype(np.int64) + 128) // 257).astype(np.uint8)
            np.testing.assert_array_equal(np.asarray(rgb)[..., 0], expect)
            assert len(np.unique(expect)) > 100
        else:
            np.testing.assert_array_equal(np.asarray(rgb), np.asarray(raw.convert("RGB")))
    crop, _ = load_and_crop(path, 16)
    assert crop.shape == (16, 16, 3)


def test_png_named_jpeg_is_decoded_as_png(tmp_path):
    path = tmp_path / "x.JPEG"
    path.write_bytes(odd_files()["b_odd/png_named.JPEG"])
    _, info = load_rgb(path)
    assert info.format == "PNG"


@pytest.mark.parametrize("rel, reason", sorted(UNUSABLE.items()))
def test_unusable_files_are_skipped_with_reason(tmp_path, rel, reason):
    path = tmp_path / "f"
    path.write_bytes(odd_files()[rel])
    with pytest.raises(SkippedImage) as e:
        load_and_crop(path, 16)
    assert reason in e.value.reason


def test_bombs_are_refused_without_decoding(tmp_path, monkeypatch):
    from tests.extract.conftest import HUGE, JUST_ABOVE, bomb_png

    def no_decode(self, *a, **k):
        raise AssertionError("a bomb must not be decoded")

    monkeypatch.setattr(ImageFile.ImageFile, "load", no_decode)
    for size in (HUGE, JUST_ABOVE):
        path = tmp_path / f"{size[0]}.png"
        path.write_bytes(bomb_png(size))
        with pytest.raises(SkippedImage, match="decompression bomb, not decoded"):
            load_rgb(path)
    # Our own limit is checked from the header too, even below PIL's.
    path = tmp_path / "small.png"
    path.write_bytes(bomb_png((300, 200)))
    with pytest.raises(SkippedImage, match="declares 300x200 = 60000 pixels, more than the limit of 50000"):
        load_rgb(path, max_pixels=50_000)


def test_missing_file_is_a_skip(tmp_path):
    with pytest.raises(SkippedImage, match="cannot read the file"):
        load_rgb(tmp_path / "gone.JPEG")
