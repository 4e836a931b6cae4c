"""Several images read together: the joint PCA, correspondences, the norm outlier rule, the page."""
import json

import pytest
import torch
from streamlit.testing.v1 import AppTest

import vit_explorer as vx
from vit_explorer import figures
from vit_explorer.analysis import image_set as sets
from vit_explorer.model import vit as model_module
from vit_explorer.app import costs, memo, models, selection
from vit_explorer.model.capture import layer_internals
from apptest import APP, PHOTO, errors, figure_titles, tiny_default, tiny_model, widget  # noqa: F401 (the fixture)
from apptest import assert_same_charts, charts, run_until

GRID = (3, 4)


def random_features(batch: int, dim: int = 16, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, GRID[0] * GRID[1], dim, generator=torch.Generator().manual_seed(seed))


def test_the_joint_pca_is_fitted_over_all_images_so_identical_images_get_identical_colours():
    one = random_features(1)
    other = random_features(1, seed=1)
    result = sets.joint_pca_foreground(torch.cat([one, other, one]), GRID, threshold=-0.5)
    torch.testing.assert_close(result.colours[0], result.colours[2])
    torch.testing.assert_close(result.first_component[0], result.first_component[2])
    # Fitted jointly: the first image's own PCA would give it other numbers.
    alone = sets.joint_pca_foreground(one, GRID, threshold=-0.5)
    assert not torch.allclose(alone.first_component, result.first_component[:1])


def test_the_threshold_splits_by_the_first_components_sign_and_the_switch_takes_the_other_side():
    # Two clusters far apart along one direction: the first component is that direction.
    features = random_features(2) * 0.01
    features[0, :, 0] += 5.0
    features[1, :, 0] -= 5.0
    result = sets.joint_pca_foreground(features, GRID, threshold=0.0)
    component = result.first_component.flatten(1)
    assert (component[0] > 0).all() == (component[1] < 0).all()  # the two clusters on either side
    torch.testing.assert_close(result.foreground, result.first_component > 0)
    assert result.foreground.sum() == GRID[0] * GRID[1]  # exactly one image's patches
    assert result.explained > 0.99
    flipped = sets.joint_pca_foreground(features, GRID, threshold=0.0, flip=True)
    torch.testing.assert_close(flipped.foreground, ~result.foreground)
    # Background black; foreground colours fill [0, 1] on each channel.
    assert (result.colours[~result.foreground] == 0).all()
    foreground_colours = result.colours[result.foreground]
    torch.testing.assert_close(foreground_colours.amin(0), torch.zeros(3))
    torch.testing.assert_close(foreground_colours.amax(0), torch.ones(3))
    # In standard deviations: a threshold above every patch leaves no foreground.
    assert not sets.joint_pca_foreground(features, GRID, threshold=float(component.max()) + 0.1).foreground.any()


def test_an_image_compared_with_itself_finds_every_patch_itself():
    features = random_features(1).repeat(2, 1, 1)  # the same image twice
    patches = GRID[0] * GRID[1]
    torch.testing.assert_close(sets.cosine_matrix(features[0], features[1]).diagonal(), torch.ones(patches))
    for patch in range(patches):
        cosines, best = sets.correspondence(features, 0, patch)
        assert best.tolist() == [patch, patch]
        assert cosines[1, patch] == pytest.approx(1.0, abs=1e-6)
        assert cosines.max() <= 1.0 + 1e-6


def test_correspondence_finds_a_patch_moved_to_another_place():
    features = random_features(2)
    features[1, 7] = 3.0 * features[0, 2]  # the same direction, another norm and place
    _, best = sets.correspondence(features, 0, 2)
    assert best.tolist() == [2, 7]


def test_the_keys_facet_is_the_layers_keys_of_the_patches_heads_side_by_side():
    model = tiny_model(reg_tokens=2).eval()
    x = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    cap = vx.capture(model, x)
    layer, prefix, dim = 1, model.config.num_prefix_tokens, model.config.embed_dim
    keys = sets.patch_keys(vx.capture(model, x, internals=layer).internals, prefix)
    block = model.blocks[layer]
    with torch.no_grad():  # timm's qkv layout: q, k, v one after the other, heads contiguous in each
        by_hand = block.attn.qkv(block.norm1(cap.tokens[:, layer]))[..., dim : 2 * dim]
    torch.testing.assert_close(keys, by_hand[:, prefix:], rtol=1e-4, atol=1e-5)
    # The page's way: the layer's norm and qkv projection on the captured tokens, the same numbers
    # as that block run again whole.
    page = sets.layer_keys(model, cap.tokens[:, layer], layer)
    assert torch.equal(page, sets.patch_keys(layer_internals(model, cap.tokens[:, layer], layer), prefix))
    torch.testing.assert_close(page, keys)


