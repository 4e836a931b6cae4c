"""Checkpoints: our safetensors files, timm / torchvision / Hugging Face ViT imports, resizing.

Every format is converted to our (timm-named) state dict first; the config is then inferred from
the tensor shapes alone, so one code path builds and checks the model whatever the source was.
Files may come from anyone (the class server's uploads): no pickle code runs, what a file declares
is checked against its size before anything is allocated, and nothing outside a model's folder
is read.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import os
import pickle
import pickletools
import re
import struct
import uuid
import zipfile
from collections.abc import Mapping
from pathlib import Path

import torch
from einops import rearrange
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file
from safetensors.torch import save as safetensors_bytes

from .config import IMAGENET_MEAN, IMAGENET_STD, ViTConfig, _brief, _is_number
from .model import ViT, resample_patch_embed, resample_pos_embed, resize_matrix

CONFIG_KEY = "vit_explorer.config"  # safetensors metadata entry that marks a project checkpoint
TORCHVISION_VITS = ("vit_b_16", "vit_b_32", "vit_l_16", "vit_l_32", "vit_h_14")
HF_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
HF_SHARD_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
# Bounds on what one uploaded checkpoint can make the server hold or do. The largest published
# ViTs fit well inside them (ViT-22B: 48 blocks, ~800 tensors; ViT-H/14: 2.5 GB).
MAX_BLOCKS = 256
MAX_TENSORS = 10_000
MAX_CHECKPOINT_BYTES = 4 * 2**30
MAX_HEADER_BYTES = 2**20  # a safetensors header, a pickle or a JSON file: names and shapes only


class CheckpointError(ValueError):
    """A checkpoint that cannot be read or is not a ViT we can rebuild; the message says why."""


# ----------------------------------------------------------------------------- project files


def save_model(model: ViT, path: str | os.PathLike, metadata: dict[str, str] | None = None) -> None:
    """Write the weights and the config (class names included) to one ``.safetensors`` file.

    ``metadata`` adds string entries (e.g. how the model was trained); read them back with
    :func:`load_metadata`. The file appears atomically: a crash leaves the old file or none.
    """
    extra = dict(metadata or {})
    bad = [
        key
        for key, value in extra.items()
        if not isinstance(key, str) or not isinstance(value, str)
    ]
    if bad:
        raise ValueError(f"checkpoint metadata must map strings to strings (bad entries: {bad})")
    if CONFIG_KEY in extra or "format" in extra:
        raise ValueError(f"metadata keys {CONFIG_KEY!r} and 'format' are reserved")
    tensors = {
        name: value.detach().cpu().contiguous() for name, value in model.state_dict().items()
    }
    header = {"format": "pt", CONFIG_KEY: model.config.to_json(), **extra}

    path = Path(path)
    data = safetensors_bytes(tensors, metadata=header)
    # The temporary file lives in the target folder so that os.replace is an atomic rename;
    # plain open() gives it the usual permissions (safetensors' save_file makes files 0600).
    temporary = path.parent / f".{path.name}.{uuid.uuid4().hex}.tmp"
    try:
        with open(temporary, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def load_metadata(path: str | os.PathLike) -> dict[str, str]:
    """The extra metadata :func:`save_model` stored (the config entry and 'format' left out)."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    header = _safetensors_header(path) if _looks_like_safetensors(path) else None
    if header is None:
        raise CheckpointError(f"{path.name} is not a safetensors checkpoint, so it has no metadata")
    return {key: value for key, value in header.items() if key not in (CONFIG_KEY, "format")}


# ----------------------------------------------------------------------------- reading files


def _looks_like_safetensors(path: Path) -> bool:
    # safetensors: an 8-byte little-endian header length, then the JSON header itself.
    with open(path, "rb") as file:
        start = file.read(9)
    return len(start) == 9 and start[8:9] == b"{"


def _safetensors_header(path: Path) -> dict[str, str]:
    with open(path, "rb") as file:
        (header_bytes,) = struct.unpack("<Q", file.read(8))
    if header_bytes > MAX_HEADER_BYTES:
        raise CheckpointError(
            f"{path.name} has a {header_bytes / 2**20:.0f} MB header, far more than the names and"
            " shapes of a ViT's tensors need"
        )
    try:
        with safe_open(str(path), framework="pt") as file:
            if len(file.keys()) > MAX_TENSORS:
                raise CheckpointError(
                    f"{path.name} holds {len(file.keys())} tensors; a ViT has fewer than {MAX_TENSORS}"
                )
            return dict(file.metadata() or {})
    except SafetensorError as error:
        raise CheckpointError(
            f"{path.name} is truncated or not a valid safetensors file ({error})"
        ) from None


def _describe(start: bytes) -> str:
    """What a file that is not a checkpoint appears to be, from its first bytes."""
    signatures = {
        b"\x89PNG": "a PNG image",
        b"\xff\xd8\xff": "a JPEG image",
        b"GIF8": "a GIF image",
        b"%PDF": "a PDF",
        b"\x1f\x8b": "a gzip archive",
    }
    for magic, kind in signatures.items():
        if start.startswith(magic):
            return kind
    try:
        start.decode("utf-8")
    except UnicodeDecodeError as error:
        if error.start < len(start) - 3:  # not just a character cut off by the sample's end
            return "an unknown binary format"
    return "a text file"


