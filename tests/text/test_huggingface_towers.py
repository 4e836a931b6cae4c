"""Both towers of a Hugging Face transformers CLIPModel and SiglipModel folder against
transformers with the same random weights, and the sentences for such folders that cannot be read."""
import json

import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file, save_file

import vit_explorer as vx
from vit_explorer.text import is_image_text_folder, load_image_text_model
from vit_explorer.weights import CheckpointError, from_huggingface_text

from textmodels import HF_SMALL, SMALL_CLIP, hf_clip_folder, hf_siglip_folder, open_clip, open_clip_folder

LABELS = ["a photo of a cat", "a rocket", "dog", "a small blue circle"]
SMALL_VISION = {**HF_SMALL, "patch_size": 16, "image_size": 32}


def _reference(model, images: torch.Tensor, tokens: torch.Tensor):
    """transformers' own unit image and text embeddings and logits_per_image, from one pass of
    the model (its forward normalises get_image_features' and get_text_features' outputs)."""
    inputs = {"input_ids": tokens, "pixel_values": images}
    if isinstance(model, transformers.Siglip2Model):  # NaFlex: flattened patches, each image's grid
        from transformers.models.siglip2.image_processing_siglip2 import convert_image_to_patches

        patch = model.config.vision_config.patch_size
        grid = (images.shape[-2] // patch, images.shape[-1] // patch)
        patches = torch.stack([convert_image_to_patches(image, patch) for image in images])
        inputs |= {
            "pixel_values": patches, "pixel_attention_mask": torch.ones(patches.shape[:2], dtype=torch.long),
            "spatial_shapes": torch.tensor([grid] * len(images)),
        }
    with torch.no_grad():
        out = model(**inputs)
    return out.image_embeds, out.text_embeds, out.logits_per_image


def _ours(ours, images: torch.Tensor, tokens: torch.Tensor):
    image = ours.project_image(vx.capture(ours.image, images, layers=()).logits)
    with torch.no_grad():
        text = F.normalize(ours.text(tokens), dim=-1)
    return image, text, ours.logits(image, text)


@pytest.mark.parametrize("kind", ["clip", "siglip", "siglip2"])
def test_both_towers_match_transformers(tmp_path, kind):
    folder = tmp_path / kind
    if kind == "clip":
        reference = hf_clip_folder(folder)
    elif kind == "siglip":
        reference = hf_siglip_folder(folder)
    else:  # SigLIP 2's image tower at B/16; its text tower is SigLIP's, checked above at B/16
        reference = hf_siglip_folder(folder, {"num_hidden_layers": 2}, version=2)
    assert is_image_text_folder(folder)
    ours = load_image_text_model(folder)
    grid = ours.image.config.grid_size  # SigLIP 2 (NaFlex): its 256 positions, a square of 16 x 16
    assert grid == ((16, 16) if kind == "siglip2" else (14, 14))
    size = [side * ours.image.config.patch_size for side in grid]
    images = torch.randn(2, 3, *size, generator=torch.Generator().manual_seed(1))
    tokens = ours.tokenize(LABELS)  # the folder's tokenizer.json, padded as transformers pads
    assert tokens.shape == (len(LABELS), 77 if kind == "clip" else 64)
    expected, found = _reference(reference, images, tokens), _ours(ours, images, tokens)
    for what, theirs, mine in zip(("image", "text", "logits_per_image"), expected, found):
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=0, msg=lambda message: f"{what}: {message}")
    torch.testing.assert_close(ours.embed_texts(LABELS), found[1], atol=1e-6, rtol=0)
    assert ours.scoring == ("softmax" if kind == "clip" else "sigmoid")
    assert ours.image.config.num_classes == 0
    if kind == "clip":
        # The same ids as open_clip's byte-pair encoding, which pads with 0 where transformers
        # pads with the end token: causal, and read at the first end token, CLIP sees no padding.
        bpe = open_clip.tokenize(LABELS)
        assert torch.equal(tokens[bpe != 0], bpe[bpe != 0])
        with torch.no_grad():
            torch.testing.assert_close(F.normalize(ours.text(bpe), dim=-1), found[1], atol=1e-6, rtol=0)
        assert ours.logit_bias == 0.0
    else:
        assert ours.logit_bias == pytest.approx(-5.0)


