"""What every figure module shares: colour scales, array helpers, image traces and axes."""
from __future__ import annotations

import base64
import collections
import functools
import hashlib
import io
import json
import math
import os
import threading
from collections.abc import Sequence

import numpy as np
import plotly.colors as plotly_colors
import plotly.graph_objects as go
from plotly.subplots import make_subplots
from _plotly_utils.basevalidators import ColorscaleValidator
from PIL import Image

# Attention over an image: one colour whose opacity grows with the value, from 0 (transparent:
# the image untouched) to the largest value shown (opaque crimson). Every step up moves a cell the
# same way towards crimson whatever lies beneath, so a white object and a dark one read alike; a
# many-coloured scale laid half-transparent over the image (Inferno at 0.6) made its pale zero and
# its darkest top look the same over white.
ATTENTION_SCALE = [[0.0, "rgba(220,20,60,0)"], [1.0, "rgba(220,20,60,1)"]]
# The same in gold (the query outline is cyan), for a picture on which crimson would hide
# (attention_scale): over the shapes' dark red ring the steered heads' crimson was lost.
CONTRAST_SCALE = [[0.0, "rgba(255,214,0,0)"], [1.0, "rgba(255,214,0,1)"]]
# Gold is chosen where it stands out from the attended patches this many times as much as
# crimson, lightness counted 1.5 times (a faint crimson over a dark patch is dark too). Over the
# bundled pictures: crimson on the shapes and on the astronaut and cat, gold on the red coffee
# cup and the night sky's rocket; gold over black, dark grey, red or navy, crimson over mid grey.
CONTRAST_GAIN = 1.45
LIGHTNESS_WEIGHT = 1.5
VALUE_SCALE = "Viridis"
SIMILARITY_SCALE = "RdBu_r"  # red = similar, blue = opposite
CELL_PIXELS = 240  # on-screen size of one image panel in a grid of panels
MARGIN = dict(l=10, r=10, t=60, b=10)

# Figures are built from trace and layout dicts without plotly's per-property validation, which
# cost more than everything else a figure takes (for a page of figures, more than running the
# layer they show). Set (the test suite does), each figure is also built validated and must give
# the same JSON, so that a misspelt property or a value plotly would coerce still fails a test.
CHECK_FIGURES = os.environ.get("VIT_EXPLORER_CHECK_FIGURES") == "1"


def figure(data: Sequence[dict], layout: dict) -> go.Figure:
    """A figure of trace dicts (each with its ``type``) and a layout dict, built unvalidated.
    Empty lists in the layout (no shapes, no annotations) are left out, as validation does."""
    layout = {key: value for key, value in layout.items() if not (isinstance(value, list) and not value)}
    fig = go.Figure(data=list(data), layout=layout, _validate=False)
    if CHECK_FIGURES:
        difference = _difference(json.loads(fig.to_json()), json.loads(go.Figure(data=list(data), layout=layout).to_json()))
        if difference:
            raise AssertionError(f"a figure built unvalidated differs from the same figure validated at {difference}")
    return fig


def _difference(built, validated, path: str = "") -> str | None:
    """The first place where two figures' JSON differ (keys in any order), as "path: a != b"."""
    if isinstance(built, dict) and isinstance(validated, dict):
        for key in sorted(set(built) | set(validated)):
            difference = _difference(built.get(key), validated.get(key), f"{path}.{key}")
            if difference:
                return difference
        return None
    if isinstance(built, list) and isinstance(validated, list) and len(built) == len(validated):
        return next((found for index, (a, b) in enumerate(zip(built, validated))
                     if (found := _difference(a, b, f"{path}[{index}]"))), None)
    return None if built == validated else f"{path}: {str(built)[:80]} != {str(validated)[:80]}"


def _array(values) -> np.ndarray:
    if hasattr(values, "detach"):
        values = values.detach().cpu().numpy()
    return np.asarray(values)


def _float_array(values) -> np.ndarray:
    return _array(values).astype(np.float64)


@functools.lru_cache(maxsize=16)
def _scale(name: str) -> tuple:
    """A named plotly colour scale ("Viridis", "RdBu_r") as its (position, colour) stops, as plotly's
    validation writes it into a figure: plotly.js knows some names but not the reversed "_r" ones."""
    return tuple(tuple(stop) for stop in ColorscaleValidator("colorscale", "heatmap").validate_coerce(name))


