"""torchvision's ViTs (torchvision.models.VisionTransformer): their state dicts renamed to ours,
and the ImageNet-pretrained ones downloaded into torchvision's own cache."""

from __future__ import annotations

import math
import pickle
import re

import torch

from ..model.config import IMAGENET_MEAN, IMAGENET_STD
from . import catalogue
from .checks import CheckpointError

TORCHVISION_VITS = ("vit_b_16", "vit_b_32", "vit_l_16", "vit_l_32", "vit_h_14")


def recognises(state: dict[str, torch.Tensor]) -> bool:
    return "conv_proj.weight" in state or "encoder.pos_embedding" in state


def convert(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict]:
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


def read_pretrained(name: str, progress=None) -> tuple[dict[str, torch.Tensor], dict]:
    """(our state dict, config fields) of torchvision's ImageNet-pretrained ViT ``name``."""
    import torchvision.models

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
    converted, known = convert(state)
    known.update(
        image_size=weights.meta["min_size"][0], class_names=tuple(weights.meta["categories"])
    )
    return converted, {**known, **_transform(weights.transforms())}


def _transform(transform) -> dict:
    """torchvision's ImageClassification on a picture (PIL's filters): the shorter side resized to
    resize_size, the centre cropped to crop_size, as ViTConfig fields."""
    crop, resize = transform.crop_size[0], transform.resize_size[0]
    crop_pct = crop / resize
    assert math.floor(crop / crop_pct) == resize, (crop, resize)  # the crop_pct arithmetic gives it back
    return {"resize_mode": "shortest", "crop_pct": crop_pct, "interpolation": transform.interpolation.value}
