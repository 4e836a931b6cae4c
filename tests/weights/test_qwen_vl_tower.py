"""Qwen2.5-VL's and Qwen3-VL's vision towers from the whole VLM folder transformers 5 writes
(random weights, a tiny language model, sharded): every layer's tokens and the mergers' outputs
as transformers' tower computes them, on a non-square picture its own processor prepared; the
explorer's truths on the window-attention model; a folder that does not hold one is a sentence."""
from __future__ import annotations

import json

import pytest
import torch
from einops import rearrange

import vit_explorer as vx
from vit_explorer import analysis
from vit_explorer.analysis.faithfulness import kept_outputs
from vit_explorer.model.internals import rescaled_attention
from vit_explorer.model.windows import window_ids
from vit_explorer.weights import from_qwen_vl
from vit_explorer.weights.footprint import model_footprint

transformers = pytest.importorskip("transformers")

# Windows of 56 px: 4 x 4 patches of 14, 2 x 2 merged tokens; block 1 attends everywhere.
VISION = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=24, window_size=56,
              fullatt_block_indexes=[1], patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
TEXT = dict(hidden_size=24, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
            vocab_size=1000, rope_parameters={"rope_type": "default", "mrope_section": [2, 2, 2], "rope_theta": 10000.0})
PIXELS = dict(min_pixels=56 * 56, max_pixels=28 * 28 * 64)
HEIGHT, WIDTH = 28 * 4, 28 * 6  # an 8 x 12 grid of patches: 2 x 3 windows, 4 x 6 merged tokens


def qwen_model(text: dict):
    """transformers' Qwen2.5-VL at VISION's sizes, its tower's weights made telling: scores large
    enough that a wrong window, position or order shows, norms not all ones."""
    config = transformers.Qwen2_5_VLConfig(vision_config=VISION, text_config=text, image_token_id=999, video_token_id=998,
                                           vision_start_token_id=997)
    torch.manual_seed(0)
    model = transformers.Qwen2_5_VLForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, parameter in model.model.visual.named_parameters():
            if name.endswith("qkv.weight"):
                parameter.mul_(6)
            if "norm" in name or "ln_q" in name:
                parameter.copy_(1 + 0.5 * torch.randn_like(parameter))
    return model


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """(the folder, transformers' model, its processor's pixel values and grid of one picture)."""
    t = transformers
    model = qwen_model(TEXT)
    folder = tmp_path_factory.mktemp("qwen") / "qwen2_5_vl"
    model.save_pretrained(folder, max_shard_size="20KB")
    processor = t.Qwen2VLImageProcessor(**PIXELS)
    processor.save_pretrained(folder)
    picture = torch.rand(HEIGHT, WIDTH, 3, generator=torch.Generator().manual_seed(0))
    prepared = processor(images=(picture * 255).to(torch.uint8).numpy(), return_tensors="pt")
    return folder, model, prepared["pixel_values"], prepared["image_grid_thw"]


