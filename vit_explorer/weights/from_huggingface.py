"""Hugging Face transformers ViTs: a model folder (config.json, preprocessor_config.json, weights
in one file or shards) or a weights file beside its config.json. ViT, DeiT, DINOv2 (with
registers), DINOv3 (rotary positions, gated MLP) and the image towers of CLIP, SigLIP and
SigLIP 2 are converted to our names. SigLIP 2's own model type (NaFlex) embeds flattened patches
of any aspect ratio with a Linear and resizes its square grid of positions to each image's; at
that grid (a square image of sqrt(num_patches) patches a side) it is our ViT with that Linear
as the patch convolution, and another size resamples the grid as transformers does (bilinear,
antialiased).

A folder is untrusted like any upload: each config.json setting read is checked (_HF_SETTINGS)
and every file the folder names must lie inside it (checks.folder_file). Another model type is
added to HF_MODEL_TYPES with its renames (and prefix), its unsupported variants refused in
_refuse_unsupported.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from pathlib import Path

import torch

from ..model.config import _brief, _is_number
from .checks import MAX_TENSORS, CheckpointError, folder_file, read_json, read_tensors
from .from_eva import DINOV3

HF_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
HF_SHARD_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")

# Hugging Face model types we convert; the full CLIP / SigLIP models contribute their image tower.
HF_MODEL_TYPES = (
    "vit", "deit", "dinov2", "dinov2_with_registers", "dinov3_vit",
    "clip", "clip_vision_model", "siglip", "siglip_vision_model", "siglip2", "siglip2_vision_model",
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
# DINOv3ViTModel: transformers 5 modules nest the layers under model., files keep layer.N.
_HF_DINOV3_RENAMES = [
    (r"^embeddings\.cls_token$", "cls_token"),
    (r"^embeddings\.register_tokens$", "reg_token"),
    (r"^embeddings\.patch_embeddings\.", "patch_embed.proj."),
    (r"^(?:model\.)?layer\.(\d+)\.", r"blocks.\1."),
    (r"\.attention\.o_proj\.", ".attn.proj."),
    (r"\.layer_scale(1|2)\.lambda1$", r".ls\1.gamma"),
    (r"\.mlp\.gate_proj\.", ".mlp.fc1_g."),
    (r"\.mlp\.down_proj\.", ".mlp.fc2."),
]
_HF_DINOV3_QKV = re.compile(r"^(?:model\.)?layer\.(\d+)\.attention\.(q|k|v)_proj\.(weight|bias)$")
# Our linear layers that always have a bias (DINOv3's proj_bias and mlp_bias may be off: zeros).
_BIASED = re.compile(r"^blocks\.\d+\.(attn\.proj|mlp\.fc1|mlp\.fc1_g|mlp\.fc1_x|mlp\.fc2)\.weight$")
_HF_SEPARATE_QKV = re.compile(
    r"^(?:encoder\.layer|layers|encoder\.layers)\.(\d+)\.(?:attention\.(?:attention\.)?|self_attn\.)"
    r"(query|key|value|q_proj|k_proj|v_proj)\.(weight|bias)$"
)
# The prefix of the encoder's keys in a model with a head (ViTForImageClassification: vit.*);
# CLIP's and SigLIP's towers are vision_model.*.
_HF_PREFIXES = {"vit": "vit.", "deit": "deit.", "dinov2": "dinov2.", "dinov2_with_registers": "dinov2."}


def recognises(state: Mapping[str, torch.Tensor]) -> bool:
    """Whether a lone weights file holds a Hugging Face model (its config.json lies beside it)."""
    return any(
        re.match(r"^(?:(?:vit|deit|dinov2|vision_model)\.)?embeddings\.patch_embeddings?\.", key)
        for key in state
    )


def convert(
    state: dict[str, torch.Tensor], hf_config: dict, name: str
) -> tuple[dict[str, torch.Tensor], dict]:
    """(our state dict, config fields the shapes cannot tell) of a Hugging Face model's weights,
    given its settings (:func:`read_config`)."""
    try:
        return _convert(state, hf_config)
    except (RuntimeError, IndexError):  # q, k and v (or SigLIP's pool) that do not fit together
        raise CheckpointError(f"{name}'s tensors do not fit together as a Hugging Face ViT's") from None


def _convert(
    state: dict[str, torch.Tensor], hf_config: dict
) -> tuple[dict[str, torch.Tensor], dict]:
    model_type = _hf_setting(hf_config, "model_type", "vit")
    if model_type not in HF_MODEL_TYPES:
        raise CheckpointError(
            f"Hugging Face model type {model_type!r} is not supported; we read"
            f" {', '.join(HF_MODEL_TYPES)}"
        )
    if model_type == "dinov3_vit":
        converted, known = _dinov3(state, hf_config)
        known.update(_settings(hf_config, converted))
        return converted, known
    tower = model_type.startswith(("clip", "siglip"))
    if model_type in ("clip", "siglip", "siglip2"):  # the whole model: its settings for the image tower
        hf_config = {**hf_config, **_hf_setting(hf_config, "vision_config", {})}
        state = {
            key.removeprefix("vision_model."): value
            for key, value in state.items()
            if key.startswith("vision_model.")
        }
    activation = _hf_setting(hf_config, "hidden_act", "gelu")
    _refuse_unsupported(model_type, activation, hf_config, state)

    state = {key.removeprefix(_HF_PREFIXES.get(model_type, "vision_model.")): value for key, value in state.items()}
    converted = _renamed(state, _HF_TOWER_RENAMES if tower else _HF_VIT_RENAMES)
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
        if model_type.startswith("siglip2"):
            _siglip2_patches(converted, hf_config)
            # Siglip2VisionEmbeddings resizes its grid to each picture's bilinearly, antialiased (not bicubic)
            known["pos_embed_interpolation"] = "bilinear"
    if model_type == "dinov2_with_registers" and "cls_token" in converted and "pos_embed" in converted:
        _fold_class_position(converted)
        known["no_embed_class"] = True
    known.update(_settings(hf_config, converted))
    return converted, known


def _dinov3(state: dict[str, torch.Tensor], hf_config: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """DINOv3ViTModel's weights under our names: q, k, v fused (a missing bias is zeros, as the
    keys' is), up_proj the MLP's fc1 (gated: its value fc1_x beside the gate fc1_g). Its settings
    are claims checked against the tensors: depth, width, registers, MLP width and gate."""
    gated = any(".mlp.gate_proj." in key for key in state)
    if gated != bool(_hf_setting(hf_config, "use_gated_mlp", False)):
        raise CheckpointError(f"config.json's use_gated_mlp does not say what the tensors hold (gated: {gated})")
    activation = _hf_setting(hf_config, "hidden_act", "gelu")
    if (activation != "silu") if gated else (activation not in HF_ACTIVATIONS):
        raise CheckpointError(f"DINOv3 with a {'gated' if gated else 'plain'} MLP of {activation!r} is not supported")
    renames = [*_HF_DINOV3_RENAMES, (r"\.mlp\.up_proj\.", ".mlp.fc1_x." if gated else ".mlp.fc1.")]
    converted: dict[str, torch.Tensor] = {}
    projections: dict[str, dict[tuple[str, str], torch.Tensor]] = {}
    for key, value in state.items():
        if key == "embeddings.mask_token" or (key == "embeddings.register_tokens" and value.numel() == 0):
            continue
        found = _HF_DINOV3_QKV.match(key)
        if found:
            projections.setdefault(found.group(1), {})[found.group(2, 3)] = value
            continue
        for pattern, replacement in renames:
            key = re.sub(pattern, replacement, key)
        converted[key] = value
    for block, parts in projections.items():
        if not all((role, "weight") in parts for role in "qkv"):
            raise CheckpointError(f"the Hugging Face checkpoint lacks part of layer {block}'s q, k and v")
        converted[f"blocks.{block}.attn.qkv.weight"] = torch.cat([parts[role, "weight"] for role in "qkv"])
        if any(kind == "bias" for _, kind in parts):
            biases = [parts.get((role, "bias"), parts[role, "weight"].new_zeros(parts[role, "weight"].shape[0])) for role in "qkv"]
            converted[f"blocks.{block}.attn.qkv.bias"] = torch.cat(biases)
    for key in [key for key in converted if _BIASED.match(key)]:
        converted.setdefault(key.removesuffix("weight") + "bias", converted[key].new_zeros(converted[key].shape[0]))
    fc2 = converted.get("blocks.0.mlp.fc2.weight")
    width = _hf_setting(hf_config, "intermediate_size")
    if fc2 is not None and width is not None and fc2.dim() == 2 and width != fc2.shape[1]:
        raise CheckpointError(f"config.json's intermediate_size {width} is not its tensors' MLP width {fc2.shape[1]}")
    claims = {
        "depth": _hf_setting(hf_config, "num_hidden_layers"), "embed_dim": _hf_setting(hf_config, "hidden_size"),
        "reg_tokens": _hf_setting(hf_config, "num_register_tokens"),
    }
    known = {
        **DINOV3, **{field: value for field, value in claims.items() if value is not None},
        "layer_norm_eps": float(_hf_setting(hf_config, "layer_norm_eps", 1e-5)),
        "rope_temperature": float(_hf_setting(hf_config, "rope_theta", 100.0)),
    }
    return converted, known


def _refuse_unsupported(model_type: str, activation: str, hf_config: dict, state: dict) -> None:
    """Variants of a supported model type that our ViT does not compute, each in one sentence."""
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


def _renamed(state: dict[str, torch.Tensor], renames: list) -> dict[str, torch.Tensor]:
    """``state`` (its model prefix removed) under our names, q, k and v merged into qkv."""
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
    return converted


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


def _siglip2_patches(converted: dict[str, torch.Tensor], hf_config: dict) -> None:
    """SigLIP 2 (NaFlex) embeds each patch flattened as (row, column, channel) with a Linear:
    the same numbers as our (channel, row, column) convolution."""
    weight = converted.get("patch_embed.proj.weight")
    patch = _hf_setting(hf_config, "patch_size", 16)
    if weight is None or weight.dim() != 2 or weight.shape[1] % (patch * patch):
        raise CheckpointError(f"SigLIP 2's patch embedding does not take patches of {patch} x {patch} pixels")
    channels = weight.shape[1] // (patch * patch)
    converted["patch_embed.proj.weight"] = weight.reshape(-1, patch, patch, channels).permute(0, 3, 1, 2).contiguous()


def _fold_class_position(converted: dict[str, torch.Tensor]) -> None:
    """Registers get no position embedding but the class token does: fold the class token's
    into the token itself, as timm's DINOv2 layout (no_embed_class) does."""
    class_position = converted["pos_embed"][:, :1]
    if converted["cls_token"].shape != class_position.shape:  # an addition must not broadcast
        raise CheckpointError(
            "the Hugging Face checkpoint's class token and position embeddings do not fit"
        )
    converted["cls_token"] = converted["cls_token"] + class_position
    converted["pos_embed"] = converted["pos_embed"][:, 1:]


