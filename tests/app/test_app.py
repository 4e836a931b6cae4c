"""The Streamlit app, page by page, with streamlit.testing's AppTest (no browser).

A tiny random shapes model stands in for the shipped one, so that every run is quick; the
last test runs the pages on the shipped model itself when it is there.
"""
import io
import json
import time
from pathlib import Path

import pytest
import streamlit as st
import torch
from streamlit.testing.v1 import AppTest

import vit_explorer as vx
from vit_explorer.training import train
from vit_explorer.app import costs, images, memo, models, runs, selection, session, uploads
from vit_explorer.data.datasets import SHAPE_CLASSES, shapes_sample
from apptest import (  # noqa: F401 (tiny_default: autouse)
    APP, PHOTO, SHAPES, errors, figure_titles, open_app, tiny_default, tiny_model, title_matching, uploader, widget,
)
from helpers import small_run_config

PAGES = ["views/pipeline.py", "views/patches.py", "views/attention.py", "views/train.py"]


@pytest.mark.parametrize("page", PAGES)
def test_every_page_renders_and_every_figure_has_a_title(page):
    app = open_app(page)
    assert errors(app) == []
    assert app.title[0].value == Path(page).stem.capitalize()
    assert all(title.strip() for title in figure_titles(app))
    # The sidebar names the model and counts its parameters.
    assert any("8x8 grid" in caption.value for caption in app.sidebar.caption)
    count = sum(p.numel() for p in tiny_model().parameters())
    assert any(f"{count:,} parameters" in caption.value for caption in app.sidebar.caption)


def test_pipeline_shows_real_shapes_and_top5():
    app = open_app("views/pipeline.py")
    steps = app.dataframe[0].value
    shapes = dict(zip(steps["step"], steps["shape"]))
    assert shapes["2. Cut into patches"] == "(8, 8, 3, 4, 4)"
    assert shapes["4. Linear projection"] == "(64, 32)"
    assert shapes["6. Add position embeddings"] == "(65, 32)"
    assert "Top-5 predictions" in figure_titles(app)
    assert "Patch embeddings: 64 x 32" in figure_titles(app)


def test_layer_slider_and_buttons_change_the_shown_layer():
    app = open_app("views/attention.py")
    assert "layer 3" in title_matching(app, "^Attention of the")
    widget(app.slider, "Layer").set_value(1).run()
    assert "layer 1" in title_matching(app, "^Attention of the")
    assert title_matching(app, "attention$").startswith("Layer 1, head 0")
    widget(app.button, "Previous").click().run()
    assert "layer 0" in title_matching(app, "^Attention of the")
    assert widget(app.button, "Previous").disabled
    widget(app.button, "Next").click().run()
    widget(app.button, "Next").click().run()
    assert "layer 2" in title_matching(app, "^Attention of the")


def test_query_and_head_choices_change_the_maps():
    app = open_app("views/attention.py")
    assert "class token" in title_matching(app, "^Attention of the")
    widget(app.selectbox, "Query token").set_value(9).run()
    assert "patch 9 (row 1, col 1)" in title_matching(app, "^Attention of the")
    assert "query: patch 9" in title_matching(app, "^Rollout")
    widget(app.selectbox, "Head").set_value(2).run()
    assert title_matching(app, "attention$").startswith("Layer 3, head 2: 65 x 65")


def test_attribution_follows_the_chosen_class():
    app = open_app("views/attention.py")
    class_box = widget(app.selectbox, "Class")
    predicted, runner_up = class_box.options[:2]
    assert title_matching(app, "^Attribution for") == f"Attribution for '{predicted.split(' (')[0]}'"
    class_box.select_index(1).run()  # options are ranked by probability
    name = runner_up.split(" (")[0]
    assert title_matching(app, "^Attribution for") == f"Attribution for '{name}'"


def test_moving_sliders_never_recomputes_the_forward_pass(monkeypatch):
    calls = []

    def counting_capture(*args, **kwargs):
        calls.append(1)
        return vx.capture(*args, **kwargs)

    monkeypatch.setattr(selection, "capture", counting_capture)
    app = open_app("views/attention.py")
    assert len(calls) == 1
    widget(app.slider, "Layer").set_value(0).run()
    widget(app.slider, "Overlay opacity").set_value(0.3).run()
    widget(app.selectbox, "Query token").set_value(5).run()
    widget(app.slider, "Discard the weakest share of weights").set_value(0.5).run()
    app.switch_page("views/pipeline.py").run()
    assert not app.exception
    assert len(calls) == 1
    app.switch_page("views/patches.py").run()
    widget(app.select_slider, "Patch size").set_value(8).run()
    assert len(calls) == 2  # a new patch size is a new model: one more forward pass


def keeping_captures(monkeypatch) -> list:
    captured = []

    def keeping_capture(*args, **kwargs):
        captured.append(vx.capture(*args, **kwargs))
        return captured[-1]

    monkeypatch.setattr(selection, "capture", keeping_capture)
    return captured


