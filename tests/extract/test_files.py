"""Image discovery and labels: torchvision's ImageFolder convention, hidden entries ignored, path errors."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from torchvision.datasets import ImageFolder

from dit_pipeline.common.errors import UserError
from dit_pipeline.extract.files import scan_image_folder
from tests._util import draw_image


def _rel(root: Path, path: str) -> str:
    return Path(os.path.relpath(path, root)).as_posix()


def test_labels_and_order_equal_imagefolder(odd_tree, tmp_path):
    images = scan_image_folder(odd_tree)
    # ImageFolder on the same tree with the hidden entries removed (ImageFolder itself would make
    # `.ipynb_checkpoints` class 0 and shift every label by one).
    clean = tmp_path / "clean"
    shutil.copytree(odd_tree, clean, ignore=lambda d, names: [n for n in names if n.startswith(".")])
    ref = ImageFolder(str(clean), allow_empty=True)
    assert list(images.class_names) == ref.classes == ["a_plain", "b_odd", "c_empty", "d_bad"]
    assert list(zip(images.paths, images.labels)) == [(_rel(clean, p), t) for p, t in ref.samples]
    # The empty class keeps its index: d_bad is 3, not 2.
    assert images.labels[-1] == 3 and 2 not in images.labels
    assert "a_plain/nested/deep.jpg" in images.paths  # recursive, like ImageFolder
    assert not any(Path(p).name.startswith(".") for p in images.paths)
    assert not any(p.endswith((".txt", ".csv", "README")) for p in images.paths)


def test_extensions_case_insensitive_and_sorted(tmp_path):
    root = tmp_path / "t"
    (root / "zebra").mkdir(parents=True)
    (root / "Apple").mkdir()
    for name in ("b.JPEG", "a.jpg", "C.Png", "d.WebP", "e.gif", "f.jpeg.txt"):
        draw_image(0, 0).save(root / "zebra" / name, format="PNG")
    draw_image(0, 0).save(root / "Apple" / "x.BMP", format="BMP")
    images = scan_image_folder(root)
    assert images.class_names == ("Apple", "zebra")  # plain str sort: uppercase first, like ImageFolder
    assert images.paths == ("Apple/x.BMP", "zebra/C.Png", "zebra/a.jpg", "zebra/b.JPEG", "zebra/d.WebP")
    assert images.labels == (0, 1, 1, 1, 1)
    ref = ImageFolder(str(root))
    assert [(_rel(root, p), t) for p, t in ref.samples] == list(zip(images.paths, images.labels))


def test_symlink_loop_is_not_followed_forever(tmp_path):
    root = tmp_path / "t"
    (root / "cls").mkdir(parents=True)
    draw_image(0, 0).save(root / "cls" / "a.png")
    os.symlink(root / "cls", root / "cls" / "loop")
    assert scan_image_folder(root).paths == ("cls/a.png",)


def test_head_and_fingerprint(odd_tree, tmp_path):
    images = scan_image_folder(odd_tree)
    head = images.head(4)
    assert head.paths == images.paths[:4] and head.labels == images.labels[:4]
    assert head.class_names == images.class_names
    assert images.head(None) is images and images.head(10_000) is images
    assert head.fingerprint() != images.fingerprint()
    assert scan_image_folder(odd_tree).fingerprint() == images.fingerprint()
    copy = tmp_path / "copy"
    shutil.copytree(odd_tree, copy)
    assert scan_image_folder(copy).fingerprint() == images.fingerprint()  # independent of the location
    (copy / "a_plain" / "img0.JPEG").rename(copy / "a_plain" / "img9.JPEG")
    assert scan_image_folder(copy).fingerprint() != images.fingerprint()


@pytest.mark.parametrize("case, message", [
    ("missing", "no such folder"),
    ("file", "is a file, not a folder"),
    ("empty", "no class folders found"),
    ("loose", "holds 2 image file(s) directly; put them in one sub-folder per class"),
    ("no_images", "found 2 class folder(s) but no image files"),
])
def test_path_errors(tmp_path, case, message):
    root = tmp_path / "data"
    if case == "file":
        root.write_text("x")
    elif case == "empty":
        root.mkdir()
    elif case == "loose":
        root.mkdir()
        for i in range(2):
            draw_image(0, i).save(root / f"{i}.JPEG")
    elif case == "no_images":
        (root / "a").mkdir(parents=True)
        (root / "b").mkdir()
        (root / "a" / "notes.txt").write_text("x")
    with pytest.raises(UserError) as e:
        scan_image_folder(root)
    assert message in str(e.value)
    assert str(root) in str(e.value) and "--data-path" in str(e.value)


def test_unreadable_folder_is_user_error(tmp_path, monkeypatch):
    # Tests run as root, where chmod 000 does not stop reading; make scandir fail like it would.
    root = tmp_path / "data"
    (root / "a").mkdir(parents=True)
    real = os.scandir

    def deny(path="."):
        if Path(path) == root:
            raise PermissionError(13, "Permission denied", str(path))
        return real(path)

    monkeypatch.setattr(os, "scandir", deny)
    with pytest.raises(UserError, match="cannot read this folder \\(permission denied\\)"):
        scan_image_folder(root)


def test_unreadable_class_folder_is_user_error(tmp_path, monkeypatch):
    root = tmp_path / "data"
    (root / "a").mkdir(parents=True)
    real = os.scandir

    def deny(path="."):
        if Path(path) == root / "a":
            raise PermissionError(13, "Permission denied", str(path))
        return real(path)

    monkeypatch.setattr(os, "scandir", deny)
    with pytest.raises(UserError, match="cannot read folder .*/a"):
        scan_image_folder(root)