def _settings(hf_config: dict, converted: dict[str, torch.Tensor]) -> dict:
    """The ViTConfig fields config.json gives: heads, image size, mean/std and class names."""
    known = {}
    for ours, theirs in (
        ("num_heads", "num_attention_heads"), ("image_size", "image_size"),
        ("mean", "image_mean"), ("std", "image_std"),
    ):
        if theirs in hf_config:
            value = _hf_setting(hf_config, theirs)
            known[ours] = tuple(value) if isinstance(value, list) else value
    if "mean" in known or "std" in known:
        known["normalization_source"] = "publisher: Hugging Face's preprocessor config"
    known.update(transform(hf_config))
    labels = _hf_setting(hf_config, "id2label", {}) or {}
    num_classes = converted["head.weight"].shape[0] if "head.weight" in converted else 0
    names = [labels.get(str(index)) for index in range(num_classes)]
    if any(name is not None and not isinstance(name, str) for name in names):
        raise CheckpointError("config.json's id2label must map class numbers to names (strings)")
    # transformers fills id2label with LABEL_0, LABEL_1, ... when nobody named the classes.
    if num_classes and all(names) and names != [f"LABEL_{index}" for index in range(num_classes)]:
        known["class_names"] = tuple(names)
    return known


# ----------------------------------------------------------------------------- the image processor

