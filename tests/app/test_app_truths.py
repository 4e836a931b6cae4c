"""What the Attention and Pipeline pages tell a reader beyond their figures: whether a prediction
or an attention pattern means anything, where the query is, and which colour scale is in use.

The tiny default model has random weights: its attention is nearly uniform and its prediction a
guess. The shipped shapes model is trained: on a sample it gets right neither note shows.
"""
import base64
import json
import re

import numpy as np
import pytest
from streamlit.testing.v1 import AppTest

from apptest import APP, tiny_default, widget  # noqa: F401 (tiny_default: autouse)
from vit_explorer.training import train

UNIFORM = re.compile(r"spread their attention almost evenly over all tokens \(mean entropy 100% of")
CHANCE = re.compile(r"^The top probability, 1\d\.\d%, is close to chance \(16\.7% for 6 classes\)")
PHOTO_CAVEAT = "Read nothing into this prediction: this model was trained on synthetic shapes"


def open_page(page: str) -> AppTest:
    app = AppTest.from_file(APP, default_timeout=60).run()
    app.switch_page(page).run()
    assert not app.exception, app.exception
    return app


def notes(app: AppTest) -> list[str]:
    """The main area's info and warning lines (the sidebar has its own)."""
    return [element.value for element in (*app.main.info, *app.main.warning)]


def chart(app: AppTest, pattern: str) -> dict:
    figures = [json.loads(element.proto.spec) for element in app.get("plotly_chart")]
    (figure,) = [figure for figure in figures if re.search(pattern, figure["layout"]["title"]["text"])]
    return figure


def array(data) -> np.ndarray:
    """An array of a figure's JSON: a list, or plotly's typed array (base64 bytes, dtype, shape)."""
    if isinstance(data, dict):
        shape = [int(size) for size in str(data.get("shape", "-1")).split(",")]
        return np.frombuffer(base64.b64decode(data["bdata"]), dtype=data["dtype"]).reshape(shape)
    return np.asarray(data, dtype=float)


def rects(figure: dict) -> list[dict]:
    return [shape for shape in figure["layout"].get("shapes", []) if shape["type"] == "rect"]


@pytest.mark.parametrize("page", ["views/pipeline.py", "views/attention.py"])
def test_a_random_model_says_its_attention_is_uniform_and_its_prediction_a_guess(page):
    app = open_page(page)
    shown = notes(app)
    assert sum(bool(UNIFORM.search(note)) for note in shown) == 1, shown
    assert sum(bool(CHANCE.search(note)) for note in shown) == 1, shown


def test_the_uniform_note_never_measures_every_head_where_the_capture_does_not_hold_every_layer(monkeypatch):
    """Where a page's capture keeps the tokens only (a DINOv3 at 768 px), the Pipeline's note does not
    compute every layer's attention again: it appears once the heads are measured (the Attention page)."""
    from vit_explorer.app import memo, models, selection

    memo.shared_results().clear()
    monkeypatch.setattr(models, "KEEP_EVERY_LAYER_BYTES", 0)
    measured = []
    original = selection.captured_head_statistics
    monkeypatch.setattr(selection, "captured_head_statistics", lambda *a, **k: measured.append(1) or original(*a, **k))
    app = open_page("views/pipeline.py")
    assert measured == [] and not [note for note in notes(app) if UNIFORM.search(note)]
    app.switch_page("views/attention.py").run()  # its view measures every head (quick here)
    assert measured == [1]
    app.switch_page("views/pipeline.py").run()
    assert measured == [1] and sum(bool(UNIFORM.search(note)) for note in notes(app)) == 1


@pytest.mark.skipif(not train.DEFAULT_WEIGHTS.is_file(), reason="the shipped model is not there yet")
@pytest.mark.parametrize("page", ["views/pipeline.py", "views/attention.py"])
def test_the_trained_model_on_a_sample_it_gets_right_shows_neither_note(monkeypatch, page):
    monkeypatch.delenv("VIT_EXPLORER_DEFAULT_MODEL")  # the shipped model on its default sample, a ring
    app = open_page(page)
    if page == "views/pipeline.py":
        assert any("The model says **ring**" in text.value for text in app.markdown)
    assert not [note for note in notes(app) if UNIFORM.search(note) or "close to chance" in note]


