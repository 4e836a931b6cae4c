"""load_image: any readable upload -> RGB, else a one-line error; preprocess feeds the model."""

from __future__ import annotations

import io
import struct
import warnings
import zipfile
import zlib

import numpy as np
import pytest
import torch
from PIL import Image

import vit_explorer as vx
from vit_explorer.data.images import MAX_ASPECT_RATIO, MAX_PIXELS


def _encode(image: Image.Image, format: str = "PNG", **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=format, **options)
    return buffer.getvalue()


def _png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height pixels and that has no pixel data at all."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IEND", b"")


def _noise(width: int = 64, height: int = 48) -> Image.Image:
    pixels = np.random.default_rng(0).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels, "RGB")


# ----------------------------------------------------------------------------- sources


def test_bytes_paths_and_file_objects_give_the_same_image(tmp_path):
    data = _encode(_noise())
    path = tmp_path / "noise.png"
    path.write_bytes(data)
    upload = io.BytesIO(data)
    upload.read()  # Streamlit's UploadedFile may already have been read once

    images = [
        vx.load_image(data),
        vx.load_image(path),
        vx.load_image(str(path)),
        vx.load_image(upload),
    ]
    for image in images:
        assert image.mode == "RGB" and image.size == (64, 48)
        assert np.array_equal(np.asarray(image), np.asarray(_noise()))


def test_missing_path_is_a_clear_error(tmp_path):
    with pytest.raises(vx.InvalidImageError, match="does not exist"):
        vx.load_image(tmp_path / "nowhere.png")


# ----------------------------------------------------------------------------- modes


def test_alpha_is_composited_on_white():
    pixels = np.zeros((4, 4, 4), dtype=np.uint8)
    pixels[..., 0] = 255  # red
    pixels[:2, :, 3] = 128  # top half half-transparent, bottom half fully transparent
    image = vx.load_image(_encode(Image.fromarray(pixels, "RGBA")))
    assert image.mode == "RGB"
    assert np.allclose(np.asarray(image)[0, 0], (255, 127, 127), atol=1)
    assert tuple(np.asarray(image)[3, 3]) == (255, 255, 255)

    gray_alpha = Image.fromarray(
        np.dstack([np.zeros((4, 4)), np.full((4, 4), 0)]).astype(np.uint8), "LA"
    )
    assert tuple(np.asarray(vx.load_image(_encode(gray_alpha)))[0, 0]) == (255, 255, 255)


def test_palette_with_transparency():
    palette_image = Image.new("P", (4, 4), 1)
    palette_image.putpalette([0, 0, 0, 0, 0, 255] + [0] * 762)  # index 0 black, 1 blue
    palette_image.putpixel((0, 0), 0)
    image = vx.load_image(_encode(palette_image, transparency=0))
    assert tuple(np.asarray(image)[0, 0]) == (255, 255, 255)  # transparent index -> white
    assert tuple(np.asarray(image)[3, 3]) == (0, 0, 255)


def test_cmyk_jpeg():
    cmyk = Image.new("CMYK", (8, 8), (0, 255, 255, 0))  # pure red in CMYK
    image = vx.load_image(_encode(cmyk, "JPEG", quality=100))
    assert image.mode == "RGB"
    red, green, blue = np.asarray(image)[4, 4].astype(int)
    assert red > 200 and green < 50 and blue < 50


def test_16_bit_png_is_scaled_to_8_bit():
    values = np.array([[0, 257 * 64], [257 * 128, 65535]], dtype=np.uint16)
    data = _encode(Image.fromarray(values))
    assert Image.open(io.BytesIO(data)).mode.startswith("I")  # really a 16-bit file
    image = vx.load_image(data)
    assert image.mode == "RGB"
    assert np.asarray(image)[..., 0].tolist() == [[0, 64], [128, 255]]


def test_float_images_are_scaled_to_8_bit():
    unit = np.array([[0.0, 0.25], [0.5, 1.0]], dtype=np.float32)
    image = vx.load_image(_encode(Image.fromarray(unit, "F"), "TIFF"))
    assert np.asarray(image)[..., 0].tolist() == [[0, 64], [128, 255]]

    depth = np.array([[-3.0, -1.0], [1.0, 5.0]], dtype=np.float32)  # any range: min..max stretch
    image = vx.load_image(_encode(Image.fromarray(depth, "F"), "TIFF"))
    assert np.asarray(image)[..., 0].tolist() == [[0, 64], [128, 255]]

    with_nan = np.array([[np.nan, 0.25], [0.5, 1.0]], dtype=np.float32)  # NaN pixels become 0
    image = vx.load_image(_encode(Image.fromarray(with_nan, "F"), "TIFF"))
    assert np.asarray(image)[..., 0].tolist() == [[0, 64], [128, 255]]


def test_exif_orientation_is_applied():
    stored = Image.new("RGB", (40, 20), (255, 0, 0))
    stored.paste((0, 0, 255), (20, 0, 40, 20))  # left half red, right half blue
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 degrees clockwise to display"
    image = vx.load_image(_encode(stored, "JPEG", exif=exif, quality=95))
    assert image.size == (20, 40)
    top, bottom = np.asarray(image)[5, 10].astype(int), np.asarray(image)[35, 10].astype(int)
    assert top[0] > 200 and top[2] < 50  # the stored left (red) edge is now on top
    assert bottom[2] > 200 and bottom[0] < 50


