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
import types
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

import vit_explorer as vx
from vit_explorer.text import load_image_text_model, zero_shot
from vit_explorer.weights import catalogue

from test_catalogue import serve_hub
from textmodels import open_clip, open_clip_folder

SAMPLE = Path(__file__).resolve().parents[2] / "assets" / "samples" / "chelsea.png"
# The last one is longer than PE's 32 tokens of context: cut as open_clip cuts it, its end token kept.
LABELS = ["a cat", "a dog", "a rocket", "a small blue circle drawn on an old sheet of yellow paper beside a red"
          " square, a green triangle, two black dots and a yellow star under a grey cloud"]


def _smaller_clip(model_cfg: dict) -> dict:
    """open_clip's own ViT and text tower, 2 layers each, narrow; the rest as the entry's."""
    model_cfg["embed_dim"] = 32
    model_cfg["vision_cfg"].update(width=64, layers=2, head_width=32)
    model_cfg["text_cfg"].update(width=32, heads=2, layers=2)
    return model_cfg


def _smaller_text(model_cfg: dict) -> dict:
    """A timm trunk's model: the text tower narrow, 2 layers; the trunk is cut where open_clip makes it."""
    model_cfg["embed_dim"] = 32
    model_cfg["text_cfg"].update(width=32, heads=2, layers=2)
    return model_cfg


def _smaller_siglip(model_cfg: dict) -> dict:
    """SigLIP's image embedding is its trunk's pooled token (no projection): the space as wide as
    the cut trunk, the text tower narrower and projected into it."""
    model_cfg["embed_dim"] = 128
    model_cfg["text_cfg"].update(width=32, heads=2, layers=2)
    return model_cfg


@dataclasses.dataclass(frozen=True)
class Smaller:
    tag: str  # open_clip's pretrained tag of the entry: its preprocess_cfg
    cut: Callable[[dict], dict]  # the entry's open_clip model config made smaller
    changes: dict  # the entry's ViT config, as cut
    trunk: dict | None = None  # a timm trunk's cut, given to timm.create_model where open_clip makes it


SMALLER = {
    "clip_vitl14_336": Smaller("openai", _smaller_clip, dict(embed_dim=64, depth=2, num_heads=2)),
    "pe_core_l14_336": Smaller("meta", _smaller_text, dict(embed_dim=128, depth=2, num_heads=2), dict(embed_dim=128, depth=2, num_heads=2)),
    "siglip_so400m14_384": Smaller("webli", _smaller_siglip, dict(embed_dim=128, depth=2, num_heads=2), dict(embed_dim=128, depth=2, num_heads=2)),
}


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """A Hub on 127.0.0.1 serving tmp_path/hub; the cache in tmp_path/cache."""
    with serve_hub(tmp_path, monkeypatch) as (root, _):
        yield root


def smaller_entry(name: str, monkeypatch) -> tuple[str, catalogue.CatalogueEntry]:
    """The entry ``name`` made smaller as SMALLER says, in the catalogue as small_<name>."""
    entry, smaller = catalogue.entry(name), SMALLER[name]
    small = dataclasses.replace(
        entry, source=f"test/small_{name}", config={**entry.config, **smaller.changes},
        open_clip=smaller.cut(entry.open_clip_config()),
    )
    monkeypatch.setitem(catalogue.CATALOGUE, f"small_{name}", small)
    if smaller.trunk is not None:  # open_clip's own module alone sees the cut (timm's stays whole for the loader)
        import open_clip.timm_model
        import timm

        trunk = small.open_clip_config()["vision_cfg"]["timm_model_name"]

        def create_model(model_name, **kwargs):
            return timm.create_model(model_name, **(smaller.trunk if model_name == trunk else {}), **kwargs)

        monkeypatch.setattr(open_clip.timm_model, "timm", types.SimpleNamespace(create_model=create_model))
    return f"small_{name}", small


def publish(root: Path, name: str, small: catalogue.CatalogueEntry) -> Path:
    """open_clip's model of the small entry with random weights, and the publisher's preprocess_cfg
    (open_clip's registry's for the entry), where the Hub would have them."""
    tag = SMALLER[name.removeprefix("small_")].tag
    pretrained = open_clip.get_pretrained_cfg(catalogue.entry(name.removeprefix("small_")).open_clip, tag)
    preprocess_cfg = {key: list(value) if isinstance(value, tuple) else value for key, value in pretrained.items()
                      if key in ("mean", "std", "interpolation", "resize_mode")}
    folder = root / small.source / "resolve" / "main"
    open_clip_folder(folder, small.open_clip_config(), preprocess_cfg=preprocess_cfg)
    weights = folder / "open_clip_model.safetensors"
    state = load_file(weights)
    if "visual.trunk.head.bias" in state:  # a trunk's head as the projection: the zeros timm writes for PE's proj
        state["visual.trunk.head.bias"].zero_()
        save_file(state, weights)
    return folder


