"""The Compare page: two models side by side, layers matched by relative depth, one image point
mapped onto two grids, everything from the shared caches."""
import pytest

import vit_explorer as vx
from apptest import errors, figure_titles, open_app, tiny_default, tiny_model, title_matching, widget  # noqa: F401
from apptest import assert_same_charts, charts, run_until
from vit_explorer import analysis
from vit_explorer.app import costs, memo, models, selection

PAGE = "views/compare.py"


@pytest.mark.parametrize("layer, depth, other_depth, matched", [
    (0, 12, 6, 0), (11, 12, 6, 5), (5, 12, 6, 2),  # 5 * 5 / 11 = 2.27
    (11, 12, 24, 23), (6, 12, 24, 13), (5, 11, 6, 3),  # 6 * 23 / 11 = 12.5; 5 * 5 / 10 = 2.5: halves go up
    (1, 3, 2, 1),  # 1 * 1 / 2 = 0.5
    (3, 4, 4, 3), (0, 1, 6, 5), (2, 4, 1, 0),
])
def test_layers_are_matched_at_the_same_relative_depth(layer, depth, other_depth, matched):
    assert analysis.matching_layer(layer, depth, other_depth) == matched


def test_matching_is_monotonic_and_covers_both_ends():
    for depth, other_depth in [(12, 6), (6, 12), (4, 7), (24, 12)]:
        matched = [analysis.matching_layer(layer, depth, other_depth) for layer in range(depth)]
        assert matched[0] == 0 and matched[-1] == other_depth - 1
        assert matched == sorted(matched)
    with pytest.raises(analysis.AnalysisError):
        analysis.matching_layer(12, 12, 6)


def test_a_point_falls_in_the_patch_under_it_on_either_grid():
    # The image centre: patch (4, 4) of an 8x8 grid, (7, 7) of a 14x14 one.
    assert analysis.point_patch((0.5, 0.5), (8, 8)) == 4 * 8 + 4
    assert analysis.point_patch((0.5, 0.5), (14, 14)) == 7 * 14 + 7
    # The far edges belong to the last row and column; a non-square grid counts its own sides.
    assert analysis.point_patch((1.0, 1.0), (14, 14)) == 14 * 14 - 1
    assert analysis.point_patch((0.0, 0.0), (14, 14)) == 0
    assert analysis.point_patch((0.75, 0.3), (2, 4)) == 1 * 4 + 1
    # A patch's centre of a coarse 8x8 grid (patch 4 on 32 px) lies in the finer 16x16 grid's
    # patch (2r + 1, 2c + 1), the one that holds the same pixels.
    for patch in range(64):
        row, col = divmod(patch, 8)
        centre = analysis.patch_point(patch, (8, 8))
        assert analysis.point_patch(centre, (8, 8)) == patch
        assert analysis.point_patch(centre, (16, 16)) == (2 * row + 1) * 16 + 2 * col + 1
    with pytest.raises(analysis.AnalysisError):
        analysis.point_patch((1.2, 0.5), (8, 8))


@pytest.fixture
def captures(monkeypatch):
    """Every forward pass the app makes, as the capture calls it counts."""
    calls = []

    def counting_capture(*args, **kwargs):
        calls.append(args[0].config)
        return vx.capture(*args, **kwargs)

    monkeypatch.setattr(selection, "capture", counting_capture)
    return calls


def test_the_same_model_at_another_patch_size_side_by_side(captures):
    app = open_app("views/attention.py")
    assert len(captures) == 1
    app.switch_page(PAGE).run()
    assert not app.exception and errors(app) == []
    assert app.title[0].value == "Compare"
    assert widget(app.select_slider, "B's patch size").value == 2  # the nearest finer grid
    titles = figure_titles(app)
    assert titles and all(title.strip() for title in titles)
    assert len(titles) == 8  # top-5, head maps, rollout and token PCA of each
    assert "in layer 3 (of 4)" in title_matching(app, "^A: attention of the class token")
    assert "in layer 3 (of 4)" in title_matching(app, "^B: attention of the class token")
    # A's capture is the one the Attention page made: only B's pass is new.
    assert len(captures) == 2 and captures[1].patch_size == 2

    # A new image: one pass of each model, twice what a new image costs on a one-model page.
    app.selectbox(key="image_picker").set_value("shapes:1").run()
    assert len(captures) == 4
    # Widgets cost no forward pass.
    widget(app.slider, "A's layer").set_value(1).run()
    assert "in layer 1 (of 4)" in title_matching(app, "^B: attention")
    widget(app.radio, "Query").set_value("image point").run()
    widget(app.slider, "Point across (% of the width)").set_value(10.0).run()
    widget(app.slider, "Point down (% of the height)").set_value(90.0).run()
    assert not app.exception and errors(app) == []
    # 10% across, 90% down: patch (7, 0) of A's 8x8 grid and (14, 1) of B's 16x16 one.
    assert "patch under the point (row 7, col 0)" in title_matching(app, "^A: rollout")
    assert "patch under the point (row 14, col 1)" in title_matching(app, "^B: rollout")
    assert title_matching(app, "^A: its 8x8 grid") and title_matching(app, "^B: its 16x16 grid")
    app.switch_page("views/attention.py").run()
    app.switch_page(PAGE).run()
    assert len(captures) == 4 and not app.exception
    # B at A's own patch size is A itself: said so, nothing drawn twice.
    widget(app.select_slider, "B's patch size").set_value(4).run()
    assert any("Model B is model A itself" in info.value for info in app.info)
    assert figure_titles(app) == [] and len(captures) == 4


