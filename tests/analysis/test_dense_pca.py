"""DINOv3's dense-feature PCA (vit_explorer.analysis.dense_pca): the notebook's recipe on planted tokens,
the input size, the figure, and the Patches and Several images pages with AppTest."""
import json

import numpy as np
import pytest
import torch
from PIL import Image
from streamlit.testing.v1 import AppTest

import vit_explorer as vx
from vit_explorer.analysis import dense_pca as dense
from vit_explorer import figures
from vit_explorer.app import costs
from vit_explorer.analysis import AnalysisError
from vit_explorer.analysis.image_set import last_layer_features
from apptest import APP, errors, figure_titles, tiny_default, tiny_model  # noqa: F401 (the fixture)
from apptest import counting_forwards


# --- the input size ----------------------------------------------------------------------------


@pytest.mark.parametrize("image_size, patch, expected", [
    ((1024, 768), 16, (768, 1024)),  # 4:3, already whole patches
    ((768, 1024), 16, (768, 576)),  # portrait: 768 px high, narrower
    ((451, 300), 16, (768, 1152)),  # chelsea: 72.2 patches wide, rounded down as int() does
    ((500, 500), 14, (756, 756)),  # 768 px is 54.9 patches of 14: whole patches only
    ((10, 4000), 16, (768, 16)),  # a sliver still gets one column
])
def test_the_input_is_768_px_high_in_whole_patches_at_the_pictures_aspect_ratio(image_size, patch, expected):
    height, width = dense.aspect_size(image_size, patch)
    assert (height, width) == expected
    assert height % patch == 0 and width % patch == 0
    if width > patch:  # rounded down by less than a patch: the aspect ratio is kept
        assert 0 <= image_size[0] / image_size[1] * height - width < patch


def test_the_patch_limit_takes_a_vit_s16_at_768_px_but_not_patch_4():
    assert dense.within_limit(dense.aspect_size((1920, 1080), 16), 16)  # 48 x 85
    assert not dense.within_limit(dense.aspect_size((32, 32), 4), 4)  # 192 x 192


# --- the recipe ----------------------------------------------------------------------------------


def planted(grid=(12, 16), dim=48, seed=0):
    """Features with a 6 x 8 object in the middle made of four parts (each patch one of four
    directions, plus noise: their means span three dimensions) on a background of its own; the
    object mask and each object patch's part."""
    generator = torch.Generator().manual_seed(seed)
    grid_h, grid_w = grid
    features = torch.randn(grid_h * grid_w, dim, generator=generator) * 0.1
    mask = torch.zeros(grid, dtype=torch.bool)
    mask[3:9, 4:12] = True
    parts = torch.arange(int(mask.sum())) % 4
    directions = torch.randn(4, dim, generator=generator) * 3
    features[mask.reshape(-1)] += directions[parts] + 6 * torch.randn(dim, generator=generator)
    return features, mask, parts


def test_the_colours_separate_the_four_planted_parts_and_the_background_is_black():
    features, mask, parts = planted()
    result = dense.dense_pca([features], [mask.shape], [mask])
    colours = result.colours[0]
    assert colours.shape == (*mask.shape, 3) and torch.equal(result.foreground[0], mask)
    assert torch.all(colours[~mask] == 0)
    inside = colours[mask]  # (F, 3)
    assert torch.all((inside > 0) & (inside < 1))  # a sigmoid's range
    means = torch.stack([inside[parts == part].mean(dim=0) for part in range(4)])
    spread = max(float(inside[parts == part].std(dim=0).max()) for part in range(4))
    gaps = torch.cdist(means, means)[~torch.eye(4, dtype=torch.bool)]
    assert float(gaps.min()) > 10 * spread


def test_the_components_are_whitened_over_the_foreground_and_coloured_sigmoid_2x():
    features, mask, _ = planted()
    colours = dense.dense_pca([features], [mask.shape], [mask]).colours[0][mask].double()
    components = torch.logit(colours) / dense.SCALE  # undo sigmoid(2 x)
    assert dense.SCALE == 2.0
    assert torch.allclose(components.mean(dim=0), torch.zeros(3, dtype=torch.float64), atol=1e-4)
    assert torch.allclose(components.std(dim=0), torch.ones(3, dtype=torch.float64), atol=1e-3)  # ddof 1, as sklearn


def test_it_is_scikit_learns_whitened_pca_with_svd_flips_signs():
    """PCA(n_components=3, whiten=True).fit(foreground).transform(all), written out with a full
    SVD: (x - mean) @ V.T / (S / sqrt(F - 1)), each row of V signed so its largest entry is positive."""
    features, mask, _ = planted(seed=3)
    fitted = features[mask.reshape(-1)].double()
    mean = fitted.mean(dim=0)
    _, singular, vh = torch.linalg.svd(fitted - mean, full_matrices=False)
    axes = vh[:3] * torch.sign(vh[:3].gather(1, vh[:3].abs().argmax(dim=1, keepdim=True)))
    expected = torch.sigmoid(2 * ((features.double() - mean) @ axes.T) / (singular[:3] / (fitted.shape[0] - 1) ** 0.5))
    expected = expected * mask.reshape(-1, 1)
    colours = dense.dense_pca([features], [mask.shape], [mask]).colours[0].reshape(-1, 3)
    assert torch.allclose(colours.double(), expected, atol=1e-4)
    again = dense.dense_pca([features.clone()], [mask.shape], [mask.clone()]).colours[0].reshape(-1, 3)
    assert torch.equal(colours, again)  # deterministic: the randomized SVD starts from a fixed seed


