"""The publisher's input in the app: a model whose publisher crops reads the sidebar's picture
cropped (the crop drawn on the picture), the whole picture one choice away, for that session only;
the pages that draw on the picture draw on what the model read."""
import numpy as np
import pytest

import vit_explorer as vx
from vit_explorer.analysis import display_image
from vit_explorer.app import images, memo, models
from apptest import PHOTO, errors, open_app, tiny_default, tiny_model, widget  # noqa: F401 (tiny_default: autouse)

CROPPED = dict(resize_mode="shortest", crop_pct=0.875)


@pytest.fixture
def cropping_default(tiny_default):
    """The app's default model as a publisher that crops (timm's crop_pct 0.875)."""
    vx.save_model(tiny_model(**CROPPED), tiny_default)
    return tiny_default


def _shown(app, key: tuple) -> np.ndarray:
    shown = memo.shared_results().get(key)
    assert shown is not None, key
    return shown


def test_the_sidebars_choice_switches_between_the_crop_and_the_whole_picture(cropping_default):
    app = open_app("views/attention.py")
    app.selectbox(key="image_picker").set_value("photo:chelsea.png").run()
    assert not app.exception and errors(app) == []
    choice = widget(app.sidebar.radio, "Input")
    assert choice.value is False
    captions = " ".join(caption.value for caption in app.sidebar.caption)
    assert "The model reads the picture resized to 54x36 px, its centre 32x32 px kept" in captions
    config = models.base_model(models.DEFAULT_MODEL).config
    picture = vx.load_image(PHOTO)
    key = (models.DEFAULT_MODEL, 4, (32, 32), "photo:chelsea.png", "display image")
    cropped = display_image(vx.preprocess(picture, config), config)
    np.testing.assert_array_equal(_shown(app, key), cropped)

    choice.set_value(True).run()
    assert not app.exception and errors(app) == []
    assert "The model reads the whole picture squeezed to 32x32 px" in " ".join(c.value for c in app.sidebar.caption)
    whole = display_image(vx.preprocess(picture, config, whole=True), config)
    np.testing.assert_array_equal(_shown(app, ((models.DEFAULT_MODEL, "whole picture"), *key[1:])), whole)
    assert np.abs(whole.astype(int) - cropped).max() > 50  # another picture indeed
    for page in ("views/patches.py", "views/pipeline.py", "views/lesson.py", "views/compare.py", "views/images.py", "views/attention.py"):
        app.switch_page(page).run()
        assert not app.exception, (page, app.exception)
        assert widget(app.sidebar.radio, "Input").value is True  # kept across pages
        if page == "views/images.py":  # Several images reads every picture whole too
            keys = tuple(app.multiselect(key="image_set").value)
            read = _shown(app, ((models.DEFAULT_MODEL, "whole picture"), 4, (32, 32), "image set", keys, "model input"))
            index = keys.index("photo:chelsea.png")
            np.testing.assert_array_equal(display_image(read[index:index + 1], config), whole)

    other = open_app("views/attention.py")  # another session: the publisher's crop
    assert widget(other.sidebar.radio, "Input").value is False
    other.selectbox(key="image_picker").set_value("photo:chelsea.png").run()
    other.switch_page("views/images.py").run()
    assert not other.exception
    keys = tuple(other.multiselect(key="image_set").value)
    read = _shown(other, (models.DEFAULT_MODEL, 4, (32, 32), "image set", keys, "model input"))
    index = keys.index("photo:chelsea.png")
    np.testing.assert_array_equal(display_image(read[index:index + 1], config), cropped)


def test_a_model_that_reads_the_whole_picture_offers_no_choice():
    app = open_app()
    assert "Input" not in [radio.label for radio in app.sidebar.radio]
    assert any("The model reads the whole picture squeezed" in caption.value for caption in app.sidebar.caption)


