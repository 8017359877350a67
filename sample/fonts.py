"""Fonts for the class names written on sample grids, so that a name such as "Ñandú" or "鳥" is never drawn as
boxes.

Pillow's built-in font (what the grids used alone) has glyphs for ASCII only, and a character without a glyph
is drawn as the font's box. A label is drawn with the first font of a chain that has every one of its glyphs:
Pillow's built-in font (so ASCII labels keep their pixels), a font named by `DIT_LABEL_FONT` (for scripts no
bundled font covers), DejaVu Sans (shipped with matplotlib, the optional `plot` dependency, and with most Linux
systems), then common system fonts with CJK glyphs. When no font has them all, each character takes the first
font that has it, and a character no font has is transliterated: its accents dropped (Unicode decomposition:
"Ñ" -> "N"), else written as its code point ("U+9CE5"). Whether a font has a glyph is decided by drawing it:
a missing glyph draws the font's `.notdef` shape, the same for every missing character.
"""
from __future__ import annotations

import functools
import importlib.util
import os
import unicodedata
from pathlib import Path
from typing import Any

LABEL_FONT_ENV = "DIT_LABEL_FONT"
_SYSTEM_FONTS = (
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/opentype/noto/NotoSansCJK-Regular.ttc",
    "/usr/share/fonts/noto-cjk/NotoSansCJK-Regular.ttc",
    "/usr/share/fonts/truetype/droid/DroidSansFallbackFull.ttf",
    "/System/Library/Fonts/Supplemental/Arial Unicode.ttf",
    "/System/Library/Fonts/PingFang.ttc",
    "C:/Windows/Fonts/arialuni.ttf",
    "C:/Windows/Fonts/msgothic.ttc",
)
_NO_GLYPH = "\U0010fffd"  # a private-use code point at the end of Unicode: no font has a glyph for it


def _matplotlib_dejavu() -> list[str]:
    if importlib.util.find_spec("matplotlib") is None:
        return []
    import matplotlib

    return [str(Path(matplotlib.get_data_path()) / "fonts" / "ttf" / "DejaVuSans.ttf")]


def font_files() -> list[str]:
    """The fallback font files of the chain that exist here, in order."""
    named = [os.environ[LABEL_FONT_ENV]] if os.environ.get(LABEL_FONT_ENV) else []
    found = []
    for f in [*named, *_matplotlib_dejavu(), *_SYSTEM_FONTS]:
        if f not in found and Path(f).is_file():
            found.append(f)
    return found


@functools.lru_cache(maxsize=16)
def label_fonts(size: int) -> tuple[Any, ...]:
    """The chain at `size` pixels: Pillow's built-in font, then every fallback file that loads."""
    from PIL import ImageFont

    try:
        chain = [ImageFont.load_default(size=size)]
    except (TypeError, OSError, ImportError):  # Pillow without FreeType: the fixed bitmap font, nothing else
        return (ImageFont.load_default(),)
    for path in font_files():
        try:
            chain.append(ImageFont.truetype(path, size=size))
        except OSError:
            continue
    return tuple(chain)


def _mask(font: Any, ch: str) -> tuple[tuple[int, int], bytes]:
    m = font.getmask(ch)
    return m.size, bytes(m)


@functools.lru_cache(maxsize=4096)
def _has_glyph(font: Any, ch: str) -> bool:
    if unicodedata.category(ch).startswith(("Z", "C")):  # spaces draw nothing in any font
        return True
    try:
        return _mask(font, ch) != _mask(font, _NO_GLYPH)
    except UnicodeEncodeError:  # a bitmap font (Pillow's fixed one, without FreeType) encodes Latin-1 only
        return ch.isascii() and ch.isprintable()


def has_glyphs(font: Any, text: str) -> bool:
    """Whether `font` draws every character of `text` (none as its missing-glyph box)."""
    return all(_has_glyph(font, ch) for ch in text)


def _transliterate(ch: str, fonts: tuple[Any, ...]) -> str:
    base = "".join(c for c in unicodedata.normalize("NFKD", ch) if not unicodedata.combining(c))
    return base if base and base != ch and has_glyphs(fonts[0], base) else f"U+{ord(ch):04X}"


def label_runs(text: str, size: int) -> list[tuple[Any, str]]:
    """`text` as (font, piece) runs to draw one after another: one run in the first font that has every glyph,
    else per character (see the module docstring); every piece has its font's glyphs."""
    text = unicodedata.normalize("NFC", text)
    fonts = label_fonts(size)
    whole = next((f for f in fonts if has_glyphs(f, text)), None)
    if whole is not None:
        return [(whole, text)]
    runs: list[tuple[Any, str]] = []
    for ch in text:
        font = next((f for f in fonts if _has_glyph(f, ch)), None)
        piece = ch
        if font is None:
            font, piece = fonts[0], _transliterate(ch, fonts)
        if runs and runs[-1][0] is font:
            runs[-1] = (font, runs[-1][1] + piece)
        else:
            runs.append((font, piece))
    return runs
