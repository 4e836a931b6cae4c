"""The Features page (AppTest) with a dictionary trained here on the app's tiny default model: its
numbers are the dictionary's own on this image's capture, steering by 1 changes nothing and by 0
changes the prediction, another model's dictionary is never offered; an SAE run launched from the
Train page becomes one; and the shipped dictionary fits the shipped model."""
import numpy as np
import pytest
import torch

import vit_explorer as vx
from vit_explorer.app import features, images, models, runs, session
from vit_explorer.features.effects import latent_effects, points_text
from vit_explorer.data.datasets import shapes_sample
from vit_explorer.features.sae import load_sae
from vit_explorer.features.steering import Steering
from vit_explorer.features.train import SAETrainConfig, model_identity, train_sae
from vit_explorer.training import train

from apptest import (  # noqa: F401 (tiny_default: autouse)
    charts, decoded, errors, figure_titles, open_app, tiny_default, tiny_model, title_matching, widget,
)

PAGE = "views/features.py"
LAYER = 1


def trained_dictionary(weights, out_dir, name: str = "sae_tiny") -> SAETrainConfig:
    config = SAETrainConfig(
        weights=str(weights), layer=LAYER, images=48, epochs=1, batch_size=128, expansion=4, k=4, device="cpu",
        out_dir=str(out_dir), name=name, log_every=5, index_top=4,
    )
    for _ in train_sae(config):
        pass
    return config


@pytest.fixture
def dictionary(tiny_default):
    return trained_dictionary(tiny_default, runs.RUNS_DIR)


def test_without_a_dictionary_the_page_says_how_to_train_one():
    app = open_app(PAGE)
    assert errors(app) == [] and app.title[0].value == "Features"
    assert "python -m vit_explorer sae" in app.info[0].value


def test_the_page_shows_the_dictionarys_own_numbers_on_this_image(dictionary):
    app = open_app(PAGE)
    assert errors(app) == [] and not app.exception
    assert title_matching(app, "^Share of each patch's token the dictionary explains \\(layer 1\\)")
    assert title_matching(app, "^Latent \\d+'s top patches over its training images")
    assert title_matching(app, "^Latent \\d+'s activations: fires on")
    patch = 9
    app.session_state["features_patch"] = patch
    app.run()
    # The clicked patch's bars are the dictionary's encoding of the capture's token leaving layer 1.
    model = models.base_model(models.DEFAULT_MODEL)
    sae, _ = load_sae(dictionary.paths()["dictionary"], model)
    image, _ = shapes_sample(int(images.DEFAULT_IMAGE.removeprefix("shapes:")), model.config.img_size)
    cap = vx.capture(model, vx.preprocess(image, model.config))
    with torch.no_grad():
        encoded = sae.encode(cap.tokens[0, LAYER + 1, cap.num_prefix_tokens + patch])
    values, latents = encoded.topk(int((encoded > 0).sum()))
    (bars,) = [chart for chart in charts(app).items() if chart[0] == f"Patch {patch}'s strongest latents (click one)"]
    trace = bars[1][0]
    assert trace["customdata"] == latents.tolist()
    np.testing.assert_allclose(decoded(trace["x"]), values.numpy(), rtol=1e-4, atol=1e-5)


def test_steering_by_one_changes_nothing_and_by_zero_removes_the_latent(dictionary):
    app = open_app(PAGE)
    widget(app.slider, "Factor").set_value(1.0).run()
    assert not app.exception and errors(app) == []
    bars = title_matching(app, "^Top-\\d with latent \\d+ x 1, against the intact model")
    assert bars
    # Factor 1 is the intact pass, factor 0 the pass without the latent's contribution.
    latent = widget(app.number_input, "Latent").value
    model = models.base_model(models.DEFAULT_MODEL)
    sae, _ = load_sae(dictionary.paths()["dictionary"], model)
    x = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    intact = vx.capture(model, x)
    same = vx.capture(model, x, steering=Steering(sae, LAYER, {latent: 1.0}))
    torch.testing.assert_close(same.logits, intact.logits)
    widget(app.slider, "Factor").set_value(0.0).run()
    assert not app.exception and title_matching(app, f"^Top-\\d with latent {latent} x 0, against the intact model")


