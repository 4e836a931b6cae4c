"""The Head types page's heads in words: for a CLIP-shaped model with both towers, each of the last
layers' heads described as text/heads.py describes it by hand over the same pictures; a SigLIP-shaped
model says why its heads are not described."""
from pathlib import Path

import pytest
import torch

import vit_explorer as vx
from vit_explorer.app import images
from vit_explorer.text import load_image_text_model
from vit_explorer.text.descriptions import DESCRIPTIONS
from vit_explorer.text.heads import LAST_LAYERS, describe_heads, head_contributions

from apptest import tiny_default  # noqa: F401 (the fixture)
from apptest import open_words_app
from textmodels import SMALL_CLIP, open_clip_folder, siglip_folder

PAGE = "views/head_types.py"
PHOTOS = ["photo:astronaut.png", "photo:chelsea.png", "photo:coffee.png", "photo:rocket.jpg"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("text models")
    open_clip_folder(root / "clip", SMALL_CLIP)
    return {"clip": root / "clip", "siglip": siglip_folder(root / "siglip")}


def test_each_late_head_is_described_as_by_hand(folders):
    app = open_words_app(folders["clip"], PAGE)
    app.toggle(key="types_words").set_value(True).run()
    assert not app.exception, app.exception
    (table,) = app.dataframe
    shown = table.value
    model = load_image_text_model(folders["clip"])
    config = model.image.config
    batch = torch.cat([vx.preprocess(images.resolve_image(key, config.img_size)[1], config) for key in PHOTOS])
    captured = vx.capture(model.image, batch, layers=())
    layers = list(range(max(0, config.depth - LAST_LAYERS), config.depth))
    writes = head_contributions(model, captured.tokens, captured.grid_size, layers)
    expected = describe_heads(writes.flatten(1, 2), model.embed_texts(list(DESCRIPTIONS)), DESCRIPTIONS)
    assert len(shown) == len(layers) * config.num_heads
    for row, described in zip(shown.to_dict("records"), expected):
        assert row["description 1"] == f"{described[0][0]} ({described[0][1]:.0%})"
        assert row["description 3"].startswith(described[2][0])


def test_a_model_that_pools_otherwise_says_why(folders):
    app = open_words_app(folders["siglip"], PAGE)
    assert any("pools its tokens another way" in info.value for info in app.info)
    assert not app.dataframe
