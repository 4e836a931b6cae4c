"""The Attention page decides with app/costs.py what runs in the server: a model whose view is quick
draws the rollout and every head's distance and entropy with the page; one whose view with those
measures is heavy gets them from a job, and the rollout from one too where the view is heavy
without them, each drawn as the server would have drawn it."""
import json

import pytest
from streamlit.testing.v1 import AppTest

import vit_explorer as vx

from apptest import APP, errors, open_app, tiny_default, tiny_model, widget  # noqa: F401
from apptest import assert_same_charts, charts, run_until
from vit_explorer.app import costs, jobs, memo, selection

PAGE = "views/attention.py"
ROLLOUT_BUTTON, STATISTICS_BUTTON = "Roll the attention out", "Measure every head"
STATISTICS = ("Mean attention distance per head", "Attention entropy per head")


def first_view() -> AppTest:
    """The page's first view with nothing computed for the picture: opened on it, not on the
    Pipeline page (whose caveat measures every head)."""
    memo.shared_results().clear()
    app = AppTest.from_file(APP, default_timeout=60).switch_page(PAGE).run()
    assert not app.exception, app.exception
    return app


def rollout_charts(app) -> dict[str, list[dict]]:
    return {title: traces for title, traces in charts(app).items() if title.startswith("Rollout through all")}


def statistics_charts(app) -> dict[str, list[dict]]:
    return {title: traces for title, traces in charts(app).items() if title in STATISTICS}


def job_buttons(app) -> list[str]:
    return [button.label for button in app.button if button.label in (ROLLOUT_BUTTON, STATISTICS_BUTTON)]


def asked_kinds() -> list[str]:
    return sorted(json.loads(record.read_text())["spec"]["kind"] for record in jobs.job_board().folder.glob("*/record.json"))


def computed_nowhere_here(monkeypatch) -> None:
    """From now on the server may not roll out or measure the heads: a job must."""
    def refused(*args, **kwargs):
        raise AssertionError("computed in the server")

    monkeypatch.setattr(selection, "streamed_rollout", refused)
    monkeypatch.setattr(selection, "captured_head_statistics", refused)


@pytest.fixture
def patch_2(tiny_default, monkeypatch):
    """The tiny model at patch 2 (257 tokens) as the default: with the bar of QUICK_COST lowered, its
    view is heavy even without the heads' measures, its capture made or not."""
    weights = tiny_default.parent / "patch_2.safetensors"
    vx.save_model(tiny_model(patch_size=2), weights)
    monkeypatch.setenv("VIT_EXPLORER_DEFAULT_MODEL", str(weights))
    return weights


def test_a_quick_view_draws_the_rollout_and_every_heads_measures_with_the_page():
    app = first_view()
    assert errors(app) == [] and job_buttons(app) == []
    assert len(rollout_charts(app)) == 1 and len(statistics_charts(app)) == 2


def test_the_measures_alone_are_a_job_where_only_they_make_the_view_heavy(monkeypatch):
    """The tiny model as a ViT-B's would be (no view of it quick): its view is 3.6 passes with the
    measures, 2.8 without, so the rollout stays in the server and the measures are a job, the same
    on every rerun; once done they are drawn as the server draws them."""
    expected = statistics_charts(first_view())
    monkeypatch.setattr(costs, "QUICK_COST", 1.0)
    config = tiny_model().config
    assert costs.is_heavy(config, costs.attention_view_forwards(config, statistics=True))
    assert not costs.is_heavy(config, costs.attention_view_forwards(config))
    app = first_view()
    assert errors(app) == [] and job_buttons(app) == [STATISTICS_BUTTON]
    assert len(rollout_charts(app)) == 1 and statistics_charts(app) == {}
    assert any("With every head measured" in markdown.value for markdown in app.markdown)
    computed_nowhere_here(monkeypatch)
    widget(app.slider, "Layer").set_value(0).run()  # a rerun, the capture made: still a job
    assert job_buttons(app) == [STATISTICS_BUTTON]
    widget(app.button, STATISTICS_BUTTON).click().run()
    run_until(app, statistics_charts)
    assert errors(app) == [] and asked_kinds() == ["head statistics"]
    assert_same_charts(statistics_charts(app), expected)


def test_the_rollout_is_a_job_too_where_the_view_is_heavy_without_the_measures(patch_2, monkeypatch):
    """Both are jobs and the rest of the page is drawn meanwhile (the curves, which test the rollout,
    wait for it); each is drawn as the server draws it once done."""
    inline = first_view()
    expected_rollout, expected_statistics = rollout_charts(inline), statistics_charts(inline)
    assert len(expected_rollout) == 1 and len(expected_statistics) == 2
    monkeypatch.setattr(costs, "QUICK_COST", 1.0)
    computed_nowhere_here(monkeypatch)
    app = first_view()
    assert errors(app) == [] and job_buttons(app) == [ROLLOUT_BUTTON, STATISTICS_BUTTON]
    assert rollout_charts(app) == {} and statistics_charts(app) == {}
    assert any("the curves come once it is computed above" in caption.value for caption in app.caption)
    assert any(title.startswith("Token norms") for title in charts(app))  # the page goes on below
    widget(app.button, ROLLOUT_BUTTON).click().run()
    widget(app.button, STATISTICS_BUTTON).click().run()
    run_until(app, lambda app: rollout_charts(app) and statistics_charts(app))
    assert errors(app) == [] and asked_kinds() == ["head statistics", "rollout"]
    assert_same_charts(rollout_charts(app), expected_rollout)
    assert_same_charts(statistics_charts(app), expected_statistics)
    assert not any("the curves come once" in caption.value for caption in app.caption)


def test_measures_another_page_made_are_drawn_without_a_job(patch_2, monkeypatch):
    monkeypatch.setattr(costs, "QUICK_COST", 1.0)
    app = open_app().switch_page(PAGE).run()  # through the Pipeline page, whose caveat measures every head
    assert not app.exception and errors(app) == [] and job_buttons(app) == [ROLLOUT_BUTTON] and len(statistics_charts(app)) == 2
    assert not any("With every head measured" in markdown.value for markdown in app.markdown)
