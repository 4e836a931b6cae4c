"""The catalogue: each entry fits timm's architecture of that name, and the download path works
against a real HTTP server on loopback serving random-weight files of the same layout."""
from __future__ import annotations

import dataclasses
import contextlib
import functools
import http.server
import json
import math
import os
import socket
import subprocess
import struct
import sys
import threading
import time

import pytest
import timm
import torch
from safetensors.torch import save_file

import vit_explorer as vx
from vit_explorer.weights import catalogue

from helpers import randomize
from textmodels import SMALL_CLIP, SMALL_SIGLIP_TEXT, open_clip_folder, siglip_folder
from vit_explorer.model.config import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD


@pytest.mark.parametrize("name", [name for name, entry in catalogue.CATALOGUE.items()
                                  if entry.source.startswith("timm/") and entry.open_clip is None])
def test_each_entry_has_the_shapes_of_timms_model(name):
    entry = catalogue.CATALOGUE[name]
    with torch.device("meta"):
        reference = timm.create_model(entry.source.removeprefix("timm/"), pretrained=False)
    shapes = {key: tuple(value.shape) for key, value in reference.state_dict().items()}
    for key in entry.drop_keys:
        shapes.pop(key)
    assert catalogue.expected_shapes(name) == catalogue.our_names(name, shapes)
    assert entry.size_bytes == 4 * sum(value.numel() for value in reference.state_dict().values())
    assert entry.config.get("mean", (0.5,) * 3) == pytest.approx(reference.pretrained_cfg["mean"])
    if entry.config.get("abs_pos_embed", True):
        assert entry.config["image_size"] == reference.pretrained_cfg["input_size"][-1]
    else:  # rotary positions only (DINOv3, 256 in timm): any size is native; 224 as the others
        assert entry.config["image_size"] == 224
    licences = {"apache-2.0": "Apache-2.0", "dinov3-license": catalogue.DINOV3_LICENCE}
    assert entry.licence == licences[reference.pretrained_cfg["license"]]
    assert entry.card.endswith(f" Licence: {entry.licence}.")
    assert catalogue.url(name) == f"https://huggingface.co/{entry.source}/resolve/main/model.safetensors"


# The catalogue's CLIP and SigLIPs -> (open_clip's model name, its pretrained tag, the timm model of the image tower).
OPEN_CLIP_ENTRIES = {
    "clip_vitb16": ("ViT-B-16", "openai", "vit_base_patch16_clip_224.openai"),
    "clip_vitl14_336": ("ViT-L-14-336", "openai", "vit_large_patch14_clip_336.openai"),
    "pe_core_l14_336": ("PE-Core-L-14-336", "meta", "vit_pe_core_large_patch14_336.fb"),
    "siglip_so400m14_384": ("ViT-SO400M-14-SigLIP-384", "webli", "vit_so400m_patch14_siglip_384.webli"),
    "siglip_vitb16": ("ViT-B-16-SigLIP", "webli", "vit_base_patch16_siglip_224.webli"),
    "siglip2_vitb16": ("ViT-B-16-SigLIP2", "webli", "vit_base_patch16_siglip_224.v2_webli"),
}


def sparse_safetensors(path, shapes: dict[str, tuple[int, ...]]) -> None:
    """A float32 safetensors file of these shapes whose data is a hole: the size of the real one
    (its header checks out), nothing written."""
    header, offset = {}, 0
    for key, shape in shapes.items():
        size = 4 * math.prod(shape)
        header[key] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(path, "wb") as file:
        file.write(struct.pack("<Q", len(encoded)) + encoded)
        file.truncate(8 + len(encoded) + offset)


