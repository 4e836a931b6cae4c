"""ProxyCLIP's proxy on the pages (app/proxies.py): another model of the app captured on the text
model's very pixels, its map the one text.proxyclip computes by hand."""
import numpy as np
import pytest
import torch
from PIL import Image

import vit_explorer as vx
from vit_explorer.app import proxies
from vit_explorer.app.selection import Selection
from vit_explorer.text import load_image_text_model, proxyclip

from helpers import randomize
from textmodels import SMALL_CLIP, open_clip_folder


def test_the_pages_proxy_is_captured_on_the_text_models_pixels(tmp_path):
    open_clip_folder(tmp_path / "clip", SMALL_CLIP)
    clip = load_image_text_model(tmp_path / "clip")
    dino = randomize(vx.ViT(vx.ViTConfig(
        image_size=64, patch_size=4, num_classes=0, embed_dim=24, depth=2, num_heads=2,
        mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225),
    )))
    vx.save_model(dino, tmp_path / "dino.safetensors")
    picture = Image.fromarray(np.random.default_rng(0).integers(0, 256, (40, 56, 3), dtype=np.uint8))
    selection = Selection(f"file:{tmp_path / 'clip'}", 8, "test:proxies", clip.image, picture)

    borrowed = proxies.proxy(selection, f"file:{tmp_path / 'dino.safetensors'}")
    assert borrowed.model.config.img_size == (32, 32) and borrowed.grid_size == (8, 8)  # at the text model's size
    x = selection.model_input()
    by_hand = vx.resize_model(dino, image_size=(32, 32))
    expected = proxyclip.patch_embeddings(clip, vx.capture(clip.image, x), proxyclip.Proxy(
        by_hand, vx.capture(by_hand, proxyclip.proxy_input(x, clip.image.config, by_hand.config)),
    ))
    torch.testing.assert_close(proxyclip.patch_embeddings(clip, vx.capture(clip.image, x), borrowed), expected, atol=1e-5, rtol=0)

    coarse = randomize(vx.ViT(vx.ViTConfig(image_size=36, patch_size=12, num_classes=0, embed_dim=8, depth=1, num_heads=1)))
    vx.save_model(coarse, tmp_path / "coarse.safetensors")
    with pytest.raises(ValueError, match="the proxy cannot read the picture at 32x32 px: the input size must be a multiple"):
        proxies.proxy(selection, f"file:{tmp_path / 'coarse.safetensors'}")
