"""Qwen2.5-VL's and Qwen3-VL's vision towers, from the VLM's whole Hugging Face folder
(transformers 5's ``Qwen2_5_VLForConditionalGeneration`` / ``Qwen3VLForConditionalGeneration``:
the tower's tensors under ``visual.``).

What the tower is, in our ViT's options (each compared with transformers' tower in
tests/weights/test_qwen_vl_tower.py):

- its Conv3d patch embedding over ``temporal_patch_size`` frames: a picture is that many
  identical frames, so the kernel summed over time is the same map as a Conv2d (exact);
- no class token, no position embedding: 2D rotary positions (rope_type "axial": patch indices,
  the row's angles then the column's, rotate-half), theta from its rope_parameters;
- window attention (attn_window: window_size / patch_size patches a side), except in the
  fullatt_block_indexes blocks (full_attention_blocks); RMSNorm; a SwiGLU MLP (gate_proj,
  up_proj, down_proj -> timm's fc1_g, fc1_x, fc2);
- the patch merger (ln_q and an MLP over each 2 x 2 of patches): what its language model reads,
  (H/28) x (W/28) tokens of out_hidden_size numbers.

Qwen3-VL's tower differs: patches of 16 with a bias; a learned 48 x 48 grid of position
embeddings, stretched bilinearly corner to corner over each picture's grid
(pos_embed_interpolation "bilinear_corners"); the same rotary positions; every layer attends
everywhere; LayerNorm and a GELU (tanh) MLP (linear_fc1, linear_fc2 -> fc1, fc2); a LayerNorm
merger, and DeepStack: the outputs of deepstack_visual_indexes' blocks through mergers of their
own (deepstack_layers), which its language model adds into its first layers.

Qwen orders its tokens by window (vit_explorer.model.windows); ours stay row-major. Its
preprocessing (preprocessor_config.json, checked as any file of the folder) resizes a picture to
multiples of patch_size * spatial_merge_size within a pixel budget; the config keeps the budget
(pixel_budget) and a square size within it as the model's default input size.
"""
from __future__ import annotations

import math
import numbers
import os
from pathlib import Path

import torch

from ..model.config import INCEPTION_MEAN, INCEPTION_STD, OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, _brief
from . import from_vlm
from .checks import MAX_BLOCKS, CheckpointError, folder_file, read_json

MODEL_TYPES = ("qwen2_5_vl", "qwen3_vl")
PREFIXES = ("model.visual.", "visual.")
PATCH_KEY = "patch_embed.proj.weight"
PREPROCESSOR = "preprocessor_config.json"
# Qwen2-VL's image processor's own defaults (transformers' Qwen2VLImageProcessor), and the largest
# budget we accept: Qwen2.5-VL's published max_pixels, 16,384 tokens of 28 x 28 pixels.
DEFAULT_PIXELS = (56 * 56, 28 * 28 * 1280)
MAX_PIXELS = 16384 * 28 * 28
DEFAULT_SIDE = 448  # the square input size the pages start from, within the budget
_RENAMES = {
    ".mlp.gate_proj.": ".mlp.fc1_g.", ".mlp.up_proj.": ".mlp.fc1_x.", ".mlp.down_proj.": ".mlp.fc2.",
    # Qwen3-VL's blocks and mergers
    ".mlp.linear_fc1.": ".mlp.fc1.", ".mlp.linear_fc2.": ".mlp.fc2.",
    ".norm.": ".ln_q.", ".linear_fc1.": ".mlp.0.", ".linear_fc2.": ".mlp.2.",
}


def recognises(hf_config: dict) -> bool:
    return hf_config.get("model_type") in MODEL_TYPES


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(height, width) Qwen's processor resizes a picture to: multiples of ``factor``, the aspect
    ratio kept as closely as it can, within [min_pixels, max_pixels] (transformers' smart_resize,
    whose Python round() this keeps)."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"a picture {width} x {height} pixels is more than 200 times longer than it is wide")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar, w_bar = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def _whole(vision: dict, key: str, name: str, default=None, low: int = 1, high: int = 2**16) -> int:
    value = vision.get(key, default)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not low <= value <= high:
        raise CheckpointError(f"{name}'s vision_config has {key} {_brief(value)}, not a whole number from {low} to {high}")
    return int(value)


