"""A prediction in words (app/words.py) on the pages that show a classifier's: small CLIP- and
SigLIP-shaped models with both towers selected as uploaded folders, typed labels against
zero_shot.predict computed by hand, ImageNet's classes through the class embeddings job and then
from disk, labels that cannot be scored, the Lesson's knock-out question, and sessions apart."""
import json
import re
from pathlib import Path

import numpy as np
import pytest
import streamlit as st
import torch
from streamlit.testing.v1 import AppTest

import vit_explorer as vx
from vit_explorer.app import images, jobs, words
from vit_explorer.text import load_image_text_model, zero_shot

from apptest import APP, charts, decoded, errors, figure_titles, open_words_app, run_until, tiny_default, widget  # noqa: F401
from textmodels import SMALL_CLIP, open_clip_folder, siglip_folder

LABELS = ("cat", "dog", "rocket")
PIPELINE, LESSON, KNOCKOUT, COMPARE = "views/pipeline.py", "views/lesson.py", "views/knockout.py", "views/compare.py"


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("text models")
    open_clip_folder(root / "clip", SMALL_CLIP)
    return {"clip": root / "clip", "siglip": siglip_folder(root / "siglip")}


@pytest.fixture
def folder_copies(folders, tmp_path) -> dict[str, Path]:
    """Each test's own copy: the ImageNet job writes its file beside the model."""
    copies = {}
    for name, folder in folders.items():
        copies[name] = tmp_path / "models" / name
        copies[name].mkdir(parents=True)
        for path in folder.iterdir():
            (copies[name] / path.name).write_bytes(path.read_bytes())
    return copies


def type_labels(app: AppTest, text: str) -> None:
    app.text_input(key=words.LABELS_WIDGET).set_value(text).run()
    assert not app.exception, app.exception


def by_hand(folder: Path, image_key: str, labels, texts=None) -> zero_shot.Prediction:
    """zero_shot.predict on a model read from the folder anew, the image preprocessed anew."""
    model = load_image_text_model(folder)
    _, image = images.resolve_image(image_key, model.image.config.img_size)
    pooled = vx.capture(model.image, vx.preprocess(image, model.image.config), layers=()).logits
    if texts is None:
        texts = model.embed_texts(zero_shot.label_prompts(list(labels)))
    return zero_shot.predict(model, pooled, tuple(labels), texts)


def top5(app: AppTest) -> tuple[list[str], np.ndarray]:
    """The labels and scores of the page's top-k (k: 5, or fewer labels)."""
    ((trace,),) = [traces for title, traces in charts(app).items() if re.match(r"Top-\d labels in words", title)]
    return list(trace["y"]), decoded(trace["x"])


def words_shown(app: AppTest) -> bool:
    return any(title.startswith("Top-5 labels in words") for title in figure_titles(app))


def captions(app: AppTest) -> str:
    return " ".join(caption.value for caption in app.caption)


@pytest.mark.parametrize("name, scoring", [("clip", "softmax"), ("siglip", "sigmoid")])
def test_typed_labels_give_a_top_k_in_words_equal_to_zero_shot_by_hand(folders, name, scoring):
    app = open_words_app(folders[name], PIPELINE)
    type_labels(app, " cat, dog,rocket ,")
    assert errors(app) == [] and app.session_state[words.LABELS] == LABELS
    expected = by_hand(folders[name], app.session_state["image_key"], LABELS)
    shown, values = top5(app)
    assert shown == [label for label, _ in expected.top(3)]
    np.testing.assert_allclose(values, [score for _, score in expected.top(3)], rtol=1e-5, atol=1e-7)
    best, score = expected.top(1)[0]
    assert any(f"The model says **{best}** with {score:.1%}." == markdown.value for markdown in app.markdown)
    # What it is over and how it scores, beside the prediction.
    assert "over your labels (3)" in captions(app)
    assert ("a softmax of 30 x the cosine" if scoring == "softmax" else "the sigmoid of 10.0 x cosine -2.0") in captions(app)
    assert expected.scoring == scoring
    if scoring == "softmax":
        assert expected.scores.sum().item() == pytest.approx(1.0)
    assert "9. Top-5 prediction in words" in [header.value for header in app.subheader]


def test_a_model_without_a_text_tower_has_no_label_box():
    app = AppTest.from_file(APP, default_timeout=60).run()
    assert not app.exception and [box.label for box in app.text_input] == []


