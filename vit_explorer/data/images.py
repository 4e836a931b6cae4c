"""Images in: any upload PIL can read -> an RGB PIL image -> a normalized model input tensor."""

from __future__ import annotations

import io
import os
import warnings
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch
from einops import rearrange
from PIL import Image, ImageOps, UnidentifiedImageError

from ..model.config import ViTConfig
from .transforms import input_pixels

MAX_PIXELS = 40_000_000  # larger images are refused before decoding (decompression bombs)
# Longer sides than this many times the shorter are refused before decoding: stitched panoramas
# and scrolling screenshots stay well inside, while a 40,000,000 x 1 strip (a 116 KB PNG) would
# cost gigabytes to resize and leave no pixel row in a thumbnail.
MAX_ASPECT_RATIO = 50


class InvalidImageError(ValueError):
    """An upload that is not an image we can use; the message says why in one sentence."""


def _read_bytes(source: bytes | str | os.PathLike | BinaryIO) -> tuple[bytes, str]:
    """(contents, a name for messages) of bytes, a path or a binary file-like object."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        return bytes(source), "this file"
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if not path.is_file():
            raise InvalidImageError(f"{path} does not exist or is not a file")
        return path.read_bytes(), path.name
    if hasattr(source, "read"):
        if hasattr(source, "seek"):
            source.seek(0)  # Streamlit's UploadedFile may have been read before
        data = source.read()
        if not isinstance(data, (bytes, bytearray)):
            raise InvalidImageError("the upload must be opened in binary mode")
        return bytes(data), getattr(source, "name", None) or "this file"
    raise InvalidImageError(f"cannot read an image from a {type(source).__name__}")


def _looks_like(data: bytes) -> str | None:
    """What a file PIL cannot read appears to be, for the error message."""
    head = data[:1024].lstrip().lower()
    if head.startswith(b"%pdf"):
        return "a PDF"
    if head.startswith(b"pk\x03\x04"):
        return "a zip archive (or an Office document)"
    if b"<svg" in head:
        return "an SVG drawing, which must be converted to PNG first"
    if head.startswith((b"<!doctype html", b"<html")) or b"<html" in head:
        return "an HTML page"
    sample = data[:1024]
    try:
        sample.decode("utf-8")
    except UnicodeDecodeError as error:
        # A multi-byte character cut off by the sample's end is still text.
        if len(sample) < 1024 or error.start < len(sample) - 3:
            return None
    return "a text file"


def _to_8bit(image: Image.Image) -> Image.Image:
    """16-bit and float single-channel images mapped to 0..255."""
    values = np.asarray(image, dtype=np.float64)
    values = np.where(np.isfinite(values), values, 0.0)  # NaN/inf pixels of float images
    low, high = (values.min(), values.max()) if values.size else (0.0, 0.0)
    if image.mode.startswith("I;16"):
        scale = 65535.0  # the whole 16-bit range, so that brightness is kept
    elif image.mode == "F" and 0.0 <= low and high <= 1.0:
        scale = 1.0  # floats in [0, 1] are intensities
    elif 0.0 <= low and high <= 255.0:
        scale = 255.0
    elif 0.0 <= low and high <= 65535.0:
        scale = 65535.0  # mode I from a 16-bit file
    else:
        # Arbitrary ranges (depth maps, scientific data): stretch min..max to black..white.
        values, scale = values - low, max(high - low, 1e-12)
    return Image.fromarray(np.clip(np.rint(values / scale * 255.0), 0, 255).astype(np.uint8), "L")


def to_rgb(image: Image.Image) -> Image.Image:
    """Any PIL mode as RGB; transparency is composited on white."""
    if image.mode in ("I", "I;16", "I;16L", "I;16B", "I;16N", "F"):
        image = _to_8bit(image)
    elif image.mode == "La":  # premultiplied alpha converts to nothing but LA
        image = image.convert("LA")
    has_alpha = image.mode in ("RGBA", "LA", "PA", "RGBa", "La") or (
        image.mode == "P" and "transparency" in image.info
    )
    if has_alpha:
        image = image.convert("RGBA")
        background = Image.new("RGBA", image.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, image).convert("RGB")
    return image if image.mode == "RGB" else image.convert("RGB")


def load_image(source: bytes | str | os.PathLike | BinaryIO) -> Image.Image:
    """An RGB PIL image from bytes, a path or a binary file-like, or an InvalidImageError.

    EXIF orientation is applied, animations give their first frame, and images above
    ``MAX_PIXELS`` or longer than ``MAX_ASPECT_RATIO`` times their width (or wider than that
    times their height) are refused from their header, before any pixel is decoded.
    """
    data, name = _read_bytes(source)
    if not data:
        raise InvalidImageError(f"{name} is empty")
    with warnings.catch_warnings():
        # Our own size limit is lower than PIL's decompression-bomb limit; keep its warning quiet.
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            image = Image.open(io.BytesIO(data))
        except Image.DecompressionBombError:
            raise InvalidImageError(
                f"{name} is too large (more than {MAX_PIXELS // 1_000_000} megapixels)"
            ) from None
        except (UnidentifiedImageError, OSError, ValueError, SyntaxError):
            kind = _looks_like(data)
            reason = f" (it looks like {kind})" if kind else ""
            raise InvalidImageError(f"{name} is not an image PIL can read{reason}") from None
        width, height = image.size
        if width * height > MAX_PIXELS:
            raise InvalidImageError(
                f"{name} is too large ({width}x{height} pixels, more than "
                f"{MAX_PIXELS // 1_000_000} megapixels)"
            )
        if width == 0 or height == 0:
            raise InvalidImageError(f"{name} has no pixels ({width}x{height})")
        if max(width, height) > MAX_ASPECT_RATIO * min(width, height):
            raise InvalidImageError(
                f"{name} is too long and thin ({width}x{height} pixels, one side more than"
                f" {MAX_ASPECT_RATIO} times the other); crop it first"
            )
        try:
            image.seek(0)  # the first frame of an animation
            image.load()
            image = ImageOps.exif_transpose(image)
        except (OSError, ValueError, SyntaxError, EOFError) as error:
            raise InvalidImageError(f"{name} is truncated or corrupt ({error})") from None
    try:
        return to_rgb(image)
    except ValueError:
        raise InvalidImageError(
            f"{name} uses the pixel mode {image.mode}, which cannot be converted to RGB"
        ) from None


def preprocess(image: Image.Image, config: ViTConfig, whole: bool = False) -> torch.Tensor:
    """(1, C, H, W) model input: the picture as the model's publisher evaluates it (cropped or
    padded as its config says: data/transforms.py), or with ``whole`` the whole picture squeezed
    to the input size, normalized like training."""
    if config.in_chans not in (1, 3):
        raise ValueError(
            f"images can feed models with 1 or 3 input channels, not {config.in_chans}"
        )
    image = to_rgb(image)
    if config.in_chans == 1:
        image = image.convert("L")
    pixels = input_pixels(image, config, whole)  # (C, H, W) on the 0..1 scale
    mean = rearrange(torch.tensor(config.mean), "c -> c 1 1")
    std = rearrange(torch.tensor(config.std), "c -> c 1 1")
    return ((pixels - mean) / std)[None]  # (1, C, H, W)
