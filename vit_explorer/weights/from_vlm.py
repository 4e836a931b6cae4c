"""The vision tower inside a vision-language model's Hugging Face folder: LLaVA (1.5, NeXT,
OneVision), PaliGemma, Gemma 3, Idefics3 and SmolVLM, whose towers are CLIP's or SigLIP's vision
transformer
(Qwen2.5-VL's and Qwen3-VL's have a reader of their own, from_qwen_vl, InternVL's from_internvl;
both read their tensors here).

Only the tower is read: its keys are picked from the shards' index (or the one file's header),
only the shards that hold them are opened, and of those only the tower's tensors are read, so a
7B model's folder costs the tower's bytes, not the language model's 14 GB. The tower's settings
are the folder's vision_config, converted as a CLIP or SigLIP vision folder is
(from_huggingface). The tower's keys carry the VLM's prefix: transformers 4 wrote
``vision_tower.vision_model.``, transformers 5 writes ``vision_tower.`` (``model.`` before either
in some).
"""
from __future__ import annotations

import math
import os
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from .checks import DTYPE_BYTES, MAX_CHECKPOINT_BYTES, MAX_TENSORS, CheckpointError, folder_file, looks_like_safetensors
from .checks import read_json, safetensors_header

# The VLMs whose towers we read, and the vision_config model types their towers may be.
VLM_TOWERS = {
    "llava": ("clip_vision_model", "siglip_vision_model"),
    "llava_next": ("clip_vision_model", "siglip_vision_model"),
    "llava_onevision": ("siglip_vision_model",),
    "paligemma": ("siglip_vision_model",),
    "gemma3": ("siglip_vision_model",),
    # SigLIP's layers under names of their own; one square tile (or the whole picture squeezed) at a time
    "idefics3": ("idefics3_vision",), "smolvlm": ("smolvlm_vision",),
}
_SIGLIP_LIKE = {"idefics3_vision", "smolvlm_vision"}
# What from_huggingface.transform reads of a LLaVA folder's preprocessor_config.json. The other
# VLMs' processors add tiles (OneVision's anyres, Idefics3's, InternVL's) to a whole-picture view
# squashed to the tower's size, which is what the tower is shown here.
_LLAVA_PROCESSOR_KEYS = (
    "image_processor_type", "feature_extractor_type", "size", "crop_size", "do_resize", "do_center_crop",
    "do_rescale", "do_normalize", "rescale_factor", "resample", "do_pad",
)
# VLMs whose towers need pieces our ViT does not have yet: each refused in a sentence that says why.
VLM_UNSUPPORTED = {
    "qwen2_vl": "LayerNorm blocks with a QuickGELU MLP (Qwen2.5-VL's we read)",
    "mllama": "tiled cross-attention", "aimv2": "a reader of transformers' AIMv2 names (timm's aimv2_* files load)",
}
_PREFIXES = (
    "vision_tower.vision_model.", "model.vision_tower.vision_model.", "model.vision_tower.", "vision_tower.",
    "model.vision_model.",  # Idefics3's and SmolVLM's
)
INDEX_FILE = "model.safetensors.index.json"
WEIGHTS_FILE = "model.safetensors"
_PATCH_KEY = "embeddings.patch_embedding.weight"


def is_vlm(hf_config: dict) -> bool:
    model_type = hf_config.get("model_type")
    return isinstance(model_type, str) and (model_type in VLM_TOWERS or model_type in VLM_UNSUPPORTED)


def tower_config(hf_config: dict, name: str) -> dict:
    """The tower's settings as a CLIP or SigLIP vision folder's config.json would give them, with
    the preprocessor's mean and std; a VLM we do not read is a sentence."""
    model_type = hf_config["model_type"]
    if model_type in VLM_UNSUPPORTED:
        raise CheckpointError(
            f"{name} is a {model_type} model, whose vision tower needs {VLM_UNSUPPORTED[model_type]},"
            f" which we do not load yet; we read the towers of {', '.join(VLM_TOWERS)}"
        )
    vision = hf_config.get("vision_config")
    tower_type = vision.get("model_type") if isinstance(vision, dict) else None
    if tower_type not in VLM_TOWERS[model_type]:
        raise CheckpointError(
            f"{name}'s vision_config is {tower_type!r}, not a tower a {model_type} model has"
            f" ({', '.join(VLM_TOWERS[model_type])})"
        )
    preprocessing = {key: hf_config[key] for key in ("image_mean", "image_std") if key in hf_config}
    if model_type == "llava":  # its processor (CLIP's, or LLaVA's padding to a square) as a folder's
        preprocessing.update({key: hf_config[key] for key in _LLAVA_PROCESSOR_KEYS if key in hf_config})
    if tower_type in _SIGLIP_LIKE:  # SigLIP's vision transformer without its pool, as PaliGemma's
        return {**preprocessing, **vision, "model_type": "siglip_vision_model", "vision_use_head": False}
    return {**preprocessing, **vision}


