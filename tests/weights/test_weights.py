"""Checkpoints: round trips, parity with timm / torchvision / Hugging Face, refusals, resizing."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import vit_explorer as vx
from vit_explorer.model import vit as vm
from vit_explorer.weights import load_metadata, project
from vit_explorer.weights.resize import resize_patches

from helpers import randomize


@pytest.fixture(autouse=True)
def _no_grad():
    """These tests only compare outputs; a module-level switch would leak into other test files."""
    with torch.no_grad():
        yield


def _images(size: int = 32, batch: int = 2, channels: int = 3) -> torch.Tensor:
    return torch.randn(batch, channels, size, size, generator=torch.Generator().manual_seed(1))


def _tiny(**changes) -> vx.ViT:
    fields = dict(image_size=32, patch_size=8, num_classes=3, embed_dim=32, depth=2, num_heads=2)
    return randomize(vx.ViT(vx.ViTConfig(**{**fields, **changes})))


# ----------------------------------------------------------------------------- project files


def test_project_round_trip_is_identical(tmp_path):
    model = _tiny(class_names=("cat", "dog", "owl"), reg_tokens=1, init_values=0.1)
    path = tmp_path / "run.safetensors"
    vx.save_model(model, path, metadata={"epochs": "7", "accuracy": "0.91"})

    loaded = vx.load_model(path)
    assert loaded.config == model.config
    assert not loaded.training
    assert loaded.state_dict().keys() == model.state_dict().keys()
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    assert torch.equal(loaded(_images()), model(_images()))
    assert load_metadata(path) == {"epochs": "7", "accuracy": "0.91"}
    assert os.listdir(tmp_path) == ["run.safetensors"]  # no temporary file left behind
    plain = tmp_path / "plain.txt"
    plain.write_text("")
    assert path.stat().st_mode == plain.stat().st_mode  # ordinary permissions, not 0600


def test_save_is_atomic_when_writing_fails(tmp_path, monkeypatch):
    path = tmp_path / "run.safetensors"
    vx.save_model(_tiny(), path)
    before = path.read_bytes()

    def crash(*args, **kwargs):
        raise KeyboardInterrupt  # e.g. Ctrl-C after part of the file was written

    monkeypatch.setattr(project.os, "fsync", crash)
    with pytest.raises(KeyboardInterrupt):
        vx.save_model(_tiny(depth=1), path)
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["run.safetensors"]


def test_save_rejects_non_string_metadata(tmp_path):
    with pytest.raises(ValueError, match="strings to strings"):
        vx.save_model(_tiny(), tmp_path / "m.safetensors", metadata={"epochs": 3})


def test_overrides_and_resize_on_load(tmp_path):
    path = tmp_path / "run.safetensors"
    vx.save_model(_tiny(), path)
    larger = vx.load_model(path, image_size=64)
    assert larger.config.grid_size == (8, 8)
    assert larger(_images(64)).shape == (2, 3)
    assert vx.load_model(path, patch_size=4).config.grid_size == (8, 8)
    with pytest.raises(vx.CheckpointError, match="unknown ViTConfig field.*nonsense"):
        vx.load_model(path, nonsense=1)
    with pytest.raises(ValueError, match="not divisible by num_heads"):
        vx.load_model(path, num_heads=5)


# ----------------------------------------------------------------------------- torchvision


def _torchvision_vit(**changes):
    from torchvision.models.vision_transformer import VisionTransformer

    fields = dict(
        image_size=32,
        patch_size=8,
        num_layers=2,
        num_heads=2,
        hidden_dim=64,
        mlp_dim=128,
        num_classes=5,
    )
    return randomize(VisionTransformer(**{**fields, **changes}))


@pytest.mark.parametrize("wrap", [None, "model"])
def test_torchvision_parity(tmp_path, wrap):
    reference = _torchvision_vit()
    state = reference.state_dict()
    path = tmp_path / "checkpoint.pth"
    torch.save({wrap: state} if wrap else state, path)

    model = vx.load_model(path, num_heads=2)
    assert model.config.mean == vx.model.config.IMAGENET_MEAN
    assert model.config.layer_norm_eps == 1e-6
    x = _images()
    torch.testing.assert_close(model(x), reference(x), atol=1e-5, rtol=1e-5)


def test_torchvision_legacy_mlp_names(tmp_path):
    reference = _torchvision_vit()
    state = {
        key.replace("mlp.0.", "mlp.linear_1.").replace("mlp.3.", "mlp.linear_2."): value
        for key, value in reference.state_dict().items()
    }
    torch.save(state, tmp_path / "old.pth")
    x = _images()
    torch.testing.assert_close(
        vx.load_model(tmp_path / "old.pth", num_heads=2)(x), reference(x), atol=1e-5, rtol=1e-5
    )


def test_torchvision_pre_logits_is_refused(tmp_path):
    torch.save(_torchvision_vit(representation_size=16).state_dict(), tmp_path / "pre.pth")
    with pytest.raises(vx.CheckpointError, match="pre-logits"):
        vx.load_model(tmp_path / "pre.pth")


@pytest.fixture
def torchvision_mirror(tmp_path, monkeypatch):
    """A mirror of download.pytorch.org/models on 127.0.0.1 serving tmp_path/mirror, and torch.hub's
    cache (where torchvision looks for its weights) in tmp_path/torch."""
    import functools
    import http.server
    import threading

    root = tmp_path / "mirror"
    root.mkdir()
    handler = type("Quiet", (http.server.SimpleHTTPRequestHandler,), {"log_message": lambda *args: None})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(handler, directory=str(root)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    address = f"http://127.0.0.1:{server.server_address[1]}"
    monkeypatch.setenv("VIT_EXPLORER_TORCHVISION_URL", address)
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    yield root, address, server
    server.shutdown()
    server.server_close()


def _narrow_imagenet_vit():
    """A narrow stand-in for torchvision's ImageNet ViT-B/16: same input, patch and head, one layer."""
    return _torchvision_vit(image_size=224, patch_size=16, num_layers=1, hidden_dim=64, num_heads=1, num_classes=1000)


