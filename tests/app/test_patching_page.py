"""The Patching page (AppTest): a painted region or another picture as the corrupted run, the
attribution and exact heat maps with their agreement, a clicked cell's patched run, path patching,
exact patching as a job for a model where it is not quick, and each bad input a sentence."""
import json
import re

import numpy as np
import pytest
import torch

import vit_explorer as vx
from vit_explorer.analysis import patching
from vit_explorer.app import costs, jobs, models
from vit_explorer.serving import job_kinds

from apptest import (  # noqa: F401 (tiny_default: autouse)
    decoded, errors, figure_titles, open_app, run_until, tiny_default, tiny_model, title_matching, widget,
)

PAGE = "views/patching.py"


def exact_map(app) -> np.ndarray:
    spec = next(chart for chart in app.get("plotly_chart") if "Exact: " in chart.proto.spec).proto.spec
    return np.asarray(decoded(json.loads(spec)["data"][0]["z"]), dtype=float)


def test_the_page_patches_a_painted_region_and_draws_both_maps():
    app = open_app(PAGE)
    assert errors(app) == [] and app.title[0].value == "Patching"
    assert all(w.help for w in [*app.main.radio, *app.main.selectbox, *app.main.slider, *app.main.number_input])
    titles = figure_titles(app)
    assert all(title.strip() for title in titles)
    title_matching(app, "^Attribution: residual stream per layer x token \\(denoising\\)$")
    title_matching(app, "^Exact: residual stream per layer x token \\(denoising\\)$")
    title_matching(app, "^residual stream: the estimate against exact patching, cell by cell \\(correlation")
    assert any("correlate at" in markdown.value for markdown in app.markdown)
    title_matching(app, "^Exact: residual stream entering layer 0, on the picture$")
    widget(app.slider, "Layer on the picture").set_value(3).run()
    title_matching(app, "^Exact: residual stream entering layer 3, on the picture$")
    # The exact map is the analysis' own on the same two pictures.
    model = models.base_model(models.DEFAULT_MODEL)
    clean = vx.preprocess(vx.shapes_sample(4, 32)[0], model.config)
    runs = patching.paired_runs(model, clean, patching.painted(clean, (2, 6, 2, 6), 4))
    top = int(runs.outputs[0].argmax())
    names = list(model.config.class_names)
    second = int(runs.outputs[1].argmax())
    b = second if second != top else int(runs.outputs[0].topk(2).indices[1])
    expected = patching.exact_patching(model, runs, patching.class_difference(top, b, names), "resid")
    np.testing.assert_allclose(exact_map(app).reshape(expected.shape), expected.numpy(), atol=1e-4)
    # Painted patches only differ at layer 0: the other tokens' cells are exactly 0 there.
    painted = {1 + row * 8 + column for row in range(2, 6) for column in range(2, 6)}
    assert all(expected[0, token] == 0 for token in range(expected.shape[1]) if token not in painted)


def test_sites_directions_a_clicked_cell_and_path_patching():
    app = open_app(PAGE)
    widget(app.radio, "Site").set_value("head").run()
    assert errors(app) == []
    title_matching(app, "^Exact: head output per layer x head \\(denoising\\)$")
    widget(app.number_input, "Layer").set_value(2).run()
    widget(app.number_input, "Head").set_value(1).run()
    assert errors(app) == []
    title_matching(app, "^Top-5 with layer 2 head 1 \\(head output\\) patched, against the clean and corrupted runs$")
    assert any(metric.label.startswith("Restored with layer 2 head 1") for metric in app.metric)
    receiver = next(box for box in app.selectbox if "reaches the output through" in box.label)
    assert receiver.options[0] == "the MLPs only" and receiver.value is None  # a pass of its own: asked for
    assert not any(metric.label == "Restored through that path alone" for metric in app.metric)
    receiver.set_value(0).run()
    assert errors(app) == []
    (shown,) = [metric for metric in app.metric if metric.label == "Restored through that path alone"]
    sender = re.match(r"Head (\d+) of layer (\d+)", receiver.label).groups()
    model = models.base_model(models.DEFAULT_MODEL)
    clean = vx.preprocess(vx.shapes_sample(4, 32)[0], model.config)
    runs = patching.paired_runs(model, clean, patching.painted(clean, (2, 6, 2, 6), 4))
    top, second = runs.outputs[0].topk(2).indices.tolist()
    corrupted_top = int(runs.outputs[1].argmax())
    metric = patching.class_difference(top, corrupted_top if corrupted_top != top else second, list(model.config.class_names))
    expected = patching.path_patching(model, runs, metric, (int(sender[1]), int(sender[0])), None)
    assert shown.value == f"{expected:.3f}"
    widget(app.radio, "Direction").set_value("noising").run()
    assert errors(app) == []
    title_matching(app, "^Exact: head output per layer x head \\(noising\\)$")


def test_another_picture_of_another_size_is_resized_and_said_so():
    app = open_app(PAGE)
    widget(app.radio, "Corrupted picture").set_value("picture").run()
    widget(app.selectbox, "The corrupted picture").set_value("photo:chelsea.png").run()
    assert errors(app) == []
    assert any("each was resized to the model's 32x32" in info.value for info in app.info)


def test_bad_inputs_are_a_sentence_each():
    app = open_app(PAGE)
    widget(app.slider, "Painted patch rows").set_value((0, 8)).run()
    widget(app.slider, "Painted patch columns").set_value((0, 8)).run()
    assert [error.value for error in app.error] == [
        "The painted region covers the whole picture, so nothing of the clean picture is left to find: paint a smaller region."
    ]
    widget(app.slider, "Painted patch columns").set_value((0, 4)).run()
    widget(app.selectbox, "minus the logit of").set_value(widget(app.selectbox, "Metric: the logit of").value).run()
    assert len(app.error) == 1 and "same value" in app.error[0].value and "nothing to patch" in app.error[0].value


