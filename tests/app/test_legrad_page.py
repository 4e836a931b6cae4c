"""LeGrad beside Chefer's relevance on the Attention page's "Ask in words" (app/word_maps.legrad):
the map drawn is text.legrad's on a model read anew, from the page's own pass (no forward more)."""
import numpy as np
import pytest

import vit_explorer as vx
from vit_explorer.app import images
from vit_explorer.text import load_image_text_model, zero_shot
from vit_explorer.text.legrad import legrad

from apptest import charts, counting_forwards, decoded, errors, open_words_app
from textmodels import SMALL_CLIP, open_clip_folder, siglip_folder

PROMPTS = ("a cat", "a dog", "a rocket")  # the box's default


@pytest.mark.parametrize("shape", ["clip", "siglip"])
def test_legrad_draws_text_legrads_map_without_another_forward(tmp_path, monkeypatch, shape):
    folder = siglip_folder(tmp_path / shape) if shape == "siglip" else tmp_path / shape
    if shape == "clip":
        open_clip_folder(folder, SMALL_CLIP)
    app = open_words_app(folder, "views/attention.py")
    app.selectbox(key="word_traced").set_value(1).run()  # a tiny model: Chefer's relevance drawn unasked
    forwards = counting_forwards(monkeypatch)
    app.radio(key="word_relevance_method").set_value("legrad").run()
    assert not app.exception and errors(app) == []
    assert not [warning.value for warning in app.warning if "LeGrad" in warning.value]
    assert forwards == []  # from the capture the page already made

    model = load_image_text_model(folder)
    _, image = images.resolve_image(app.session_state["image_key"], model.image.config.img_size)
    captured = vx.capture(model.image, vx.preprocess(image, model.image.config))
    text = model.embed_texts(zero_shot.label_prompts(list(PROMPTS)))[1]
    expected = legrad(model, captured, text)[0].numpy()
    (traces,) = [traces for title, traces in charts(app).items() if title.endswith("match 'a dog' (LeGrad)")]
    (heatmap,) = [trace for trace in traces if trace["type"] == "heatmap"]
    np.testing.assert_allclose(decoded(heatmap["z"]).reshape(expected.shape), expected, atol=1e-4, rtol=1e-3)