def test_load_pretrained_downloads_and_converts_torchvision_weights(torchvision_mirror, monkeypatch):
    import hashlib

    from vit_explorer.weights import catalogue

    root, address, server = torchvision_mirror
    fake = _narrow_imagenet_vit()
    torch.save(fake.state_dict(), root / "weights.pth")
    # torch.hub names a file after its hash: serve it under the name its content has.
    name = f"vit_b_16-{hashlib.sha256((root / 'weights.pth').read_bytes()).hexdigest()[:8]}.pth"
    (root / "weights.pth").rename(root / name)
    monkeypatch.setattr(catalogue, "torchvision_url", lambda model: f"{address}/{name}")
    assert not catalogue.is_downloaded("vit_b_16")
    seen = []
    model = vx.load_pretrained("vit_b_16", progress=lambda done, total: seen.append((done, total)))
    size = (root / name).stat().st_size
    assert seen[-1] == (size, size)
    assert model.config.img_size == (224, 224) and model.config.patch_size == 16
    assert model.config.class_names[:2] == ("tench", "goldfish")
    assert model.config.mean == vx.model.config.IMAGENET_MEAN
    x = torch.randn(1, 3, 224, 224)
    torch.testing.assert_close(model(x), fake(x), atol=1e-5, rtol=1e-5)
    # Where torchvision's own loader looks, and nothing else beside it.
    cached = catalogue.torchvision_path("vit_b_16")
    assert cached.parent == Path(os.environ["TORCH_HOME"]) / "hub" / "checkpoints"
    assert [path.name for path in cached.parent.iterdir()] == [name]
    server.shutdown()  # cached: no server needed any more
    assert catalogue.is_downloaded("vit_b_16")
    assert vx.load_pretrained("vit_b_16").config == model.config


def test_a_torchvision_file_with_the_wrong_checksum_is_refused_and_not_kept(torchvision_mirror):
    from vit_explorer.weights import catalogue

    root, _, _ = torchvision_mirror
    torch.save(_narrow_imagenet_vit().state_dict(), root / "vit_b_16-c867db91.pth")  # the real name
    with pytest.raises(vx.CheckpointError, match=r"^the downloaded file does not match its checksum \(c867db91"):
        vx.load_pretrained("vit_b_16")
    assert not catalogue.is_downloaded("vit_b_16")
    assert not list(catalogue.torchvision_path("vit_b_16").parent.iterdir())


def test_load_pretrained_offline_is_a_clear_error(torchvision_mirror):
    _, address, server = torchvision_mirror
    server.shutdown()
    server.server_close()  # nothing listens on the port any more: as good as offline
    with pytest.raises(vx.CheckpointError) as refused:
        vx.load_pretrained()
    message = str(refused.value)
    assert message.startswith(f"could not download ImageNet ViT-B/16 (torchvision) from {address}/vit_b_16-c867db91.pth")
    assert "(no internet?)" in message and "\n" not in message
    with pytest.raises(vx.CheckpointError, match="unknown pretrained model"):
        vx.load_pretrained("resnet50")


