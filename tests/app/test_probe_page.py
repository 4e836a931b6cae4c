"""The probe a person labels (AppTest): clicks (the picker's handler, as Streamlit calls it) label
patches, the probe is scikit-learn's fit on the set's tokens by hand and segments every picture, bad
labels are a sentence each and never lose a click, and the Several images page's DINOv3 PCA takes
its foreground from the probe."""
import numpy as np
import pytest
import torch
from streamlit.testing.v1 import AppTest

import vit_explorer as vx
from vit_explorer.analysis import dense_pca, image_set as sets
from vit_explorer.analysis.probe import fit_probe, probe_layers
from vit_explorer.app.images import resolve_image

from apptest import charts, decoded, open_app, tiny_default, widget  # noqa: F401

PAGE = "views/probe.py"
SET = ["shapes:4", "shapes:0", "shapes:1"]  # the default set of the default image
KEYS = [f"{key}@32x32" for key in SET]
CENTRE = [row * 8 + column for row in (3, 4) for column in (2, 3, 4, 5)]
BORDER = [0, 1, 2, 5, 6, 7, 8, 15, 16, 23, 48, 55, 56, 57, 60, 63]


def labels(image: int = 0, objects=CENTRE, backgrounds=BORDER) -> dict:
    return {**{(KEYS[image], patch): "object" for patch in objects},
            **{(KEYS[image], patch): "background" for patch in backgrounds}}


def with_labels(kept: dict) -> AppTest:
    app = open_app(PAGE)
    app.session_state["probe_labels"] = {(8, 8): dict(kept)}
    app.run()
    assert not app.exception, app.exception
    return app


def set_tokens(weights) -> torch.Tensor:
    model = vx.load_model(weights)
    x = torch.cat([vx.preprocess(resolve_image(key, (32, 32))[1], model.config) for key in SET])
    return vx.capture(model, x, layers=()).tokens  # (3, depth + 1, N, D)


def said(app) -> str:
    return " ".join(str(element.value) for kind in ("markdown", "caption", "info", "warning") for element in app.get(kind))


def test_clicks_label_a_patch_and_a_second_click_unlabels_it():
    """AppTest cannot play a plotly selection: the picker's on_select handler runs by itself, as
    Streamlit calls it (the chart's state set, then the callback)."""
    def clicked():
        import streamlit as st
        from streamlit.util import AttributeDictionary

        from vit_explorer.app import probe

        for label in ("object", "object", "background"):
            key = probe.click_key()
            st.session_state[key] = AttributeDictionary(selection=AttributeDictionary(points=[
                {"point_index": 27, "curve_number": 4},
            ]))
            probe.clicked(key, "shapes:4@32x32", (8, 8), label)()
            st.write(repr(probe.labelled((8, 8))))

    handled = AppTest.from_function(clicked).run()
    assert not handled.exception
    assert [element.value for element in handled.markdown] == [
        "{('shapes:4@32x32', 27): 'object'}", "{}", "{('shapes:4@32x32', 27): 'background'}",
    ]
    app = open_app(PAGE)
    (picker,) = [chart for chart in app.get("plotly_chart") if chart.proto.id and "probe_click_0" in chart.proto.id]
    assert list(picker.proto.selection_mode) == [0]  # points


def test_the_probe_is_scikit_learns_on_the_sets_tokens_and_segments_every_picture(tiny_default):
    kept = {**labels(0), **labels(1, objects=[27, 28], backgrounds=[0, 63])}
    app = with_labels(kept)
    tokens = set_tokens(tiny_default)
    used = [(key, patch, label) for (key, patch), label in sorted(kept.items())]
    curve = probe_layers(tokens, used, names=("object", "background"), grid_size=(8, 8), num_prefix_tokens=1, images=KEYS)
    assert widget(app.slider, "Tokens after this many layers").value == curve.best  # the best until one is picked
    expected = fit_probe(tokens[:, curve.best], used, names=("object", "background"), grid_size=(8, 8),
                         num_prefix_tokens=1, images=KEYS)
    (title,) = [title for title in charts(app) if title.startswith("The probe on the tokens after")]
    heatmaps = [trace for trace in charts(app)[title] if trace["type"] == "heatmap"]
    assert len(heatmaps) == 3
    for shown, segmented in zip(heatmaps, expected.segmentation):
        np.testing.assert_array_equal(decoded(shown["z"]).reshape(8, 8), segmented.numpy())
    assert f"**{expected.accuracy:.0%}** of {expected.held_out} patches. {expected.method}" in said(app)
    (layers_title,) = [title for title in charts(app) if title.startswith("Which layer knows")]
    np.testing.assert_allclose(decoded(charts(app)[layers_title][0]["y"]), curve.accuracies)
    # Another layer, picked: the probe on its tokens, and it stays picked.
    widget(app.slider, "Tokens after this many layers").set_value(1).run()
    layer1 = fit_probe(tokens[:, 1], used, names=("object", "background"), grid_size=(8, 8), num_prefix_tokens=1, images=KEYS)
    (title,) = [title for title in charts(app) if title.startswith("The probe on the tokens after 1 layers")]
    shown = [trace for trace in charts(app)[title] if trace["type"] == "heatmap"][0]
    np.testing.assert_array_equal(decoded(shown["z"]).reshape(8, 8), layer1.segmentation[0].numpy())


