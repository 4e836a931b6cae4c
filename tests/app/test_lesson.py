"""The Lesson page (AppTest): every step with the shipped model and with headless models with
registers, each question answered against an independent computation of the model's numbers,
the teacher's link, and what a step's first view costs.

Uses test_app's fixture (tiny default model, private runs and uploads folders) and helpers."""
import json
import re
import time
import urllib.parse

import pytest
import streamlit as st
import torch

import vit_explorer as vx
from vit_explorer.training import train
from vit_explorer.app import costs, jobs, lesson, memo, models, session
from streamlit.testing.v1 import AppTest

from apptest import APP, errors, figure_titles, open_app, tiny_default, tiny_model, title_matching, widget  # noqa: F401

PAGE = "views/lesson.py"
DEFAULT_IMAGE = vx.shapes_sample(4, 32)[0]  # images.DEFAULT_IMAGE at the tiny model's size
HEADLESS = {  # with registers: DINOv3-shaped (class token, rotary positions), and one without a class token
    "rotary, class token": dict(
        image_size=64, patch_size=16, embed_dim=64, depth=2, num_heads=2, num_classes=0, class_names=None,
        reg_tokens=4, abs_pos_embed=False, rope_type="dinov3", init_values=1e-5,
    ),
    "no class token": dict(num_classes=0, class_names=None, class_token=False, global_pool="mean", reg_tokens=2),
}


def open_lesson(step: int = 1):
    app = open_app(PAGE)
    if step != 1:
        app.selectbox(key="lesson_step_picker").set_value(step).run()
    assert not app.exception and errors(app) == []
    return app


def said(app) -> str:
    return " ".join(str(element.value) for kind in ("markdown", "caption") for element in app.get(kind))


def walk(app) -> list[str]:
    """Every step with Next, from the first; each step's heading. Each must render without an error,
    name its page to explore, and be the step in the address."""
    headings = []
    for number in range(1, len(lesson.STEPS) + 1):
        assert not app.exception, (number, app.exception)
        assert errors(app) == [], (number, errors(app))
        (heading,) = [header.value for header in app.subheader]
        assert heading == f"{number}. {lesson.STEPS[number - 1]}"
        assert app.query_params[lesson.STEP_PARAM] == str(number)
        assert [button.label for button in app.button if button.label.startswith("Explore this on its page")], number
        assert all(title.strip() for title in figure_titles(app)), number
        headings.append(heading)
        if number < len(lesson.STEPS):
            widget(app.button, "Next").click().run()
    assert widget(app.button, "Next").disabled
    return headings


@pytest.mark.skipif(not train.DEFAULT_WEIGHTS.is_file(), reason="the shipped model is not there yet")
def test_every_step_with_the_shipped_model(monkeypatch):
    monkeypatch.delenv("VIT_EXPLORER_DEFAULT_MODEL")  # the shipped model
    st.cache_resource.clear()
    app = open_lesson()
    assert app.title[0].value == "Lesson"
    assert not app.warning  # a trained model on a picture it reads: nothing to caution against
    walk(app)
    assert "ring" in said(app.selectbox(key="lesson_step_picker").set_value(9).run())


@pytest.mark.parametrize("changes", HEADLESS.values(), ids=HEADLESS.keys())
def test_every_step_with_a_headless_model_with_registers(tiny_default, changes):
    torch.manual_seed(0)
    vx.save_model(tiny_model(**changes), tiny_default)
    app = open_lesson()
    walk(app)
    texts = {}
    for number in range(1, len(lesson.STEPS) + 1):
        app.selectbox(key="lesson_step_picker").set_value(number).run()
        texts[number] = said(app) + " ".join(info.value for info in app.info)
    config = models.base_model(models.DEFAULT_MODEL).config
    assert f"{config.reg_tokens} register tokens follow" in texts[3]
    # The steps that need classes say so and skip: no question, no logit lens, no prediction.
    assert "This step's question (will the prediction survive without the MLP?) needs class scores" in texts[7]
    assert "The logit lens needs class scores" in texts[8] and "A prediction needs class scores" in texts[9]
    if config.class_token:
        app.selectbox(key="lesson_step_picker").set_value(3).run()
        assert "Each patch's rotation angle" in " ".join(figure_titles(app))
    else:  # the steps follow the centre patch
        assert "the centre patch (patch 36) attends to most" in texts[4]
    # The random model is said to be one, at the top of every step.
    assert any("as an untrained model's do" in warning.value for warning in app.warning)


