"""Hostile checkpoints: the class server loads what careless or hostile students upload.

The corpus is generated here (nothing is shipped) and loaded with vx.load_model in one child
process whose address space is capped at its size after the imports plus 1 GB. Every case must
end in one CheckpointError sentence, grow the process by well under 1 GB, open nothing outside
its upload's folder and run no pickle code.
"""
from __future__ import annotations

import collections
import io
import json
import math
import os
import pickle
import re
import struct
import zlib
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import vit_explorer as vx
from vit_explorer.weights import CONFIG_KEY

from helpers import randomize
from hostile import GROWTH_LIMIT_KB, run_capped


# The child's own part: each case loaded with vx.load_model (tests/hostile.py caps and records it).
CHILD = r"""
import vit_explorer as vx
from vit_explorer.weights.footprint import model_footprint

cap()
for name, path in json.load(open(sys.argv[1])):
    # Its memory first, as the app's admission sizes it before the loader runs.
    sized = outcome(lambda path: {"sized": model_footprint(path) is not None}, vx.CheckpointError, path)
    print(json.dumps({"name": f"footprint: {name}", **sized}), flush=True)
    print(json.dumps({"name": name, **outcome(vx.load_model, vx.CheckpointError, path)}), flush=True)
"""

# ----------------------------------------------------------------------------- building blocks

D, HEADS, PATCH, IMAGE, LAYERS = 16, 2, 8, 16, 2


def _tiny_model() -> vx.ViT:
    fields = dict(image_size=IMAGE, patch_size=PATCH, num_classes=3, embed_dim=D, depth=LAYERS, num_heads=HEADS)
    return randomize(vx.ViT(vx.ViTConfig(**fields)))


def _tiny_state() -> dict[str, torch.Tensor]:
    return {key: value.contiguous() for key, value in _tiny_model().state_dict().items()}


def _project_file(path: Path, **config_changes) -> Path:
    """Our own checkpoint format, its metadata config edited (what a hostile file can claim)."""
    model = _tiny_model()
    config = {**model.config.to_dict(), **config_changes}
    save_file(_tiny_state(), path, metadata={"format": "pt", CONFIG_KEY: json.dumps(config)})
    return path