# transformers' image processors whose resize and crop we reproduce (data/transforms.py: their
# torchvision backend, transformers 5's default), with their class defaults where the file gives
# none: the filter, whether a size given as one number is the square's side (default_to_square),
# whether they crop the centre, and the library (DINOv3's rescales to floats before resizing).
_PROCESSORS = {
    "CLIPImageProcessor": (3, False, True, "transformers"), "BitImageProcessor": (3, False, True, "transformers"),
    "DeiTImageProcessor": (3, True, True, "transformers"), "SiglipImageProcessor": (3, False, False, "transformers"),
    "ViTImageProcessor": (2, True, False, "transformers"), "DINOv3ViTImageProcessor": (2, True, False, "transformers-float"),
    "LlavaImageProcessor": (3, False, True, "transformers"),  # CLIP's, with do_pad: LLaVA's pad to square
}
_RESAMPLE = {0: "nearest", 2: "bilinear", 3: "bicubic"}  # PIL's codes, as preprocessor_config.json writes them


def _sides(value, what: str) -> dict:
    if _whole(value):
        return {"number": value}
    if isinstance(value, dict) and value and set(value) <= {"height", "width", "shortest_edge"} \
            and all(map(_whole, value.values())):
        return value
    raise CheckpointError(f"preprocessor_config.json's {what} must be a number of pixels or height and width, not {_brief(value)}")