def test_the_foreground_is_the_first_components_side_away_from_the_border_median_filtered():
    features, mask, _ = planted()
    found = dense.foreground_masks([features], [mask.shape])[0]
    # The 6 x 8 object less its four corners: a 3 x 3 median takes a corner's 4 object patches of 9 as background.
    eroded = mask.clone()
    for row, col in [(3, 4), (3, 11), (8, 4), (8, 11)]:
        eroded[row, col] = False
    assert torch.equal(found, eroded)
    assert torch.equal(dense.foreground_masks([-features], [mask.shape])[0], found)  # whatever the component's sign
    switched = dense.foreground_masks([features], [mask.shape], flip=True)[0]
    # The background (less the picture's corners, filtered away as a corner is), and the object's corners.
    assert not (switched & eroded).any() and torch.equal(switched[~eroded], ~_corners(mask.shape)[~eroded])


def _corners(grid) -> torch.Tensor:
    corners = torch.zeros(grid, dtype=torch.bool)
    corners[[0, 0, -1, -1], [0, -1, 0, -1]] = True
    return corners


def test_a_set_is_fitted_jointly_over_images_of_different_grids():
    features, mask, _ = planted()
    other, other_mask, _ = planted(grid=(8, 16), seed=1)
    other_mask[:] = False
    other_mask[2:6, 4:12] = True
    grids = [mask.shape, other_mask.shape]
    together = dense.dense_pca([features, features], [mask.shape, mask.shape], [mask, mask]).colours
    assert torch.equal(together[0], together[1])  # one PCA: the same patch, the same colour in every image
    joint = dense.dense_pca([features, other], grids, [mask, other_mask])
    assert [tuple(colours.shape) for colours in joint.colours] == [(12, 16, 3), (8, 16, 3)]
    assert [tuple(masks.shape) for masks in dense.foreground_masks([features, other], grids)] == [(12, 16), (8, 16)]
    with pytest.raises(AnalysisError):
        dense.dense_pca([features, other], [mask.shape], [mask])
    with pytest.raises(AnalysisError):
        dense.dense_pca([features], [(8, 8)], [mask])


def test_no_foreground_is_all_black():
    features, mask, _ = planted()
    assert torch.all(dense.dense_pca([features], [mask.shape], [torch.zeros_like(mask)]).colours[0] == 0)


def test_the_features_are_the_last_layers_patch_tokens_after_the_final_norm_at_the_new_size():
    model = tiny_model(reg_tokens=2, patch_size=8).eval()
    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (30, 60, 3), dtype=np.uint8))
    size = dense.aspect_size(image.size, 8, side=32)
    assert size == (32, 64)
    resized = vx.resize_model(model, image_size=size)
    features, picture = dense.image_features(resized, image)
    assert features.shape == (4 * 8, 32) and picture.shape == (32, 64, 3)
    captured = vx.capture(resized, vx.preprocess(image, resized.config))
    assert torch.allclose(features, last_layer_features(resized, captured.tokens[:, -1])[0], atol=1e-5)


# --- the figure --------------------------------------------------------------------------------


def test_the_figure_shows_each_picture_beside_or_above_its_colours():
    photo = np.zeros((768, 1152, 3), dtype=np.uint8)
    colours = torch.rand(48, 72, 3)
    one = json.loads(figures.dense_pca_grid([photo], [colours], ["chelsea"], "at 768x1152 px").to_json())
    assert one["layout"]["title"]["text"] == "DINOv3-style PCA of the last layer's patch tokens at 768x1152 px"
    assert [trace["xaxis"] for trace in one["data"]] == ["x", "x2"]
    # The photo is sent at most PHOTO_SIDE wide; the colours cover it, one cell per patch.
    assert one["data"][1]["dx"] == pytest.approx(figures.image_set.PHOTO_SIDE / 72)
    several = json.loads(figures.dense_pca_grid(
        [photo, np.zeros((32, 32, 3), dtype=np.uint8)], [colours, torch.rand(2, 2, 3)], ["a", "b"], "of 2 images"
    ).to_json())
    assert len(several["data"]) == 4
    assert several["layout"]["height"] > one["layout"]["height"]  # two rows
    with pytest.raises(ValueError):
        figures.dense_pca_grid([photo, photo], [colours], ["a", "b"], "")


# --- the pages ---------------------------------------------------------------------------------

DENSE = "DINOv3-style PCA of the last layer's patch tokens"


