"""The "Inside a layer" page (AppTest): it renders for every family, shows the model's own
numbers (its attention row is the capture's), shares layer, head and query with the Attention
page, costs one capture plus one block, and its scale control changes nothing else."""
import base64
import json

import numpy as np
import pytest
import torch

import vit_explorer as vx
from vit_explorer.app import models, selection

from apptest import errors, figure_titles, open_app, tiny_default, tiny_model, title_matching, widget  # noqa: F401

PAGE = "views/inside.py"


def figures_by_title(app) -> dict[str, dict]:
    return {
        json.loads(chart.proto.spec)["layout"]["title"]["text"]: json.loads(chart.proto.spec)
        for chart in app.get("plotly_chart")
    }


def attention_heatmap(app, pattern: str) -> np.ndarray:
    spec = figures_by_title(app)[title_matching(app, pattern)]
    (heatmap,) = [trace for trace in spec["data"] if trace["type"] == "heatmap"]
    z = heatmap["z"]
    if isinstance(z, dict):  # plotly's typed-array encoding of a numpy array
        shape = [int(size) for size in str(z["shape"]).split(",")]
        z = np.frombuffer(base64.b64decode(z["bdata"]), dtype=z["dtype"]).reshape(shape)
    return np.asarray(z, dtype=np.float64)


def test_the_page_renders_every_step_with_titled_figures():
    app = open_app(PAGE)
    assert errors(app) == [] and app.title[0].value == "Inside a layer"
    titles = figure_titles(app)
    assert all(title.strip() for title in titles)
    assert [expander.label[:2] for expander in app.main.expander] == ["1.", "2.", "3.", "4.", "5."]
    assert len(app.main.get("latex")) == 5  # every step has its formula
    for pattern in ("before and after LayerNorm", "^Query q of CLS, layer 3, head 0 \\(8 numbers\\)",
                    "^Keys and values of all 65 tokens", "before the softmax$", "the softmax of the scores$",
                    "^Where head 0's output", "output projection", "hidden units", "leaving layer 3"):
        title_matching(app, pattern)


def test_the_attention_row_is_the_one_the_attention_page_draws():
    app = open_app("views/attention.py")
    widget(app.slider, "Layer").set_value(1).run()
    widget(app.selectbox, "Query token").set_value(9).run()
    widget(app.selectbox, "Head").set_value(2).run()
    app.switch_page(PAGE).run()
    assert not app.exception
    # The choice made on the Attention page holds here.
    assert widget(app.slider, "Layer").value == 1
    assert widget(app.selectbox, "Head").value == 2
    assert widget(app.selectbox, "Query token").value == 9
    row = attention_heatmap(app, "^Attention of patch 9, layer 1, head 2: the softmax")
    model = models.base_model(models.DEFAULT_MODEL)
    x = vx.preprocess(vx.shapes_sample(0, 32)[0], model.config)
    shown = vx.capture(model, x, attention_dtype=torch.float16).attentions[0, 1, 2, 1 + 9, 1:]
    np.testing.assert_allclose(row.reshape(-1), shown.float().numpy(), atol=2e-3)


def test_a_view_costs_one_capture_and_one_block_and_widgets_reuse_them(monkeypatch):
    captures, blocks = [], []

    def counting_capture(*args, **kwargs):
        captures.append(1)
        return vx.capture(*args, **kwargs)

    def counting_internals(*args, **kwargs):
        blocks.append((args[2], tuple(kwargs["queries"])))  # one token's steps, not the whole block
        return vx.layer_internals(*args, **kwargs)

    monkeypatch.setattr(selection, "capture", counting_capture)
    monkeypatch.setattr(selection, "layer_internals", counting_internals)
    app = open_app(PAGE)
    assert (len(captures), blocks) == (1, [(3, (0,))])  # the class token
    widget(app.selectbox, "Head").set_value(1).run()
    widget(app.select_slider, "Softmax scale, as a multiple of 1/sqrt(d_head)").set_value(4.0).run()
    assert (len(captures), blocks) == (1, [(3, (0,))])
    widget(app.selectbox, "Query token").set_value(12).run()
    assert (len(captures), blocks) == (1, [(3, (0,)), (3, (13,))])
    widget(app.slider, "Layer").set_value(0).run()
    assert (len(captures), blocks) == (1, [(3, (0,)), (3, (13,)), (0, (13,))])  # part of one block, not the model
    app.switch_page("views/attention.py").run()
    app.switch_page(PAGE).run()
    assert not app.exception and len(captures) == 1 and len(blocks) == 3


