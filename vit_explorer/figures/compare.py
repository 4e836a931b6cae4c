"""Two models side by side: the one-model figures, each titled with the side (A or B) it shows,
so that the two halves of the Compare page never read alike."""
from __future__ import annotations

from collections.abc import Sequence

import plotly.graph_objects as go

from ._base import MARGIN, _rgb_uint8, _title
from .attention import attention_heads_grid, heads_height
from .embeddings import token_pca_image
from .patches import patch_picker
from .predictions import topk_bar

PICKER_PIXELS = 400  # the height of each side's point picker


def side_topk(probs, class_names: Sequence[str] | None, side: str, k: int = 5) -> go.Figure:
    """:func:`topk_bar` of one side's probabilities (C,), titled with the side."""
    fig = topk_bar(probs, class_names, k=k)
    return fig.update_layout(title=_title(f"{side}: top-{min(k, len(fig.data[0].x))} predictions"))


def side_heads_grid(
    image, maps, side: str, where: str, query: str, query_patch: int | None = None, columns: int = 4,
) -> go.Figure:
    """:func:`attention_heads_grid` (heads on one shared scale) of one side's maps (H, gh, gw),
    its title on two lines to fit half a page."""
    return attention_heads_grid(
        image, maps, layer=where, query=query, query_patch=query_patch, columns=columns,
        title=_title(f"{side}: attention of the {query}<br>in {where}, all heads on one colour scale"),
        margin={**MARGIN, "t": MARGIN["t"] + 30}, height=heads_height(_rgb_uint8(image).shape, len(maps), columns) + 30,
    )


def side_token_pca(colors, image, side: str, where: str) -> go.Figure:
    """:func:`token_pca_image` of one side's (gh, gw, 3) colours, titled with the side and layer."""
    return token_pca_image(colors, image, title=_title(f"{side}: token PCA {where}, similar tokens in similar colours"))


def side_point_picker(image, grid_size: tuple[int, int], selected: int | None, side: str) -> go.Figure:
    """:func:`patch_picker` on one side's view of the image, its patch under the point outlined."""
    # One height for both sides: left to itself, the picture's size follows the marker size.
    return patch_picker(
        image, grid_size, selected,
        title=_title(f"{side}: its {grid_size[0]}x{grid_size[1]} grid; click to place the point"), height=PICKER_PIXELS,
    )