def test_animation_gives_its_first_frame():
    frames = [Image.new("RGB", (8, 8), color) for color in ((255, 0, 0), (0, 255, 0), (0, 0, 255))]
    data = _encode(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=100, loop=0)
    assert Image.open(io.BytesIO(data)).n_frames == 3
    assert tuple(np.asarray(vx.load_image(data))[4, 4]) == (255, 0, 0)


# ----------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("pixels", [MAX_PIXELS + 1, 200_000_000])  # ours; beyond PIL's bomb limit
def test_too_large_images_are_refused_from_the_header(pixels):
    width = 20_000
    data = _png_header_only(width, pixels // width + 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # PIL's DecompressionBombWarning must not leak
        with pytest.raises(vx.InvalidImageError, match="too large"):
            vx.load_image(data)


@pytest.mark.parametrize("width, height", [(40_000_000, 1), (1, 40_000_000), (MAX_ASPECT_RATIO * 100 + 1, 100)])
def test_absurd_aspect_ratios_are_refused_from_the_header(width, height):
    with pytest.raises(vx.InvalidImageError) as refused:
        vx.load_image(_png_header_only(width, height))  # no pixel data: decoding it would fail otherwise
    assert str(refused.value) == (
        f"this file is too long and thin ({width}x{height} pixels, one side more than"
        f" {MAX_ASPECT_RATIO} times the other); crop it first"
    )


@pytest.mark.parametrize("width, height", [(4000, 400), (MAX_ASPECT_RATIO * 10, 10), (300, 6000)],
                         ids=["1:10 panorama", "at the bound", "scrolling screenshot"])
def test_panoramas_and_long_screenshots_are_accepted(width, height):
    assert vx.load_image(_encode(Image.new("RGB", (width, height), (0, 128, 255)))).size == (width, height)


def test_truncated_png():
    data = _encode(_noise(256, 256))
    with pytest.raises(vx.InvalidImageError, match="truncated or corrupt"):
        vx.load_image(data[: len(data) // 2])


def _zip_bytes() -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("a.txt", "hello")
    return buffer.getvalue()


@pytest.mark.parametrize(
    "data, kind",
    [
        (b"", "is empty"),
        (b"just some notes\nand more", "looks like a text file"),
        # The 1 KiB sample ends inside an "é": still text.
        (b"notes:" + "notes about a café ".encode() * 60, "looks like a text file"),
        (b"%PDF-1.7\n%\xe2\xe3\xcf\xd3\n1 0 obj", "looks like a PDF"),
        (
            b'<?xml version="1.0"?><svg xmlns="http://www.w3.org/2000/svg"></svg>',
            "looks like an SVG",
        ),
        (b"<!DOCTYPE html><html><body>hi</body></html>", "looks like an HTML page"),
        (_zip_bytes(), "looks like a zip archive"),
        (bytes(range(256)) * 4, "not an image PIL can read"),
    ],
    ids=["empty", "text", "utf-8 text", "pdf", "svg", "html", "zip", "binary"],
)
def test_non_images_are_one_line_errors(data, kind):
    with pytest.raises(vx.InvalidImageError, match=kind) as caught:
        vx.load_image(data)
    assert "\n" not in str(caught.value)
    assert data == b"" or "is not an image PIL can read" in str(caught.value)


# ----------------------------------------------------------------------------- preprocess


def test_preprocess_matches_torchvision_resize_and_normalize():
    from torchvision import transforms

    config = vx.ViTConfig(
        image_size=(32, 48), patch_size=8, mean=(0.4, 0.5, 0.6), std=(0.2, 0.25, 0.3)
    )
    image = _noise(100, 70)
    reference = transforms.Compose(
        [
            transforms.Resize((32, 48), interpolation=transforms.InterpolationMode.BICUBIC),
            transforms.ToTensor(),
            transforms.Normalize(config.mean, config.std),
        ]
    )(image)
    x = vx.preprocess(image, config)
    assert x.shape == (1, 3, 32, 48) and x.dtype == torch.float32
    torch.testing.assert_close(x[0], reference)


def test_preprocess_keeps_the_whole_image():
    image = Image.new("RGB", (64, 32), (0, 0, 0))
    image.paste((255, 255, 255), (48, 0, 64, 32))  # a white strip at the far right
    x = vx.preprocess(image, vx.ViTConfig(image_size=16, patch_size=4))  # mean/std 0.5: -1..1
    assert torch.allclose(x[0, :, :, -1], torch.ones(3, 16), atol=1e-3)  # not cropped away
    assert torch.allclose(x[0, :, :, 0], -torch.ones(3, 16), atol=1e-3)


def test_preprocess_grayscale_and_odd_modes():
    config = vx.ViTConfig(image_size=8, patch_size=4, in_chans=1, mean=(0.5,), std=(0.5,))
    x = vx.preprocess(Image.new("RGB", (8, 8), (255, 0, 0)), config)
    assert x.shape == (1, 1, 8, 8)
    expected_gray = round(255 * 299 / 1000) / 255  # ITU-R 601-2 luma of pure red
    torch.testing.assert_close(x, torch.full((1, 1, 8, 8), (expected_gray - 0.5) / 0.5))

    transparent = Image.new("RGBA", (8, 8), (0, 0, 0, 0))
    x = vx.preprocess(transparent, vx.ViTConfig(image_size=8, patch_size=4))
    torch.testing.assert_close(x, torch.ones(1, 3, 8, 8))  # white after compositing
    with pytest.raises(ValueError, match="1 or 3 input channels"):
        vx.preprocess(
            transparent,
            vx.ViTConfig(image_size=8, patch_size=4, in_chans=2, mean=(0, 0), std=(1, 1)),
        )