@pytest.fixture
def peaked(tiny_default):
    """The tiny default model with larger queries and keys: attention far from uniform, so that the
    patches' ranks are not ties."""
    model = tiny_model()
    with torch.no_grad():
        for block in model.blocks:
            block.attn.qkv.weight.mul_(4)
    vx.save_model(model, tiny_default)


def model_and_input():
    model = models.base_model(models.DEFAULT_MODEL)
    return model, vx.preprocess(DEFAULT_IMAGE, model.config)


def test_the_patch_question_ranks_the_clicked_patch_in_the_last_layers_attention(peaked):
    app = open_lesson(4)
    assert "click the patch you think the class token attends to most in layer 3" in said(app)
    assert not re.search(r"ranks \d+", said(app))  # nothing revealed before the answer
    model, x = model_and_input()
    # The class token's row in the last layer, the mean of the heads, from the weights the app keeps.
    row = vx.capture(model, x, attention_dtype=torch.float16).attentions[0, -1, :, 0, 1:].float().mean(dim=0)
    ranked = row.argsort(descending=True).tolist()
    guess = ranked[10]
    assert row[guess] != row[ranked[9]]  # no tie
    app.selectbox(key="lesson_answer_patch").set_value(guess).run()
    best_row, best_col = divmod(ranked[0], 8)
    assert "ranks 11th of 64" in said(app)
    assert f"the most goes to patch {ranked[0]} (row {best_row}, col {best_col}), {float(row.max()):.1%}" in said(app)
    assert said(app).startswith("Eleven steps") and "**Not this time.**" in said(app)
    title_matching(app, r"^The class token's attention in layer 3<br>\(the mean of 4 heads; outlined: your patch\)")
    app.selectbox(key="lesson_answer_patch").set_value(ranked[0]).run()
    assert "**Right.**" in said(app)
    widget(app.button, "Ask me again").click().run()
    assert not re.search(r"ranks \d+", said(app)) and app.selectbox(key="lesson_answer_patch").value is None


def test_the_answers_are_this_sessions_and_this_images_only():
    app = open_lesson(4)
    app.selectbox(key="lesson_answer_patch").set_value(5).run()
    app.selectbox(key="image_picker").set_value("shapes:1").run()  # another picture: asked again
    assert app.selectbox(key="lesson_answer_patch").value is None and "ranks" not in said(app)
    app.selectbox(key="image_picker").set_value("shapes:4").run()
    assert app.selectbox(key="lesson_answer_patch").value == 5 and "ranks" in said(app)
    assert "ranks" not in said(open_lesson(4))  # another session


def test_the_scale_question_is_answered_by_the_softmax_at_half_the_scale(peaked):
    app = open_lesson(5)
    head = app.selectbox(key="lesson_head").value
    model, x = model_and_input()
    steps = vx.layer_internals(model, vx.capture(model, x).tokens[:, 3], 3)
    scores = steps.scores[0, head, 0].double()  # the class token's, scaled by 1/sqrt(d_head) already
    entropies = [float(torch.special.entr(torch.softmax(scores * factor, -1)).sum()) for factor in (1.0, 0.5)]
    # The head offered first is the one most focused on this token.
    assert head == int(torch.special.entr(steps.attention[0, :, 0].double()).sum(-1).argmin())
    app.radio(key="lesson_answer_scale").set_value("sharper").run()
    assert entropies[1] > entropies[0]  # a softmax is never sharper at a smaller scale
    assert "**Not this time: flatter.**" in said(app)
    assert f"the entropy goes from {entropies[0]:.3f} to {entropies[1]:.3f} nats" in said(app)
    title_matching(app, r"^Attention of CLS at x0.5 the model's scale")


