"""Figures to files: PNG through kaleido and the system Chrome/Chromium, or HTML."""
from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import plotly.graph_objects as go


class FigureExportError(ValueError):
    """Figures could not be written in the format asked for; the message says why."""


def find_browser() -> str | None:
    """A Chrome/Chromium executable for kaleido's PNG export, or None.

    ``BROWSER_PATH`` wins (kaleido's and choreographer's own override); otherwise the system
    browser that choreographer finds on PATH or at the usual places (/usr/bin/chromium on Debian).
    """
    override = os.environ.get("BROWSER_PATH")
    if override:
        return override if os.access(override, os.X_OK) else None
    try:
        from choreographer.browsers.chromium import Chromium
    except ImportError:  # kaleido (and with it choreographer) is not installed
        return None
    return Chromium.find_browser(skip_local=False)


def write_figures(
    figures: Mapping[str, go.Figure], directory: str | os.PathLike, image_format: str = "png",
    width: int = 900, height: int = 700,
) -> list[Path]:
    """Write each figure as ``directory/<name>.<image_format>``, or as HTML with
    ``image_format="html"``; returns the paths. Static images need kaleido and a Chrome/Chromium
    (see :func:`find_browser`); without one, use HTML. HTML files share one plotly.min.js in
    ``directory`` (written once, about 4 MB) so that they open offline."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    paths = [directory / f"{name}.{image_format}" for name in figures]
    if image_format == "html":
        for fig, path in zip(figures.values(), paths):
            fig.write_html(path, include_plotlyjs="directory", full_html=True)
        return paths
    browser = find_browser()
    if browser is None:
        raise FigureExportError(f"writing {image_format} files needs Chrome or Chromium; none was found")
    try:
        import kaleido
    except ImportError as error:
        raise FigureExportError(f"writing {image_format} files needs kaleido (pip install kaleido)") from error

    specs = [
        dict(
            fig=fig.to_dict(), path=path,
            opts=dict(format=image_format, width=fig.layout.width or width,
                      height=fig.layout.height or height, scale=1),
        )
        for fig, path in zip(figures.values(), paths)
    ]
    # One browser for all figures; MathJax off, since its default source is a CDN.
    try:
        kaleido.write_fig_from_object_sync(specs, kopts=dict(path=browser, mathjax=False))
    except Exception as error:  # the browser can fail in many ways; say which, in one line
        raise FigureExportError(
            f"{browser} could not render the figures: {type(error).__name__}: {error}"
        ) from error
    return paths
