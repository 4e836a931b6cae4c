"""Where each word is, on the pages (app/word_maps.py): the Attention page's "Ask in words" and its
attribution in words, the Several images page's prompt over every image, the Lesson's last step;
small CLIP- and SigLIP-shaped models with both towers selected as uploaded folders, every map
against text.maps computed by hand on a model read anew."""
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from streamlit.testing.v1 import AppTest

import vit_explorer as vx
from vit_explorer.app import images, word_maps, words
from vit_explorer.text import load_image_text_model, maps, zero_shot

from apptest import APP, charts, decoded, errors, figure_titles, open_words_app, tiny_default, widget  # noqa: F401
from textmodels import SMALL_CLIP, open_clip_folder, siglip_folder

ATTENTION, IMAGES, LESSON = "views/attention.py", "views/images.py", "views/lesson.py"
PROMPTS = ("a cat", "a dog", "a rocket")  # the box's default


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("text models")
    open_clip_folder(root / "clip", SMALL_CLIP)
    return {"clip": root / "clip", "siglip": siglip_folder(root / "siglip")}


class ByHand:
    """The folder's model read anew, the app's image preprocessed anew, and text.maps on them."""

    def __init__(self, folder: Path, image_key: str):
        self.model = load_image_text_model(folder)
        config = self.model.image.config
        _, image = images.resolve_image(image_key, config.img_size)
        self.x = vx.preprocess(image, config)
        self.captured = vx.capture(self.model.image, self.x, layers=())

    def texts(self, labels) -> torch.Tensor:
        return self.model.embed_texts(zero_shot.label_prompts(list(labels)))

    def similarities(self, labels) -> np.ndarray:
        """(T, gh, gw)"""
        patches = maps.patch_embeddings(self.model, self.captured)
        return maps.similarity_maps(patches, self.texts(labels), self.captured.grid_size)[0].numpy()

    def relevance(self, text: torch.Tensor) -> np.ndarray:
        return maps.relevance(self.model, self.x, text)[0].numpy()


def chart(app: AppTest, pattern: str) -> list[dict]:
    (traces,) = [traces for title, traces in charts(app).items() if re.search(pattern, title)]
    return traces


def grid_values(trace: dict, grid: tuple[int, int]) -> np.ndarray:
    return decoded(trace["z"]).reshape(grid)


@pytest.mark.parametrize("name, path", [("clip", "MaskCLIP's value path"), ("siglip", "attention pool's value path")])
def test_ask_in_words_draws_each_prompts_map_the_best_prompt_and_the_relevance_as_text_maps_do(folders, name, path):
    app = open_words_app(folders[name], ATTENTION)
    assert "Ask in words" in [header.value for header in app.subheader]
    # Random weights: the best-prompt map may be one prompt's and the page says so (its caveats);
    # nothing else is to be warned of.
    assert errors(app) == [] and all(
        "closest prompt" in warning.value or "Read little into these maps" in warning.value for warning in app.warning
    )
    hand = ByHand(folders[name], app.session_state["image_key"])
    grid = hand.captured.grid_size
    expected = hand.similarities(PROMPTS)
    shown = [grid_values(trace, grid) for trace in chart(app, r"^Where each prompt is") if trace["type"] == "heatmap"]
    np.testing.assert_allclose(np.stack(shown), expected, atol=1e-5, rtol=0)
    assert path in " ".join(caption.value for caption in app.caption)
    (best,) = [trace for trace in chart(app, r"coloured by the prompt") if trace["type"] == "heatmap"]
    assert np.array_equal(grid_values(best, grid), expected.argmax(axis=0))
    # The relevance of the chosen prompt (a tiny model: computed unasked), then of another.
    (relevance,) = [trace for trace in chart(app, r"match 'a cat'") if trace["type"] == "heatmap"]
    np.testing.assert_allclose(grid_values(relevance, grid), hand.relevance(hand.texts(PROMPTS)[0]), atol=1e-5, rtol=1e-4)
    app.selectbox(key="word_traced").set_value(2).run()
    (relevance,) = [trace for trace in chart(app, r"match 'a rocket'") if trace["type"] == "heatmap"]
    np.testing.assert_allclose(grid_values(relevance, grid), hand.relevance(hand.texts(PROMPTS)[2]), atol=1e-5, rtol=1e-4)
    # Other prompts, each scale.
    app.text_input(key="word_prompts").set_value("a red square,a blue circle").run()
    app.radio(key="word_scale").set_value("per prompt").run()
    assert not app.exception and errors(app) == []
    shown = [grid_values(trace, grid) for trace in chart(app, r"^Where each prompt is") if trace["type"] == "heatmap"]
    np.testing.assert_allclose(np.stack(shown), hand.similarities(["a red square", "a blue circle"]), atol=1e-5, rtol=0)


def test_a_rerun_computes_nothing_again(folders, monkeypatch):
    app = open_words_app(folders["clip"], ATTENTION)
    calls = []
    for name in ("patch_embeddings", "relevance", "last_block_embeddings"):
        original = getattr(maps, name)
        monkeypatch.setattr(maps, name, lambda *args, _original=original, _name=name, **kw: calls.append(_name) or _original(*args, **kw))
    embedded = []
    original_embed = type(words.words_model(app.session_state["model_key"])).embed_texts
    monkeypatch.setattr(type(words.words_model(app.session_state["model_key"])), "embed_texts",
                        lambda self, *args, **kw: embedded.append(args) or original_embed(self, *args, **kw))
    app.run()
    assert not app.exception and calls == [] and embedded == []
    # Another session on the same model and image: shared, not computed again.
    other = open_words_app(folders["clip"], ATTENTION)
    assert not other.exception and calls == [] and embedded == []