def read(folder: Path, hf_config: dict, name: str) -> tuple[dict[str, torch.Tensor], dict]:
    """(our state dict, the config fields its tensors do not tell) of the folder's tower, every
    setting checked before a tensor is read."""
    known = settings(folder, hf_config, name)
    state = convert(from_vlm.read_tower(folder, name, PREFIXES, PATCH_KEY), name)
    if hf_config["model_type"] == "qwen3_vl":
        positions = state.get("pos_embed.weight")
        side = known["image_size"] // known["patch_size"]
        if positions is None or positions.dim() != 2 or positions.shape[0] != side * side:
            raise CheckpointError(f"{name}'s tower has no {side} x {side} grid of position embeddings, as its config says")
        state["pos_embed"] = state.pop("pos_embed.weight")[None]  # (1, P, D) as ours
    return state, known


def convert(state: dict[str, torch.Tensor], name: str) -> dict[str, torch.Tensor]:
    """Qwen's tower names -> ours: the MLP's, and the patch kernel summed over its frames."""
    kernel = state.get(PATCH_KEY)
    if kernel is None or kernel.dim() != 5:
        raise CheckpointError(f"{name}'s patch embedding is not the (D, C, frames, p, p) kernel of Qwen-VL's tower")
    converted = {}
    for key, value in state.items():
        for old, new in _RENAMES.items():
            key = key.replace(old, new)
        converted[key] = value  # (".norm." only in a merger: a block's are norm1, norm2)
    # A picture is temporal_patch_size identical frames: the Conv3d over them is the Conv2d of the summed kernel.
    converted[PATCH_KEY] = kernel.sum(dim=2)
    return converted


def _blocks(vision: dict, key: str, depth: int, name: str, default: tuple) -> tuple[int, ...]:
    blocks = vision.get(key, default)
    if not isinstance(blocks, (list, tuple)) or not all(
        isinstance(block, int) and not isinstance(block, bool) and 0 <= block < depth for block in blocks
    ):
        raise CheckpointError(f"{name}'s {key} {_brief(blocks)} are not blocks of its {depth}")
    return tuple(blocks)