def test_clip_from_before_the_end_token_fix_pools_where_transformers_does(tmp_path):
    """A config.json whose eos_token_id is still 2 (older CLIP folders): the largest id. Without
    a tokenizer.json, CLIP's vocabulary is open_clip's byte-pair encoding."""
    reference = hf_clip_folder(tmp_path / "clip", {**HF_SMALL, "eos_token_id": 2}, SMALL_VISION, 48, tokenizer=False)
    ours = load_image_text_model(tmp_path / "clip")
    images = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    tokens = ours.tokenize(LABELS)
    assert torch.equal(tokens, open_clip.tokenize(LABELS))
    for theirs, mine in zip(_reference(reference, images, tokens), _ours(ours, images, tokens)):
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=0)


def test_text_defaults_are_transformers_own():
    for kind, config in (
        ("clip", transformers.CLIPTextConfig()), ("siglip", transformers.SiglipTextConfig()),
        ("siglip2", transformers.Siglip2TextConfig()),
    ):
        for key, value in from_huggingface_text._DEFAULTS[kind].items():
            assert getattr(config, key) == value, (kind, key)
    assert transformers.CLIPConfig().projection_dim == from_huggingface_text.CLIP_PROJECTION_DIM


def _small(tmp_path, kind="clip", **text):
    folder = tmp_path / kind
    if kind == "clip":
        hf_clip_folder(folder, {**HF_SMALL, **text}, SMALL_VISION, 48)
    else:
        hf_siglip_folder(folder, {**HF_SMALL, **text}, SMALL_VISION)
    return folder


def test_a_text_tower_that_does_not_fit_its_image_tower_is_a_sentence(tmp_path):
    folder = _small(tmp_path)
    weights = folder / "model.safetensors"
    state = load_file(str(weights))
    state["visual_projection.weight"] = torch.randn(40, 64)  # images into 40 numbers, texts into 48
    save_file(state, str(weights))
    with pytest.raises(CheckpointError, match="text tower does not fit its image tower.*48.*40"):
        load_image_text_model(folder)


def test_a_config_claiming_more_than_the_file_holds_allocates_nothing(tmp_path):
    folder = _small(tmp_path, "siglip")
    config = json.loads((folder / "config.json").read_text())
    config["text_config"]["vocab_size"] = 300_000  # more than the file holds
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="text tower does not fit its text_cfg.*token_embedding"):
        load_image_text_model(folder)
    config["text_config"]["vocab_size"] = 10**9  # 256 GB of embedding if it were built
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="text_cfg vocab_size must be a whole number from 1 to 400,000"):
        load_image_text_model(folder)
    config["text_config"]["hidden_act"] = "relu"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="text_config hidden_act must be one of quick_gelu, gelu"):
        load_image_text_model(folder)


def test_a_tokenizer_file_that_is_not_one_is_a_sentence(tmp_path):
    folder = _small(tmp_path, "siglip")
    assert load_image_text_model(folder).scoring == "sigmoid"
    (folder / "tokenizer.json").write_text("this is not a tokenizer")
    with pytest.raises(CheckpointError, match="tokenizer.json is not a tokenizer we can read"):
        load_image_text_model(folder)
    (folder / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match="has no tokenizer.json"):
        load_image_text_model(folder)


def test_only_folders_with_both_towers_are_image_text_folders(tmp_path):
    vision = tmp_path / "vision"
    transformers.CLIPVisionModel(transformers.CLIPVisionConfig(**SMALL_VISION)).save_pretrained(str(vision))
    assert not is_image_text_folder(vision)  # a CLIP image tower alone: load_model reads it
    assert not is_image_text_folder(tmp_path / "nothing")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{not json")
    assert not is_image_text_folder(tmp_path / "broken")
    open_clip_folder(tmp_path / "open_clip", SMALL_CLIP)
    assert is_image_text_folder(tmp_path / "open_clip")
    with pytest.raises(CheckpointError, match="neither an open_clip model folder.*nor a Hugging Face CLIP or SigLIP"):
        load_image_text_model(vision)