def test_exact_patching_is_a_job_where_it_is_not_quick(monkeypatch):
    monkeypatch.setattr(costs, "QUICK_COST", 0.0)  # nothing is quick: attribution and exact are jobs
    app = open_app(PAGE)
    assert errors(app) == []
    labels = [button.label for button in app.button]
    assert "Estimate every cell" in labels and "Patch every cell" in labels
    widget(app.button, "Patch every cell").click().run()
    run_until(app, lambda app: any("Exact: " in chart.proto.spec for chart in app.get("plotly_chart")))
    assert errors(app) == []
    title_matching(app, "^Exact: residual stream per layer x token")


def test_a_headless_model_patches_the_pooled_cosine(tmp_path):
    path = tmp_path / "headless.safetensors"
    vx.save_model(tiny_model(num_classes=0, class_names=None), path)
    app = open_app(PAGE)
    app.file_uploader(key="checkpoint_upload").set_value((path.name, path.read_bytes(), "application/octet-stream")).run()
    app.switch_page(PAGE).run()
    assert not app.exception and errors(app) == []
    assert any("cosine of the pooled feature" in caption.value for caption in app.main.caption)
    title_matching(app, "^Exact: residual stream per layer x token")
    assert not any("Top-5" in title for title in figure_titles(app))


def test_a_clip_patches_the_difference_of_two_labels_scores(tmp_path):
    from apptest import open_words_app
    from textmodels import SMALL_CLIP, open_clip_folder
    from vit_explorer.text import load_image_text_model, zero_shot

    folder = tmp_path / "clip"
    open_clip_folder(folder, SMALL_CLIP)
    app = open_words_app(folder, PAGE)
    assert errors(app) == []
    widget(app.text_input, "Metric: the score of").set_value("a rocket").run()
    assert errors(app) == []
    assert any("score of 'a rocket' - score of 'a dog'" in caption.value for caption in app.main.caption)
    # The exact map scores the patched runs with the two labels, as analysis.patching does by hand.
    both = load_image_text_model(folder)
    config = both.image.config
    clean = vx.preprocess(vx.shapes_sample(4, config.img_size)[0], config)
    runs = patching.paired_runs(both.image, clean, patching.painted(clean, (1, 3, 1, 3), config.patch_size))  # the 4 x 4 grid's middle
    metric = zero_shot.score_difference(both, both.embed_texts(zero_shot.label_prompts(["a rocket", "a dog"])), ("a rocket", "a dog"))
    expected = patching.exact_patching(both.image, runs, metric, "resid")
    np.testing.assert_allclose(exact_map(app).reshape(expected.shape), expected.numpy(), atol=1e-4)
    # A job (a large CLIP's) gets the labels' embeddings and reads the projection from the folder.
    settings = dict(metric=["words", "a rocket", "a dog"], folder=str(folder), site="resid", direction="denoising",
                    texts=both.embed_texts(zero_shot.label_prompts(["a rocket", "a dog"])).tolist())
    arrays = job_kinds.KINDS["patching"].compute(both.image, runs.images, settings, lambda share: None)
    np.testing.assert_allclose(arrays["values"], expected.numpy(), atol=1e-4)
    widget(app.text_input, "minus the score of").set_value("a" * 400).run()
    (error,) = [error.value for error in app.main.error]
    assert error.startswith("a label of 400 characters is too long")
    widget(app.text_input, "minus the score of").set_value("a rocket").run()
    assert [error.value for error in app.error] == ["Type two different labels: the metric is the first one's score minus the second's."]


def test_a_size_whose_runs_would_not_fit_a_view_is_refused_in_a_sentence(monkeypatch):
    monkeypatch.setattr(models, "MAX_VIEW_BYTES", 2**16)
    app = open_app(PAGE)
    (error,) = [error.value for error in app.main.error]
    assert error.startswith("Patching keeps both pictures' activations at every layer,") and "choose a smaller" in error


def test_the_metric_follows_the_corrupted_runs_answer_until_one_is_chosen():
    """Painted first, then another picture: the metric's second class is that picture's answer,
    not the painted one's kept (a ring against a crescent read 'ring - circle' in Chromium)."""
    app = open_app(PAGE)
    model = models.base_model(models.DEFAULT_MODEL)
    widget(app.radio, "Corrupted picture").set_value("picture").run()
    chosen = widget(app.selectbox, "The corrupted picture").value
    assert chosen.startswith("shapes:") or chosen.startswith("photo:")
    clean = app.session_state["image_key"]
    outputs = []
    for key in (clean, chosen):
        image = vx.shapes_sample(int(key.split(":")[1].split("@")[0]), 32)[0] if key.startswith("shapes:") else None
        if image is None:
            pytest.skip("the first other picture is a photo")
        outputs.append(model(vx.preprocess(image, model.config))[0])
    clean_top, corrupted_top = (int(output.argmax()) for output in outputs)
    if corrupted_top == clean_top:
        pytest.skip("the tiny model gives both pictures one answer")
    assert widget(app.selectbox, "minus the logit of").value == corrupted_top
    # A class chosen by hand stays while the answers do.
    other = next(index for index in range(model.config.num_classes) if index not in (clean_top, corrupted_top))
    widget(app.selectbox, "minus the logit of").set_value(other).run()
    app.switch_page("views/pipeline.py").run()
    app.switch_page(PAGE).run()
    assert widget(app.selectbox, "minus the logit of").value == other