def test_another_models_dictionary_is_not_offered(tiny_default, tmp_path):
    other = tmp_path / "other.safetensors"
    vx.save_model(tiny_model(depth=3), other)  # another model, with the same width
    trained_dictionary(other, runs.RUNS_DIR, name="sae_other")
    app = open_app(PAGE)
    assert "python -m vit_explorer sae" in app.info[0].value  # nothing fits the sidebar's model
    trained_dictionary(tiny_default, runs.RUNS_DIR)
    app = open_app(PAGE)
    (offered,) = widget(app.selectbox, "Dictionary").options
    assert offered.startswith("sae_tiny (layer 1, explains ")


def test_an_sae_run_launched_on_the_train_page_becomes_a_dictionary_of_the_model():
    app = open_app("views/train.py")
    widget(app.number_input, "How many images").set_value(16)
    widget(app.number_input, "Latents per token dimension").set_value(2)
    widget(app.number_input, "Active latents per token (k)").set_value(4)
    widget(app.number_input, "Passes over the tokens").set_value(1)
    widget(app.button, "Launch the sparse autoencoder").click().run()
    assert not app.exception and errors(app) == []
    (run,) = runs.training_runs().values()
    assert isinstance(run.config, SAETrainConfig)
    assert run.join(timeout=180) and run.status == "finished", run.error
    assert run.peak_rss is not None  # trained in a process of its own
    app.run()
    metrics = {metric.label: metric.value for metric in app.metric}
    assert metrics["Explained variance"].endswith("%") and metrics["Dead latents"].endswith("%")
    assert title_matching(app, "^Sparse autoencoder: step \\d+ of \\d+, explains")
    assert "sparse autoencoder on layer" in widget(app.selectbox, "Run").format_func(widget(app.selectbox, "Run").value)
    page = open_app(PAGE)
    assert errors(page) == [] and widget(page.selectbox, "Dictionary").options


def test_the_shipped_dictionary_fits_the_shipped_model_and_explains_most_of_its_tokens():
    path = train.DEFAULT_WEIGHTS.with_name("sae_shapes_layer2.safetensors")
    model = vx.load_model(train.DEFAULT_WEIGHTS)
    sae, card = load_sae(path, model)
    assert card["model"]["digest"] == model_identity(train.DEFAULT_WEIGHTS)["digest"]
    assert card["layer"] == 2 and card["metrics"]["explained_variance"] > 0.9
    assert path.with_suffix(".index.npz").is_file()
    assert np.isfinite(np.asarray(card["mean"])).all()


def test_steering_composes_with_the_knock_out_page_s_knock_out(dictionary):
    app = open_app(PAGE)
    assert not app.toggle  # nothing knocked out: nothing to compose with
    app.session_state[session.kept_key(session.knockout_heads_key(0))] = [1]
    app.run()
    (together,) = app.toggle
    assert "layer 0 head" in together.label
    together.set_value(True).run()
    assert not app.exception and errors(app) == []
    latent = widget(app.number_input, "Latent").value
    assert title_matching(app, f"^Top-\\d with latent {latent} x 0 and layer 0 head")
    # The same pass as the knock-out and the steering asked of capture at once, from the image.
    model = models.base_model(models.DEFAULT_MODEL)
    sae, _ = load_sae(dictionary.paths()["dictionary"], model)
    image, _ = shapes_sample(int(images.DEFAULT_IMAGE.removeprefix("shapes:")), model.config.img_size)
    x = vx.preprocess(image, model.config)
    knock_out = vx.KnockOut(heads={0: (1,)})
    both = vx.capture(model, x, knock_out=knock_out, steering=Steering(sae, LAYER, {latent: 0.0}))
    resumed = vx.capture(model, x, knock_out=knock_out, steering=Steering(sae, LAYER, {latent: 0.0}),
                         intact=vx.capture(model, x))
    torch.testing.assert_close(resumed.logits, both.logits)
    assert not torch.allclose(both.logits, vx.capture(model, x, steering=Steering(sae, LAYER, {latent: 0.0})).logits)


