"""An SAE run end to end on a tiny model and a few shapes: its events, its files, its card, and an
index that agrees with encoding every token by brute force; in chunks when the tokens do not fit."""
import math
import re
import threading

import numpy as np
import pytest
import torch

import vit_explorer as vx
from vit_explorer.features import train as sae_training
from vit_explorer.features.evaluation import Evaluation
from vit_explorer.features.index import load_index
from vit_explorer.features.sae import explained_variance, load_sae
from vit_explorer.features.tokens import ImageSource, layer_tokens, model_input
from vit_explorer.features.train import (
    SAECaptureEvent, SAEDoneEvent, SAEStepEvent, SAETrainConfig, model_identity, train_sae,
)

from helpers import randomize, tiny_config

IMAGES, PATCHES, WIDTH = 64, 16, 32  # tiny_config: 16 x 16 images, patch 4, embed_dim 32
HELD_OUT = 6  # a tenth of the images, the last ones, measure the dictionary
TRAINED = IMAGES - HELD_OUT


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    path = tmp_path_factory.mktemp("model") / "tiny.safetensors"
    vx.save_model(randomize(vx.ViT(tiny_config(depth=3))), path)
    return path


def run_config(weights, out_dir, **changes) -> SAETrainConfig:
    base = dict(weights=str(weights), layer=1, images=IMAGES, epochs=1, batch_size=128, expansion=4, k=4,
                device="cpu", out_dir=str(out_dir), log_every=3, index_top=5, evaluation_images=8)
    return SAETrainConfig(**{**base, **changes})


def all_tokens(model, layer: int) -> torch.Tensor:
    """(IMAGES * PATCHES, D) every token of the image set, image by image (the held-out ones last)."""
    images = ImageSource("shapes", IMAGES, 16).images(torch.arange(IMAGES))
    return layer_tokens(model, model_input(model, images), layer).flatten(0, 1)


