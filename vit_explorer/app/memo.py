"""The results every session shares: ``memo`` computes a value once per key for everybody, and a
figure in it is kept as the JSON ``st.plotly_chart`` sends (``SentFigure``)."""
from __future__ import annotations

import os
from collections.abc import Callable
from typing import TypeVar

import orjson
import plotly.graph_objects as go
import plotly.io as pio
import streamlit as st

from ..serving.cache import ByteBoundedCache, nbytes

# Captures, analyses and figures shared by all sessions (one view holds at most models.MAX_VIEW_BYTES).
CACHE_BYTES = int(float(os.environ.get("VIT_EXPLORER_CACHE_MB") or 2048) * 2**20)
T = TypeVar("T")


@st.cache_resource
def shared_results() -> ByteBoundedCache:
    """Captures, analyses and figures of every session, bounded in bytes, shared without copies."""
    return ByteBoundedCache(CACHE_BYTES)


def with_spinner(text: str | None, compute: Callable[[], T]) -> T:
    if text is None:
        return compute()
    with st.spinner(text):
        return compute()


def memo(key: tuple, compute: Callable[[], T], spinner: str | None = None) -> T:
    """``compute()`` once per key for everybody; the value is shared, so it is never mutated.
    Figures in it (alone, a tuple's items or a dict's values) are :class:`SentFigure` s."""
    return shared_results().get_or_compute(
        key, lambda: _sent_figures(with_spinner(spinner, compute)), size=_memo_bytes
    )


class SentFigure(go.Figure):
    """A memoised figure as ``st.plotly_chart`` sends it, and nothing else: its JSON, made once
    when cached. Streamlit collects every generation after every run of every session, and a
    cached go.Figure (with its to_dict) held a few hundred objects for the collection to walk,
    tens of thousands with a few images in the cache: most of the server's CPU per warm view.
    Serializing it again on every run (``to_dict``, a deep copy, then plotly's JSON) cost more."""

    def __init__(self, figure: go.Figure):  # go.Figure's own __init__ would build it again
        self._sent = _SentDict(figure)

    def to_dict(self) -> dict:
        return self._sent

    def to_plotly_json(self) -> dict:
        return self._sent


class _SentDict(dict):
    """What ``st.plotly_chart`` reads of ``to_dict()``: the layout's size, and the figure's JSON,
    which plotly's serializer takes from ``to_plotly_json`` and orjson writes as it is (orjson
    is a requirement: plotly's other engine would write this dict itself)."""

    def __init__(self, figure: go.Figure):
        layout = figure.layout
        super().__init__(layout={name: layout[name] for name in ("width", "height") if layout[name] is not None})
        self.json = _figure_json(figure)

    def to_plotly_json(self) -> orjson.Fragment:
        return orjson.Fragment(self.json)


def _figure_json(figure: go.Figure) -> bytes:
    """The JSON st.plotly_chart would send, through plotly's public serializer (the same bytes:
    its to_dict, typed arrays and template included)."""
    return pio.to_json(figure, validate=False).encode()


def _sent_figures(value: T) -> T:
    if type(value) is dict:
        return {name: _sent_figures(item) for name, item in value.items()}
    if type(value) is tuple:
        return tuple(_sent_figures(item) for item in value)
    if type(value) is go.Figure:
        return SentFigure(value)
    return value


def _memo_bytes(value) -> int:
    """The cache's bytes of a memo value (a figure: its JSON)."""
    if type(value) is dict:
        return sum(_memo_bytes(item) for item in value.values()) + 64 * len(value)
    if type(value) is tuple:
        return sum(_memo_bytes(item) for item in value) + 8 * len(value)
    if isinstance(value, SentFigure):
        return len(value.to_dict().json)
    return nbytes(value)
