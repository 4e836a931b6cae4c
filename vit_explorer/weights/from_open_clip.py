"""open_clip's files: a CLIP or SigLIP model's both towers in one state dict, beside its config.

A folder as open_clip publishes it on the Hub (and writes with ``push_to_hf_hub``):
``open_clip_config.json`` ({"model_cfg": ..., "preprocess_cfg": ...}), ``open_clip_model.safetensors``
(``visual.*``, the text tower's tensors, ``logit_scale`` and SigLIP's ``logit_bias``) and, for a
tokenizer other than CLIP's BPE (which ships inside open_clip), the Hugging Face tokenizer files.

The image tower comes in two layouts: OpenAI's (``visual.conv1``, ``visual.transformer.resblocks``;
open_clip's own VisionTransformer, CLIP) or a timm trunk (``visual.trunk.*``, timm's names, which
are ours; SigLIP, the Perception Encoder). Here it is renamed to our ViT's names, and its
projection into the shared embedding space (CLIP's ``visual.proj``, a timm trunk's
``visual.head.proj`` or, where the vision_cfg's timm_proj is null, the trunk's own classifier:
the Perception Encoder's) is set apart: the ViT stays headless, so that every page treats it as
the image tower it is, and the words (vit_explorer.text) apply the projection.
"""
from __future__ import annotations

import functools
import os
import re
from pathlib import Path

import torch

from ..model.config import _brief
from .checks import MAX_HEADER_BYTES, CheckpointError, folder_file, read_json

CONFIG_FILE = "open_clip_config.json"
WEIGHTS_FILE = "open_clip_model.safetensors"
MAX_CONFIG_BYTES = MAX_HEADER_BYTES  # checks.read_json's bound

# OpenAI's layout of the image tower, under "visual.", to our names.
_OPENAI_NAMES = [
    (r"^conv1\.", "patch_embed.proj."),
    (r"^ln_pre\.", "norm_pre."),
    (r"^ln_post\.", "norm."),
    (r"^transformer\.resblocks\.(\d+)\.ln_1\.", r"blocks.\1.norm1."),
    (r"^transformer\.resblocks\.(\d+)\.ln_2\.", r"blocks.\1.norm2."),
    (r"^transformer\.resblocks\.(\d+)\.attn\.in_proj_weight$", r"blocks.\1.attn.qkv.weight"),
    (r"^transformer\.resblocks\.(\d+)\.attn\.in_proj_bias$", r"blocks.\1.attn.qkv.bias"),
    (r"^transformer\.resblocks\.(\d+)\.attn\.out_proj\.", r"blocks.\1.attn.proj."),
    (r"^transformer\.resblocks\.(\d+)\.mlp\.c_fc\.", r"blocks.\1.mlp.fc1."),
    (r"^transformer\.resblocks\.(\d+)\.mlp\.c_proj\.", r"blocks.\1.mlp.fc2."),
    (r"^transformer\.resblocks\.(\d+)\.ls_1\.gamma$", r"blocks.\1.ls1.gamma"),
    (r"^transformer\.resblocks\.(\d+)\.ls_2\.gamma$", r"blocks.\1.ls2.gamma"),
]


def is_folder(path: Path) -> bool:
    return path.is_dir() and os.path.lexists(path / CONFIG_FILE)


def read_config(folder: Path) -> dict:
    """The folder's open_clip_config.json: {"model_cfg": {...}, "preprocess_cfg": {...}}."""
    config = read_json(folder_file(folder, CONFIG_FILE, CONFIG_FILE), CONFIG_FILE, folder.name)
    model_cfg = config.get("model_cfg") if isinstance(config, dict) else None
    if not isinstance(model_cfg, dict) or not isinstance(model_cfg.get("text_cfg"), dict) \
            or not isinstance(model_cfg.get("vision_cfg"), dict):
        raise CheckpointError(f"{folder.name}'s {CONFIG_FILE} has no model_cfg with a text_cfg and a vision_cfg")
    return config


def weights_path(folder: Path) -> Path:
    """The folder's open_clip_model.safetensors, refused if it leads outside the folder."""
    return folder_file(folder, WEIGHTS_FILE, WEIGHTS_FILE)


def is_openai_layout(state: dict[str, torch.Tensor]) -> bool:
    return "visual.conv1.weight" in state


