"""Words over the image (vit_explorer.text): each prompt's dense similarity over the patches, the
relevance of one prompt's score, each patch coloured by its best prompt, one prompt over several
images, and the zero-shot scores of the top labels. Maps are (gh, gw) cosines or relevances drawn
one cell per patch over the image, as the attention figures are."""
from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import plotly.colors as plotly_colors
import plotly.graph_objects as go

from ._base import (
    CELL_PIXELS, MARGIN, _float_array, _image_axis_layout, _image_trace, _on_axes, _panel_height,
    _patch_heatmap, _rgb_uint8, _subplots, _title, attention_scale, distinct_names, figure, image_data_uri,
    shared_attention_scale,
)
from .attention import attention_overlay

PROMPT_SCALES = ("shared", "per prompt")  # one colour scale for every prompt's map, or one each
# Each prompt's colour in the best-prompt map: distinct on a photo, in the order the prompts were typed.
PROMPT_COLOURS = plotly_colors.qualitative.Bold + plotly_colors.qualitative.Pastel
BEST_OPACITY = 0.6
SCORINGS = {
    "softmax": "softmax over the labels (CLIP): they add up to 100%",
    "sigmoid": "each label's own sigmoid (SigLIP): they need not add up to 100%",
}


def _check_maps(maps, prompts: Sequence[str], name: str = "maps") -> np.ndarray:
    maps = _float_array(maps)
    if maps.ndim != 3 or maps.shape[0] != len(prompts) or not len(prompts):
        raise ValueError(f"{name} must hold one (gh, gw) map per prompt ({len(prompts)}), not {maps.shape}")
    return maps


def _range(values: np.ndarray) -> tuple[float, float]:
    """The colour scale's ends for cosines: the lowest shown is clear, the highest full colour."""
    low, high = float(values.min()), float(values.max())
    return (low, high) if high > low else (low - 1e-6, low + 1e-6)


def similarity_grid(
    image, similarities, prompts: Sequence[str], how: str, scale: str = "shared", columns: int = 4,
    opacity: float = 0.85,
) -> go.Figure:
    """Each prompt's dense similarity map (T, gh, gw), the cosine of every patch with the prompt's
    text embedding, over the image, one panel per prompt: clear at the lowest cosine shown and
    crimson (or gold, attention_scale) at the highest, on one scale for every prompt (``scale="shared"``: prompts compare) or
    each from its own lowest to its highest (``"per prompt"``: where each word is, however faint).
    ``how``: how the patches were carried into the texts' space, for the title."""
    image = _rgb_uint8(image)
    maps = _check_maps(similarities, prompts, "similarities")
    if scale not in PROMPT_SCALES:
        raise ValueError(f"scale must be one of {PROMPT_SCALES}, not {scale!r}")
    count = len(prompts)
    columns = min(columns, count)
    rows = math.ceil(count / columns)
    layout, cells = _subplots(
        rows, columns, [f"{_short(prompt)} (max {values.max():.3f})" for prompt, values in zip(prompts, maps)],
        horizontal_spacing=0.02, vertical_spacing=0.06 if rows > 1 else 0.0,
    )
    shared = scale == "shared"
    colorscale = attention_scale(image, maps - maps.min())  # weighed where the cosines are highest
    if shared:
        low, high = _range(maps)
        layout["coloraxis"] = dict(
            colorscale=colorscale, cmin=low, cmax=high,
            colorbar=dict(title=dict(text="cosine<br>(lowest<br>= clear)")),
        )
    source = image_data_uri(image)
    traces = []
    for index, (prompt, values) in enumerate(zip(prompts, maps)):
        suffix = cells[divmod(index, columns)[0] + 1, index % columns + 1]
        if shared:
            colour = dict(coloraxis="coloraxis")
        else:
            low, high = _range(values)
            colour = dict(colorscale=colorscale, zmin=low, zmax=high, showscale=False)
        traces += [
            _on_axes(dict(type="image", source=source, hoverinfo="skip"), suffix),
            _on_axes(_patch_heatmap(values, image.shape[:2], "cosine", _short(prompt), opacity=opacity, **colour), suffix),
        ]
        for axis, settings in _image_axis_layout(suffix).items():
            layout[axis].update(settings)
    how_scaled = "one colour scale for every prompt" if shared else "each prompt on its own scale"
    layout.update(
        title=_title(f"Where each prompt is: the cosine of every patch with the text ({how}; {how_scaled})"),
        margin=MARGIN, height=_panel_height(image.shape, rows, CELL_PIXELS),
    )
    return figure(traces, layout)


