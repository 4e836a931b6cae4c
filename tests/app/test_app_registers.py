"""The Registers page (AppTest): with the shipped model, with a model given a register neuron by hand
(vit_explorer.analysis.test_time_registers.plant_register_neuron), headless with registers, and what a view
costs. Uses test_app's fixture (tiny default model, private runs and uploads folders) and helpers."""
import json

import numpy as np
import pytest
import streamlit as st
import torch

import vit_explorer as vx
from vit_explorer.analysis import test_time_registers as ttr
from vit_explorer.training import train
from vit_explorer.app import costs, jobs, memo, models, selection
from apptest import PHOTO, errors, figure_titles, open_app, tiny_default, tiny_model, title_matching, widget  # noqa: F401
from apptest import decoded, run_until

PAGE = "views/registers.py"
PHOTOS = PHOTO.parent  # the bundled photos
LAYER, UNIT = 1, 5


def default_input(config) -> torch.Tensor:
    """The sidebar's default picture (shapes:4) as the model reads it."""
    return vx.preprocess(vx.shapes_sample(4, config.img_size[0])[0], config)


def planted(model: vx.ViT) -> vx.ViT:
    """``model`` with a register neuron in layer LAYER firing on the 5 plainest patches of the default picture."""
    x = default_input(model.config)
    return ttr.plant_register_neuron(model.eval(), x, ttr.low_information_patches(x, model.config.patch_size, 5), LAYER, UNIT)


@pytest.fixture
def planted_default(tiny_default):  # noqa: F811
    """The app's default model is the tiny one with a register neuron planted."""
    model = planted(tiny_model())
    vx.save_model(model, tiny_default)
    return model


def texts(app) -> str:
    return " ".join(str(element.value) for kind in ("markdown", "caption") for element in app.get(kind))


def chart(app, pattern: str) -> dict:
    title = title_matching(app, pattern)
    return next(spec for spec in (json.loads(c.proto.spec) for c in app.get("plotly_chart"))
                if spec["layout"]["title"]["text"] == title)


def shown_top5(app) -> tuple[list[str], np.ndarray]:
    """The classes and the probabilities with the register of the page's top-5."""
    bars = chart(app, "^Top-5 with the register")["data"][1]
    return bars["y"], decoded(bars["x"])


def expected_top5(model: vx.ViT, register: vx.TestTimeRegister) -> tuple[list[str], np.ndarray]:
    probabilities = vx.register_capture(model, default_input(model.config), register).logits[0].softmax(-1)
    top = probabilities.argsort(descending=True)[:5]
    return [model.config.class_names[i] for i in top], probabilities[top].numpy()


def test_the_planted_neuron_is_found_and_the_register_takes_its_outliers(planted_default):
    app = open_app(PAGE)
    assert errors(app) == [] and app.title[0].value == "Registers at test time"
    assert all(w.help for w in app.slider)  # every control says what it does
    title_matching(app, "^Patch-token norms after layer 3; outliers \\(x\\) above")
    assert "on the 5 outliers of this image" in texts(app) and "stand out already after layer 1" in texts(app)
    # The best unit of the layers searched is the planted one, drawn first.
    ranked = chart(app, "^Register neurons: the 10 in colour")["data"][1]["y"]
    assert ranked[0] == f"layer {LAYER}, unit {UNIT}"
    widget(app.slider, "Register neurons").set_value(1).run()
    assert "Feeding the register, 1 neuron: layer 1: unit 5." in texts(app)
    # Without the register the outliers stand out; with it, no patch does.
    norms = chart(app, "^Patch-token norms after layer 3 \\(x: the outliers without the register\\)")
    before, after = (decoded(trace["z"]) for trace in norms["data"][::2])
    assert before.max() > 5 * np.median(before) and after.max() < 2 * np.median(after)
    assert float(norms["layout"]["title"]["text"].rpartition(": ")[2]) > before.max() / 2  # the register's norm
    # The top-5 is the model's own with that register, computed here by hand.
    classes, probabilities = shown_top5(app)
    expected_classes, expected = expected_top5(planted_default, vx.TestTimeRegister({LAYER: [UNIT]}))
    assert classes == expected_classes
    np.testing.assert_allclose(probabilities, expected, rtol=1e-3, atol=1e-6)