@pytest.mark.parametrize("kept, sentence", [
    ({}, "No patch is labelled yet"),
    ({(KEYS[0], patch): "object" for patch in CENTRE}, "Every labelled patch is 'object'"),
    ({(KEYS[0], patch): "background" for patch in range(64)}, "Every labelled patch is 'background'"),
])
def test_labels_it_cannot_use_are_a_sentence_and_are_kept(kept, sentence):
    app = with_labels(kept)
    assert any(sentence in warning.value and "Your labels are kept." in warning.value for warning in app.warning)
    assert app.session_state["probe_labels"] == {(8, 8): kept}


def test_one_label_only_is_refused_and_the_last_labels_stay():
    app = with_labels(labels(0))
    widget(app.text_input, "Labels (comma-separated, two to four; the first is the foreground)").input("cat").run()
    assert any("A probe needs two labels at least" in warning.value and "The labels stay object, background" in warning.value
               for warning in app.warning)
    assert [title for title in charts(app) if title.startswith("The probe on the tokens after")]
    assert app.session_state["probe_labels"] == {(8, 8): labels(0)}


def test_labels_on_a_picture_no_longer_in_the_set_are_set_aside_and_come_back_with_it():
    kept = {**labels(0), **labels(2, objects=[27], backgrounds=[0])}
    app = with_labels(kept)
    assert "Labelled: 9 'object', 17 'background', over the 3 pictures." in said(app)
    app.multiselect(key="image_set").set_value(SET[:2]).run()
    assert not app.exception
    assert "2 labelled patches are on an image no longer in the set: kept aside, used again once it is back." in said(app)
    assert "Labelled: 8 'object', 16 'background', over the 2 pictures." in said(app)
    assert app.session_state["probe_labels"] == {(8, 8): kept}
    app.multiselect(key="image_set").set_value(SET).run()
    assert "no longer in the set" not in said(app) and "9 'object', 17 'background'" in said(app)


def test_renamed_labels_wait_aside_and_four_labels_of_your_own():
    app = with_labels(labels(0))
    box = "Labels (comma-separated, two to four; the first is the foreground)"
    widget(app.text_input, box).input("object, sky, grass, road").run()
    assert "16 labelled patches have a label no longer among the labels ('background')" in said(app)
    assert any("Every labelled patch is 'object'" in warning.value for warning in app.warning)
    assert widget(app.radio, "A click labels a patch").options == ["object", "sky", "grass", "road"]
    widget(app.text_input, box).input("object, background").run()
    assert "no longer among" not in said(app) and not app.warning


def test_the_dense_pca_takes_its_foreground_from_the_probe(tiny_default):
    app = with_labels({**labels(0), **labels(1), **labels(2)})
    layer = widget(app.slider, "Tokens after this many layers").value
    app.switch_page("views/images.py").run()
    assert not app.exception
    assert f"where your probe (the Probe page, on the tokens after {layer} layers) finds 'object'" in said(app)
    tokens = set_tokens(tiny_default)
    used = [(key, patch, label) for (key, patch), label in sorted({**labels(0), **labels(1), **labels(2)}.items())]
    probe = fit_probe(tokens[:, layer], used, grid_size=(8, 8), num_prefix_tokens=1, images=KEYS,
                      names=("object", "background"))
    masks = [values > 0.5 for values in probe.foreground(0)]
    model = vx.load_model(tiny_default)
    features = list(sets.last_layer_features(model, tokens[:, -1]))
    parts = dense_pca.dense_pca(features, [(8, 8)] * 3, masks)
    count = sum(int(mask.sum()) for mask in masks)
    assert f"{count} of the 192 patches are foreground" in said(app)
    assert [bool(part.any()) for part in parts.foreground] == [bool(mask.any()) for mask in masks]
    # Without labels, the border heuristic again.
    app.session_state["probe_labels"] = {}
    app.run()
    assert "the joint first principal component's side away from the borders" in said(app)


def test_the_patches_page_dense_pca_takes_its_foreground_from_this_pictures_probe(tiny_default):
    app = with_labels({**labels(0), **labels(1)})  # the sidebar's picture is the set's first
    layer = widget(app.slider, "Tokens after this many layers").value
    app.switch_page("views/patches.py").run()
    assert not app.exception
    assert f"where your probe (the Probe page, on the tokens after {layer} layers) finds 'object'" in said(app)
    # The probe of this picture alone, on its own labels.
    tokens = set_tokens(tiny_default)[:1]
    used = [(key, patch, label) for (key, patch), label in sorted(labels(0).items())]
    probe = fit_probe(tokens[:, layer], used, grid_size=(8, 8), num_prefix_tokens=1, images=KEYS[:1],
                      names=("object", "background"))
    count = int((probe.foreground(0)[0] > 0.5).sum())
    assert f"8 x 8 patches, {count} of them foreground (where your probe" in said(app)
    # Labels on other pictures only: the border heuristic.
    app.session_state["probe_labels"] = {(8, 8): labels(1)}
    app.run()
    assert "of them foreground (the first principal component's side away from the border" in said(app)