def _hf_tensors() -> dict[str, torch.Tensor]:
    """A two-layer Hugging Face ViTModel's tensors, named as transformers saves them."""
    generator = torch.Generator().manual_seed(0)
    shapes = {
        "embeddings.cls_token": (1, 1, D),
        "embeddings.position_embeddings": (1, 1 + (IMAGE // PATCH) ** 2, D),
        "embeddings.patch_embeddings.projection.weight": (D, 3, PATCH, PATCH),
        "embeddings.patch_embeddings.projection.bias": (D,),
        "layernorm.weight": (D,),
        "layernorm.bias": (D,),
    }
    linears = {
        "attention.attention.query": (D, D), "attention.attention.key": (D, D),
        "attention.attention.value": (D, D), "attention.output.dense": (D, D),
        "intermediate.dense": (4 * D, D), "output.dense": (D, 4 * D),
    }
    for layer in range(LAYERS):
        prefix = f"encoder.layer.{layer}."
        for part, shape in linears.items():
            shapes[f"{prefix}{part}.weight"], shapes[f"{prefix}{part}.bias"] = shape, shape[:1]
        for norm in ("layernorm_before", "layernorm_after"):
            shapes[f"{prefix}{norm}.weight"], shapes[f"{prefix}{norm}.bias"] = (D,), (D,)
    return {key: torch.randn(shape, generator=generator) for key, shape in shapes.items()}


HF_CONFIG = {
    "model_type": "vit", "hidden_size": D, "num_attention_heads": HEADS, "image_size": IMAGE,
    "patch_size": PATCH,
}


def _dinov3_tensors(registers: int = 4) -> dict[str, torch.Tensor]:
    """A two-layer timm DINOv3 (Eva) state dict: registers, LayerScale, no position embedding."""
    state = {key: value for key, value in _tiny_state().items() if key != "pos_embed"}
    state["reg_token"] = torch.zeros(1, registers, D)
    for layer in range(LAYERS):
        state[f"blocks.{layer}.gamma_1"], state[f"blocks.{layer}.gamma_2"] = torch.ones(D), torch.ones(D)
    return state


def _hf_dinov3_tensors() -> dict[str, torch.Tensor]:
    """A two-layer Hugging Face DINOv3ViTModel's tensors, named as transformers saves them."""
    renames = {"cls_token": "embeddings.cls_token", "reg_token": "embeddings.register_tokens",
               "patch_embed.proj.weight": "embeddings.patch_embeddings.weight",
               "patch_embed.proj.bias": "embeddings.patch_embeddings.bias", "norm.weight": "norm.weight",
               "norm.bias": "norm.bias"}
    state = {renames[key]: value for key, value in _dinov3_tensors().items() if key in renames}
    for layer in range(LAYERS):
        prefix = f"layer.{layer}."
        for part, shape in (("attention.q_proj", (D, D)), ("attention.k_proj", (D, D)), ("attention.v_proj", (D, D)),
                            ("attention.o_proj", (D, D)), ("mlp.up_proj", (4 * D, D)), ("mlp.down_proj", (D, 4 * D))):
            state[f"{prefix}{part}.weight"] = torch.zeros(shape)
        for norm in ("norm1", "norm2"):
            state[f"{prefix}{norm}.weight"], state[f"{prefix}{norm}.bias"] = torch.ones(D), torch.zeros(D)
        state[f"{prefix}layer_scale1.lambda1"], state[f"{prefix}layer_scale2.lambda1"] = torch.ones(D), torch.ones(D)
    return state


HF_DINOV3_CONFIG = {
    "model_type": "dinov3_vit", "hidden_size": D, "num_attention_heads": HEADS, "num_hidden_layers": LAYERS,
    "intermediate_size": 4 * D, "num_register_tokens": 4, "patch_size": PATCH, "image_size": IMAGE,
    "query_bias": False, "value_bias": False,
}


def _hf_dinov3_folder(folder: Path, **claims) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({**HF_DINOV3_CONFIG, **claims}))
    save_file(_hf_dinov3_tensors(), folder / "model.safetensors")
    return folder


def _hf_folder(folder: Path, config=HF_CONFIG, config_text: str | None = None, weights=True) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config) if config_text is None else config_text)
    if weights:
        save_file(_hf_tensors(), folder / "model.safetensors")
    return folder


def _sharded_folder(folder: Path, shard: str) -> Path:
    """A Hugging Face folder whose shard index names ``shard`` for every tensor."""
    _hf_folder(folder, weights=False)
    weight_map = {key: shard for key in _hf_tensors()}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return folder


class _Storage:
    def __init__(self, key: str, numel: int, storage_type=torch.FloatStorage):
        self.key, self.numel, self.storage_type = key, numel, storage_type


class _Tensor:
    """Pickles as torch.save writes a tensor: any size and stride over a declared storage."""

    def __init__(self, storage: _Storage, size, stride):
        self.storage, self.size, self.stride = storage, tuple(size), tuple(stride)

    def __reduce__(self):
        arguments = (self.storage, 0, self.size, self.stride, False, collections.OrderedDict())
        return (torch._utils._rebuild_tensor_v2, arguments)


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj):
        if isinstance(obj, _Storage):
            return ("storage", obj.storage_type, obj.key, "cpu", obj.numel)
        return None


class _RunsCode:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _pickled(obj) -> bytes:
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=2).dump(obj)
    return buffer.getvalue()


def _zip(path: Path, members: list[tuple[str, bytes, int, int]]) -> Path:
    """A zip written by hand, so a member can be stored pre-deflated: (name, data, method, size)."""
    local, central = io.BytesIO(), io.BytesIO()
    for name, data, method, size in members:
        encoded = name.encode()
        # The CRC is left 0: it is only checked after inflating, which is what must not happen.
        fields = (20, 0, method, 0, 0, 0, len(data), size, len(encoded), 0)
        central.write(
            struct.pack("<IH", 0x02014B50, 20) + struct.pack("<HHHHHIIIHH", *fields)
            + struct.pack("<HHHII", 0, 0, 0, 0, local.tell()) + encoded
        )
        local.write(struct.pack("<I", 0x04034B50) + struct.pack("<HHHHHIIIHH", *fields) + encoded + data)
    count = len(members)
    end = struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, count, count, central.tell(), local.tell(), 0)
    path.write_bytes(local.getvalue() + central.getvalue() + end)
    return path