def test_a_view_costs_one_search_and_one_register_pass_and_its_widgets_reuse_them(planted_default, monkeypatch):
    searches, passes, captures = [], [], []

    def counted(calls: list, original):
        def run(*args, **kwargs):
            calls.append(args)
            return original(*args, **kwargs)
        return run

    monkeypatch.setattr(selection, "find_register_neurons", counted(searches, ttr.find_register_neurons))
    monkeypatch.setattr(selection, "register_capture", counted(passes, ttr.register_capture))
    monkeypatch.setattr(selection, "capture", counted(captures, vx.capture))
    app = open_app(PAGE)
    assert (len(captures), len(searches), len(passes)) == (1, 1, 1)
    widget(app.slider, "Register neurons").set_value(2).run()
    assert (len(captures), len(searches), len(passes)) == (1, 1, 2)  # another register, the same search
    widget(app.slider, "Layer").set_value(1).run()
    app.switch_page("views/attention.py").run()
    app.switch_page(PAGE).run()
    assert not app.exception and (len(captures), len(searches), len(passes)) == (1, 1, 2)  # kept, and shared
    widget(app.slider, "From the layers").set_value((2, 3)).run()  # past where the outliers appear
    assert not app.exception and (len(captures), len(searches)) == (1, 2)
    assert all(label.startswith(("layer 2,", "layer 3,")) for label in ranked_units(app))
    widget(app.slider, "Find the outliers after layer").set_value(2).run()  # up to where they appear, then 3
    assert not app.exception and (len(captures), len(searches)) == (1, 4)


def photos_input(config) -> torch.Tensor:
    """The default picture, then the bundled photos, as the model reads them."""
    photos = [vx.preprocess(vx.load_image(path), config) for path in sorted(PHOTOS.glob("*.[pj][np]g"))]
    return torch.cat([default_input(config), *photos])


def ranked_units(app) -> list[str]:
    return chart(app, "^Register neurons: the")["data"][1]["y"]


def test_the_neurons_found_on_the_bundled_photos_too(planted_default):
    app = open_app(PAGE)
    app.radio(key="registers_with_photos").set_value(True).run()
    assert not app.exception and errors(app) == []
    found = vx.find_register_neurons(planted_default, photos_input(planted_default.config))
    assert f"on the {found.images} of the 5 pictures with outliers" in texts(app)
    assert ranked_units(app)[:3] == [f"layer {layer}, unit {unit}" for layer, unit, _ in found.top(3)]


def test_the_search_on_the_photos_is_a_job_for_a_large_model(planted_default, monkeypatch):
    monkeypatch.setattr(costs, "QUICK_COST", 1.0)  # the tiny model's search as a ViT-B's would be
    computed = []
    monkeypatch.setattr(selection, "find_register_neurons", lambda model, source, *args: computed.append(source) or (
        ttr.find_register_neurons(model, source, *args)
    ))
    app = open_app(PAGE)
    app.radio(key="registers_with_photos").set_value(True).run()
    said = f"costs about {costs.register_search_forwards(planted_default.config, 5):.0f} forward passes"  # 5 pictures
    assert said in texts(app) and not any(t.startswith("Register neurons") for t in figure_titles(app))
    widget(app.button, "Search the photos").click().run()
    run_until(app, lambda app: any(title.startswith("Register neurons") for title in figure_titles(app)))
    found = vx.find_register_neurons(planted_default, photos_input(planted_default.config))
    assert ranked_units(app)[:3] == [f"layer {layer}, unit {unit}" for layer, unit, _ in found.top(3)]
    assert errors(app) == [] and len(list(jobs.job_board().folder.glob("*/record.json"))) == 1
    assert all(isinstance(source, vx.Capture) for source in computed)  # the photos were searched beside the server


