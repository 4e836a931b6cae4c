"""The catalogue's VLM tower: only the vision tower's byte ranges of a VLM repository's shards are
downloaded (a real HTTP server on loopback that answers range requests, serving a folder as
transformers writes it), checked, and load as the whole folder would; a server without ranges, a
range cut short, an index naming a file elsewhere and a repository without a tower are sentences
that keep nothing."""
from __future__ import annotations

import dataclasses
import functools
import http.server
import json
import re
import threading
from pathlib import Path

import pytest
import torch

import vit_explorer as vx
from vit_explorer.model.config import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD
from vit_explorer.weights import catalogue, entry_checks

transformers = pytest.importorskip("transformers")

VISION = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, image_size=32, patch_size=8)
TEXT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, vocab_size=3000)
TINY = catalogue.CatalogueEntry(
    "Tiny LLaVA's tower", "test/tiny-llava", 0, "nothing", "random",
    config=dict(
        image_size=32, patch_size=8, num_classes=0, pre_norm=True, patch_bias=False, act_layer="quick_gelu",
        layer_norm_eps=1e-5, mean=OPENAI_CLIP_MEAN, std=OPENAI_CLIP_STD, embed_dim=64, depth=2, num_heads=4,
        mlp_ratio=2, language_model_layer=1, language_model_drops_class_token=True,
    ),
    vlm=True,
)


def test_the_llava_entry_is_llava_15s_tower(tmp_path):
    """LLaVA-1.5's config (transformers' LlavaConfig defaults are LLaVA-1.5-7B's) passes the
    entry's config check, its tower's shapes (on the meta device) its tower check, and the
    entry's size is the tower's half-precision bytes."""
    config = transformers.LlavaConfig(vision_feature_layer=-2, vision_feature_select_strategy="default").to_dict()
    with torch.device("meta"):
        tower = transformers.CLIPVisionModel(transformers.CLIPVisionConfig(**config["vision_config"]))
    shapes = {f"vision_tower.{key}": tuple(value.shape) for key, value in tower.state_dict().items()}
    entry = catalogue.entry("llava15_7b_tower")
    assert entry.size_bytes == 2 * sum(value.numel() for value in tower.state_dict().values())
    assert config["vision_config"]["image_size"] == 336 and config["vision_config"]["num_hidden_layers"] == 24
    converted = entry_checks.tower_shapes("llava15_7b_tower", shapes, config)
    assert converted == catalogue.expected_shapes("llava15_7b_tower")
    (tmp_path / "config.json").write_text(json.dumps(config))
    catalogue.check_vlm_config("llava15_7b_tower", tmp_path / "config.json")  # the penultimate layer, no class token
    config["vision_feature_layer"] = -1
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(catalogue.DownloadError, match="its language model reads"):
        catalogue.check_vlm_config("llava15_7b_tower", tmp_path / "config.json")


class RangeHandler(http.server.SimpleHTTPRequestHandler):
    """Serves files whole, or the byte range a Range header asks for (as the Hub does); the
    server's ``cut`` answers ranges with half their bytes and ``whole`` ignores ranges."""

    def log_message(self, *args):
        pass

    def do_GET(self):
        path = Path(self.translate_path(self.path))
        if not path.is_file():
            self.send_error(404)
            return
        data = path.read_bytes()
        asked = re.fullmatch(r"bytes=(\d+)-(\d+)", self.headers.get("Range") or "")
        if asked is None or self.server.whole:
            self.server.served.append((path.name, len(data)))
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return
        first, last = int(asked.group(1)), min(int(asked.group(2)), len(data) - 1)
        body = data[first:last + 1]
        self.server.served.append((path.name, len(body)))
        self.send_response(206)
        self.send_header("Content-Range", f"bytes {first}-{last}/{len(data)}")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body[:len(body) // 2] if self.server.cut and len(body) > 64 else body)


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """A Hub on 127.0.0.1 serving a tiny LLaVA folder (sharded, transformers' files) as the
    entry's repository; the cache in tmp_path/cache."""
    root = tmp_path / "hub"
    folder = root / TINY.source / "resolve" / "main"
    folder.parent.mkdir(parents=True)
    torch.manual_seed(0)
    config = transformers.LlavaConfig(
        vision_config=transformers.CLIPVisionConfig(**VISION).to_dict(),
        text_config=transformers.LlamaConfig(**TEXT).to_dict(), image_token_index=2999,
    )
    transformers.LlavaForConditionalGeneration(config).eval().save_pretrained(folder, max_shard_size="100KB")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(RangeHandler, directory=str(root)))
    server.served, server.cut, server.whole = [], False, False
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv(catalogue.HUB_URL_VARIABLE, f"http://127.0.0.1:{server.server_address[1]}")
    monkeypatch.setenv(catalogue.CACHE_VARIABLE, str(tmp_path / "cache"))
    tower_bytes = sum(
        4 * value.numel() for key, value in transformers.LlavaForConditionalGeneration(config).state_dict().items()
        if "vision_tower" in key
    )
    monkeypatch.setitem(catalogue.CATALOGUE, "tiny_llava", dataclasses.replace(TINY, size_bytes=tower_bytes))
    yield folder, server
    server.shutdown()
    server.server_close()


