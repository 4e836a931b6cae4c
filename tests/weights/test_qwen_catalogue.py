"""The catalogue's Qwen2.5-VL-3B tower: the entry is the published model's tower (its config.json
and preprocessor_config.json as published, transformers' tower at those sizes on the meta
device); downloaded from a loopback Hub serving a Qwen2.5-VL folder as transformers writes it
(bfloat16, sharded, with its index and preprocessor), only the tower's byte ranges come, and the
result equals transformers' tower on the same weights; a range cut short and a tampered header
are sentences that keep nothing; in the app its licence is named before anything downloads and
the Pipeline ends in what its language model reads."""
from __future__ import annotations

import copy
import dataclasses
import functools
import http.server
import json
import re
import shutil
import threading

import pytest
import torch

import vit_explorer as vx
from vit_explorer.weights import catalogue, entry_checks, from_qwen_vl
from vit_explorer.weights.infer import infer_config

from apptest import errors, open_app, tiny_default, widget  # noqa: F401 (the app's fixture)
from test_qwen_vl_tower import HEIGHT, PIXELS, TEXT, WIDTH, _image, _row_major, qwen_model
from test_vlm_catalogue import RangeHandler, nothing_kept

transformers = pytest.importorskip("transformers")

NAME = "qwen25_vl_3b_tower"
# Qwen/Qwen2.5-VL-3B-Instruct's config.json (its vision part whole) and preprocessor_config.json as published.
PUBLISHED_VISION = {
    "depth": 32, "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16, "in_chans": 3,
    "out_hidden_size": 2048, "patch_size": 14, "spatial_merge_size": 2, "spatial_patch_size": 14, "window_size": 112,
    "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2, "temporal_patch_size": 2,
}
PUBLISHED = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl", "hidden_size": 2048,
    "num_hidden_layers": 36, "torch_dtype": "bfloat16", "vision_config": PUBLISHED_VISION, "vocab_size": 151936,
}
PUBLISHED_PREPROCESSOR = {
    "min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
    "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2_5_VLProcessor",
}
# The entry at the test folder's sizes (test_qwen_vl_tower's tower), every other setting its own.
TINY = dataclasses.replace(
    catalogue.entry(NAME), source="test/tiny-qwen2.5-vl", size_bytes=0,
    config={
        **catalogue.entry(NAME).config, "embed_dim": 32, "depth": 3, "num_heads": 2, "mlp_ratio": 1.5, "swiglu_align_to": 8,
        "attn_window": 4, "full_attention_blocks": (1,), "merger_dim": 24, "language_model_layer": 3,
        "image_size": (224, 224), "pixel_budget": (PIXELS["min_pixels"], PIXELS["max_pixels"]),
    },
)


def _published(folder, vision_changes=None, preprocessor=True):
    """The published config.json (its vision_config changed) and preprocessor_config.json (or none) in ``folder``."""
    vision = {**PUBLISHED_VISION, **(vision_changes or {})}
    (folder / "config.json").write_text(json.dumps({**PUBLISHED, "vision_config": vision}))
    (folder / "preprocessor_config.json").unlink(missing_ok=True)
    if preprocessor:
        (folder / "preprocessor_config.json").write_text(json.dumps(PUBLISHED_PREPROCESSOR))
    return folder / "config.json"


