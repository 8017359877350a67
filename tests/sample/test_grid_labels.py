"""Class names on grid tiles: never drawn as missing-glyph boxes (sample/fonts.py). Pillow's built-in font has
ASCII only; "Ñandú" is drawn with a font that has its glyphs (DejaVu Sans here) and "鳥", which no font here
has, is written as its code point; ASCII labels keep exactly the pixels they had."""
from __future__ import annotations

import numpy as np
import pytest
from PIL import Image, ImageDraw, ImageFont

from dit_pipeline.sample import fonts
from dit_pipeline.sample.grid import GRID_PADDING, _draw_labels

SIZE = 160 // 16  # the label size of 160 px tiles (max(8, h // 16))


@pytest.fixture(autouse=True)
def fresh_chain():
    fonts.label_fonts.cache_clear()
    yield
    fonts.label_fonts.cache_clear()


def _grid(labels: list[str]) -> np.ndarray:
    n = len(labels)
    canvas = np.full((160 + 2 * GRID_PADDING, n * (160 + GRID_PADDING) + GRID_PADDING, 3), 90, np.uint8)
    return _draw_labels(canvas, labels, (160, 160), n, GRID_PADDING)


def _old_drawing(labels: list[str]) -> np.ndarray:
    """The grid labels as they were drawn before (Pillow's built-in font only)."""
    n = len(labels)
    img = Image.fromarray(np.full((160 + 2 * GRID_PADDING, n * (160 + GRID_PADDING) + GRID_PADDING, 3), 90, np.uint8))
    draw = ImageDraw.Draw(img)
    font = ImageFont.load_default(size=SIZE)
    for k, text in enumerate(labels):
        x, y = GRID_PADDING + k * (160 + GRID_PADDING), GRID_PADDING
        _, _, right, bottom = draw.textbbox((x + 1, y), text, font=font)
        draw.rectangle((x, y, min(right + 1, x + 159), min(bottom + 1, y + 159)), fill=(0, 0, 0))
        draw.text((x + 1, y), text, fill=(255, 255, 255), font=font)
    return np.array(img)


def test_ascii_labels_keep_their_pixels():
    labels = ["207 golden_retriever", "3 n01440764", "12"]
    assert np.array_equal(_grid(labels), _old_drawing(labels))


def test_pillows_own_font_draws_non_ascii_names_as_boxes():
    """The bug: the built-in font has no glyph for Ñ, ú or 鳥 (each drawn as the same .notdef box)."""
    default = ImageFont.load_default(size=SIZE)
    assert not fonts.has_glyphs(default, "Ñ") and not fonts.has_glyphs(default, "鳥")
    assert fonts.has_glyphs(default, "Nandu 0123")


def test_non_ascii_names_are_drawn_with_glyphs_or_transliterated():
    dejavu = [f for f in fonts.font_files() if f.endswith("DejaVuSans.ttf")]
    for text in ("1 Ñandú", "2 鳥", "3 Ñandú 鳥"):
        runs = fonts.label_runs(text, SIZE)
        assert all(fonts.has_glyphs(font, piece) for font, piece in runs), text  # nothing drawn as a box
    cjk = any(fonts.has_glyphs(f, "鳥") for f in fonts.label_fonts(SIZE))
    bird = "鳥" if cjk else "U+9CE5"
    assert "".join(p for _, p in fonts.label_runs("2 鳥", SIZE)) == f"2 {bird}"
    if not dejavu:
        pytest.skip("no DejaVu Sans here (neither matplotlib nor the system font)")
    [(font, piece)] = fonts.label_runs("1 Ñandú", SIZE)
    assert piece == "1 Ñandú" and font.path == dejavu[0]
    # drawn exactly as DejaVu Sans itself draws it: the known-good rendering of this name
    known = ImageFont.truetype(dejavu[0], size=SIZE)
    img = Image.fromarray(np.full((160 + 2 * GRID_PADDING, 160 + 2 * GRID_PADDING, 3), 90, np.uint8))
    draw = ImageDraw.Draw(img)
    _, _, right, bottom = draw.textbbox((GRID_PADDING + 1, GRID_PADDING), "1 Ñandú", font=known)
    draw.rectangle((GRID_PADDING, GRID_PADDING, right + 1, bottom + 1), fill=(0, 0, 0))
    draw.text((GRID_PADDING + 1, GRID_PADDING), "1 Ñandú", fill=(255, 255, 255), font=known)
    drawn = _grid(["1 Ñandú"])
    assert np.array_equal(drawn, np.array(img))
    assert not np.array_equal(drawn, _old_drawing(["1 Ñandú"]))  # which drew boxes


def test_without_fallback_fonts_names_are_transliterated_not_boxed(monkeypatch):
    monkeypatch.setattr(fonts, "font_files", lambda: [])
    assert [p for _, p in fonts.label_runs("1 Ñandú", SIZE)] == ["1 Nandu"]
    assert [p for _, p in fonts.label_runs("2 鳥", SIZE)] == ["2 U+9CE5"]
    assert [p for _, p in fonts.label_runs("Ça va, Zürich", SIZE)] == ["Ca va, Zurich"]


def test_a_font_named_by_the_environment_comes_first(monkeypatch, tmp_path):
    dejavu = [f for f in fonts.font_files() if f.endswith("DejaVuSans.ttf")]
    if not dejavu:
        pytest.skip("no DejaVu Sans here")
    monkeypatch.setenv(fonts.LABEL_FONT_ENV, dejavu[-1])
    monkeypatch.setattr(fonts, "_SYSTEM_FONTS", ())
    monkeypatch.setattr(fonts, "_matplotlib_dejavu", lambda: [])
    assert fonts.font_files() == [dejavu[-1]]
    [(font, piece)] = fonts.label_runs("Ñandú", SIZE)
    assert font.path == dejavu[-1] and piece == "Ñandú"


def test_a_bitmap_font_is_probed_without_raising():
    """Pillow's fixed bitmap font (its only font without FreeType) encodes Latin-1 only: probing a glyph with the
    private-use code point raised UnicodeEncodeError and crashed every labelled grid (issue #34, at Pillow 10.0)."""
    if not hasattr(ImageFont, "load_default_imagefont"):  # Pillow < 10.2: no public way to get it beside FreeType
        pytest.skip("this Pillow cannot load its bitmap font while FreeType is present")
    bitmap = ImageFont.load_default_imagefont()
    assert fonts.has_glyphs(bitmap, "Nandu 12") and not fonts.has_glyphs(bitmap, "Ñ") and not fonts.has_glyphs(bitmap, "鳥")