def settings(folder: Path, hf_config: dict, name: str) -> dict:
    """The config fields of the folder's tower that its tensors do not tell (from its config.json
    and preprocessor_config.json), each checked; the catalogue checks a download's against its entry's."""
    qwen3 = hf_config["model_type"] == "qwen3_vl"
    family = "Qwen3-VL" if qwen3 else "Qwen2.5-VL"
    vision = hf_config.get("vision_config")
    if not isinstance(vision, dict):
        raise CheckpointError(f"{name} is a {family} model without a vision_config")
    depth = _whole(vision, "depth", name, high=MAX_BLOCKS)
    heads = _whole(vision, "num_heads", name, high=1024)
    patch = _whole(vision, "patch_size", name, 16 if qwen3 else 14, high=64)
    merge = _whole(vision, "spatial_merge_size", name, 2, high=8)
    activation = "gelu_pytorch_tanh" if qwen3 else "silu"
    if vision.get("hidden_act", activation) != activation:
        raise CheckpointError(
            f"{name}'s vision MLP uses {_brief(vision.get('hidden_act'))}; {family}'s towers use {activation}, the one we compared"
        )
    rope = vision.get("rope_parameters") or {}
    theta = rope.get("rope_theta", 10000.0) if isinstance(rope, dict) else None
    if not isinstance(rope, dict) or rope.get("rope_type", "axial") != "axial" or isinstance(theta, bool) \
            or not isinstance(theta, numbers.Real) or not 0 < theta < 1e12:
        raise CheckpointError(f"{name}'s vision rope_parameters are not {family}'s axial rotary positions")
    min_pixels, max_pixels, mean, std, source = _preprocessing(folder, name, qwen3)
    factor = patch * merge
    fields = {
        "num_heads": heads, "patch_size": patch, "class_token": False, "global_pool": "mean", "rope_type": "axial",
        "rope_temperature": float(theta), "layer_norm_eps": 1e-6, "spatial_merge_size": merge,
        "merger_dim": _whole(vision, "out_hidden_size", name, high=2**16), "pixel_budget": (min_pixels, max_pixels),
        "depth": depth, "language_model_layer": depth, "mean": mean, "std": std, "normalization_source": source,
    }
    if qwen3:
        positions = _whole(vision, "num_position_embeddings", name, 2304, high=256 * 256)
        side = math.isqrt(positions)
        if side * side != positions:
            raise CheckpointError(f"{name}'s num_position_embeddings {positions} is no square grid of positions")
        return {
            **fields, "image_size": side * patch, "abs_pos_embed": True, "pos_embed_interpolation": "bilinear_corners",
            "act_layer": "gelu_tanh", "deepstack_layers": _blocks(vision, "deepstack_visual_indexes", depth, name, (8, 16, 24)),
        }
    window = _whole(vision, "window_size", name, 112)
    if window % factor:
        raise CheckpointError(f"{name}'s window_size {window} is not a whole number of {factor}-pixel merged patches")
    if window > math.isqrt(max_pixels):
        raise CheckpointError(
            f"{name}'s window of {window} x {window} pixels is larger than the grid of any picture its"
            f" pixel budget allows (at most {max_pixels:,} pixels)"
        )
    return {
        **fields, "image_size": smart_resize(DEFAULT_SIDE, DEFAULT_SIDE, factor, min_pixels, max_pixels),
        "abs_pos_embed": False, "norm_layer": "rmsnorm", "attn_window": window // patch,
        "full_attention_blocks": _blocks(vision, "fullatt_block_indexes", depth, name, ()),
    }


def _preprocessing(folder: Path, name: str, qwen3: bool) -> tuple[int, int, list, list, str]:
    """(min_pixels, max_pixels, mean, std, where they came from) of the folder's
    preprocessor_config.json (either spelling of the budget: min_pixels / max_pixels, or size's
    shortest_edge / longest_edge, which Qwen counts in pixels), else the processor's defaults
    (Qwen3-VL's publisher normalises with 0.5, not the processor's default CLIP values: assumed)."""
    if not os.path.lexists(folder / PREPROCESSOR):
        if qwen3:
            return (*DEFAULT_PIXELS, list(INCEPTION_MEAN), list(INCEPTION_STD), "assumed")
        return (*DEFAULT_PIXELS, list(OPENAI_CLIP_MEAN), list(OPENAI_CLIP_STD), "publisher: Qwen2-VL's image processor's defaults")
    settings = read_json(folder_file(folder, PREPROCESSOR, PREPROCESSOR), PREPROCESSOR, name)
    if not isinstance(settings, dict):
        raise CheckpointError(f"{PREPROCESSOR} in {name} is not a JSON object of settings")
    size = settings.get("size") if isinstance(settings.get("size"), dict) else {}
    budget = []
    for key, edge, default in (("min_pixels", "shortest_edge", DEFAULT_PIXELS[0]), ("max_pixels", "longest_edge", DEFAULT_PIXELS[1])):
        value = settings.get(key) or size.get(edge, default)
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 1 <= value <= MAX_PIXELS:
            raise CheckpointError(
                f"{PREPROCESSOR} in {name} has {key} {_brief(value)}; we read budgets of up to {MAX_PIXELS:,}"
                " pixels (Qwen2.5-VL's own)"
            )
        budget.append(int(value))
    if budget[0] > budget[1]:
        raise CheckpointError(f"{PREPROCESSOR} in {name} has min_pixels above max_pixels")
    mean, std = settings.get("image_mean", list(OPENAI_CLIP_MEAN)), settings.get("image_std", list(OPENAI_CLIP_STD))
    return budget[0], budget[1], mean, std, f"publisher: {PREPROCESSOR}"