def _check_archive(path: Path) -> None:
    """Refuse a zip whose members would unpack to far more than the file holds, before torch.load
    allocates and inflates them: its central directory declares each member's size."""
    size = path.stat().st_size
    with open(path, "rb") as file:
        file.seek(max(0, size - 2**16 - 22))
        tail = file.read()
    # The end-of-central-directory record counts the members; Python's zipfile would otherwise
    # build an object for each of millions of them.
    end = tail.rfind(b"PK\x05\x06")
    if end < 0 or len(tail) < end + 22:
        raise CheckpointError(f"{path.name} is truncated or not a PyTorch/safetensors file")
    (members,) = struct.unpack("<H", tail[end + 10 : end + 12])
    if members > MAX_TENSORS:
        raise CheckpointError(f"{path.name} is an archive of {members} files; a ViT has fewer tensors")
    try:
        with zipfile.ZipFile(path) as archive:
            infos = archive.infolist()
    except (zipfile.BadZipFile, OSError, ValueError):
        raise CheckpointError(f"{path.name} is truncated or not a PyTorch/safetensors file") from None
    declared = sum(info.file_size for info in infos)
    # torch.save stores tensors uncompressed: an honest archive unpacks to about its own size.
    if declared > min(4 * size + 2**20, MAX_CHECKPOINT_BYTES):
        raise CheckpointError(
            f"{path.name} would unpack to {declared / 2**20:,.0f} MB from a {size / 2**20:,.1f} MB"
            " file, which is refused (PyTorch checkpoints are stored uncompressed)"
        )
    pickles = [info for info in infos if info.filename.endswith(".pkl")]
    if any(info.file_size > MAX_HEADER_BYTES for info in pickles):
        raise CheckpointError(
            f"{path.name} has a pickle of over {MAX_HEADER_BYTES // 2**20} MB, far more than the"
            " names and shapes of a ViT's tensors need"
        )


def _refuse_raw_pickle(path: Path) -> None:
    """A pickle outside a zip: torch.save's format before PyTorch 1.6, or plain pickle.dump.

    Never unpickled: the old format declares storage sizes that torch.load allocates before it
    reads them, so a small file could ask for any amount of memory. The opcodes are only listed
    (pickletools runs nothing) to say which code a pickle would have called.
    """
    with open(path, "rb") as file:
        head = file.read(MAX_HEADER_BYTES)
    strings: list[str] = []
    called = None
    try:
        for opcode, argument, _ in pickletools.genops(io.BytesIO(head)):
            if opcode.name in ("GLOBAL", "INST"):
                called = argument.replace(" ", ".")[:60]
            elif opcode.name == "STACK_GLOBAL" and len(strings) >= 2:
                called = ".".join(strings[-2:])[:60]
            if called or opcode.name == "STOP":
                break
            if isinstance(argument, str):
                strings.append(argument)
    except ValueError:  # not a complete pickle: said below like any other unreadable file
        pass
    if called:
        raise CheckpointError(
            f"loading {path.name} was refused: it contains code or Python objects other than "
            f"tensors, which could run arbitrary commands ({called})"
        )
    raise CheckpointError(
        f"{path.name} is a Python pickle, not a checkpoint we read: PyTorch files from before"
        " version 1.6 are not read (they cannot be checked before loading); load it with torch.load"
        " and save it again with a current torch.save"
    )


def _check_loaded(tensors: dict[str, torch.Tensor], name: str, file_size: int) -> None:
    """Tensors may be views that share one storage: their data is bounded by the file's size
    before anything copies them (converting to float32 at most doubles fp16 weights)."""
    if len(tensors) > MAX_TENSORS:
        raise CheckpointError(f"{name} holds {len(tensors)} tensors; a ViT has fewer than {MAX_TENSORS}")
    odd = next(
        (
            key
            for key, value in tensors.items()
            if value.layout != torch.strided or value.device.type != "cpu"
        ),
        None,
    )
    if odd is not None:
        raise CheckpointError(f"{name}'s tensor {_brief(odd)} is not a plain (dense, stored) tensor")
    declared = sum(value.numel() * value.element_size() for value in tensors.values())
    if declared > min(2 * file_size + 2**20, MAX_CHECKPOINT_BYTES):
        raise CheckpointError(
            f"{name}'s tensors would hold {declared / 2**20:,.0f} MB of data in a"
            f" {file_size / 2**20:,.1f} MB file, which is refused"
        )


