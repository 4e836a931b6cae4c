"""SAE and index files: the round trip, and every refusal one sentence, decided from the header
before anything is allocated for what a file claims."""
import json
import re
import struct

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import vit_explorer as vx
from vit_explorer.features import sae as sae_module
from vit_explorer.features.index import LatentIndex, load_index, save_index
from vit_explorer.features.sae import SAE_KEY, SAEConfig, SAEError, SparseAutoencoder, load_sae, read_card, save_sae

from helpers import tiny_config

MODEL = vx.ViT(tiny_config(depth=2))  # 32-wide tokens, layers 0..1


def saved(tmp_path, d_model=32, layer=1, name="sae.safetensors"):
    torch.manual_seed(0)
    sae = SparseAutoencoder(SAEConfig(d_model, 64, 4))
    with torch.no_grad():
        sae.input_scale.fill_(0.5)
        sae.b_dec.normal_()
    path = tmp_path / name
    save_sae(sae, path, {"layer": layer, "metrics": {"l0": 4.0}})
    return sae, path


def nothing_allocated_here(monkeypatch):
    """Fail the test if a dictionary is built or its tensors read from now on."""
    def refuse(*args, **kwargs):
        raise AssertionError("allocated before the refusal")

    monkeypatch.setattr(sae_module, "SparseAutoencoder", refuse)
    monkeypatch.setattr("safetensors.torch.load_file", refuse)


def test_a_dictionary_round_trips(tmp_path):
    sae, path = saved(tmp_path)
    loaded, card = load_sae(path, MODEL, layer=1)
    assert card == {"layer": 1, "metrics": {"l0": 4.0}} and not loaded.training
    for name, tensor in sae.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    tokens = torch.randn(10, 32)
    assert torch.equal(loaded(tokens)[0], sae(tokens)[0])


@pytest.mark.parametrize("d_model, layer, asked, message", [
    (48, 1, None, "this dictionary reads 48-wide tokens and the model's are 32-wide: it was trained on another model"),
    (32, 2, None, "this dictionary reads layer 2, which the model (layers 0..1) does not have"),
    (32, 1, 0, "this dictionary reads layer 1, not layer 0"),
])
def test_another_models_dictionary_is_refused_before_allocating(tmp_path, d_model, layer, asked, message, monkeypatch):
    _, path = saved(tmp_path, d_model, layer)
    nothing_allocated_here(monkeypatch)
    with pytest.raises(SAEError, match="^" + re.escape(message)):
        load_sae(path, MODEL, layer=asked)


def test_a_header_claiming_a_billion_latents_is_refused_without_allocating(tmp_path, monkeypatch):
    claims = tmp_path / "claims.safetensors"
    save_file({"W_enc": torch.zeros(2, 2)}, str(claims),
              metadata={SAE_KEY: json.dumps({"d_model": 768, "width": 10**9, "k": 32})})
    # A header whose tensors declare the billion latents themselves, on a file of a few bytes.
    declares = tmp_path / "declares.safetensors"
    header = json.dumps({
        "__metadata__": {SAE_KEY: json.dumps({"d_model": 768, "width": 10**9, "k": 32})},
        "W_enc": {"dtype": "F32", "shape": [768, 10**9], "data_offsets": [0, 4 * 768 * 10**9]},
    }).encode()
    declares.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 16)
    nothing_allocated_here(monkeypatch)
    with pytest.raises(SAEError, match="^a dictionary of 1,000,000,000 latents over 768 dimensions is larger than"):
        read_card(claims)
    with pytest.raises(SAEError, match="^this is not a readable SAE file"):
        load_sae(declares, MODEL)


def test_weights_are_scanned_a_chunk_at_a_time_to_the_last_row(tmp_path, monkeypatch):
    sae, path = saved(tmp_path)
    monkeypatch.setattr(sae_module, "WEIGHTS_CHUNK", 3 * 32)  # W_dec (64, 32) in 22 chunks of 3 rows
    sae_module.check_weights(path)
    with torch.no_grad():
        sae.W_dec[-1, -1] = float("nan")
    save_sae(sae, path, {"layer": 1})
    with pytest.raises(SAEError, match="^this SAE file's weights are not all finite numbers"):
        sae_module.check_weights(path)
    with pytest.raises(SAEError, match="^this SAE file's weights are not all finite numbers"):
        load_sae(path)


def test_files_that_are_not_dictionaries_are_refused(tmp_path, monkeypatch):
    model_file = tmp_path / "model.safetensors"
    vx.save_model(MODEL, model_file)
    text = tmp_path / "notes.safetensors"
    text.write_text("not a dictionary at all, but long enough to have a header length")
    mismatched = tmp_path / "mismatched.safetensors"
    save_file({"W_enc": torch.zeros(32, 8)}, str(mismatched), metadata={SAE_KEY: SAEConfig(32, 64, 4).to_json()})
    nothing_allocated_here(monkeypatch)
    with pytest.raises(SAEError, match="^this file is not a sparse autoencoder saved by vit_explorer$"):
        load_sae(model_file, MODEL)
    with pytest.raises(SAEError, match="^this is not a readable SAE file"):
        load_sae(text)
    with pytest.raises(SAEError, match="^this SAE file's tensors do not match the dictionary it describes$"):
        load_sae(mismatched)


def small_index() -> LatentIndex:
    return LatentIndex(
        images=np.array([[3, 1], [2, -1]]), patches=np.array([[5, 0], [7, 0]]),
        values=np.array([[2.5, 1.0], [0.5, 0.0]], dtype=np.float32), frequency=np.array([0.25, 0.125]),
        histogram=np.array([[0, 1, 1], [1, 0, 0]]), maxima=np.array([2.5, 0.5], dtype=np.float32),
        tokens_seen=8, grid_size=(2, 4), num_prefix_tokens=1,
    )


def test_an_index_round_trips_and_a_broken_one_is_refused(tmp_path):
    path = tmp_path / "x.index.npz"
    save_index(small_index(), path)
    index = load_index(path)
    assert index.top(0) == [(3, 5, 2.5), (1, 0, 1.0)] and index.top(1) == [(2, 7, 0.5)]
    assert index.grid_size == (2, 4) and index.num_prefix_tokens == 1 and index.tokens_seen == 8
    assert list(tmp_path.iterdir()) == [path]  # no temporary file left

    truncated = tmp_path / "truncated.npz"
    truncated.write_bytes(path.read_bytes()[:200])
    lacking = tmp_path / "lacking.npz"
    np.savez(lacking, images=np.zeros((2, 2)))
    disagreeing = tmp_path / "disagreeing.npz"
    save_index(LatentIndex(**{**small_index().__dict__, "maxima": np.zeros(3, dtype=np.float32)}), disagreeing)
    pickled = tmp_path / "pickled.npz"
    np.savez(pickled, **{**{name: np.asarray(value) for name, value in small_index().__dict__.items()},
                         "images": np.array([object()])})
    for broken, message in [
        (truncated, "this is not a readable SAE index file"),
        (lacking, "this SAE index file lacks some of its arrays or holds the wrong kinds"),
        (disagreeing, "this SAE index file's arrays do not agree on the number of latents"),
        (pickled, "this SAE index file lacks some of its arrays or holds the wrong kinds"),
        (tmp_path / "missing.npz", "this is not a readable SAE index file"),
    ]:
        with pytest.raises(SAEError, match="^" + re.escape(message) + "$"):
            load_index(broken)
