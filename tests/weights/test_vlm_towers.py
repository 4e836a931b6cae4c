"""The vision tower inside a vision-language model's folder, as transformers writes one (random
weights, tiny language models): every layer's tokens as the VLM's own tower computes them, read
without opening the language model's shards; a folder that does not hold one is a sentence."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

import vit_explorer as vx

transformers = pytest.importorskip("transformers")

VISION = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, image_size=32, patch_size=8)
TEXT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, vocab_size=3000)


def _vlm(kind: str):
    t = transformers
    siglip = t.SiglipVisionConfig(**VISION, vision_use_head=kind == "paligemma").to_dict()
    if kind == "llava":
        config = t.LlavaConfig(vision_config=t.CLIPVisionConfig(**VISION).to_dict(), text_config=t.LlamaConfig(**TEXT).to_dict(), image_token_index=2999)
        return t.LlavaForConditionalGeneration(config)
    if kind == "paligemma":
        config = t.PaliGemmaConfig(vision_config=siglip, text_config=t.GemmaConfig(**TEXT, head_dim=16).to_dict(), image_token_index=2999, projection_dim=32)
        return t.PaliGemmaForConditionalGeneration(config)
    if kind == "gemma3":
        config = t.Gemma3Config(vision_config=siglip, text_config=t.Gemma3TextConfig(**TEXT, head_dim=16).to_dict(),
                                mm_tokens_per_image=4, image_token_index=2999, boi_token_index=2997, eoi_token_index=2998)
        return t.Gemma3ForConditionalGeneration(config)
    if kind in ("idefics3", "smolvlm"):
        prefix = "Idefics3" if kind == "idefics3" else "SmolVLM"
        vision = getattr(t, f"{prefix}VisionConfig")(**VISION).to_dict()
        config = getattr(t, f"{prefix}Config")(vision_config=vision, text_config=t.LlamaConfig(**TEXT).to_dict(), image_token_id=2999)
        return getattr(t, f"{prefix}ForConditionalGeneration")(config)
    config = t.LlavaOnevisionConfig(vision_config=siglip, text_config=t.Qwen2Config(**TEXT).to_dict(), image_token_index=2999, video_token_index=2998)
    return t.LlavaOnevisionForConditionalGeneration(config)


def _saved(kind: str, folder, shard: str = "100KB"):
    torch.manual_seed(0)
    model = _vlm(kind).eval()
    with torch.no_grad():  # queries and keys large enough that a wrong head split or order shows
        for name, parameter in model.model.vision_tower.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                parameter.mul_(6)
    model.save_pretrained(folder, max_shard_size=shard)
    return model


@pytest.mark.parametrize("kind", ["llava", "paligemma", "gemma3", "llava_onevision"])
def test_the_tower_of_a_vlm_folder_matches_its_own(tmp_path, kind):
    reference = _saved(kind, tmp_path / kind)
    index = json.loads((tmp_path / kind / "model.safetensors.index.json").read_text())["weight_map"]
    language_shards = set(index.values()) - {shard for key, shard in index.items() if "vision_tower" in key}
    assert language_shards  # the folder's language model lies in shards the tower has no part of
    for shard in language_shards:  # never opened: their bytes are no safetensors at all
        (tmp_path / kind / shard).write_bytes(b"not the language model")
    model = vx.load_model(tmp_path / kind)
    images = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = reference.model.vision_tower(pixel_values=images, output_hidden_states=True)
    captured = vx.capture(model, images)
    # float32's own spread: transformers' tower differs from itself in float64 by 5e-5 (tokens up to 6)
    torch.testing.assert_close(captured.tokens, torch.stack(expected.hidden_states, 1), atol=1e-4, rtol=1e-4)
    if kind == "paligemma":  # a SigLIP tower with its pool (PaliGemma's own reads the tokens)
        torch.testing.assert_close(captured.logits, expected.pooler_output, atol=1e-4, rtol=1e-4)
    assert model.config.num_heads == 4 and model.config.class_token == (kind == "llava")
    # What the language model reads (capture's tokens: 0 the embeddings, 3 after the final norm):
    # LLaVA the penultimate layer without the class token, OneVision the last layer's output,
    # PaliGemma and Gemma 3 the normed tokens, Gemma 3's 16 averaged 2 x 2 into its 4 a picture.
    expected = {"llava": (1, True, 1), "llava_onevision": (2, False, 1), "paligemma": (3, False, 1), "gemma3": (3, False, 2)}
    config = model.config
    assert (config.language_model_layer, config.language_model_drops_class_token, config.language_model_pooling) == expected[kind]


def test_a_vlm_folder_without_a_tower_or_of_an_unknown_kind_is_a_sentence(tmp_path):
    folder = tmp_path / "llava"
    _saved("llava", folder, shard="10GB")
    config = json.loads((folder / "config.json").read_text())

    def load_with(**changes):
        (folder / "config.json").write_text(json.dumps({**config, **changes}))
        with pytest.raises(vx.CheckpointError) as refusal:
            vx.load_model(folder)
        assert str(tmp_path) not in str(refusal.value)
        return str(refusal.value)

    assert "tiled cross-attention" in load_with(model_type="mllama")
    assert "not a tower a paligemma model has" in load_with(model_type="paligemma")
    # A vision config claiming far more patches than its positions hold: nothing built.
    assert "position" in load_with(vision_config={**config["vision_config"], "image_size": 8000}).lower()
    (folder / "config.json").write_text(json.dumps(config))
    # An index naming a shard outside the folder, and a folder whose weights hold no tower.
    outside = tmp_path / "elsewhere.safetensors"
    shutil.copy(folder / "model.safetensors", outside)
    (folder / "model.safetensors").rename(folder / "weights.safetensors")
    index = {"weight_map": {"vision_tower.embeddings.patch_embedding.weight": "../elsewhere.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(vx.CheckpointError, match="outside the model folder"):
        vx.load_model(folder)
    index = {"weight_map": {"language_model.lm_head.weight": "weights.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(vx.CheckpointError, match="no vision tower"):
        vx.load_model(folder)


@pytest.mark.parametrize("kind", ["idefics3", "smolvlm"])
def test_the_siglip_tower_of_idefics3_and_smolvlm_matches_its_own(tmp_path, kind):
    """SigLIP's layers under Idefics3's names, on one square tile (the tower's image size): every
    layer's tokens, the normed tokens its connector joins 2 x 2 (pixel shuffle), the language
    model's shards never opened."""
    torch.manual_seed(0)
    reference = _vlm(kind).eval()
    with torch.no_grad():
        for name, parameter in reference.model.vision_model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                parameter.mul_(6)
    reference.save_pretrained(tmp_path / kind, max_shard_size="100KB")
    index = json.loads((tmp_path / kind / "model.safetensors.index.json").read_text())["weight_map"]
    for shard in set(index.values()) - {shard for key, shard in index.items() if "vision_model" in key}:
        (tmp_path / kind / shard).write_bytes(b"not the language model")
    model = vx.load_model(tmp_path / kind)
    images = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = reference.model.vision_model(pixel_values=images, output_hidden_states=True)
    captured = vx.capture(model, images)
    torch.testing.assert_close(captured.tokens, torch.stack(expected.hidden_states, 1), atol=1e-4, rtol=1e-4)
    with torch.no_grad():  # what the connector reads: the tokens after the final norm
        torch.testing.assert_close(model.norm(captured.tokens[:, -1]), expected.last_hidden_state, atol=1e-4, rtol=1e-4)
    config = model.config
    assert (config.language_model_layer, config.language_model_shuffle, config.class_token) == (3, 2, False)


def test_a_llava_folder_reads_the_picture_as_its_processor_does(tmp_path):
    """LLaVA's own preprocessing from its folder: CLIP's (the shorter side resized, the centre
    cropped) or, with do_pad, the picture pasted on a square of the mean colour first (the
    original LLaVA-1.5's); both were squeezed before."""
    import numpy as np
    from PIL import Image

    from vit_explorer.data.transforms import describe

    _saved("llava", tmp_path)
    pictures = [Image.fromarray(np.random.default_rng(side).integers(0, 255, (side, 90 - side, 3), dtype=np.uint8))
                for side in (40, 59)]  # wide and tall
    for pad, mode in ((False, "shortest"), (True, "pad_square")):
        processor = transformers.LlavaImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}, do_pad=pad)
        processor.save_pretrained(tmp_path)
        config = vx.load_model(tmp_path).config
        assert config.resize_mode == mode
        for picture in pictures:
            expected = processor(picture, return_tensors="pt")["pixel_values"]
            torch.testing.assert_close(vx.preprocess(picture, config), expected, atol=1e-6, rtol=0)
    assert describe(pictures[0].size, config).startswith("the whole picture padded to a square with the training images' mean colour")