def image_tower(state: dict[str, torch.Tensor], name: str) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """(our ViT's state dict, the projection into the shared space as (embed_dim, width) or None)
    of an open_clip state dict's image tower."""
    if is_openai_layout(state):
        return _openai_tower(state)
    trunk = {key.removeprefix("visual.trunk."): value for key, value in state.items() if key.startswith("visual.trunk.")}
    if not trunk:
        raise CheckpointError(f"{name} has no image tower we can read (neither visual.conv1 nor visual.trunk)")
    heads = sorted(key for key in state if key.startswith("visual.head."))
    if heads and heads != ["visual.head.proj.weight"]:
        raise CheckpointError(f"{name}'s image tower ends in a head we do not read ({', '.join(heads[:3])})")
    if "head.weight" not in trunk:
        return trunk, state.get("visual.head.proj.weight")  # a Linear's (embed_dim, width)
    if heads:
        raise CheckpointError(f"{name}'s image tower has two projections (its trunk's head and visual.head.proj)")
    # timm_proj null: open_clip made the trunk's classifier with embed_dim outputs, the projection.
    projection = trunk.pop("head.weight")
    no_bias(trunk.pop("head.bias", None), name)
    return trunk, projection


def no_bias(bias: torch.Tensor | None, name: str) -> None:
    """A trunk's head is a projection without a bias (the Perception Encoder's proj, which timm
    writes with a zero bias): one that moves the embedding is refused, since the words project
    linearly (a sum of parts to the sum of their projections). On the meta device (a download's
    check) only its presence is known."""
    if bias is not None and not bias.is_meta and bool(bias.any()):
        raise CheckpointError(
            f"{name}'s image projection (its timm trunk's head) has a bias that is not zero, which we do not apply"
        )


