"""A VLM's vision tower in the app: a LLaVA-shaped folder (CLIP inside, transformers' own layout)
uploaded through the sidebar, every page rendered, and the pages saying what the language model
reads instead of a prediction."""
from pathlib import Path

import pytest
import torch

from apptest import errors, open_app, uploader

PAGES = sorted(f"views/{path.name}" for path in (Path(__file__).resolve().parents[2] / "views").glob("*.py"))

transformers = pytest.importorskip("transformers")


def _llava_folder(folder):
    torch.manual_seed(0)
    vision = transformers.CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2, image_size=32, patch_size=4,
    )
    text = transformers.LlamaConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, vocab_size=300,
    )
    config = transformers.LlavaConfig(
        vision_config=vision.to_dict(), text_config=text.to_dict(), image_token_index=299,
        vision_feature_layer=-2, vision_feature_select_strategy="default",
    )
    transformers.LlavaForConditionalGeneration(config).save_pretrained(folder)
    return [path for path in folder.iterdir() if path.name in ("config.json", "model.safetensors")]


def test_a_llava_tower_says_what_its_language_model_reads(tmp_path):
    files = _llava_folder(tmp_path / "llava")
    app = open_app("views/pipeline.py")
    uploader(app, "checkpoint_upload").set_value([(path.name, path.read_bytes(), "application/octet-stream") for path in files]).run()
    assert not app.exception and errors(app) == []
    headings = [heading.value for heading in app.subheader]
    assert "8. What the language model reads" in headings and not any("Top-5" in heading for heading in headings)
    (sentence,) = [text.value for text in app.markdown if text.value.startswith("This is the vision tower")]
    # LLaVA reads the penultimate layer's output without the class token: 8 x 8 patches.
    assert "the penultimate layer's output (layer 1 on the Attention page), without the class token, 64 image tokens" in sentence
    assert any("(65, 32) -> drop the class token -> (64, 32)" in code.value for code in app.code)
    app.switch_page("views/attention.py").run()
    assert [caption.value for caption in app.caption if "language model reads" in caption.value] == [
        "The language model reads layer 1's output, before this one."
    ]
    for page in PAGES:
        app.switch_page(page).run()
        assert not app.exception and errors(app) == [], page