def _read_tensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(state dict, safetensors metadata) of a file, or a CheckpointError saying what is wrong."""
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if not path.is_file():
        raise CheckpointError(f"{path.name} is not a file")
    size = path.stat().st_size
    if size == 0:
        raise CheckpointError(f"{path.name} is empty")
    if size > MAX_CHECKPOINT_BYTES:
        raise CheckpointError(
            f"{path.name} is {size / 2**30:.1f} GB; checkpoints over"
            f" {MAX_CHECKPOINT_BYTES // 2**30} GB are not loaded"
        )

    if _looks_like_safetensors(path):
        metadata = _safetensors_header(path)
        try:
            # safetensors checks that the tensors tile the file: they hold no more than it does.
            return load_file(str(path), device="cpu"), metadata
        except SafetensorError as error:
            raise CheckpointError(
                f"{path.name} is truncated or not a valid safetensors file ({error})"
            ) from None

    with open(path, "rb") as file:
        start = file.read(64)
    # torch.save writes a zip archive (or, before torch 1.6, a raw pickle starting with 0x80).
    if start.startswith(b"\x80"):
        _refuse_raw_pickle(path)
    if not start.startswith(b"PK\x03\x04"):
        raise CheckpointError(
            f"{path.name} is not a PyTorch/safetensors checkpoint "
            f"(it looks like {_describe(start)})"
        )
    _check_archive(path)
    try:
        # weights_only: a pickle may only rebuild tensors and containers, never call code.
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        if "Weights only load failed" in str(error):
            found = re.search(r"GLOBAL ([\w.]+)", str(error))
            detail = f" ({found.group(1)[:60]})" if found else ""
            raise CheckpointError(
                f"loading {path.name} was refused: it contains code or Python objects other than "
                f"tensors, which could run arbitrary commands{detail}"
            ) from None
        raise CheckpointError(
            f"{path.name} is truncated or not a PyTorch/safetensors file"
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError, MemoryError):
        raise CheckpointError(
            f"{path.name} is truncated or not a PyTorch/safetensors file"
        ) from None
    tensors = _unwrap(loaded, path.name)
    _check_loaded(tensors, path.name, size)
    return tensors, {}


def _unwrap(loaded: object, name: str) -> dict[str, torch.Tensor]:
    """The tensor dict inside a training checkpoint ({"state_dict": ...}, {"model": ...}, DDP)."""
    while isinstance(loaded, Mapping):
        inner = next(
            (
                loaded[key]
                for key in ("state_dict", "model")
                if isinstance(loaded.get(key), Mapping)
            ),
            None,
        )
        if inner is None:
            break
        loaded = inner
    if not isinstance(loaded, Mapping):
        raise CheckpointError(
            f"{name} holds a {type(loaded).__name__}, not a state dict of tensors"
        )
    tensors = {str(key): value for key, value in loaded.items() if isinstance(value, torch.Tensor)}
    if not tensors:
        raise CheckpointError(f"{name} contains no tensors")
    if all(key.startswith("module.") for key in tensors):  # saved from DistributedDataParallel
        tensors = {key.removeprefix("module."): value for key, value in tensors.items()}
    return tensors


# ----------------------------------------------------------------------------- format converters
# Each converter returns (our state dict, config fields the source knows and the shapes cannot
# tell, e.g. normalisation, class names, heads).


def _from_timm(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict]:
    # timm parameter names are ours; mean/std 0.5 is the augreg (and our) default.
    return dict(state), {}


def _from_torchvision(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict]:
    if any(key.startswith("conv_proj.conv_") for key in state):
        raise CheckpointError("torchvision ViTs with a convolutional stem are not supported")
    if "heads.pre_logits.weight" in state:
        raise CheckpointError(
            "this torchvision ViT has a pre-logits layer (representation_size), "
            "which our ViT does not have"
        )
    renames = [
        (r"^conv_proj\.", "patch_embed.proj."),
        (r"^class_token$", "cls_token"),
        (r"^encoder\.pos_embedding$", "pos_embed"),
        (r"^encoder\.layers\.encoder_layer_(\d+)\.", r"blocks.\1."),
        (r"\.ln_1\.", ".norm1."),
        (r"\.ln_2\.", ".norm2."),
        (r"\.self_attention\.in_proj_(weight|bias)$", r".attn.qkv.\1"),
        (r"\.self_attention\.out_proj\.", ".attn.proj."),
        (r"\.mlp\.(0|linear_1)\.", ".mlp.fc1."),  # linear_1/2: torchvision before 0.14
        (r"\.mlp\.(3|linear_2)\.", ".mlp.fc2."),
        (r"^encoder\.ln\.", "norm."),
        (r"^heads\.head\.", "head."),
    ]
    converted = {}
    for key, value in state.items():
        for pattern, replacement in renames:
            key = re.sub(pattern, replacement, key)
        converted[key] = value
    return converted, {"mean": IMAGENET_MEAN, "std": IMAGENET_STD}


# Hugging Face model types we convert; the full CLIP / SigLIP models contribute their image tower.
HF_MODEL_TYPES = (
    "vit", "deit", "dinov2", "dinov2_with_registers",
    "clip", "clip_vision_model", "siglip", "siglip_vision_model",
)
HF_ACTIVATIONS = {"gelu": "gelu", "quick_gelu": "quick_gelu", "gelu_pytorch_tanh": "gelu_tanh"}
# Names of the BERT-style encoders (ViT, DeiT, DINOv2); files keep the transformers 4 names,
# transformers 5 modules call the attention projections q/k/v/o_proj.
_HF_VIT_RENAMES = [
    (r"^embeddings\.cls_token$", "cls_token"),
    (r"^embeddings\.distillation_token$", "dist_token"),
    (r"^embeddings\.register_tokens$", "reg_token"),
    (r"^embeddings\.position_embeddings$", "pos_embed"),
    (r"^embeddings\.patch_embeddings\.projection\.", "patch_embed.proj."),
    (r"^(encoder\.layer|layers)\.(\d+)\.", r"blocks.\2."),
    (r"\.attention\.(output\.dense|o_proj)\.", ".attn.proj."),
    (r"\.layernorm_before\.", ".norm1."),
    (r"\.layernorm_after\.", ".norm2."),
    (r"\.layer_scale(1|2)\.lambda1$", r".ls\1.gamma"),
    (r"\.intermediate\.dense\.", ".mlp.fc1."),
    (r"\.output\.dense\.", ".mlp.fc2."),
    (r"^layernorm\.", "norm."),
    (r"^classifier\.", "head."),
    (r"^cls_classifier\.", "head."),
    (r"^distillation_classifier\.", "head_dist."),
]
# CLIP's and SigLIP's vision towers (CLIPVisionModel, SiglipVisionModel).
_HF_TOWER_RENAMES = [
    (r"^embeddings\.patch_embedding\.", "patch_embed.proj."),
    (r"^pre_layrnorm\.", "norm_pre."),  # sic: CLIP's own spelling
    (r"^encoder\.layers\.(\d+)\.", r"blocks.\1."),
    (r"\.layer_norm(1|2)\.", r".norm\1."),
    (r"\.self_attn\.out_proj\.", ".attn.proj."),
    (r"^post_layernorm\.", "norm."),
    (r"^head\.probe$", "attn_pool.latent"),
    (r"^head\.attention\.out_proj\.", "attn_pool.proj."),
    (r"^head\.layernorm\.", "attn_pool.norm."),
    (r"^head\.mlp\.", "attn_pool.mlp."),
]
_HF_SEPARATE_QKV = re.compile(
    r"^(?:encoder\.layer|layers|encoder\.layers)\.(\d+)\.(?:attention\.(?:attention\.)?|self_attn\.)"
    r"(query|key|value|q_proj|k_proj|v_proj)\.(weight|bias)$"
)


def _merge_qkv(separate: dict[str, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One qkv tensor per block from Hugging Face's separate query, key and value projections."""
    merged = {}
    for key, parts in separate.items():
        if set(parts) != {"q", "k", "v"}:
            raise CheckpointError(
                f"the Hugging Face checkpoint lacks part of {key} (has {sorted(parts)})"
            )
        merged[key] = torch.cat([parts["q"], parts["k"], parts["v"]], dim=0)  # (3D, ...)
    return merged