# ----------------------------------------------------------------------------- timm

TIMM_VARIANTS = {
    "class token": {},
    "mean pool, no class token": dict(class_token=False, global_pool="avg"),
    "registers, no_embed_class": dict(reg_tokens=2, no_embed_class=True),
    "registers with position embedding": dict(reg_tokens=3),
    "layer scale": dict(init_values=1e-5),
    "class token + fc_norm mean pool": dict(global_pool="avg"),
    "no qkv bias, mlp ratio 3": dict(qkv_bias=False, mlp_ratio=3.0),
    "headless": dict(num_classes=0),
}


@pytest.mark.parametrize("suffix", [".safetensors", ".pth"])
@pytest.mark.parametrize("variant", list(TIMM_VARIANTS))
def test_timm_parity(tmp_path, variant, suffix):
    from timm.models.vision_transformer import VisionTransformer

    fields = dict(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=2, num_classes=5)
    reference = randomize(VisionTransformer(**{**fields, **TIMM_VARIANTS[variant]}))
    path = tmp_path / f"timm{suffix}"
    if suffix == ".safetensors":
        save_file({key: value.contiguous() for key, value in reference.state_dict().items()}, path)
    else:
        torch.save({"state_dict": reference.state_dict(), "epoch": 3}, path)

    model = vx.load_model(path, num_heads=2)
    assert model.config.num_prefix_tokens == reference.num_prefix_tokens
    # LayerScale with a class token is DINOv2's or DeiT III's (ImageNet's); the rest, timm's default.
    layer_scale = "init_values" in TIMM_VARIANTS[variant]
    assert model.config.mean == (vx.model.config.IMAGENET_MEAN if layer_scale else (0.5, 0.5, 0.5))
    x = _images()
    torch.testing.assert_close(
        model.forward_features(x), reference.forward_features(x), atol=1e-5, rtol=1e-5
    )
    torch.testing.assert_close(model(x), reference(x), atol=1e-5, rtol=1e-5)


def test_timm_non_square_grid_needs_image_size(tmp_path):
    from timm.models.vision_transformer import VisionTransformer

    reference = randomize(
        VisionTransformer(img_size=(16, 24), patch_size=8, embed_dim=64, depth=1, num_heads=1)
    )
    torch.save(reference.state_dict(), tmp_path / "wide.pth")
    with pytest.raises(vx.CheckpointError, match=r"pass image_size=\(height, width\)"):
        vx.load_model(tmp_path / "wide.pth")
    model = vx.load_model(tmp_path / "wide.pth", image_size=(16, 24))
    x = torch.randn(1, 3, 16, 24)
    torch.testing.assert_close(model(x), reference(x), atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- Hugging Face


def _hf_config(**changes):
    from transformers import ViTConfig as HFViTConfig

    fields = dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=128,
        image_size=32,
        patch_size=8,
        num_labels=3,
        id2label={0: "ant", 1: "bee", 2: "cow"},
        label2id={"ant": 0, "bee": 1, "cow": 2},
    )
    return HFViTConfig(**{**fields, **changes})


@pytest.mark.parametrize("layout", ["save_pretrained", "pytorch_model.bin", "state_dict.pth"])
def test_huggingface_classifier_parity(tmp_path, layout):
    from safetensors.torch import load_file
    from transformers import ViTForImageClassification

    reference = randomize(ViTForImageClassification(_hf_config()))
    reference.save_pretrained(tmp_path)
    if layout == "pytorch_model.bin":  # the older Hub format, same names as the safetensors file
        torch.save(load_file(tmp_path / "model.safetensors"), tmp_path / layout)
        (tmp_path / "model.safetensors").unlink()
    elif layout == "state_dict.pth":  # the module's own names (q/k/v_proj since transformers 5)
        torch.save(reference.state_dict(), tmp_path / layout)

    # Heads, eps, sizes and labels come from config.json.
    model = vx.load_model(tmp_path if layout == "save_pretrained" else tmp_path / layout)
    assert model.config.num_heads == 2
    assert model.config.layer_norm_eps == 1e-12
    assert model.config.class_names == ("ant", "bee", "cow")
    assert model.config.mean == (0.5, 0.5, 0.5)  # ViT's processor default, not in config.json
    x = _images()
    torch.testing.assert_close(model(x), reference(pixel_values=x).logits, atol=1e-5, rtol=1e-5)
    if layout != "state_dict.pth":
        torch.testing.assert_close(vx.load_model(tmp_path)(x), model(x))