def _openai_tower(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    converted: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if not key.startswith("visual."):
            continue
        key = key.removeprefix("visual.")
        if key == "class_embedding":
            converted["cls_token"] = value.reshape(1, 1, -1)
        elif key == "positional_embedding":
            converted["pos_embed"] = value.unsqueeze(0)
        elif key != "proj":
            for pattern, replacement in _OPENAI_NAMES:
                key, count = re.subn(pattern, replacement, key)
                if count:
                    break
            converted[key] = value
    projection = state.get("visual.proj")  # (width, embed_dim), applied as x @ proj
    return converted, None if projection is None else projection.t()


def read_image_tensors(path: Path) -> dict[str, torch.Tensor]:
    """The image tower's tensors ("visual.*") of a weights file checked before (the catalogue's
    download), without reading the text tower's."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt", device="cpu") as file:
            return {key: file.get_tensor(key) for key in file.keys() if key.startswith("visual.")}
    except (OSError, SafetensorError) as error:
        raise CheckpointError(f"{path.parent.name}'s {path.name} could not be read ({error})") from None


# OpenAI's (width, E); a timm trunk's Linear (E, width); a trunk's own head (E, width) and its bias.
PROJECTIONS = ("visual.proj", "visual.head.proj.weight", "visual.trunk.head.weight", "visual.trunk.head.bias")


def read_text_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor but the image tower's (its projection kept) of a weights file checked before:
    what the text tower needs once the image tower is loaded, without reading it twice."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt", device="cpu") as file:
            return {
                key: file.get_tensor(key) for key in file.keys() if not key.startswith("visual.") or key in PROJECTIONS
            }
    except (OSError, SafetensorError) as error:
        raise CheckpointError(f"{path.parent.name}'s {path.name} could not be read ({error})") from None


def projection(state: dict[str, torch.Tensor], name: str) -> torch.Tensor | None:
    """The image tower's projection into the shared space as (E, width), or None."""
    if "visual.proj" in state:
        return state["visual.proj"].t()
    if "visual.trunk.head.weight" in state:
        no_bias(state.get("visual.trunk.head.bias"), name)
        return state["visual.trunk.head.weight"]
    return state.get("visual.head.proj.weight")


def text_tower(state: dict[str, torch.Tensor], custom_text: bool) -> dict[str, torch.Tensor]:
    """The text tower's tensors under open_clip TextTransformer's names: a CustomTextCLIP's
    (SigLIP) are under "text.", a CLIP's are the top-level ones that are not the image tower's."""
    if custom_text:
        return {key.removeprefix("text."): value for key, value in state.items() if key.startswith("text.")}
    return {
        key: value for key, value in state.items()
        if not key.startswith("visual.") and key not in ("logit_scale", "logit_bias")
    }


def convert(state: dict[str, torch.Tensor], config: dict, name: str) -> tuple[dict[str, torch.Tensor], dict]:
    """(our headless ViT's state dict, the config fields the shapes cannot tell) of an open_clip
    model's image tower."""
    tower, _ = image_tower(state, name)
    known = {"num_classes": 0, **normalization(config), **transform(config, name)}
    vision = config["model_cfg"]["vision_cfg"]
    if is_openai_layout(state):
        known["act_layer"] = "quick_gelu" if config["model_cfg"].get("quick_gelu") else "gelu"
        known["num_heads"] = _openai_heads(vision, tower["patch_embed.proj.weight"].shape[0], name)
    else:  # a timm trunk is the timm model its vision_cfg names, heads and activation included
        known.update(_trunk_settings(vision.get("timm_model_name"), tower["patch_embed.proj.weight"].shape[0], name))
    if isinstance(vision.get("image_size"), (int, list)):  # So400m/14's 384 px: 378 read (infer.py)
        known["image_size"] = vision["image_size"] if isinstance(vision["image_size"], int) else tuple(vision["image_size"])
    return tower, known


def _openai_heads(vision: dict, width: int, name: str) -> int:
    """open_clip's own ViT has width // head_width heads (64 unless the config says: ViT-H/14's 80)."""
    head_width = vision.get("head_width", 64)
    if not isinstance(head_width, int) or isinstance(head_width, bool) or not 0 < head_width <= width or width % head_width:
        raise CheckpointError(f"{name}'s vision_cfg head_width {head_width!r} does not divide its image tower's width {width}")
    return width // head_width


def _trunk_settings(timm_name, width: int, name: str) -> dict:
    """The heads and the activation of the timm model a trunk names, as open_clip builds it; a
    trunk of another width than that model's (which open_clip cannot build: a hand-made folder)
    keeps the shapes' defaults."""
    import timm

    if not isinstance(timm_name, str) or len(timm_name) > 200 or not timm.is_model(timm_name):
        raise CheckpointError(f"{name}'s image tower is a timm trunk, but its vision_cfg names no timm model we know")
    try:
        settings = dict(_timm_trunk_settings(timm_name))
    except Exception:  # a registered model that cannot be made on the meta device, or is no ViT
        raise CheckpointError(f"{name}'s vision_cfg names {timm_name[:60]}, which is not a timm ViT we read") from None
    return settings if settings.pop("embed_dim") == width else {}


@functools.lru_cache(maxsize=32)
def _timm_trunk_settings(timm_name: str) -> tuple[tuple[str, object], ...]:
    import timm

    with torch.device("meta"):  # nothing allocated: only its definition is read (0.2 s for a So400m)
        trunk = timm.create_model(timm_name, pretrained=False)
    block = trunk.blocks[0]
    activation = getattr(block.mlp, "act", None)
    settings = {"embed_dim": trunk.embed_dim, "num_heads": block.attn.num_heads}
    if isinstance(activation, torch.nn.GELU):
        settings["act_layer"] = "gelu_tanh" if activation.approximate == "tanh" else "gelu"
    return tuple(settings.items())


def normalization(config: dict) -> dict:
    """The mean and std the publisher wrote in preprocess_cfg (ViTConfig fields), if it did."""
    preprocess = config.get("preprocess_cfg") or {}
    fields = {}
    for key in ("mean", "std"):
        value = preprocess.get(key) if isinstance(preprocess, dict) else None
        if isinstance(value, (list, tuple)) and len(value) == 3 and all(isinstance(v, (int, float)) for v in value):
            fields[key] = tuple(float(v) for v in value)
    if len(fields) != 2:
        return {}
    return {**fields, "normalization_source": f"publisher: {CONFIG_FILE}"}


def transform(config: dict, name: str) -> dict:
    """The eval transform open_clip builds from preprocess_cfg (its PreprocessCfg's defaults where
    a key is missing: the shorter side resized bicubic, the centre cropped), as ViTConfig fields;
    a value open_clip would not build, or that we do not reproduce, is refused in a sentence."""
    preprocess = config.get("preprocess_cfg") or {}
    if not isinstance(preprocess, dict):
        raise CheckpointError(f"{name}'s {CONFIG_FILE} has a preprocess_cfg that is not an object of settings")
    mode = preprocess.get("resize_mode", "shortest")
    interpolation = preprocess.get("interpolation", "bicubic")
    fill = preprocess.get("fill_color", 0)
    if mode not in ("shortest", "squash", "longest"):
        raise CheckpointError(f"{name}'s preprocess_cfg resize_mode must be shortest, squash or longest, not {_brief(mode)}")
    if interpolation not in ("bicubic", "bilinear"):
        raise CheckpointError(f"{name}'s preprocess_cfg interpolation must be bicubic or bilinear, not {_brief(interpolation)}")
    if not isinstance(fill, int) or isinstance(fill, bool) or not 0 <= fill <= 255:
        raise CheckpointError(f"{name}'s preprocess_cfg fill_color must be a whole number from 0 to 255, not {_brief(fill)}")
    return {"resize_mode": mode, "interpolation": interpolation, "fill_color": fill}
