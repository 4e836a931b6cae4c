"""Segment by words on the Attention page (app/word_segments.py): the mask drawn and offered for
download is every pixel's best prompt by text.segmentation's rule on the page's own maps, at the
picture's size; the threshold leaves the background, PAMR runs; the class list says the indices."""
import io

import numpy as np
import pytest
import torch
from PIL import Image
from streamlit.delta_generator import DeltaGenerator

import vit_explorer as vx
from vit_explorer.app import images
from vit_explorer.text import load_image_text_model, maps, zero_shot
from vit_explorer.text.segmentation import Protocol, label

from apptest import figure_titles, open_words_app, tiny_default, widget  # noqa: F401
from textmodels import SMALL_CLIP, open_clip_folder

PROMPTS = ("a cat", "a dog", "a rocket")  # the box's default


@pytest.fixture
def offered(monkeypatch) -> dict[str, tuple[object, str]]:
    """label -> (data, file name) of every download button the page draws."""
    drawn = {}
    original = DeltaGenerator.download_button

    def download_button(self, label, data, file_name=None, *args, **kwargs):
        drawn[label] = (data, file_name)
        return original(self, label, data, file_name, *args, **kwargs)

    monkeypatch.setattr(DeltaGenerator, "download_button", download_button)
    return drawn


def test_the_segment_view_draws_and_offers_the_mask_of_every_pixels_best_prompt(tmp_path, offered):
    open_clip_folder(tmp_path / "clip", SMALL_CLIP)
    app = open_words_app(tmp_path / "clip", "views/attention.py")
    assert "Each pixel labelled by the prompt it is most like" in figure_titles(app)
    data, name = offered["Download the mask"]
    assert name == "mask.png" and callable(data)  # encoded when clicked, not on every view
    with Image.open(io.BytesIO(data())) as png:
        mask, classes = np.asarray(png), png.text["classes"]
    assert classes == "0\tbackground\n1\ta cat\n2\ta dog\n3\ta rocket\n"
    assert offered["Download the class list"] == (classes, "classes.txt")
    # By hand: the folder's model read anew, its maps of the page's picture, the papers' rule.
    model = load_image_text_model(tmp_path / "clip")
    _, picture = images.resolve_image(app.session_state["image_key"], model.image.config.img_size)
    x = vx.preprocess(picture, model.image.config)
    captured = vx.capture(model.image, x, layers=())
    texts = model.embed_texts(zero_shot.label_prompts(list(PROMPTS)))
    cosines = maps.similarity_maps(maps.patch_embeddings(model, captured), texts, captured.grid_size)
    expected = label(cosines, torch.empty((1, 0, picture.height, picture.width)), [1, 2, 3], Protocol(slide=False))
    assert mask.shape == (picture.height, picture.width) and np.array_equal(mask, expected)
    # Every pixel below a probability of 1 is background; PAMR refines without a word of error.
    widget(app.slider, "Background below this probability").set_value(1.0).run()
    with Image.open(io.BytesIO(offered["Download the mask"][0]())) as png:
        assert not np.asarray(png).any()
    widget(app.slider, "Background below this probability").set_value(0.0)
    widget(app.toggle, "Refine along the picture's edges (PAMR)").set_value(True).run()
    assert not app.exception and not app.error
    with Image.open(io.BytesIO(offered["Download the mask"][0]())) as png:
        refined = np.asarray(png)
    assert refined.shape == mask.shape and set(np.unique(refined)) <= {1, 2, 3}



def test_a_large_pictures_mask_is_computed_smaller_and_downloaded_at_the_pictures_size():
    from vit_explorer.app import word_segments

    assert word_segments.segmented_size(300, 451) == (300, 451)
    height, width = word_segments.segmented_size(3000, 4000)
    assert height * width <= word_segments.MAX_PIXELS and abs(width / height - 4 / 3) < 0.01
    labels = np.array([[0, 1, 2], [2, 1, 0]], dtype=np.uint8)
    with Image.open(io.BytesIO(word_segments.mask_png(labels, (6, 4), ("a", "b")))) as png:
        assert png.mode == "L" and png.size == (6, 4) and png.text["classes"] == "0\tbackground\n1\ta\n2\tb\n"
        assert np.array_equal(np.asarray(png), labels.repeat(2, axis=0).repeat(2, axis=1))
