"""The catalogue's vision-language encoders with their text towers (CLIP ViT-L/14-336, the
Perception Encoder core L/14-336, SigLIP So400m/14-384): a smaller model of each entry's own
settings (its depth and widths cut, its picture size, patch size and preprocessing kept) is
published as open_clip writes it on a Hub on loopback, downloaded through the catalogue, and
compared with open_clip's own pipeline from the served files (create_model_and_transforms,
encode_image, encode_text) on a photo file: every layer's tokens, both embeddings and the
zero-shot probabilities. The full-size entries are checked against open_clip's full-size models
on the meta device in tests/weights/test_catalogue.py."""
from __future__ import annotations

import dataclasses
import functools
import http.server
import json
import threading
from pathlib import Path

import pytest
import torch
from PIL import Image

import vit_explorer as vx
from vit_explorer.text import load_image_text_model, zero_shot
from vit_explorer.weights import catalogue

from textmodels import open_clip, open_clip_folder

SAMPLE = Path(__file__).resolve().parents[2] / "assets" / "samples" / "chelsea.png"
LABELS = ["a cat", "a dog", "a rocket", "a blue circle"]


def _smaller_clip(model_cfg: dict) -> dict:
    """open_clip's own ViT and text tower, 2 layers each, narrow; the rest as the entry's."""
    model_cfg["embed_dim"] = 32
    model_cfg["vision_cfg"].update(width=64, layers=2, head_width=32)
    model_cfg["text_cfg"].update(width=32, heads=2, layers=2)
    return model_cfg


# entry -> (open_clip's pretrained tag, its model config made smaller, the entry's ViT config changes)
SMALLER = {
    "clip_vitl14_336": ("openai", _smaller_clip, dict(embed_dim=64, depth=2, num_heads=2)),
}


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """A Hub on 127.0.0.1 serving tmp_path/hub; the cache in tmp_path/cache."""
    root = tmp_path / "hub"
    root.mkdir()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(QuietHandler, directory=str(root)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv(catalogue.HUB_URL_VARIABLE, f"http://127.0.0.1:{server.server_address[1]}")
    monkeypatch.setenv(catalogue.CACHE_VARIABLE, str(tmp_path / "cache"))
    yield root
    server.shutdown()
    server.server_close()


def smaller_entry(name: str, monkeypatch) -> tuple[str, catalogue.CatalogueEntry]:
    """The entry ``name`` made smaller as SMALLER says, in the catalogue as small_<name>."""
    entry = catalogue.entry(name)
    _, cut, changes = SMALLER[name]
    small = dataclasses.replace(
        entry, source=f"test/small_{name}", config={**entry.config, **changes}, open_clip=cut(entry.open_clip_config()),
    )
    monkeypatch.setitem(catalogue.CATALOGUE, f"small_{name}", small)
    return f"small_{name}", small


def publish(root: Path, name: str, small: catalogue.CatalogueEntry) -> Path:
    """open_clip's model of the small entry with random weights, and the publisher's preprocess_cfg
    (open_clip's registry's for the entry), where the Hub would have them."""
    tag = SMALLER[name.removeprefix("small_")][0]
    pretrained = open_clip.get_pretrained_cfg(catalogue.entry(name.removeprefix("small_")).open_clip, tag)
    preprocess_cfg = {key: list(value) if isinstance(value, tuple) else value for key, value in pretrained.items()
                      if key in ("mean", "std", "interpolation", "resize_mode")}
    folder = root / small.source / "resolve" / "main"
    open_clip_folder(folder, small.open_clip_config(), preprocess_cfg=preprocess_cfg)
    return folder


def open_clips_pipeline(folder: Path, picture: Image.Image):
    """open_clip's own reading of the served files: (every layer's tokens, unit image embedding,
    unit text embeddings, zero-shot probabilities)."""
    model, _, preprocess = open_clip.create_model_and_transforms(f"local-dir:{folder}")
    tokenizer = open_clip.get_tokenizer(f"local-dir:{folder}")
    visual = model.visual
    blocks = visual.trunk.blocks if hasattr(visual, "trunk") else visual.transformer.resblocks
    tokens = []
    hooks = [blocks[0].register_forward_pre_hook(lambda module, args: tokens.append(args[0]))]
    hooks += [block.register_forward_hook(lambda module, args, out: tokens.append(out)) for block in blocks]
    with torch.no_grad():
        image = model.encode_image(preprocess(picture).unsqueeze(0), normalize=True)
        text = model.encode_text(tokenizer(zero_shot.label_prompts(LABELS)), normalize=True)
        logits = model.logit_scale.exp() * image @ text.T
        if getattr(model, "logit_bias", None) is not None:
            probabilities = (logits + model.logit_bias).sigmoid()
        else:
            probabilities = logits.softmax(dim=-1)
    for hook in hooks:
        hook.remove()
    return torch.stack(tokens, dim=1), image, text, probabilities


@pytest.mark.parametrize("name", list(SMALLER))
def test_the_entry_downloads_and_matches_open_clips_pipeline(hub, monkeypatch, name):
    small_name, small = smaller_entry(name, monkeypatch)
    served = publish(hub, small_name, small)
    model = vx.load_pretrained(small_name)
    folder = catalogue.text_folder(small_name)
    assert sorted(path.name for path in folder.iterdir()) == sorted(small.files)
    assert model.config == small.vit_config()
    picture = Image.open(SAMPLE).convert("RGB").resize((400, 300))  # not square: the publisher's crop or squash shows
    tokens, image, text, probabilities = open_clips_pipeline(served, picture)
    words = load_image_text_model(folder, image=model)
    captured = vx.capture(model, vx.preprocess(picture, model.config), layers=())
    assert captured.tokens.shape == tokens.shape
    torch.testing.assert_close(captured.tokens, tokens, atol=1e-4, rtol=0)
    torch.testing.assert_close(words.project_image(captured.logits), image, atol=1e-5, rtol=0)
    embedded = words.embed_texts(zero_shot.label_prompts(LABELS))
    torch.testing.assert_close(embedded, text, atol=1e-5, rtol=0)
    prediction = zero_shot.predict(words, captured.logits, tuple(LABELS), embedded)
    torch.testing.assert_close(prediction.scores, probabilities[0], atol=1e-5, rtol=0)