def test_the_open_clip_entries_are_open_clips_models():
    import open_clip

    assert {name for name, entry in catalogue.CATALOGUE.items() if entry.open_clip is not None} == set(OPEN_CLIP_ENTRIES)
    for name, (model_name, tag, _) in OPEN_CLIP_ENTRIES.items():
        entry = catalogue.CATALOGUE[name]
        pretrained = open_clip.get_pretrained_cfg(model_name, tag)
        # The repository open_clip loads these weights from, with its normalisation and activation.
        assert pretrained["hf_hub"] == f"{entry.source}/"
        assert entry.config.get("mean", (0.5,) * 3) == pytest.approx(pretrained["mean"])
        assert entry.config.get("std", (0.5,) * 3) == pytest.approx(pretrained["std"])
        model_cfg = entry.open_clip_config()
        assert bool(model_cfg.get("quick_gelu")) == pretrained.get("quick_gelu", False)
        assert {key: value for key, value in model_cfg.items() if key != "quick_gelu"} == open_clip.get_model_config(model_name)
        assert entry.tokenizer == bool(model_cfg["text_cfg"].get("hf_tokenizer_name"))
        assert entry.files[0] == "open_clip_config.json" and entry.files[-1] == "open_clip_model.safetensors"
        assert ("tokenizer.json" in entry.files) == entry.tokenizer
        assert catalogue.url(name) == f"https://huggingface.co/{entry.source}/resolve/main/open_clip_model.safetensors"
        assert catalogue.text_folder(name) == catalogue.cached_path(name)
        assert entry.card.endswith(f" Licence: {entry.licence}.") and "text tower comes with it" in entry.card
    assert catalogue.text_folder("dino_vits16") is None and catalogue.text_folder("vit_b_16") is None


@pytest.mark.parametrize("name", list(OPEN_CLIP_ENTRIES))
def test_each_open_clip_entry_is_the_file_open_clip_writes(name, tmp_path):
    """open_clip's own model of the entry's config, both towers, as the file its repository holds
    (a sparse file of the real size): it passes the check, and its size is the entry's."""
    import open_clip

    entry = catalogue.CATALOGUE[name]
    model_cfg = entry.open_clip_config()
    arguments = {key: value for key, value in model_cfg.items() if key != "custom_text"}
    with torch.device("meta"):
        model = (open_clip.CustomTextCLIP if model_cfg.get("custom_text") else open_clip.CLIP)(**arguments)
        image_tower = timm.create_model(OPEN_CLIP_ENTRIES[name][2], pretrained=False, num_classes=0)
    shapes = {key: tuple(value.shape) for key, value in model.state_dict().items()}
    assert entry.size_bytes == 4 * sum(math.prod(shape) for shape in shapes.values())
    assert entry.size_bytes == 4 * catalogue.open_clip_shapes(name).numel
    # The image tower is the one timm publishes alone, as the entry's ViT has it.
    assert catalogue.expected_shapes(name) == {key: tuple(value.shape) for key, value in image_tower.state_dict().items()}
    path = tmp_path / "open_clip_model.safetensors"
    sparse_safetensors(path, shapes)
    assert path.stat().st_size > entry.size_bytes and path.stat().st_blocks * 512 < 2**20
    catalogue.check_open_clip_weights(name, path)
    config = tmp_path / "open_clip_config.json"
    config.write_text(json.dumps({"model_cfg": model_cfg, "preprocess_cfg": {}}))
    catalogue.check_open_clip_config(name, config)


def test_the_torchvision_file_names_are_torchvisions_own():
    import torchvision.models

    for model, file_name in catalogue.TORCHVISION_FILES.items():
        assert torchvision.models.get_model_weights(model).DEFAULT.url == f"{catalogue.TORCHVISION_MODELS_URL}/{file_name}"
        assert catalogue.torchvision_url(model) == f"{catalogue.TORCHVISION_MODELS_URL}/{file_name}"


def test_asking_whether_a_model_is_downloaded_does_not_import_torchvision_models():
    # torchvision.models imports torch._dynamo: seconds that the model picker would cost every new server.
    code = (
        "import sys; from vit_explorer.weights import catalogue;"
        "[catalogue.is_downloaded(name) for name in catalogue.CATALOGUE];"
        "print('torchvision.models' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert result.stdout.strip() == "False"


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
    "tiny_dinov3": ("vit_small_patch16_dinov3", catalogue.CatalogueEntry(
        "Tiny DINOv3", "timm/tiny_dinov3", 0, "nothing", "random",
        config=dict(catalogue._DINOV3, image_size=28, patch_size=14, embed_dim=32, depth=2, num_heads=2),
        licence=catalogue.DINOV3_LICENCE, eva_names=True,
    )),
    "tiny_siglip2": ("vit_base_patch16_siglip_224", catalogue.CatalogueEntry(
        "Tiny SigLIP 2", "timm/tiny_siglip2", 0, "nothing", "random",
        config=dict(catalogue._SIGLIP_B, image_size=28, patch_size=14, embed_dim=32, depth=2, num_heads=2),
    )),
}


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@contextlib.contextmanager
def serve_hub(tmp_path, monkeypatch):
    """(root, server): a Hub on 127.0.0.1 serving tmp_path/hub; the cache in tmp_path/cache."""
    root = tmp_path / "hub"
    root.mkdir()
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(QuietHandler, directory=str(root))
    )
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setenv(catalogue.HUB_URL_VARIABLE, f"http://127.0.0.1:{server.server_address[1]}")
    monkeypatch.setenv(catalogue.CACHE_VARIABLE, str(tmp_path / "cache"))
    try:
        yield root, server
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """serve_hub's, the LAYOUTS' entries in the catalogue."""
    with serve_hub(tmp_path, monkeypatch) as served:
        for name, (_, entry) in LAYOUTS.items():
            monkeypatch.setitem(catalogue.CATALOGUE, name, entry)
        yield served


