"""What the page tests share: the app (AppTest) with a tiny default model, and reading what a page
shows (figure titles, widgets, errors, charts' numbers)."""
import base64
import contextlib
import io
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import streamlit as st
import torch
from PIL import Image
from streamlit.testing.v1 import AppTest

import vit_explorer as vx
from vit_explorer.app import costs, runs, uploads
from vit_explorer.data.datasets import SHAPE_CLASSES

APP = str(Path(__file__).resolve().parent.parent / "app.py")
PHOTO = Path(__file__).resolve().parent.parent / "assets" / "samples" / "chelsea.png"
SHAPES = dict(num_classes=len(SHAPE_CLASSES), class_names=SHAPE_CLASSES, mean=(0.5,) * 3, std=(0.25,) * 3)


def tiny_model(**changes) -> vx.ViT:
    config = dict(image_size=32, patch_size=4, embed_dim=32, depth=4, num_heads=4, **SHAPES)
    torch.manual_seed(0)
    return vx.ViT(vx.ViTConfig(**{**config, **changes}))


@pytest.fixture(autouse=True)
def tiny_default(tmp_path, monkeypatch):
    """The app with a tiny default model and its files in tmp_path, starting from empty caches."""
    weights = tmp_path / "tiny_default.safetensors"
    vx.save_model(tiny_model(), weights)
    monkeypatch.setenv("VIT_EXPLORER_DEFAULT_MODEL", str(weights))
    monkeypatch.setattr(runs, "RUNS_DIR", tmp_path / "runs")
    monkeypatch.setattr(uploads, "UPLOADS_DIR", tmp_path / "uploads")
    st.cache_data.clear()
    st.cache_resource.clear()
    # What is quick from multiply-adds only, never from passes timed on a machine whose load varies
    # (a tiny model's pass is mostly fixed costs: timed, its 480-pass comparison would not be quick).
    # The tests of the timed rule bring their own record.
    untimed = costs.PassTimes(size=0)
    monkeypatch.setattr(costs, "pass_times", lambda: untimed)
    yield weights
    runs.run_manager().shutdown()
    st.cache_resource.clear()


# Pages whose st.Page names another url_path than the file's name (app.py). AppTest hashes the
# file's name before the first run: these open on Pipeline first, then switch.
RENAMED_PAGES = {"views/head_types.py"}


def opening(app: AppTest, page: str | None) -> AppTest:
    """``app`` run once, on ``page`` as its address would open it (not the default page first:
    a whole run of Pipeline more for every page a test opens)."""
    if page is not None and page not in RENAMED_PAGES:
        app.switch_page(page)
    app.run()
    if page in RENAMED_PAGES:
        app.switch_page(page).run()
    return app


@contextlib.contextmanager
def tiny_app_server(folder: Path) -> Iterator[str]:
    """`streamlit run app.py` with tiny_model() as its default model and its files in ``folder``;
    yields its URL."""
    from bench.browser import serve_app

    weights = folder / "tiny.safetensors"
    vx.save_model(tiny_model(), weights)
    env = {
        "VIT_EXPLORER_DEFAULT_MODEL": str(weights), "VIT_EXPLORER_RUNS_DIR": str(folder / "runs"),
        "VIT_EXPLORER_UPLOADS_DIR": str(folder / "uploads"),
    }
    with serve_app(env, log=folder / "streamlit.log") as url:
        yield url


def open_app(page: str | None = None) -> AppTest:
    app = opening(AppTest.from_file(APP, default_timeout=60), page)
    assert not app.exception, app.exception
    return app


def figure_titles(app: AppTest) -> list[str]:
    titles = []
    for chart in app.get("plotly_chart"):
        layout = json.loads(chart.proto.spec)["layout"]
        titles.append(layout["title"]["text"])
    return titles


def title_matching(app: AppTest, pattern: str) -> str:
    matches = [title for title in figure_titles(app) if re.search(pattern, title)]
    assert len(matches) == 1, (pattern, figure_titles(app))
    return matches[0]


def widget(widgets, label: str):
    matches = [w for w in widgets if w.label == label]
    assert len(matches) == 1, (label, [w.label for w in widgets])
    return matches[0]


def uploader(app: AppTest, key: str):
    """The uploader of that key now: each handled upload gives it a new key (it starts empty)."""
    (match,) = [widget for widget in app.file_uploader if widget.key.partition("#")[0] == key]
    return match


def errors(app: AppTest) -> list[str]:
    return [error.value for error in app.error]


def open_words_app(folder: Path, page: str | None = None) -> AppTest:
    """The app with ``folder`` (both towers) selected as an uploaded model, ``file:<folder>``."""
    key = f"file:{folder}"
    app = AppTest.from_file(APP, default_timeout=60)
    app.session_state["uploaded_models"] = {key: f"Uploaded: {folder.name}"}
    app.session_state["requested_model"] = key
    opening(app, page)
    assert app.session_state["model_key"] == key, errors(app)
    assert not app.exception, app.exception
    return app


def counting_forwards(monkeypatch) -> list[tuple[int, int]]:
    """Every forward pass from now on, as (batch size, tokens)."""
    calls = []
    original = vx.ViT.forward_features

    def forward_features(self, x, patch_size=None):
        grid_h, grid_w = self.grid_size(patch_size)
        calls.append((x.shape[0], self.config.num_prefix_tokens + grid_h * grid_w))
        return original(self, x, patch_size)

    monkeypatch.setattr(vx.ViT, "forward_features", forward_features)
    return calls


def decoded(values) -> np.ndarray:
    """A figure's numbers, plain or in plotly's typed-array encoding of a numpy array."""
    if isinstance(values, dict):
        return np.frombuffer(base64.b64decode(values["bdata"]), dtype=values["dtype"])
    return np.asarray(values)


def charts(app) -> dict[str, list[dict]]:
    """The page's charts: title -> traces (their JSON)."""
    specs = [json.loads(chart.proto.spec) for chart in app.get("plotly_chart")]
    return {spec["layout"]["title"]["text"]: spec["data"] for spec in specs}


def assert_same_charts(shown: dict[str, list[dict]], expected: dict[str, list[dict]]) -> None:
    """Charts (title -> traces, their JSON) that show the same: numbers within what summing in
    another order (a job's worker) moves, pictures within one level, the rest equal."""
    assert shown.keys() == expected.keys()
    for title, traces in shown.items():
        for trace, reference in zip(traces, expected[title], strict=True):
            assert trace.keys() == reference.keys()
            for name, value in reference.items():
                if isinstance(value, dict) and "bdata" in value:
                    np.testing.assert_allclose(decoded(trace[name]), decoded(value), rtol=1e-3, atol=1e-6)
                elif name == "source":  # a PNG
                    np.testing.assert_allclose(pixels(trace[name]), pixels(value), atol=1)
                elif isinstance(value, list) and value and all(isinstance(v, float) for v in value):
                    np.testing.assert_allclose(trace[name], value, rtol=1e-3, atol=1e-6)  # a short list plotly keeps plain
                else:
                    assert trace[name] == value, (title, name)


def pixels(source: str) -> np.ndarray:
    """A data-URL PNG's pixels."""
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(source.partition(",")[2])))).astype(int)


def run_until(app, done, timeout: float = 120) -> None:
    """Rerun the page (as its live fragment would) until ``done(app)``."""
    deadline = time.monotonic() + timeout
    while not done(app):
        assert time.monotonic() < deadline, [element.value for element in app.markdown]
        time.sleep(0.5)
        app.run()
        assert not app.exception, app.exception
