"""Both towers of CLIP, SigLIP and SigLIP 2 against open_clip with the same random weights, and
the sentences for folders and labels that cannot be read."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import vit_explorer as vx
from vit_explorer.model.config import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD
from vit_explorer.text import LabelError, load_image_text_model, parse_labels
from vit_explorer.weights import CheckpointError

from textmodels import SMALL_CLIP, open_clip, open_clip_folder, open_clip_tokenizer, siglip_folder

LABELS = ["a photo of a cat", "a rocket", "dog", "a small blue circle"]


def _clip_b16() -> dict:
    config = open_clip.get_model_config("ViT-B-16")
    return {**config, "quick_gelu": True}  # OpenAI's weights, trained with QuickGELU


@pytest.mark.parametrize("name", ["ViT-B-16", "ViT-B-16-SigLIP", "ViT-B-16-SigLIP2"])
def test_both_towers_match_open_clip(tmp_path, name):
    config = _clip_b16() if name == "ViT-B-16" else open_clip.get_model_config(name)
    reference = open_clip_folder(tmp_path / name, config)
    ours = load_image_text_model(tmp_path / name)
    images = torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(1))
    tokens = open_clip_tokenizer(tmp_path / name)(LABELS)
    assert torch.equal(ours.tokenize(LABELS), tokens)  # the publisher's tokenizer, as open_clip reads it
    with torch.no_grad():
        image_reference = reference.encode_image(images, normalize=True)
        text_reference = reference.encode_text(tokens, normalize=True)
        bias = reference.logit_bias if getattr(reference, "logit_bias", None) is not None else 0.0
        logits_reference = reference.logit_scale.exp() * image_reference @ text_reference.t() + bias
    image = ours.project_image(vx.capture(ours.image, images, layers=()).logits)
    text = ours.embed_texts(LABELS)
    torch.testing.assert_close(image, image_reference, atol=1e-5, rtol=0)
    torch.testing.assert_close(text, text_reference, atol=1e-5, rtol=0)
    torch.testing.assert_close(ours.logits(image, text), logits_reference, atol=1e-5, rtol=0)
    assert ours.scoring == ("softmax" if name == "ViT-B-16" else "sigmoid")
    assert ours.image.config.num_classes == 0  # the image tower every page explores, headless
    assert ours.image.config.mean == OPENAI_CLIP_MEAN and ours.image.config.std == OPENAI_CLIP_STD


def test_probabilities_follow_the_models_loss(tmp_path):
    clip = load_image_text_model(_small_clip(tmp_path))
    logits = torch.tensor([[2.0, 1.0, -3.0]])
    assert clip.probabilities(logits).sum().item() == pytest.approx(1.0)
    assert "softmax" in clip.scoring_sentence()


def _small_clip(tmp_path, **changes):
    config = json.loads(json.dumps(SMALL_CLIP))
    for key, value in changes.items():
        config["text_cfg"][key] = value
    folder = tmp_path / "clip"
    open_clip_folder(folder, config)
    return folder


def test_a_text_tower_that_does_not_fit_its_image_tower_is_a_sentence(tmp_path):
    folder = _small_clip(tmp_path)
    weights = folder / "open_clip_model.safetensors"
    state = load_file(str(weights))
    state["visual.proj"] = torch.randn(64, 48)  # images into 48 numbers, texts into 32
    save_file(state, str(weights))
    with pytest.raises(CheckpointError, match="text tower does not fit its image tower.*32.*48"):
        load_image_text_model(folder)


def test_a_config_claiming_more_than_the_file_holds_allocates_nothing(tmp_path):
    folder = _small_clip(tmp_path)
    config = json.loads((folder / "open_clip_config.json").read_text())
    config["model_cfg"]["text_cfg"]["vocab_size"] = 300_000  # 38 MB of embedding that the file does not hold
    (folder / "open_clip_config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="text tower does not fit its text_cfg.*token_embedding"):
        load_image_text_model(folder)


def test_a_tokenizer_file_that_is_not_one_is_a_sentence(tmp_path):
    folder = siglip_folder(tmp_path / "siglip")
    assert load_image_text_model(folder).scoring == "sigmoid"
    (folder / "tokenizer.json").write_text("this is not a tokenizer")
    with pytest.raises(CheckpointError, match="tokenizer.json is not a tokenizer we can read"):
        load_image_text_model(folder)
    (folder / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match="has no tokenizer.json"):
        load_image_text_model(folder)


def test_a_folder_without_a_model_config_is_a_sentence(tmp_path):
    folder = _small_clip(tmp_path)
    (folder / "open_clip_config.json").write_text(json.dumps({"model_cfg": {"embed_dim": 32}}))
    with pytest.raises(CheckpointError, match="no model_cfg with a text_cfg and a vision_cfg"):
        load_image_text_model(folder)
    (folder / "open_clip_config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="open_clip_config.json in clip is not valid JSON"):
        load_image_text_model(folder)


@pytest.mark.parametrize("text, message", [
    ("", "type at least one label"),
    (" , ,\n", "type at least one label"),
    (", ".join(f"label {index}" for index in range(10_000)), "10,000 labels is too many"),
    ("x" * 100_000, "a label of 100,000 characters is too long"),
    ("y" * 10_000_000, "type at most 1000 labels"),
])
def test_labels_that_cannot_be_scored_are_a_sentence(text, message):
    with pytest.raises(LabelError, match=message):
        parse_labels(text)


def test_labels_are_split_on_commas_and_lines_once_each():
    assert parse_labels("a cat, a dog\na rocket, a cat,") == ["a cat", "a dog", "a rocket"]


def test_an_image_tower_has_the_heads_its_config_gives(tmp_path):
    """open_clip's ViT has width // head_width heads: SMALL_CLIP's 64 wide in heads of 32 has 2,
    where the shapes' convention (64 channels a head) would give 1 and still load, wrong."""
    reference = open_clip_folder(tmp_path / "clip", SMALL_CLIP)
    with torch.no_grad():  # queries and keys large enough that the heads' split shows in the output
        for block in reference.visual.transformer.resblocks:
            block.attn.in_proj_weight.mul_(20)
    save_file({key: value.contiguous() for key, value in reference.state_dict().items()},
              str(tmp_path / "clip" / "open_clip_model.safetensors"))
    ours = load_image_text_model(tmp_path / "clip")
    assert ours.image.config.num_heads == reference.visual.transformer.resblocks[0].attn.num_heads == 2
    images = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference.encode_image(images, normalize=True)
    torch.testing.assert_close(ours.project_image(vx.capture(ours.image, images, layers=()).logits), expected, atol=1e-5, rtol=0)


def test_a_timm_trunk_has_the_heads_of_the_model_it_names():
    from vit_explorer.weights.from_open_clip import _trunk_settings

    # So400m: 1152 channels in 16 heads of 72, as open_clip builds it from timm.
    assert _trunk_settings("vit_so400m_patch14_siglip_384", 1152, "so400m") == {"num_heads": 16, "act_layer": "gelu"}
    with pytest.raises(CheckpointError, match="names no timm model"):
        _trunk_settings("no_such_model", 1152, "so400m")