def test_the_crop_is_drawn_on_the_sidebars_picture():
    from PIL import Image
    import io

    picture = vx.load_image(PHOTO)
    config = tiny_model(**CROPPED).config
    from vit_explorer.data.transforms import visible_box

    drawn = np.asarray(Image.open(io.BytesIO(images.sidebar_image("photo:chelsea.png", picture, visible_box(picture.size, config)))))
    plain = np.asarray(Image.open(io.BytesIO(images.sidebar_image("photo:chelsea.png", picture))))
    width = drawn.shape[1]
    # The sides left out are dimmed; the centre is the picture.
    assert drawn[:, : width // 10].mean() < 0.5 * plain[:, : width // 10].mean()
    assert abs(drawn[40:-40, width // 2 - 20: width // 2 + 20].mean() - plain[40:-40, width // 2 - 20: width // 2 + 20].mean()) < 3


def test_a_job_on_the_whole_picture_is_another_job_and_carries_that_input(cropping_default):
    from dataclasses import replace

    from vit_explorer.app import jobs
    from vit_explorer.app.selection import Selection

    model = models.base_model(models.DEFAULT_MODEL)
    cropped = Selection(models.DEFAULT_MODEL, 4, "photo:chelsea.png", model, vx.load_image(PHOTO))
    whole = replace(cropped, whole=True)
    assert jobs.job_spec(cropped, "rollout").key != jobs.job_spec(whole, "rollout").key
    assert jobs.job_spec(whole, "rollout").model["whole picture"] is True
    np.testing.assert_array_equal(whole.model_input(), vx.preprocess(whole.image, model.config, whole=True))
    assert not np.array_equal(cropped.model_input(), whole.model_input())


def test_segment_by_words_labels_the_whole_picture_of_a_cropping_clip(tmp_path, monkeypatch):
    """open_clip's default crops the centre; the mask is still every pixel's of the whole picture."""
    import io

    import torch
    from PIL import Image
    from streamlit.delta_generator import DeltaGenerator

    from vit_explorer.text import load_image_text_model, maps, zero_shot
    from vit_explorer.text.segmentation import Protocol, label
    from apptest import open_words_app
    from textmodels import SMALL_CLIP, open_clip_folder

    offered = {}
    original = DeltaGenerator.download_button

    def download_button(self, label, data, file_name=None, *args, **kwargs):
        offered[label] = data
        return original(self, label, data, file_name, *args, **kwargs)

    monkeypatch.setattr(DeltaGenerator, "download_button", download_button)
    open_clip_folder(tmp_path / "clip", SMALL_CLIP)
    app = open_words_app(tmp_path / "clip", "views/attention.py")
    app.selectbox(key="image_picker").set_value("photo:chelsea.png").run()
    assert not app.exception and widget(app.sidebar.radio, "Input").value is False
    with Image.open(io.BytesIO(offered["Download the mask"]())) as png:
        mask = np.asarray(png)
    model = load_image_text_model(tmp_path / "clip")
    picture = vx.load_image(PHOTO)
    captured = vx.capture(model.image, vx.preprocess(picture, model.image.config, whole=True), layers=())
    texts = model.embed_texts(zero_shot.label_prompts(["a cat", "a dog", "a rocket"]))
    cosines = maps.similarity_maps(maps.patch_embeddings(model, captured), texts, captured.grid_size)
    expected = label(cosines, torch.empty((1, 0, picture.height, picture.width)), [1, 2, 3], Protocol(slide=False))
    assert mask.shape == (300, 451) and np.array_equal(mask, expected)
    # A tiny random CLIP gives every pixel one label, crop or whole: the segmentation's key says which it read.
    from vit_explorer.app import word_maps, words

    read = ((app.session_state["model_key"], "whole picture"), 8, (32, 32), "photo:chelsea.png", "words segmentation",
            words.labels_id(("a cat", "a dog", "a rocket")), word_maps.DEFAULT_METHOD, None, 0.0, False)
    assert memo.shared_results().get(read) is not None