def test_the_mlp_question_is_answered_by_the_pass_without_it(peaked):
    app = open_lesson(7)
    model, x = model_and_input()
    intact = vx.capture(model, x).logits[0].softmax(-1)
    knocked = vx.capture(model, x, knock_out=vx.KnockOut(mlp=(2,))).logits[0].softmax(-1)
    top = int(intact.argmax())
    assert "Remove layer 2's MLP" in said(app)
    app.radio(key="lesson_answer_mlp").set_value("yes").run()
    survives = int(knocked.argmax()) == top
    assert ("**Right.**" if survives else "**Not this time.**") in said(app)
    name = vx.SHAPE_CLASSES[top]
    assert (f"It survives: still '{name}'" if survives else f"It does not: '{name}' falls") in said(app)
    title_matching(app, "^Top-5 with layer 2 MLP")


def run_until(app, done, timeout: float = 120) -> None:
    """Rerun the page (as its live fragment would) until ``done(app)``."""
    deadline = time.monotonic() + timeout
    while not done(app):
        assert time.monotonic() < deadline, said(app)
        time.sleep(0.5)
        app.run()
        assert not app.exception, app.exception


def test_the_head_question_shows_at_once_and_its_sweep_is_asked_for_as_a_job(monkeypatch):
    monkeypatch.setattr(costs, "QUICK_COST", 1.0)  # the tiny model's sweep as a ViT-B's would be
    app = open_lesson(10)
    assert "which head will matter most when knocked out?" in said(app)
    assert app.selectbox(key="lesson_answer_head").value is None
    assert not [button for button in app.button if button.label == "Run the sweep"]  # asked already
    (record,) = jobs.job_board().folder.glob("*/record.json")
    assert json.loads(record.read_text())["spec"]["kind"] == "head sweep"
    app.selectbox(key="lesson_answer_head").set_value(6).run()  # layer 1, head 2
    run_until(app, lambda app: "that head ranks" in said(app))
    model, x = model_and_input()
    values = vx.head_sweep(model, x).values  # (4, 4): the change of log p of the predicted class
    order = values.flatten().argsort().tolist()  # the most harmful knock-out first
    rank = order.index(6) + 1
    assert f"that head ranks {rank}{ {1: 'st', 2: 'nd', 3: 'rd'}.get(rank, 'th')} of 16" in said(app)
    best_layer, best_head = divmod(order[0], 4)
    if order[0] != 6:
        assert f"The head that matters most is layer {best_layer}, head {best_head}" in said(app)
    title_matching(app, f"^Top-5 with layer {best_layer} head {best_head}")
    # The link opens the Knock-out page with that head knocked out, and nothing else.
    next(button for button in app.button if button.label.startswith("Explore this on its page")).click().run()
    assert app.title[0].value == "Knock-out" and not app.exception
    assert widget(app.multiselect, f"Layer {best_layer}").value == [best_head]
    assert all(not box.value for box in app.multiselect if box.label != f"Layer {best_layer}")
    # Back on the step, the sweep is read again, not asked for again.
    app.switch_page(PAGE).run()
    assert "that head ranks" in said(app) and len(list(jobs.job_board().folder.glob("*/record.json"))) == 1


def test_every_heads_measures_are_a_job_where_they_are_heavy(monkeypatch):
    """Step 6 on a model whose measures of every head are heavy (the tiny model as a ViT-B's would be,
    its capture holding the tokens only): the button of their job, no measure in the server."""
    from vit_explorer.app import memo, models, selection

    memo.shared_results().clear()
    monkeypatch.setattr(costs, "QUICK_COST", 1.0)
    monkeypatch.setattr(costs, "HEAVY_FORWARDS", 0.1)
    monkeypatch.setattr(models, "KEEP_EVERY_LAYER_BYTES", 0)
    monkeypatch.setattr(selection, "captured_head_statistics", lambda *a, **k: pytest.fail("measured in the server"))
    app = open_lesson(6)
    assert [button.label for button in app.button if button.label == "Measure every head"]
    assert "Measured over every query of this image" not in said(app)