def test_the_scale_control_changes_only_its_own_charts():
    app = open_app(PAGE)
    model = models.base_model(models.DEFAULT_MODEL)
    x = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(0)).to(next(model.parameters()).device)
    with torch.no_grad():
        before = model(x)
    shown = figures_by_title(app)
    widget(app.select_slider, "Softmax scale, as a multiple of 1/sqrt(d_head)").set_value(8.0).run()
    assert not app.exception
    after = figures_by_title(app)
    changed = {title for title in set(shown) | set(after) if shown.get(title) != after.get(title)}
    assert changed == {
        title_matching(app, "^How the scale sharpens"),
        "Attention of CLS at x1 the model's scale (its own)",
        "Attention of CLS at x8 the model's scale (not the model's)",
    }
    with torch.no_grad():
        assert torch.equal(model(x), before)  # bitwise: the shared model is untouched


@pytest.mark.parametrize("changes", [
    dict(reg_tokens=2, dist_token=True, init_values=0.1),
    dict(class_token=False, global_pool="mean"),
    dict(class_token=False, global_pool="map", num_classes=0, class_names=None),
])
def test_the_page_for_every_family(tmp_path, changes):
    path = tmp_path / "family.safetensors"
    vx.save_model(tiny_model(**changes), path)
    app = open_app(PAGE)
    app.file_uploader(key="checkpoint_upload").set_value(
        (path.name, path.read_bytes(), "application/octet-stream")
    ).run()
    assert not app.exception and errors(app) == []
    titles = figure_titles(app)
    assert all(title.strip() for title in titles) and len(titles) == 13
    if changes.get("class_token") is False:
        assert "patch 36 (row 4, col 4)" == widget(app.selectbox, "Query token").format_func(36)
        title_matching(app, "^Query q of patch 36, layer 3")
    else:
        title_matching(app, "^Query q of CLS")
        spec = figures_by_title(app)[title_matching(app, "the softmax of the scores$")]
        (bars,) = [trace for trace in spec["data"] if trace["type"] == "bar"]
        assert bars["x"] == ["CLS", "DIST", "reg 1", "reg 2"]


def test_a_choice_made_here_holds_on_the_attention_page():
    app = open_app(PAGE)
    widget(app.slider, "Layer").set_value(2).run()
    widget(app.selectbox, "Head").set_value(3).run()
    app.switch_page("views/attention.py").run()
    assert not app.exception
    assert title_matching(app, "attention$").startswith("Layer 2, head 3")


def test_the_attention_page_opens_this_page_on_a_head_it_shows():
    app = open_app("views/attention.py")
    widget(app.slider, "Layer").set_value(1).run()
    widget(app.selectbox, "Query token").set_value(9).run()
    (button,) = [button for button in app.button if button.label == "head 3"]
    button.click().run()
    assert errors(app) == [] and app.title[0].value == "Inside a layer"
    assert widget(app.slider, "Layer").value == 1
    assert widget(app.selectbox, "Head").value == 3
    assert widget(app.selectbox, "Query token").value == 9


def test_the_matrix_and_the_pipeline_link_here():
    app = open_app("views/attention.py")
    assert [link.proto.page for link in app.get("page_link")] == ["inside"]  # the page's url_path
    app.switch_page("views/pipeline.py").run()
    assert [link.proto.page for link in app.get("page_link")] == ["lesson", "inside"]  # the Lesson offered first