@pytest.mark.parametrize("page", ["views/pipeline.py", "views/attention.py"])
def test_a_photo_on_the_shapes_model_is_flagged_where_the_prediction_is(page):
    app = open_page(page)
    app.selectbox(key="image_picker").set_value("photo:chelsea.png").run()
    assert not app.exception
    (caveat,) = [note for note in notes(app) if note.startswith(PHOTO_CAVEAT)]
    assert caveat.endswith("so a photo means nothing to it.")
    app.selectbox(key="image_picker").set_value("shapes:0").run()
    assert not [note for note in notes(app) if note.startswith(PHOTO_CAVEAT)]


@pytest.mark.skipif(not train.DEFAULT_WEIGHTS.is_file(), reason="the shipped model is not there yet")
def test_the_scale_control_switches_between_one_scale_and_one_per_head(monkeypatch):
    monkeypatch.delenv("VIT_EXPLORER_DEFAULT_MODEL")  # trained: its heads' largest weights differ
    app = open_page("views/attention.py")
    scale = widget(app.radio, "Scale")
    assert scale.value == "shared"
    grid = chart(app, "^Attention of the")
    assert "one colour scale shared by all heads" in grid["layout"]["title"]["text"]
    assert grid["layout"]["coloraxis"]["cmin"] == 0
    scale.set_value("per head").run()
    grid = chart(app, "^Attention of the")
    assert "each head on its own scale" in grid["layout"]["title"]["text"]
    heatmaps = [trace for trace in grid["data"] if trace["type"] == "heatmap"]
    assert len(heatmaps) == 4 and len({trace["zmax"] for trace in heatmaps}) == 4
    for trace in heatmaps:  # each head to its own largest weight, or 3x the uniform weight 1/64
        assert trace["zmax"] == pytest.approx(max(array(trace["z"]).max(), 3 / 64))


def test_the_query_patch_is_marked_in_every_map_and_its_row_in_the_matrix():
    app = open_page("views/attention.py")
    widget(app.selectbox, "Query token").set_value(9).run()  # row 1, col 1 of the 8 x 8 grid
    patch = (3.5, 7.5, 3.5, 7.5)  # 4-pixel patches of the 32-pixel input
    for pattern, panels in (("^Attention of the", 4), ("^Patches holding", 4), ("^Rollout", 1)):
        outlined = {(shape.get("xref", "x"), (shape["x0"], shape["x1"], shape["y0"], shape["y1"]))
                    for shape in rects(chart(app, pattern))}
        assert {where for _, where in outlined} == {patch} and len(outlined) == panels, pattern
    (row,) = rects(chart(app, "attention$"))
    assert (row["y0"], row["y1"]) == (9.5, 10.5)  # the class token is row 0, patch 9 row 10
    matrix = chart(app, "attention$")
    assert matrix["layout"]["height"] >= 700
    widget(app.selectbox, "Query token").set_value(-1).run()  # the class token: its row, no patch
    assert not rects(chart(app, "^Attention of the"))
    (row,) = rects(chart(app, "attention$"))
    assert (row["y0"], row["y1"]) == (-0.5, 0.5)


def test_a_matrix_drawn_in_blocks_says_so_where_rows_are_said_to_sum_to_one():
    app = open_page("views/attention.py")
    texts = " ".join(text.value for text in app.markdown)
    assert "(each row sums to 1)" in texts and "blocks of" not in texts
    app.number_input(key="input_height").set_value(96).run()
    app.number_input(key="input_width").set_value(96).run()  # 576 patches: blocks of 2 x 2
    assert not app.exception
    texts = " ".join(text.value for text in app.markdown)
    assert "(each row sums to 1; the 577 tokens are too many to draw one by one" in texts
    assert "blocks of 2 x 2, each cell the largest weight in its block, and its rows do not sum to 1" in texts