def relevance_overlay(image, relevance, prompt: str, opacity: float = 0.85) -> go.Figure:
    """The relevance (gh, gw) of each patch to the image's score with ``prompt`` (the class
    attribution with the image-text cosine as its target) over the image."""
    return attention_overlay(
        image, relevance, opacity=opacity, value_name="relevance",
        title=f"Which patches made the image match '{_short(prompt)}' (gradient-weighted attention, rolled out)",
    )


def best_prompt_map(
    image, similarities, prompts: Sequence[str], opacity: float = BEST_OPACITY, how: str | None = None,
) -> go.Figure:
    """Each patch coloured by the prompt whose text it is most like (the largest of the (T, gh, gw)
    similarities), a legend naming each prompt's colour; a patch's hover says its cosine with it.
    ``how``: how the patches were carried into the texts' space, for the title."""
    image = _rgb_uint8(image)
    maps = _check_maps(similarities, prompts, "similarities")
    count = len(prompts)
    if count > len(PROMPT_COLOURS):
        raise ValueError(f"at most {len(PROMPT_COLOURS)} prompts can be told apart by colour, not {count}")
    best = maps.argmax(axis=0)  # (gh, gw)
    colours = PROMPT_COLOURS[:count]
    # One flat band of colour per prompt index: z = index lands in its band.
    scale = [[position, colour] for index, colour in enumerate(colours)
             for position in (index / count, (index + 1) / count)]
    names = np.asarray([_short(prompt) for prompt in prompts], dtype=object)
    cells = _patch_heatmap(best, image.shape[:2], label="")
    cells.update(
        colorscale=scale, zmin=-0.5, zmax=count - 0.5, showscale=False, opacity=opacity,
        customdata=np.dstack([cells["customdata"], names[best], maps.max(axis=0)]),
        hovertemplate=(
            "patch %{customdata[0]} (row %{customdata[1]}, col %{customdata[2]})"
            "<br>most like '%{customdata[3]}' (cosine %{customdata[4]:.3f})<extra></extra>"
        ),
    )
    shown = np.bincount(best.reshape(-1), minlength=count)
    keys = [  # legend entries only: a square of each prompt's colour
        dict(type="scatter", x=[None], y=[None], mode="markers", name=f"{_short(prompt)} ({number} patches)",
             marker=dict(size=12, symbol="square", color=colour), showlegend=True, hoverinfo="skip")
        for prompt, colour, number in zip(prompts, colours, shown)
    ]
    return figure([_image_trace(image, hover=False), cells, *keys], dict(
        **_image_axis_layout(), title=_title("Each patch coloured by the prompt it is most like" + (f" ({how})" if how else "")), margin=MARGIN,
        legend=dict(title=dict(text="prompt"), itemclick=False, itemdoubleclick=False),
    ))


def segmentation_map(image, labels, names: Sequence[str], opacity: float = BEST_OPACITY) -> go.Figure:
    """The picture with every pixel coloured by its class of ``labels`` (H, W), class k in the
    colour of prompt k - 1 of the best-prompt map, class 0 (``names[0]``, the background) left
    clear; a legend names each colour and its share of the pixels."""
    image = _rgb_uint8(image)
    labels = np.asarray(labels)
    if labels.shape != image.shape[:2]:
        raise ValueError(f"one class a pixel is needed: labels {labels.shape}, picture {image.shape[:2]}")
    count = len(names) - 1
    if count > len(PROMPT_COLOURS):
        raise ValueError(f"at most {len(PROMPT_COLOURS)} classes can be told apart by colour, not {count}")
    colours = plotly_colors.convert_colors_to_same_type(list(PROMPT_COLOURS[:count]), "rgb")[0]
    palette = np.array([(0, 0, 0), *map(plotly_colors.unlabel_rgb, colours)], dtype=np.float64)  # (classes, 3)
    coloured = labels > 0
    blended = image.astype(np.float64)
    blended[coloured] = (1 - opacity) * blended[coloured] + opacity * palette[labels[coloured]]
    shares = np.bincount(labels.reshape(-1), minlength=count + 1) / labels.size
    keys = [
        dict(type="scatter", x=[None], y=[None], mode="markers", name=f"{_short(name)} ({share:.0%} of the pixels)",
             marker=dict(size=12, symbol="square", color=colour), showlegend=True, hoverinfo="skip")
        for name, colour, share in zip(names, ["rgba(0,0,0,0)", *PROMPT_COLOURS[:count]], shares)
    ]
    return figure([_image_trace(np.round(blended).astype(np.uint8), hover=False, lossless=True), *keys], dict(
        **_image_axis_layout(), title=_title("Each pixel labelled by the prompt it is most like"), margin=MARGIN,
        legend=dict(title=dict(text="class"), itemclick=False, itemdoubleclick=False),
    ))


