"""The Several images page's "Score a labelled set (mIoU)" (app/segment_scores.py): on a tiny
labelled folder inside the runs folder its table is text.segmentation.measure's (bench.segment's
loop) on the model read anew; a folder outside the allowed ones, and a bad one, are a sentence."""
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from bench import segment as bench
from vit_explorer.data.labelled_folder import read_classes, read_labelled_folder
from vit_explorer.text import load_image_text_model, segmentation
from vit_explorer.text.zero_shot import class_embeddings

from apptest import errors, open_words_app, tiny_default, widget  # noqa: F401
from textmodels import labelled_folder, siglip_folder

IMAGES = "views/images.py"
METHODS = ["maskclip", "naclip"]


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory) -> Path:
    return siglip_folder(tmp_path_factory.mktemp("set scores") / "siglip")


def score(app, folder: Path, methods=("maskclip",), threshold: float = 0.0):
    app.text_input(key="set_score_folder").set_value(str(folder))
    app.multiselect(key="set_score_methods").set_value(list(methods))
    app.number_input(key="set_score_threshold").set_value(threshold)
    app.selectbox(key="set_score_templates").set_value("plain")
    widget(app.button, "Score the set").click().run()
    assert not app.exception, app.exception


def test_the_pages_table_is_the_measure_of_the_folder(model_folder, tmp_path):
    root = tmp_path / "runs" / "labelled"  # the runs folder (apptest.tiny_default's)
    labelled_folder(root)
    app = open_words_app(model_folder, IMAGES)
    score(app, root, METHODS, threshold=0.1)
    assert errors(app) == []
    (frame,) = app.dataframe
    shown = frame.value.set_index("class")
    app.run()  # another run shows the kept scores without the button
    assert not app.exception and app.dataframe[0].value.equals(frame.value)

    model = load_image_text_model(model_folder)
    classes = read_classes(root / "classes.txt")
    folder = read_labelled_folder(root / "images", root / "masks", classes)
    texts = class_embeddings(model, classes.names, segmentation.templates("plain"))
    protocols = [segmentation.Protocol(method, threshold=0.1) for method in METHODS]
    results = segmentation.measure(model, folder, texts, protocols)
    assert [result.mean_iou for result in bench.measure(model, folder, texts, protocols, progress=False)] == \
        [result.mean_iou for result in results]
    for method, result in zip(METHODS, results):
        assert shown.loc["mIoU", method] == round(100 * result.mean_iou, 2)
        assert shown.loc["passes a picture", method] == 1.0  # a 32 px picture at a 32 px model: one window
        expected = [None if np.isnan(iou) else round(100 * float(iou), 1) for iou in result.ious]
        got = [None if np.isnan(value) else value for value in shown[method].iloc[:len(classes)]]
        assert got == expected
    (said,) = [caption.value for caption in app.caption if caption.value.startswith("IoU (%) of each class")]
    assert "over 3 pictures" in said and "probability < 0.1" in said and "naclip: shorter side resized to 32 px" in said


def test_a_folder_outside_the_allowed_ones_and_a_bad_one_are_sentences(model_folder, tmp_path):
    outside = tmp_path / "elsewhere"
    labelled_folder(outside)
    app = open_words_app(model_folder, IMAGES)
    score(app, outside)
    (said,) = errors(app)
    assert said.startswith("That set cannot be scored: that folder is not one a page may read") and str(tmp_path) not in said
    assert not app.dataframe

    inside = tmp_path / "runs" / "bad"
    labelled_folder(inside)
    Image.fromarray(np.zeros((16, 16), dtype=np.uint8)).save(inside / "masks" / "b.png")
    score(app, inside)
    (said,) = errors(app)
    assert "the mask b.png is 16x16 pixels but its picture b.png is 32x32" in said and str(tmp_path) not in said
