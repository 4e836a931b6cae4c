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


# plotly.js's cartesian bundle (npm's plotly.js-cartesian-dist-min, MIT, vendor/plotly.js-LICENSE):
# every trace type the project draws, in a third of the full bundle's 4.8 MB. A browser tab loads
# its page, the plotly.js, before it draws anything: 1.2-1.4 s instead of 1.7-2.4 s for the full one
# on the 2-core machine, most of the browser's start. Used where it is the same version as the
# plotly.js that plotly.py ships (it is replaced when that changes), else the full one.
CARTESIAN_PLOTLY = Path(__file__).resolve().parent / "vendor" / "plotly-cartesian.min.js"
CARTESIAN_TRACE_TYPES = frozenset({
    "bar", "box", "contour", "heatmap", "histogram", "histogram2d", "histogram2dcontour", "image", "pie",
    "scatter", "scatterternary", "violin",
})


def cartesian_plotly() -> Path | None:
    """The cartesian bundle where it matches plotly.py's own plotly.js version, else None."""
    from plotly.offline import get_plotlyjs_version

    try:
        with CARTESIAN_PLOTLY.open(encoding="utf-8") as bundle:
            header = bundle.read(200)  # "* plotly.js (cartesian - minified) v4.1.1"
    except OSError:
        return None
    return CARTESIAN_PLOTLY if f" v{get_plotlyjs_version()}\n" in header else None


def _beyond_cartesian(figures) -> list[str]:
    """The trace types of these figures that the cartesian bundle lacks, sorted."""
    return sorted({trace.type for fig in figures for trace in fig.data} - CARTESIAN_TRACE_TYPES)


def _plotly_for(figures) -> Path | None:
    """The plotly.js that draws every one of these figures fastest: the cartesian bundle where
    it has all their trace types (None: kaleido's default, plotly.py's full bundle)."""
    return None if _beyond_cartesian(figures) else cartesian_plotly()


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
            fig=_drawn_images(fig.to_dict(), fig.layout.width or width, fig.layout.height or height), path=path,
            opts=dict(format=image_format, width=fig.layout.width or width,
                      height=fig.layout.height or height, scale=1),
        )
        for fig, path in zip(figures.values(), paths)
    ]
    # One browser for all figures; MathJax off, since its default source is a CDN.
    options = dict(path=browser, mathjax=False, plotlyjs=_plotly_for(figures.values()))
    try:
        kaleido.write_fig_from_object_sync(specs, kopts=options, cancel_on_error=True)
    except Exception as error:  # the browser can fail in many ways; say which, in one line
        raise FigureExportError(
            f"{browser} could not render the figures: {type(error).__name__}: {error}"
        ) from error
    return paths


def _kaleido_keeping_tabs(kaleido):
    """kaleido.Kaleido whose tabs are not reloaded after each figure. kaleido reloads a tab (its
    page and the 4 MB plotly.js) after every figure; plotly's toImage draws each figure in a div of
    its own and purges it, so a tab can draw the next one as it is: inspect's figures of a DINOv2
    at 518 px took 5.7 s of rendering one after the other instead of 9.6. (A figure that fails
    ends the export: PngWriter cancels the rest, and inspect writes HTML instead.)"""

    class KeepingTabs(kaleido.Kaleido):
        async def _return_kaleido_tab(self, tab) -> None:
            await self.tabs_ready.put(tab)

    return KeepingTabs


def _png_spec(fig: go.Figure, path: Path, width: int, height: int) -> dict:
    opts = dict(format="png", width=fig.layout.width or width, height=fig.layout.height or height, scale=1)
    return dict(fig=_drawn_images(fig.to_dict(), opts["width"], opts["height"]), path=path, opts=opts)


def _drawn_images(fig: dict, width: int, height: int) -> dict:
    """A figure's dict for a static image, its image traces drawn by the browser itself.

    plotly exports an image trace given as a picture (``source``) by repainting it pixel by pixel
    into a canvas of the size it is drawn at, in JavaScript (its pixels kept sharp when
    enlarged), then encoding that canvas: 0.5 s for a 518 px photo, 3.9 s for a 1,406 px mosaic,
    most of inspect's export. ``zsmooth="fast"`` has the browser draw the picture as it is
    (0.1 s and 0.9 s), smoothed when enlarged, so a picture much smaller than it is drawn (a
    patch's 14 x 14 filter) is first enlarged here, each pixel a block, to about its drawn size:
    it stays sharp; one much larger is reduced to it. Where each trace lies is unchanged."""
    layout = fig.get("layout", {})
    margin = {"l": 80, "r": 80, "t": 100, "b": 80, **layout.get("margin", {})}  # plotly's defaults
    plot = (width - margin["l"] - margin["r"], height - margin["t"] - margin["b"])
    for trace in fig.get("data", ()):
        if trace.get("type") != "image" or "source" not in trace or "z" in trace or trace.get("zsmooth") is not None:
            continue
        # The most it can be drawn across: its axes' share of the plot, the picture's shape kept.
        across, down = (
            layout.get(name + str(trace.get(name, name[0]))[1:], {}).get("domain", (0.0, 1.0))
            for name in ("xaxis", "yaxis")
        )
        trace.update(_resized(trace, (across[1] - across[0]) * plot[0], (down[1] - down[0]) * plot[1]))
        trace["zsmooth"] = "fast"
    return fig