def publish(root, name: str, **changes) -> torch.nn.Module:
    """Put a random-weight timm model of the entry's layout where the Hub would have it."""
    architecture, entry = LAYOUTS[name]
    kwargs = {**TINY, "num_classes": 512 if entry.drop_keys else 0, **changes}
    if entry.eva_names:  # DINOv3: pooled on the class token as upstream, as the entry is
        kwargs["global_pool"] = "token"
    if entry.config.get("act_layer") == "gelu_tanh":  # SigLIP's as big_vision trains it (timm: exact GELU)
        kwargs["act_layer"] = "gelu_tanh"
    reference = randomize(timm.create_model(architecture, pretrained=False, **kwargs))
    if entry.eva_names:  # the periods rounded to bfloat16 as the original weights keep them
        reference.rope.periods = reference.rope.periods.to(torch.bfloat16).to(torch.float32)
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
    assert "Errno" not in message and message.endswith(f"; {catalogue.HUB_URL_VARIABLE} can name a mirror")


# ------------------------------------------------------------- open_clip downloads (both towers)

SMALL_SIGLIP = {
    "embed_dim": 32, "custom_text": True, "init_logit_bias": -10,
    "vision_cfg": {"image_size": 32, "timm_model_name": "vit_base_patch16_siglip_224", "timm_pool": "map", "timm_proj": "none"},
    "text_cfg": SMALL_SIGLIP_TEXT,
}
OPEN_CLIP_LAYOUTS = {
    # Small models of the CLIP and SigLIP entries' layouts (tests/textmodels.py writes their folders).
    "tiny_openclip_clip": catalogue.CatalogueEntry(
        "Tiny open_clip CLIP", "timm/tiny_openclip_clip", 4 * 1_723_777, "nothing", "random",
        config=dict(image_size=32, patch_size=8, num_classes=0, pre_norm=True, patch_bias=False,
                    act_layer="quick_gelu", layer_norm_eps=1e-5, embed_dim=64, depth=2, num_heads=2,
                    mean=OPENAI_CLIP_MEAN, std=OPENAI_CLIP_STD),
        open_clip=SMALL_CLIP,
    ),
    "tiny_openclip_siglip": catalogue.CatalogueEntry(
        "Tiny open_clip SigLIP", "timm/tiny_openclip_siglip", 4 * 75_714, "nothing", "random",
        config=dict(catalogue._SIGLIP_B, image_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2),
        open_clip=SMALL_SIGLIP, tokenizer=True,
    ),
}


@pytest.fixture
def open_clip_hub(hub, monkeypatch):
    for name, entry in OPEN_CLIP_LAYOUTS.items():
        monkeypatch.setitem(catalogue.CATALOGUE, name, entry)
    return hub


def publish_open_clip(root, name: str, seed: int = 0):
    """The entry's open_clip folder with random weights, where the Hub would have it."""
    folder = root / OPEN_CLIP_LAYOUTS[name].source / "resolve" / "main"
    if name == "tiny_openclip_clip":
        open_clip_folder(folder, SMALL_CLIP, seed=seed)
    else:
        siglip_folder(folder, seed=seed)
    return folder


def served_bytes(folder) -> int:
    return sum(path.stat().st_size for path in folder.iterdir())


def nothing_kept(name: str) -> bool:
    """Neither the entry's folder nor any temporary file or folder is in the cache."""
    cache = catalogue.cache_dir()
    return not catalogue.is_downloaded(name) and (not cache.exists() or list(cache.iterdir()) == [])


