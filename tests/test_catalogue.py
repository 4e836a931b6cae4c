"""The catalogue: each entry fits timm's architecture of that name, and the download path works
against a real HTTP server on loopback serving random-weight files of the same layout."""
from __future__ import annotations

import functools
import http.server
import threading

import pytest
import timm
import torch
from safetensors.torch import save_file

import vit_explorer as vx
from vit_explorer import catalogue

from helpers import randomize


@pytest.mark.parametrize("name", [name for name, entry in catalogue.CATALOGUE.items()
                                  if entry.source.startswith("timm/")])
def test_each_entry_has_the_shapes_of_timms_model(name):
    entry = catalogue.CATALOGUE[name]
    with torch.device("meta"):
        reference = timm.create_model(entry.source.removeprefix("timm/"), pretrained=False)
    shapes = {key: tuple(value.shape) for key, value in reference.state_dict().items()}
    for key in entry.drop_keys:
        shapes.pop(key)
    assert catalogue.expected_shapes(name) == shapes
    assert entry.size_bytes == 4 * sum(value.numel() for value in reference.state_dict().values())
    assert entry.config.get("mean", (0.5,) * 3) == pytest.approx(reference.pretrained_cfg["mean"])
    assert entry.config["image_size"] == reference.pretrained_cfg["input_size"][-1]
    assert catalogue.url(name) == f"https://huggingface.co/{entry.source}/resolve/main/model.safetensors"


def test_imagenet_heads_get_imagenet_class_names():
    config = catalogue.CATALOGUE["deit_s"].vit_config()
    assert len(config.class_names) == 1000 and config.class_names[:2] == ("tench", "goldfish")


# ----------------------------------------------------------------------------- downloads

TINY = dict(img_size=28, patch_size=14, embed_dim=32, depth=2, num_heads=2)
LAYOUTS = {
    # our name -> (timm architecture of the same layout, its catalogue entry's config)
    "tiny_dinov2_reg": ("vit_small_patch14_reg4_dinov2", catalogue.CatalogueEntry(
        "Tiny DINOv2", "timm/tiny_dinov2_reg", 0, "nothing", "random",
        config=dict(image_size=28, patch_size=14, num_classes=0, reg_tokens=4, no_embed_class=True,
                    init_values=1e-5, embed_dim=32, depth=2, num_heads=2),
    )),
    "tiny_clip": ("vit_base_patch16_clip_quickgelu_224", catalogue.CatalogueEntry(
        "Tiny CLIP", "timm/tiny_clip", 0, "nothing", "random",
        config=dict(image_size=28, patch_size=14, num_classes=0, pre_norm=True, patch_bias=False,
                    act_layer="quick_gelu", layer_norm_eps=1e-5, embed_dim=32, depth=2, num_heads=2),
        drop_keys=("head.weight", "head.bias"),
    )),
}


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """A Hub on 127.0.0.1 serving tmp_path/hub; the cache in tmp_path/cache."""
    root = tmp_path / "hub"
    root.mkdir()
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(QuietHandler, directory=str(root))
    )
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setenv(catalogue.HUB_URL_VARIABLE, f"http://127.0.0.1:{server.server_address[1]}")
    monkeypatch.setenv(catalogue.CACHE_VARIABLE, str(tmp_path / "cache"))
    for name, (_, entry) in LAYOUTS.items():
        monkeypatch.setitem(catalogue.CATALOGUE, name, entry)
    yield root, server
    server.shutdown()
    server.server_close()


def publish(root, name: str, **changes) -> torch.nn.Module:
    """Put a random-weight timm model of the entry's layout where the Hub would have it."""
    architecture, entry = LAYOUTS[name]
    kwargs = {**TINY, "num_classes": 512 if entry.drop_keys else 0, **changes}
    reference = randomize(timm.create_model(architecture, pretrained=False, **kwargs))
    folder = root / entry.source / "resolve" / "main"
    folder.mkdir(parents=True)
    save_file({key: value.contiguous() for key, value in reference.state_dict().items()},
              folder / "model.safetensors")
    return reference


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_download_check_cache_and_parity(hub, name):
    root, server = hub
    reference = publish(root, name)
    seen = []
    model = vx.load_pretrained(name, progress=lambda done, total: seen.append((done, total)))
    size = (root / catalogue.CATALOGUE[name].source / "resolve/main/model.safetensors").stat().st_size
    assert seen[-1] == (size, size)
    x = torch.randn(2, 3, 28, 28)
    with torch.no_grad():
        expected = reference.forward_head(reference.forward_features(x), pre_logits=True)
        torch.testing.assert_close(model(x), expected, atol=1e-5, rtol=1e-5)
    cache = catalogue.cached_path(name).parent
    assert [path.name for path in cache.iterdir()] == [f"{name}.safetensors"]
    # Cached: no server needed any more.
    server.shutdown()
    assert catalogue.is_downloaded(name)
    assert vx.load_pretrained(name).config == model.config


def test_a_file_of_another_model_is_refused_and_not_kept(hub):
    root, _ = hub
    publish(root, "tiny_dinov2_reg", depth=3)
    with pytest.raises(vx.CheckpointError, match=r"^the downloaded tiny_dinov2_reg file is not the expected model \(unexpected: blocks\.2"):
        vx.load_pretrained("tiny_dinov2_reg")
    assert not catalogue.cached_path("tiny_dinov2_reg").parent.exists() or not any(
        catalogue.cached_path("tiny_dinov2_reg").parent.iterdir()
    )


def test_a_truncated_file_is_refused_and_not_kept(hub):
    root, _ = hub
    publish(root, "tiny_dinov2_reg")
    served = root / "timm/tiny_dinov2_reg/resolve/main/model.safetensors"
    served.write_bytes(served.read_bytes()[:-1000])
    with pytest.raises(vx.CheckpointError, match="truncated"):
        vx.load_pretrained("tiny_dinov2_reg")
    assert not catalogue.is_downloaded("tiny_dinov2_reg")
    assert not list(catalogue.cached_path("tiny_dinov2_reg").parent.iterdir())


def test_missing_file_and_offline_are_one_sentence(hub, monkeypatch):
    with pytest.raises(vx.CheckpointError, match=r"answered 404"):
        vx.load_pretrained("tiny_clip")
    _, server = hub
    port = server.server_address[1]
    server.shutdown()
    server.server_close()  # nothing listens on the port any more: as good as offline
    with pytest.raises(vx.CheckpointError) as refused:
        vx.load_pretrained("tiny_clip")
    message = str(refused.value)
    assert message.startswith(f"could not download Tiny CLIP from http://127.0.0.1:{port}/")
    assert "(no internet?)" in message and "\n" not in message
