"""Figures to files: PNG through kaleido and the system Chrome/Chromium, or HTML.

:func:`write_figures` writes a finished set; :class:`PngWriter` starts the browser at once, in the
background, and renders each figure as soon as it is handed over, so that the browser's start and
the rendering overlap what the caller does meanwhile (``inspect``: loading, capturing, drawing).
"""
from __future__ import annotations

import asyncio
import os
import queue
import threading
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
        kaleido.write_fig_from_object_sync(specs, kopts=dict(path=browser, mathjax=False), cancel_on_error=True)
    except Exception as error:  # the browser can fail in many ways; say which, in one line
        raise FigureExportError(
            f"{browser} could not render the figures: {type(error).__name__}: {error}"
        ) from error
    return paths


def _png_spec(fig: go.Figure, path: Path, width: int, height: int) -> dict:
    opts = dict(format="png", width=fig.layout.width or width, height=fig.layout.height or height, scale=1)
    return dict(fig=fig.to_dict(), path=path, opts=opts)


class PngWriter:
    """PNG files through one Chromium started in the background on creation, with a tab per core;
    :meth:`write` hands a figure over and returns at once, :meth:`close` waits for every file
    (FigureExportError if any could not be written). Raises FigureExportError at once without a
    browser or kaleido."""

    def __init__(self, directory: str | os.PathLike, width: int = 900, height: int = 700):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._size = (width, height)
        self.browser = find_browser()
        if self.browser is None:
            raise FigureExportError("writing png files needs Chrome or Chromium; none was found")
        try:
            import kaleido
        except ImportError as error:
            raise FigureExportError("writing png files needs kaleido (pip install kaleido)") from error
        self._kaleido = kaleido
        self._specs: queue.Queue[dict | None] = queue.Queue()
        self._errors: list[BaseException] = []
        self.paths: list[Path] = []
        self._thread = threading.Thread(target=asyncio.run, args=(self._serve(),), daemon=True)
        self._thread.start()

    async def _serve(self) -> None:
        tabs = max(1, min(2, os.cpu_count() or 1))
        try:
            async with self._kaleido.Kaleido(n=tabs, path=self.browser, mathjax=False) as browser:
                rendering = []
                while (spec := await asyncio.to_thread(self._specs.get)) is not None:
                    rendering.append(asyncio.create_task(browser.write_fig_from_object([spec], cancel_on_error=True)))
                results = await asyncio.gather(*rendering, return_exceptions=True)
                self._errors += [result for result in results if isinstance(result, BaseException)]
        except Exception as error:  # the browser can fail in many ways; close() says which
            self._errors.append(error)
            while self._specs.get() is not None:  # the rest are not written; let close() return
                pass

    def write(self, name: str, fig: go.Figure) -> Path:
        path = self.directory / f"{name}.png"
        self._specs.put(_png_spec(fig, path, *self._size))
        self.paths.append(path)
        return path

    def close(self) -> list[Path]:
        if self._thread.is_alive():
            self._specs.put(None)
            self._thread.join()
        if self._errors:
            error = self._errors[0]
            raise FigureExportError(
                f"{self.browser} could not render the figures: {type(error).__name__}: {error}"
            ) from error
        return list(self.paths)

    def close_quietly(self) -> None:
        """Ends the browser whatever happened (a failed run's figures are not wanted)."""
        if self._thread.is_alive():
            self._specs.put(None)
            self._thread.join()
