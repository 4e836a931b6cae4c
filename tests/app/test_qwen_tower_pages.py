"""Qwen2.5-VL's windowed tower in the app: its folder (config.json, weights, preprocessor_config.json
as transformers writes them) uploaded through the sidebar, a non-square picture sized as Qwen's
processor sizes it, every page rendered, the windows and the merger said where they matter."""
import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from apptest import decoded, errors, figure_titles, open_app, uploader

PAGES = sorted(f"views/{path.name}" for path in (Path(__file__).resolve().parents[2] / "views").glob("*.py"))

transformers = pytest.importorskip("transformers")


def _qwen_folder(folder):
    t = transformers
    vision = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=24, window_size=56,
                  fullatt_block_indexes=[1], patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
    text = dict(hidden_size=24, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                vocab_size=1000, rope_parameters={"rope_type": "default", "mrope_section": [2, 2, 2], "rope_theta": 10000.0})
    torch.manual_seed(0)
    config = t.Qwen2_5_VLConfig(vision_config=vision, text_config=text, image_token_id=999, video_token_id=998, vision_start_token_id=997)
    t.Qwen2_5_VLForConditionalGeneration(config).save_pretrained(folder)
    t.Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=28 * 28 * 25).save_pretrained(folder)
    return [path for path in folder.iterdir() if path.name in ("config.json", "model.safetensors", "preprocessor_config.json")]


def test_a_qwen_tower_sizes_the_picture_draws_its_windows_and_reads_through_its_merger(tmp_path):
    files = _qwen_folder(tmp_path / "qwen")
    app = open_app("views/pipeline.py")
    uploader(app, "checkpoint_upload").set_value([(path.name, path.read_bytes(), "application/octet-stream") for path in files]).run()
    assert not app.exception and errors(app) == []
    picture = io.BytesIO()
    Image.fromarray((np.random.RandomState(0).rand(300, 451, 3) * 255).astype("uint8")).save(picture, "PNG")
    app.file_uploader(key="image_upload").set_value(("wide.png", picture.getvalue(), "image/png")).run()
    assert not app.exception and errors(app) == []
    # Qwen's processor: 451 x 300 px within 25 tokens' budget -> 168 x 112 px, an 8 x 12 grid.
    assert any("Qwen-VL's preprocessing" in caption.value and "This picture: 112x168 px" in caption.value for caption in app.caption)
    (sentence,) = [text.value for text in app.markdown if "through its patch merger" in text.value]
    assert "4 x 6 = 24 image tokens" in sentence
    assert any("(96, 32) -> join 2x2 -> (24, 128) -> merger MLP -> (24, 24)" in code.value for code in app.code)
    app.switch_page("views/attention.py").run()
    assert not app.exception and errors(app) == []
    app.slider(key="layer").set_value(0).run()
    app.selectbox(key="query").set_value(30).run()  # row 2, column 6: the window of rows 0-3, columns 4-7
    notes = [caption.value for caption in app.caption if "windows of 4 x 4 patches" in caption.value]
    assert notes and "Patch 30's window is rows 0-3, columns 4-7 (dashed): its map is exactly zero outside it." in notes[0]
    (grid,) = [json.loads(chart.proto.spec) for chart in app.get("plotly_chart")
               if json.loads(chart.proto.spec)["layout"]["title"]["text"].startswith("Attention of the patch 30 (row 2, col 6) in layer 0")]
    dashed = [shape for shape in grid["layout"]["shapes"] if shape["line"].get("dash") == "dash"]
    assert len(dashed) == 2 and {(shape["x0"], shape["x1"], shape["y0"], shape["y1"]) for shape in dashed} == {(55.5, 111.5, -0.5, 55.5)}
    for heatmap in [trace for trace in grid["data"] if trace["type"] == "heatmap"]:  # each head's map
        z = decoded(heatmap["z"]).reshape(8, 12)
        assert np.all(z[4:] == 0) and np.all(z[:, :4] == 0) and np.all(z[:, 8:] == 0) and np.all(z[:4, 4:8] > 0)
    app.slider(key="layer").set_value(1).run()
    assert any("one of this model's full-attention layers" in caption.value for caption in app.caption)
    for page in PAGES:
        app.switch_page(page).run()
        assert not app.exception and errors(app) == [], page
    app.switch_page("views/inside.py").run()  # its norm is RMSNorm, and the softmax runs within the window
    assert any("RMSNorm" in expander.label for expander in app.expander)
    assert any("before and after RMSNorm" in title for title in figure_titles(app))
    assert not any("tokens of this token's window only" in caption.value for caption in app.caption)  # layer 1: full
    app.slider(key="layer").set_value(0).run()
    assert any("softmax runs over the 16 tokens of this token's window only" in caption.value for caption in app.caption)


def test_a_qwen3_tower_says_what_deepstack_reads(tmp_path):
    t = transformers
    vision = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=24, num_position_embeddings=36,
                  deepstack_visual_indexes=[0, 1], patch_size=16, spatial_merge_size=2, temporal_patch_size=2)
    text = dict(hidden_size=24, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                vocab_size=1000, head_dim=12, rope_parameters={"rope_type": "default", "mrope_section": [2, 2, 2], "rope_theta": 10000.0})
    torch.manual_seed(0)
    config = t.Qwen3VLConfig(vision_config=vision, text_config=text, image_token_id=999, video_token_id=998, vision_start_token_id=997)
    folder = tmp_path / "qwen3"
    t.Qwen3VLForConditionalGeneration(config).save_pretrained(folder)
    t.Qwen2VLImageProcessorPil(min_pixels=32 * 32, max_pixels=32 * 32 * 30, patch_size=16, merge_size=2).save_pretrained(folder)
    files = [path for path in folder.iterdir() if path.name in ("config.json", "model.safetensors", "preprocessor_config.json")]
    app = open_app("views/pipeline.py")
    uploader(app, "checkpoint_upload").set_value([(path.name, path.read_bytes(), "application/octet-stream") for path in files]).run()
    assert not app.exception and errors(app) == []
    (sentence,) = [text.value for text in app.markdown if "through its patch merger" in text.value]
    assert "DeepStack: the outputs of layers 0, 1 go through mergers of their own too" in sentence
    for page in ("views/attention.py", "views/inside.py"):
        app.switch_page(page).run()
        assert not app.exception and errors(app) == [], page
        assert not any("windows of" in caption.value for caption in app.caption)  # every layer attends everywhere
