"""The Patches page's patch-size comparison and the sidebar's model picker, with AppTest.

Uses test_app's tiny default model (its autouse fixture) and helpers.
"""
import io
import socket
import threading

import pytest
import torch

import vit_explorer as vx
from vit_explorer.weights import catalogue
from vit_explorer.app import costs, memo, models, selection
from vit_explorer.data.datasets import shapes_sample
from apptest import counting_forwards, errors, open_app, tiny_default, tiny_model, title_matching  # noqa: F401
from apptest import assert_same_charts, charts, run_until

HEADLESS = dict(num_classes=0, class_names=None)


def upload(app, model: vx.ViT, tmp_path, name: str = "upload.safetensors"):
    path = tmp_path / name
    vx.save_model(model, path)
    app.file_uploader(key="checkpoint_upload").set_value((path.name, path.read_bytes(), "application/octet-stream")).run()
    assert errors(app) == []
    return app


# --- the comparison --------------------------------------------------------------------------


def test_each_patch_size_is_warmed_up_then_timed_by_the_median_of_the_plan(monkeypatch):
    model = tiny_model()
    plan = costs.comparison_plan(model.config)
    assert {planned.timed_passes for planned in plan} <= {1, costs.TIMED_PASSES}
    assert any(planned.timed_passes == costs.TIMED_PASSES for planned in plan)
    calls = counting_forwards(monkeypatch)
    seen = []
    rows = costs.predictions_by_patch_size(model, shapes_sample(0, 32)[0], lambda done, text: seen.append((done, text)))
    per_size = [(1 + planned.timed_passes) for planned in plan]
    tokens = [models.token_count(model.config, planned.patch_size) for planned in plan]
    assert calls == [(1, count) for count, passes in zip(tokens, per_size) for _ in range(passes)]
    assert [row["tokens"] for row in rows] == tokens
    # The bar moves forward, names every size before it runs, and ends full.
    fractions = [done for done, _ in seen]
    assert fractions == sorted(fractions) and fractions[0] == 0 and fractions[-1] == 1
    assert [text.split(" (")[0] for _, text in seen[:-1]] == [
        f"Timing patch {planned.patch_size}" for planned in plan
    ]


def test_the_wait_is_timed_from_the_pass_that_captured_the_image(monkeypatch):
    """The comparison's wait needs one pass's seconds: the capture's own pass at the model's patch
    size gives them; only where no page captured it there do passes run to time it."""
    base = models.base_model(models.DEFAULT_MODEL)
    image = shapes_sample(0, 32)[0]
    native = selection.Selection(models.DEFAULT_MODEL, base.config.patch_size, "shapes:0", base, image)
    calls = counting_forwards(monkeypatch)
    native.capture()
    assert costs.forward_seconds(native) == native.capture_seconds() > 0 and len(calls) == 1
    memo.shared_results().clear()
    finer = selection.Selection(
        models.DEFAULT_MODEL, 2, "shapes:0", models.model_at(models.DEFAULT_MODEL, 2, base.config.img_size), image
    )
    finer.capture()
    assert costs.forward_seconds(finer) > 0
    assert calls[1:] == [(1, 257)] + [(1, 65)] * costs.TIMED_PASSES  # patch 2's capture, then the timed passes


def test_an_expensive_patch_size_is_timed_once_after_its_warm_up():
    config = vx.ViTConfig(image_size=224, patch_size=16, num_classes=0, embed_dim=384, depth=12, num_heads=6)
    plan = {planned.patch_size: planned.timed_passes for planned in costs.comparison_plan(config)}
    assert plan[16] == costs.TIMED_PASSES and plan[8] == 1  # 785 tokens: 4x the work of patch 16


@pytest.mark.parametrize("timed", [True, False])
def test_the_estimate_counts_exactly_the_passes_the_comparison_runs(monkeypatch, timed):
    model = tiny_model()
    config = model.config
    forward_ms = None if timed else dict.fromkeys(models.patch_size_options(config), 1.0)
    calls = counting_forwards(monkeypatch)
    costs.predictions_by_patch_size(model, shapes_sample(0, 32)[0], forward_ms=forward_ms)
    costs.held_out_accuracy_by_patch_size(model, costs.held_out_set(config))
    by_tokens = {models.token_count(config, patch): patch for patch in models.patch_size_options(config)}
    ran = sum(costs.pass_cost(config, by_tokens[tokens], batch) for batch, tokens in calls)
    resizes = sum(costs.resize_cost(config, patch) for patch in models.patch_size_options(config))
    estimate = costs.patch_size_comparison_cost(config, held_out=True, timed=timed) * costs.pass_cost(config)
    assert estimate == pytest.approx(ran + resizes)