def test_huggingface_backbone_parity(tmp_path):
    from transformers import ViTModel

    reference = randomize(
        ViTModel(_hf_config(num_labels=2, id2label=None, label2id=None, qkv_bias=False))
    )
    reference.save_pretrained(tmp_path)
    preprocessor = {"image_mean": [0.485, 0.456, 0.406], "image_std": [0.229, 0.224, 0.225]}
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(preprocessor))

    model = vx.load_model(tmp_path)
    assert model.config.num_classes == 0
    assert (
        model.config.mean == vx.model.config.IMAGENET_MEAN and model.config.std == vx.model.config.IMAGENET_STD
    )
    x = _images()
    expected = reference(pixel_values=x).last_hidden_state
    torch.testing.assert_close(model.forward_features(x), expected, atol=1e-5, rtol=1e-5)


def test_huggingface_file_without_config_is_refused(tmp_path):
    from transformers import ViTModel

    ViTModel(_hf_config()).save_pretrained(tmp_path)
    (tmp_path / "config.json").unlink()
    with pytest.raises(vx.CheckpointError, match="model.safetensors has no Hugging Face config"):
        vx.load_model(tmp_path / "model.safetensors")
    with pytest.raises(vx.CheckpointError, match="is a folder but not a Hugging Face model"):
        vx.load_model(tmp_path)


# ----------------------------------------------------------------------------- bad files


class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("writer", ["torch.save", "pickle.dump"])
def test_pickle_with_code_is_refused_and_not_run(tmp_path, writer):
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pth"
    payload = {"state_dict": _tiny().state_dict(), "trap": _RunsCode(marker)}
    if writer == "torch.save":
        torch.save(payload, path)
    else:
        path.write_bytes(pickle.dumps(_RunsCode(marker), protocol=2))
    with pytest.raises(vx.CheckpointError, match=r"refused: it contains code .*\.system\)"):
        vx.load_model(path)
    assert not marker.exists()


def test_unreadable_files_are_clear_errors(tmp_path):
    good = tmp_path / "good.pth"
    torch.save(_tiny().state_dict(), good)
    truncated = tmp_path / "checkpoint.pth"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(
        vx.CheckpointError, match="checkpoint.pth is truncated or not a PyTorch/safetensors file"
    ):
        vx.load_model(truncated)

    safetensors_file = tmp_path / "cut.safetensors"
    vx.save_model(_tiny(), safetensors_file)
    safetensors_file.write_bytes(safetensors_file.read_bytes()[:-100])
    with pytest.raises(vx.CheckpointError, match="cut.safetensors is truncated"):
        vx.load_model(safetensors_file)

    (tmp_path / "empty.pth").write_bytes(b"")
    with pytest.raises(vx.CheckpointError, match="empty.pth is empty"):
        vx.load_model(tmp_path / "empty.pth")
    (tmp_path / "notes.pth").write_text("these are not weights")
    with pytest.raises(vx.CheckpointError, match="looks like a text file"):
        vx.load_model(tmp_path / "notes.pth")
    (tmp_path / "photo.pth").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(64))
    with pytest.raises(vx.CheckpointError, match="looks like a PNG image"):
        vx.load_model(tmp_path / "photo.pth")
    with pytest.raises(vx.CheckpointError, match="does not exist"):
        vx.load_model(tmp_path / "missing.safetensors")


def test_a_compressed_archive_of_honest_size_loads(tmp_path):
    """The zip-bomb bound leaves room for an archive some tool saved deflated (torch reads it)."""
    import zipfile

    model = _tiny()
    torch.save(model.state_dict(), tmp_path / "stored.pth")
    with zipfile.ZipFile(tmp_path / "stored.pth") as source, zipfile.ZipFile(
        tmp_path / "deflated.pth", "w", zipfile.ZIP_DEFLATED
    ) as target:
        for info in source.infolist():
            target.writestr(info.filename, source.read(info.filename))
    assert (tmp_path / "deflated.pth").stat().st_size < (tmp_path / "stored.pth").stat().st_size
    loaded = vx.load_model(tmp_path / "deflated.pth", num_heads=2)
    assert torch.equal(loaded(_images()), model(_images()))


def test_a_file_in_the_pre_1_6_format_is_refused_with_what_to_do(tmp_path):
    torch.save(_tiny().state_dict(), tmp_path / "old.pth", _use_new_zipfile_serialization=False)
    with pytest.raises(vx.CheckpointError, match="old.pth is a Python pickle.*save it again with a current torch.save"):
        vx.load_model(tmp_path / "old.pth")