def test_a_checkpoint_of_another_depth_and_no_head_beside_the_default(tmp_path, captures):
    other = tmp_path / "shallow.safetensors"
    vx.save_model(tiny_model(depth=2, patch_size=8, num_classes=0, class_names=None, embed_dim=16), other)
    app = open_app("views/pipeline.py")
    app.file_uploader(key="checkpoint_upload").set_value(
        (other.name, other.read_bytes(), "application/octet-stream")
    ).run()
    uploaded = app.session_state["model_key"]
    assert uploaded.startswith("file:")
    app.selectbox(key="model_picker").set_value("default").run()  # A: the 4-layer default again
    app.switch_page(PAGE).run()
    before = len(captures)
    app.selectbox(key="compare_model").set_value(uploaded).run()
    assert not app.exception and errors(app) == []
    assert len(captures) == before  # B's capture is the one it got as the sidebar's model
    assert ("base", uploaded) in models.shared_models()  # B lives in the byte-bounded model cache
    assert any("A has 4 layers and B 2" in markdown.value for markdown in app.markdown)
    titles = figure_titles(app)
    assert all(title.strip() for title in titles) and len(titles) == 7  # B has no top-5
    assert any("B's prediction needs class scores" in info.value for info in app.info)
    assert "in layer 1 (of 2)" in title_matching(app, "^B: attention")
    widget(app.slider, "A's layer").set_value(1).run()  # 1 * 1 / 3 = 0.33
    assert "in layer 0 (of 2)" in title_matching(app, "^B: attention")
    assert "after layer 0 (of 2)" in title_matching(app, "^B: token PCA")
    widget(app.slider, "A's layer").set_value(2).run()  # 2 * 1 / 3 = 0.67
    assert "in layer 1 (of 2)" in title_matching(app, "^B: attention")
    assert len(captures) == before and not app.exception
    app.selectbox(key="image_picker").set_value("shapes:2").run()
    assert len(captures) == before + 2 and {config.depth for config in captures[-2:]} == {4, 2}


def test_a_catalogue_model_waits_to_be_asked_and_a_failed_download_keeps_a(monkeypatch, tmp_path):
    from vit_explorer.weights import catalogue

    monkeypatch.setenv(catalogue.CACHE_VARIABLE, str(tmp_path / "cache"))
    monkeypatch.setenv(catalogue.HUB_URL_VARIABLE, "http://127.0.0.1:9")  # discard port: refused
    app = open_app(PAGE)
    app.selectbox(key="compare_model").set_value("pretrained:dino_vits16").run()
    assert not app.exception and errors(app) == []  # nothing fetched unasked
    assert any("downloads once (87 MB)" in info.value and "(about 87 MB in memory once loaded)" in info.value for info in app.info)
    download = next(button for button in app.button if button.label.startswith("Download DINO"))
    download.click().run()
    assert not app.exception
    (error,) = errors(app)
    assert error.startswith("Could not load model B, model A stays as it is: could not download DINO ViT-S/16")
    assert "\n" not in error
    assert app.session_state["model_key"] == "default"


def b_figures(app) -> dict[str, list[dict]]:
    return {title: traces for title, traces in charts(app).items() if title.startswith("B:")}


def test_a_model_b_that_is_not_quick_is_a_job_that_draws_what_the_server_would(captures, monkeypatch):
    inline = b_figures(open_app(PAGE))  # B at patch 2, computed in the server
    assert len(inline) == 4
    memo.shared_results().clear()
    monkeypatch.setattr(costs, "QUICK_COST", 1.0)  # B's pass as a real-size model's would be
    captures.clear()
    app = open_app(PAGE)
    assert errors(app) == [] and b_figures(app) == {}
    assert any("runs when you ask" in markdown.value for markdown in app.markdown)
    widget(app.button, "Run model B").click().run()
    run_until(app, b_figures)
    assert errors(app) == [] and not app.get("progress")
    assert [config.patch_size for config in captures] == [4]  # A's only: B's ran beside the server
    assert_same_charts(b_figures(app), inline)


def test_a_dinov2_beside_a_dinov3_on_the_same_photo(tmp_path, monkeypatch):
    """The comparison people bring in 2026: learned positions and patch 14 (DINOv2 with registers)
    beside rotary positions and patch 16 (DINOv3), headless both, on one uploaded photo."""
    shared = dict(num_classes=0, class_names=None, reg_tokens=4, init_values=1e-5, embed_dim=32, depth=2, num_heads=2)
    dinov2 = tmp_path / "dinov2.safetensors"
    vx.save_model(tiny_model(image_size=56, patch_size=14, no_embed_class=True, **shared), dinov2)
    dinov3 = tmp_path / "dinov3.safetensors"
    vx.save_model(tiny_model(image_size=64, patch_size=16, rope_type="dinov3", abs_pos_embed=False,
                             qkv_bias=False, **shared), dinov3)
    monkeypatch.setenv("VIT_EXPLORER_DEFAULT_MODEL", str(dinov3))
    app = open_app("views/pipeline.py")
    app.file_uploader(key="checkpoint_upload").set_value(
        (dinov2.name, dinov2.read_bytes(), "application/octet-stream")
    ).run()
    dinov2_key = app.session_state["model_key"]
    app.selectbox(key="model_picker").set_value("default").run()  # A: the DINOv3
    photo = (vx.resources.app_root() / "assets" / "samples" / "chelsea.png").read_bytes()
    app.file_uploader(key="image_upload").set_value(("chelsea.png", photo, "image/png")).run()
    app.switch_page(PAGE).run()
    app.selectbox(key="compare_model").set_value(dinov2_key).run()
    assert not app.exception and errors(app) == []
    titles = figure_titles(app)
    assert title_matching(app, "^A: attention") and title_matching(app, "^B: attention")
    assert all(title.strip() for title in titles)
    widget(app.radio, "Query").set_value("image point").run()  # one image point on both grids: patches of 16 and 14 px
    assert not app.exception and errors(app) == []