def language_model_reads(hf_config: dict, name: str) -> dict:
    """The ViTConfig fields that say what the language model reads of the tower: LLaVA's
    vision_feature_layer (-2, the penultimate block's output) without the class token
    ("default"); PaliGemma's, Gemma 3's, Idefics3's and SmolVLM's the tokens after the final norm,
    Gemma 3's projector averaging them down to mm_tokens_per_image, Idefics3's connector joining
    scale_factor x scale_factor squares (pixel shuffle); and the depth that layer is counted in,
    which the tower's tensors must have (a config claiming other layers is refused, not read)."""
    vision = hf_config["vision_config"]
    depth = vision.get("num_hidden_layers")
    if not isinstance(depth, int) or isinstance(depth, bool) or depth < 1:
        raise CheckpointError(f"{name}'s vision_config has no num_hidden_layers")
    if hf_config["model_type"].startswith("llava"):
        layer = hf_config.get("vision_feature_layer", -2)
        if not isinstance(layer, int) or isinstance(layer, bool) or not -depth - 1 <= layer <= depth:
            raise CheckpointError(f"{name}'s vision_feature_layer {layer!r} is not one layer of its {depth}")
        return {
            "depth": depth,
            "language_model_layer": layer % (depth + 1),
            "language_model_drops_class_token": hf_config.get("vision_feature_select_strategy", "default") == "default",
        }
    fields = {"language_model_layer": depth + 1, "depth": depth}
    if hf_config["model_type"] in ("idefics3", "smolvlm"):  # the connector's pixel shuffle
        scale = hf_config.get("scale_factor", 2)
        side = vision.get("image_size", 0) // max(vision.get("patch_size", 1), 1)
        if not isinstance(scale, int) or isinstance(scale, bool) or scale < 1 or side % scale:
            raise CheckpointError(f"{name}'s scale_factor {scale!r} does not join its {side} x {side} patches into squares")
        fields["language_model_shuffle"] = scale
    if hf_config["model_type"] == "gemma3":
        side = vision.get("image_size", 0) // max(vision.get("patch_size", 1), 1)
        per_image = hf_config.get("mm_tokens_per_image", 256)
        kept = math.isqrt(per_image) if isinstance(per_image, int) and per_image > 0 else 0
        if kept < 1 or kept * kept != per_image or side % kept:
            raise CheckpointError(f"{name}'s mm_tokens_per_image {per_image!r} is no square that divides its grid")
        fields["language_model_pooling"] = side // kept
    return fields


def read_tower(
    folder: Path, name: str, prefixes: tuple[str, ...] = _PREFIXES, patch_key: str = _PATCH_KEY
) -> dict[str, torch.Tensor]:
    """The tower's tensors, prefix removed, from the folder's safetensors (one file, or the
    shards its index names, each checked to lie inside the folder before any is opened): those
    under the first of ``prefixes`` that holds ``patch_key`` (another VLM's names: Qwen-VL's
    ``visual.``)."""
    prefix, shards = tower_shards(folder, name, prefixes, patch_key)
    state: dict[str, torch.Tensor] = {}
    budget = MAX_CHECKPOINT_BYTES
    for path, shard_keys in shards.items():
        tensors = _read_keys(path, shard_keys, budget, name)
        budget -= sum(tensor.numel() * tensor.element_size() for tensor in tensors.values())
        state.update({key.removeprefix(prefix): tensor for key, tensor in tensors.items()})
    return state