def computed_layers() -> list[tuple]:
    return [key[4:] for key in memo.shared_results()._entries if key[4:5] == ("attention",)]


def test_a_small_capture_keeps_every_layer_in_half_precision_and_computes_none_again(monkeypatch):
    captured = keeping_captures(monkeypatch)
    app = open_app("views/attention.py")
    assert not app.exception and len(captured) == 1
    assert captured[0].attentions.shape == (1, 4, 4, 65, 65) and captured[0].attentions.dtype == torch.float16
    widget(app.slider, "Layer").set_value(1).run()
    assert not app.exception and computed_layers() == []  # read from the capture, not computed again


def test_past_the_bound_the_app_captures_tokens_only_and_computes_the_layer_it_draws(monkeypatch):
    monkeypatch.setattr(models, "KEEP_EVERY_LAYER_BYTES", 0)  # as for a model at a high resolution
    captured = keeping_captures(monkeypatch)
    app = open_app("views/attention.py")
    assert not app.exception and len(captured) == 1
    assert captured[0].attentions.shape[1] == 0 and captured[0].tokens.dtype == torch.float32
    assert computed_layers() == [("attention", 3, None)]  # the layer drawn, not every layer
    (attention,) = [value for key, (value, _) in memo.shared_results()._entries.items() if key[4:5] == ("attention",)]
    assert attention.dtype == torch.float16 and attention.shape == (4, 65, 65)  # (heads, N, N)
    widget(app.slider, "Layer").set_value(1).run()
    assert ("attention", 1, None) in computed_layers()