def test_times_given_run_each_size_once_with_the_same_predictions_as_timing(monkeypatch):
    model = tiny_model()
    image = shapes_sample(1, 32)[0]
    timed = costs.predictions_by_patch_size(model, image)
    forward_ms = {patch: float(patch) for patch in models.patch_size_options(model.config)}
    calls = counting_forwards(monkeypatch)
    seen = []
    rows = costs.predictions_by_patch_size(model, image, lambda done, text: seen.append(text), forward_ms)
    assert calls == [(1, row["tokens"]) for row in rows]
    assert [row["forward ms"] for row in rows] == [float(row["patch size"]) for row in rows]
    assert [(row["prediction"], row["probability"]) for row in rows] == [(row["prediction"], row["probability"]) for row in timed]
    assert seen[0].startswith("Running patch ") and seen[-1] == "Done."


def test_a_second_image_is_not_timed_again_and_gets_its_own_predictions(monkeypatch):
    app = open_app("views/patches.py")
    first = app.dataframe[0].value
    picture = io.BytesIO()
    image = shapes_sample(5, 32)[0]
    image.save(picture, format="PNG")
    config = tiny_model().config
    calls = counting_forwards(monkeypatch)
    app.file_uploader(key="image_upload").set_value(("second.png", picture.getvalue(), "image/png")).run()
    assert errors(app) == []
    second = app.dataframe[0].value
    # The capture, then one pass of this image per patch size: no timing, no held-out batch.
    assert calls == [(1, config.num_tokens)] + [(1, tokens) for tokens in second["tokens"]]
    assert list(second["forward ms"]) == list(first["forward ms"])
    assert list(second["held-out accuracy"]) == list(first["held-out accuracy"])
    own = costs.predictions_by_patch_size(tiny_model(), image, forward_ms=dict(zip(first["patch size"], first["forward ms"])))
    assert second[["prediction", "probability"]].to_dict("records") == [
        {"prediction": row["prediction"], "probability": row["probability"]} for row in own
    ]
    assert list(second["probability"]) != list(first["probability"])


def test_a_stopped_comparison_leaves_nothing_cached(monkeypatch):
    model = tiny_model()
    image = shapes_sample(0, 32)[0]
    key = ("stopped comparison",)

    def stop_at_third_size(done, text):
        if "3 of" in text:
            raise RuntimeError("stopped")

    calls = counting_forwards(monkeypatch)
    with pytest.raises(RuntimeError):
        memo.memo(key, lambda: costs.predictions_by_patch_size(model, image, stop_at_third_size))
    plan = costs.comparison_plan(model.config)
    assert len(calls) == sum(1 + planned.timed_passes for planned in plan[:2])  # no pass after the stop
    assert key not in memo.shared_results()
    assert len(memo.memo(key, lambda: costs.predictions_by_patch_size(model, image))) == len(plan)


def test_the_page_leaves_out_the_held_out_column_without_a_dataset(tmp_path):
    app = upload(open_app("views/patches.py"), tiny_model(num_classes=3, class_names=("a", "b", "c")), tmp_path)
    (table,) = app.dataframe
    assert "held-out accuracy" not in table.value.columns
    assert list(table.value["prediction"].isin(["a", "b", "c"])) == [True] * len(table.value)


def test_a_headless_model_still_compares_tokens_and_time(tmp_path):
    app = upload(open_app("views/patches.py"), tiny_model(**HEADLESS), tmp_path)
    (table,) = app.dataframe
    assert list(table.value.columns) == ["patch size", "grid", "tokens", "forward ms"]
    assert list(table.value["tokens"]) == [257, 65, 17, 5, 2]
    assert (table.value["forward ms"] > 0).all()
    assert title_matching(app, "^The same weights at every patch size")
    assert any("no classification head (num_classes=0)" in info.value for info in app.info)


def test_the_caption_says_what_the_table_shows():
    rows = [
        {"patch size": patch, "tokens": tokens, "forward ms": ms, "held-out accuracy": accuracy}
        for patch, tokens, ms, accuracy in [(4, 65, 3.0, 0.95), (8, 17, 1.0, 0.98), (16, 5, 0.5, 0.23), (32, 2, 0.4, 0.14)]
    ]
    summary = costs.patch_size_summary(rows, trained=8)
    assert summary.startswith("A pass at patch 4 (65 tokens) took 7.5x as long as at patch 32 (2 tokens).")
    assert "does best at patch 8 (98%; trained at 8)" in summary
    assert "patch 4 stay within 5 points" in summary
    assert "at patches 16 and 32 it falls to 23% and 14%" in summary
    assert "holds up at all" not in summary


