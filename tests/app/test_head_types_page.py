"""The Head types page: the grid over the bundled photos or the Several images page's pictures,
the rules beside it, a head's maps on every picture, what a view costs, the job for a real-size
model, the click on a cell (its handler), and the models without a class token."""
import json

import pytest
import torch
from streamlit.testing.v1 import AppTest
from streamlit.util import AttributeDictionary

import vit_explorer as vx
from vit_explorer.analysis import head_types as ht
from vit_explorer.model import vit as model_module
from vit_explorer.training import train
from vit_explorer.app import costs, images, memo, models
from apptest import APP, PHOTO, errors, figure_titles, tiny_default, tiny_model, widget  # noqa: F401 (the fixture)
from apptest import assert_same_charts, charts, run_until

PAGE = "views/head_types.py"
PHOTOS = ["photo:astronaut.png", "photo:chelsea.png", "photo:coffee.png", "photo:rocket.jpg"]


@pytest.fixture
def passes(monkeypatch):
    """What runs: the batch of each block's pass, and the images of each layer's attention
    computed again from tokens."""
    blocks, attentions = [], []
    block_forward = model_module.Block.forward
    monkeypatch.setattr(model_module.Block, "forward", lambda self, x, *args: blocks.append(x.shape[0]) or block_forward(self, x, *args))
    layer_attention = ht.layer_attention
    counting = lambda model, tokens, *rest, **named: attentions.append(tokens.shape[0]) or layer_attention(model, tokens, *rest, **named)  # noqa: E731
    monkeypatch.setattr(ht, "layer_attention", counting)
    from vit_explorer.app import selection
    monkeypatch.setattr(selection, "layer_attention", counting)
    return blocks, attentions


def open_page() -> AppTest:
    app = AppTest.from_file(APP, default_timeout=60).run()
    app.switch_page(PAGE).run()
    assert not app.exception, app.exception
    return app


def grid_spec(app: AppTest) -> dict:
    (chart,) = [chart for chart in app.get("plotly_chart") if "type over" in json.loads(chart.proto.spec)["layout"]["title"]["text"]]
    return json.loads(chart.proto.spec)


def test_the_page_measures_the_four_photos_in_one_pass_and_shows_the_rules_beside_the_grid(passes):
    blocks, attentions = passes
    app = AppTest.from_file(APP, default_timeout=60).run()  # Pipeline captures the sidebar's shapes picture
    depth = models.base_model(models.DEFAULT_MODEL).config.depth
    blocks.clear()
    app.switch_page(PAGE).run()
    assert not app.exception and errors(app) == []
    assert app.title[0].value == "Head types"
    # One pass of the four photos together, then each layer's attention (the four together: they
    # are small), and the drawn head's layer (0) for its maps, an image at a time.
    assert blocks == [4] * depth and attentions == [4] * depth + [1] * 4
    titles = figure_titles(app)
    assert len(titles) == 2 and titles[0].startswith("Every head's type over 4 pictures: ")
    assert titles[1].startswith("Layer 0, head 0 (") and "patch 36 (row 4, col 4) on each picture" in titles[1]
    # The rules, in their order, with the thresholds, beside the grid; every measure defined.
    rules = next(markdown.value for markdown in app.markdown if markdown.value.startswith("1. **prefix sink**"))
    assert [line.split("**")[1] for line in rules.splitlines()] == list(ht.LABELS)
    assert f"prefix share ≥ {ht.PREFIX_SINK:g}" in rules and f"reach ≤ {ht.LOCAL_REACH:g}" in rules
    assert f"consistency ≥ {ht.POSITIONAL:g}" in rules and f"evenness ≥ {ht.GLOBAL_EVENNESS:g}" in rules
    definitions = next(markdown.value for markdown in app.markdown if markdown.value.startswith("- **distance**"))
    assert "Fig. 7" in definitions and f"median + {ht.OUTLIER_MADS:g} MADs" in definitions
    # The grid is the package's numbers over the same photos.
    config = models.base_model(models.DEFAULT_MODEL).config
    x = torch.cat([vx.preprocess(images.photo(key.partition(":")[2]), config) for key in PHOTOS])
    expected = vx.classify_heads(models.base_model(models.DEFAULT_MODEL), x)
    heatmap, cells = grid_spec(app)["data"]
    assert [cell[0] for cell in cells["customdata"]] == [label for row in expected.labels for label in row]
    consistency = [float(cell[7]) for cell in cells["customdata"]]
    assert consistency == pytest.approx(expected.consistency.flatten().tolist(), abs=2e-3)
    assert cells["hovertemplate"].count("<br>") == 8  # the seven measures and the hint
    assert grid_spec(app)["layout"]["shapes"][0]["x0"] == -0.5  # layer 0, head 0 outlined
    for control in [*app.radio, *app.selectbox]:
        if control.key and not control.key.endswith("picker"):
            assert control.help, control.label