def test_a_resized_model_shares_its_base_weights_and_is_evicted_before_its_base(monkeypatch):
    from vit_explorer.serving.cache import nbytes

    base = models.base_model(models.DEFAULT_MODEL)
    size = base.config.img_size
    resized = models.model_at(models.DEFAULT_MODEL, 8, size)
    assert resized.blocks[0].attn.qkv.weight.data_ptr() == base.blocks[0].attn.qkv.weight.data_ptr()
    own = models.shared_models().total_bytes - nbytes(base)
    assert 0 < own < nbytes(resized.blocks)  # counted: the resampled tensors only
    # Room for the base and one resized model: whatever needs room next (another model) evicts
    # the resized one, never the base whose storage the resized model holds.
    st.cache_resource.clear()
    monkeypatch.setattr(models, "MODELS_BYTES", nbytes(base) + 3 * own // 2)
    models.model_at(models.DEFAULT_MODEL, 8, size)
    shared = models.shared_models()
    shared.get_or_compute(("another model",), lambda: torch.zeros(own // 4))
    assert ("base", models.DEFAULT_MODEL) in shared and ("resized", models.DEFAULT_MODEL, 8, size) not in shared


def test_patch_size_changes_the_grid_everywhere():
    app = open_app("views/patches.py")
    assert title_matching(app, "^Input image as a").startswith("Input image as a 8 x 8 grid")
    widget(app.select_slider, "Patch size").set_value(8).run()
    assert title_matching(app, "^Input image as a").startswith("Input image as a 4 x 4 grid")
    assert any("resized from patch 4" in caption.value for caption in app.sidebar.caption)
    # The choice holds on the other pages.
    app.switch_page("views/attention.py").run()
    assert title_matching(app, "attention$").endswith("17 x 17 attention")
    app.switch_page("views/patches.py").run()
    assert widget(app.select_slider, "Patch size").value == 8


def test_a_new_model_starts_at_its_own_patch_size(tmp_path):
    path = tmp_path / "other.safetensors"
    vx.save_model(tiny_model(embed_dim=16), path)
    app = open_app("views/patches.py")
    widget(app.select_slider, "Patch size").set_value(8).run()
    app.file_uploader(key="checkpoint_upload").set_value(
        (path.name, path.read_bytes(), "application/octet-stream")
    ).run()
    assert errors(app) == []
    assert widget(app.select_slider, "Patch size").value == 4
    assert title_matching(app, "^Input image as a").startswith("Input image as a 8 x 8 grid")


def test_predictions_at_each_patch_size_use_the_resized_model():
    model = tiny_model()
    image, _ = vx.data.datasets.shapes_sample(0, 32)
    rows = costs.predictions_by_patch_size(model, image)
    assert [row["patch size"] for row in rows] == [2, 4, 8, 16, 32]
    assert [row["tokens"] for row in rows] == [257, 65, 17, 5, 2]
    for row in rows:
        resized = vx.resize_model(model, patch_size=row["patch size"])
        with torch.no_grad():
            expected = resized(vx.preprocess(image, resized.config)).softmax(-1)[0]
        assert row["probability"] == pytest.approx(float(expected.max()), abs=1e-5)
        assert row["prediction"] == SHAPE_CLASSES[int(expected.argmax())]
        assert row["forward ms"] > 0


def test_held_out_accuracy_at_each_patch_size_matches_the_resized_model():
    model = tiny_model()
    dataset = costs.held_out_set(model.config)
    assert len(dataset) == costs.HELD_OUT_IMAGES and costs.has_held_out(model.config)
    accuracy = costs.held_out_accuracy_by_patch_size(model, dataset)
    assert sorted(accuracy) == [2, 4, 8, 16, 32]
    resized = vx.resize_model(model, patch_size=8)
    x = (dataset.images.float() / 255 - 0.5) / 0.25
    with torch.no_grad():
        expected = (resized(x).argmax(-1) == dataset.labels).float().mean()
    assert accuracy[8] == pytest.approx(float(expected))
    assert not costs.has_held_out(tiny_model(num_classes=3, class_names=("a", "b", "c")).config)


def test_the_patches_page_shows_the_trade_off_of_every_patch_size():
    app = open_app("views/patches.py")
    title_matching(app, "^The same weights at every patch size")
    (table,) = app.dataframe
    assert list(table.value["patch size"]) == [2, 4, 8, 16, 32]
    assert list(table.value["tokens"]) == [257, 65, 17, 5, 2]
    assert (table.value["forward ms"] > 0).all()
    assert table.value["held-out accuracy"].between(0, 1).all()
    assert not any(button.label.startswith("Compare all") for button in app.button)


def test_a_bad_image_upload_says_why_and_keeps_the_previous_image():
    app = open_app("views/attention.py")
    app.file_uploader(key="image_upload").set_value(("notes.png", b"just some text", "image/png")).run()
    assert not app.exception
    assert len(errors(app)) == 1 and errors(app)[0].startswith("Could not use notes.png:")
    assert app.selectbox(key="image_picker").value == images.DEFAULT_IMAGE
    assert title_matching(app, "^Attention of the")  # the page still works


def test_an_image_upload_becomes_the_image():
    app = open_app("views/pipeline.py")
    app.file_uploader(key="image_upload").set_value(("cat.png", PHOTO.read_bytes(), "image/png")).run()
    assert errors(app) == []
    assert app.selectbox(key="image_picker").value.startswith("upload:")
    assert app.sidebar.image[0].captions == ["451x300 px as given"]


def test_a_bad_checkpoint_upload_says_why_and_keeps_the_model():
    app = open_app("views/pipeline.py")
    upload = ("broken.safetensors", b"\x00" * 64, "application/octet-stream")
    app.file_uploader(key="checkpoint_upload").set_value(upload).run()
    assert not app.exception
    assert len(errors(app)) == 1 and "broken.safetensors" in errors(app)[0]
    assert app.selectbox(key="model_picker").value == "default"


def test_a_checkpoint_without_class_token_on_a_wide_image_with_registers(tmp_path):
    path = tmp_path / "wide.safetensors"
    vx.save_model(
        tiny_model(image_size=(32, 48), class_token=False, global_pool="mean", reg_tokens=2), path
    )
    app = open_app("views/attention.py")
    app.file_uploader(key="checkpoint_upload").set_value(
        (path.name, path.read_bytes(), "application/octet-stream")
    ).run()
    assert errors(app) == []
    assert app.selectbox(key="model_picker").value.startswith("file:")
    # 8 x 12 grid, 2 registers, no class token: the query is a patch (the centre by default).
    assert "patch 54 (row 4, col 6)" in title_matching(app, "^Attention of the")
    assert title_matching(app, "attention$").endswith("98 x 98 attention")
    for page in PAGES:
        app.switch_page(page).run()
        assert not app.exception and errors(app) == [], page


def test_pretrained_offline_says_so_and_keeps_the_previous_model(monkeypatch, tmp_path):
    from vit_explorer.weights import catalogue

    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))  # nothing downloaded yet
    monkeypatch.setenv(catalogue.TORCHVISION_URL_VARIABLE, "http://127.0.0.1:9")  # discard port: refused
    app = open_app("views/pipeline.py")
    app.selectbox(key="model_picker").set_value(models.PRETRAINED_MODEL).run()
    assert not app.exception
    (error,) = errors(app)
    assert error.startswith("Could not load that model: could not download ImageNet ViT-B/16 (torchvision)")
    assert "(no internet?)" in error and "\n" not in error
    assert app.selectbox(key="model_picker").value == "default"
    assert app.session_state["model_key"] == "default"


def test_a_one_epoch_training_run_produces_metrics_and_becomes_the_model():
    app = open_app("views/train.py")
    widget(app.number_input, "Epochs").set_value(1)
    widget(app.number_input, "Training images (0: the whole dataset)").set_value(256)
    widget(app.number_input, "Batch size").set_value(64)
    widget(app.text_input, "Patch sizes (FlexiViT)").set_value("4, 8")
    widget(app.button, "Launch training").click().run()
    assert not app.exception and errors(app) == []
    (run,) = runs.training_runs().values()
    assert run.config.patch_sizes == (4, 8)
    assert run.join(timeout=120) and run.status == "finished", run.error
    assert run.peak_rss is not None  # it trained in a process of its own
    app.run()
    metrics = {metric.label: metric.value for metric in app.metric}
    assert metrics["Step"] == "4 / 4"
    assert metrics["Test accuracy"].endswith("%")
    assert title_matching(app, "^Training: step 4 of 4")
    widget(app.button, "Explore this model").click().run()
    assert app.session_state["model_key"] == f"file:{run.checkpoint}"
    assert app.selectbox(key="model_picker").value == f"file:{run.checkpoint}"


def test_an_impossible_custom_model_is_refused_with_a_sentence():
    app = open_app("views/train.py")
    widget(app.selectbox, "Model size").set_value("custom")
    widget(app.number_input, "Patch size").set_value(5)  # does not tile 32 x 32 images
    widget(app.button, "Launch training").click().run()
    assert not app.exception
    assert errors(app) == ["Cannot train that: image size 32x32 is not divisible by patch size 5"]
    assert runs.training_runs() == {}


def test_a_model_too_large_for_the_server_is_refused_before_it_starts():
    app = open_app("views/train.py")
    widget(app.selectbox, "Model size").set_value("custom")
    for label, value in [("Patch size", 1), ("Dim", 1024), ("Depth", 24), ("Heads", 16), ("Batch size", 4096)]:
        widget(app.number_input, label).set_value(value)
    widget(app.button, "Launch training").click().run()
    assert not app.exception
    (error,) = errors(app)
    assert error.startswith("This run would need about ") and "a run may use on this server" in error
    assert "lower the batch size (4096), use a larger patch size (patch 1 gives 1025 tokens" in error
    assert runs.training_runs() == {}


def launch(app: AppTest, epochs: int) -> None:
    widget(app.number_input, "Epochs").set_value(epochs)
    widget(app.number_input, "Training images (0: the whole dataset)").set_value(256)
    widget(app.button, "Launch training").click().run()
    assert not app.exception and errors(app) == []


def progress_texts(app: AppTest) -> list[str]:
    return [element.proto.text for element in app.get("progress")]


def test_runs_wait_their_turn_and_only_their_owner_stops_them(monkeypatch):
    monkeypatch.setenv("VIT_EXPLORER_MAX_RUNS", "1")
    alice = open_app("views/train.py")
    assert runs.OWNER_PARAM not in alice.query_params  # no token in an address that may be shared
    launch(alice, epochs=200)
    token = alice.query_params[runs.OWNER_PARAM]
    assert token  # created with her first run
    launch(alice, epochs=1)
    assert "run 2 queued: 1st in line; it starts by itself when a slot frees" in progress_texts(alice)
    assert widget(alice.button, "Withdraw")

    # Someone else watches alice's run but cannot stop it.
    bob = open_app("views/train.py")
    assert bob.query_params.get(runs.OWNER_PARAM) != token
    bob.selectbox(key="watched_run").set_value("run 1").run()
    assert bob.selectbox(key="watched_run").options == [
        f"run {number}: shapes, tiny model (read-only)" for number in (1, 2)
    ]
    assert [button.label for button in bob.button if button.label in ("Stop", "Withdraw")] == []
    assert any("only they can stop it" in caption.value for caption in bob.caption)

    # Alice reloads the page: her token is in its address, and her Stop button is back.
    again = AppTest.from_file(APP, default_timeout=60)
    again.query_params[runs.OWNER_PARAM] = token
    again.run().switch_page("views/train.py").run()
    again.selectbox(key="watched_run").set_value("run 1").run()
    run = runs.training_runs()["run 1"]
    widget(again.button, "Stop").click().run()
    assert run.join(timeout=60) and run.status == "stopped", run.error
    assert runs.run_manager().place("run 2") is None  # it started when the slot freed
    assert runs.training_runs()["run 2"].join(timeout=120)


@pytest.mark.parametrize("sizes, error", [
    ("4,5", "patch size 5 does not tile 32x32 images; FlexiViT patch sizes must divide the image size"),
    ("4,eight", "'4,eight' is not a list of patch sizes; give positive whole numbers separated by commas, like 4,8,16"),
])
def test_flexivit_patch_sizes_that_cannot_work_are_refused_with_a_sentence(sizes, error):
    app = open_app("views/train.py")
    widget(app.text_input, "Patch sizes (FlexiViT)").set_value(sizes)
    widget(app.button, "Launch training").click().run()
    assert not app.exception
    assert errors(app) == [f"Cannot train that: {error}"]
    assert runs.training_runs() == {}


@pytest.mark.skipif(not train.DEFAULT_WEIGHTS.is_file(), reason="the shipped model is not there yet")
def test_the_shipped_model_explores_offline(monkeypatch):
    monkeypatch.delenv("VIT_EXPLORER_DEFAULT_MODEL")  # the shipped model
    st.cache_resource.clear()
    st.cache_data.clear()
    for page in PAGES:
        app = open_app(page)
        assert errors(app) == [], page


def test_what_is_quick_is_decided_from_the_shortest_pass_timed(monkeypatch):
    times = costs.PassTimes(size=2)
    monkeypatch.setattr(costs, "pass_times", lambda: times)
    config = tiny_model().config
    assert costs.is_quick(config, forwards=100)  # not timed yet: its multiply-adds say so
    times.record(config, 0.1)
    assert costs.is_quick(config) and not costs.is_quick(config, forwards=2)  # 0.2 s: more than QUICK_SECONDS
    times.record(config.replace(image_size=(32, 32)), 1.0)  # the same shape timed on a busy moment
    assert times.seconds(config) == 0.1 and costs.is_quick(config)  # the shortest is kept: nothing flips
    times.record(config.replace(patch_size=2), 0.5)
    times.record(config.replace(patch_size=8), 0.5)
    assert times.measured(config) is None  # bounded: the least recently recorded shape forgotten
    # ... and estimated from the nearest size timed (patch 8's 17 tokens rather than patch 2's 257)
    nearest = config.replace(patch_size=8)
    assert times.seconds(config) == pytest.approx(0.5 * costs.cost.pass_cost(config) / costs.cost.pass_cost(nearest))


def test_a_page_times_its_capture_and_the_sweep_is_a_job_when_that_pass_is_slow(monkeypatch):
    """The multiply-adds of the tiny model's sweep are quick; its pass timed on a server where no
    pass is quick makes the sweep a job."""
    times = costs.PassTimes()
    monkeypatch.setattr(costs, "pass_times", lambda: times)
    monkeypatch.setattr(costs, "QUICK_SECONDS", 0)
    config = tiny_model().config
    assert costs.is_quick(config, forwards=vx.sweep_cost(config))
    app = open_app()  # Pipeline's capture, timed; Knock-out's own passes are not
    app.switch_page("views/knockout.py").run()
    assert not app.exception
    assert times.measured(config) > 0  # the page's capture, timed
    assert errors(app) == [] and [button.label for button in app.button if button.label == "Run the sweep"]


def test_a_real_size_model_runs_only_what_the_view_shows(monkeypatch):
    """With a model too large for unasked work (the bar set to zero here), a view costs one
    forward pass; the all-patch-sizes comparison and the attribution wait to be asked for, and
    widgets and page switches cost none."""
    monkeypatch.setattr(costs, "QUICK_COST", 0)
    forwards = []
    original = vx.ViT.forward_features
    monkeypatch.setattr(vx.ViT, "forward_features", lambda self, x, patch_size=None: forwards.append(1) or original(self, x, patch_size))
    app = open_app("views/patches.py")
    # The capture, whose pass is timed to say how long the comparison takes: no pass more.
    assert len(forwards) == 1
    assert any(button.label.startswith("Compare all") for button in app.button)
    assert not any(title.startswith("The same weights at every patch size") for title in figure_titles(app))
    app.switch_page("views/attention.py").run()
    widget(app.slider, "Layer").set_value(0).run()
    widget(app.selectbox, "Head").set_value(1).run()
    app.switch_page("views/pipeline.py").run()
    assert not app.exception and len(forwards) == 1
    assert not any(title.startswith("Attribution for") for title in figure_titles(app.switch_page("views/attention.py").run()))
    app.toggle(key="attribution_on").set_value(True).run()
    assert len(forwards) == 2 and title_matching(app, "^Attribution for")
    app.switch_page("views/patches.py").run()
    compare = next(button for button in app.button if button.label.startswith("Compare all"))
    compare.click().run()
    # Every patch size's passes and the held-out batches (this model's first comparison: nobody has
    # timed it yet) run in a job's worker, beside the server.
    deadline = time.monotonic() + 120
    while "The same weights at every patch size" not in " ".join(figure_titles(app)):
        assert time.monotonic() < deadline and not app.exception, [error.value for error in app.error]
        time.sleep(0.5)
        app.run()
    assert len(forwards) == 2
    app.switch_page("views/pipeline.py").run()
    app.switch_page("views/patches.py").run()  # the comparison stays, without running again
    assert len(forwards) == 2 and not app.exception
    assert title_matching(app, "^The same weights at every patch size")
    assert not any(button.label.startswith("Compare all") for button in app.button)


@pytest.mark.parametrize("changes", [
    dict(num_classes=0, class_names=None),  # DINO, DINOv2, CLIP
    dict(num_classes=0, class_names=None, class_token=False, global_pool="map"),  # SigLIP
    dict(dist_token=True),  # DeiT distilled
])
def test_every_page_renders_for_the_new_families(tmp_path, changes):
    path = tmp_path / "family.safetensors"
    vx.save_model(tiny_model(**changes), path)
    app = open_app("views/pipeline.py")
    app.file_uploader(key="checkpoint_upload").set_value(
        (path.name, path.read_bytes(), "application/octet-stream")
    ).run()
    assert errors(app) == []
    headless = changes.get("num_classes") == 0
    for page in PAGES:
        app.switch_page(page).run()
        assert not app.exception and errors(app) == [], page
        infos = [info.value for info in app.info]
        if headless and page != "views/train.py":
            # Each view that needs classes says in one line why it is absent.
            assert any("no classification head (num_classes=0)" in info for info in infos), page
    app.switch_page("views/attention.py").run()
    assert title_matching(app, "^Patches holding 60% of the")
    assert title_matching(app, "^Token norms")
    if changes.get("global_pool") == "map":
        assert "attention-pool probe in the pooling head" in title_matching(app, "^Attention of the")
        assert "attention-pool probe" in title_matching(app, "^Rollout")


def test_an_uploaded_shapes_picture_is_not_taken_for_a_photo():
    picture = io.BytesIO()
    shapes_sample(0, (32, 32))[0].save(picture, format="PNG")
    app = open_app("views/pipeline.py")
    uploader(app, "image_upload").set_value(("shapes.png", picture.getvalue(), "image/png")).run()
    assert not app.exception and app.session_state["image_key"].startswith("upload:")
    assert not app.sidebar.warning
    uploader(app, "image_upload").set_value(("cat.png", PHOTO.read_bytes(), "image/png")).run()
    (warning,) = [warning.value for warning in app.sidebar.warning]
    assert warning.startswith("This model was trained on synthetic shapes")


def test_a_photo_on_the_shapes_model_says_why_and_offers_the_catalogue():
    app = open_app("views/pipeline.py")
    app.selectbox(key="image_picker").set_value("photo:chelsea.png").run()
    assert not app.exception
    (warning,) = [warning.value for warning in app.sidebar.warning]
    assert warning.startswith("This model was trained on synthetic shapes at 32x32 pixels")
    # Which catalogue models it offers, and when: tests/app/test_app_patches.py.
    options = app.selectbox(key="model_picker").options
    assert any("SigLIP ViT-B/16" in option for option in options)


def test_a_catalogue_model_offline_says_so_in_one_sentence(monkeypatch, tmp_path):
    from vit_explorer.weights import catalogue

    monkeypatch.setenv(catalogue.CACHE_VARIABLE, str(tmp_path / "cache"))
    monkeypatch.setenv(catalogue.HUB_URL_VARIABLE, "http://127.0.0.1:9")  # discard port: refused
    app = open_app("views/attention.py")
    app.selectbox(key="model_picker").set_value("pretrained:dino_vits16").run()
    assert not app.exception
    (error,) = errors(app)
    assert error.startswith("Could not load that model: could not download DINO ViT-S/16")
    assert "(no internet?)" in error and "\n" not in error
    assert app.session_state["model_key"] == "default"


def test_a_model_under_terms_to_accept_names_them_before_it_downloads(monkeypatch, tmp_path):
    from vit_explorer.weights import catalogue

    monkeypatch.setenv(catalogue.CACHE_VARIABLE, str(tmp_path / "cache"))
    monkeypatch.setenv(catalogue.HUB_URL_VARIABLE, "http://127.0.0.1:9")  # discard port: refused
    app = open_app("views/pipeline.py")
    app.selectbox(key="model_picker").set_value("pretrained:dinov3_vits16").run()
    assert not app.exception and errors(app) == [] and app.session_state["model_key"] == "default"
    (notice,) = [warning.value for warning in app.warning if "DINOv3 License" in warning.value]
    assert notice.startswith("DINOv3 ViT-S/16's weights are published under the DINOv3 License (Meta), not Apache")
    widget(app.button, "Cancel").click().run()
    assert not [warning for warning in app.warning if "DINOv3 License" in warning.value]

    app.selectbox(key="model_picker").set_value("pretrained:dinov3_vits16").run()
    widget(app.button, "Accept and download").click().run()
    (error,) = errors(app)  # it tried: offline here
    assert error.startswith("Could not load that model: could not download DINOv3 ViT-S/16")
    assert app.session_state["model_key"] == "default"


def test_uploads_share_a_quota_and_the_oldest_go_first(monkeypatch):
    monkeypatch.setattr(uploads, "UPLOADS_QUOTA_BYTES", 6000)
    app = open_app("views/pipeline.py")
    pictures = []
    for index in range(3):
        image, _ = vx.data.datasets.shapes_sample(index, 32)
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        pictures.append(buffer.getvalue())
    assert all(2000 < len(picture) < 3000 for picture in pictures), [len(p) for p in pictures]
    uploader(app, "image_upload").set_value(("first.png", pictures[0], "image/png")).run()
    first = app.session_state["image_key"]
    for name, picture in (("second.png", pictures[1]), ("third.png", pictures[2])):
        uploader(app, "image_upload").set_value((name, picture, "image/png")).run()
    assert errors(app) == [] and app.session_state["image_key"] != first
    assert sum(path.stat().st_size for path in uploads.UPLOADS_DIR.iterdir()) <= 6000
    assert first not in app.selectbox(key="image_picker").options  # removed to make room
    too_big = ("huge.png", pictures[0] + b"\0" * 6000, "image/png")
    uploader(app, "image_upload").set_value(too_big).run()
    (error,) = errors(app)
    assert error.startswith("That upload is 0 MB, more than this server keeps for all uploads")


def test_the_input_size_can_change_and_a_too_large_one_is_refused():
    app = open_app("views/attention.py")
    app.number_input(key="input_height").set_value(48).run()
    app.number_input(key="input_width").set_value(64).run()
    assert not app.exception and errors(app) == []
    assert any("48x64 px input, patch 4 -> 12x16 grid" in caption.value for caption in app.sidebar.caption)
    assert title_matching(app, "^Layer 3, head 0").startswith("Layer 3, head 0: 193 x 193 attention")
    app.switch_page("views/patches.py").run()
    assert title_matching(app, "^Input image as a").startswith("Input image as a 12 x 16 grid")
    app.number_input(key="input_width").set_value(4000).run()
    (error,) = errors(app)
    assert "one view of it would hold" in error and "more than the 640 MB this app allows; choose a smaller size" in error
    assert title_matching(app, "^Input image as a").startswith("Input image as a 8 x 8 grid")
    app.number_input(key="input_width").set_value(30).run()
    assert errors(app)[0].startswith("The input size must be a multiple of the patch size (4 px)")


def test_the_owner_token_survives_moving_between_pages_and_a_reload():
    app = open_app("views/train.py")
    launch(app, epochs=200)
    token = app.query_params[runs.OWNER_PARAM]
    # Streamlit's page navigation drops the address's parameters.
    app.query_params.clear()
    app.switch_page("views/attention.py").run()
    assert app.query_params[runs.OWNER_PARAM] == token
    app.query_params.clear()
    app.switch_page("views/train.py").run()
    assert app.query_params[runs.OWNER_PARAM] == token
    assert widget(app.button, "Stop")
    assert not any("only they can stop it" in caption.value for caption in app.caption)
    # A reload: a new session with the address it had.
    again = AppTest.from_file(APP, default_timeout=60)
    again.query_params[runs.OWNER_PARAM] = token
    again.run().switch_page("views/train.py").run()
    run = runs.training_runs()["run 1"]
    widget(again.button, "Stop").click().run()
    if run.status == "running":  # the page says the stop was heard while the run winds down
        bars = [bar.proto.text for bar in again.get("progress")]
        assert any(text.startswith("run 1 stopping at ") for text in bars), bars
        assert not [button for button in again.button if button.label == "Stop"]
    assert run.join(timeout=60) and run.status == "stopped", run.error


def test_the_chosen_image_survives_a_reload():
    app = open_app("views/attention.py")
    assert app.selectbox(key="image_picker").value == images.DEFAULT_IMAGE
    assert session.IMAGE_PARAM not in app.query_params  # the default needs no parameter
    app.selectbox(key="image_picker").set_value("shapes:2").run()
    assert app.query_params[session.IMAGE_PARAM] == "shapes:2"
    again = AppTest.from_file(APP, default_timeout=60)
    again.query_params[session.IMAGE_PARAM] = "shapes:2"
    again.run().switch_page("views/attention.py").run()
    assert not again.exception
    assert again.selectbox(key="image_picker").value == "shapes:2"


@pytest.mark.parametrize("image_key", ["shapes:99", "shapes:-1", "photo:missing.png", "upload:0123abcd", "nonsense"])
def test_an_unknown_image_in_the_address_falls_back_to_the_default(image_key):
    app = AppTest.from_file(APP, default_timeout=60)
    app.query_params[session.IMAGE_PARAM] = image_key
    app.run()
    assert not app.exception and errors(app) == []
    assert app.selectbox(key="image_picker").value == images.DEFAULT_IMAGE
    assert session.IMAGE_PARAM not in app.query_params


def test_an_uploaded_image_survives_a_reload():
    app = open_app("views/pipeline.py")
    app.file_uploader(key="image_upload").set_value(("cat.png", PHOTO.read_bytes(), "image/png")).run()
    image_key = app.session_state["image_key"]
    assert app.query_params[session.IMAGE_PARAM] == image_key
    again = AppTest.from_file(APP, default_timeout=60)
    again.query_params[session.IMAGE_PARAM] = image_key
    again.run()
    assert not again.exception
    assert again.selectbox(key="image_picker").value == image_key


def test_a_width_only_input_size_change_takes_effect_and_keeps_the_expander():
    app = open_app("views/patches.py")
    labels = [expander.label for expander in app.sidebar.expander]
    app.number_input(key="input_width").set_value(64).run()
    assert not app.exception and errors(app) == []
    assert any("32x64 px input, patch 4 -> 8x16 grid" in caption.value for caption in app.sidebar.caption)
    assert title_matching(app, "^Input image as a").startswith("Input image as a 8 x 16 grid")
    # The same label: Streamlit keeps the expander (and whether it is open) across the edit.
    assert [expander.label for expander in app.sidebar.expander] == labels


def test_a_preset_fills_in_the_numbers_and_an_edited_number_makes_the_model_custom():
    app = open_app("views/train.py")
    widget(app.selectbox, "Model size").set_value("small").run()
    shown = {label: widget(app.number_input, label).value for label in ("Patch size", "Dim", "Depth", "Heads")}
    assert shown == {"Patch size": 4, "Dim": 128, "Depth": 6, "Heads": 4}
    widget(app.selectbox, "Model size").set_value("tiny").run()
    widget(app.number_input, "Depth").set_value(2).run()
    assert widget(app.selectbox, "Model size").value == "custom"
    widget(app.number_input, "Epochs").set_value(1)
    widget(app.number_input, "Training images (0: the whole dataset)").set_value(64)
    widget(app.button, "Launch training").click().run()
    assert not app.exception and errors(app) == []
    (run,) = runs.training_runs().values()
    model = train.model_config(run.config)
    assert (model.patch_size, model.embed_dim, model.depth, model.num_heads, model.mlp_ratio) == (8, 64, 2, 4, 2.0)
    assert run.join(timeout=120), run.error


def test_a_run_trains_rotary_positions_when_chosen():
    app = open_app("views/train.py")
    positions = widget(app.radio, "Positions")
    assert positions.options == ["learned (ViT)", "rotary (DINOv3)"] and positions.value == "learned"
    assert "fit any grid" in positions.help
    positions.set_value("rotary")
    launch(app, epochs=1)
    (run,) = runs.training_runs().values()
    assert run.config.positions == "rotary" and train.model_config(run.config).rope_type == "dinov3"
    assert app.selectbox(key="watched_run").options == ["run 1: shapes, tiny model, rotary positions"]
    assert run.join(timeout=120) and run.status == "finished", run.error


def test_ended_runs_are_tested_at_each_image_size_on_request():
    # Two ended runs in the runs folder, trained here in-process: learned and rotary positions.
    for number, positions in enumerate(("learned", "rotary"), start=1):
        config = small_run_config(runs.RUNS_DIR, epochs=1, positions=positions, name=f"vit_shapes_{number}", snapshot_every=0)
        list(train.train(config))
    app = open_app("views/train.py")
    app.selectbox(key="watched_run").set_value("run 1").run()
    assert any("Tests 500 test images at each of 16x16, 24x24, 32x32 px" in caption.value for caption in app.caption)
    widget(app.button, "Test at each image size").click().run()
    assert not app.exception and errors(app) == []
    assert title_matching(app, "^Test accuracy at each input size") == "Test accuracy at each input size (trained at 16x16)"
    assert not [button for button in app.button if button.label == "Test at each image size"]

    app.selectbox(key="watched_run").set_value("run 2").run()
    widget(app.button, "Test at each image size").click().run()
    assert not app.exception
    assert errors(app) == []
    (chart,) = app.get("plotly_chart")[-1:]
    lines = json.loads(chart.proto.spec)["data"]
    assert [line["name"] for line in lines] == ["run 1 (learned)", "run 2 (rotary)"]


def test_the_train_page_says_what_a_run_gets(monkeypatch):
    monkeypatch.setenv("VIT_EXPLORER_RUN_THREADS", "3")
    app = open_app("views/train.py")
    help_text = widget(app.number_input, "Training images (0: the whole dataset)").help
    assert "3 CPU threads at low priority" in help_text
    assert "2-core CPU" not in help_text


@pytest.mark.skipif(not train.DEFAULT_WEIGHTS.is_file(), reason="the shipped model is not there yet")
def test_the_app_opens_on_a_sample_the_shipped_model_gets_right_and_is_sure_of():
    model = vx.load_model(train.DEFAULT_WEIGHTS).eval()
    image, label = shapes_sample(int(images.DEFAULT_IMAGE.removeprefix("shapes:")), model.config.img_size)
    with torch.no_grad():
        probabilities = model(vx.preprocess(image, model.config)).softmax(-1)[0]
    assert SHAPE_CLASSES[int(probabilities.argmax())] == label
    assert float(probabilities.max()) > 0.9