def _rgb_uint8(image) -> np.ndarray:
    """(H, W, 3) uint8 from uint8 or [0, 1] float images, grey (H, W) / (H, W, 1) repeated."""
    image = _array(image)
    if image.ndim == 2:
        image = image[..., None]
    if image.ndim != 3 or image.shape[-1] not in (1, 3):
        raise ValueError(f"an image must be (H, W, 3) or (H, W), not {image.shape}")
    if image.shape[-1] == 1:
        image = np.repeat(image, 3, axis=-1)
    if image.dtype != np.uint8:
        image = np.round(np.clip(image.astype(np.float64), 0.0, 1.0) * 255).astype(np.uint8)
    return image


def _mosaic(tiles: np.ndarray, columns: int, gap: int, fill) -> np.ndarray:
    """Lay (n, h, w, ...) tiles out row-major in ``columns`` columns with ``gap`` between them."""
    count, height, width = tiles.shape[:3]
    rows = math.ceil(count / columns)
    mosaic = np.full(
        (rows * height + (rows - 1) * gap, columns * width + (columns - 1) * gap) + tiles.shape[3:],
        fill,
        dtype=tiles.dtype,
    )
    for index, tile in enumerate(tiles):
        top, left = divmod(index, columns)
        top, left = top * (height + gap), left * (width + gap)
        mosaic[top : top + height, left : left + width] = tile
    return mosaic


def _patch_positions(grid_size: tuple[int, int]) -> np.ndarray:
    """(gh, gw, 3) customdata: patch index, row, col."""
    grid_h, grid_w = grid_size
    rows, cols = np.indices((grid_h, grid_w))
    return np.stack([rows * grid_w + cols, rows, cols], axis=-1)


def _check_map(values: np.ndarray, name: str = "map") -> np.ndarray:
    if values.ndim != 2:
        raise ValueError(f"a {name} must be (gh, gw), not {values.shape}")
    return values


def colour_mapped(values: np.ndarray, scale: str, low: float, high: float) -> np.ndarray:
    """(..., 3) uint8: ``values`` coloured on the plotly colour scale ``scale`` from ``low`` to
    ``high`` (clipped), as a heatmap would colour them; NaN is white."""
    values = np.asarray(values, dtype=np.float32)
    table = _colour_table(scale)
    steps = len(table) - 1
    index = np.clip((values - low) * (steps / (high - low)), 0, steps)
    rgb = table[np.round(np.nan_to_num(index)).astype(np.intp)]  # a lookup: 660k values in ms
    rgb[np.isnan(values)] = 255
    return rgb


@functools.lru_cache(maxsize=16)
def _colour_table(scale: str, steps: int = 1024) -> np.ndarray:
    """(steps + 1, 3) uint8 colours of a plotly colour scale at evenly spaced positions."""
    stops = plotly_colors.get_colorscale(scale)
    positions = np.array([position for position, _ in stops])
    colours = np.array([
        plotly_colors.unlabel_rgb(plotly_colors.convert_colors_to_same_type(colour, "rgb")[0][0])
        for _, colour in stops
    ])  # (stops, 3)
    samples = np.linspace(0.0, 1.0, steps + 1)
    table = np.stack([np.interp(samples, positions, colours[:, channel]) for channel in range(3)], axis=-1)
    table = np.round(table).astype(np.uint8)
    table.flags.writeable = False  # shared by every call
    return table


UNIFORM_TOP = 3.0  # a scale of attention weights reaches at least this many times the uniform weight


def attention_top(values, uniform: float = 0.0) -> float:
    """The top of an attention colour scale that starts at 0: the largest value, and at least
    ``UNIFORM_TOP`` x ``uniform``, the weight of every key under uniform attention (1 where all
    is 0). Starting at 0, not at the smallest value, keeps near-uniform attention flat; the
    floor keeps it pale, where topping out at its own largest value painted it all in full colour."""
    top = max(float(np.max(values)) if np.size(values) else 0.0, UNIFORM_TOP * uniform)
    return top if top > 0 else 1.0


def _encoded(image: np.ndarray, image_format: str, **options) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format=image_format, **options)
    return buffer.getvalue()


def image_data_uri(image: np.ndarray, lossless: bool = False) -> str:
    """An (H, W, 3) uint8 image as a data URI: PNG, or JPEG where that is less than a third of
    the size and ``lossless`` is not asked (a photo: 17 kB instead of 93 kB at 224 px).

    Every rerun sends each figure to the browser, and grids repeat their image per panel, so the
    encoding decides how heavy a page is. Drawn shapes compress well as PNG and stay exact;
    colour-mapped values ask for ``lossless``. The same picture goes into most figures of a
    page, so its encodings are kept (by content, the last URI_CACHE_SIZE).
    """
    image = np.ascontiguousarray(image)
    key = (image.shape, image.dtype.str, hashlib.blake2b(image.data, digest_size=16).digest(), lossless)
    with _URI_LOCK:
        if key in _URIS:
            _URIS.move_to_end(key)
            return _URIS[key]
    uri = _encode_uri(image, lossless)
    with _URI_LOCK:
        _URIS[key] = uri
        while len(_URIS) > URI_CACHE_SIZE:
            _URIS.popitem(last=False)
    return uri