def transform(hf_config: dict) -> dict:
    """The eval transform of a folder's image processor (preprocessor_config.json) as ViTConfig
    fields: CLIP's (the shorter side resized, the centre cropped), SigLIP's and ViT's (resized to
    a size: squashed); nothing where the file gives no size (the whole picture, ours). A setting
    we do not reproduce is refused in a sentence. SigLIP 2's NaFlex processor, beside its tower,
    sizes each picture (its aspect ratio kept, at most max_num_patches patches: ViTConfig.max_patches,
    timm's rule)."""
    siglip2 = str(hf_config.get("model_type", "")).startswith("siglip2")
    if siglip2 and hf_config.get("image_processor_type") in ("Siglip2ImageProcessor", "Siglip2ImageProcessorFast"):
        return _siglip2_transform(hf_config)  # compared with transformers for SigLIP 2's towers only
    if "size" not in hf_config:
        return {}
    # Older folders name a feature extractor (openai/clip-vit-base-patch32's CLIPFeatureExtractor).
    kind = hf_config.get("image_processor_type", hf_config.get("feature_extractor_type"))
    kind = kind.removesuffix("Fast").replace("FeatureExtractor", "ImageProcessor") if isinstance(kind, str) else kind
    if not isinstance(kind, str) or kind not in _PROCESSORS:
        raise CheckpointError(
            f"preprocessor_config.json's image processor {_brief(kind)} is not one we reproduce ({', '.join(_PROCESSORS)})"
        )
    default_resample, square, centre_crop, library = _PROCESSORS[kind]
    for flag in ("do_resize", "do_center_crop", "do_rescale", "do_normalize"):
        if flag in hf_config and not isinstance(hf_config[flag], bool):
            raise CheckpointError(f"preprocessor_config.json's {flag} must be true or false, not {_brief(hf_config[flag])}")
    if not hf_config.get("do_resize", True) or not hf_config.get("do_rescale", True) or not hf_config.get("do_normalize", True):
        raise CheckpointError("preprocessor_config.json turns off resizing, rescaling or normalising, which we do not reproduce")
    factor = hf_config.get("rescale_factor", 1 / 255)
    if not _is_number(factor) or abs(factor * 255 - 1) > 1e-6:
        raise CheckpointError(f"preprocessor_config.json's rescale_factor must be 1/255, not {_brief(factor)}")
    resample = hf_config.get("resample", default_resample)
    if not isinstance(resample, int) or isinstance(resample, bool) or resample not in _RESAMPLE:
        raise CheckpointError(f"preprocessor_config.json's resample must be 0, 2 or 3 (nearest, bilinear, bicubic), not {_brief(resample)}")
    size = _sides(hf_config["size"], "size")
    if "number" in size:
        size = {"height": size["number"], "width": size["number"]} if square else {"shortest_edge": size["number"]}
    crop = None
    if hf_config.get("do_center_crop", centre_crop):
        crop = _sides(hf_config.get("crop_size", 224), "crop_size")
        crop = (crop["number"],) * 2 if "number" in crop else (crop.get("height"), crop.get("width"))
    fields = {"interpolation": _RESAMPLE[resample], "transform_library": library}
    if set(size) == {"shortest_edge"} and crop is not None and crop[0] == crop[1]:
        fields.update(resize_mode="shortest", crop_pct=crop[0] / size["shortest_edge"])
        scale = size["shortest_edge"]
    elif set(size) == {"height", "width"} and size["height"] == size["width"] and (crop is None or crop[0] == crop[1]):
        fields.update(resize_mode="squash", crop_pct=1.0 if crop is None else crop[0] / size["height"])
        scale = size["height"]
    else:
        raise CheckpointError(
            f"preprocessor_config.json's size {_brief(hf_config['size'])} and crop_size {_brief(crop)} do not make a square"
            " input we reproduce"
        )
    if not 0.25 <= fields["crop_pct"] <= 1 or math.floor(crop[0] / fields["crop_pct"] if crop else scale) != scale:
        raise CheckpointError(f"preprocessor_config.json's crop_size {_brief(crop)} must fit inside its size {_brief(hf_config['size'])}")
    if kind == "LlavaImageProcessor" and hf_config.get("do_pad", False) is not False:
        mean = hf_config.get("image_mean")
        if hf_config["do_pad"] is not True or fields["resize_mode"] != "shortest" or not (
                isinstance(mean, list) and len(mean) == 3 and all(_is_number(value) and 0 <= value <= 1 for value in mean)):
            raise CheckpointError("preprocessor_config.json's do_pad must be true or false, with the shorter side resized and three image_mean values")
        # Pasted on the mean colour truncated to bytes, as LlavaImageProcessor pads.
        fields.update(resize_mode="pad_square", fill_color=tuple(int(value * 255) for value in mean))
    return fields