@pytest.mark.parametrize("name", list(OPEN_CLIP_LAYOUTS))
def test_an_open_clip_entry_downloads_both_towers_and_its_tokenizer(open_clip_hub, name):
    from vit_explorer.text import load_image_text_model

    root, server = open_clip_hub
    entry = catalogue.CATALOGUE[name]
    assert entry.size_bytes == 4 * catalogue.open_clip_shapes(name).numel
    served = publish_open_clip(root, name)
    assert (served / "open_clip_model.safetensors").stat().st_size > entry.size_bytes
    assert not catalogue.is_downloaded(name)
    seen = []
    model = vx.load_pretrained(name, progress=lambda done, total: seen.append((done, total)))
    # One progress over every file, its total all of them once the weights' size is known.
    total = served_bytes(served)
    assert seen[-1] == (total, total)
    assert [done for done, _ in seen] == sorted(done for done, _ in seen)
    assert {total for _, total in seen} - {None} == {total}
    folder = catalogue.text_folder(name)
    assert folder == catalogue.cached_path(name) == catalogue.cache_dir() / name
    assert sorted(path.name for path in folder.iterdir()) == sorted(entry.files)
    assert [path.name for path in catalogue.cache_dir().iterdir()] == [name]  # no temporary file left
    # The image tower as the catalogue says (its activation, normalisation), from the folder's weights.
    assert model.config == entry.vit_config()
    reference = vx.load_model(served)
    assert model.state_dict().keys() == reference.state_dict().keys()
    for key, value in reference.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key
    # The text tower beside it, read with the app's shared image tower.
    words = load_image_text_model(folder, image=model)
    assert words.image is model
    labels = ["a photo of a cat", "a red square"]
    torch.testing.assert_close(words.embed_texts(labels), load_image_text_model(served).embed_texts(labels))
    # Downloaded: no server needed any more.
    server.shutdown()
    assert catalogue.is_downloaded(name)
    assert vx.load_pretrained(name).config == model.config


def test_the_optional_tokenizer_file_comes_when_the_server_has_it(open_clip_hub):
    root, _ = open_clip_hub
    served = publish_open_clip(root, "tiny_openclip_siglip")
    (served / "special_tokens_map.json").write_text(json.dumps({"eos_token": "</s>", "pad_token": "<pad>"}))
    folder = catalogue.download("tiny_openclip_siglip")
    assert (folder / "special_tokens_map.json").read_bytes() == (served / "special_tokens_map.json").read_bytes()


def test_a_folder_missing_a_file_is_not_downloaded_and_is_completed(open_clip_hub):
    root, _ = open_clip_hub
    publish_open_clip(root, "tiny_openclip_siglip")
    folder = catalogue.download("tiny_openclip_siglip")
    (folder / "tokenizer.json").unlink()
    assert not catalogue.is_downloaded("tiny_openclip_siglip")
    catalogue.download("tiny_openclip_siglip")
    assert catalogue.is_downloaded("tiny_openclip_siglip")


def test_a_text_tower_of_another_shape_is_refused_and_nothing_kept(open_clip_hub, tmp_path):
    root, _ = open_clip_hub
    served = publish_open_clip(root, "tiny_openclip_clip")
    other = json.loads(json.dumps(SMALL_CLIP))
    other["text_cfg"]["layers"] = 3
    open_clip_folder(tmp_path / "other", other)
    (served / "open_clip_model.safetensors").write_bytes((tmp_path / "other" / "open_clip_model.safetensors").read_bytes())
    expected = (
        r"^the downloaded tiny_openclip_clip file is not the expected model"
        r" \(text tower unexpected: transformer\.resblocks\.2\."
    )
    with pytest.raises(vx.CheckpointError, match=expected) as refused:
        vx.load_pretrained("tiny_openclip_clip")
    assert "\n" not in str(refused.value)
    assert nothing_kept("tiny_openclip_clip")


def test_an_image_tower_of_another_shape_is_refused(open_clip_hub):
    root, _ = open_clip_hub
    publish_open_clip(root, "tiny_openclip_clip")
    changed = dict(OPEN_CLIP_LAYOUTS["tiny_openclip_clip"].config, depth=3)
    catalogue.CATALOGUE["tiny_openclip_clip"] = dataclasses.replace(OPEN_CLIP_LAYOUTS["tiny_openclip_clip"], config=changed)
    with pytest.raises(catalogue.DownloadError, match=r"\(image tower missing: blocks\.2\."):
        catalogue.download("tiny_openclip_clip")
    assert nothing_kept("tiny_openclip_clip")