def test_the_page_caption_is_derived_from_its_rows():
    app = open_app("views/patches.py")
    rows = app.dataframe[0].value.to_dict("records")
    captions = [caption.value for caption in app.caption]
    assert costs.patch_size_summary(rows, 4) in captions
    assert not any("holds up at all of them" in caption for caption in captions)


def test_a_real_size_model_says_what_the_comparison_costs_before_it_runs(monkeypatch):
    monkeypatch.setattr(costs, "QUICK_COST", 0)
    app = open_app("views/patches.py")
    (compare,) = [button for button in app.button if button.label.startswith("Compare all")]
    cost = costs.patch_size_comparison_cost(tiny_model().config, held_out=True)
    assert compare.help.startswith(f"About {cost:.0f} forward passes")
    assert compare.label.endswith(" s)")  # the wait in seconds, from a pass timed on this server
    compare.click().run()
    run_until(app, lambda app: len(app.dataframe) > 0)
    assert title_matching(app, "^The same weights at every patch size")
    # Once the comparison is there, neither its button nor Cancel is offered.
    assert not [button.label for button in app.button if button.label == "Cancel" or button.label.startswith("Compare all")]
    # Another image: the button announces only its own passes (times and held-out accuracy are the model's).
    picture = io.BytesIO()
    shapes_sample(5, 32)[0].save(picture, format="PNG")
    app.file_uploader(key="image_upload").set_value(("second.png", picture.getvalue(), "image/png")).run()
    (compare,) = [button for button in app.button if button.label.startswith("Compare all")]
    config = tiny_model().config
    cost = costs.patch_size_comparison_cost(config, timed=False)
    assert cost < costs.patch_size_comparison_cost(config) and compare.help.startswith(f"About {cost:.0f} forward passes")


def test_a_heavy_comparison_is_a_job_that_draws_what_the_server_would(monkeypatch):
    """Costed as a real-size model's, the comparison is asked for and computed beside the server:
    its predictions, times and held-out accuracy land in memo under the keys of the comparison in
    the server, and the page draws from them what it draws when it computes them itself."""
    quick_cost = costs.QUICK_COST
    monkeypatch.setattr(costs, "QUICK_COST", 1.0)
    app = open_app("views/patches.py")
    assert not app.dataframe and any("runs when you ask, beside the server" in caption.value for caption in app.caption)
    calls = counting_forwards(monkeypatch)
    next(button for button in app.button if button.label.startswith("Compare all")).click().run()
    run_until(app, lambda app: len(app.dataframe) > 0)
    assert calls == [] and errors(app) == [] and not app.get("progress")  # every pass in the worker
    model = tiny_model()
    accuracy = costs.held_out_accuracy_by_patch_size(model, costs.held_out_set(model.config))
    rows = app.dataframe[0].value
    assert list(rows["held-out accuracy"]) == pytest.approx([accuracy[patch] for patch in rows["patch size"]])
    assert (rows["forward ms"] > 0).all()
    # The page in the server, from the times and accuracy the job measured: the same figures.
    drawn = charts(app)
    kept = [("default", (32, 32), "forward ms by patch size"), ("default", "held-out accuracy by patch size")]
    values = {key: memo.shared_results().get(key) for key in kept}
    memo.shared_results().clear()
    for key, value in values.items():
        memo.memo(key, lambda value=value: value)
    monkeypatch.setattr(costs, "QUICK_COST", quick_cost)
    calls.clear()
    inline = open_app("views/patches.py")
    assert len(calls) == 1 + len(rows)  # the capture, then one untimed pass per patch size
    assert_same_charts(charts(inline), drawn)


# --- the model picker ------------------------------------------------------------------------


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """Nothing downloaded and every publisher refusing connections."""
    monkeypatch.setenv(catalogue.CACHE_VARIABLE, str(tmp_path / "cache"))
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    monkeypatch.setenv(catalogue.HUB_URL_VARIABLE, "http://127.0.0.1:9")  # discard port: refused
    monkeypatch.setenv(catalogue.TORCHVISION_URL_VARIABLE, "http://127.0.0.1:9")


def photo_buttons(app) -> list[str]:
    return [button.label for button in app.sidebar.button if button.label.startswith("Explore with")]