def _from_huggingface(
    state: dict[str, torch.Tensor], hf_config: dict
) -> tuple[dict[str, torch.Tensor], dict]:
    model_type = _hf_setting(hf_config, "model_type", "vit")
    if model_type not in HF_MODEL_TYPES:
        raise CheckpointError(
            f"Hugging Face model type {model_type!r} is not supported; we read"
            f" {', '.join(HF_MODEL_TYPES)}"
        )
    tower = model_type.startswith(("clip", "siglip"))
    if model_type in ("clip", "siglip"):  # the whole model: its settings for the image tower
        hf_config = {**hf_config, **_hf_setting(hf_config, "vision_config", {})}
        state = {
            key.removeprefix("vision_model."): value
            for key, value in state.items()
            if key.startswith("vision_model.")
        }
    activation = _hf_setting(hf_config, "hidden_act", "gelu")
    if activation not in HF_ACTIVATIONS:
        raise CheckpointError(
            f"Hugging Face activation {activation!r} is not supported, only"
            f" {', '.join(HF_ACTIVATIONS)}"
        )
    if hf_config.get("use_swiglu_ffn"):
        raise CheckpointError("DINOv2 with a SwiGLU MLP (ViT-g) is not supported")
    if model_type.startswith("dinov2") and any(key.startswith("classifier.") for key in state):
        raise CheckpointError(
            "DINOv2's classifier reads the class token and the mean patch token together,"
            " which our ViT does not do; load the backbone (Dinov2Model) instead"
        )
    if model_type == "deit" and any(key.startswith("classifier.") for key in state):
        raise CheckpointError(
            "this DeiT classifier reads only the class token of a distilled model, which our"
            " ViT does not do; DeiTForImageClassificationWithTeacher and DeiTModel load"
        )

    prefix = {"vit": "vit.", "deit": "deit.", "dinov2": "dinov2.", "dinov2_with_registers": "dinov2."}
    state = {key.removeprefix(prefix.get(model_type, "vision_model.")): value for key, value in state.items()}
    renames = _HF_TOWER_RENAMES if tower else _HF_VIT_RENAMES
    converted: dict[str, torch.Tensor] = {}
    separate_qkv: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in state.items():
        if key.startswith("pooler.") or key == "embeddings.mask_token":
            continue  # the pooler and the masked-image-modelling token never reach logits
        found = _HF_SEPARATE_QKV.match(key)
        if found:
            block, role, kind = found.groups()
            separate_qkv.setdefault(f"blocks.{block}.attn.qkv.{kind}", {})[role[0]] = value
            continue
        if key == "head.attention.in_proj_weight" or key == "head.attention.in_proj_bias":
            # SigLIP's pooling attention: one (3D, ...) projection; its probe's query, then k, v.
            kind = key.rsplit("_", 1)[1]
            query, key_value = value.split([value.shape[0] // 3, 2 * value.shape[0] // 3])
            converted[f"attn_pool.q.{kind}"] = query
            converted[f"attn_pool.kv.{kind}"] = key_value
            continue
        for pattern, replacement in renames:
            key = re.sub(pattern, replacement, key)
        converted[key] = value
    converted.update(_merge_qkv(separate_qkv))

    known: dict = {
        "layer_norm_eps": float(_hf_setting(hf_config, "layer_norm_eps", 1e-12)),
        "act_layer": HF_ACTIVATIONS[activation],
    }
    if tower:
        # CLIP: a class embedding (D,) and position embeddings (N, D) stored without batch axes.
        if "embeddings.class_embedding" in converted:
            converted["cls_token"] = converted.pop("embeddings.class_embedding")[None, None]
        if "embeddings.position_embedding.weight" in converted:
            converted["pos_embed"] = converted.pop("embeddings.position_embedding.weight")[None]
    if model_type == "dinov2_with_registers" and "cls_token" in converted and "pos_embed" in converted:
        # Registers get no position embedding but the class token does: fold the class token's
        # into the token itself, as timm's DINOv2 layout (no_embed_class) does.
        class_position = converted["pos_embed"][:, :1]
        if converted["cls_token"].shape != class_position.shape:  # an addition must not broadcast
            raise CheckpointError(
                "the Hugging Face checkpoint's class token and position embeddings do not fit"
            )
        converted["cls_token"] = converted["cls_token"] + class_position
        converted["pos_embed"] = converted["pos_embed"][:, 1:]
        known["no_embed_class"] = True
    for ours, theirs in (
        ("num_heads", "num_attention_heads"), ("image_size", "image_size"),
        ("mean", "image_mean"), ("std", "image_std"),
    ):
        if theirs in hf_config:
            value = _hf_setting(hf_config, theirs)
            known[ours] = tuple(value) if isinstance(value, list) else value
    labels = _hf_setting(hf_config, "id2label", {}) or {}
    num_classes = converted["head.weight"].shape[0] if "head.weight" in converted else 0
    names = [labels.get(str(index)) for index in range(num_classes)]
    if any(name is not None and not isinstance(name, str) for name in names):
        raise CheckpointError("config.json's id2label must map class numbers to names (strings)")
    # transformers fills id2label with LABEL_0, LABEL_1, ... when nobody named the classes.
    if num_classes and all(names) and names != [f"LABEL_{index}" for index in range(num_classes)]:
        known["class_names"] = tuple(names)
    return converted, known


def _convert_huggingface(
    state: dict[str, torch.Tensor], hf_config: dict, name: str
) -> tuple[dict[str, torch.Tensor], dict]:
    try:
        return _from_huggingface(state, hf_config)
    except (RuntimeError, IndexError):  # q, k and v (or SigLIP's pool) that do not fit together
        raise CheckpointError(f"{name}'s tensors do not fit together as a Hugging Face ViT's") from None


def _whole(value) -> bool:
    return _is_number(value) and isinstance(value, int) and value > 0


# The config.json settings we read: a check of each, and what it must be in words.
_HF_SETTINGS = {
    "model_type": (lambda value: isinstance(value, str), "a name"),
    "vision_config": (lambda value: isinstance(value, dict), "an object of settings"),
    "hidden_act": (lambda value: isinstance(value, str), "a name"),
    "layer_norm_eps": (lambda value: _is_number(value) and value > 0, "a positive number"),
    "num_attention_heads": (_whole, "a positive whole number"),
    "image_size": (
        lambda value: _whole(value)
        or (isinstance(value, list) and len(value) == 2 and all(map(_whole, value))),
        "a positive whole number or [height, width]",
    ),
    "image_mean": (
        lambda value: isinstance(value, list) and all(map(_is_number, value)),
        "a list of numbers, one per channel",
    ),
    "image_std": (
        lambda value: isinstance(value, list) and all(map(_is_number, value)),
        "a list of numbers, one per channel",
    ),
    "id2label": (
        lambda value: value is None or isinstance(value, dict),
        "an object from class numbers to names",
    ),
}


def _hf_setting(hf_config: dict, key: str, default=None):
    """``hf_config[key]`` (or ``default``), refused with a sentence unless it is what it must be."""
    if key not in hf_config:
        return default
    valid, expected = _HF_SETTINGS[key]
    if not valid(hf_config[key]):
        raise CheckpointError(f"config.json's {key} must be {expected}, not {_brief(hf_config[key])}")
    return hf_config[key]


def _folder_file(folder: Path, relative, what: str) -> Path:
    """The file ``relative`` names inside ``folder``; refused if it leads outside the folder
    (``..``, an absolute path, a symlink out), before anything there is opened, and in the same
    words whether or not such a file exists, so that an upload cannot probe the server's disk."""
    outside = CheckpointError(
        f"{what} in {folder.name} leads outside the model folder, which is refused"
    )
    if not isinstance(relative, str) or not relative or "\0" in relative:
        raise outside
    parts = Path(relative).parts
    if Path(relative).is_absolute() or ".." in parts:
        raise outside
    inside = Path(os.path.realpath(folder))
    target = Path(os.path.realpath(folder / relative))
    if not target.is_relative_to(inside):
        raise outside
    if not target.is_file():
        raise CheckpointError(
            f"{what} in {folder.name} is {_brief(relative)}, which is not a file in the folder"
        )
    return target


def _read_json(path: Path, what: str, folder_name: str):
    if path.stat().st_size > MAX_HEADER_BYTES:
        raise CheckpointError(
            f"{what} in {folder_name} is over {MAX_HEADER_BYTES // 2**20} MB,"
            " far more than a config needs"
        )
    try:
        return json.loads(path.read_bytes())
    except (ValueError, RecursionError, UnicodeDecodeError):  # JSONDecodeError is a ValueError
        raise CheckpointError(f"{what} in {folder_name} is not valid JSON") from None


def _huggingface_config(folder: Path, name: str) -> dict:
    """config.json of a Hugging Face model folder, with preprocessor_config.json's mean/std."""
    if not os.path.lexists(folder / "config.json"):
        raise CheckpointError(f"{name} has no Hugging Face config.json beside its weights")
    hf_config = {}
    for file_name in ("preprocessor_config.json", "config.json"):  # config.json's settings win
        if file_name == "config.json" or os.path.lexists(folder / file_name):
            settings = _read_json(_folder_file(folder, file_name, file_name), file_name, folder.name)
            if not isinstance(settings, dict):
                raise CheckpointError(f"{file_name} in {folder.name} is not a JSON object of settings")
            hf_config.update(settings)
    return hf_config


def _huggingface_weights(folder: Path) -> dict[str, torch.Tensor]:
    """The weights of a Hugging Face model folder: one file (safetensors first) or shards."""
    single = next((name for name in HF_WEIGHT_FILES if os.path.lexists(folder / name)), None)
    if single is not None:
        return _read_tensors(_folder_file(folder, single, single))[0]
    index_name = next((name for name in HF_SHARD_INDEXES if os.path.lexists(folder / name)), None)
    if index_name is None:
        raise CheckpointError(f"{folder.name} has no {' or '.join(HF_WEIGHT_FILES)}")
    index = _read_json(_folder_file(folder, index_name, index_name), index_name, folder.name)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if (
        not isinstance(weight_map, dict)
        or not weight_map
        or not all(isinstance(shard, str) for shard in weight_map.values())
    ):
        raise CheckpointError(
            f"{index_name} in {folder.name} has no weight_map from tensor names to shard files"
        )
    # Every shard is checked before any is read.
    what = f"a shard named in {index_name}"
    shards = {_folder_file(folder, shard, what) for shard in set(weight_map.values())}
    state: dict[str, torch.Tensor] = {}
    for shard in sorted(shards):
        state.update(_read_tensors(shard)[0])
        if len(state) > MAX_TENSORS:
            raise CheckpointError(
                f"{folder.name}'s shards hold over {MAX_TENSORS} tensors; a ViT has fewer"
            )
    return state


def _is_huggingface(state: Mapping[str, torch.Tensor]) -> bool:
    return any(
        re.match(r"^(?:(?:vit|deit|dinov2|vision_model)\.)?embeddings\.patch_embeddings?\.", key)
        for key in state
    )


# ----------------------------------------------------------------------------- building the model


def _grid_for(num_positions: int, image_size, patch_size: int) -> tuple[int, int] | None:
    """The patch grid for ``num_positions`` positions: the requested image's grid, else a square."""
    if num_positions < 1:
        return None
    if image_size is not None:
        grid = ViTConfig(image_size=image_size, patch_size=patch_size, num_classes=0).grid_size
        return grid if grid[0] * grid[1] == num_positions else None
    side = math.isqrt(num_positions)
    return (side, side) if side * side == num_positions else None


def _block_count(state: dict[str, torch.Tensor], name: str) -> int:
    """How many blocks the file holds, numbered 0, 1, 2, ... (a key like blocks.999999999.x
    must not make the model that deep)."""
    indices = {found.group(1) for key in state if (found := re.match(r"blocks\.(\d+)\.", key))}
    if len(indices) > MAX_BLOCKS:
        raise CheckpointError(f"{name} has {len(indices)} blocks; we load ViTs of up to {MAX_BLOCKS}")
    if indices != {str(index) for index in range(len(indices))}:
        raise CheckpointError(
            f"{name}'s blocks are not numbered 0, 1, 2, ... without gaps, as a ViT's are"
        )
    return len(indices)


def _check_sizes(config: ViTConfig, state: dict[str, torch.Tensor], name: str) -> ViTConfig:
    """The sizes a file's metadata (or the caller) may claim must be those of its tensors: a
    model of a claimed depth or width is never built, not even on "meta"."""
    kernel = state["patch_embed.proj.weight"]  # (D, C, p, p)
    hidden = state["blocks.0.mlp.fc1.weight"].shape[0]
    from_tensors = {
        "depth": _block_count(state, name),
        "embed_dim": kernel.shape[0],
        "in_chans": kernel.shape[1],
        "num_classes": state["head.weight"].shape[0] if "head.weight" in state else 0,
        "reg_tokens": state["reg_token"].shape[1] if "reg_token" in state else 0,
        "mlp_ratio": hidden / kernel.shape[0],
    }
    claimed = {field: getattr(config, field) for field in from_tensors}
    if int(config.embed_dim * config.mlp_ratio) == hidden:  # Mlp's own rounding of the ratio
        claimed["mlp_ratio"] = from_tensors["mlp_ratio"]
    for field, value in from_tensors.items():
        if claimed[field] != value:
            raise CheckpointError(
                f"{name} cannot be built with {field} {_brief(claimed[field])}:"
                f" its tensors have {field} {value}"
            )
    return config


def _infer_config(
    state: dict[str, torch.Tensor], known: dict, requested: dict, name: str
) -> ViTConfig:
    """A ViTConfig from the tensor shapes, ``known`` source facts and the caller's overrides."""
    needed = ("patch_embed.proj.weight", "blocks.0.attn.qkv.weight", "blocks.0.mlp.fc1.weight")
    if not all(key in state for key in needed):
        sample = ", ".join(_brief(key)[1:-1] for key in sorted(state)[:6])
        raise CheckpointError(
            f"{name} is not a ViT checkpoint we can read (found keys like {sample})"
        )
    # The shapes read below must be those of a ViT's tensors before anything is computed from them.
    ranks = {
        "patch_embed.proj.weight": 4, "blocks.0.mlp.fc1.weight": 2, "pos_embed": 3,
        "reg_token": 3, "attn_pool.latent": 3, "head.weight": 2,
    }
    for key, rank in ranks.items():
        if key in state and (state[key].dim() != rank or 0 in state[key].shape):
            raise CheckpointError(
                f"{name}'s {key} has shape {tuple(state[key].shape)}, which no ViT's has"
            )
    patch_weight = state["patch_embed.proj.weight"]  # (D, C, p, p)
    embed_dim, in_chans, patch_h, patch_w = patch_weight.shape
    if patch_h != patch_w:
        raise CheckpointError(
            f"{name} has non-square patches ({patch_h}x{patch_w}), which we do not support"
        )
    depth = _block_count(state, name)
    class_token = "cls_token" in state
    dist_token = "dist_token" in state
    reg_tokens = state["reg_token"].shape[1] if "reg_token" in state else 0
    num_prefix = int(class_token) + int(dist_token) + reg_tokens
    if "norm.weight" not in state and "fc_norm.weight" not in state:
        raise CheckpointError(
            f"{name} has no final norm (neither norm nor fc_norm), which our ViT needs"
        )
    attention_pool = "attn_pool.latent" in state
    if attention_pool and state["attn_pool.latent"].shape[1] != 1:
        raise CheckpointError(
            f"{name} has an attention pool with {state['attn_pool.latent'].shape[1]} probe"
            " queries; our ViT supports one"
        )
    mean_pool = not attention_pool and ("fc_norm.weight" in state or not class_token)

    fields: dict = {
        "embed_dim": embed_dim,
        "in_chans": in_chans,
        "depth": depth,
        "num_heads": max(1, embed_dim // 64),  # the timm / torchvision / HF convention
        "mlp_ratio": state["blocks.0.mlp.fc1.weight"].shape[0] / embed_dim,
        "qkv_bias": "blocks.0.attn.qkv.bias" in state,
        "class_token": class_token,
        "dist_token": dist_token,
        "reg_tokens": reg_tokens,
        "global_pool": "map" if attention_pool else "mean" if mean_pool else "cls",
        "pre_norm": "norm_pre.weight" in state,
        "patch_bias": "patch_embed.proj.bias" in state,
        # A CLIP image tower (norm_pre, no patch bias) is built by timm with LayerNorm eps 1e-5.
        "layer_norm_eps": 1e-5 if "norm_pre.weight" in state and "patch_embed.proj.bias" not in state else 1e-6,
        # Mean pooling without fc_norm weights means the final norm comes before the pooling.
        "fc_norm": None if "fc_norm.weight" in state or not mean_pool else False,
        # LayerScale's init value only matters for training from scratch; the weights set gamma.
        "init_values": 1.0 if "blocks.0.ls1.gamma" in state else None,
        "num_classes": state["head.weight"].shape[0] if "head.weight" in state else 0,
        "mean": (0.5,) * in_chans,
        "std": (0.5,) * in_chans,
        **known,
        **requested,
        "patch_size": patch_h,  # always the kernel's; other sizes go through resize_model
    }
    if "pos_embed" not in state:
        raise CheckpointError(
            f"{name} has no absolute position embedding (pos_embed), which our ViT needs"
        )
    # Position embeddings cover the patch grid, plus the prefix tokens unless no_embed_class;
    # timm's default layout (prefix tokens included) is tried first.
    num_positions = state["pos_embed"].shape[1]
    image_size, patch_size = fields.get("image_size"), fields["patch_size"]
    layouts = [False, True] if num_prefix else [False]
    if "no_embed_class" in known or "no_embed_class" in requested:
        layouts = [fields["no_embed_class"]]
    try:
        for no_embed_class in layouts:
            num_patches = num_positions - (0 if no_embed_class else num_prefix)
            grid = _grid_for(num_patches, image_size, patch_size)
            if grid is not None:
                fields["no_embed_class"] = no_embed_class
                fields["image_size"] = image_size if image_size is not None else grid[0] * patch_size
                return _check_sizes(ViTConfig(**fields), state, name)
    except CheckpointError:
        raise
    except ValueError as error:  # a setting the file or the caller gave is not a valid ViTConfig
        raise CheckpointError(f"{name} has an invalid config: {error}") from None
    raise CheckpointError(
        f"cannot tell the image size of {name} from its {num_positions} position embeddings; "
        "pass image_size=(height, width) to load_model"
    )


def _adopt(config: ViTConfig, state: dict[str, torch.Tensor]):
    """A ViT built on the meta device that takes ``state``'s tensors as its parameters.

    Skips the random init (~4 s for ViT-B/16 on a CPU), which the state dict would overwrite;
    returns (model, load result) so the caller can check for missing or unexpected keys.
    """
    with torch.device("meta"):
        model = ViT(config)
    return model, model.load_state_dict(state, strict=False, assign=True)


def _expected_shapes(config: ViTConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter's shape for ``config``, from a one-block model on "meta" (no memory used)."""
    with torch.device("meta"):
        one_block = ViT(config.replace(depth=1))
    shapes = {}
    for key, value in one_block.state_dict().items():
        if key.startswith("blocks.0."):
            for index in range(config.depth):
                shapes[f"blocks.{index}.{key.removeprefix('blocks.0.')}"] = tuple(value.shape)
        else:
            shapes[key] = tuple(value.shape)
    return shapes


def _build(state: dict[str, torch.Tensor], config: ViTConfig, name: str) -> ViT:
    # Checked against the config before any model is built, so the model is no larger than
    # the tensors the file holds.
    expected = _expected_shapes(config)
    problems = []
    unexpected = [_brief(key)[1:-1] for key in state if key not in expected]
    if unexpected:
        problems.append(f"parameters our ViT does not have: {', '.join(unexpected[:5])}")
    missing = [key for key in expected if key not in state]
    if missing:
        problems.append(f"missing parameters: {', '.join(missing[:5])}")
    if problems:
        raise CheckpointError(f"{name} does not fit our ViT ({'; '.join(problems)})")
    for key, shape in expected.items():
        if tuple(state[key].shape) != shape:
            raise CheckpointError(
                f"{name} does not fit the config: {key} has shape {tuple(state[key].shape)},"
                f" not {shape}"
            )
        if not state[key].is_floating_point():
            raise CheckpointError(f"{name}'s {key} holds {state[key].dtype} values, not weights")
    model, _ = _adopt(config, {key: value.float() for key, value in state.items()})
    return model.eval()


def _model_from_state(
    state: dict[str, torch.Tensor], known: dict, overrides: dict, name: str
) -> ViT:
    """Build from the native geometry; a different image/patch size asked for is then resampled."""
    unknown = sorted(set(overrides) - {field.name for field in dataclasses.fields(ViTConfig)})
    if unknown:
        raise CheckpointError(f"unknown ViTConfig field(s) to override: {', '.join(unknown)}")
    kernel = state.get("patch_embed.proj.weight")
    rest = {key: value for key, value in overrides.items() if key != "patch_size"}
    geometry = {}
    if kernel is not None and overrides.get("patch_size", kernel.shape[-1]) != kernel.shape[-1]:
        geometry["patch_size"] = overrides["patch_size"]
    try:
        config = _infer_config(state, known, rest, name)
    except CheckpointError:
        if "image_size" not in rest:
            raise
        # The weights were trained for another size: build that one, then resample it.
        geometry["image_size"] = rest.pop("image_size")
        config = _infer_config(state, known, rest, name)
    try:
        model = _build(state, config, name)
    except (RuntimeError, TypeError) as error:  # sizes torch cannot make
        last_line = str(error).strip().splitlines()[-1].strip()
        raise CheckpointError(f"{name} does not fit its config ({last_line})") from None
    return resize_model(model, **geometry) if geometry else model


def load_model(path: str | os.PathLike, **overrides) -> ViT:
    """Load a ViT in eval mode on the CPU from any supported checkpoint; the format is detected.

    ``path``: our ``.safetensors`` file; a timm or torchvision state dict (``.safetensors``,
    ``.pth``, ``.bin``, possibly wrapped in ``{"state_dict": ...}`` or ``{"model": ...}``); a
    Hugging Face ViT folder (config.json + weights) or a weights file inside one. Whatever the
    weights do not reveal (num_heads defaults to embed_dim // 64) and any other ViTConfig field
    can be given as a keyword; a different ``image_size``/``patch_size`` resamples the model.
    """
    path = Path(path)
    if path.is_dir():
        if not os.path.lexists(path / "config.json"):
            raise CheckpointError(
                f"{path} is a folder but not a Hugging Face model (no config.json)"
            )
        hf_config = _huggingface_config(path, path.name)
        converted, known = _convert_huggingface(_huggingface_weights(path), hf_config, path.name)
        return _model_from_state(converted, known, overrides, path.name)

    state, metadata = _read_tensors(path)
    if CONFIG_KEY in metadata:
        try:
            saved = ViTConfig.from_json(metadata[CONFIG_KEY])
        except (ValueError, TypeError, RecursionError) as error:
            raise CheckpointError(f"{path.name} has an unreadable config ({str(error)[:200]})") from None
        return _model_from_state(state, saved.to_dict(), overrides, path.name)
    if _is_huggingface(state):
        hf_config = _huggingface_config(path.parent, path.name)
        converted, known = _convert_huggingface(state, hf_config, path.name)
    elif "conv_proj.weight" in state or "encoder.pos_embedding" in state:
        converted, known = _from_torchvision(state)
    else:
        converted, known = _from_timm(state)
    return _model_from_state(converted, known, overrides, path.name)


def load_pretrained(name: str = "vit_b_16", progress=None) -> ViT:
    """A pretrained model of the catalogue (vit_explorer.catalogue.CATALOGUE) or torchvision ViT.

    Downloaded on first use into the cache (~/.cache/vit_explorer/models, or torchvision's for
    its ViTs) and checked; ``progress(done_bytes, total_bytes or None)`` follows a download.
    Offline, or given a wrong file, it raises a CheckpointError that says so in one sentence.
    """
    from . import catalogue

    if name in TORCHVISION_VITS:
        return _load_torchvision(name, progress)
    if name not in catalogue.CATALOGUE:
        raise CheckpointError(
            f"unknown pretrained model {name!r}; choose one of"
            f" {', '.join([*catalogue.CATALOGUE, *TORCHVISION_VITS[1:]])}"
        )
    entry = catalogue.entry(name)
    try:
        path = catalogue.download(name, progress)
    except catalogue.DownloadError as error:
        raise CheckpointError(str(error)) from None
    state, _ = _read_tensors(path)
    for key in entry.drop_keys:
        state.pop(key, None)
    return _build(state, entry.vit_config(), name)


def _load_torchvision(name: str, progress=None) -> ViT:
    """A torchvision ImageNet-pretrained ViT (downloaded once into torchvision's cache)."""
    import torchvision.models

    from . import catalogue

    weights = torchvision.models.get_model_weights(name).DEFAULT
    try:
        # Into torchvision's own cache (torch.hub's checkpoints), with progress and our checks.
        path = catalogue.download_torchvision(name, progress)
    except OSError as error:
        raise CheckpointError(str(error)) from None
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, pickle.UnpicklingError) as error:
        raise CheckpointError(f"could not read the {name} weights in {path}: {error}") from None
    converted, known = _from_torchvision(state)
    known.update(
        image_size=weights.meta["min_size"][0], class_names=tuple(weights.meta["categories"])
    )
    return _model_from_state(converted, known, {}, name)


# ----------------------------------------------------------------------------- resizing


def resize_patches(x: torch.Tensor, old_patch: int, new_patch: int) -> torch.Tensor:
    """Resize each p x p patch of (B, C, H, W) images on its own, as PI-resize's matrix does."""
    patches = rearrange(
        x.double(), "b c (gh ph) (gw pw) -> b c gh gw (ph pw)", ph=old_patch, pw=old_patch
    )
    resized = patches @ resize_matrix((old_patch, old_patch), (new_patch, new_patch)).to(x.device)
    return rearrange(resized, "b c gh gw (ph pw) -> b c (gh ph) (gw pw)", ph=new_patch).to(x.dtype)


def resize_model(model: ViT, patch_size: int | None = None, image_size=None, *, share_weights: bool = False) -> ViT:
    """A copy of ``model`` for a new patch size and/or image size; the original is untouched.

    With ``share_weights`` only the resampled tensors (patch kernel, position embeddings) are
    new: the rest is the original's own storage, which saves a copy of the whole model (330 MB
    for a ViT-B) for a model that is only run, never trained (the app's shared models).
    """
    old = model.config
    new = old.replace(
        patch_size=patch_size if patch_size is not None else old.patch_size,
        image_size=image_size if image_size is not None else old.image_size,
    )
    state = {
        key: value.detach() if share_weights else value.detach().clone()
        for key, value in model.state_dict().items()
    }
    if new.patch_size != old.patch_size:
        # In float64 (then back), the most exact copy; a forward at patch_size= uses the kernel's dtype.
        weight = state["patch_embed.proj.weight"]
        state["patch_embed.proj.weight"] = resample_patch_embed(weight.double(), new.patch_size).to(weight.dtype)
    prefix = 0 if old.no_embed_class else old.num_prefix_tokens
    state["pos_embed"] = resample_pos_embed(
        state["pos_embed"], old.grid_size, new.grid_size, prefix
    )

    resized, result = _adopt(new, state)  # the cloned tensors keep the model's device and dtype
    assert not result.missing_keys and not result.unexpected_keys, result
    return resized.train(model.training)