def test_the_norm_outlier_rule_is_median_plus_k_mads():
    norms = torch.tensor([[10.0, 11.0, 9.0, 10.0, 12.0, 8.0, 10.0, 50.0]])
    features = torch.zeros(1, 8, 2)
    features[..., 0] = norms  # each token's norm is its first entry
    result = sets.norm_outliers(features, k=5)
    assert result.median == pytest.approx(10.0) and result.mad == pytest.approx(1.0)
    assert result.threshold == pytest.approx(15.0)
    assert result.outliers[0].tolist() == [False] * 7 + [True]
    assert not sets.norm_outliers(torch.ones(2, 8, 3), k=1).outliers.any()  # all equal: none


# --- the page ----------------------------------------------------------------------------------

PAGE = "views/images.py"
THREE = ["shapes:0", "shapes:4", "photo:chelsea.png"]


@pytest.fixture
def forwards(monkeypatch):
    """Forward passes of images, counted per block: a batch of B through D blocks is B passes,
    one block run again on B images (the keys of a layer) is B / D."""
    counted = []
    original = model_module.Block.forward

    def counting(self, x, *args, **kwargs):
        counted.append(x.shape[0] / len(models.base_model(models.DEFAULT_MODEL).blocks))
        return original(self, x, *args, **kwargs)

    monkeypatch.setattr(model_module.Block, "forward", counting)
    return counted


def open_page() -> AppTest:
    app = AppTest.from_file(APP, default_timeout=60).run()
    app.switch_page(PAGE).run()
    assert not app.exception, app.exception
    return app


def choose(app: AppTest, keys: list[str]) -> AppTest:
    app.multiselect(key="image_set").set_value(keys).run()
    assert not app.exception, app.exception
    return app


def test_the_page_renders_two_shapes_and_a_photo_with_every_figure_titled(forwards):
    app = open_page()
    assert app.title[0].value == "Several images"
    forwards.clear()
    choose(app, THREE)
    assert errors(app) == []
    titles = figure_titles(app)
    assert len(titles) == 5 and all(title.strip() for title in titles)  # DINOv2's PCA, DINOv3's, picker, correspondence, norms
    assert any(title.startswith("Joint PCA of 3 images' last-layer patch tokens") for title in titles)
    assert any(title.startswith("Cosine of layer 3's output tokens with patch") for title in titles)
    assert any("= median" in title for title in titles)
    # The page opened on shapes 4, 0 and 1, each read once and kept: only the photo is new.
    assert sum(forwards) == pytest.approx(1)
    assert any("median" in caption.value and "outliers" in caption.value for caption in app.caption)
    # Every control of the page says what it does.
    for control in [*app.slider, *app.selectbox, *app.multiselect, *app.toggle, *app.radio]:
        if control.key and not control.key.endswith("picker"):  # the sidebar's own
            assert control.help, control.label


SEVEN = [f"shapes:{index}" for index in range(6)] + ["photo:chelsea.png"]


@pytest.mark.parametrize("keys", [["shapes:0"], [], SEVEN])
def test_too_few_or_too_many_images_is_one_sentence(keys):
    app = choose(open_page(), keys)
    assert not app.exception
    assert [info.value for info in app.info] == [f"Pick between 2 and 6 images ({len(keys)} chosen)."]
    assert figure_titles(app) == []


def test_moving_widgets_costs_no_forward_pass_and_keys_no_block(forwards, monkeypatch):
    app = choose(open_page(), THREE)
    forwards.clear()
    # The first component is fitted once per image set: a threshold only splits it anew.
    fitted = []
    monkeypatch.setattr(selection, "first_component", lambda features: fitted.append(1) or sets.first_component(features))
    widget(app.slider, "Foreground threshold (standard deviations)").set_value(0.5).run()
    app.toggle(key="set_flip").set_value(True).run()
    assert any("foreground where the sign-switched 1st component > +0.5 sd" in title for title in figure_titles(app))
    widget(app.slider, "k (MADs above the median)").set_value(3.0).run()
    widget(app.selectbox, "Source image").set_value(2).run()
    widget(app.selectbox, "Patch").set_value(5).run()
    widget(app.slider, "Layer").set_value(1).run()
    assert not app.exception and sum(forwards) == 0
    title = next(t for t in figure_titles(app) if t.startswith("Cosine"))
    assert "patch 5 (row 0, col 5) of 3. chelsea" in title
    assert fitted == []
    projections = []
    qkv = model_module.Attention._qkv
    monkeypatch.setattr(model_module.Attention, "_qkv", lambda self, x: projections.append(x.shape[0]) or qkv(self, x))
    app.radio(key="set_facet").set_value("keys").run()
    assert not app.exception
    # Layer 1's norm and qkv projection on the 3 images' captured tokens: no block runs again.
    assert sum(forwards) == 0 and projections == [3]
    assert any(t.startswith("Cosine of layer 1's keys") for t in figure_titles(app))
    widget(app.slider, "Layer").set_value(1).run()
    app.switch_page("views/pipeline.py").run()
    app.switch_page(PAGE).run()
    # Pipeline's capture was made when the app opened; coming back recomputes nothing.
    assert not app.exception and sum(forwards) == 0 and projections == [3] and fitted == []