def _deflated_zeros(size: int) -> bytes:
    """A raw deflate stream of ``size`` zero bytes, in a few milliseconds: after a full flush the
    compressor starts afresh, so every MiB of zeros compresses to the same bytes."""
    chunk = 2**20
    compressor = zlib.compressobj(9, zlib.DEFLATED, -15)
    piece = compressor.compress(bytes(chunk)) + compressor.flush(zlib.Z_FULL_FLUSH)
    return piece * (size // chunk) + zlib.compressobj(9, zlib.DEFLATED, -15).flush()


def _torch_zip(path: Path, tensors: dict, records: dict[str, tuple[bytes, int, int]]) -> Path:
    """A torch.save-style archive: data.pkl for ``tensors``, records key -> (data, method, size)."""
    pickled = _pickled(tensors)
    members = [("archive/data.pkl", pickled, 0, len(pickled))]
    members += [(f"archive/data/{key}", *record) for key, record in records.items()]
    members += [("archive/byteorder", b"little", 0, 6), ("archive/version", b"3\n", 0, 2)]
    return _zip(path, members)


def _handmade_state() -> tuple[dict, dict]:
    """The tiny model's state as (_Tensor views, records) for _torch_zip: one storage each."""
    views, records = {}, {}
    for index, (key, value) in enumerate(_tiny_state().items()):
        views[key] = _Tensor(_Storage(str(index), value.numel()), value.shape, value.stride())
        records[str(index)] = (value.numpy().tobytes(), 0, value.numel() * 4)
    return views, records


def _zip_bomb(path: Path, declared: int) -> Path:
    data = _deflated_zeros(declared)
    tensor = _Tensor(_Storage("0", declared // 4), (declared // 4,), (1,))
    return _torch_zip(path, {"w": tensor}, {"0": (data, zlib.DEFLATED, declared)})


def _legacy_file(path: Path, obj) -> Path:
    """torch.save's format before PyTorch 1.6: pickles one after another, no zip."""
    buffer = io.BytesIO()
    pickle.dump(0x1950A86A20F9469CFC6C, buffer, protocol=2)  # torch's legacy magic number
    pickle.dump(1001, buffer, protocol=2)
    system = {"protocol_version": 1001, "little_endian": True, "type_sizes": {"short": 2, "int": 4, "long": 4}}
    pickle.dump(system, buffer, protocol=2)
    buffer.write(_pickled(obj))
    pickle.dump(["0"], buffer, protocol=2)
    path.write_bytes(buffer.getvalue())
    return path


# ----------------------------------------------------------------------------- the corpus

OUTSIDE_MESSAGE = "leads outside the model folder"
# Pairs that must be refused in the same words whether the target outside exists or not.
SAME_MESSAGE = [
    ("shard ../ to a real checkpoint", "shard ../ to nothing"),
    ("shard absolute path to a real checkpoint", "shard absolute path to nothing"),
    ("shard symlink to a real checkpoint", "shard symlink to nothing"),
    ("weights symlink to a real checkpoint", "weights symlink to nothing"),
]


def _corpus(root: Path) -> dict[str, tuple[Path, str]]:
    """case name -> (path to load, a regex its CheckpointError message must match)."""
    outside = root / "outside"
    outside.mkdir()
    secret = outside / "secret.safetensors"  # loads as the folder's weights if ever followed
    save_file(_hf_tensors(), secret)
    (outside / "config.json").write_text(json.dumps(HF_CONFIG))
    missing = outside / "missing.safetensors"
    cases: dict[str, tuple[Path, str]] = {}
    folders = root / "uploads"

    def case(name: str, expected: str) -> Path:
        folder = folders / name.replace(" ", "_").replace("/", "-")
        cases[name] = (folder, expected)
        return folder

    def single(name: str, expected: str, file_name: str) -> Path:
        folder = case(name, expected)
        folder.mkdir(parents=True)
        cases[name] = (folder / file_name, expected)
        return folder / file_name

    # Files outside the upload's folder.
    for target, label in ((secret, "a real checkpoint"), (missing, "nothing")):
        relative = f"../../outside/{target.name}"
        _sharded_folder(case(f"shard ../ to {label}", OUTSIDE_MESSAGE), relative)
        _sharded_folder(case(f"shard absolute path to {label}", OUTSIDE_MESSAGE), str(target))
        folder = _sharded_folder(case(f"shard symlink to {label}", OUTSIDE_MESSAGE), "shard.safetensors")
        (folder / "shard.safetensors").symlink_to(target)
        folder = _hf_folder(case(f"weights symlink to {label}", OUTSIDE_MESSAGE), weights=False)
        (folder / "model.safetensors").symlink_to(target)
    folder = _hf_folder(case("config.json symlink out", OUTSIDE_MESSAGE), config_text="")
    (folder / "config.json").unlink()
    (folder / "config.json").symlink_to(outside / "config.json")
    folder = _sharded_folder(case("shard that is a folder", "not a file in the folder"), "sub")
    (folder / "sub").mkdir()
    _hf_folder(case("index without weight_map", "has no weight_map"), weights=False)
    (cases["index without weight_map"][0] / "model.safetensors.index.json").write_text("{}")

    # Depth and size claims a small file cannot back.
    deep = single("metadata depth 10**9", "with depth 1000000000: its tensors have depth 2", "deep.safetensors")
    _project_file(deep, depth=10**9)
    deep = single("metadata depth 100000", "with depth 100000: its tensors have depth 2", "deep.safetensors")
    _project_file(deep, depth=100_000)
    wide = single("metadata embed_dim 10**9", "with embed_dim 1000000000: its tensors have embed_dim 16", "wide.safetensors")
    _project_file(wide, embed_dim=10**9, num_heads=1)
    _project_file(single("metadata mlp_ratio 1e300", "with mlp_ratio 1e[+]300: its tensors", "wide.safetensors"), mlp_ratio=1e300)
    wide = single("metadata num_classes 10**20", "with num_classes 100000000000000000000:", "wide.safetensors")
    _project_file(wide, num_classes=10**20)
    state = _tiny_state()
    state["blocks.999999999.attn.qkv.weight"] = state["blocks.0.attn.qkv.weight"].clone()
    torch.save(state, single("timm key blocks.999999999", "not numbered 0, 1, 2", "deep.pth"))
    save_file(state, single("timm key blocks.999999999 (safetensors)", "not numbered 0, 1, 2", "deep.safetensors"))
    for name, shape in (("patch kernel with 0 channels out", (0, 3, PATCH, PATCH)), ("patch kernel 0x0", (D, 3, 0, 0))):
        state = {**_tiny_state(), "patch_embed.proj.weight": torch.zeros(shape)}
        expected = re.escape(f"patch_embed.proj.weight has shape {shape}")
        save_file(state, single(name, expected, "zero.safetensors"))

    # DINOv3 (rotary positions, no pos_embed): claims of its config.json, registers, missing parts.
    _hf_dinov3_folder(case("dinov3 config.json 10**5 layers", "with depth 100000: its tensors have depth 2"),
                      num_hidden_layers=100_000)
    _hf_dinov3_folder(case("dinov3 config.json 10**9 registers", "with reg_tokens 1000000000: its tensors have reg_tokens 4"),
                      num_register_tokens=10**9)
    _hf_dinov3_folder(case("dinov3 config.json MLP width 10**9", "intermediate_size 1000000000 is not its tensors'"),
                      intermediate_size=10**9)
    save_file(_dinov3_tensors(registers=100_000), single("dinov3 100,000 registers", "has 100000 register tokens", "reg.safetensors"))
    state = _dinov3_tensors()
    del state["blocks.1.mlp.fc2.weight"]
    save_file(state, single("dinov3 missing tensors", r"missing parameters: blocks\.1\.mlp\.fc2\.weight", "part.safetensors"))
    state = {key.replace("reg_token", "storage_tokens"): value for key, value in _dinov3_tensors().items()}
    state["rope_embed.periods"] = torch.full((2,), 1e30)
    save_file(state, single("dinov3 periods of no temperature", "rotary periods are not those of a DINOv3", "meta.safetensors"))

    # Archives that unpack to far more than they hold.
    _zip_bomb(single("zip bomb declaring 2 GiB", "would unpack to 2,048 MB", "bomb.pth"), 2 * 2**30)
    _zip_bomb(single("zip bomb declaring 600 MiB", "would unpack to 600 MB", "bomb.pth"), 600 * 2**20)
    views, records = _handmade_state()
    # fp16 data viewed as a 100,000 x 100,000 tensor (stride 0): converting it to float32 copies 40 GB.
    records["bomb"] = (bytes(2), 0, 2)
    views["extra"] = _Tensor(_Storage("bomb", 1, torch.HalfStorage), (100_000, 100_000), (0, 0))
    _torch_zip(single("stride-0 view of one fp16 value", r"would hold 19,07\d MB of data", "view.pth"), views, records)
    legacy = single("legacy pickle declaring 2 GiB", "before version 1.6", "old.pth")
    _legacy_file(legacy, {"w": _Tensor(_Storage("0", 2**29), (2**29,), (1,))})

    # Pickles that would run code (creating a marker file).
    marker = root / "pwned"
    code = r"refused: it contains code .*system\)"
    torch.save({"state_dict": _tiny_state(), "trap": _RunsCode(marker)}, single("torch.save with code", code, "evil.pth"))
    single("raw pickle with code", code, "evil.pkl").write_bytes(pickle.dumps(_RunsCode(marker), protocol=4))
    _legacy_file(single("legacy pickle with code", "before version 1.6", "evil_old.pth"), {"trap": _RunsCode(marker)})

    # Qwen2.5-VL folders: settings claiming more than a picture can have, and no tower at all.
    qwen_vision = dict(depth=2, hidden_size=D, intermediate_size=2 * D, num_heads=HEADS, out_hidden_size=D, window_size=56,
                       fullatt_block_indexes=[1], patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
    qwen_cases = {
        "qwen window larger than the grid": ({"window_size": 28 * 10}, {}, "larger than the grid"),
        "qwen budget of 10**6 patches": ({}, {"max_pixels": 10**6 * 14 * 14}, "budgets of up to"),
        "qwen without vision weights": ({}, {}, "holds no vision tower"),
    }
    for name, (vision, pixels, expected) in qwen_cases.items():
        folder = case(name, expected)
        folder.mkdir(parents=True)
        (folder / "config.json").write_text(json.dumps({"model_type": "qwen2_5_vl", "vision_config": {**qwen_vision, **vision}}))
        (folder / "preprocessor_config.json").write_text(json.dumps({"min_pixels": 3136, "max_pixels": 50176, **pixels}))
        save_file({"model.language_model.embed_tokens.weight": torch.zeros(8, D)}, folder / "model.safetensors")

    # config.json values of the wrong type or shape.
    bad_configs = {
        "config a list": ("[1, 2]", "not a JSON object of settings"),
        "config null": ("null", "not a JSON object of settings"),
        "config a number": ("5", "not a JSON object of settings"),
        "image_mean 5": ({"image_mean": 5}, "image_mean must be a list of numbers"),
        "hidden_act a list": ({"hidden_act": ["gelu"]}, "hidden_act must be a name"),
        "num_attention_heads a list": ({"num_attention_heads": [2]}, "num_attention_heads must be a positive"),
        "num_attention_heads null": ({"num_attention_heads": None}, "num_attention_heads must be a positive"),
        "num_attention_heads 5": ({"num_attention_heads": 5}, "embed_dim 16 is not divisible by num_heads 5"),
        "layer_norm_eps a list": ({"layer_norm_eps": [1e-6]}, "layer_norm_eps must be a positive number"),
        "image_size 32.0": ({"image_size": 32.0}, "image_size must be a positive whole number"),
        "image_size NaN": ({"image_size": math.nan}, "image_size must be a positive whole number"),
        "image_size -32": ({"image_size": -32}, "image_size must be a positive whole number"),
        "image_std 0": ({"image_std": [0, 0, 0]}, "std must be positive"),
        "vision_config a string": ({"model_type": "clip", "vision_config": "big"}, "vision_config must be an object"),
        "id2label a list": ({"id2label": ["ant", "bee"]}, "id2label must be an object"),
        "id2label a string": ({"id2label": "ant"}, "id2label must be an object"),
        "config nested 100,000 deep": ("[" * 100_000 + "]" * 100_000, "config.json in .* is not valid JSON"),
    }
    for name, (config, expected) in bad_configs.items():
        if isinstance(config, str):
            _hf_folder(case(name, expected), config_text=config)
        else:
            _hf_folder(case(name, expected), config={**HF_CONFIG, **config})

    # Our own format with a config ViTConfig must refuse.
    invalid = {"depth": -1, "num_classes": -1, "image_size": -32, "in_chans": 0, "std": [0.5, 0.0, 0.5]}
    for field, value in invalid.items():
        expected = "std must be positive" if field == "std" else f"{field} must be a whole number of at least"
        _project_file(single(f"metadata {field} {value}", expected, "bad.safetensors"), **{field: value})
    return cases


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile")
    cases = _corpus(root)
    lines, stderr = run_capped(CHILD, [[name, str(path)] for name, (path, _) in cases.items()], root)
    return root, cases, {line["name"]: line for line in lines}, stderr


CASE_NAMES = [
    "shard ../ to a real checkpoint", "shard ../ to nothing", "shard absolute path to a real checkpoint",
    "shard absolute path to nothing", "shard symlink to a real checkpoint", "shard symlink to nothing",
    "weights symlink to a real checkpoint", "weights symlink to nothing", "config.json symlink out",
    "shard that is a folder", "index without weight_map",
    "metadata depth 10**9", "metadata depth 100000", "metadata embed_dim 10**9", "metadata mlp_ratio 1e300",
    "metadata num_classes 10**20",
    "timm key blocks.999999999",
    "timm key blocks.999999999 (safetensors)", "patch kernel with 0 channels out", "patch kernel 0x0",
    "zip bomb declaring 2 GiB", "zip bomb declaring 600 MiB", "stride-0 view of one fp16 value",
    "legacy pickle declaring 2 GiB", "torch.save with code", "raw pickle with code", "legacy pickle with code",
    "config a list", "config null", "config a number", "image_mean 5", "hidden_act a list",
    "num_attention_heads a list", "num_attention_heads null", "num_attention_heads 5", "layer_norm_eps a list",
    "image_size 32.0", "image_size NaN", "image_size -32", "image_std 0", "vision_config a string",
    "id2label a list", "id2label a string", "config nested 100,000 deep",
    "metadata depth -1", "metadata num_classes -1", "metadata image_size -32", "metadata in_chans 0",
    "metadata std [0.5, 0.0, 0.5]",
    "dinov3 config.json 10**5 layers", "dinov3 config.json 10**9 registers", "dinov3 config.json MLP width 10**9",
    "dinov3 100,000 registers", "dinov3 missing tensors", "dinov3 periods of no temperature",
    "qwen window larger than the grid", "qwen budget of 10**6 patches", "qwen without vision weights",
]


@pytest.mark.parametrize("name", CASE_NAMES)
def test_hostile_upload_is_refused_in_one_sentence_cheaply(outcomes, name):
    root, cases, results, stderr = outcomes
    assert name in results, f"the child died or hung before or during this case:\n{stderr}"
    result = results[name]
    folder = cases[name][0] if cases[name][0].is_dir() else cases[name][0].parent
    assert result["error"] is not None, "the hostile upload loaded as a model"
    assert result["expected_error"], f"{result['error']}: {result['message']}"
    message = result["message"]
    assert "\n" not in message and "Errno" not in message and "Traceback" not in message, message
    assert re.search(cases[name][1], message), message
    assert result["growth_kb"] < GROWTH_LIMIT_KB, f"the process grew by {result['growth_kb'] // 1024} MB"
    read_outside = [
        path for path in result["opened"]
        if Path(os.path.realpath(path)).is_relative_to(root)
        and not Path(os.path.realpath(path)).is_relative_to(os.path.realpath(folder))
    ]
    assert not read_outside, f"opened outside the upload's folder: {read_outside}"
    assert not (root / "pwned").exists(), "a pickle ran its code"


@pytest.mark.parametrize("name", CASE_NAMES)
def test_a_hostile_uploads_memory_is_sized_from_its_headers_or_refused_in_one_sentence(outcomes, name):
    """weights.footprint reads what the loader would read, headers only: sized (the loader refuses
    it then), left to the loader (None), or refused in the loader's own kind of sentence."""
    root, cases, results, stderr = outcomes
    result = results.get(f"footprint: {name}")
    assert result is not None, f"the child died or hung before or during this case:\n{stderr}"
    folder = cases[name][0] if cases[name][0].is_dir() else cases[name][0].parent
    assert result["error"] is None or result["expected_error"], f"{result['error']}: {result['message']}"
    assert result["error"] is None or "\n" not in result["message"] and str(root) not in result["message"]
    assert result["growth_kb"] < 64 * 1024, f"the process grew by {result['growth_kb'] // 1024} MB"
    read_outside = [
        path for path in result["opened"]
        if Path(os.path.realpath(path)).is_relative_to(root)
        and not Path(os.path.realpath(path)).is_relative_to(os.path.realpath(folder))
    ]
    assert not read_outside, f"opened outside the upload's folder: {read_outside}"


@pytest.mark.parametrize("existing, missing", SAME_MESSAGE)
def test_refusal_does_not_tell_whether_a_file_outside_exists(outcomes, existing, missing):
    _, cases, results, stderr = outcomes
    assert existing in results and missing in results, stderr
    # The same words, but for the name of the folder each was uploaded as.
    messages = [results[name]["message"].replace(cases[name][0].name, "FOLDER") for name in (existing, missing)]
    assert messages[0] and messages[0] == messages[1]


def test_the_corpus_would_load_without_its_one_hostile_change(tmp_path):
    """The controls: the same generated files, minus the hostile part, are real checkpoints."""
    assert vx.load_model(_hf_folder(tmp_path / "hf")).config.depth == LAYERS
    sharded = _sharded_folder(tmp_path / "sharded", "shard.safetensors")
    save_file(_hf_tensors(), sharded / "shard.safetensors")
    assert vx.load_model(sharded).config.num_heads == HEADS
    assert vx.load_model(_project_file(tmp_path / "ours.safetensors")).config == _tiny_model().config
    views, records = _handmade_state()
    handmade = vx.load_model(_torch_zip(tmp_path / "handmade.pth", views, records), num_heads=HEADS)
    x = torch.randn(1, 3, IMAGE, IMAGE)
    with torch.no_grad():
        torch.testing.assert_close(handmade(x), _tiny_model()(x))
    dinov3 = vx.load_model(_hf_dinov3_folder(tmp_path / "dinov3"))
    assert dinov3.config.depth == LAYERS and dinov3.config.rope_type == "dinov3" and dinov3.pos_embed is None
    save_file(_dinov3_tensors(), tmp_path / "dinov3.safetensors")
    assert vx.load_model(tmp_path / "dinov3.safetensors", num_heads=HEADS).config.reg_tokens == 4
    small = _zip_bomb(tmp_path / "small.pth", 2**20)
    with pytest.raises(vx.CheckpointError, match="not a ViT checkpoint"):  # 1 MiB of zeros is no bomb
        vx.load_model(small)


@pytest.mark.parametrize(
    "field, value",
    [("depth", -1), ("depth", 0), ("num_classes", -1), ("image_size", -32), ("image_size", (32, 0)),
     ("image_size", 32.0), ("in_chans", 0), ("embed_dim", 0), ("mlp_ratio", math.nan), ("layer_norm_eps", 0.0)],
)
def test_vit_config_refuses_values_no_model_can_have(field, value):
    with pytest.raises(ValueError, match=f"^{field} must be"):
        vx.ViTConfig(**{field: value})


def test_vit_config_refuses_a_zero_std():
    with pytest.raises(ValueError, match="std must be positive"):
        vx.ViTConfig(std=(0.5, 0.0, 0.5))
    with pytest.raises(ValueError, match="mean must be a list of numbers"):
        vx.ViTConfig(mean=5)


def test_resize_model_to_image_size_zero_is_a_sentence():
    with pytest.raises(ValueError, match="^image_size must be a whole number of at least 1, not 0$"):
        vx.resize_model(_tiny_model(), image_size=0)