URI_CACHE_SIZE = 64  # the last pictures encoded (a 224 px photo's URI is about 23 kB)
_URIS: collections.OrderedDict = collections.OrderedDict()
_URI_LOCK = threading.Lock()  # sessions draw figures from several threads


def _encode_uri(image: np.ndarray, lossless: bool) -> str:
    png = _encoded(image, "PNG", compress_level=1)  # 4x faster than the default, 10% larger
    jpeg = None if lossless else _encoded(image, "JPEG", quality=90)
    if jpeg is not None and 3 * len(jpeg) < len(png):
        return "data:image/jpeg;base64," + base64.b64encode(jpeg).decode("ascii")
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def _image_trace(image: np.ndarray, hover: bool = True, lossless: bool = False, **kwargs) -> dict:
    # An encoded source is ~10x smaller in the figure JSON than z as nested lists of numbers.
    return dict(
        type="image", source=image_data_uri(image, lossless), hoverinfo="x+y+color" if hover else "skip", **kwargs
    )


def _patch_heatmap(
    values: np.ndarray,
    image_size: tuple[int, int],
    value_name: str = "attention",
    label: str = "",
    **kwargs,
) -> dict:
    """A (gh, gw) map drawn one cell per patch over an image of ``image_size`` = (H, W) pixels,
    as a trace dict.

    go.Image puts pixel centres at 0..W-1, so patch j spans pixels [j*dx - 0.5, (j+1)*dx - 0.5].
    """
    grid_h, grid_w = values.shape
    height, width = image_size
    dy, dx = height / grid_h, width / grid_w
    return dict(
        type="heatmap",
        z=values,
        x0=dx / 2 - 0.5,
        dx=dx,
        y0=dy / 2 - 0.5,
        dy=dy,
        customdata=_patch_positions((grid_h, grid_w)),
        hovertemplate=(
            "patch %{customdata[0]} (row %{customdata[1]}, col %{customdata[2]})"
            f"<br>{value_name} %{{z:.4g}}<extra>{label}</extra>"
        ),
        **kwargs,
    )


def _subplots(
    rows: int, columns: int, titles: Sequence[str] = (), column_titles: Sequence[str] = (),
    row_titles: Sequence[str] = (), **options,
) -> tuple[dict, dict[tuple[int, int], str]]:
    """make_subplots' layout of a ``rows`` x ``columns`` grid as a new dict (the axes' domains and
    anchors, the titles' annotations; ``options``: make_subplots' own, spacing, specs, ...), and
    each (row, col) cell's axis suffix ("" for x/y, "2" for x2/y2, ...), for a figure built in
    one go: make_subplots itself costs more than drawing a 12-head grid."""
    layout, cells = json.loads(_subplots_json(
        rows, columns, len(titles), len(column_titles), len(row_titles), json.dumps(options, sort_keys=True)
    ))
    texts = {f"title {kind}{index}": text for kind, given in (("t", titles), ("c", column_titles), ("r", row_titles))
             for index, text in enumerate(given)}
    for annotation in layout.get("annotations", []):
        annotation["text"] = texts[annotation["text"]]
    return layout, {(row, col): suffix for row, col, suffix in cells}


@functools.lru_cache(maxsize=32)
def _subplots_json(rows: int, columns: int, titles: int, column_titles: int, row_titles: int, options: str) -> str:
    """The grid as make_subplots lays it out (titles as placeholders), once per grid shape."""
    fig = make_subplots(
        rows=rows, cols=columns, subplot_titles=[f"title t{index}" for index in range(titles)] or None,
        column_titles=[f"title c{index}" for index in range(column_titles)] or None,
        row_titles=[f"title r{index}" for index in range(row_titles)] or None, **json.loads(options),
    )
    layout = fig.layout.to_plotly_json()
    layout.pop("template", None)  # every new figure gets the default template itself
    cells = []
    for row in range(1, rows + 1):
        for col in range(1, columns + 1):
            subplot = fig.get_subplot(row, col)
            if subplot is not None:
                cells.append((row, col, subplot.xaxis.plotly_name.removeprefix("xaxis")))
    return json.dumps([layout, cells])