def test_an_empty_label_box_is_imagenet_from_the_job_then_from_disk(folder_copies):
    folder = folder_copies["clip"]
    app = open_words_app(folder, PIPELINE)
    assert "zero-shot over ImageNet's 1,000 classes (7 prompts each)" in captions(app)
    assert not words_shown(app)  # not there yet: the job's button instead
    widget(app.button, "Compute ImageNet's class embeddings").click().run()
    run_until(app, words_shown, timeout=300)
    assert errors(app) == []
    path = folder / words.CLASS_EMBEDDINGS_FILE
    classes, templates = zero_shot.imagenet_classes(), zero_shot.imagenet_templates()
    model = load_image_text_model(folder)
    saved = zero_shot.load_class_embeddings(path, classes, templates, model.embed_dim)
    assert saved is not None and saved.shape == (1000, 32)
    expected = by_hand(folder, app.session_state["image_key"], classes, texts=saved)
    shown, values = top5(app)
    assert shown == [label for label, _ in expected.top(5)]
    np.testing.assert_allclose(values, [score for _, score in expected.top(5)], rtol=1e-5, atol=1e-7)
    # The job's embeddings are open_clip's zero-shot classifier's: every class's 7 prompts averaged.
    some = [0, 281, 999]
    by_templates = zero_shot.class_embeddings(model, [classes[index] for index in some], templates)
    torch.testing.assert_close(saved[some], by_templates, atol=1e-5, rtol=0)
    # Another server (caches empty): read from disk, no job, no button.
    st.cache_resource.clear()
    for record in jobs.job_board().folder.glob("*/record.json"):
        record.unlink()
    again = open_words_app(folder, PIPELINE)
    assert words_shown(again) and errors(again) == []
    assert not [button for button in again.button if button.label == "Compute ImageNet's class embeddings"]
    assert top5(again)[0] == shown


@pytest.mark.parametrize("text, reason", [
    (", ".join(f"label {index}" for index in range(10_000)), "too many"),
    ("x" * 100_000, "too long"),
])
def test_labels_that_cannot_be_scored_are_a_sentence_and_the_last_good_ones_stay(folders, text, reason):
    app = open_words_app(folders["clip"], PIPELINE)
    type_labels(app, "cat, dog, rocket")
    before = top5(app)
    type_labels(app, text)
    (error,) = errors(app)
    assert error.startswith("Those labels were not taken") and "still over your last labels" in error
    assert reason in error or "characters" in error
    assert app.session_state[words.LABELS] == LABELS
    assert app.text_input(key=words.LABELS_WIDGET).value == "cat, dog, rocket"  # the labels in force
    shown = top5(app)
    assert shown[0] == before[0] and np.array_equal(shown[1], before[1])
    type_labels(app, "a red square, a blue circle")  # and the box takes good labels again
    assert errors(app) == [] and top5(app)[0][0] in ("a red square", "a blue circle")


def test_the_longest_label_the_box_takes_is_predicted_and_a_tokenizer_failure_is_said_beside_the_box(folders, monkeypatch):
    """The box and the text tower count the same characters (a label of 289-300 characters used to
    pass the box and break every page); what the words layer still raises (here a Rust panic of the
    tokenizer: a BaseException) is one sentence in the sidebar, and the page goes on over ImageNet's."""
    from open_clip.tokenizer import SimpleTokenizer

    from vit_explorer.text.towers import MAX_LABEL_CHARACTERS

    app = open_words_app(folders["clip"], PIPELINE)
    longest = "a" * MAX_LABEL_CHARACTERS
    type_labels(app, f"cat, {longest}")
    assert errors(app) == [] and app.session_state[words.LABELS] == ("cat", longest) and len(top5(app)[0]) == 2

    class PanicException(BaseException):  # pyo3's, which no `except Exception` catches
        pass

    def panics(self, texts, context_length=None):
        if any("boom" in text for text in texts):
            raise PanicException("no entry found for key")
        return tokenize(self, texts, context_length)

    tokenize = SimpleTokenizer.__call__
    monkeypatch.setattr(SimpleTokenizer, "__call__", panics)
    type_labels(app, "cat, boom")
    assert not app.exception
    (error,) = [element.value for element in app.sidebar.error]
    assert error.startswith("This model could not read your labels: this model's tokenizer cannot read those texts")
    assert app.session_state[words.LABELS] is None
    app.run()  # and the next run says it still, beside the box
    assert not app.exception and any("could not read your labels" in element.value for element in app.sidebar.error)


