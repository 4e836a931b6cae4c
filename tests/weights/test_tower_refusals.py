"""A VLM folder whose vision config claims what its tower's tensors do not hold (a million patches,
a million layers, an image no InternViT has) is one sentence that says so, and nothing of that
size is allocated. (A folder without a tower, a shard outside the folder, Qwen's window larger than
the grid and a range download cut short: tests/weights/test_vlm_towers.py, test_qwen_vl_tower.py,
test_vlm_catalogue.py.)"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

import vit_explorer as vx
from vit_explorer.weights.footprint import model_footprint

transformers = pytest.importorskip("transformers")

VISION = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, image_size=32, patch_size=8)
TEXT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, vocab_size=3000)


def peak_growth() -> int:
    """VmHWM over VmRSS since the last reset (/proc/self/clear_refs)."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return (int(fields["VmHWM"].split()[0]) - int(fields["VmRSS"].split()[0])) * 1024


def test_a_llava_config_claiming_a_million_patches_or_layers_is_a_sentence(tmp_path):
    t = transformers
    config = t.LlavaConfig(vision_config=t.CLIPVisionConfig(**VISION).to_dict(), text_config=t.LlamaConfig(**TEXT).to_dict(), image_token_index=2999)
    t.LlavaForConditionalGeneration(config).save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())

    def refusal(**vision) -> str:
        (tmp_path / "config.json").write_text(json.dumps({**saved, "vision_config": {**saved["vision_config"], **vision}}))
        assert model_footprint(tmp_path).weights < 2**20  # admitted: the tower is what it is
        Path("/proc/self/clear_refs").write_text("5")
        with pytest.raises(vx.CheckpointError) as refused:
            vx.load_model(tmp_path)
        assert peak_growth() < 32 * 2**20  # a million positions of 64 floats would be 256 MB
        return str(refused.value)

    assert refusal(image_size=8000) == (
        f"{tmp_path.name}'s config says 8000 x 8000 px images, 1,000,000 patches of 8 px, but it holds 17 position embeddings"
    )
    # The layer its language model reads is counted in the claimed depth: refused, not misplaced.
    assert refusal(num_hidden_layers=10**6) == f"{tmp_path.name} cannot be built with depth 1000000: its tensors have depth 2"


def test_an_internvl_config_claiming_a_million_patches_is_refused_before_its_tensors_are_read(tmp_path):
    vision = dict(model_type="internvl_vision", image_size=[14000, 14000], patch_size=[14, 14])
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "internvl", "vision_config": vision}))
    with pytest.raises(vx.CheckpointError) as refused:  # the folder holds no weights: never asked for
        vx.load_model(tmp_path)
    assert str(refused.value) == f"{tmp_path.name}'s vision_config image_size [14000, 14000] is not a size from 1 to 8,192 px"
