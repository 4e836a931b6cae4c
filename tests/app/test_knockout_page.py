"""The Knock-out page (AppTest): the knock-out against the intact model, the sweep of every head (a job
for a large model), shared between sessions."""
import json
import os
import re
import signal

import numpy as np
import pytest
import torch

import vit_explorer as vx
from vit_explorer.app import costs, jobs, models, selection

from apptest import (  # noqa: F401 (tiny_default: autouse)
    assert_same_charts, charts, decoded, errors, figure_titles, open_app, run_until, tiny_default, tiny_model,
    title_matching, widget,
)
from helpers import counting_blocks


PAGE = "views/knockout.py"


def choose(app, label: str, values) -> None:
    widget(app.multiselect, label).set_value(values).run()
    assert not app.exception, app.exception


def test_the_page_shows_the_knock_out_against_the_intact_model():
    app = open_app(PAGE)
    assert errors(app) == [] and app.title[0].value == "Knock-out"
    assert title_matching(app, "^Each head knocked out alone \\(zero\\): change of log p of '\\w+'; outlined")  # tiny: sweep unasked
    assert all(w.help for w in [*app.multiselect, *app.radio, *app.button])  # every control says what it does
    choose(app, "Layer 1", [0, 2])
    assert errors(app) == []
    titles = figure_titles(app)
    assert all(title.strip() for title in titles) and len(titles) == 6
    what = re.escape("layer 1 heads 0, 2 (zero-ablated)")
    title_matching(app, f"^Top-5 with {what}, against the intact model$")
    title_matching(app, f"^With {what}: attention of the class token in layer 2")
    title_matching(app, "^Intact: rollout to the class token$")
    # The bars are the model's own, with and without the heads, computed here by hand.
    model = models.base_model(models.DEFAULT_MODEL)
    x = vx.preprocess(vx.shapes_sample(4, 32)[0], model.config)
    knocked = vx.capture(model, x, knock_out=vx.KnockOut(heads={1: (0, 2)})).logits[0].softmax(-1)
    spec = next(chart for chart in app.get("plotly_chart") if "Top-5" in chart.proto.spec).proto.spec
    bars = json.loads(spec)["data"][1]
    shown = [vx.SHAPE_CLASSES.index(name) for name in bars["y"]]
    assert shown == knocked.argsort(descending=True)[:5].tolist()
    np.testing.assert_allclose(decoded(bars["x"]), knocked[shown].numpy(), rtol=1e-3)


def test_a_view_costs_one_knocked_out_pass_and_its_widgets_reuse_it(monkeypatch):
    captures, sweeps = [], []

    def counting_capture(*args, **kwargs):
        captures.append(kwargs.get("knock_out"))
        return vx.capture(*args, **kwargs)

    def counting_sweep(*args, **kwargs):
        sweeps.append(args[2])
        return vx.head_sweep(*args, **kwargs)

    monkeypatch.setattr(selection, "capture", counting_capture)
    monkeypatch.setattr(selection, "head_sweep", counting_sweep)
    app = open_app().switch_page(PAGE).run()  # Pipeline's intact capture, then the page
    assert (captures, sweeps) == ([None], ["zero"])
    choose(app, "Layer 2", [3])
    assert captures == [None, vx.KnockOut(heads={2: (3,)})]
    widget(app.slider, "Layer").set_value(0).run()
    choose(app, "Remove the MLP branch of layers", [0])
    assert len(captures) == 3 and sweeps == ["zero"]  # the slider drew what was there
    app.radio(key="knockout_mode").set_value("mean").run()
    assert captures[-1] == vx.KnockOut(heads={2: (3,)}, mlp=[0], mode="mean") and sweeps == ["zero", "mean"]
    app.switch_page("views/attention.py").run()
    app.switch_page(PAGE).run()
    assert not app.exception and len(captures) == 4 and len(sweeps) == 2  # kept, and shared


def test_a_knock_out_view_runs_only_the_layers_from_the_knocked_out_one_on(monkeypatch):
    app = open_app().switch_page(PAGE).run()  # Pipeline's intact capture, then the page
    ran = counting_blocks(monkeypatch, models.base_model(models.DEFAULT_MODEL))
    choose(app, "Layer 2", [3])
    assert ran == [2, 3]  # the intact capture is the page's first view's; layers 0 and 1 are its
    widget(app.slider, "Layer").set_value(0).run()
    choose(app, "Layer 2", [])
    assert not app.exception and ran == [2, 3]  # drawn from what was there


def sweep_shown(app) -> bool:
    return any(title.startswith("Each head knocked out alone") for title in figure_titles(app))


def test_a_sweep_that_is_not_quick_is_a_job_that_a_second_person_joins(monkeypatch):
    monkeypatch.setattr(costs, "QUICK_COST", 1.0)  # the tiny model's sweep as a ViT-B's would be
    computed = []
    monkeypatch.setattr(selection, "head_sweep", lambda *args, **kwargs: computed.append(args))
    ann = open_app(PAGE)
    assert not sweep_shown(ann) and errors(ann) == []
    widget(ann.button, "Run the sweep").click().run()
    assert ann.get("progress") or any("Waiting for its turn" in info.value for info in ann.info)
    bob = open_app(PAGE)  # the same model, image and mode: he sees it going and asks for it too
    assert [button.label for button in bob.button if "sweep" in button.label or "too" in button.label] == ["Ask for it too"]
    widget(bob.button, "Ask for it too").click().run()
    widget(ann.button, "Cancel").click().run()  # Ann withdraws: Bob still wants it, so it goes on
    run_until(bob, sweep_shown)
    ann.run()
    assert sweep_shown(ann) and computed == []  # shared through the cache, computed beside the server
    assert len(list(jobs.job_board().folder.glob("*/record.json"))) == 1  # one job for both
    # The job's sweep is the one the server would have computed.
    model = models.base_model(models.DEFAULT_MODEL)
    x = vx.preprocess(vx.shapes_sample(4, 32)[0], model.config)
    spec = json.loads(next(chart for chart in ann.get("plotly_chart") if "Each head" in chart.proto.spec).proto.spec)
    np.testing.assert_allclose(
        decoded(spec["data"][0]["z"]).reshape(4, 4), vx.head_sweep(model, x).values.numpy(), rtol=1e-4, atol=1e-5,
    )


