"""A folder of labelled pictures for segmentation: pictures, a mask of class indices for each
(matched by file name), and a class file, all checked before anything heavy is read.

The class file is the open-vocabulary papers' (SCLIP's and NACLIP's configs/cls_*.txt): line i
names class i, its names (synonyms) separated by commas, e.g. VOC21's first line lists the
background's ("sky, wall, tree, ..."). A mask is a single-channel PNG (VOC's palette PNGs, or
greyscale) whose pixels are class indices, 255 where unlabelled (ignored, as VOC's borders).

Refused in one sentence (DatasetError): a folder with no pictures, a picture without its mask, a
mask whose size is not its picture's (read from the headers, nothing decoded), a mask of colours
rather than indices, a mask value naming no class, a class file too long or with too many classes.
"""
from __future__ import annotations

import itertools
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from .datasets import DatasetError
from .images import MAX_PIXELS, load_image

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
IGNORE_INDEX = 255  # an unlabelled pixel
MAX_CLASSES = 255  # indices 0..254 fit a mask of bytes beside the ignore value (ADE20K: 150, COCO-Stuff: 171)
MAX_NAMES = 1000  # every name is embedded with its templates: 1,000 names x 80 templates already takes minutes
MAX_NAME_CHARACTERS = 200
MAX_CLASS_FILE_BYTES = 64_000  # the longest of the papers' class files (COCO-Stuff's) is under 3 KB
MAX_IMAGES = 20_000  # COCO-Stuff's validation set is 5,000
MASK_MODES = ("L", "P", "I;16", "I")  # single-channel: each pixel a number, not a colour
ORIENTATION_TAG, TRANSPOSING = 0x0112, (5, 6, 7, 8)  # EXIF orientations that swap width and height


@dataclass(frozen=True)
class ClassNames:
    """Each class's names, class i the i-th line of the class file."""

    classes: tuple[tuple[str, ...], ...]

    @property
    def names(self) -> tuple[str, ...]:
        """Every name of every class, in order (the prompts embedded)."""
        return tuple(name for names in self.classes for name in names)

    @property
    def name_classes(self) -> tuple[int, ...]:
        """The class of each of :attr:`names`."""
        return tuple(index for index, names in enumerate(self.classes) for _ in names)

    def __len__(self) -> int:
        return len(self.classes)


def parse_classes(text: str, source: str = "the class file") -> ClassNames:
    """Line i names class i; a line's names are separated by commas (synonyms)."""
    if not text.strip():
        raise DatasetError(f"{source} names no class: write one class a line")
    lines = text.rstrip("\n").split("\n")
    if len(lines) > MAX_CLASSES:
        raise DatasetError(f"{source} names {len(lines):,} classes; at most {MAX_CLASSES} can be segmented (class indices 0 to {MAX_CLASSES - 1}, {IGNORE_INDEX} unlabelled)")
    classes = []
    for number, line in enumerate(lines, 1):
        names = tuple(name.strip() for name in line.split(",") if name.strip())
        if not names:
            raise DatasetError(f"line {number} of {source} names no class: each line names one class (class {number - 1})")
        long = next((name for name in names if len(name) > MAX_NAME_CHARACTERS), None)
        if long is not None:
            raise DatasetError(f"a name on line {number} of {source} has {len(long):,} characters; at most {MAX_NAME_CHARACTERS}")
        classes.append(names)
    found = ClassNames(tuple(classes))
    if len(found.names) > MAX_NAMES:
        raise DatasetError(f"{source} has {len(found.names):,} names in all; at most {MAX_NAMES} are embedded")
    return found


def read_classes(path: str | os.PathLike) -> ClassNames:
    """The class file at ``path``, read only up to its limit."""
    path = Path(path)
    try:
        with open(path, "rb") as file:
            data = file.read(MAX_CLASS_FILE_BYTES + 1)
    except OSError:
        raise DatasetError(f"the class file {path.name} cannot be read") from None
    if len(data) > MAX_CLASS_FILE_BYTES:
        raise DatasetError(f"the class file {path.name} is over {MAX_CLASS_FILE_BYTES // 1000} KB: it can name at most {MAX_CLASSES} classes")
    try:
        text = data.decode("utf-8").replace("\r\n", "\n")
    except UnicodeDecodeError:
        raise DatasetError(f"the class file {path.name} is not UTF-8 text") from None
    return parse_classes(text, f"the class file {path.name}")


@dataclass(frozen=True)
class LabelledFolder:
    """Pictures and their masks, checked (:func:`read_labelled_folder`)."""

    images: tuple[Path, ...]
    masks: tuple[Path, ...]
    sizes: tuple[tuple[int, int], ...]  # (height, width) of each picture, as loaded (EXIF applied)
    classes: ClassNames

    def __len__(self) -> int:
        return len(self.images)

    def read(self, index: int) -> tuple[Image.Image, np.ndarray]:
        """Picture ``index`` (RGB) and its (H, W) uint8 mask."""
        return load_image(self.images[index]), read_mask(self.masks[index])