def _siglip2_transform(hf_config: dict) -> dict:
    """Siglip2ImageProcessor as ViTConfig fields: the whole picture resized (bilinear unless told)
    to at most max_num_patches patches of the model's size, as transformers resizes (read_config
    lets config.json's patch_size win over the processor's)."""
    patches = hf_config.get("max_num_patches", 256)
    if not _whole(patches) or patches > 2**16:
        raise CheckpointError(f"preprocessor_config.json's max_num_patches must be a whole number up to 65,536, not {_brief(patches)}")
    resample = hf_config.get("resample", 2)
    if not isinstance(resample, int) or isinstance(resample, bool) or resample not in _RESAMPLE:
        raise CheckpointError(f"preprocessor_config.json's resample must be 0, 2 or 3 (nearest, bilinear, bicubic), not {_brief(resample)}")
    for flag in ("do_resize", "do_rescale", "do_normalize"):
        if hf_config.get(flag, True) is not True:
            raise CheckpointError("preprocessor_config.json turns off resizing, rescaling or normalising, which we do not reproduce")
    factor = hf_config.get("rescale_factor", 1 / 255)
    if not _is_number(factor) or abs(factor * 255 - 1) > 1e-6:
        raise CheckpointError(f"preprocessor_config.json's rescale_factor must be 1/255, not {_brief(factor)}")
    return {
        "max_patches": patches, "resize_mode": "squash", "crop_pct": 1.0, "interpolation": _RESAMPLE[resample],
        "transform_library": "transformers",
    }


