"""timm's ViT state dicts (VisionTransformer): their parameter names are ours; and timm's Hub
folders (``save_for_hf`` / ``push_to_hub``: config.json naming the architecture, beside the weights).

A timm family whose modules differ from VisionTransformer's has a reader of its own, recognised
before this fallback (weights._convert): Eva's (DINOv3, EVA-02) is from_eva.py.
"""

from __future__ import annotations

import torch

from ..model.config import IMAGENET_MEAN, _brief, _is_number
from . import from_eva, from_naflex
from .checks import CheckpointError

DEFAULT_CROP_PCT = 0.875  # timm's, where a pretrained_cfg gives none

# What a timm folder's config.json says that the tensors cannot, or claims that they check.
_FOLDER_ARGS = ("num_heads", "depth", "embed_dim")


def convert(state: dict[str, torch.Tensor], name: str) -> tuple[dict[str, torch.Tensor], dict]:
    """(our state dict, config fields the shapes cannot tell): nothing to rename or add; the mean
    and std are what the structure tells, else timm's default (normalization.py). A Perception
    Encoder core's head is its projection into its text tower's space, not classes: it is left
    out, and the model's output is the pooled vector (timm's pre-logits)."""
    if from_eva.perception_encoder(state, name) is not None:
        return {key: value for key, value in state.items() if not key.startswith("head.")}, {}
    return dict(state), {}


def is_folder_config(config: dict) -> bool:
    """Whether a folder's config.json is timm's (an architecture, no transformers model_type)."""
    return isinstance(config.get("architecture"), str) and "model_type" not in config


def convert_folder(
    state: dict[str, torch.Tensor], timm_config: dict, folder_name: str
) -> tuple[dict[str, torch.Tensor], dict]:
    """A timm folder's weights, its architecture's name telling the family (from_eva) and its
    model_args and pretrained_cfg the heads and mean/std; every value is checked as a ViTConfig
    field, and depth and width against the tensors (infer.py)."""
    name = f"{folder_name} ({timm_config['architecture'][:60]})"
    arguments, pretrained = timm_config.get("model_args"), timm_config.get("pretrained_cfg")
    naflex = from_naflex.recognises(state)
    if naflex:
        converted, known = from_naflex.convert(state, name, arguments if isinstance(arguments, dict) else None)
    elif from_eva.recognises(state):
        converted, known = from_eva.convert(state, name)
    else:
        converted, known = convert(state, name)
    if isinstance(arguments, dict):
        known.update({field: arguments[field] for field in _FOLDER_ARGS if field in arguments})
    if isinstance(pretrained, dict) and ("mean" in pretrained or "std" in pretrained):
        known.update({field: pretrained[field] for field in ("mean", "std") if field in pretrained})
        known["normalization_source"] = "publisher: timm's pretrained_cfg"
    if naflex:  # its transform is timm's ResizeToSequence, its grid its table's (from_naflex): no input size
        return converted, known
    if isinstance(pretrained, dict):
        known.update(transform(pretrained, known.get("mean"), name))
    size = _input_size(arguments, pretrained, name)
    if size is not None:
        known["image_size"] = size
    return converted, known


def _input_size(arguments, pretrained, name: str):
    """The input timm builds the model for (model_args' img_size, else pretrained_cfg's
    input_size): SigLIP So400m/14's 384 px, of which its convolution reads 378."""
    size = arguments.get("img_size") if isinstance(arguments, dict) else None
    if size is None and isinstance(pretrained, dict) and pretrained.get("input_size") is not None:
        input_size = pretrained["input_size"]
        if not (isinstance(input_size, list) and len(input_size) == 3):
            raise CheckpointError(f"{name}'s pretrained_cfg input_size must be [channels, height, width], not {_brief(input_size)}")
        size = input_size[1:]
    if size is None:
        return None
    sides = [size, size] if isinstance(size, int) else size
    if not (isinstance(sides, list) and len(sides) == 2 and all(isinstance(side, int) and not isinstance(side, bool) and 0 < side <= 8192 for side in sides)):
        raise CheckpointError(f"{name}'s input size must be a height and width in pixels up to 8192, not {_brief(size)}")
    return sides[0] if sides[0] == sides[1] else tuple(sides)


_CROP_MODES = {"center": "shortest", "squash": "squash", "border": "longest"}


def transform(pretrained: dict, mean, name: str) -> dict:
    """timm's eval transform (resolve_data_config, then create_transform) from a pretrained_cfg,
    timm's defaults where a key is missing (crop_pct 0.875, centre crop, bicubic), as ViTConfig
    fields; a value timm would not build, or that we do not reproduce, is refused in a sentence."""
    crop_pct = pretrained.get("crop_pct") or DEFAULT_CROP_PCT
    crop_mode = pretrained.get("crop_mode") or "center"
    interpolation = pretrained.get("interpolation") or "bicubic"
    if not _is_number(crop_pct) or not 0.25 <= crop_pct <= 1:
        raise CheckpointError(f"{name}'s pretrained_cfg crop_pct must be a number between 0.25 and 1, not {_brief(crop_pct)}")
    if not isinstance(crop_mode, str) or crop_mode not in _CROP_MODES:
        raise CheckpointError(f"{name}'s pretrained_cfg crop_mode must be center, squash or border, not {_brief(crop_mode)}")
    if not isinstance(interpolation, str) or interpolation not in ("bicubic", "bilinear", "nearest"):
        raise CheckpointError(f"{name}'s pretrained_cfg interpolation must be bicubic, bilinear or nearest, not {_brief(interpolation)}")
    fields = {"resize_mode": _CROP_MODES[crop_mode], "crop_pct": float(crop_pct), "interpolation": interpolation}
    if crop_mode == "border":  # padded with the mean colour, as timm pads
        mean = mean if isinstance(mean, (list, tuple)) and all(map(_is_number, mean)) else IMAGENET_MEAN
        fields["fill_color"] = tuple(min(max(round(255 * value), 0), 255) for value in mean)
    return fields