def test_the_text_tower_is_made_as_the_entry_knows_it_whatever_the_hubs_config_leaves_out(open_clip_hub):
    from open_clip.transformer import QuickGELU

    from vit_explorer.text import load_image_text_model

    root, _ = open_clip_hub
    served = publish_open_clip(root, "tiny_openclip_clip")
    config = json.loads((served / "open_clip_config.json").read_text())
    del config["model_cfg"]["quick_gelu"]  # a hub config without OpenAI's activation flag
    (served / "open_clip_config.json").write_text(json.dumps(config))
    folder = catalogue.download("tiny_openclip_clip")
    assert json.loads((folder / "open_clip_config.json").read_text())["model_cfg"]["quick_gelu"] is True
    text = load_image_text_model(folder).text
    assert any(isinstance(module, QuickGELU) for module in text.modules())


@pytest.mark.parametrize("change, expected", [
    ({"text_cfg": {"width": 48}}, "describes another text tower than Tiny open_clip CLIP's"),
    ({"text_cfg": {"hf_model_name": "bert-base-uncased"}}, "describes another text tower than Tiny open_clip CLIP's"),
    ({"text_cfg": {"not_a_setting": 1}}, "describes another text tower than Tiny open_clip CLIP's"),
    ({"model_cfg": None}, "has no model_cfg with a text_cfg and a vision_cfg"),
    ("not json", "is not JSON"),
])
def test_a_config_that_is_not_the_entrys_is_refused(open_clip_hub, change, expected):
    root, _ = open_clip_hub
    served = publish_open_clip(root, "tiny_openclip_clip")
    path = served / "open_clip_config.json"
    if isinstance(change, str):
        path.write_text("{" + change)
    else:
        config = json.loads(path.read_text())
        if "model_cfg" in change:
            config["model_cfg"] = None
        for key, value in change.items():
            if key == "text_cfg":
                config["model_cfg"]["text_cfg"].update(value)
            elif key != "model_cfg":
                config["model_cfg"][key] = value
        path.write_text(json.dumps(config))
    with pytest.raises(catalogue.DownloadError) as refused:
        catalogue.download("tiny_openclip_clip")
    assert str(refused.value) == f"the downloaded tiny_openclip_clip open_clip_config.json {expected}"
    assert nothing_kept("tiny_openclip_clip")


@pytest.mark.parametrize("missing", ["tokenizer.json", "tokenizer_config.json"])
def test_a_missing_tokenizer_file_is_one_sentence(open_clip_hub, missing):
    root, server = open_clip_hub
    served = publish_open_clip(root, "tiny_openclip_siglip")
    (served / missing).unlink()
    with pytest.raises(vx.CheckpointError) as refused:
        vx.load_pretrained("tiny_openclip_siglip")
    port = server.server_address[1]
    assert str(refused.value) == (
        f"could not download Tiny open_clip SigLIP: http://127.0.0.1:{port}/timm/tiny_openclip_siglip/resolve/main/{missing}"
        " answered 404 File not found"
    )
    assert nothing_kept("tiny_openclip_siglip")


def test_a_tokenizer_that_is_not_one_is_refused(open_clip_hub):
    root, _ = open_clip_hub
    served = publish_open_clip(root, "tiny_openclip_siglip")
    (served / "tokenizer.json").write_text(json.dumps(["not", "a", "tokenizer"]))
    with pytest.raises(catalogue.DownloadError, match=r"^the downloaded tiny_openclip_siglip tokenizer\.json is not a tokenizer's tokenizer\.json$"):
        catalogue.download("tiny_openclip_siglip")
    assert nothing_kept("tiny_openclip_siglip")


def test_the_apps_download_shows_one_bar_over_every_file(open_clip_hub, monkeypatch):
    from vit_explorer.app import models

    root, _ = open_clip_hub
    publish_open_clip(root, "tiny_openclip_siglip")
    bars = []

    class Bar:
        def __init__(self, value, text):
            self.values = [value]
            bars.append(self)

        def progress(self, value, text):
            self.values.append(value)

        def empty(self):
            self.values.append("emptied")

    monkeypatch.setattr(models.st, "progress", lambda value, text: Bar(value, text))
    models.download_with_progress("tiny_openclip_siglip")
    (bar,) = bars
    values = bar.values[:-1]
    assert values == sorted(values) and values[-1] == 1.0 and bar.values[-1] == "emptied"
    assert catalogue.is_downloaded("tiny_openclip_siglip")