def test_the_latents_that_matter_start_the_steering_and_its_change_is_shown(dictionary, monkeypatch):
    """The list is features.effects on the page's capture, the Latent starts on its first, the
    steered view is a difference, and a saturated prediction names the least certain sample."""
    model = models.base_model(models.DEFAULT_MODEL)
    sae, _ = load_sae(dictionary.paths()["dictionary"], model)
    image, _ = shapes_sample(int(images.DEFAULT_IMAGE.removeprefix("shapes:")), model.config.img_size)
    intact = vx.capture(model, vx.preprocess(image, model.config))
    # The tiny model is unsure of everything: its sidebar picture's prediction counts as saturated.
    monkeypatch.setattr(features, "SATURATED", float(intact.logits.softmax(-1).max()) - 1e-6)
    app = open_app(PAGE)
    assert not app.exception and errors(app) == []
    expected = latent_effects(model, sae, LAYER, intact.tokens[:, LAYER + 1])
    (bars,) = [traces for title, traces in charts(app).items() if title.startswith("The latents that matter most")]
    assert bars[0]["customdata"] == list(expected.top(8))
    np.testing.assert_allclose(decoded(bars[0]["x"]), [expected.points(float(expected.estimates[latent]))
                                                      for latent in expected.top(8)], rtol=1e-3, atol=1e-6)
    latent = widget(app.number_input, "Latent").value
    assert latent == expected.order[0]
    assert title_matching(app, f"^Attention of the class token in layer {LAYER + 1} with latent {latent} x 0, minus intact")
    (metric,) = [metric for metric in app.metric if metric.label.startswith("Probability of")]
    steered = vx.capture(model, vx.preprocess(image, model.config), steering=Steering(sae, LAYER, {latent: 0.0}))
    target = int(intact.logits.argmax())
    assert metric.delta == points_text(expected.points(float(
        steered.logits.log_softmax(-1)[0, target] - intact.logits.log_softmax(-1)[0, target])))
    assert metric.delta.endswith(" pts") and metric.delta != "+0.0000 pts"
    # The least certain built-in picture other than this one, of its kind (shapes) first.
    sure = {index: float(vx.capture(model, vx.preprocess(shapes_sample(index, model.config.img_size)[0],
                                                         model.config)).logits.softmax(-1).max())
            for index in range(images.SHAPE_SAMPLES) if f"shapes:{index}" != images.DEFAULT_IMAGE}
    least = min(sure, key=sure.get)
    (saturated,) = [info.value for info in app.info if "saturated" in info.value]
    assert f"Shapes #{least}: " in saturated and f"({100 * sure[least]:.1f}% sure)" in saturated


def test_a_headless_model_s_latents_are_measured_on_its_pooled_output(tiny_default):
    vx.save_model(tiny_model(num_classes=0, class_names=None), tiny_default)
    dictionary = trained_dictionary(tiny_default, runs.RUNS_DIR)
    app = open_app(PAGE)
    assert not app.exception and errors(app) == []
    model = models.base_model(models.DEFAULT_MODEL)
    sae, _ = load_sae(dictionary.paths()["dictionary"], model)
    image, _ = shapes_sample(int(images.DEFAULT_IMAGE.removeprefix("shapes:")), model.config.img_size)
    expected = latent_effects(model, sae, LAYER, vx.capture(model, vx.preprocess(image, model.config)).tokens[:, LAYER + 1])
    (table,) = app.table
    shown = table.value
    assert shown["latent"].tolist() == list(expected.top(8))
    first = expected.order[0]
    assert shown["cosine removed vs intact"].iloc[0] == f"{expected.cosines[first]:.6f}"
    assert shown["real if removed"].iloc[0] == points_text(expected.points(expected.real[first]), "% of its length")
    assert widget(app.number_input, "Latent").value == first
    assert not [metric for metric in app.metric if metric.label.startswith("Probability of")]