def test_the_explore_links_open_their_pages_on_the_steps_layer_head_and_query():
    app = open_lesson(5)
    head = app.selectbox(key="lesson_head").set_value(2).run().selectbox(key="lesson_head").value
    app.radio(key="lesson_answer_scale").set_value("flatter").run()
    next(button for button in app.button if button.label.startswith("Explore this on its page")).click().run()
    assert app.title[0].value == "Inside a layer" and not app.exception
    assert widget(app.slider, "Layer").value == 3 and widget(app.selectbox, "Head").value == head == 2
    assert widget(app.selectbox, "Query token").value == -1  # the class token
    assert app.select_slider[0].value == 0.5  # the scale the answer showed
    app.switch_page(PAGE).run()
    assert app.subheader[0].value.startswith("5. ")  # the lesson kept its step


def teacher_link(app) -> dict[str, str]:
    with_query = [code.value for code in app.code if "?" in code.value and lesson.STEP_PARAM in code.value]
    (link,) = with_query
    return dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(link).query))


def test_the_teachers_link_opens_the_same_step_image_and_model(tmp_path):
    path = tmp_path / "other.safetensors"
    vx.save_model(tiny_model(depth=3), path)
    app = open_lesson(6)
    app.file_uploader(key="checkpoint_upload").set_value((path.name, path.read_bytes(), "application/octet-stream")).run()
    app.selectbox(key="image_picker").set_value("shapes:2").run()
    assert app.subheader[0].value.startswith("6. ")  # the step is kept through a new model and image
    widget(app.button, "Back").click().run()
    assert app.selectbox(key="image_picker").value == "shapes:2"  # Back keeps everything else
    params = teacher_link(app)
    assert params[lesson.STEP_PARAM] == "5" and params[session.IMAGE_PARAM] == "shapes:2"
    assert params[session.MODEL_PARAM].startswith("upload:") and "owner" not in params
    assert {key: app.query_params[key] for key in params} == params  # the address is the link
    # A student opens the link: a new session.
    student = opened_with(params)
    student.switch_page(PAGE).run()
    assert not student.exception and errors(student) == []
    assert student.subheader[0].value == f"5. {lesson.STEPS[4]}"
    assert student.selectbox(key="image_picker").value == "shapes:2"
    assert student.selectbox(key="model_picker").value == app.selectbox(key="model_picker").value
    assert any("3 layers" in caption.value for caption in student.sidebar.caption)


def opened_with(params: dict[str, str]) -> AppTest:
    """A new session (a link opened) whose address has ``params``."""
    app = AppTest.from_file(APP, default_timeout=60)
    for key, value in params.items():
        app.query_params[key] = value
    return app.run()


@pytest.mark.parametrize("params", [
    {"step": "42", "model": "pretrained:nonexistent"}, {"step": "-1", "model": "upload:../../etc"},
    {"step": "x", "model": "run:run 9"},
])
def test_a_link_to_nothing_opens_the_first_step_on_the_default_model(params):
    app = opened_with(params).switch_page(PAGE).run()
    assert not app.exception and errors(app) == []
    assert app.subheader[0].value.startswith("1. ")
    assert app.session_state["model_key"] == models.DEFAULT_MODEL and session.MODEL_PARAM not in app.query_params


def test_each_steps_first_view_costs_at_most_two_forward_passes(monkeypatch):
    """With a model too large for unasked work, every step's first view (nothing cached) runs at
    most two forward passes' worth of blocks; the sweep of step 10 is a job, not run here."""
    monkeypatch.setattr(costs, "QUICK_COST", 0)
    depth = models.base_model(models.DEFAULT_MODEL).config.depth
    ran = []
    original = vx.model.vit.Block.forward
    monkeypatch.setattr(vx.model.vit.Block, "forward", lambda block, *args, **kwargs: ran.append(1) or original(block, *args, **kwargs))
    app = open_lesson()
    for number in range(1, len(lesson.STEPS) + 1):
        memo.shared_results().clear()
        ran.clear()
        app.selectbox(key="lesson_step_picker").set_value(number).run()  # step 1: the same, run again
        assert not app.exception and errors(app) == []
        assert depth <= len(ran) <= 2 * depth, (number, len(ran))