def test_a_run_writes_a_dictionary_and_an_index_that_agree_with_brute_force(weights, tmp_path):
    events = list(train_sae(run_config(weights, tmp_path)))
    captures = [event for event in events if isinstance(event, SAECaptureEvent)]
    *steps, done = events[len(captures):]
    # Before the first step, the capture says how far it is: from none to every image it trains on.
    assert captures[0].images == 0 and captures[-1].images == captures[-1].total_images == TRAINED
    total = math.ceil(TRAINED * PATCHES / 128)
    assert all(isinstance(event, SAEStepEvent) for event in steps) and isinstance(done, SAEDoneEvent)
    assert [event.step for event in steps] == [3, 6, total] and {event.total_steps for event in steps} == {total}
    assert all(0 < event.explained_variance < 1 and event.l0 <= 4 and event.mse > 0 for event in steps)
    # The held-out tokens are measured at the epoch's end only: the last curve point is the card's number.
    assert [event.held_out_explained_variance is None for event in steps] == [True, True, False]
    assert done.path == str(tmp_path / "sae_tiny_layer1.safetensors") and not done.stopped
    assert done.index_path == str(tmp_path / "sae_tiny_layer1.index.npz")
    assert sorted(path.name for path in tmp_path.iterdir()) == [
        "sae_tiny_layer1.index.npz", "sae_tiny_layer1.safetensors",
    ]

    model = vx.load_model(weights)
    sae, card = load_sae(done.path, model, layer=1)
    assert not sae.training and sae.config.width == 4 * WIDTH and sae.config.k == 4
    assert card["metrics"] == done.metrics
    assert set(done.metrics) == {"explained_variance", "mse", "l0", "dead_share", "held_out_tokens"}
    assert card["model"] == model_identity(weights) and card["layer"] == 1 and card["depth"] == 3
    assert ImageSource.from_dict(card["images"]) == ImageSource("shapes", IMAGES, (16, 16))
    assert SAETrainConfig.from_dict(card["settings"]) == run_config(weights, tmp_path)
    # Measured on 8 held-out shapes (the next seed's stream), the numbers on its card.
    assert card["evaluation_images"] == ImageSource("shapes", 8, (16, 16), seed=1).to_dict()
    measured = Evaluation.from_card(card["evaluation"])
    assert measured.images == 8 and measured.tokens == 8 * PATCHES and 0 < measured.nmse < 1 and measured.l0 <= 4
    assert 0 <= measured.prediction_kept <= 1 and measured.kl >= 0 and measured.pooled_cosine is None
    tokens = all_tokens(model, 1)
    assert np.allclose(card["mean"], tokens[: TRAINED * PATCHES].mean(0).numpy(), atol=1e-4)  # the training tokens'
    # One number: the held-out images' tokens, encoded by the dictionary written, on the card and the last point.
    held_out = tokens[TRAINED * PATCHES:]
    with torch.no_grad():
        reconstruction, latents = sae(held_out)
    assert done.metrics["held_out_tokens"] == HELD_OUT * PATCHES
    assert steps[-1].held_out_explained_variance == done.metrics["explained_variance"]
    assert done.metrics["explained_variance"] == pytest.approx(float(explained_variance(held_out, reconstruction)), abs=1e-5)
    assert done.metrics["l0"] == pytest.approx(float((latents > 0).sum(1).double().mean()))

    index = load_index(done.index_path)
    latents = sae.encode(tokens).detach()  # (IMAGES * PATCHES, F) by brute force
    assert index.tokens_seen == IMAGES * PATCHES and index.grid_size == (4, 4) and index.num_prefix_tokens == 0
    assert np.allclose(index.frequency, (latents > 0).double().mean(0).numpy())
    assert np.array_equal(index.histogram.sum(1), (latents > 0).sum(0).numpy())
    assert np.allclose(index.maxima, latents.max(0).values.numpy(), atol=1e-5)
    fired = (latents > 0).sum(0)
    checked = [int(fired.argmax()), int(fired.argmin()), *range(0, sae.config.width, 17)]
    for latent in checked:
        values, rows = latents[:, latent].topk(5)
        expected = [
            (int(row) // PATCHES, int(row) % PATCHES, float(value)) for value, row in zip(values, rows) if value > 0
        ]
        got = index.top(latent)
        assert [(image, patch) for image, patch, _ in got] == [(image, patch) for image, patch, _ in expected]
        assert np.allclose([value for *_, value in got], [value for *_, value in expected], atol=1e-5)
        if len(expected) < 5:
            assert (index.images[latent, len(expected):] == -1).all()
        nonzero = latents[:, latent][latents[:, latent] > 0].numpy()
        if len(nonzero):  # a value within one fine bin (at most 2 x maximum / 320) of an edge may cross it
            histogram, edges = np.histogram(nonzero, bins=20, range=(0, nonzero.max()))
            crossing = np.abs(np.cumsum(index.histogram[latent]) - np.cumsum(histogram))[:-1]
            near = [(np.abs(nonzero - edge) <= 2 * nonzero.max() / 320).sum() for edge in edges[1:-1]]
            assert index.histogram[latent].sum() == len(nonzero) and (crossing <= near).all()


def test_a_run_in_chunks_captures_at_most_a_chunk_and_indexes_every_image(weights, tmp_path, monkeypatch):
    captured = []
    capture = sae_training.source_tokens

    def recording(model, source, indices, *args, **kwargs):
        captured.append(indices.clone())
        return capture(model, source, indices, *args, **kwargs)

    monkeypatch.setattr(sae_training, "source_tokens", recording)
    chunk = 10  # images whose tokens fit the buffer
    events = list(train_sae(run_config(weights, tmp_path, epochs=2, buffer_bytes=chunk * PATCHES * WIDTH * 4)))
    *steps, done = [event for event in events if not isinstance(event, SAECaptureEvent)]
    # Only the capture before the first step reports (the steps' own events follow the rest).
    assert [(event.images, event.total_images) for event in events if isinstance(event, SAECaptureEvent)] == [(0, chunk), (chunk, chunk)]
    held_out = [indices.tolist() for indices in captured if indices.tolist() == list(range(TRAINED, IMAGES))]
    captured = [indices for indices in captured if indices.tolist() != list(range(TRAINED, IMAGES))]
    assert len(held_out) == 1  # captured once, at the first epoch's end, and measured at each
    assert max(len(indices) for indices in captured) == chunk
    assert len(captured) == 2 * math.ceil(TRAINED / chunk)  # every chunk again each epoch
    first, second = torch.cat(captured[: len(captured) // 2]), torch.cat(captured[len(captured) // 2:])
    assert sorted(first.tolist()) == sorted(second.tolist()) == list(range(TRAINED))
    assert not torch.equal(first, second)  # a new order every epoch
    assert [event.epoch for event in steps if event.held_out_explained_variance is not None] == [1, 2]
    per_epoch = 5 * math.ceil(chunk * PATCHES / 128) + math.ceil(8 * PATCHES / 128)
    assert steps[-1].step == steps[-1].total_steps == 2 * per_epoch
    assert steps[-1].explained_variance > steps[0].explained_variance
    index = load_index(done.index_path)
    assert index.tokens_seen == IMAGES * PATCHES and set(index.images[index.images >= 0].tolist()) <= set(range(IMAGES))

    held = []
    monkeypatch.setattr(sae_training, "source_tokens", lambda *args, **kw: held.append(1) or capture(*args, **kw))
    list(train_sae(run_config(weights, tmp_path, epochs=3, name="held")))
    assert len(held) == 2  # all of them fit: captured once for three epochs, the held-out images once


def test_batchtopk_and_matryoshka_runs_are_rebuilt_from_their_files(weights, tmp_path):
    done = list(train_sae(run_config(weights, tmp_path, activation="batchtopk", matryoshka=3, k=2)))[-1]
    sae, card = load_sae(done.path, vx.load_model(weights), layer=1)
    assert (sae.config.activation, sae.config.prefixes, sae.config.width) == ("batchtopk", (32, 64), 128)
    assert sae.threshold > 0 and card["settings"]["activation"] == "batchtopk" and card["settings"]["matryoshka"] == 3
    latents = sae.encode(all_tokens(vx.load_model(weights), 1)).detach()  # above the threshold, any number a token
    assert torch.equal(latents > 0, (sae.pre_activations(all_tokens(vx.load_model(weights), 1)) > sae.threshold))
    assert np.allclose(load_index(done.index_path).frequency, (latents > 0).double().mean(0).numpy())
    # Its threshold, estimated again with the finished encoder, keeps about k = 2 a token on its tokens.
    assert 1.6 <= (latents > 0).sum(-1).float().mean() <= 2.4
    # A file written before BatchTopK (the shipped dictionary) still reads as TopK.
    shipped, _ = load_sae(vx.DEFAULT_WEIGHTS.with_name("sae_shapes_layer2.safetensors"))
    assert (shipped.config.activation, shipped.config.prefixes) == ("topk", ()) and not hasattr(shipped, "threshold")


def test_a_stopped_run_still_writes_both_files(weights, tmp_path):
    stop = threading.Event()
    stop.set()
    events = list(train_sae(run_config(weights, tmp_path, prefix_tokens=True, name="stopped"), stop=stop))
    assert [type(event) for event in events] == [SAECaptureEvent, SAECaptureEvent, SAEStepEvent, SAEDoneEvent]
    assert events[2].step == 1 and events[3].stopped
    assert events[2].held_out_explained_variance == events[3].metrics["explained_variance"]  # measured when stopped
    _, card = load_sae(events[3].path)
    assert card["stopped"] and card["prefix_tokens"]
    index = load_index(events[3].index_path)
    assert index.num_prefix_tokens == 1 and index.tokens_seen == IMAGES * (PATCHES + 1)
    assert events[3].metrics["held_out_tokens"] == HELD_OUT * (PATCHES + 1)


def test_a_given_model_is_used_as_it_is(weights, tmp_path):
    model = vx.load_model(weights)
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    done = list(train_sae(run_config(weights, tmp_path, layer=2, images=8), model=model))[-1]
    assert load_sae(done.path, model, layer=2)[1]["layer"] == 2
    assert not model.training and all(torch.equal(before[name], tensor) for name, tensor in model.state_dict().items())


def test_a_layer_the_model_lacks_is_refused(weights, tmp_path):
    with pytest.raises(ValueError, match=r"^layer 3 does not exist; the model has layers 0..2$"):
        next(train_sae(run_config(weights, tmp_path, layer=3)))
    with pytest.raises(ValueError, match=r"^an SAE run needs at least 2 images: one is held out to measure the dictionary$"):
        next(train_sae(run_config(weights, tmp_path, images=1)))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("changes, message", [
    (dict(layer=-1), "layer must be a whole number of at least 0, not -1"),
    (dict(dataset="imagenet"), "unknown image set 'imagenet'"),
    (dict(images=0), "images must be a whole number of at least 1, not 0"),
    (dict(k=1.5), "k must be a whole number of at least 1, not 1.5"),
    (dict(lr=float("nan")), "lr must be a positive number, not nan"),
    (dict(lr=0), "lr must be a positive number, not 0"),
    (dict(device="tpu"), "device must be auto, cpu, cuda or mps, not 'tpu'"),
    (dict(name="../x"), "the run name '../x' must be a plain file name"),
    (dict(prefix_tokens="yes"), "prefix_tokens must be true or false, not 'yes'"),
    (dict(image_size=0), "image_size must be a whole number of at least 1, not 0"),
    (dict(image_size=100_000), "image_size must be at most 2048 pixels, not 100,000"),
    (dict(activation="relu"), "activation must be one of topk, batchtopk, not 'relu'"),
    (dict(matryoshka=0), "matryoshka must be a whole number of at least 1, not 0"),
    (dict(matryoshka=40), "matryoshka must be at most 17 nested dictionaries, not 40"),
])
def test_bad_settings_are_one_sentence(changes, message):
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        SAETrainConfig(**{"weights": "default", "layer": 0, **changes})


def test_settings_round_trip_and_name_the_run():
    config = SAETrainConfig(weights="default", layer=3, image_size=32)
    assert SAETrainConfig.from_json(config.to_json()) == config
    assert config.run_name == "sae_vit_shapes_layer3" and config.replace(name="mine").run_name == "mine"
    assert config.weights_path == vx.DEFAULT_WEIGHTS


def test_a_catalogue_model_is_named_and_admitted_from_its_entry_without_a_download():
    from vit_explorer.training.admission import Limits, RunRefused, admit
    from vit_explorer.weights import catalogue

    config = SAETrainConfig(weights="pretrained:dino_vits16", layer=8, images=1000, device="cpu")
    assert config.pretrained == "dino_vits16" and config.weights_path == catalogue.cached_path("dino_vits16")
    assert config.run_name == "sae_dino_vits16_layer8"
    estimate = admit(config, Limits(max_runs=1, queue_size=1, memory=64 * 2**30, threads=1))
    # ViT-S/16: 384 dimensions, 6,144 latents; 1,000 images x 196 patches of 384 floats held at once
    assert estimate.data >= 1000 * 196 * 384 * 4 and estimate.model > 16 * 2 * 384 * 6144
    with pytest.raises(RunRefused, match="Layer 12 does not exist: the model has layers 0..11"):
        admit(config.replace(layer=12), Limits(max_runs=1, queue_size=1, memory=64 * 2**30, threads=1))
    with pytest.raises(ValueError, match="is not a model of the catalogue"):
        SAETrainConfig(weights="pretrained:no_such_model", layer=0)