def test_the_qwen_entry_is_qwen25_vl_3bs_tower(tmp_path):
    """The published files pass the entry's config check; transformers' tower at the published
    sizes (meta device) has the entry's shapes, infers exactly the entry's config, and its
    bfloat16 parameters are the entry's size; the 7B's merger, other full-attention blocks or the
    processor's default budget (no preprocessor_config.json) are refused in a sentence."""
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    catalogue.check_vlm_config(NAME, _published(tmp_path))
    with torch.device("meta"):
        tower = Qwen2_5_VisionTransformerPretrainedModel(transformers.Qwen2_5_VLVisionConfig(**PUBLISHED_VISION))
    shapes = {f"visual.{key}": tuple(value.shape) for key, value in tower.state_dict().items()}
    entry = catalogue.entry(NAME)
    assert entry.size_bytes == 2 * sum(value.numel() for value in tower.state_dict().values())
    assert entry_checks.tower_shapes(NAME, shapes, PUBLISHED) == catalogue.expected_shapes(NAME)
    with torch.device("meta"):
        state = from_qwen_vl.convert({key.removeprefix("visual."): torch.empty(shape) for key, shape in shapes.items()}, NAME)
    inferred = infer_config(state, from_qwen_vl.settings(tmp_path, PUBLISHED, NAME), {}, NAME)
    assert inferred == entry.vit_config() and inferred.num_tokens == 1024  # 448 x 448 px by default
    assert entry.terms_to_accept and entry.licence.startswith("Qwen RESEARCH LICENSE") and "(H/28) x (W/28)" in entry.card
    for changes, preprocessor, words in [
        ({"out_hidden_size": 3584}, True, "merger_dim is 3584, not 2048"),
        ({"fullatt_block_indexes": [7, 15, 23]}, True, "full_attention_blocks"),
        ({}, False, "pixel_budget"),
    ]:
        with pytest.raises(catalogue.DownloadError, match=words) as refused:
            catalogue.check_vlm_config(NAME, _published(tmp_path, changes, preprocessor))
        assert str(tmp_path) not in str(refused.value)


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """(a Qwen2.5-VL folder as transformers writes it, bfloat16 and sharded, with its processor's
    settings; transformers' model with the same, bfloat16-rounded, weights in float32)."""
    t = transformers
    model = qwen_model({**TEXT, "vocab_size": 4000})
    with torch.no_grad():
        for parameter in model.parameters():  # the values bfloat16 keeps (its rotary buffer stays float32)
            parameter.copy_(parameter.bfloat16())
    folder = tmp_path_factory.mktemp("published")
    copy.deepcopy(model).to(torch.bfloat16).save_pretrained(folder, max_shard_size="200KB")
    t.Qwen2VLImageProcessor(**PIXELS).save_pretrained(folder)
    return folder, model


@pytest.fixture
def hub(published, tmp_path, monkeypatch):
    """A Hub on 127.0.0.1 serving a copy of the published folder as the tiny entry's repository;
    the cache in tmp_path/cache."""
    source, _ = published
    root = tmp_path / "hub"
    folder = root / TINY.source / "resolve" / "main"
    shutil.copytree(source, folder)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(RangeHandler, directory=str(root)))
    server.served, server.cut, server.whole = [], False, False
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv(catalogue.HUB_URL_VARIABLE, f"http://127.0.0.1:{server.server_address[1]}")
    monkeypatch.setenv(catalogue.CACHE_VARIABLE, str(tmp_path / "cache"))
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    # The tower's bfloat16 bytes, the merger's with them.
    tower_bytes = 2 * sum(value.numel() for key, value in published[1].state_dict().items() if key.startswith("model.visual."))
    assert {key.removeprefix("visual.") for key in index if key.startswith("visual.")} == {
        key.removeprefix("model.visual.") for key in published[1].state_dict() if key.startswith("model.visual.")}
    monkeypatch.setitem(catalogue.CATALOGUE, "tiny_qwen", dataclasses.replace(TINY, size_bytes=tower_bytes))
    yield folder, server
    server.shutdown()
    server.server_close()