def tower_shards(
    folder: Path, name: str, prefixes: tuple[str, ...] = _PREFIXES, patch_key: str = _PATCH_KEY
) -> tuple[str, dict[Path, list[str]]]:
    """(the tower's prefix, each shard that holds its tensors -> their names): what
    :func:`read_tower` reads (weights/footprint.py sizes it from the same headers), every shard
    checked to lie inside the folder; nothing but the index or the one file's header is read."""
    if os.path.lexists(folder / INDEX_FILE):
        index = read_json(folder_file(folder, INDEX_FILE, INDEX_FILE), INDEX_FILE, name)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(key, str) and isinstance(shard, str)
                                                       for key, shard in weight_map.items()):
            raise CheckpointError(f"{INDEX_FILE} in {name} has no weight_map from tensor names to shard files")
        keys = list(weight_map)
    elif os.path.lexists(folder / WEIGHTS_FILE):
        weight_map = None
        keys = _keys(folder_file(folder, WEIGHTS_FILE, WEIGHTS_FILE))
    else:
        raise CheckpointError(f"{name} is a vision-language model without {WEIGHTS_FILE} or {INDEX_FILE}; we read its tower from safetensors only")
    prefix, wanted = tower_keys(keys, name, prefixes, patch_key)
    shards: dict[Path, list[str]] = {}
    for key in wanted:
        shard = WEIGHTS_FILE if weight_map is None else weight_map[key]
        shards.setdefault(folder_file(folder, shard, f"a shard named in {INDEX_FILE}"), []).append(key)
    return prefix, shards


def tower_keys(
    keys: list[str], name: str, prefixes: tuple[str, ...] = _PREFIXES, patch_key: str = _PATCH_KEY
) -> tuple[str, list[str]]:
    """(the tower's prefix, the names of its tensors) among a VLM's tensor names: those under the
    first of ``prefixes`` that holds ``patch_key``."""
    present = set(keys)
    prefix = next((prefix for prefix in prefixes if prefix + patch_key in present), None)
    if prefix is None:
        raise CheckpointError(f"{name} holds no vision tower's weights (no {prefixes[-1]}*{patch_key})")
    wanted = [key for key in keys if key.startswith(prefix)]
    if len(wanted) > MAX_TENSORS:
        raise CheckpointError(f"{name}'s vision tower has {len(wanted)} tensors; a ViT has fewer than {MAX_TENSORS}")
    return prefix, wanted


def _keys(path: Path) -> list[str]:
    if not looks_like_safetensors(path):
        raise CheckpointError(f"{path.name} is not a safetensors file")
    safetensors_header(path)
    with safe_open(str(path), framework="pt") as file:
        return list(file.keys())


def _read_keys(path: Path, keys: list[str], budget: int, name: str) -> dict[str, torch.Tensor]:
    """Only ``keys`` of one safetensors shard, their sizes (from its checked header) within
    ``budget`` bytes before any is read."""
    if not looks_like_safetensors(path):
        raise CheckpointError(f"{path.name} in {name} is not a safetensors file; we read a tower from safetensors only")
    safetensors_header(path)
    try:
        with safe_open(str(path), framework="pt", device="cpu") as file:
            present = set(file.keys())
            missing = [key for key in keys if key not in present]
            if missing:
                raise CheckpointError(f"{path.name} in {name} lacks {missing[0]}, which its index says it holds")
            slices = {key: file.get_slice(key) for key in keys}
            size = sum(_bytes(piece) for piece in slices.values())
            if size > budget:
                raise CheckpointError(f"{name}'s vision tower is over {MAX_CHECKPOINT_BYTES // 2**30} GB, which we do not load")
            # float32 (as the model holds them) one tensor at a time: a half-precision copy of the
            # whole tower never lies beside the float32 one.
            return {key: _float(file.get_tensor(key)) for key in keys}
    except SafetensorError as error:
        raise CheckpointError(f"{path.name} in {name} is truncated or not a valid safetensors file ({error})") from None


def _float(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.float() if tensor.is_floating_point() else tensor


def _bytes(piece) -> int:
    """What a tensor will hold once read: float32 for any floating dtype."""
    count = 1
    for side in piece.get_shape():
        count *= side
    return count * max(4, DTYPE_BYTES.get(piece.get_dtype(), 8))
