"""Is this map true? on the pages (AppTest): the Attention page's deletion and insertion curves against
analysis.faithfulness run by hand on the same image and maps (tiny default model, a headless
DINOv3-shaped one, the job a larger model gets), the removal mode, and the Lesson's last step."""
import json

import numpy as np
import pytest
import torch

import vit_explorer as vx
from vit_explorer.analysis import attribution, faithfulness as fa, query_map, streamed_rollout
from vit_explorer.app import costs, faithfulness, jobs, lesson
from vit_explorer.app.images import resolve_image
from vit_explorer.model.capture import layer_attentions

from apptest import charts, decoded, open_app, run_until, tiny_default, widget  # noqa: F401

PAGE = "views/attention.py"
TITLE = "Is this map true?"


def by_hand(weights, mode: str = "drop", curves=fa.CURVES, attributed: bool = True, mass: float = 0.6):
    """The Attention page's maps of the default image made by hand, and their curves."""
    model = vx.load_model(weights).eval()
    config = model.config
    x = vx.preprocess(resolve_image("shapes:4", config.img_size)[1], config)
    captured = vx.capture(model, x, attention_dtype=torch.float16)  # as the page's capture keeps them
    prefix, grid = captured.num_prefix_tokens, captured.grid_size
    heads = query_map(captured.attentions[0, -1], grid, prefix, class_token=config.class_token)  # (H, gh, gw)
    rollout = streamed_rollout(layer_attentions(model, vx.capture(model, x, layers=())), num_prefix_tokens=prefix)
    maps = {"last layer's attention": heads.float().mean(0),
            "rollout": query_map(rollout[0], grid, prefix, class_token=config.class_token)}
    if attributed and config.num_classes:
        maps["attribution"] = attribution(model, x, int(captured.logits[0].argmax()))[0]
    head, mask = fa.sharpest_mask(heads, mass)
    maps[f"head {head}'s mask"] = mask
    return fa.faithfulness_curves(model, x, maps, mode=mode, curves=curves, intact=captured.logits[0])


def shown_curves(app) -> tuple[str, dict[str, dict[str, np.ndarray]]]:
    """The curves' chart: its title and, per panel (x axis), each map's scores."""
    (title,) = [title for title in charts(app) if title.startswith(TITLE)]
    panels: dict[str, dict[str, np.ndarray]] = {}
    for trace in charts(app)[title]:
        panels.setdefault(trace.get("xaxis", "x"), {})[trace["name"]] = decoded(trace["y"])
    return title, panels


def assert_shown(app, expected: fa.Faithfulness) -> None:
    _, panels = shown_curves(app)
    assert len(panels) == len(expected.curves)
    for panel, curve in zip(sorted(panels), expected.curves):
        names = ["a random order" if name == fa.RANDOM else name for name in expected.names]
        assert list(panels[panel]) == names
        for name, scores in zip(names, expected.curves[curve]):
            np.testing.assert_allclose(panels[panel][name], scores.numpy(), rtol=1e-5, atol=1e-6)
    table = app.dataframe[0].value
    for curve in expected.curves:
        np.testing.assert_allclose(table[f"{curve} area"], expected.area(curve).numpy(), atol=1e-4)
    said = " ".join(element.value for element in app.markdown)
    assert expected.reading(0.1, next(iter(expected.curves))) in said


def test_the_curves_are_the_analysis_run_by_hand_on_the_pages_maps(tiny_default):
    app = open_app(PAGE)
    expected = by_hand(tiny_default)
    assert expected.names == ("last layer's attention", "rollout", "attribution", expected.names[3], fa.RANDOM)
    assert_shown(app, expected)
    assert fa.MODE_SENTENCES["drop"] in [caption.value for caption in app.caption]
    verdict = next(caption.value for caption in app.caption if "favour" in caption.value)
    assert f"the deletion curves favour {expected.best('deletion')}" in verdict.lower()


def test_the_mode_changes_the_curves_and_one_curve_alone(tiny_default):
    app = open_app(PAGE)
    _, dropped = shown_curves(app)
    widget(app.radio, "Remove a patch by").set_value("mean").run()
    assert not app.exception
    painted = by_hand(tiny_default, mode="mean")
    assert_shown(app, painted)
    assert fa.MODE_SENTENCES["mean"] in [caption.value for caption in app.caption]
    _, shown = shown_curves(app)
    assert any(not np.allclose(shown[panel][name], dropped[panel][name]) for panel in shown for name in shown[panel])
    widget(app.radio, "Curves").set_value("deletion").run()
    assert_shown(app, by_hand(tiny_default, mode="mean", curves=("deletion",)))
    title, _ = shown_curves(app)
    assert title.endswith("are removed")


def test_a_model_whose_curves_are_not_quick_gets_them_from_a_job(tiny_default, monkeypatch):
    """The tiny model as a ViT-B's would be: the attribution is not drawn unasked, so not tested; the
    curves are a job (admitted from planned_forwards) whose outputs the server scores."""
    monkeypatch.setattr(costs, "QUICK_COST", 1.0)
    app = open_app(PAGE)
    assert not [title for title in charts(app) if title.startswith(TITLE)]
    assert any("The attribution is not tested" in caption.value for caption in app.caption)
    widget(app.button, "Test the maps").click().run()
    (record,) = jobs.job_board().folder.glob("*/record.json")
    spec = json.loads(record.read_text())["spec"]
    model = vx.load_model(tiny_default)
    assert spec["kind"] == "faithfulness" and [name for name, _ in spec["settings"]["maps"]][:2] == [
        "last layer's attention", "rollout"]
    assert spec["settings"]["forwards"] == pytest.approx(fa.planned_forwards(model, 3, intact_given=True))
    run_until(app, lambda app: any(title.startswith(TITLE) for title in charts(app)))
    assert_shown(app, by_hand(tiny_default, attributed=False))