def test_a_sweep_job_whose_worker_is_killed_says_so_in_a_sentence(monkeypatch):
    monkeypatch.setattr(costs, "QUICK_COST", 1.0)
    app = open_app(PAGE)
    widget(app.button, "Run the sweep").click().run()
    (record,) = jobs.job_board().folder.glob("*/record.json")
    os.kill(json.loads(record.read_text())["pid"], signal.SIGKILL)
    run_until(app, lambda app: errors(app))
    assert errors(app) == [
        "The computation's process ended before it finished (it was stopped from outside or ran out of"
        " memory); run it again."
    ]
    widget(app.button, "Run the sweep").click().run()  # asked again: it runs this time
    run_until(app, sweep_shown)
    assert errors(app) == []


def test_knocking_out_every_head_is_refused_in_a_sentence():
    app = open_app(PAGE)
    choose(app, "Remove the attention branch of layers", [0, 1, 2])
    choose(app, "Layer 3", [0, 1, 2, 3])
    assert errors(app) == [
        "Knocking out every head of every layer leaves the tokens nothing to read from one another, so"
        " there is nothing left to compare: keep at least one head."
    ]
    assert not app.exception
    app.button[0].click().run()  # Clear
    assert errors(app) == [] and all(not w.value for w in app.multiselect)


def test_a_headless_model_compares_its_pooled_features(tmp_path):
    path = tmp_path / "headless.safetensors"
    model = tiny_model(class_token=False, global_pool="map", num_classes=0, class_names=None).eval()
    vx.save_model(model, path)
    app = open_app(PAGE)
    app.file_uploader(key="checkpoint_upload").set_value((path.name, path.read_bytes(), "application/octet-stream")).run()
    assert not app.exception and errors(app) == []
    title_matching(app, "^Each head knocked out alone \\(zero\\): cosine change; outlined: knocked out above$")
    choose(app, "Layer 0", [1])
    assert errors(app) == []
    (metric,) = app.metric
    assert metric.label == "Cosine between the pooled features, intact and knocked out"
    x = vx.preprocess(vx.shapes_sample(4, 32)[0], model.config)
    knocked = vx.capture(model, x, knock_out=vx.KnockOut(heads={0: (1,)})).logits
    assert metric.value == f"{float(torch.cosine_similarity(knocked, vx.capture(model, x).logits)):.6f}"
    title_matching(app, "^With layer 0 head 1 \\(zero-ablated\\): rollout to the mean over the patch queries$")


def test_a_sweep_cell_reports_its_layer_and_head_when_clicked():
    values = torch.arange(12.0).reshape(3, 4) - 6
    knocked = torch.zeros(3, 4, dtype=torch.bool)
    knocked[2, 1] = True
    fig = vx.figures.head_sweep_grid(values, "change of log p", knocked=knocked, title="t")
    (cells,) = [trace for trace in fig.data if trace.type == "scatter"]
    for x, y, value in zip(cells.x, cells.y, cells.customdata):
        assert value == values[y, x]  # a clicked point's x is the head, its y the layer
    (outline,) = fig.layout.shapes
    assert (outline.x0, outline.y0) == (0.5, 1.5)


def test_clicking_a_sweep_cell_in_chromium_knocks_that_head_out(tmp_path, server):
    """Plotly selections cannot be played in AppTest: the click goes through a real browser. The
    server's default model is tiny_model(): 4 layers of 4 heads, its sweep runs unasked."""
    sync_api = pytest.importorskip("playwright.sync_api")
    from bench.browser import CHROMIUM, CHROMIUM_LAUNCH, STATUS_WIDGET

    if CHROMIUM is None:
        pytest.skip("no system Chromium (apt-get install chromium)")
    url = server
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(**CHROMIUM_LAUNCH)
        page = browser.new_page(viewport={"width": 1400, "height": 2400})
        page.set_default_timeout(120_000)
        page.goto(f"{url}/knockout")
        page.get_by_role("heading", name="Knock-out", level=1).wait_for()
        grid = page.locator(".st-key-knockout_sweep_click .nsewdrag").first
        grid.wait_for()
        page.locator(STATUS_WIDGET).wait_for(state="hidden")
        box = grid.bounding_box()
        # The cell of layer 2, head 3: the axes run from -0.5 to 3.5 both ways, layer 0 on top.
        page.mouse.click(box["x"] + box["width"] * 3.5 / 4, box["y"] + box["height"] * 2.5 / 4)
        sync_api.expect(page.get_by_text("Top-5 with layer 2 head 3 (zero-ablated)")).to_be_visible(timeout=120_000)
        page.screenshot(path=tmp_path / "knockout_clicked.png", full_page=True)
        browser.close()