def test_the_lessons_knock_out_question_works_for_a_headless_clip(folders):
    folder = folders["clip"]
    app = open_words_app(folder, LESSON)
    type_labels(app, "cat, dog, rocket")
    app.selectbox(key="lesson_step_picker").set_value(7).run()
    assert not app.exception and errors(app) == []
    text = " ".join(markdown.value for markdown in app.markdown)
    assert "needs class scores" not in text + " ".join(info.value for info in app.info)
    intact = by_hand(folder, app.session_state["image_key"], LABELS)
    best = intact.top(1)[0][0]
    assert f"the model says '{best}'" in text and "Remove layer 1's MLP" in text
    app.radio(key="lesson_answer_mlp").set_value("yes").run()
    assert not app.exception and errors(app) == []
    # The answer is the pass without that MLP, scored in words as the intact one.
    model = load_image_text_model(folder)
    _, image = images.resolve_image(app.session_state["image_key"], model.image.config.img_size)
    pooled = vx.capture(
        model.image, vx.preprocess(image, model.image.config), layers=(), knock_out=vx.KnockOut(mlp=(1,)),
    ).logits
    knocked = zero_shot.predict(model, pooled, LABELS, model.embed_texts(zero_shot.label_prompts(list(LABELS))))
    survives = knocked.top(1)[0][0] == best
    said = " ".join(markdown.value for markdown in app.markdown)
    assert ("**Right.**" if survives else "**Not this time.**") in said
    assert ("It survives" if survives else "It does not") in said
    (title,) = [title for title in figure_titles(app) if re.match(r"Top-3 with layer 1 MLP", title)]
    # The prediction step says it in words too.
    app.selectbox(key="lesson_step_picker").set_value(9).run()
    assert not app.exception and f"it says **{best}**" in " ".join(markdown.value for markdown in app.markdown)


def test_knock_out_and_compare_show_the_change_in_words(folders):
    app = open_words_app(folders["siglip"], KNOCKOUT)
    type_labels(app, "cat, dog, rocket")
    app.multiselect(key="knockout_mlp").set_value([1]).run()
    assert not app.exception and errors(app) == []
    (title,) = [title for title in figure_titles(app) if title.startswith("Top-3 with")]
    assert "sigmoid" in captions(app) and "over your labels (3)" in captions(app)
    app.switch_page(COMPARE).run()
    app.selectbox(key="compare_model").set_value("same model").run()
    assert not app.exception and errors(app) == []
    titles = figure_titles(app)
    assert any(title.startswith("A: top-") for title in titles) and any(title.startswith("B: top-") for title in titles)


def test_two_sessions_with_different_labels_never_see_each_others_prediction(folders):
    ann, bob = open_words_app(folders["clip"], PIPELINE), open_words_app(folders["clip"], PIPELINE)
    type_labels(ann, "cat, dog, rocket")
    type_labels(bob, "a red square, a blue circle, a green triangle")
    ann.run()
    assert sorted(top5(ann)[0]) == sorted(LABELS)
    assert sorted(top5(bob)[0]) == ["a blue circle", "a green triangle", "a red square"]
    assert "over your labels (3)" in captions(ann) and bob.session_state[words.LABELS] != ann.session_state[words.LABELS]


def test_a_text_tower_that_does_not_load_is_a_sentence_and_the_image_views_keep_working(folders, tmp_path):
    folder = tmp_path / "broken"
    folder.mkdir()
    for path in folders["clip"].iterdir():
        (folder / path.name).write_bytes(path.read_bytes())
    config = json.loads((folder / "open_clip_config.json").read_text())
    config["model_cfg"]["text_cfg"]["vocab_size"] = 10**9  # claims 32 GB it does not hold
    (folder / "open_clip_config.json").write_text(json.dumps(config))
    app = open_words_app(folder, PIPELINE)
    assert errors(app) == []
    (warning,) = [warning.value for warning in app.warning if "text tower" in warning.value]
    assert warning.startswith("This model's text tower could not be loaded") and "vocab_size must be a whole number" in warning
    assert [box.label for box in app.text_input] == []
    assert len(figure_titles(app)) > 3  # the image views as for any headless model
    assert any("A prediction needs class scores" in info.value for info in app.info)


def test_the_class_embeddings_job_is_admitted_from_its_memory(folder_copies, monkeypatch):
    monkeypatch.setenv("VIT_EXPLORER_JOB_MEMORY_LIMIT", "0.1")  # GB: less than the text tower's job needs
    folder = folder_copies["siglip"]
    app = open_words_app(folder, PIPELINE)
    widget(app.button, "Compute ImageNet's class embeddings").click().run()
    assert not app.exception
    (error,) = errors(app)
    assert error.startswith("This would need about") and "more than the 0.1 GB" in error
    assert not (folder / words.CLASS_EMBEDDINGS_FILE).exists() and not words_shown(app)
    type_labels(app, "cat, dog")  # typed labels never need the job
    assert errors(app) == [] and top5(app)[0][0] in ("cat", "dog")
