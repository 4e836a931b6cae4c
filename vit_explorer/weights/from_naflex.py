"""timm's NaFlexViT (``naflexvit_*``: NaViT's any aspect ratio with FlexiViT's resampled positions,
SigLIP 2's NaFlex encoders among them), read as our ViT at its own grid.

timm keeps the embedding in one module (``embeds.``): a Linear over each patch flattened row by
row with the channels innermost (or a Conv2d), the learned positions as a (1, gh, gw, D) table
resampled to each picture's grid (or "factorized": a table of rows and one of columns, each
resized linearly, summed), the registers without positions. A picture at any aspect ratio is
our ViT at that input size (weights.resize_model resamples the positions as timm does for each
picture); a batch of several grids is timm's padding with ``patch_valid``, which leaves every
real patch's tokens as the picture alone gives them (tests/weights/test_naflex.py).

No tensor says how the positions are resampled, nor the activation: both are told as timm's
registered models build them, from the structure. An attention pool without LayerScale and
registers is SigLIP 2's (``naflexvit_*_siglip``: tanh GELU, bilinear antialiased positions);
the others (``_gap``, ``_par_gap``, ``_parfac_gap``, ``_map``, So150M2's) GELU and bicubic.
Aspect-preserving positions (``_par_gap``) are in no tensor either: a timm folder's model_args or
its architecture's name tell them, a bare file's name (``..._par_gap...``) or
``pos_embed_ar_preserving=True``; factorized positions are always aspect-preserving in timm's
registry. C-RADIO's backbones (a class token, a
128 x 128 table whose resampling differs between releases) and the variants whose modules are not
a ViT's (rotary positions, an input norm) are refused in a sentence.
"""

from __future__ import annotations

import math

import torch

from ..model.config import INCEPTION_MEAN, INCEPTION_STD, _brief
from .checks import CheckpointError

# timm's create_transform(naflex=True) default max_seq_len, the sequence timm's in1k NaFlexViTs were
# evaluated at ("s576": 24 x 24 patches of 16).
DEFAULT_MAX_PATCHES = 576
# model_args a timm folder may give that we reproduce, and the values we have compared with timm
# (its antialiased bicubic or bilinear resampling); any other NaFlexVitCfg setting is refused.
_FOLDER_ARGS = {
    "pos_embed_ar_preserving": (True, False), "act_layer": ("gelu", "gelu_tanh"), "pos_embed_interp_mode": ("bicubic", "bilinear"),
}
# model_args that change nothing at inference or that the tensors check.
_HARMLESS_ARGS = {
    "num_classes", "embed_dim", "depth", "num_heads", "mlp_ratio", "init_values", "reg_tokens",
    "qkv_bias", "fc_norm", "drop_rate", "drop_path_rate", "proj_drop_rate", "attn_drop_rate", "pos_drop_rate",
    "patch_size", "img_size", "in_chans", "pos_embed_grid_size", "pos_embed",
}
_EMBEDS = {
    "embeds.proj.weight", "embeds.proj.bias", "embeds.pos_embed", "embeds.pos_embed_y", "embeds.pos_embed_x",
    "embeds.reg_token", "embeds.norm.weight", "embeds.norm.bias",
}


def recognises(state: dict[str, torch.Tensor]) -> bool:
    return "embeds.proj.weight" in state