def test_only_the_qwen_towers_ranges_are_downloaded_and_it_equals_transformers_tower(hub, published):
    folder, server = hub
    _, reference = published
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    tower_shards = {shard for key, shard in index.items() if key.startswith("visual.")}
    assert set(index.values()) - tower_shards  # shards of the language model alone exist
    seen = []
    model = vx.load_pretrained("tiny_qwen", progress=lambda done, total: seen.append((done, total)))
    tower_bytes = catalogue.entry("tiny_qwen").size_bytes
    assert seen[-1] == (tower_bytes, tower_bytes)
    # The small files, the index, and of the tower's shards their headers and the tower's bytes.
    asked = {name for name, _ in server.served}
    assert asked - {"config.json", "preprocessor_config.json", "model.safetensors.index.json"} == tower_shards
    weights = sum(size for name, size in server.served if name.endswith(".safetensors"))
    whole = sum((folder / shard).stat().st_size for shard in set(index.values()))
    assert weights < 1.1 * tower_bytes and 2 * tower_bytes < whole, (weights, tower_bytes, whole)
    cached = catalogue.cached_path("tiny_qwen")
    assert sorted(path.name for path in cached.iterdir()) == ["config.json", "model.safetensors", "preprocessor_config.json"]
    # It loads as the whole folder does (its pixel budget, what its language model reads) ...
    assert model.config == vx.load_model(folder).config == catalogue.entry("tiny_qwen").vit_config()
    assert (model.config.language_model_layer, model.config.merger_dim) == (3, 24)
    # ... and is transformers' tower: every layer's tokens and the merger's on the processor's picture.
    processor = transformers.Qwen2VLImageProcessor(**PIXELS)
    picture = (torch.rand(HEIGHT, WIDTH, 3, generator=torch.Generator().manual_seed(0)) * 255).to(torch.uint8).numpy()
    prepared = processor(images=picture, return_tensors="pt")
    pixel_values, grid_thw = prepared["pixel_values"], prepared["image_grid_thw"]
    sized = vx.resize_model(model, image_size=(HEIGHT, WIDTH))
    with torch.no_grad():
        expected = reference.model.visual(pixel_values, grid_thw=grid_thw, output_hidden_states=True)
        captured = vx.capture(sized, _image(pixel_values, grid_thw))
        merged = sized.merged(captured.tokens[:, -1], captured.grid_size)
    assert captured.tokens.shape[1:3] == (4, 96) and merged.shape == (1, 4 * 6, 24)  # (H/28) x (W/28) tokens
    torch.testing.assert_close(captured.tokens[0], _row_major(torch.stack(expected.hidden_states), grid_thw), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(merged[0], expected.pooler_output, atol=1e-4, rtol=1e-4)
    server.shutdown()  # cached: no server needed any more
    assert catalogue.is_downloaded("tiny_qwen") and vx.load_pretrained("tiny_qwen").config == model.config


def test_a_qwen_range_cut_short_is_a_sentence_and_nothing_is_kept(hub):
    hub[1].cut = True
    with pytest.raises(vx.CheckpointError, match="cut short") as refused:
        vx.load_pretrained("tiny_qwen")
    assert "\n" not in str(refused.value) and nothing_kept()


@pytest.mark.parametrize("side, offsets_follow, words", [
    (33, False, "its header's entry for visual.blocks.0.norm1.weight does not add up"),
    (16, True, "not the expected model (wrong shape: blocks.0.norm1.weight)"),
])
def test_a_tampered_qwen_header_is_a_sentence_and_nothing_is_kept(hub, side, offsets_follow, words):
    """A tower tensor's shape changed in its shard's header: bytes that do not add up, or a header
    that adds up to a tower of other shapes than the entry's."""
    folder, _ = hub
    key = "visual.blocks.0.norm1.weight"
    path = folder / json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"][key]
    data = path.read_bytes()
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + length])
    header[key]["shape"] = [side]
    if offsets_follow:
        begin = header[key]["data_offsets"][0]
        header[key]["data_offsets"] = [begin, begin + 2 * side]
    encoded = json.dumps(header, separators=(",", ":")).encode()
    assert len(encoded) <= length
    path.write_bytes(data[:8] + encoded.ljust(length) + data[8 + length:])
    with pytest.raises(vx.CheckpointError, match=re.escape(words)):
        vx.load_pretrained("tiny_qwen")
    assert nothing_kept()


def test_the_app_names_the_qwen_licence_then_downloads_the_tower_and_marks_what_its_llm_reads(hub):
    app = open_app("views/pipeline.py")
    picker = app.selectbox(key="model_picker")
    assert picker.format_func(f"pretrained:{NAME}").startswith("1337 MB download: Qwen2.5")
    picker.set_value("pretrained:tiny_qwen").run()
    assert not app.exception and errors(app) == [] and app.session_state["model_key"] == "default"
    (notice,) = [warning.value for warning in app.warning if "Qwen RESEARCH LICENSE" in warning.value]
    assert notice.startswith(f"{TINY.title}'s weights are published under the Qwen RESEARCH LICENSE AGREEMENT")
    assert not catalogue.is_downloaded("tiny_qwen")  # nothing comes before the terms are accepted
    widget(app.button, "Accept and download").click().run()
    assert not app.exception and errors(app) == [] and app.session_state["model_key"] == "pretrained:tiny_qwen"
    assert catalogue.is_downloaded("tiny_qwen")
    # The Pipeline ends in what the language model reads: the merger's 8 x 8 tokens at 224 x 224 px.
    assert any("through its patch merger" in text.value and "8 x 8 = 64 image tokens" in text.value for text in app.markdown)