# ----------------------------------------------------------------------------- hostile mirrors

GUARD_SECONDS = 20  # a mirror below gives up by itself after this: a missing deadline fails, never hangs


@pytest.fixture(params=["tiny_clip", "vit_b_16"], ids=["hub", "torchvision"])
def mirror(request, tmp_path, monkeypatch):
    """A raw TCP server on loopback that reads a request and answers ``answer(connection)``
    (which the test sets), standing in for both kinds of mirror; downloads of the test's entry
    (a Hub file or torchvision's) go to it, expected to be 1000 bytes long, with a 1 s deadline."""
    name = request.param
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.1)
    address = f"http://127.0.0.1:{listener.getsockname()[1]}"
    monkeypatch.setenv(catalogue.HUB_URL_VARIABLE, address)
    monkeypatch.setenv(catalogue.TORCHVISION_URL_VARIABLE, address)
    monkeypatch.setenv(catalogue.CACHE_VARIABLE, str(tmp_path / "cache"))
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    monkeypatch.setenv(catalogue.TIMEOUT_VARIABLE, "1")
    for layout, (_, entry) in LAYOUTS.items():
        monkeypatch.setitem(catalogue.CATALOGUE, layout, entry)
    monkeypatch.setitem(catalogue.CATALOGUE, name, dataclasses.replace(catalogue.CATALOGUE[name], size_bytes=1000))
    closing = threading.Event()
    answers = []

    def handle(connection: socket.socket) -> None:
        with connection:
            connection.settimeout(GUARD_SECONDS)
            request_bytes = b""
            try:
                while b"\r\n\r\n" not in request_bytes and (data := connection.recv(4096)):
                    request_bytes += data
                answers[-1](connection)
            except OSError:
                pass  # the client hung up: what a download that gives up does

    def serve() -> None:
        while not closing.is_set():
            try:
                connection, _ = listener.accept()
            except TimeoutError:
                continue
            threading.Thread(target=handle, args=(connection,), daemon=True).start()

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    yield name, answers.append
    closing.set()
    server.join()
    listener.close()


def _drip(connection: socket.socket, data: bytes) -> None:
    """Send one byte every 50 ms (a mirror that is alive but hopeless), for at most GUARD_SECONDS."""
    ends = time.monotonic() + GUARD_SECONDS
    for byte in data:
        if time.monotonic() > ends:
            return
        connection.sendall(bytes([byte]))
        time.sleep(0.05)


def _drip_body(connection):
    connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n")
    _drip(connection, b"x" * 1000)


def _drip_headers(connection):
    _drip(connection, b"HTTP/1.1 200 OK\r\nX-Slow: " + b"z" * 1000)


def _silent(connection):
    """Read the request (or a TLS ClientHello) and never answer."""
    time.sleep(GUARD_SECONDS)


