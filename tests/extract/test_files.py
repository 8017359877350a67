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
    images = scan_image_folder(odd_tree, keep_empty_classes=True)
    # ImageFolder on the same tree with the hidden entries removed (ImageFolder itself would make
    # `.ipynb_checkpoints` class 0 and shift every label by one).
    clean = tmp_path / "clean"
    shutil.copytree(odd_tree, clean, ignore=lambda d, names: [n for n in names if n.startswith(".")])
    ref = ImageFolder(str(clean), allow_empty=True)
    assert list(images.class_names) == ref.classes == ["a_plain", "b_odd", "c_empty", "d_bad"]
    assert list(zip(images.paths, images.labels)) == [(_rel(clean, p), t) for p, t in ref.samples]
    # Kept (keep_empty_classes), the empty class keeps its index: d_bad is 3, not 2.
    assert images.labels[-1] == 3 and 2 not in images.labels
    assert "a_plain/nested/deep.jpg" in images.paths  # recursive, like ImageFolder
    assert not any(Path(p).name.startswith(".") for p in images.paths)
    assert not any(p.endswith((".txt", ".csv", "README")) for p in images.paths)


def test_an_empty_class_folder_is_refused_unless_kept(odd_tree):
    """torchvision's ImageFolder refuses a class folder without images (a silent label with no samples)."""
    with pytest.raises(FileNotFoundError, match="Found no valid file for the classes c_empty"):
        ImageFolder(str(odd_tree))
    with pytest.raises(UserError) as e:
        scan_image_folder(odd_tree)
    assert str(e.value) == (
        f"--data-path {odd_tree}: 1 of 4 class folder(s) hold no image files (c_empty); torchvision's ImageFolder "
        "refuses this too. Remove them or add their images, or pass --keep-empty-classes to keep their labels "
        "(each keeps its index in sorted order, so the other labels stay those of ImageFolder(allow_empty=True)).")
    kept = scan_image_folder(odd_tree, keep_empty_classes=True)
    assert kept.class_names[2] == "c_empty" and 2 not in kept.labels


def test_many_empty_class_folders_are_counted_and_the_first_five_named(tmp_path):
    root = tmp_path / "t"
    for name in ("a", "b", "c", "d", "e", "f", "g"):
        (root / name).mkdir(parents=True)
    draw_image(0, 0).save(root / "d" / "x.png")
    with pytest.raises(UserError, match=r": 6 of 7 class folder\(s\) hold no image files \(a, b, c, e, f and 1 more\)"):
        scan_image_folder(root)


def _split_tree(root: Path, names) -> Path:
    for i, name in enumerate(names):
        for cls in ("n01", "n02"):
            (root / name / cls).mkdir(parents=True)
            draw_image(i, 0).save(root / name / cls / "x.JPEG")
    return root


@pytest.mark.parametrize("names, refused", [
    (("train", "val"), "train, val"),
    (("Train", "Val", "test"), "Train, Val, test"),
    (("train",), "train"),
    (("training", "validation", "extra"), "training, validation"),
    (("n01", "test"), None),          # one class called test among real class names: left alone
])
def test_split_folders_are_refused_as_classes(tmp_path, names, refused):
    """A dataset root with train/ and val/ (the layout many guides use) would give 2 classes named after the
    splits and train on the validation images."""
    root = _split_tree(tmp_path / "data", names)
    if refused is None:
        assert scan_image_folder(root).class_names == tuple(sorted(names))
        return
    with pytest.raises(UserError) as e:
        scan_image_folder(root)
    first = refused.split(", ")[0]
    assert str(e.value) == (
        f"--data-path {root}: its class folders look like dataset splits ({refused}), not classes: every image "
        "would be labelled with its split's name, and the images of every split would be trained on. Pass the "
        f"folder of one split, whose sub-folders are the classes (e.g. --data-path {root / first}), or add "
        "--allow-split-names if these really are class names.")
    assert scan_image_folder(root, allow_split_names=True).class_names == tuple(sorted(names))
    assert scan_image_folder(root / first).class_names == ("n01", "n02")  # the suggested folder works


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
    images = scan_image_folder(odd_tree, keep_empty_classes=True)
    head = images.head(4)
    assert head.paths == images.paths[:4] and head.labels == images.labels[:4]
    assert head.class_names == images.class_names
    assert images.head(None) is images and images.head(10_000) is images
    assert head.fingerprint() != images.fingerprint()
    assert scan_image_folder(odd_tree, keep_empty_classes=True).fingerprint() == images.fingerprint()
    copy = tmp_path / "copy"
    shutil.copytree(odd_tree, copy)
    # independent of the location
    assert scan_image_folder(copy, keep_empty_classes=True).fingerprint() == images.fingerprint()
    (copy / "a_plain" / "img0.JPEG").rename(copy / "a_plain" / "img9.JPEG")
    assert scan_image_folder(copy, keep_empty_classes=True).fingerprint() != images.fingerprint()


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