def nothing_kept() -> bool:
    cache = catalogue.cache_dir()
    return not cache.exists() or not any(cache.iterdir())


def test_only_the_towers_ranges_are_downloaded_and_it_loads_as_the_whole_folder(hub):
    folder, server = hub
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    tower_shards = {shard for key, shard in index.items() if "vision_tower" in key}
    assert set(index.values()) - tower_shards  # shards of the language model alone exist
    seen = []
    model = vx.load_pretrained("tiny_llava", progress=lambda done, total: seen.append((done, total)))
    images = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    reference = vx.load_model(folder)
    torch.testing.assert_close(vx.capture(model, images).tokens, vx.capture(reference, images).tokens, atol=0, rtol=0)
    assert model.config.language_model_layer == 1 and model.config.language_model_drops_class_token
    tower_bytes = catalogue.entry("tiny_llava").size_bytes
    assert seen[-1] == (tower_bytes, tower_bytes)
    # Only the config, the index and the tower's shards were asked for: their headers and the
    # tower's bytes (neighbours asked for together bring a few small tensors beside them).
    asked = {name for name, _ in server.served}
    assert asked - {"config.json", "model.safetensors.index.json"} == tower_shards
    weights = sum(size for name, size in server.served if name.endswith(".safetensors"))
    whole = sum((folder / shard).stat().st_size for shard in set(index.values()))
    assert weights < 1.3 * tower_bytes < whole, (weights, tower_bytes, whole)
    assert sorted(path.name for path in catalogue.cached_path("tiny_llava").iterdir()) == ["config.json", "model.safetensors"]
    server.shutdown()  # cached: no server needed any more
    assert catalogue.is_downloaded("tiny_llava")
    assert vx.load_pretrained("tiny_llava").config == model.config


def test_a_server_without_ranges_is_a_sentence_and_nothing_is_kept(hub):
    hub[1].whole = True
    with pytest.raises(vx.CheckpointError, match="does not answer range requests"):
        vx.load_pretrained("tiny_llava")
    assert nothing_kept()


def test_a_range_cut_short_is_a_sentence_and_nothing_is_kept(hub):
    hub[1].cut = True
    with pytest.raises(vx.CheckpointError, match="cut"):
        vx.load_pretrained("tiny_llava")
    assert nothing_kept()


def test_an_index_naming_a_shard_elsewhere_is_a_sentence(hub):
    folder, _ = hub
    path = folder / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    key = next(key for key in index["weight_map"] if "vision_tower" in key)
    index["weight_map"][key] = "../../other/model.safetensors"
    path.write_text(json.dumps(index))
    with pytest.raises(vx.CheckpointError, match="names a shard outside its repository"):
        vx.load_pretrained("tiny_llava")
    assert nothing_kept()


def test_a_repository_without_a_tower_is_a_sentence(hub):
    folder, _ = hub
    path = folder / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    index["weight_map"] = {key: shard for key, shard in index["weight_map"].items() if "vision_tower" not in key}
    path.write_text(json.dumps(index))
    with pytest.raises(vx.CheckpointError, match="holds no vision tower"):
        vx.load_pretrained("tiny_llava")
    assert nothing_kept()