def _endless(connection):
    """No length, bytes until the client hangs up (at most 64 MiB)."""
    connection.sendall(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n")
    for _ in range(1024):
        connection.sendall(b"x" * 65536)


def _announced_too_large(connection):
    connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1000000000000\r\n\r\n" + b"x" * 65536)


def _cut_chunk(connection):
    connection.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3e8\r\n" + b"x" * 100)


def _not_http(connection):
    connection.sendall(b"SSH-2.0-OpenSSH_9.6\r\n")


def _long_header(connection):
    connection.sendall(b"HTTP/1.1 200 OK\r\nX-Long: " + b"a" * 100_000 + b"\r\n\r\n")


def _download_fails(name: str, seen: list | None = None) -> str:
    progress = None if seen is None else lambda done, total: seen.append(done)
    with pytest.raises(catalogue.DownloadError) as failed:
        catalogue.download(name, progress)
    message = str(failed.value)
    assert "\n" not in message and "Errno" not in message, message
    # Nothing is left behind, neither the file nor a temporary one.
    folder = catalogue.cached_path(name).parent
    assert not folder.exists() or list(folder.iterdir()) == []
    return message


@pytest.mark.parametrize("answer", [_drip_body, _drip_headers], ids=["body", "headers"])
def test_a_dripping_mirror_is_given_up_at_the_deadline(mirror, answer):
    name, answer_with = mirror
    answer_with(answer)
    message = _download_fails(name)
    assert message.startswith(f"could not download {catalogue.CATALOGUE[name].title} from http://127.0.0.1:")
    assert message.endswith(": it took longer than 1 s (VIT_EXPLORER_DOWNLOAD_TIMEOUT allows more)")


def test_a_silent_tls_mirror_is_given_up_at_the_deadline(mirror, monkeypatch):
    name, answer_with = mirror
    answer_with(_silent)
    for variable in (catalogue.HUB_URL_VARIABLE, catalogue.TORCHVISION_URL_VARIABLE):
        monkeypatch.setenv(variable, os.environ[variable].replace("http:", "https:"))
    assert _download_fails(name).endswith(": it took longer than 1 s (VIT_EXPLORER_DOWNLOAD_TIMEOUT allows more)")


def test_an_endless_stream_stops_at_the_expected_size(mirror):
    name, answer_with = mirror
    answer_with(_endless)
    seen = []
    message = _download_fails(name, seen)
    limit = catalogue.size_limit(1000)
    assert message.endswith(f": the server sent more than {limit} bytes for a file of about 1000")
    assert seen and max(seen) <= limit


def test_a_length_beyond_the_expected_size_is_refused_before_reading(mirror):
    name, answer_with = mirror
    answer_with(_announced_too_large)
    seen = []
    assert _download_fails(name, seen).endswith(": the server announced 1000000000000 bytes for a file of about 1000")
    assert seen == []


@pytest.mark.parametrize("answer, reason", [
    (_cut_chunk, "the connection was cut in the middle of the file"),
    (_not_http, "no HTTP status line"),
    (_long_header, "an over-long header line"),
], ids=["cut chunk", "not http", "long header"])
def test_a_broken_answer_is_one_sentence(mirror, answer, reason):
    name, answer_with = mirror
    answer_with(answer)
    assert _download_fails(name).endswith(f": the server's answer was broken ({reason})")


@pytest.mark.parametrize("host, reason", [
    ("closed port", "the connection was refused"),
    ("mirror.invalid", "its name could not be resolved"),  # RFC 6761: never resolves
])
def test_an_unreachable_mirror_says_so_and_names_the_setting(mirror, monkeypatch, host, reason):
    name, _ = mirror
    if host == "closed port":
        with socket.socket() as closed:
            closed.bind(("127.0.0.1", 0))
            host = f"127.0.0.1:{closed.getsockname()[1]}"
    for variable in (catalogue.HUB_URL_VARIABLE, catalogue.TORCHVISION_URL_VARIABLE):
        monkeypatch.setenv(variable, f"http://{host}")
    setting = catalogue.HUB_URL_VARIABLE if name == "tiny_clip" else catalogue.TORCHVISION_URL_VARIABLE
    message = _download_fails(name)
    assert message.startswith(f"could not download {catalogue.CATALOGUE[name].title} from http://{host}/")
    assert message.endswith(f" (no internet?): {reason}; {setting} can name a mirror")


def test_abandoned_temporary_files_are_removed_and_live_ones_kept(hub):
    root, _ = hub
    publish(root, "tiny_clip")
    folder = catalogue.cached_path("tiny_clip").parent
    folder.mkdir(parents=True)
    abandoned, live = folder / ".tiny_clip.safetensors.1.tmp", folder / ".tiny_clip.safetensors.2.tmp"
    abandoned.write_bytes(b"half")
    live.write_bytes(b"half")
    long_ago = time.time() - catalogue.DEFAULT_TIMEOUT_SECONDS - 3600
    os.utime(abandoned, (long_ago, long_ago))
    catalogue.download("tiny_clip")
    assert sorted(path.name for path in folder.iterdir()) == [live.name, "tiny_clip.safetensors"]


def test_a_bad_timeout_setting_is_one_sentence(hub, monkeypatch):
    monkeypatch.setenv(catalogue.TIMEOUT_VARIABLE, "soon")
    expected = "^VIT_EXPLORER_DOWNLOAD_TIMEOUT must be a number of seconds above 0, not 'soon'$"
    with pytest.raises(catalogue.DownloadError, match=expected):
        catalogue.download("tiny_clip")