# ----------------------------------------------------------------------------- config.json and weights


def _whole(value) -> bool:
    return _is_number(value) and isinstance(value, int) and value > 0


# The config.json settings we read: a check of each, and what it must be in words.
_HF_SETTINGS = {
    "model_type": (lambda value: isinstance(value, str), "a name"),
    "vision_config": (lambda value: isinstance(value, dict), "an object of settings"),
    "hidden_act": (lambda value: isinstance(value, str), "a name"),
    "layer_norm_eps": (lambda value: _is_number(value) and value > 0, "a positive number"),
    "num_attention_heads": (_whole, "a positive whole number"),
    "num_hidden_layers": (_whole, "a positive whole number"),
    "hidden_size": (_whole, "a positive whole number"),
    "intermediate_size": (_whole, "a positive whole number"),
    "num_register_tokens": (lambda value: value == 0 or _whole(value), "a whole number"),
    "patch_size": (_whole, "a positive whole number"),
    "rope_theta": (lambda value: _is_number(value) and value > 0, "a positive number"),
    "use_gated_mlp": (lambda value: isinstance(value, bool), "true or false"),
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


def read_config(folder: Path, name: str) -> dict:
    """config.json of a Hugging Face model folder, with preprocessor_config.json's mean/std."""
    if not os.path.lexists(folder / "config.json"):
        raise CheckpointError(f"{name} has no Hugging Face config.json beside its weights")
    hf_config = {}
    for file_name in ("preprocessor_config.json", "config.json"):  # config.json's settings win
        if file_name == "config.json" or os.path.lexists(folder / file_name):
            settings = read_json(folder_file(folder, file_name, file_name), file_name, folder.name)
            if not isinstance(settings, dict):
                raise CheckpointError(f"{file_name} in {folder.name} is not a JSON object of settings")
            hf_config.update(settings)
    return hf_config


def read_weights(folder: Path) -> dict[str, torch.Tensor]:
    """The weights of a Hugging Face model folder: one file (safetensors first) or shards."""
    state: dict[str, torch.Tensor] = {}
    for path in weight_files(folder):
        state.update(read_tensors(path)[0])
        if len(state) > MAX_TENSORS:
            raise CheckpointError(
                f"{folder.name}'s shards hold over {MAX_TENSORS} tensors; a ViT has fewer"
            )
    return state


def weight_files(folder: Path) -> list[Path]:
    """The files :func:`read_weights` reads, each checked to lie inside the folder before any is
    read: the one weights file (safetensors first), or every shard its index names."""
    single = next((name for name in HF_WEIGHT_FILES if os.path.lexists(folder / name)), None)
    if single is not None:
        return [folder_file(folder, single, single)]
    index_name = next((name for name in HF_SHARD_INDEXES if os.path.lexists(folder / name)), None)
    if index_name is None:
        raise CheckpointError(f"{folder.name} has no {' or '.join(HF_WEIGHT_FILES)}")
    index = read_json(folder_file(folder, index_name, index_name), index_name, folder.name)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if (
        not isinstance(weight_map, dict)
        or not weight_map
        or not all(isinstance(shard, str) for shard in weight_map.values())
    ):
        raise CheckpointError(
            f"{index_name} in {folder.name} has no weight_map from tensor names to shard files"
        )
    what = f"a shard named in {index_name}"
    return sorted({folder_file(folder, shard, what) for shard in set(weight_map.values())})
