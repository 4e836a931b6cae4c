"""A labelled folder for segmentation: each bad input refused in one sentence before anything
heavy is read (nothing decoded for a size mismatch, a class file read only up to its limit)."""
import numpy as np
import pytest
from PIL import Image

from vit_explorer.data.datasets import DatasetError
from vit_explorer.data.labelled_folder import MAX_CLASS_FILE_BYTES, parse_classes, read_classes, read_labelled_folder


def _folder(tmp_path, sizes=((32, 32), (32, 48)), mask_sizes=None, values=(0, 1), mode="P"):
    images, masks = tmp_path / "images", tmp_path / "masks"
    images.mkdir()
    masks.mkdir()
    for index, (size, mask_size) in enumerate(zip(sizes, mask_sizes or sizes)):
        Image.new("RGB", (size[1], size[0]), (0, 255, 0)).save(images / f"{index}.jpg")
        mask = np.full(mask_size, values[0], dtype=np.uint8)
        mask[: mask_size[0] // 2] = values[1]
        Image.fromarray(mask).convert(mode).save(masks / f"{index}.png")
    return images, masks


def _sentence(error) -> str:
    message = str(error.value)
    assert "\n" not in message and "Traceback" not in message and str(error.value.__class__.__name__) == "DatasetError"
    return message


def test_a_good_folder_is_read_with_its_classes(tmp_path):
    classes = parse_classes("sky, wall, tree\nobject\n")
    assert classes.names == ("sky", "wall", "tree", "object") and classes.name_classes == (0, 0, 0, 1)
    folder = read_labelled_folder(*_folder(tmp_path), classes)
    assert len(folder) == 2 and folder.sizes == ((32, 32), (32, 48))
    image, mask = folder.read(1)
    assert image.size == (48, 32) and mask.shape == (32, 48) and set(np.unique(mask)) == {0, 1}


def test_a_mask_of_another_size_is_refused_from_its_header(tmp_path):
    with pytest.raises(DatasetError) as error:
        read_labelled_folder(*_folder(tmp_path, mask_sizes=((32, 32), (30, 48))), parse_classes("a\nb"))
    assert "the mask 1.png is 48x30 pixels but its picture 1.jpg is 48x32" in _sentence(error)


def test_a_class_file_of_a_hundred_thousand_classes_is_refused_unread(tmp_path):
    path = tmp_path / "classes.txt"
    path.write_text("\n".join(f"class {index}" for index in range(100_000)))
    assert path.stat().st_size > MAX_CLASS_FILE_BYTES
    with pytest.raises(DatasetError) as error:
        read_classes(path)
    assert "over 64 KB" in _sentence(error)
    with pytest.raises(DatasetError) as error:  # short names: under the byte limit, over the class limit
        parse_classes("\n".join("x" for _ in range(300)))
    assert "names 300 classes; at most 255" in _sentence(error)


def test_mask_values_naming_no_class_are_refused_but_the_ignore_value_is_kept(tmp_path):
    images, masks = _folder(tmp_path, values=(0, 255), mode="L")
    assert len(read_labelled_folder(images, masks, parse_classes("a\nb"))) == 2
    for path in masks.iterdir():
        Image.fromarray(np.full((32, 48) if path.stem == "1" else (32, 32), 7, dtype=np.uint8)).save(path)
    with pytest.raises(DatasetError) as error:
        read_labelled_folder(images, masks, parse_classes("a\nb"))
    assert "has pixels of class 7, but the class file names 2 classes" in _sentence(error)


def test_a_folder_without_pictures_or_without_masks_or_with_colour_masks_is_refused(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.txt").write_text("no pictures here")
    with pytest.raises(DatasetError) as error:
        read_labelled_folder(empty, empty, parse_classes("a"))
    assert "holds no pictures" in _sentence(error)
    images, masks = _folder(tmp_path)
    (masks / "0.png").unlink()
    with pytest.raises(DatasetError) as error:
        read_labelled_folder(images, masks, parse_classes("a\nb"))
    assert "1 of the 2 pictures have no mask of the same name in masks: 0.jpg" in _sentence(error)
    Image.new("RGB", (32, 32)).save(masks / "0.png")
    with pytest.raises(DatasetError) as error:
        read_labelled_folder(images, masks, parse_classes("a\nb"))
    assert "colours rather than class indices" in _sentence(error)
