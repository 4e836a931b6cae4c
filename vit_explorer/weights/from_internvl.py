"""InternVL's vision tower (InternViT-300M) from a whole InternVL folder as transformers 5 writes
it (``InternVLForConditionalGeneration``): only the tower's tensors are read (from_vlm.read_tower).

Its layers are timm's ViT with LayerScale (``lambda_1``, ``lambda_2``), separate q, k, v
projections (joined into our qkv), LayerNorms before attention and MLP, and no final norm when it
pools by the mean (``use_mean_pooling``: what InternVL's towers do). What its language model reads:
``vision_feature_layer`` (the last layer's output) without the class token, every 2 x 2 square of
patch tokens joined into one vector by the projector's pixel shuffle (``downsample_ratio`` 0.5):
(448 / 14 / 2)^2 = 256 image tokens a tile. InternViT-6B's q-k RMSNorms and the RMSNorm layers are
refused in a sentence (not compared with their reference).
"""
from __future__ import annotations

import math
from pathlib import Path

import torch

from ..model.config import IMAGENET_MEAN, IMAGENET_STD, _brief
from . import from_vlm
from .checks import MAX_BLOCKS, CheckpointError

MODEL_TYPE = "internvl"
PREFIXES = ("model.vision_tower.", "vision_tower.")
PATCH_KEY = "embeddings.patch_embeddings.projection.weight"
_RENAMES = {
    "embeddings.cls_token": "cls_token", "embeddings.position_embeddings": "pos_embed",
    "embeddings.patch_embeddings.projection.": "patch_embed.proj.", "encoder.layer.": "blocks.",
    ".attention.projection_layer.": ".attn.proj.", ".layernorm_before.": ".norm1.", ".layernorm_after.": ".norm2.",
    ".lambda_1": ".ls1.gamma", ".lambda_2": ".ls2.gamma",
}


def recognises(hf_config: dict) -> bool:
    return hf_config.get("model_type") == MODEL_TYPE


def read(folder: Path, hf_config: dict, name: str) -> tuple[dict[str, torch.Tensor], dict]:
    """(our state dict, the config fields its tensors do not tell) of the folder's tower, its
    settings checked before any tensor is read."""
    known = _settings(hf_config, name)
    return convert(from_vlm.read_tower(folder, name, PREFIXES, PATCH_KEY), known["depth"], name), known


def _settings(hf_config: dict, name: str) -> dict:
    vision = hf_config.get("vision_config")
    if not isinstance(vision, dict) or vision.get("model_type") != "internvl_vision":
        raise CheckpointError(f"{name}'s vision_config is not an InternViT's (internvl_vision)")
    if vision.get("use_qk_norm", False) or vision.get("norm_type", "layer_norm") != "layer_norm":
        raise CheckpointError(
            f"{name}'s tower is InternViT-6B's kind (q-k norms, RMSNorm), which we have not compared with its"
            " reference; we read InternViT-300M's"
        )
    if vision.get("hidden_act", "gelu") != "gelu":
        raise CheckpointError(f"{name}'s tower uses the {str(vision.get('hidden_act'))[:20]!r} activation, not InternViT's GELU")
    image, patch = _pair(vision.get("image_size", 448), "image_size", name), _pair(vision.get("patch_size", 14), "patch_size", name)
    if patch[0] != patch[1] or image[0] % patch[0] or image[1] % patch[1]:
        raise CheckpointError(f"{name}'s tower has {patch[0]} x {patch[1]} patches, which do not tile its {image[0]} x {image[1]} images")
    depth = vision.get("num_hidden_layers", 24)
    heads = vision.get("num_attention_heads", 16)
    eps = vision.get("layer_norm_eps", 1e-6)
    if not _whole(depth, 1, MAX_BLOCKS) or not _whole(heads, 1, 4096) or not (isinstance(eps, float) and 0 < eps < 1):
        raise CheckpointError(f"{name}'s vision_config has no usable num_hidden_layers, num_attention_heads or layer_norm_eps")
    layer = hf_config.get("vision_feature_layer", -1)
    if not _whole(layer, -depth - 1, depth):
        raise CheckpointError(f"{name}'s vision_feature_layer {layer!r} is not one layer of its {depth}")
    ratio = hf_config.get("downsample_ratio", 0.5)
    shuffle = round(1 / ratio) if isinstance(ratio, float) and 0 < ratio <= 1 else 0
    grid = image[0] // patch[0], image[1] // patch[1]
    if shuffle < 1 or not math.isclose(shuffle * ratio, 1) or grid[0] % shuffle or grid[1] % shuffle:
        raise CheckpointError(f"{name}'s downsample_ratio {ratio!r} does not join its {grid[0]} x {grid[1]} patches into squares")
    final_norm = not vision.get("use_mean_pooling", True)
    # -1 is what the tower returns last (after its final norm, where it has one); others count its
    # hidden states (0 the embeddings).
    reads = depth + int(final_norm) if layer == -1 else layer % (depth + 1)
    return {
        "image_size": image, "depth": depth, "num_heads": heads, "layer_norm_eps": eps, "act_layer": "gelu",
        "final_norm": final_norm, "num_classes": 0,
        "language_model_layer": reads,
        "language_model_drops_class_token": hf_config.get("vision_feature_select_strategy", "default") == "default",
        "language_model_shuffle": shuffle,
        # InternVL's processor (GotOcr2ImageProcessor) normalises with ImageNet's mean and std.
        "mean": IMAGENET_MEAN, "std": IMAGENET_STD, "normalization_source": "publisher: InternVL's image processor",
    }


def convert(state: dict[str, torch.Tensor], depth: int, name: str) -> dict[str, torch.Tensor]:
    """InternVL's tower names -> ours: q, k and v joined (a k without a bias gets zeros, as timm's
    InternViT has one), LayerScale's lambdas as gammas; the mask token (pre-training's) left out."""
    converted = {}
    for key, value in state.items():
        if key == "embeddings.mask_token" or any(part in key for part in (".q_proj.", ".k_proj.", ".v_proj.")):
            continue
        for old, new in _RENAMES.items():
            key = key.replace(old, new)
        converted[key] = value
    for block in range(depth):
        prefix = f"encoder.layer.{block}.attention."
        try:
            converted[f"blocks.{block}.attn.qkv.weight"] = torch.cat([state[f"{prefix}{p}_proj.weight"] for p in "qkv"])
        except KeyError:
            raise CheckpointError(f"{name}'s tower lacks block {block}'s q, k or v projection") from None
        biases = [state.get(f"{prefix}{p}_proj.bias") for p in "qkv"]
        if any(bias is not None for bias in biases):
            width = converted[f"blocks.{block}.attn.qkv.weight"].shape[1]
            converted[f"blocks.{block}.attn.qkv.bias"] = torch.cat([
                bias if bias is not None else torch.zeros(width) for bias in biases
            ])
    return converted


def _pair(value, what: str, name: str) -> tuple[int, int]:
    pair = (value, value) if isinstance(value, int) else tuple(value) if isinstance(value, (list, tuple)) else ()
    if len(pair) != 2 or not all(_whole(side, 1, 8192) for side in pair):
        raise CheckpointError(f"{name}'s vision_config {what} {_brief(value)} is not a size from 1 to 8,192 px")
    return pair


def _whole(value, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high