def _image(pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
    """(1, 3, H, W): the processor's patches (merge-window order, 2 identical frames) as one picture."""
    _, grid_h, grid_w = grid_thw[0].tolist()
    return rearrange(pixel_values, "(h w m1 m2) (c t p1 p2) -> t c (h m1 p1) (w m2 p2)",
                     h=grid_h // 2, w=grid_w // 2, m1=2, m2=2, c=3, t=2, p1=14)[:1]


def _row_major(tokens: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
    """(..., N, D) tokens in the tower's order (windows, then 2 x 2 merge units) -> row-major."""
    from transformers.vision_utils import get_vision_window_index

    _, grid_h, grid_w = grid_thw[0].tolist()
    window_index, _ = get_vision_window_index(grid_thw, 2, VISION["window_size"], 14)
    unit, within = window_index.repeat_interleave(4), torch.arange(grid_h * grid_w) % 4
    rows = unit // (grid_w // 2) * 2 + within // 2
    cols = unit % (grid_w // 2) * 2 + within % 2
    return tokens[..., torch.argsort(rows * grid_w + cols), :]


def test_the_qwen_tower_matches_transformers_token_by_token(qwen):
    folder, reference, pixel_values, grid_thw = qwen
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    language_shards = set(index.values()) - {shard for key, shard in index.items() if key.startswith("visual.")}
    assert language_shards
    for shard in language_shards:  # never opened: their bytes are no safetensors at all
        (folder / shard).write_bytes(b"not the language model")
    model = vx.load_model(folder, image_size=(HEIGHT, WIDTH))
    # The admission's estimate: the tower's tensors from their headers, the language model's never opened.
    assert model_footprint(folder).weights == 4 * sum(p.numel() for p in reference.model.visual.parameters())
    x = _image(pixel_values, grid_thw)
    with torch.no_grad():
        expected = reference.model.visual(pixel_values, grid_thw=grid_thw, output_hidden_states=True)
        captured = vx.capture(model, x)
        merged = model.merged(captured.tokens[:, -1], captured.grid_size)
    assert captured.grid_size == (8, 12) and captured.num_prefix_tokens == 0
    # Every layer's tokens (0: the patch embeddings, the Conv3d over two frames), and the merger's.
    torch.testing.assert_close(captured.tokens[0], _row_major(torch.stack(expected.hidden_states), grid_thw), atol=1e-4, rtol=1e-4)
    assert merged.shape == (1, 4 * 6, 24)
    torch.testing.assert_close(merged[0], expected.pooler_output, atol=1e-4, rtol=1e-4)
    config = model.config
    assert (config.attn_window, config.full_attention_blocks, config.language_model_layer) == (4, (1,), 3)
    # The folder's own preprocessing: its budget, and the default input a square within it.
    assert config.pixel_budget == (PIXELS["min_pixels"], PIXELS["max_pixels"])
    assert vx.load_model(folder).config.img_size == (224, 224)
    assert config.normalization_source == "publisher: preprocessor_config.json"


def test_smart_resize_is_qwens():
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

    for height, width in [(112, 168), (1000, 37), (3000, 4000), (20, 20), (333, 500), (98, 98)]:
        for budget in [(3136, 50176), (3136, 12845056), (200_000, 1_000_000)]:
            assert from_qwen_vl.smart_resize(height, width, 28, *budget) == smart_resize(height, width, 28, *budget)


def test_our_preprocessing_is_qwens_at_the_size_it_chooses(qwen):
    from PIL import Image

    folder, *_ = qwen
    picture = Image.fromarray((torch.rand(300, 451, 3, generator=torch.Generator().manual_seed(2)) * 255).to(torch.uint8).numpy())
    config = vx.load_model(folder).config
    size = from_qwen_vl.smart_resize(300, 451, 28, *config.pixel_budget)
    processor = transformers.Qwen2VLImageProcessorPil(**PIXELS)  # Qwen's PIL path: bicubic, as ours
    prepared = processor(images=picture, return_tensors="pt")
    assert size == (168, 252) and prepared["image_grid_thw"].tolist() == [[1, 12, 18]]
    ours = vx.preprocess(picture, config.replace(image_size=size))
    torch.testing.assert_close(ours, _image(prepared["pixel_values"], prepared["image_grid_thw"]), atol=1e-6, rtol=0)


def test_window_attention_truths(qwen):
    folder, *_ = qwen
    model = vx.load_model(folder, image_size=(HEIGHT, WIDTH))
    x = torch.randn(2, 3, HEIGHT, WIDTH, generator=torch.Generator().manual_seed(1))
    intact = vx.capture(model, x)
    with torch.no_grad():
        torch.testing.assert_close(intact.logits, model(x), atol=1e-5, rtol=1e-5)  # capture changes nothing
    attentions = intact.attentions  # (B, depth, heads, N, N)
    torch.testing.assert_close(attentions.sum(-1), torch.ones(attentions.shape[:-1]), atol=1e-5, rtol=0)
    ids = window_ids((8, 12), 4)
    outside = ids[:, None] != ids[None, :]
    for layer in (0, 2):  # windowed: exactly zero outside a patch's window
        assert attentions[:, layer][..., outside].abs().max() == 0
    assert attentions[:, 1][..., outside].min() > 0  # the full-attention block reads everywhere
    # A layer's attention recomputed from its input (the pages' path past the kept layers) has the windows too.
    entropies = torch.empty(2, 2)
    again = vx.layer_attention(model, intact.tokens[:, 2], 2, intact.grid_size, torch.float32, entropies=entropies)
    torch.testing.assert_close(again, attentions[:, 2], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropies, analysis.head_entropies(again), atol=1e-4, rtol=1e-4)
    one = vx.layer_internals(model, intact.tokens[:, 0], 0, queries=[30], grid_size=intact.grid_size)  # one patch's row
    torch.testing.assert_close(one.attention[:, :, 0], attentions[:, 0, :, 30], atol=1e-5, rtol=1e-5)
    whole = vx.layer_internals(model, intact.tokens[:, 0], 0, grid_size=intact.grid_size)
    for steps in (one, whole):  # the Inside page's temperature sweep keeps the window: at the model's scale, the row itself
        torch.testing.assert_close(rescaled_attention(steps, 1, 30, steps.scale), attentions[0, 0, 1, 30], atol=1e-5, rtol=1e-5)
    knock_out = vx.KnockOut(heads={1: (0,)}, mlp=(2,))
    whole = vx.capture(model, x, knock_out=knock_out)
    resumed = vx.capture(model, x, knock_out=knock_out, intact=intact)
    torch.testing.assert_close(resumed.tokens, whole.tokens, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(whole.tokens[:, -1], intact.tokens[:, -1])
    rollout = analysis.attention_rollout(attentions, num_prefix_tokens=0)
    torch.testing.assert_close(rollout.sum(-1), torch.ones(rollout.shape[:-1]), atol=1e-4, rtol=0)
    # Faithfulness drops patch tokens: the kept patches stay in their own windows (every patch kept:
    # the model's own output; one window's alone: as if the rest of the picture were not there).
    kept = torch.ones(2, 96, dtype=torch.bool)
    kept[1] = ids == 0
    outputs = kept_outputs(model, x[:1], kept, "drop")
    torch.testing.assert_close(outputs[0], intact.logits[0], atol=1e-5, rtol=1e-5)
    crop = x[:1, :, :56, :56]  # window 0, alone: the same tokens, in a 4 x 4 grid
    alone = vx.load_model(folder, image_size=(56, 56))
    torch.testing.assert_close(outputs[1], alone(crop)[0], atol=1e-5, rtol=1e-5)
    # Our own file keeps every new setting: the same tokens after a round trip.
    vx.save_model(model, folder.parent / "tower.safetensors")
    reloaded = vx.load_model(folder.parent / "tower.safetensors")
    assert reloaded.config == model.config
    torch.testing.assert_close(vx.capture(reloaded, x).tokens, intact.tokens, atol=0, rtol=0)


def test_a_qwen_folder_that_cannot_be_read_is_a_sentence(qwen, tmp_path):
    source, *_ = qwen
    folder = tmp_path / "qwen"
    folder.mkdir()
    for file in ("config.json", "preprocessor_config.json"):
        (folder / file).write_text((source / file).read_text())
    config = json.loads((source / "config.json").read_text())
    vision, preprocessor = config["vision_config"], json.loads((source / "preprocessor_config.json").read_text())

    def refusal(config=config, preprocessor=preprocessor) -> str:
        (folder / "config.json").write_text(json.dumps(config))
        (folder / "preprocessor_config.json").write_text(json.dumps(preprocessor))
        with pytest.raises(vx.CheckpointError) as refused:
            vx.load_model(folder)
        assert str(tmp_path) not in str(refused.value) and "\n" not in str(refused.value)
        return str(refused.value)

    # Settings are checked before any tensor is read (this folder has none yet).
    assert "larger than the grid" in refusal({**config, "vision_config": {**vision, "window_size": 28 * 20}})
    million = {**preprocessor, "size": {"shortest_edge": 3136, "longest_edge": 10**6 * 14 * 14}}
    assert "budgets of up to" in refusal(preprocessor=million)
    assert "not blocks of its 3" in refusal({**config, "vision_config": {**vision, "fullatt_block_indexes": [3]}})
    assert "silu" in refusal({**config, "vision_config": {**vision, "hidden_act": "gelu"}})
    assert "no vision tower" not in refusal()  # no weights at all: its own sentence
    outside = tmp_path / "elsewhere.json"  # a preprocessor_config.json that leads out of the folder
    outside.write_text(json.dumps(preprocessor))
    (folder / "preprocessor_config.json").unlink()
    (folder / "preprocessor_config.json").symlink_to(outside)
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(vx.CheckpointError, match="leads outside the model folder"):
        vx.load_model(folder)
    (folder / "preprocessor_config.json").unlink()
    index = json.loads((source / "model.safetensors.index.json").read_text())
    language = {key: shard for key, shard in index["weight_map"].items() if not key.startswith("visual.")}
    for shard in set(language.values()):
        (folder / shard).write_bytes((source / shard).read_bytes())
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": language}))
    assert "no vision tower" in refusal()
    assert "QuickGELU" in refusal({**config, "model_type": "qwen2_vl"})


def test_the_qwen3_tower_matches_transformers_with_its_positions_and_deepstack(tmp_path):
    """Qwen3-VL: patches of 16 with a bias, a learned 6 x 6 grid of positions stretched (bilinear,
    corners) over the picture's 8 x 12, LayerNorm and GELU-tanh blocks, every layer attending
    everywhere, a LayerNorm merger and two DeepStack mergers (blocks 0 and 1)."""
    t = transformers
    vision = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=24, num_position_embeddings=36,
                  deepstack_visual_indexes=[0, 1], patch_size=16, spatial_merge_size=2, temporal_patch_size=2)
    config = t.Qwen3VLConfig(vision_config=vision, text_config={**TEXT, "head_dim": 12}, image_token_id=999,
                             video_token_id=998, vision_start_token_id=997)
    torch.manual_seed(0)
    reference = t.Qwen3VLForConditionalGeneration(config).eval()
    with torch.no_grad():  # positions and scores large enough that a wrong stretch, order or norm shows
        for name, parameter in reference.model.visual.named_parameters():
            if name.endswith("qkv.weight"):
                parameter.mul_(6)
            if "norm" in name and name.endswith("weight"):
                parameter.copy_(1 + 0.5 * torch.randn_like(parameter))
            if name == "pos_embed.weight":
                parameter.normal_()
    folder = tmp_path / "qwen3_vl"
    reference.save_pretrained(folder, max_shard_size="20KB")
    processor = t.Qwen2VLImageProcessorPil(min_pixels=32 * 32, max_pixels=32 * 32 * 30, patch_size=16, merge_size=2,
                                           image_mean=[0.5] * 3, image_std=[0.5] * 3)
    processor.save_pretrained(folder)
    picture = (torch.rand(128, 192, 3, generator=torch.Generator().manual_seed(0)) * 255).to(torch.uint8).numpy()
    prepared = processor(images=picture, return_tensors="pt")
    pixel_values, grid_thw = prepared["pixel_values"], prepared["image_grid_thw"]
    assert grid_thw.tolist() == [[1, 8, 12]]
    x = rearrange(pixel_values, "(h w m1 m2) (c t p1 p2) -> t c (h m1 p1) (w m2 p2)", h=4, w=6, m1=2, m2=2, c=3, t=2, p1=16)[:1]
    model = vx.load_model(folder, image_size=(128, 192))
    with torch.no_grad():
        expected = reference.model.visual(pixel_values, grid_thw=grid_thw, output_hidden_states=True)
        captured = vx.capture(model, x)
        merged, deepstack = model.merged(captured.tokens[:, -1], captured.grid_size), model.deepstack(captured.tokens, captured.grid_size)
    # No windows: the tower's order is only the 2 x 2 merge units, row-major.
    unit, within = torch.arange(96) // 4, torch.arange(96) % 4
    order = (unit // 6 * 2 + within // 2) * 12 + unit % 6 * 2 + within % 2
    torch.testing.assert_close(captured.tokens[0], torch.stack(expected.hidden_states)[:, torch.argsort(order)], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(merged[0], expected.pooler_output, atol=1e-4, rtol=1e-4)
    assert len(deepstack) == 2
    for ours, theirs in zip(deepstack, expected.deepstack_features):
        torch.testing.assert_close(ours[0], theirs, atol=1e-4, rtol=1e-4)
    assert model.config.pixel_budget == (32 * 32, 32 * 32 * 30) and model.config.mean == (0.5, 0.5, 0.5)
    knock_out = vx.KnockOut(heads={1: (1,)})
    torch.testing.assert_close(vx.capture(model, x, knock_out=knock_out, intact=captured).tokens,
                               vx.capture(model, x, knock_out=knock_out).tokens, atol=1e-5, rtol=1e-5)
    # A config claiming a million positions a side, or DeepStack from a block it does not have: a sentence.
    saved = json.loads((folder / "config.json").read_text())
    for vision_changes, words in [({"num_position_embeddings": 10**12}, "num_position_embeddings"),
                                  ({"deepstack_visual_indexes": [0, 5]}, "not blocks of its 3")]:
        (folder / "config.json").write_text(json.dumps({**saved, "vision_config": {**saved["vision_config"], **vision_changes}}))
        with pytest.raises(vx.CheckpointError, match=words):
            vx.load_model(folder)