def convert(state: dict[str, torch.Tensor], name: str, model_args: dict | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    """(our state dict, config fields the shapes cannot tell) of a NaFlexViT's tensors;
    ``model_args``: a timm folder's, checked."""
    _refuse_others(state, name)
    arguments = _folder_arguments(model_args or {}, name)
    kernel = _kernel(state["embeds.proj.weight"], name)
    patch = kernel.shape[-1]
    converted = {"patch_embed.proj.weight": kernel}
    if "embeds.proj.bias" in state:
        converted["patch_embed.proj.bias"] = state["embeds.proj.bias"]
    for suffix in ("weight", "bias"):
        if f"embeds.norm.{suffix}" in state:
            converted[f"patch_embed.norm.{suffix}"] = state[f"embeds.norm.{suffix}"]
    if "embeds.reg_token" in state:
        converted["reg_token"] = state["embeds.reg_token"]
    factorized = "embeds.pos_embed" not in state
    pos_embed = _factorized(state, name) if factorized else state["embeds.pos_embed"]
    if pos_embed.dim() != 4 or pos_embed.shape[0] != 1 or pos_embed.shape[-1] != kernel.shape[0]:
        raise CheckpointError(f"{name}'s position table has shape {tuple(pos_embed.shape)}, which no NaFlexViT's has")
    grid_h, grid_w = pos_embed.shape[1:3]
    converted["pos_embed"] = pos_embed.reshape(1, grid_h * grid_w, -1)
    converted.update({key: value for key, value in state.items() if not key.startswith("embeds.")})

    siglip = _siglip(state, name)
    if factorized:
        interpolation = "bilinear_no_antialias"
    else:
        interpolation = arguments.get("pos_embed_interp_mode", "bilinear" if siglip else "bicubic")
    family = "SigLIP 2's NaFlex encoder" if siglip else "timm's NaFlexViT"
    known = {
        "image_size": (grid_h * patch, grid_w * patch),
        "no_embed_class": True,
        "class_token": False,
        "act_layer": arguments.get("act_layer", "gelu_tanh" if siglip else "gelu"),
        "pos_embed_interpolation": interpolation,
        "pos_embed_ar_preserving": arguments.get("pos_embed_ar_preserving", factorized or _par_named(name)),
        "max_patches": DEFAULT_MAX_PATCHES,
        "mean": INCEPTION_MEAN, "std": INCEPTION_STD, "normalization_source": f"structure: {family} (timm's 0.5)",
        # timm's eval transform for it: the whole picture resized (ResizeToSequence), bicubic
        "resize_mode": "squash", "crop_pct": 1.0, "interpolation": "bicubic",
    }
    return converted, known


def _siglip(state: dict[str, torch.Tensor], name: str) -> bool:
    """Whether this is SigLIP 2's NaFlex encoder: its architecture's name says, else the structure
    (an attention pool without LayerScale and registers, as only timm's ``_siglip`` ones have)."""
    if "naflexvit_" in name:
        return "_siglip" in name
    return "attn_pool.latent" in state and "blocks.0.ls1.gamma" not in state and "embeds.reg_token" not in state


def _par_named(name: str) -> bool:
    """Whether a file's or architecture's name is one of timm's aspect-preserving NaFlexViTs'."""
    return "_par_" in name or "_parfac_" in name


def _refuse_others(state: dict[str, torch.Tensor], name: str) -> None:
    if "embeds.cls_token" in state:
        raise CheckpointError(
            f"{name} is a NaFlexViT with a class token (C-RADIO's kind), whose position resampling is in no"
            " tensor and differs between its releases; we do not load it"
        )
    if "embeds.norm_input.weight" in state:
        raise CheckpointError(f"{name} is a NaFlexViT with a norm on its input patches, which our ViT does not have")
    others = sorted(key for key in state if key.startswith("embeds.") and key not in _EMBEDS)
    if others or any(key.startswith("rope.") for key in state):
        found = others[0] if others else "rotary positions"
        raise CheckpointError(f"{name} is a NaFlexViT variant our ViT does not have ({_brief(found)[1:-1]})")
    if "embeds.pos_embed" not in state and not {"embeds.pos_embed_y", "embeds.pos_embed_x"} <= set(state):
        raise CheckpointError(
            f"{name} is a NaFlexViT without learned positions (rotary or none), which our ViT does not read"
        )


def _folder_arguments(model_args: dict, name: str) -> dict:
    """The NaFlex settings of a timm folder's model_args; any other setting we do not reproduce is refused."""
    other = sorted(key for key in model_args if key not in set(_FOLDER_ARGS) | _HARMLESS_ARGS)
    if other:
        raise CheckpointError(f"{name} is a NaFlexViT built with {_brief(other[0])[1:-1]}, a setting we have not compared with timm")
    arguments = {}
    for key, choices in _FOLDER_ARGS.items():
        if key in model_args:
            if not any(type(model_args[key]) is type(choice) and model_args[key] == choice for choice in choices):
                raise CheckpointError(
                    f"{name}'s {key} must be one of {', '.join(map(str, choices))} (those we have compared with timm),"
                    f" not {_brief(model_args[key])}"
                )
            arguments[key] = model_args[key]
    return arguments


def _kernel(weight: torch.Tensor, name: str) -> torch.Tensor:
    """The (D, C, p, p) convolution kernel of NaFlexViT's patch embedding: a Conv2d's as it is, a
    Linear's (D, p * p * C) over patches flattened (row, column, channel) laid out as one."""
    if weight.dim() == 4:
        return weight
    if weight.dim() != 2:
        raise CheckpointError(f"{name}'s patch embedding has shape {tuple(weight.shape)}, which no NaFlexViT's has")
    # p * p * 3 values a patch: an RGB picture's (one channel would give p * p, never 3 times a square)
    side = math.isqrt(weight.shape[1] // 3)
    if weight.shape[1] % 3 or side * side * 3 != weight.shape[1]:
        raise CheckpointError(
            f"{name}'s patch embedding reads {weight.shape[1]} values a patch, not those of a square RGB patch"
        )
    return weight.reshape(weight.shape[0], side, side, 3).permute(0, 3, 1, 2).contiguous()


def _factorized(state: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """(1, gh, gw, D): the factorized tables summed over the grid. timm resizes each table linearly
    and sums them; the sum resized bilinearly (no antialiasing) is the same, to float rounding."""
    rows, columns = state["embeds.pos_embed_y"], state["embeds.pos_embed_x"]
    if rows.dim() != 3 or columns.dim() != 3 or rows.shape[0] != 1 or columns.shape[0] != 1 or rows.shape[2] != columns.shape[2]:
        raise CheckpointError(
            f"{name}'s factorized positions have shapes {tuple(rows.shape)} and {tuple(columns.shape)}, which no NaFlexViT's have"
        )
    return rows[:, :, None, :] + columns[:, None, :, :]


def sequence_size(height: int, width: int, patch: int, max_patches: int) -> tuple[int, int]:
    """(height, width) timm's NaFlex eval transform resizes a height x width picture to
    (``get_image_size_for_seq``): the largest scale, found by the same bisection, whose sides
    rounded up to multiples of ``patch`` give at most ``max_patches`` patches; at least one a side."""

    def target(ratio: float) -> tuple[int, int]:
        scaled = [patch * math.ceil(side * ratio / patch) for side in (height, width)]
        return int(max(scaled[0], patch)), int(max(scaled[1], patch))

    def fits(ratio: float) -> bool:
        target_h, target_w = target(ratio)
        return (target_h // patch) * (target_w // patch) <= max_patches

    eps = 1e-5
    low, high = eps / 10.0, 100.0
    while high - low >= eps:
        middle = (low + high) / 2.0
        low, high = (middle, high) if fits(middle) else (low, middle)
    if not eps < low < 100.0:
        raise ValueError(f"a {width}x{height} picture cannot be fitted into {max_patches} patches")
    return target(low)