def test_without_outliers_the_page_says_so_and_where_to_find_them():
    app = open_app(PAGE)
    assert "a large model that has them: CLIP ViT-B/16 (OpenAI)" in texts(app)
    widget(app.slider, "k (MADs above the median)").set_value(20.0).run()
    assert not app.exception and errors(app) == []
    (info,) = [info.value for info in app.info]
    assert info.startswith("No patch token stands out after layer 3 (none above ")
    assert not any(title.startswith("Register neurons") for title in figure_titles(app))


def test_a_headless_model_with_registers_compares_its_pooled_features(tmp_path):
    path = tmp_path / "headless.safetensors"
    model = planted(tiny_model(reg_tokens=2, num_classes=0, class_names=None))
    vx.save_model(model, path)
    app = open_app(PAGE)
    app.file_uploader(key="checkpoint_upload").set_value((path.name, path.read_bytes(), "application/octet-stream")).run()
    assert not app.exception and errors(app) == []
    widget(app.slider, "Register neurons").set_value(1).run()
    (metric,) = app.metric
    assert metric.label == "Cosine between the pooled features, without and with the register"
    x = default_input(model.config)
    moved = vx.register_capture(model, x, vx.TestTimeRegister({LAYER: [UNIT]}))
    assert moved.register_token == 3  # after the class token and the two trained registers
    assert metric.value == f"{float(torch.cosine_similarity(moved.logits, vx.capture(model, x).logits)):.6f}"
    title_matching(app, "^With the register: attention of the class token in layer 3")


@pytest.mark.skipif(not train.DEFAULT_WEIGHTS.is_file(), reason="the shipped model is not there yet")
def test_the_shipped_model(monkeypatch):
    monkeypatch.delenv("VIT_EXPLORER_DEFAULT_MODEL")
    st.cache_resource.clear()
    st.cache_data.clear()
    app = open_app(PAGE)
    assert not app.exception and errors(app) == []
    if app.info:  # no outliers on its default picture: said so
        assert app.info[0].value.startswith("No patch token stands out")
        return
    model = vx.load_model(train.DEFAULT_WEIGHTS).eval()
    neurons = vx.find_register_neurons(model, vx.capture(model, default_input(model.config)))
    classes, probabilities = shown_top5(app)
    expected_classes, expected = expected_top5(model, neurons.register(ttr.DEFAULT_COUNT))
    assert classes == expected_classes
    np.testing.assert_allclose(probabilities, expected, rtol=1e-3, atol=1e-6)


def test_a_rotary_model_at_high_resolution_within_two_views(tiny_default):  # noqa: F811
    """A DINOv3-shaped model (rotary positions, 4 registers) at 768 px, 2,309 tokens, with a
    register neuron: the register is one more unrotated prefix token, the page shows it, and
    holds no more than two views (models.view_bytes: the passes without and with the register)."""
    torch.manual_seed(0)
    config = vx.ViTConfig(
        image_size=768, patch_size=16, reg_tokens=4, qkv_bias=False, init_values=1e-5, rope_type="dinov3",
        abs_pos_embed=False, layer_norm_eps=1e-5, embed_dim=384, depth=2, num_heads=6, num_classes=0,
    )
    x = default_input(config)
    model = ttr.plant_register_neuron(vx.ViT(config).eval(), x, ttr.low_information_patches(x, 16, 12), 0, UNIT)
    models.shared_models().get_or_compute(("base", models.DEFAULT_MODEL), lambda: model)
    memo.shared_results().clear()
    app = open_app(PAGE)
    assert not app.exception and errors(app) == []
    widget(app.slider, "Register neurons").set_value(1).run()
    assert "Feeding the register, 1 neuron: layer 0: unit 5." in texts(app)
    assert memo.shared_results().total_bytes <= 2 * models.view_bytes(config)
    (metric,) = app.metric
    moved = vx.register_capture(model, x, vx.TestTimeRegister({0: [UNIT]}))
    assert moved.register_token == 5 and moved.num_prefix_tokens == 6
    assert metric.value == f"{float(torch.cosine_similarity(moved.logits, vx.capture(model, x).logits)):.6f}"