def open_clips_pipeline(folder: Path, picture: Image.Image):
    """open_clip's own reading of the served files: (every layer's tokens, unit image embedding,
    the prompts' token ids, unit text embeddings, zero-shot probabilities)."""
    model, _, preprocess = open_clip.create_model_and_transforms(f"local-dir:{folder}")
    tokenizer = open_clip.get_tokenizer(f"local-dir:{folder}")
    visual = model.visual
    blocks = visual.trunk.blocks if hasattr(visual, "trunk") else visual.transformer.resblocks
    tokens = []
    hooks = [blocks[0].register_forward_pre_hook(lambda module, args: tokens.append(args[0]))]
    hooks += [block.register_forward_hook(lambda module, args, out: tokens.append(out)) for block in blocks]
    ids = tokenizer(zero_shot.label_prompts(LABELS))
    with torch.no_grad():
        image = model.encode_image(preprocess(picture).unsqueeze(0), normalize=True)
        text = model.encode_text(ids, normalize=True)
        logits = model.logit_scale.exp() * image @ text.T
        if getattr(model, "logit_bias", None) is not None:
            probabilities = (logits + model.logit_bias).sigmoid()
        else:
            probabilities = logits.softmax(dim=-1)
    for hook in hooks:
        hook.remove()
    return torch.stack(tokens, dim=1), image, ids, text, probabilities


@pytest.mark.parametrize("name", list(SMALLER))
def test_the_entry_downloads_and_matches_open_clips_pipeline(hub, monkeypatch, name):
    small_name, small = smaller_entry(name, monkeypatch)
    served = publish(hub, small_name, small)
    model = vx.load_pretrained(small_name)
    folder = catalogue.text_folder(small_name)
    assert sorted(path.name for path in folder.iterdir()) == sorted(small.files)
    assert model.config == small.vit_config()
    picture = Image.open(SAMPLE).convert("RGB").resize((400, 300))  # not square: the publisher's crop or squash shows
    tokens, image, ids, text, probabilities = open_clips_pipeline(served, picture)
    words = load_image_text_model(folder, image=model)
    assert torch.equal(words.tokenize(zero_shot.label_prompts(LABELS)), ids)
    captured = vx.capture(model, vx.preprocess(picture, model.config), layers=())
    assert captured.tokens.shape == tokens.shape
    torch.testing.assert_close(captured.tokens, tokens, atol=1e-4, rtol=0)
    torch.testing.assert_close(words.project_image(captured.logits), image, atol=1e-5, rtol=0)
    embedded = words.embed_texts(zero_shot.label_prompts(LABELS))
    torch.testing.assert_close(embedded, text, atol=1e-5, rtol=0)
    prediction = zero_shot.predict(words, captured.logits, tuple(LABELS), embedded)
    torch.testing.assert_close(prediction.scores, probabilities[0], atol=1e-5, rtol=0)
    # The same files uploaded as a folder read alike (the cut trunk's config inferred from its tensors).
    uploaded = load_image_text_model(served)
    torch.testing.assert_close(uploaded.project_image(uploaded.image(vx.preprocess(picture, uploaded.image.config))), image, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", list(SMALLER))
def test_the_entry_is_what_the_loader_reads_from_the_full_size_file(name):
    """open_clip's full-size model of the entry (on the meta device) read as an open_clip folder is:
    its tensors renamed, the config the loader infers from their shapes and the registry's
    preprocess_cfg is the entry's."""
    from vit_explorer.weights import from_open_clip
    from vit_explorer.weights.infer import infer_config

    entry = catalogue.entry(name)
    model_cfg = entry.open_clip_config()
    pretrained = open_clip.get_pretrained_cfg(entry.open_clip, SMALLER[name].tag)
    preprocess_cfg = {key: pretrained[key] for key in ("mean", "std", "interpolation", "resize_mode")}
    arguments = {key: value for key, value in model_cfg.items() if key != "custom_text"}
    with torch.device("meta"):
        model = (open_clip.CustomTextCLIP if model_cfg.get("custom_text") else open_clip.CLIP)(**arguments)
    config = {"model_cfg": model_cfg, "preprocess_cfg": preprocess_cfg}
    state, known = from_open_clip.convert(model.state_dict(), config, name)
    inferred = infer_config(state, known, {}, name)
    assert dataclasses.replace(inferred, normalization_source="given") == entry.config_without_names()


def test_a_projection_with_a_bias_is_refused_and_nothing_kept(hub, monkeypatch, tmp_path):
    """The Perception Encoder's projection is its trunk's head, whose bias timm writes as zeros; one
    that is not zero would move every image embedding, which the words do not apply: the download
    is refused in a sentence and nothing kept, and the same folder read by hand is refused too."""
    from vit_explorer.weights import CheckpointError

    small_name, small = smaller_entry("pe_core_l14_336", monkeypatch)
    served = publish(hub, small_name, small)
    weights = served / "open_clip_model.safetensors"
    state = load_file(weights)
    state["visual.trunk.head.bias"][0] = 0.5
    save_file(state, weights)
    with pytest.raises(CheckpointError, match=rf"^the downloaded {small_name} file is not the expected model \(its image projection has a bias that is not zero\)$"):
        vx.load_pretrained(small_name)
    assert not catalogue.is_downloaded(small_name) and list(catalogue.cache_dir().iterdir()) == []
    with pytest.raises(CheckpointError, match=r"^main's image projection \(its timm trunk's head\) has a bias that is not zero, which we do not apply$"):
        load_image_text_model(served)