def test_offline_a_photo_offers_no_pretrained_model_and_says_why(offline):
    app = open_app("views/pipeline.py")
    app.selectbox(key="image_picker").set_value("photo:chelsea.png").run()
    assert not app.exception and photo_buttons(app) == []
    (info,) = [info.value for info in app.sidebar.info]
    assert info == models.CATALOGUE_OFFLINE
    assert "VIT_EXPLORER_HUB_URL" in info and "VIT_EXPLORER_TORCHVISION_URL" in info
    (warning,) = [warning.value for warning in app.sidebar.warning]
    assert "below" not in warning  # nothing below to point at


def test_offline_a_downloaded_model_is_still_offered(offline):
    path = catalogue.cached_path("dino_vits16")
    path.parent.mkdir(parents=True)
    path.write_bytes(b"")
    app = open_app("views/pipeline.py")
    app.selectbox(key="image_picker").set_value("photo:chelsea.png").run()
    assert photo_buttons(app) == ["Explore with DINO ViT-S/16"]
    (warning,) = [warning.value for warning in app.sidebar.warning]
    assert warning.endswith("A pretrained model below reads photos.")
    options = app.selectbox(key="model_picker")
    assert options.format_func("pretrained:dino_vits16") == "Downloaded: DINO ViT-S/16"
    assert options.format_func("pretrained:deit_s") == "88 MB download: DeiT-S"
    # Long titles are cut in the middle; what choosing the model costs stays readable.
    labels = options.options
    assert all(len(label) <= models.MAX_LABEL for label in labels), labels
    assert options.format_func("pretrained:vit_b_16").startswith("346 MB download: ")


def test_a_reachable_publisher_offers_its_models(offline, monkeypatch):
    listener = socket.create_server(("127.0.0.1", 0))
    accepting = threading.Thread(target=lambda: [listener.accept()[0].close() for _ in range(4)], daemon=True)
    accepting.start()
    monkeypatch.setenv(catalogue.HUB_URL_VARIABLE, f"http://127.0.0.1:{listener.getsockname()[1]}")
    try:
        app = open_app("views/pipeline.py")
        app.selectbox(key="image_picker").set_value("photo:chelsea.png").run()
        assert photo_buttons(app) == ["Explore with DINO ViT-S/16", "Explore with DeiT-S", "Explore with CLIP ViT-B/16 (OpenAI)"]
    finally:
        listener.close()


def test_the_picker_help_is_short_and_the_cards_are_below_it():
    app = open_app("views/pipeline.py")
    assert len(app.selectbox(key="model_picker").help) < 200
    (cards,) = [expander for expander in app.sidebar.expander if expander.label == "The pretrained models"]
    assert "finds the object without ever seeing a label" in cards.markdown[0].value


def test_a_long_checkpoint_name_is_cut_in_the_middle_and_shown_whole_below(tiny_default, tmp_path, monkeypatch):
    long_name = tmp_path / "vit_small_patch16_224_headless_finetuned_run7.safetensors"
    long_name.write_bytes(tiny_default.read_bytes())
    monkeypatch.setenv("VIT_EXPLORER_DEFAULT_MODEL", str(long_name))
    app = open_app("views/pipeline.py")
    label = app.selectbox(key="model_picker").format_func("default")
    assert len(label) <= models.MAX_LABEL and "…" in label
    assert label.startswith("Default: vit_small") and label.endswith("run7")
    assert any(long_name.stem in caption.value for caption in app.sidebar.caption)


def test_a_resampled_kernel_is_laid_out_as_the_kernel_and_embeds_as_the_conv():
    """A transposed 224 x 224 kernel made every pass at that patch size seconds long."""
    model = vx.ViT(vx.ViTConfig(image_size=64, patch_size=16, num_classes=0, embed_dim=32, depth=1, num_heads=2))
    kernel = vx.model.vit.resample_patch_embed(model.patch_embed.proj.weight, 64)
    assert kernel.is_contiguous()
    x = torch.randn(2, 3, 64, 64)
    expected = torch.nn.functional.conv2d(x, kernel, model.patch_embed.proj.bias, stride=64).flatten(2).transpose(1, 2)
    torch.testing.assert_close(model.patch_embed(x, patch_size=64), expected, atol=1e-4, rtol=1e-4)


def test_the_trade_off_figure_of_a_headless_model_has_no_prediction_panel():
    from vit_explorer import figures

    rows = [{"patch size": patch, "grid": f"{32 // patch}x{32 // patch}", "tokens": 1 + (32 // patch) ** 2, "forward ms": 1.0} for patch in (4, 8)]
    fig = figures.patch_size_tradeoff(rows, 4)
    assert [annotation.text for annotation in fig.layout.annotations] == ["tokens", "forward time of one image (ms)"]
    assert len(fig.data) == 2