def prompt_over_images(images: Sequence, similarities, prompt: str, labels: Sequence[str], how: str) -> go.Figure:
    """One prompt's similarity maps (B, gh, gw) over several images (columns), on one colour scale
    (clear at the lowest cosine of all, crimson at the highest), so that the images compare."""
    images = [_rgb_uint8(image) for image in images]
    maps = _float_array(similarities)
    count = len(images)
    if maps.ndim != 3 or maps.shape[0] != count or len(labels) != count or not count:
        raise ValueError(f"one (gh, gw) map and one label per image ({count}) are needed, not {maps.shape}")
    if len({image.shape for image in images}) != 1:
        raise ValueError("the images must all have one size (the model's input)")
    low, high = _range(maps)
    layout, cells = _subplots(
        1, count, [f"{label} (max {values.max():.3f})" for label, values in zip(labels, maps)], horizontal_spacing=0.01,
    )
    colorscale = shared_attention_scale(images, maps - low)  # weighed where the cosines are highest
    traces = []
    for index, (image, values) in enumerate(zip(images, maps)):
        suffix = cells[1, index + 1]
        traces += [
            _on_axes(_image_trace(image, hover=False), suffix),
            _on_axes(_patch_heatmap(
                values, image.shape[:2], "cosine", labels[index], colorscale=colorscale, zmin=low, zmax=high,
                opacity=0.85, showscale=index == 0, colorbar=dict(title=dict(text="cosine"), thickness=12),
            ), suffix),
        ]
        for axis, settings in _image_axis_layout(suffix).items():
            layout[axis].update(settings)
    layout.update(
        title=_title(f"Where '{_short(prompt)}' is in each image: the cosine of every patch with it ({how}; one scale)"),
        margin=MARGIN, height=_panel_height(images[0].shape, 1, min(CELL_PIXELS, 1100 // count)),
    )
    return figure(traces, layout)


def zero_shot_bar(scores, labels: Sequence[str], scoring: str, k: int = 5) -> go.Figure:
    """The k labels the image matches best as horizontal bars, the best on top: ``scores`` (T,)
    are probabilities as the model was trained to score (``scoring``: "softmax" or "sigmoid")."""
    scores = _float_array(scores).reshape(-1)
    if scores.shape[0] != len(labels):
        raise ValueError(f"{len(labels)} labels for {scores.shape[0]} scores")
    if scoring not in SCORINGS:
        raise ValueError(f"scoring must be one of {tuple(SCORINGS)}, not {scoring!r}")
    top = np.argsort(-scores, kind="stable")[:k]
    return figure([dict(
        type="bar", x=scores[top], y=distinct_names([_short(label) for label in labels], top.tolist()), orientation="h",
        text=[f"{100 * scores[index]:.1f}%" for index in top], textposition="auto",
        marker=dict(color="#4c78a8"), hovertemplate="%{y}: %{x:.4f}<extra></extra>",
    )], dict(
        xaxis=dict(title=dict(text="probability"), range=[0, 1]), yaxis=dict(autorange="reversed"),
        title=_title(f"Top-{len(top)} labels in words ({SCORINGS[scoring]})"), margin=MARGIN,
    ))


SHORT = 40  # characters of a prompt shown in a title or a legend


def _short(prompt: str) -> str:
    prompt = str(prompt)
    return prompt if len(prompt) <= SHORT else prompt[:SHORT - 3] + "..."