@pytest.fixture
def dinov3(tiny_default, monkeypatch):
    """A tiny random headless DINOv3-shaped default model (rotary positions, 4 registers)."""
    torch.manual_seed(0)
    weights = tiny_default.parent / "dinov3.safetensors"
    vx.save_model(vx.ViT(vx.ViTConfig(
        image_size=64, patch_size=16, embed_dim=64, depth=2, num_heads=2, num_classes=0, reg_tokens=4,
        abs_pos_embed=False, rope_type="dinov3", init_values=1e-5,
    )), weights)
    monkeypatch.setenv("VIT_EXPLORER_DEFAULT_MODEL", str(weights))
    return weights


def test_a_headless_dinov3_shaped_models_curves_follow_the_cosine_with_the_intact_embedding(dinov3):
    app = open_app(PAGE)
    expected = by_hand(dinov3)
    assert "attribution" not in expected.names and not expected.percent
    assert_shown(app, expected)
    assert any("no class attribution to test" in caption.value for caption in app.caption)
    title, _ = shown_curves(app)
    assert "The embedding's cosine with the intact one" in title


def test_the_lessons_last_step_asks_which_map_and_answers_with_the_deletion_and_insertion_curves(tiny_default):
    app = open_app("views/lesson.py")
    app.selectbox(key="lesson_step_picker").set_value(len(lesson.STEPS)).run()
    assert app.subheader[0].value == f"{len(lesson.STEPS)}. Which map should you believe?"
    said = " ".join(element.value for element in app.markdown)
    assert "which map will make the score fall fastest?" in said and "Removing the" not in said
    expected = by_hand(tiny_default)
    guess = next(name for name in expected.names if name != expected.best("deletion"))
    app.selectbox(key="lesson_answer_map").set_value(guess).run()
    assert not app.exception
    said = " ".join(element.value for element in app.markdown)
    best = expected.best("deletion")
    if best == fa.RANDOM:
        assert "No map beats a random order" in said
    else:
        assert f"**Not this time: {best} makes the score fall fastest, not {guess}.**" in said
    assert expected.reading(0.1) in said
    assert faithfulness.insertion_opinion(expected) in said
    assert_shown(app, expected)
    app.selectbox(key="lesson_answer_map").set_value(best if best != fa.RANDOM else guess).run()
    assert ("**Right:" in " ".join(e.value for e in app.markdown)) == (best != fa.RANDOM)


def test_a_model_with_a_text_tower_tests_the_top_labels_maps_by_its_cosine(tmp_path):
    """A small CLIP (both towers) with labels typed: the top label's relevance and similarity are
    tested beside the others, every curve scored by the image's cosine with that label's text."""
    from streamlit.testing.v1 import AppTest

    from textmodels import SMALL_CLIP, open_clip_folder
    from vit_explorer.app import words
    from vit_explorer.text import load_image_text_model, maps, zero_shot

    from apptest import APP

    folder = tmp_path / "clip"
    open_clip_folder(folder, SMALL_CLIP)
    key = f"file:{folder}"
    app = AppTest.from_file(APP, default_timeout=60)
    app.session_state["uploaded_models"] = {key: "Uploaded: clip"}
    app.session_state["requested_model"] = key
    app.run()
    labels = ["a cat", "a dog", "a cup"]
    app.text_input(key=words.LABELS_WIDGET).input(", ".join(labels)).run()
    app.switch_page(PAGE).run()
    assert not app.exception, app.exception
    both = load_image_text_model(folder)
    model, config = both.image, both.image.config
    x = vx.preprocess(resolve_image(app.session_state["image_key"], config.img_size)[1], config)
    captured = vx.capture(model, x, attention_dtype=torch.float16)
    prefix, grid = captured.num_prefix_tokens, captured.grid_size
    texts = both.embed_texts(zero_shot.label_prompts(labels))
    top = int(zero_shot.predict(both, captured.logits, tuple(labels), texts).scores.argmax())
    heads = query_map(captured.attentions[0, -1], grid, prefix, class_token=config.class_token)
    rollout = streamed_rollout(layer_attentions(model, vx.capture(model, x, layers=())), num_prefix_tokens=prefix)
    head, mask = fa.sharpest_mask(heads, 0.6)
    tested = {
        "last layer's attention": heads.float().mean(0),
        "rollout": query_map(rollout[0], grid, prefix, class_token=config.class_token),
        f"relevance of '{labels[top]}'": maps.relevance(both, x, texts[top])[0],
        f"head {head}'s mask": mask,
        f"similarity to '{labels[top]}'": maps.similarity_maps(
            maps.patch_embeddings(both, captured), texts[top:top + 1], grid)[0, 0],
    }
    expected = fa.faithfulness_curves(
        model, x, tested, intact=captured.logits[0], score=maps.text_score(both, texts[top]),
        what=f"the cosine with '{labels[top]}'",
    )
    assert_shown(app, expected)
    title, _ = shown_curves(app)
    assert f"The cosine with '{labels[top]}'" in title
