"""Checkpoints: our safetensors files, timm / torchvision / Hugging Face ViT imports, resizing.

Every format is converted to our (timm-named) state dict first; the config is then inferred from
the tensor shapes alone, so one code path builds and checks the model whatever the source was.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pickle
import re
import uuid
from collections.abc import Mapping
from pathlib import Path

import torch
from einops import rearrange
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file
from safetensors.torch import save as safetensors_bytes

from .config import IMAGENET_MEAN, IMAGENET_STD, ViTConfig
from .model import ViT, resample_patch_embed, resample_pos_embed, resize_matrix

CONFIG_KEY = "vit_explorer.config"  # safetensors metadata entry that marks a project checkpoint
TORCHVISION_VITS = ("vit_b_16", "vit_b_32", "vit_l_16", "vit_l_32", "vit_h_14")
HF_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
HF_SHARD_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


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
    try:
        with safe_open(str(path), framework="pt") as file:
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


def _read_tensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(state dict, safetensors metadata) of a file, or a CheckpointError saying what is wrong."""
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if path.stat().st_size == 0:
        raise CheckpointError(f"{path.name} is empty")

    if _looks_like_safetensors(path):
        metadata = _safetensors_header(path)
        try:
            return load_file(str(path), device="cpu"), metadata
        except SafetensorError as error:
            raise CheckpointError(
                f"{path.name} is truncated or not a valid safetensors file ({error})"
            ) from None

    with open(path, "rb") as file:
        start = file.read(64)
    # torch.save writes a zip archive (or, before torch 1.6, a raw pickle starting with 0x80).
    if not (start.startswith(b"PK\x03\x04") or start.startswith(b"\x80")):
        raise CheckpointError(
            f"{path.name} is not a PyTorch/safetensors checkpoint "
            f"(it looks like {_describe(start)})"
        )
    try:
        # weights_only: a pickle may only rebuild tensors and containers, never call code.
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        if "Weights only load failed" in str(error):
            found = re.search(r"GLOBAL ([\w.]+)", str(error))
            detail = f" ({found.group(1)})" if found else ""
            raise CheckpointError(
                f"loading {path.name} was refused: it contains code or Python objects other than "
                f"tensors, which could run arbitrary commands{detail}"
            ) from None
        raise CheckpointError(
            f"{path.name} is truncated or not a PyTorch/safetensors file"
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError):
        raise CheckpointError(
            f"{path.name} is truncated or not a PyTorch/safetensors file"
        ) from None
    return _unwrap(loaded, path.name), {}


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
    model_type = hf_config.get("model_type", "vit")
    if model_type not in HF_MODEL_TYPES:
        raise CheckpointError(
            f"Hugging Face model type {model_type!r} is not supported; we read"
            f" {', '.join(HF_MODEL_TYPES)}"
        )
    tower = model_type.startswith(("clip", "siglip"))
    if model_type in ("clip", "siglip"):  # the whole model: its settings for the image tower
        hf_config = {**hf_config, **hf_config.get("vision_config", {})}
        state = {
            key.removeprefix("vision_model."): value
            for key, value in state.items()
            if key.startswith("vision_model.")
        }
    activation = hf_config.get("hidden_act", "gelu")
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
        "layer_norm_eps": float(hf_config.get("layer_norm_eps", 1e-12)),
        "act_layer": HF_ACTIVATIONS[activation],
    }
    if tower:
        # CLIP: a class embedding (D,) and position embeddings (N, D) stored without batch axes.
        if "embeddings.class_embedding" in converted:
            converted["cls_token"] = converted.pop("embeddings.class_embedding")[None, None]
        converted["pos_embed"] = converted.pop("embeddings.position_embedding.weight")[None]
    if model_type == "dinov2_with_registers":
        # Registers get no position embedding but the class token does: fold the class token's
        # into the token itself, as timm's DINOv2 layout (no_embed_class) does.
        converted["cls_token"] = converted["cls_token"] + converted["pos_embed"][:, :1]
        converted["pos_embed"] = converted["pos_embed"][:, 1:]
        known["no_embed_class"] = True
    if "num_attention_heads" in hf_config:
        known["num_heads"] = int(hf_config["num_attention_heads"])
    if "image_size" in hf_config:
        known["image_size"] = hf_config["image_size"]
    for ours, theirs in (("mean", "image_mean"), ("std", "image_std")):
        if theirs in hf_config:
            known[ours] = tuple(hf_config[theirs])
    labels = hf_config.get("id2label") or {}
    num_classes = converted["head.weight"].shape[0] if "head.weight" in converted else 0
    names = [labels.get(str(index)) for index in range(num_classes)]
    # transformers fills id2label with LABEL_0, LABEL_1, ... when nobody named the classes.
    if num_classes and all(names) and names != [f"LABEL_{index}" for index in range(num_classes)]:
        known["class_names"] = tuple(names)
    return converted, known