def test_state_dict_that_is_not_a_vit_is_refused(tmp_path):
    import torchvision

    torch.save(torchvision.models.resnet18(num_classes=2).state_dict(), tmp_path / "resnet.pth")
    with pytest.raises(vx.CheckpointError, match="resnet.pth is not a ViT checkpoint"):
        vx.load_model(tmp_path / "resnet.pth")

    state = _tiny().state_dict()
    state["blocks.0.attn.q_norm.weight"] = torch.ones(16)  # a timm feature our ViT lacks
    torch.save(state, tmp_path / "qknorm.pth")
    with pytest.raises(
        vx.CheckpointError, match="parameters our ViT does not have: blocks.0.attn.q_norm"
    ):
        vx.load_model(tmp_path / "qknorm.pth", num_heads=2)


# ----------------------------------------------------------------------------- resizing


def test_pi_resize_preserves_patch_embeddings_of_upsampled_input():
    model = _tiny(image_size=16, patch_size=4)
    resized = vx.resize_model(model, patch_size=8, image_size=32)  # same 4x4 grid, bigger patches
    x = _images(16)
    upsampled = resize_patches(x, 4, 8)
    torch.testing.assert_close(
        resized.patch_embed(upsampled), model.patch_embed(x), atol=1e-5, rtol=1e-5
    )
    # The grid is unchanged, so the whole network agrees too.
    torch.testing.assert_close(resized(upsampled), model(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("new_patch", [6, 12, 3])
def test_pi_resize_matches_timm_reference(new_patch):
    from timm.layers import resample_patch_embed

    kernel = torch.randn(8, 3, 8, 8, generator=torch.Generator().manual_seed(2))
    expected = resample_patch_embed(
        kernel, [new_patch, new_patch], interpolation="bilinear", antialias=True
    )
    torch.testing.assert_close(
        vm.resample_patch_embed(kernel, new_patch), expected, atol=1e-4, rtol=1e-4
    )


def test_pos_embed_resample_keeps_prefix_and_matches_timm():
    from timm.layers import resample_abs_pos_embed

    pos_embed = torch.randn(1, 2 + 16, 8, generator=torch.Generator().manual_seed(3))
    resampled = vm.resample_pos_embed(pos_embed, (4, 4), (6, 3), num_prefix_tokens=2)
    assert resampled.shape == (1, 2 + 18, 8)
    assert torch.equal(resampled[:, :2], pos_embed[:, :2])
    expected = resample_abs_pos_embed(pos_embed, [6, 3], [4, 4], num_prefix_tokens=2)
    torch.testing.assert_close(resampled, expected)
    assert vm.resample_pos_embed(pos_embed, (4, 4), (4, 4), 2) is pos_embed


def test_resize_model_leaves_the_original_untouched():
    model = _tiny(reg_tokens=1, no_embed_class=True)
    before = {key: value.clone() for key, value in model.state_dict().items()}
    resized = vx.resize_model(model, image_size=48)
    assert resized is not model and resized.config.grid_size == (6, 6)
    assert resized.pos_embed.shape == (1, 36, 32)  # no_embed_class: patches only
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key
    same = vx.resize_model(model)
    assert torch.equal(same(_images()), model(_images()))
    with pytest.raises(ValueError, match="not divisible by patch size"):
        vx.resize_model(model, patch_size=5)


def test_resize_model_can_share_the_weights_it_does_not_resample():
    model = _tiny()
    copied = vx.resize_model(model, patch_size=4, image_size=48)
    shared = vx.resize_model(model, patch_size=4, image_size=48, share_weights=True)
    with torch.no_grad():
        torch.testing.assert_close(shared(_images(48)), copied(_images(48)))
    assert shared.blocks[0].attn.qkv.weight.data_ptr() == model.blocks[0].attn.qkv.weight.data_ptr()
    assert copied.blocks[0].attn.qkv.weight.data_ptr() != model.blocks[0].attn.qkv.weight.data_ptr()
    assert shared.pos_embed.shape != model.pos_embed.shape
    assert shared.patch_embed.proj.weight.shape[-1] == 4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_resize_model_on_the_gpu_matches_the_cpu():
    on_cpu = vx.resize_model(_tiny(), patch_size=4, image_size=48)
    on_gpu = vx.resize_model(_tiny().cuda(), patch_size=4, image_size=48)
    assert on_gpu.pos_embed.device.type == "cuda"
    for key, value in on_cpu.state_dict().items():
        torch.testing.assert_close(on_gpu.state_dict()[key].cpu(), value, atol=1e-5, rtol=1e-5)
