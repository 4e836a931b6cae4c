"""The pictures a session can explore: the built-in shapes and photos, uploaded images (by the
digest they are kept under), the sidebar's picker labels and its picture, each made once for
everybody."""
from __future__ import annotations

import io
from pathlib import Path

import streamlit as st
from PIL import Image, ImageDraw

from .. import resources
from ..data.datasets import SHAPE_CLASSES, shapes_sample
from ..data.images import load_image
from . import uploads
from .memo import memo

PHOTOS_DIR = resources.app_root() / "assets" / "samples"
SHAPE_SAMPLES = len(SHAPE_CLASSES)
# The picture the app opens on: a sample the shipped model classifies right and surely.
DEFAULT_IMAGE = "shapes:4"  # ring, 99.97% (shapes:0, a circle, is only 61% sure)


def photo_names() -> list[str]:
    return sorted(path.name for path in PHOTOS_DIR.iterdir() if path.suffix in (".png", ".jpg"))


@st.cache_data(max_entries=64, show_spinner=False)
def shapes_image(index: int, image_size: tuple[int, int]) -> tuple[Image.Image, str]:
    return shapes_sample(index, image_size)


@st.cache_resource(max_entries=16, show_spinner=False)
def photo(name: str) -> Image.Image:
    return load_image(PHOTOS_DIR / name)


# The sidebar draws the chosen picture 160 px wide: it is sent at most twice that (sharp on
# high-density screens).
SIDEBAR_IMAGE_PX = 320


def sidebar_image(image_key: str, image: Image.Image, shown: tuple[float, float, float, float] | None = None) -> bytes:
    """``image`` as the sidebar shows it: encoded once per image (and crop) for everybody. Given
    the PIL image, st.image encodes it again as PNG on every run of every session (0.3-1 s for a
    512 x 512 photo on a busy 2-core server); small pictures (the shapes) stay PNG, photos go as
    JPEG, both shrunk to SIDEBAR_IMAGE_PX. ``shown``: the box (left, top, right, bottom, in the
    picture's pixels) the model's input shows; what lies outside it is dimmed, the box outlined."""
    def encode() -> bytes:
        small = image.copy()
        small.thumbnail((SIDEBAR_IMAGE_PX, SIDEBAR_IMAGE_PX))
        if shown is not None:
            small = _with_crop(small, [value * small.width / image.width for value in shown])
        buffer = io.BytesIO()
        if small.width * small.height <= 128 * 128:
            small.save(buffer, format="PNG")
        else:
            small.save(buffer, format="JPEG", quality=90)
        return buffer.getvalue()

    box = None if shown is None else tuple(round(value, 1) for value in shown)
    return memo((image_key, image.size, "sidebar image", box), encode)


def _with_crop(picture: Image.Image, box: list[float]) -> Image.Image:
    """``picture`` dimmed outside ``box`` (left, top, right, bottom), the box outlined in white."""
    left, top, right, bottom = (round(value) for value in box)
    dimmed = Image.eval(picture, lambda value: value * 35 // 100)
    inside = (max(left, 0), max(top, 0), min(right, picture.width), min(bottom, picture.height))
    dimmed.paste(picture.crop(inside), inside[:2])
    ImageDraw.Draw(dimmed).rectangle((left, top, right - 1, bottom - 1), outline=(255, 255, 255), width=2)
    return dimmed


def uploaded_image(digest: str) -> Image.Image:
    """A decoded upload, shared by every session that uploaded the same bytes."""
    path = uploads.uploaded_image_path(digest)
    if not path.is_file():
        raise FileNotFoundError(
            "that uploaded image was removed to make room for newer uploads; upload it again"
        )
    return memo(("uploaded image", digest), lambda: load_image(path))


def sample_image_options(image_size: tuple[int, int]) -> dict[str, str]:
    """Image key -> label for the built-in pictures (shapes are drawn at the model's size): a
    fresh dict of labels made once per size (each run of the sidebar asks; through
    st.cache_data each label cost unpickling its picture)."""
    def options() -> dict[str, str]:
        shapes = {
            f"shapes:{index}": f"Shapes #{index}: {shapes_image(index, image_size)[1]}"
            for index in range(SHAPE_SAMPLES)
        }
        return {**shapes, **{f"photo:{name}": f"Photo: {Path(name).stem}" for name in photo_names()}}

    return dict(memo((tuple(image_size), "sample image options"), options))


def photo_keys() -> list[str]:
    """The image keys of the bundled photos."""
    return [f"photo:{name}" for name in photo_names()]


def default_set(current: str, options: dict[str, str]) -> list[str]:
    """Three pictures to read together (the Several images page's first set): ``current``, the
    sidebar's, and two more of its kind (shapes, photos or uploads) where there are, of ``options``."""
    current = current if current in options else next(iter(options))
    kind = current.partition(":")[0]
    others = sorted(options, key=lambda key: key.partition(":")[0] != kind)
    return [current, *[key for key in others if key != current][:2]]


def uploaded_image_options() -> dict[str, str]:
    """This session's uploads that are still kept (the uploads folder has a quota), key -> label."""
    uploaded = st.session_state["uploaded_images"]
    for image_key in [key for key in uploaded if not uploads.uploaded_image_path(key.partition(":")[2]).is_file()]:
        del uploaded[image_key]
    return dict(uploaded)


def resolve_image(image_key: str, image_size: tuple[int, int]) -> tuple[str, Image.Image]:
    """(cache key, RGB image) for an image key; shapes depend on the model's input size."""
    kind, _, reference = image_key.partition(":")
    if kind == "shapes":
        return f"{image_key}@{image_size[0]}x{image_size[1]}", shapes_image(int(reference), image_size)[0]
    if kind == "photo":
        return image_key, photo(reference)
    return image_key, uploaded_image(reference)