def _huggingface_config(folder: Path, name: str) -> dict:
    """config.json of a Hugging Face model folder, with preprocessor_config.json's mean/std."""
    config_path = folder / "config.json"
    if not config_path.exists():
        raise CheckpointError(f"{name} has no Hugging Face config.json beside its weights")
    try:
        hf_config = json.loads(config_path.read_text())
        preprocessor = folder / "preprocessor_config.json"
        if preprocessor.exists():
            hf_config = {**json.loads(preprocessor.read_text()), **hf_config}
    except json.JSONDecodeError as error:
        raise CheckpointError(f"a config file in {folder} is not valid JSON ({error})") from None
    return hf_config


def _huggingface_weights(folder: Path) -> dict[str, torch.Tensor]:
    """The weights of a Hugging Face model folder: one file (safetensors first) or shards."""
    files = [folder / name for name in HF_WEIGHT_FILES if (folder / name).exists()][:1]
    if not files:
        index = next((folder / name for name in HF_SHARD_INDEXES if (folder / name).exists()), None)
        if index is None:
            raise CheckpointError(f"{folder} has no {' or '.join(HF_WEIGHT_FILES)}")
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [folder / shard for shard in shards]
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(_read_tensors(file)[0])
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


def _infer_config(
    state: dict[str, torch.Tensor], known: dict, requested: dict, name: str
) -> ViTConfig:
    """A ViTConfig from the tensor shapes, ``known`` source facts and the caller's overrides."""
    if "patch_embed.proj.weight" not in state or "blocks.0.attn.qkv.weight" not in state:
        sample = ", ".join(sorted(state)[:6])
        raise CheckpointError(
            f"{name} is not a ViT checkpoint we can read (found keys like {sample})"
        )
    patch_weight = state["patch_embed.proj.weight"]  # (D, C, p, p)
    embed_dim, in_chans, patch_h, patch_w = patch_weight.shape
    if patch_h != patch_w:
        raise CheckpointError(
            f"{name} has non-square patches ({patch_h}x{patch_w}), which we do not support"
        )
    depth = 1 + max(
        int(key.split(".")[1])
        for key in state
        if re.match(r"^blocks\.\d+\.attn\.qkv\.weight$", key)
    )
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
    for no_embed_class in layouts:
        num_patches = num_positions - (0 if no_embed_class else num_prefix)
        grid = _grid_for(num_patches, image_size, patch_size)
        if grid is not None:
            fields["no_embed_class"] = no_embed_class
            fields["image_size"] = image_size if image_size is not None else grid[0] * patch_size
            return ViTConfig(**fields)
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


def _build(state: dict[str, torch.Tensor], config: ViTConfig, name: str) -> ViT:
    state = {
        key: value.float() if value.is_floating_point() else value for key, value in state.items()
    }
    model, result = _adopt(config, state)
    problems = []
    if result.unexpected_keys:
        problems.append(
            f"parameters our ViT does not have: {', '.join(result.unexpected_keys[:5])}"
        )
    if result.missing_keys:
        problems.append(f"missing parameters: {', '.join(result.missing_keys[:5])}")
    if problems:
        raise CheckpointError(f"{name} does not fit our ViT ({'; '.join(problems)})")
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
    except RuntimeError as error:  # shape mismatches, e.g. an override that contradicts the weights
        last_line = str(error).strip().splitlines()[-1].strip()
        raise CheckpointError(f"{name} does not fit the requested config ({last_line})") from None
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
        if not (path / "config.json").exists():
            raise CheckpointError(
                f"{path} is a folder but not a Hugging Face model (no config.json)"
            )
        hf_config = _huggingface_config(path, path.name)
        converted, known = _from_huggingface(_huggingface_weights(path), hf_config)
        return _model_from_state(converted, known, overrides, path.name)

    state, metadata = _read_tensors(path)
    if CONFIG_KEY in metadata:
        try:
            saved = ViTConfig.from_json(metadata[CONFIG_KEY])
        except (ValueError, TypeError) as error:
            raise CheckpointError(f"{path.name} has an unreadable config ({error})") from None
        return _model_from_state(state, saved.to_dict(), overrides, path.name)
    if _is_huggingface(state):
        hf_config = _huggingface_config(path.parent, path.name)
        converted, known = _from_huggingface(state, hf_config)
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