@pytest.mark.parametrize("text, sentence", [
    (" , ,", "type at least one label"),
    ("x" * 100_000, "characters"),
    (", ".join(f"p{index}" for index in range(5_000)), "too many"),
])
def test_prompts_that_cannot_be_mapped_are_a_sentence(folders, text, sentence):
    app = open_words_app(folders["clip"], ATTENTION)
    app.text_input(key="word_prompts").set_value(text).run()
    assert not app.exception and errors(app) == []
    (warning,) = [warning.value for warning in app.warning if "prompts" in warning.value]
    assert warning.startswith("Those prompts cannot be mapped") and sentence in warning
    assert not [title for title in figure_titles(app) if title.startswith("Where each prompt is")]
    assert len(figure_titles(app)) > 5  # the rest of the page as before


def test_past_twelve_prompts_the_first_twelve_are_mapped(folders):
    app = open_words_app(folders["clip"], ATTENTION)
    app.text_input(key="word_prompts").set_value(", ".join(f"thing {index}" for index in range(15))).run()
    assert not app.exception and errors(app) == []
    assert f"The first {word_maps.MAX_PROMPTS} of your 15 prompts are mapped." in [caption.value for caption in app.caption]
    assert len([trace for trace in chart(app, r"^Where each prompt is") if trace["type"] == "heatmap"]) == word_maps.MAX_PROMPTS


def test_a_model_without_a_text_tower_asks_nothing_in_words():
    app = AppTest.from_file(APP, default_timeout=60).run()
    app.switch_page(ATTENTION).run()
    assert not app.exception and "Ask in words" not in [header.value for header in app.subheader]


@pytest.mark.parametrize("name", ["clip", "siglip"])
def test_the_attribution_of_a_headless_model_in_words_targets_its_top_label(folders, name):
    app = open_words_app(folders[name], ATTENTION)
    app.text_input(key=words.LABELS_WIDGET).set_value("cat, dog, rocket").run()
    assert not app.exception and errors(app) == []
    assert not [info for info in app.info if "needs class scores" in info.value]
    hand = ByHand(folders[name], app.session_state["image_key"])
    labels = ("cat", "dog", "rocket")
    texts = hand.texts(labels)
    predicted = zero_shot.predict(hand.model, hand.captured.logits, labels, texts)
    top = labels.index(predicted.top(1)[0][0])
    assert widget(app.selectbox, "Label").value == top
    (trace,) = [trace for trace in chart(app, rf"^Attribution for '{labels[top]}' \(in words\)") if trace["type"] == "heatmap"]
    np.testing.assert_allclose(grid_values(trace, hand.captured.grid_size), hand.relevance(texts[top]), atol=1e-5, rtol=1e-4)


def test_several_images_show_one_prompt_over_every_image(folders):
    app = open_words_app(folders["siglip"], IMAGES)
    assert not app.exception and errors(app) == []
    chosen = app.multiselect(key="image_set").value
    app.text_input(key="word_set_prompt").set_value("a rocket").run()
    assert not app.exception and errors(app) == []
    traces = [trace for trace in chart(app, r"^Where 'a rocket' is in each image") if trace["type"] == "heatmap"]
    assert len(traces) == len(chosen) >= 2
    for image_key, trace in zip(chosen, traces):
        hand = ByHand(folders["siglip"], image_key)
        np.testing.assert_allclose(
            grid_values(trace, hand.captured.grid_size), hand.similarities(["a rocket"])[0], atol=1e-5, rtol=0,
        )


def test_the_lessons_last_step_shows_where_the_top_label_is(folders):
    folder = folders["clip"]
    app = open_words_app(folder, LESSON)
    app.text_input(key=words.LABELS_WIDGET).set_value("cat, dog, rocket").run()
    app.selectbox(key="lesson_step_picker").set_value(10).run()
    assert not app.exception and errors(app) == []
    hand = ByHand(folder, app.session_state["image_key"])
    labels = ("cat", "dog", "rocket")
    predicted = zero_shot.predict(hand.model, hand.captured.logits, labels, hand.texts(labels))
    best = predicted.top(1)[0][0]
    assert any("Where is the word?" in markdown.value for markdown in app.markdown)
    (trace,) = [trace for trace in chart(app, rf"^Where each prompt is") if trace["type"] == "heatmap"]
    np.testing.assert_allclose(
        grid_values(trace, hand.captured.grid_size), hand.similarities([best])[0], atol=1e-5, rtol=0,
    )


def test_the_lessons_last_step_waits_silently_for_imagenets_class_embeddings(folders):
    app = open_words_app(folders["clip"], LESSON)  # no labels typed: ImageNet's, not computed yet
    app.selectbox(key="lesson_step_picker").set_value(10).run()
    assert not app.exception and errors(app) == []
    assert not any("Where is the word?" in markdown.value for markdown in app.markdown)