def read_mask(path: Path) -> np.ndarray:
    with Image.open(path) as mask:
        return np.asarray(mask).astype(np.uint8) if mask.mode in ("L", "P") else _wide_mask(np.asarray(mask), path)


def _wide_mask(values: np.ndarray, path: Path) -> np.ndarray:
    """A 16- or 32-bit mask, already checked to hold class indices or IGNORE_INDEX only."""
    if values.size and (values.min() < 0 or values.max() > IGNORE_INDEX):
        raise DatasetError(f"the mask {path.name} has values outside 0 to {IGNORE_INDEX}")
    return values.astype(np.uint8)


def _files(folder: Path, what: str) -> list[Path]:
    if not folder.is_dir():
        raise DatasetError(f"the {what} folder {folder.name or folder} does not exist")
    files = list(itertools.islice((Path(entry.path) for entry in os.scandir(folder) if entry.is_file()), MAX_IMAGES * 4 + 1))
    if len(files) > MAX_IMAGES * 4:
        raise DatasetError(f"the {what} folder {folder.name} holds too many files; at most {MAX_IMAGES:,} pictures are measured")
    return sorted(files)


def _header(path: Path, what: str) -> Image.Image:
    """The file opened lazily (its header read, no pixel decoded), or a sentence."""
    try:
        image = Image.open(path)
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError):
        raise DatasetError(f"the {what} {path.name} is not an image PIL can read") from None
    if image.width * image.height > MAX_PIXELS:
        image.close()
        raise DatasetError(f"the {what} {path.name} is too large ({image.width}x{image.height} pixels)")
    return image


def _picture_size(path: Path) -> tuple[int, int]:
    """(height, width) of the picture as load_image gives it (EXIF orientation applied)."""
    with _header(path, "picture") as image:
        width, height = image.size
        if image.getexif().get(ORIENTATION_TAG) in TRANSPOSING:
            width, height = height, width
    return height, width


def read_labelled_folder(images: str | os.PathLike, masks: str | os.PathLike, classes: ClassNames) -> LabelledFolder:
    """The pictures of ``images`` and their masks in ``masks`` (same file name, any image suffix,
    PNG first), every one checked against its picture and ``classes`` before any is used."""
    pictures = [path for path in _files(Path(images), "pictures") if path.suffix.lower() in IMAGE_SUFFIXES]
    if not pictures:
        raise DatasetError(f"the folder {Path(images).name} holds no pictures ({', '.join(IMAGE_SUFFIXES)})")
    if len(pictures) > MAX_IMAGES:
        raise DatasetError(f"the folder {Path(images).name} holds {len(pictures):,} pictures; at most {MAX_IMAGES:,} are measured")
    by_stem: dict[str, Path] = {}
    for path in _files(Path(masks), "masks"):
        if path.suffix.lower() in IMAGE_SUFFIXES and (path.stem not in by_stem or path.suffix.lower() == ".png"):
            by_stem[path.stem] = path
    missing = [path.name for path in pictures if path.stem not in by_stem]
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3:,} more" if len(missing) > 3 else "")
        raise DatasetError(f"{len(missing):,} of the {len(pictures):,} pictures have no mask of the same name in {Path(masks).name}: {shown}")
    found = [by_stem[path.stem] for path in pictures]
    sizes = []
    for picture, mask in zip(pictures, found):
        size = _picture_size(picture)
        with _header(mask, "mask") as header:
            if header.mode not in MASK_MODES:
                raise DatasetError(
                    f"the mask {mask.name} is {header.mode}, colours rather than class indices: save each pixel's class"
                    " index in a single-channel PNG (greyscale or palette, as VOC's)"
                )
            if (header.height, header.width) != size:
                raise DatasetError(
                    f"the mask {mask.name} is {header.width}x{header.height} pixels but its picture {picture.name} is"
                    f" {size[1]}x{size[0]}: each mask must cover its picture pixel for pixel"
                )
        sizes.append(size)
    for mask in found:
        values = np.unique(read_mask(mask))
        outside = values[(values >= len(classes)) & (values != IGNORE_INDEX)]
        if outside.size:
            raise DatasetError(
                f"the mask {mask.name} has pixels of class {int(outside[0])}, but the class file names {len(classes)} classes"
                f" (0 to {len(classes) - 1}; {IGNORE_INDEX} is unlabelled)"
            )
    return LabelledFolder(tuple(pictures), tuple(found), tuple(sizes), classes)