def test_a_picture_added_to_the_set_runs_that_one_alone(forwards):
    app = choose(open_page(), THREE)
    forwards.clear()
    choose(app, [*THREE, "shapes:2"])
    assert sum(forwards) == pytest.approx(1)
    assert any(title.startswith("Joint PCA of 4 images' last-layer patch tokens") for title in figure_titles(app))
    choose(app, THREE[1:])  # fewer pictures: nothing runs again
    assert sum(forwards) == pytest.approx(1) and errors(app) == []


def test_the_sidebars_image_is_read_from_its_capture_and_the_others_run_in_one_batch(monkeypatch):
    batches = []
    original = model_module.Block.forward
    monkeypatch.setattr(model_module.Block, "forward", lambda self, x, *args: batches.append(x.shape[0]) or original(self, x, *args))
    app = AppTest.from_file(APP, default_timeout=60).run()  # Pipeline captures the sidebar's shapes 4
    depth = len(models.base_model(models.DEFAULT_MODEL).blocks)
    assert batches == [1] * depth
    batches.clear()
    app.switch_page(PAGE).run()
    assert not app.exception and batches == [2] * depth  # shapes 0 and 1 together; shapes 4 not again
    # Nothing captured yet (the page opened first): the sidebar's image gets the capture every
    # page shares, the others their one batch.
    memo.shared_results().clear()
    batches.clear()
    app.run()
    assert not app.exception and batches == [1] * depth + [2] * depth
    batches.clear()
    app.switch_page("views/pipeline.py").run()
    assert not app.exception and batches == []


def test_images_whose_pass_is_not_quick_are_read_by_a_job_that_draws_what_the_server_would(forwards, monkeypatch):
    inline = charts(choose(open_page(), THREE))
    memo.shared_results().clear()
    monkeypatch.setattr(costs, "QUICK_COST", 1.0)  # each picture's pass as a real-size model's would be
    monkeypatch.setattr(costs, "HEAVY_FORWARDS", 1)  # and two of them more than a few
    app = choose(open_page(), THREE)
    assert errors(app) == [] and charts(app) == {}
    assert any("Pictures no page has read with this model yet: 2" in markdown.value for markdown in app.markdown)
    forwards.clear()
    widget(app.button, "Read the pictures").click().run()
    run_until(app, charts)
    assert errors(app) == [] and not app.get("progress")
    assert sum(forwards) == 0  # the two in one batch beside the server; the sidebar's was captured
    assert_same_charts(charts(app), inline)


def test_a_few_pictures_are_read_in_the_server_even_on_a_real_size_model(forwards, monkeypatch):
    monkeypatch.setattr(costs, "QUICK_COST", 1.0)  # each picture's pass as a real-size model's would be
    app = choose(open_page(), THREE)  # two pictures no page read: a page's own capture or two, not a job
    assert errors(app) == [] and len(charts(app)) > 0
    assert not [button for button in app.button if button.label == "Read the pictures"]


def test_the_images_batch_is_shared_by_every_session(forwards):
    choose(open_page(), THREE)
    forwards.clear()
    choose(open_page(), THREE)  # another session, the same model and images
    assert sum(forwards) == 0


def test_the_figures_reject_maps_that_do_not_fit_the_images():
    image = torch.zeros(8, 8, 3, dtype=torch.uint8).numpy()
    with pytest.raises(ValueError):
        figures.foreground_pca_grid([image, image], torch.zeros(3, 2, 2), torch.zeros(3, 2, 2, 3), 0.0, ["a", "b"], 0.5)
    layout = json.loads(figures.correspondence_grid(
        [image, image], torch.ones(2, 2, 2), [3, 1], 0, 3, ["a", "b"], "tokens"
    ).to_json())["layout"]
    assert len(layout["shapes"]) == 2  # the chosen patch and the other image's best match


@pytest.mark.parametrize("changes", [
    dict(reg_tokens=2),  # the prefix holds registers: they are not patches
    dict(num_classes=0, class_names=None, class_token=False, global_pool="map"),  # SigLIP: no class token
    dict(dist_token=True),  # DeiT distilled
])
def test_the_page_reads_every_family_and_an_uploaded_image(tmp_path, changes):
    path = tmp_path / "family.safetensors"
    vx.save_model(tiny_model(**changes), path)
    app = AppTest.from_file(APP, default_timeout=60).run()
    app.file_uploader(key="checkpoint_upload").set_value((path.name, path.read_bytes(), "application/octet-stream")).run()
    app.file_uploader(key="image_upload").set_value(("cat.png", PHOTO.read_bytes(), "image/png")).run()
    app.switch_page(PAGE).run()
    assert not app.exception and errors(app) == []
    chosen = app.multiselect(key="image_set").value
    assert len(chosen) == 3 and chosen[0].startswith("upload:")  # the sidebar's upload and two more
    app.radio(key="set_facet").set_value("keys").run()
    assert not app.exception and errors(app) == []
    titles = figure_titles(app)
    assert len(titles) == 5 and any(title.startswith("Cosine of layer 3's keys with patch 36 (row 4, col 4) of 1. cat.png") for title in titles)
