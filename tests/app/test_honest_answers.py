"""Answers that say no more than they know (issue 47, item 5): one label under CLIP's softmax,
labels typed twice, a best-prompt map that one prompt fills, and the maps' test whose insertion
curves favour chance (why, and what the random floor is)."""
import re

import numpy as np
import pytest
import torch

from vit_explorer.analysis import faithfulness as fa
from vit_explorer.app import faithfulness, word_maps, words

from apptest import errors, open_words_app, tiny_default, widget  # noqa: F401 (tiny_default: autouse)
from textmodels import SMALL_CLIP, open_clip_folder


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    folder = tmp_path_factory.mktemp("clip") / "clip"
    open_clip_folder(folder, SMALL_CLIP)
    return folder


def said(app) -> str:
    return " ".join(element.value for element in [*app.markdown, *app.caption, *app.warning])


def test_one_label_under_softmax_is_no_prediction_and_a_label_typed_twice_is_said_to_be_scored_once(clip):
    app = open_words_app(clip, "views/pipeline.py")
    app.text_input(key=words.LABELS_WIDGET).set_value("a cat, a cat").run()
    assert not app.exception and errors(app) == []
    assert app.session_state[words.LABELS] == ("a cat",)
    text = said(app)
    assert "The model says" not in text
    assert "With one label there is nothing to choose between: the softmax gives 'a cat' 100% whatever the image" in text
    assert "'a cat' was typed more than once and is scored once." in text
    app.text_input(key=words.LABELS_WIDGET).set_value("a cat, a dog").run()
    text = said(app)
    assert "The model says" in text and "With one label" not in text and "typed more than once" not in text


def test_a_best_prompt_map_one_prompt_fills_says_so_beside_it(monkeypatch):
    similarities = np.zeros((2, 4, 4))
    similarities[0] += 0.3
    similarities[1, 0, 0] = 0.5  # 'a dog' is closest for one patch of 16
    monkeypatch.setattr(word_maps, "uniform_attention_caveat", lambda selection: None)
    (sentence,) = word_maps.best_prompt_caveats(None, similarities, ("a cat", "a dog"))
    assert sentence.startswith("'a cat' is the closest prompt for 15 of the 16 patches")
    similarities[1, :2] = 0.5  # 8 of 16 each: nothing to say
    assert word_maps.best_prompt_caveats(None, similarities, ("a cat", "a dog")) == []
    monkeypatch.setattr(word_maps, "uniform_attention_caveat", lambda selection: "This model's heads spread ...")
    assert word_maps.best_prompt_caveats(None, similarities, ("a cat", "a dog")) == [
        "Read little into these maps: this model's heads spread ..."
    ]


def test_the_random_clips_best_prompt_map_carries_the_pages_caveat_beside_it(clip):
    app = open_words_app(clip, "views/attention.py")
    top = [info.value for info in app.info if "spread their attention almost evenly" in info.value]
    beside = [warning.value for warning in app.warning if warning.value.startswith("Read little into these maps")]
    assert top and beside  # a random CLIP: its heads pick nothing out, said at the top and beside the map


def curves(insertion_random: float) -> fa.Faithfulness:
    """Three orders over 10 patches: rollout drops the score fastest; in insertion, a random tenth
    of the patches brings it to ``insertion_random``."""
    fractions = torch.linspace(0, 1, 11)
    deletion = torch.stack([torch.linspace(0.9, 0.05, 11) ** 3, torch.linspace(0.9, 0.05, 11), torch.linspace(0.9, 0.05, 11) ** 0.5])
    insertion = torch.stack([torch.linspace(0.05, 0.9, 11), torch.linspace(0.05, 0.9, 11), torch.linspace(0.05, 0.9, 11)])
    insertion[2, 1:] = torch.clamp(torch.linspace(insertion_random, 0.95, 10), max=0.95)
    return fa.Faithfulness(
        names=("rollout", "attention", fa.RANDOM), orders=torch.zeros(3, 10, dtype=torch.long),
        counts=torch.arange(11), fractions=fractions, curves={"deletion": deletion, "insertion": insertion},
        intact=0.9, empty=0.05, mode="drop", what="'a cat'", percent=True, target=0, passes=1, forwards=1.0,
    )


def test_the_maps_test_says_why_insertion_favours_chance_and_what_the_floor_is():
    result = curves(insertion_random=0.8)
    verdict = faithfulness.verdict(result)
    assert verdict.startswith("The deletion curves favour rollout (the smallest area); the insertion curves favour a random order")
    assert re.search(r"Why: keeping only a random 10% of the patches already takes 'a cat' from 5(\.0)?% to 80(\.0)?%"
                     r" \(the whole image: 90(\.0)?%\)", verdict), verdict
    assert "the model gives its answer from almost any few patches" in verdict
    opinion = faithfulness.insertion_opinion(result)
    assert opinion.startswith("Keeping only the brightest patches (insertion) favours no map over a random order. Why:")
    assert "fixed seed" in faithfulness.RANDOM_FLOOR
    # A random tenth that gives little back: chance wins, but not for that reason, so no "why".
    assert "Why" not in faithfulness.verdict(curves(insertion_random=0.2))