def dense_title(app: AppTest) -> str | None:
    return next((title for title in figure_titles(app) if title.startswith(DENSE)), None)


def upload(app: AppTest, model: vx.ViT, tmp_path) -> AppTest:
    path = tmp_path / "patch16.safetensors"
    vx.save_model(model, path)
    app.file_uploader(key="checkpoint_upload").set_value((path.name, path.read_bytes(), "application/octet-stream")).run()
    assert errors(app) == [] and not app.exception
    return app


def test_the_patches_page_shows_it_at_the_input_from_its_capture_and_says_why_not_at_768(monkeypatch):
    app = AppTest.from_file(APP, default_timeout=60).run()
    app.switch_page("views/patches.py").run()
    assert not app.exception and errors(app) == []
    assert dense_title(app) == (
        "DINOv3-style PCA of the last layer's patch tokens at 32x32 px: 3 whitened components of the foreground, sigmoid(2x)"
    )
    calls = counting_forwards(monkeypatch)
    assert any("would read 36864 patches, more than the 4096" in caption.value for caption in app.caption)
    assert [radio.options for radio in app.radio if radio.key == "dense_resolution"] == [["the model's input (32x32 px)"]]
    app.toggle(key="dense_flip").set_value(True).run()
    assert not app.exception and dense_title(app) and calls == []


def test_the_patches_page_reads_the_picture_768_px_high_in_one_pass(monkeypatch, tmp_path):
    app = upload(AppTest.from_file(APP, default_timeout=60).run(), tiny_model(patch_size=16), tmp_path)
    app.selectbox(key="image_picker").set_value("photo:chelsea.png").run()
    app.switch_page("views/patches.py").run()
    calls = counting_forwards(monkeypatch)
    app.radio(key="dense_resolution").set_value("768").run()
    assert not app.exception and errors(app) == []
    assert calls == [(1, 1 + 48 * 72)]  # one pass of chelsea (451 x 300) at 768 x 1152, quick for this model
    assert dense_title(app).startswith(f"{DENSE} at 768x1152 px")
    assert any(caption.value.startswith("48 x 72 patches, ") for caption in app.caption)
    app.toggle(key="dense_flip").set_value(True).run()
    app.switch_page("views/pipeline.py").run()
    app.switch_page("views/patches.py").run()
    assert not app.exception and calls == [(1, 1 + 48 * 72)] and dense_title(app)


def test_a_real_size_model_reads_768_px_only_when_asked_and_says_the_cost(monkeypatch, tmp_path):
    monkeypatch.setattr(costs, "QUICK_COST", 0)
    app = upload(AppTest.from_file(APP, default_timeout=60).run(), tiny_model(patch_size=16), tmp_path)
    app.switch_page("views/patches.py").run()
    calls = counting_forwards(monkeypatch)
    app.radio(key="dense_resolution").set_value("768").run()
    assert not app.exception and calls == [] and dense_title(app) is None
    config = tiny_model(patch_size=16).config
    passes = costs.dense_forwards(config, [(768, 768)])
    ask = app.toggle(key="dense_high_on")
    assert ask.label == f"Read the picture at 768x768 px (about {passes:.0f} forward passes)" and ask.help
    ask.set_value(True).run()
    assert not app.exception and calls == [(1, 1 + 48 * 48)]
    assert dense_title(app).startswith(f"{DENSE} at 768x768 px")


def choose_set(app: AppTest, keys: list[str]) -> AppTest:
    app.switch_page("views/images.py").run()
    app.multiselect(key="image_set").set_value(keys).run()
    assert not app.exception and errors(app) == []
    return app


def test_several_images_share_one_pca_at_the_input_then_768_px_high(monkeypatch, tmp_path):
    app = upload(AppTest.from_file(APP, default_timeout=60).run(), tiny_model(patch_size=16), tmp_path)
    app = choose_set(app, ["shapes:0", "photo:chelsea.png"])
    assert dense_title(app).startswith(f"{DENSE} of 2 images at the model's input")
    calls = counting_forwards(monkeypatch)
    app.radio(key="dense_resolution").set_value("768").run()
    assert not app.exception and errors(app) == []
    assert sorted(calls) == [(1, 1 + 48 * 48), (1, 1 + 48 * 72)]  # each picture at its own aspect ratio
    assert dense_title(app).startswith(f"{DENSE} of 2 images 768 px high")
    assert any("patches are foreground" in caption.value and "of the 5760 patches" in caption.value for caption in app.caption)
    # The Patches page reads the same picture at the same size from the same pass.
    app.selectbox(key="image_picker").set_value("photo:chelsea.png").run()
    app.switch_page("views/patches.py").run()
    high = [tokens for _, tokens in calls if tokens > 1000]  # the rest: its capture and the patch-size comparison
    assert not app.exception and sorted(high) == [1 + 48 * 48, 1 + 48 * 72]
    assert dense_title(app).startswith(f"{DENSE} at 768x1152 px")