def test_another_head_or_query_runs_no_pass_and_one_layer_of_attention(passes):
    blocks, attentions = passes
    app = open_page()
    blocks.clear()
    attentions.clear()
    widget(app.selectbox, "Head").set_value(2).run()
    widget(app.selectbox, "Layer").set_value(3).run()
    widget(app.selectbox, "Query").set_value(-1).run()
    assert not app.exception and blocks == []
    assert attentions == [1] * 8  # layer 3's attention, an image at a time, for head 2; then the query
    title = figure_titles(app)[1]
    assert title.startswith("Layer 3, head 2 (") and "attention of the class token" in title
    assert grid_spec(app)["layout"]["shapes"][0]["x0"] == 1.5  # the chosen head outlined
    app.switch_page("views/pipeline.py").run()
    app.switch_page(PAGE).run()
    assert not app.exception and blocks == [] and attentions == [1] * 8  # everything kept for everybody
    assert widget(app.selectbox, "Head").value == 2


def test_a_clicked_cell_becomes_the_layer_and_head_shown():
    """AppTest cannot play a plotly selection: the page's on_select handler runs by itself, as
    Streamlit calls it (the chart's state set, then the callback), and the page follows its values."""
    def clicked():
        import streamlit as st
        from streamlit.util import AttributeDictionary

        from vit_explorer.app import session

        st.session_state["types_click"] = AttributeDictionary(
            selection=AttributeDictionary(points=[{"x": 3, "y": 1, "point_index": 7}])
        )
        session.cell_picked("types_click", "types_layer", "types_head")()
        st.write(f"{st.session_state['kept:types_layer']} {st.session_state['kept:types_head']}")

    handled = AppTest.from_function(clicked).run()
    assert not handled.exception and handled.markdown[0].value == "1 3"
    app = open_page()
    (grid,) = [chart for chart in app.get("plotly_chart") if chart.proto.id and "types_click" in chart.proto.id]
    assert list(grid.proto.selection_mode) == [0]  # points
    app.session_state["kept:types_layer"], app.session_state["kept:types_head"] = 1, 3  # what the handler leaves
    app.run()
    assert not app.exception and figure_titles(app)[1].startswith("Layer 1, head 3 (")
    assert grid_spec(app)["layout"]["shapes"][0]["x0"] == 2.5


def test_the_several_images_pages_pictures_can_be_read_instead():
    app = AppTest.from_file(APP, default_timeout=60).run()
    app.switch_page("views/images.py").run()
    app.multiselect(key="image_set").set_value(["shapes:0", "shapes:4", "photo:chelsea.png"]).run()
    app.switch_page(PAGE).run()
    app.radio(key="types_images").set_value("set").run()
    assert not app.exception and errors(app) == []
    titles = figure_titles(app)
    assert titles[0].startswith("Every head's type over 3 pictures")
    maps = json.loads(app.get("plotly_chart")[1].proto.spec)
    assert [annotation["text"].split(" (max")[0] for annotation in maps["layout"]["annotations"]] == [
        "1. circle", "2. ring", "3. chelsea"
    ]


