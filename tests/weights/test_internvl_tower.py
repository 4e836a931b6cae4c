"""InternVL's vision tower (InternViT-300M's kind) from a whole InternVL folder as transformers
writes it (random weights, a tiny language model in shards never opened): every layer's tokens as
transformers' own tower computes them; what its language model reads (the last layer, no class
token, 2 x 2 pixel shuffle); InternViT-6B's kind refused in a sentence."""
from __future__ import annotations

import json

import pytest
import torch

import vit_explorer as vx
from vit_explorer.app.models import language_model_reads
from vit_explorer.weights.footprint import model_footprint

transformers = pytest.importorskip("transformers")

VISION = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, image_size=[32, 32],
              patch_size=[8, 8], attention_bias=True, layer_scale_init_value=0.5)
TEXT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, vocab_size=3000)


def _saved(folder, **vision):
    torch.manual_seed(0)
    config = transformers.InternVLConfig(
        vision_config=transformers.InternVLVisionConfig(**{**VISION, **vision}).to_dict(),
        text_config=transformers.Qwen2Config(**TEXT).to_dict(), image_token_id=2999,
    )
    model = transformers.InternVLForConditionalGeneration(config).eval()
    with torch.no_grad():  # position embeddings and LayerScale away from their zero / constant start
        tower = model.model.vision_tower
        tower.embeddings.position_embeddings.normal_(0, 0.5)
        tower.embeddings.cls_token.normal_(0, 0.5)
        for name, parameter in tower.named_parameters():
            if "lambda" in name or name.endswith(("q_proj.weight", "k_proj.weight")):
                parameter.mul_(torch.empty_like(parameter).uniform_(0.5, 3))
    model.save_pretrained(folder, max_shard_size="100KB")
    return model


def test_the_internvl_tower_matches_its_own(tmp_path):
    reference = _saved(tmp_path / "internvl")
    index = json.loads((tmp_path / "internvl" / "model.safetensors.index.json").read_text())["weight_map"]
    for shard in set(index.values()) - {shard for key, shard in index.items() if "vision_tower" in key}:
        (tmp_path / "internvl" / shard).write_bytes(b"not the language model")  # never opened
    model = vx.load_model(tmp_path / "internvl")
    # The admission's estimate: the tower's tensors from their headers, the language model's never opened.
    assert model_footprint(tmp_path / "internvl").weights == 4 * sum(p.numel() for p in reference.model.vision_tower.parameters())
    images = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = reference.model.vision_tower(pixel_values=images, output_hidden_states=True)
    captured = vx.capture(model, images)
    torch.testing.assert_close(captured.tokens, torch.stack(expected.hidden_states, 1), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(captured.tokens[:, -1], expected.last_hidden_state, atol=1e-4, rtol=1e-4)
    config = model.config
    assert (config.language_model_layer, config.language_model_drops_class_token, config.language_model_shuffle) == (2, True, 2)
    assert not config.final_norm and config.mean == pytest.approx((0.485, 0.456, 0.406))
    sentence, shapes = language_model_reads(config, config.grid_size)
    # InternVL's own: the last layer's 16 patch tokens joined 2 x 2 into 4 of 256 numbers
    with torch.no_grad():
        features = reference.model.get_image_features(images, vision_feature_layer=-1, vision_feature_select_strategy="default")
    assert features.pooler_output.shape[1] == 4
    assert "4 of 256 numbers" in sentence and "(16, 64) -> join 2x2 -> (4, 256)" in shapes


@pytest.mark.parametrize("vision, said", [
    (dict(use_qk_norm=True), "InternViT-6B's kind"),
    (dict(norm_type="rms_norm"), "InternViT-6B's kind"),
    (dict(hidden_act="silu"), "not InternViT's GELU"),
])
def test_a_tower_not_compared_with_its_reference_is_a_sentence(tmp_path, vision, said):
    _saved(tmp_path / "internvl", **vision)
    with pytest.raises(vx.CheckpointError, match=said):
        vx.load_model(tmp_path / "internvl")