def _on_axes(trace: dict, suffix: str) -> dict:
    """A trace dict placed on the axes x{suffix}/y{suffix} of a :func:`_subplots` grid."""
    return {**trace, "xaxis": f"x{suffix}", "yaxis": f"y{suffix}"}


def _image_axis_layout(suffix: str = "") -> dict:
    """Layout entries of an image's axes x{suffix}/y{suffix}: y grows downwards, square pixels, no ticks."""
    return {
        f"xaxis{suffix}": dict(visible=False, constrain="domain"),
        f"yaxis{suffix}": dict(visible=False, autorange="reversed", scaleanchor=f"x{suffix}", constrain="domain"),
    }


def _panel_height(image_shape: tuple[int, ...], rows: int, width: int) -> int:
    height, image_width = image_shape[:2]
    return int(rows * width * height / image_width) + MARGIN["t"] + MARGIN["b"] + 30 * rows


def _title(text: str) -> dict:
    return dict(text=text, x=0.01, xanchor="left")


def token_labels(
    num_tokens: int, num_prefix_tokens: int, class_token: bool = True, dist_token: bool = False
) -> list[str]:
    """Readable names of the tokens: CLS, DIST (DeiT's distillation token), reg 1.., patch 0.."""
    named = (["CLS"] if class_token else []) + (["DIST"] if dist_token else [])
    registers = [f"reg {index + 1}" for index in range(num_prefix_tokens - len(named))]
    return named + registers + [f"patch {i}" for i in range(num_tokens - num_prefix_tokens)]


def _lab(rgb: np.ndarray) -> np.ndarray:
    """(..., 3) sRGB 0-255 -> CIELAB (D65): distances there follow what the eye tells apart."""
    linear = np.asarray(rgb, dtype=np.float64) / 255
    linear = np.where(linear > 0.04045, ((linear + 0.055) / 1.055) ** 2.4, linear / 12.92)
    xyz = linear @ np.array([[0.4124, 0.3576, 0.1805], [0.2126, 0.7152, 0.0722], [0.0193, 0.1192, 0.9505]]).T
    xyz = xyz / np.array([0.9505, 1.0, 1.089])
    f = np.where(xyz > 0.008856, np.cbrt(xyz), 7.787 * xyz + 16 / 116)
    return np.stack([116 * f[..., 1] - 16, 500 * (f[..., 0] - f[..., 1]), 200 * (f[..., 1] - f[..., 2])], axis=-1)


def attention_scale(image: np.ndarray, maps) -> list:
    """ATTENTION_SCALE, or CONTRAST_SCALE where crimson would hide in the picture: the distance
    (CIELAB, lightness weighted LIGHTNESS_WEIGHT) of each colour from the patches of the (H, W, 3)
    picture, averaged with the maps' (gh, gw) or (M, gh, gw) weights; crimson unless gold's is
    CONTRAST_GAIN times as large."""
    weights = np.clip(np.nan_to_num(_float_array(maps)), 0, None)
    weights = weights.reshape(-1, *weights.shape[-2:]).mean(0)  # (gh, gw)
    if weights.sum() <= 0:
        weights = np.ones_like(weights)
    grid_h, grid_w = weights.shape
    patches = _lab(np.asarray(Image.fromarray(image).resize((grid_w, grid_h), Image.BOX)).reshape(-1, 3))

    def contrast(colour: tuple[int, int, int]) -> float:
        difference = (patches - _lab(np.array(colour))) * np.array([LIGHTNESS_WEIGHT, 1.0, 1.0])
        return float(np.average(np.linalg.norm(difference, axis=-1), weights=weights.reshape(-1)))

    return CONTRAST_SCALE if contrast((255, 214, 0)) > CONTRAST_GAIN * contrast((220, 20, 60)) else ATTENTION_SCALE


def shared_attention_scale(images: Sequence[np.ndarray], maps) -> list:
    """:func:`attention_scale` of pictures of one size drawn side by side on one colour scale, each
    with its (gh, gw) map: chosen over all of them, as if they were one wide picture."""
    return attention_scale(np.concatenate(list(images), axis=1), np.concatenate(list(_float_array(maps)), axis=1))


def distinct_names(names: Sequence[str], indices: Sequence[int]) -> list[str]:
    """The names of ``indices`` as a bar chart's categories: a name shown twice (ImageNet has two
    'missile' classes and two 'sunglasses') gets its index, else plotly draws both bars on one
    row and the chart shows one label and one bar fewer than it says."""
    shown = [str(names[index]) for index in indices]
    return [f"{name} (#{index})" if shown.count(name) > 1 else name for name, index in zip(shown, indices)]