def test_a_real_size_models_head_types_are_a_job_that_draws_what_the_server_would(passes, monkeypatch):
    blocks, attentions = passes
    inline = charts(open_page())
    memo.shared_results().clear()
    monkeypatch.setattr(costs, "QUICK_COST", 1.0)  # the tiny model's passes as a ViT-B's would be
    app = open_page()
    assert errors(app) == [] and charts(app) == {}
    said = f"costs about {costs.head_types_forwards(tiny_model().config, 4):.0f} forward passes"  # the 4 photos, none read
    assert any(said in markdown.value for markdown in app.markdown)
    blocks.clear()
    attentions.clear()
    widget(app.button, "Measure the heads").click().run()
    run_until(app, charts)
    assert errors(app) == [] and not app.get("progress")
    # The four photos and their head types beside the server; their tokens kept, so that the maps
    # here run only their layer's attention, and another head no pass either.
    assert blocks == [] and attentions == [1] * 4
    assert_same_charts(charts(app), inline)
    widget(app.selectbox, "Head").set_value(1).run()
    assert not app.exception and blocks == []


@pytest.mark.parametrize("changes", [
    dict(reg_tokens=3, class_token=False, global_pool="mean", num_classes=0, class_names=None),  # headless, registers
    dict(dist_token=True),  # DeiT distilled: two prefix tokens
])
def test_the_page_reads_models_with_registers_and_no_class_token(tmp_path, changes):
    path = tmp_path / "family.safetensors"
    model = tiny_model(**changes)
    vx.save_model(model, path)
    app = AppTest.from_file(APP, default_timeout=60).run()
    app.file_uploader(key="checkpoint_upload").set_value((path.name, path.read_bytes(), "application/octet-stream")).run()
    app.switch_page(PAGE).run()
    assert not app.exception and errors(app) == []
    widget(app.selectbox, "Query").set_value(-1).run()
    assert not app.exception and errors(app) == []
    prefix = model.config.num_prefix_tokens
    query = "class token" if model.config.class_token else "mean over the patch queries"
    assert f"attention of the {query} on each picture" in figure_titles(app)[1]
    x = torch.cat([vx.preprocess(images.photo(key.partition(":")[2]), model.config) for key in PHOTOS])
    expected = vx.classify_heads(vx.load_model(path), x)
    assert expected.num_prefix_tokens == prefix
    _, cells = grid_spec(app)["data"]
    shares = [float(cell[5]) for cell in cells["customdata"]]  # the prefix share: registers or class + distillation
    assert shares == pytest.approx(expected.prefix_share.flatten().tolist(), rel=2e-2, abs=1e-3) and min(shares) > 0


@pytest.mark.skipif(not train.DEFAULT_WEIGHTS.is_file(), reason="the shipped model is not there yet")
def test_the_page_reads_the_shipped_model(monkeypatch):
    monkeypatch.setenv("VIT_EXPLORER_DEFAULT_MODEL", str(train.DEFAULT_WEIGHTS))
    app = open_page()
    assert errors(app) == []
    titles = figure_titles(app)
    assert titles[0].startswith("Every head's type over 4 pictures") and titles[1].startswith("Layer 0, head 0")
    assert any(caption.value.startswith("High-norm patches found among the 4 pictures' 256 patches") for caption in app.caption)


def test_clicking_a_cell_in_chromium_shows_that_heads_maps(server):
    """The click itself, through a real browser: AppTest cannot play a plotly selection. The
    server's default model is tiny_model(): 4 layers of 4 heads."""
    sync_api = pytest.importorskip("playwright.sync_api")
    from bench.browser import CHROMIUM, CHROMIUM_LAUNCH, STATUS_WIDGET

    if CHROMIUM is None:
        pytest.skip("no system Chromium (apt-get install chromium)")
    url = server
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(**CHROMIUM_LAUNCH)
        page = browser.new_page(viewport={"width": 1400, "height": 2400})
        page.set_default_timeout(120_000)
        page.goto(f"{url}/heads")
        page.get_by_role("heading", name="Head types", level=1).wait_for()
        grid = page.locator(".st-key-types_click .nsewdrag").first
        grid.wait_for()
        page.locator(STATUS_WIDGET).wait_for(state="hidden")
        box = grid.bounding_box()
        # The cell of layer 2, head 3: the axes run from -0.5 to 3.5 both ways, layer 0 on top.
        page.mouse.click(box["x"] + box["width"] * 3.5 / 4, box["y"] + box["height"] * 2.5 / 4)
        sync_api.expect(page.get_by_text("Layer 2, head 3 (").first).to_be_visible(timeout=120_000)
        browser.close()
