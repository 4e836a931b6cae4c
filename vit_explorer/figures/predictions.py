"""Predictions: the top-k bar and the logit lens."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import plotly.graph_objects as go

from ._base import VALUE_SCALE, MARGIN, _float_array, _title, distinct_names, figure, _scale


def _class_names(count: int, class_names: Sequence[str] | None) -> list[str]:
    if class_names is None:
        return [f"class {i}" for i in range(count)]
    if len(class_names) != count:
        raise ValueError(f"{len(class_names)} class names for {count} classes")
    return [str(name) for name in class_names]


def logit_lens_figure(probs, class_names: Sequence[str] | None = None, max_classes: int = 10) -> go.Figure:
    """How the prediction forms through the depth: class probabilities read out after each block.

    probs: (L+1, K) softmax of ``analysis.logit_lens`` (row 0: the embeddings). With more than
    ``max_classes`` classes, the ones most probable at the output are shown.
    """
    probs = _float_array(probs)
    if probs.ndim != 2:
        raise ValueError(f"probs must be (L+1, K), not {probs.shape}")
    names = _class_names(probs.shape[1], class_names)
    shown = np.argsort(-probs[-1], kind="stable")[:max_classes]
    depth = probs.shape[0] - 1
    rows = ["embeddings"] + [f"after block {block}" for block in range(depth)]
    return figure([dict(
        type="heatmap", z=probs[:, shown], x=[names[i] for i in shown], y=rows, colorscale=_scale(VALUE_SCALE),
        zmin=0, zmax=1, colorbar=dict(title=dict(text="probability")),
        hovertemplate="%{y}<br>%{x}: %{z:.3f}<extra></extra>",
    )], dict(
        yaxis=dict(autorange="reversed"), xaxis=dict(title=dict(text="class (most probable at the output first)")),
        title=_title("Logit lens: the classifier head applied after every block"), margin=MARGIN,
    ))


def topk_bar(probs, class_names: Sequence[str] | None = None, k: int = 5) -> go.Figure:
    """The k most probable classes as horizontal bars, the most probable on top. probs: (C,)."""
    probs = _float_array(probs).reshape(-1)
    names = _class_names(probs.shape[0], class_names)
    top = np.argsort(-probs, kind="stable")[:k]
    return figure([dict(
        type="bar", x=probs[top], y=distinct_names(names, top.tolist()), orientation="h",
        text=[f"{100 * probs[i]:.1f}%" for i in top], textposition="auto",
        marker=dict(color="#4c78a8"), hovertemplate="%{y}: %{x:.4f}<extra></extra>",
    )], dict(
        xaxis=dict(title=dict(text="probability"), range=[0, 1]), yaxis=dict(autorange="reversed"),
        title=_title(f"Top-{len(top)} predictions"), margin=MARGIN,
    ))
