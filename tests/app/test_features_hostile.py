"""The Features page with a bad file beside a good dictionary (each kind of tests/features/
test_hostile_sae.py that reaches the page): the bad one is skipped with a sentence, the good one
still shows its numbers and its gallery, and the page renders for another model too."""
import math
import os
import re
import shutil
import zipfile

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import vit_explorer as vx
from vit_explorer.app import runs
from vit_explorer.features.index import LatentIndex, load_index, save_index
from vit_explorer.features.sae import CARD_KEY, SAE_KEY, load_sae, save_sae
from vit_explorer.features.train import SAETrainConfig, train_sae

from apptest import (  # noqa: F401 (tiny_default: autouse)
    PHOTO, errors, figure_titles, open_app, tiny_default, tiny_model, title_matching, widget,
)

PAGE = "views/features.py"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny default model, and a dictionary of its layer 1 with its index, trained once (each
    test's default model is this file again: the card names the model by its bytes)."""
    folder = tmp_path_factory.mktemp("trained")
    vx.save_model(tiny_model(), folder / "tiny_default.safetensors")
    config = SAETrainConfig(
        weights=str(folder / "tiny_default.safetensors"), layer=1, images=16, epochs=1, batch_size=128, expansion=2,
        k=4, device="cpu", out_dir=str(folder), name="good", log_every=5, index_top=4,
    )
    for _ in train_sae(config):
        pass
    return {**config.paths(), "model": folder / "tiny_default.safetensors"}


def _resaved(good, bad, card_changes=None, weights=None):
    sae, card = load_sae(good)
    if weights is not None:
        with torch.no_grad():
            weights(sae)
    save_sae(sae, bad, {**card, **(card_changes or {})})


def _bad_index(good_paths, bad, **changes):
    """The good dictionary again beside an index with ``changes`` (newer: the page's first choice)."""
    shutil.copy(good_paths["dictionary"], bad)
    index = load_index(good_paths["index"])
    save_index(LatentIndex(**{**index.__dict__, **changes}), bad.with_suffix(".index.npz"))


def _not_arrays(good_paths, bad):
    shutil.copy(good_paths["dictionary"], bad)
    with zipfile.ZipFile(bad.with_suffix(".index.npz"), "w") as archive:
        for name in ("images", "patches", "values", "frequency", "histogram", "maxima", "tokens_seen", "grid_size",
                     "num_prefix_tokens"):
            archive.writestr(f"{name}.npy", "not an array")


def _deep_card(good, bad):
    sae, _ = load_sae(good)
    save_file({name: value.contiguous() for name, value in sae.state_dict().items()}, str(bad),
              metadata={SAE_KEY: sae.config.to_json(), CARD_KEY: "[" * 100_000 + "]" * 100_000})


# kind -> (what writes the bad file beside the good one, what the page says of it)
SAE_KINDS = {
    "SAE file of 3 bytes": (lambda good, bad: bad.write_bytes(b"abc"), "too short to be a safetensors file"),
    "card nested 100,000 deep": (_deep_card, "settings are unreadable: nested too deeply"),
    "a list where a number belongs": (lambda good, bad: _resaved(good, bad, {"metrics": {"explained_variance": [1] * 5}}),
                                      "card has metrics .*, not numbers by name"),
    "image set folder: elsewhere": (lambda good, bad: _resaved(good, bad, {"images": {
        "dataset": f"folder:{bad.parent.parent / 'elsewhere'}", "count": 16, "image_size": [32, 32], "seed": 0}}),
        "names an image folder outside the data and dictionary folders"),
    "image set 100,000 pixels wide": (lambda good, bad: _resaved(good, bad, {"images": {
        "dataset": "shapes", "count": 16, "image_size": [32, 100_000], "seed": 0}}), "image sides of at most 2048 pixels"),
    "decoder weights NaN": (lambda good, bad: _resaved(good, bad, weights=lambda sae: sae.W_dec.fill_(math.nan)),
                            "weights are not all finite numbers"),
}
INDEX_KINDS = {
    "index entries at image 10**9": (lambda paths, bad: _bad_index(paths, bad, images=np.full_like(
        load_index(paths["index"]).images, 10**9)), "points at images beyond its image set's 16"),
    "index entries at position 10**6": (lambda paths, bad: _bad_index(paths, bad, patches=np.full_like(
        load_index(paths["index"]).patches, 10**6)), "points at positions beyond the tokens"),
    "index of latents the dictionary lacks": (lambda paths, bad: _bad_index(paths, bad, **{
        name: value[:5] for name, value in load_index(paths["index"]).__dict__.items()
        if name in ("images", "patches", "values", "frequency", "histogram", "maxima")}), "describes 5 latents"),
    "index members not arrays": (_not_arrays, "truncated or holds something else than arrays"),
}


def _good(trained, default_model):
    shutil.copy(trained["model"], default_model)
    runs.RUNS_DIR.mkdir(parents=True, exist_ok=True)
    for path in (trained["dictionary"], trained["index"]):
        shutil.copy(path, runs.RUNS_DIR / path.name)
    return runs.RUNS_DIR / trained["dictionary"].name, runs.RUNS_DIR / "bad.safetensors"


def _other_model_renders(app, tmp_path) -> list[str]:
    """Switch the sidebar to another model (no dictionary of its own): the page renders; its warnings."""
    other = tmp_path / "other.safetensors"
    vx.save_model(tiny_model(depth=3), other)
    app.session_state["uploaded_models"] = {f"file:{other}": "Uploaded: other"}
    app.session_state["requested_model"] = f"file:{other}"
    app.run()
    assert not app.exception and errors(app) == [] and app.session_state["model_key"] == f"file:{other}"
    assert "python -m vit_explorer sae" in app.info[0].value
    return [warning.value for warning in app.warning]


@pytest.mark.parametrize("kind", SAE_KINDS)
def test_a_bad_dictionary_beside_a_good_one_is_skipped_in_a_sentence(trained, kind, tiny_default, tmp_path):
    good, bad = _good(trained, tiny_default)
    write, said = SAE_KINDS[kind]
    write(trained["dictionary"], bad)
    os.utime(bad, (good.stat().st_mtime + 10,) * 2)  # the newest: it would be the first choice
    app = open_app(PAGE)
    assert not app.exception and errors(app) == []
    (warning,) = [warning.value for warning in app.warning]
    assert re.search("^bad.safetensors was skipped: .*" + said, warning) and str(tmp_path) not in warning, warning
    (offered,) = widget(app.selectbox, "Dictionary").options
    assert offered.startswith("good (layer 1")
    assert title_matching(app, "^Latent \\d+'s top patches over its training images")
    # Another model's page: the broken file is skipped there too; this model's unusable one is not its business.
    others = _other_model_renders(app, tmp_path)
    assert others in ([], [warning])


@pytest.mark.parametrize("kind", INDEX_KINDS)
def test_a_bad_index_leaves_its_dictionary_without_a_gallery_in_a_sentence(trained, kind, tiny_default, tmp_path):
    good, bad = _good(trained, tiny_default)
    write, said = INDEX_KINDS[kind]
    write(trained, bad)
    os.utime(bad, (good.stat().st_mtime + 10,) * 2)
    app = open_app(PAGE)
    assert not app.exception and errors(app) == [] and not app.warning
    assert widget(app.selectbox, "Dictionary").value.startswith("bad (layer 1")
    (skipped,) = [info.value for info in app.info if "index file was skipped" in info.value]
    assert re.search(said, skipped) and str(tmp_path) not in skipped, skipped
    assert not [title for title in figure_titles(app) if "top patches over" in title]
    # The good dictionary beside it still shows its gallery.
    widget(app.selectbox, "Dictionary").set_value(next(option for option in widget(app.selectbox, "Dictionary").options
                                                       if option.startswith("good"))).run()
    assert not app.exception and errors(app) == []
    assert title_matching(app, "^Latent \\d+'s top patches over its training images")
    assert _other_model_renders(app, tmp_path) == []


def _folder_set(runs_dir):
    """A folder: image set inside the runs folder (where a run may read one) of 2 training images
    (2 classes of 2; every 5th per class is the test split), fewer than the 16 the index points at."""
    for name in ("a", "b"):
        (runs_dir / "pictures" / name).mkdir(parents=True)
        for number in range(2):
            vx.data.images.load_image(PHOTO).resize((32, 32)).save(runs_dir / "pictures" / name / f"{number}.png")
    return {"dataset": f"folder:{runs_dir / 'pictures'}", "count": 16, "image_size": [32, 32], "seed": 0}


@pytest.mark.parametrize("images, said", [
    (lambda runs_dir: {"dataset": "photos", "count": 10**6, "image_size": [32, 32], "seed": 0},
     "its 1,000,000 training images at 32x32 are more than this server reads for a gallery"),
    (_folder_set, "its training images \\(folder\\) cannot be read on this server"),
], ids=["a stored set too large to read", "a folder of fewer images than its index"])
def test_a_gallery_it_cannot_read_here_is_a_sentence(trained, images, said, tiny_default, tmp_path):
    good, bad = _good(trained, tiny_default)
    shutil.copy(trained["index"], bad.with_suffix(".index.npz"))
    _resaved(good, bad, {"images": images(runs.RUNS_DIR)})
    app = open_app(PAGE)
    assert not app.exception and errors(app) == [] and not app.warning
    assert widget(app.selectbox, "Dictionary").value.startswith("bad (layer 1")
    (unread,) = [info.value for info in app.info if "index is read, but" in info.value]
    assert re.search(said, unread) and str(tmp_path) not in unread, unread
    assert title_matching(app, "^Latent \\d+'s activations")  # the rest of the page is drawn


def test_many_broken_files_are_said_in_a_few_lines(trained, tiny_default):
    good, _ = _good(trained, tiny_default)
    for number in range(5):
        (runs.RUNS_DIR / f"broken{number}.safetensors").write_bytes(b"abc")
    app = open_app(PAGE)
    assert not app.exception and errors(app) == [] and len(app.warning) == 3
    assert any(caption.value == "2 more files in the dictionaries' folders were skipped too." for caption in app.caption)
    assert widget(app.selectbox, "Dictionary").value.startswith("good (layer 1")