def _resized(trace: dict, most_across: float, most_down: float) -> dict:
    """The source, x0, dx, y0, dy of an image trace whose picture is resized to about the width
    it is drawn at (at most ``most_across`` by ``most_down`` pixels, its shape kept): enlarged by
    a whole factor, each pixel a block, where it is less than half as wide, or reduced (averaging)
    where it is more than half as wide again (a 1,406 px mosaic, 4.8 MB, drawn 560 px wide);
    nothing otherwise."""
    import base64
    import io
    import math

    from PIL import Image

    header, _, data = str(trace["source"]).partition(",")
    if not header.endswith(";base64"):
        return {}
    picture = Image.open(io.BytesIO(base64.b64decode(data)))
    width, height = picture.size
    drawn_width = max(1.0, min(most_across, most_down * width / height))
    if width * 2 < drawn_width:
        scale = min(math.ceil(drawn_width / width), 64)
        picture = picture.resize((width * scale, height * scale), Image.Resampling.NEAREST)
    elif width > 1.5 * drawn_width:
        size = (max(1, round(drawn_width)), max(1, round(height * drawn_width / width)))
        picture = picture.convert("RGBA").resize(size, Image.Resampling.BOX)
    else:
        return {}
    encoded = io.BytesIO()
    picture.save(encoded, format="PNG", compress_level=1)
    dx, dy = trace.get("dx", 1.0) * width / picture.width, trace.get("dy", 1.0) * height / picture.height
    # x0 and y0 are the centre of the first pixel: it starts where the first pixel started.
    return dict(
        source="data:image/png;base64," + base64.b64encode(encoded.getvalue()).decode(), dx=dx, dy=dy,
        x0=trace.get("x0", 0.0) - trace.get("dx", 1.0) / 2 + dx / 2,
        y0=trace.get("y0", 0.0) - trace.get("dy", 1.0) / 2 + dy / 2,
    )


class PngWriter:
    """PNG files through one Chromium with one tab, started in the background on creation;
    :meth:`write` hands a figure over and returns at once, :meth:`close` waits for every file
    (FigureExportError if any could not be written). Raises FigureExportError at once without a
    browser or kaleido. The tab draws with plotly.js's cartesian bundle where plotly.py's
    plotly.js is its version (:func:`cartesian_plotly`): :meth:`write` then refuses a figure with
    another trace type (a 3-D scatter, a table), which :func:`write_figures` draws."""

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
        self._plotly = cartesian_plotly()
        self._specs: queue.Queue[tuple[go.Figure, Path] | None] = queue.Queue()
        self._errors: list[BaseException] = []
        self.paths: list[Path] = []
        self._thread = threading.Thread(target=asyncio.run, args=(self._serve(),), daemon=True)
        self._thread.start()

    async def _serve(self) -> None:
        # One tab: a second took Chromium's start from 1.6 s to 2.9 s, longer than the figures
        # take to draw once their pictures are drawn by the browser (_drawn_images).
        try:
            tabs = _kaleido_keeping_tabs(self._kaleido)(n=1, path=self.browser, mathjax=False, plotlyjs=self._plotly)
            async with tabs as browser:
                rendering = []
                while (handed := await asyncio.to_thread(self._specs.get)) is not None:
                    # The figure's dict is made here, off the caller's thread (its pictures resized).
                    spec = await asyncio.to_thread(_png_spec, *handed, *self._size)
                    rendering.append(asyncio.create_task(browser.write_fig_from_object([spec], cancel_on_error=True)))
                results = await asyncio.gather(*rendering, return_exceptions=True)
                self._errors += [result for result in results if isinstance(result, BaseException)]
        except Exception as error:  # the browser can fail in many ways; close() says which
            self._errors.append(error)
            while self._specs.get() is not None:  # the rest are not written; let close() return
                pass

    def write(self, name: str, fig: go.Figure) -> Path:
        if self._plotly is not None:
            others = _beyond_cartesian([fig])
            if others:
                raise FigureExportError(
                    f"{name}: PngWriter draws with plotly.js's cartesian bundle, which has no {', '.join(others)}"
                    " trace; write this figure with write_figures"
                )
        path = self.directory / f"{name}.png"
        self._specs.put((fig, path))
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
