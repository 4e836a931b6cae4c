"""Hugging Face transformers' CLIP and SigLIP models with both towers (CLIPModel, SiglipModel,
Siglip2Model): the text tower's tensors under open_clip TextTransformer's names, the open_clip
text_cfg that its config.json describes, the image projection, the logit scale and bias.

A folder saved by ``save_pretrained`` (config.json with ``model_type`` "clip", "siglip" or
"siglip2", model.safetensors or shards, the tokenizer's files). Its image tower is read by
from_huggingface (``load_model``); here is the rest, which vit_explorer.text builds with
open_clip's own text transformer. The two are the same computation:

    CLIP     causal mask; pooled at the first end token (config eos_token_id; a config still
             saying 2, from before transformers fixed it, pools at the largest id, which is the
             end token of CLIP's byte-pair vocabulary: open_clip's "argmax"); text_projection
             a Linear without bias, visual_projection likewise (the image projection)
    SigLIP   no mask; pooled at the last position; the ``head`` Linear (with bias) is the
             projection; the image tower's attention pool is already in the shared space

Each setting read from config.json is checked, and an absent one is transformers' default
(_DEFAULTS, which a test compares with transformers' config classes). SigLIP 2's text tower is
SigLIP's (its fixed-resolution checkpoints are published as "siglip"); the NaFlex ones ("siglip2")
differ in the image tower only (from_huggingface).
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import torch

from ..model.config import _brief, _is_number
from .checks import CheckpointError, folder_file, read_json

MODEL_TYPES = ("clip", "siglip", "siglip2")
# transformers' CLIPTextConfig / SiglipTextConfig defaults, for a config.json that omits one.
_DEFAULTS = {
    "clip": {
        "vocab_size": 49408, "hidden_size": 512, "intermediate_size": 2048, "num_hidden_layers": 12,
        "num_attention_heads": 8, "max_position_embeddings": 77, "hidden_act": "quick_gelu",
        "layer_norm_eps": 1e-5, "eos_token_id": 49407,
    },
    "siglip": {
        "vocab_size": 32000, "hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
        "num_attention_heads": 12, "max_position_embeddings": 64, "hidden_act": "gelu_pytorch_tanh",
        "layer_norm_eps": 1e-6,
    },
}
_DEFAULTS["siglip2"] = _DEFAULTS["siglip"]
CLIP_PROJECTION_DIM = 512  # CLIPConfig's default projection_dim
# transformers' activation -> (open_clip's quick_gelu flag, its act_kwargs)
_ACTIVATIONS = {"quick_gelu": (True, None), "gelu": (False, None), "gelu_pytorch_tanh": (False, {"approximate": "tanh"})}
MAX_CONTEXT_LENGTH = 512

_SEPARATE_QKV = re.compile(r"^encoder\.layers\.(\d+)\.self_attn\.(q|k|v)_proj\.(weight|bias)$")
_RENAMES = [
    (r"^embeddings\.token_embedding\.weight$", "token_embedding.weight"),
    (r"^embeddings\.position_embedding\.weight$", "positional_embedding"),
    (r"^encoder\.layers\.(\d+)\.layer_norm(1|2)\.", r"transformer.resblocks.\1.ln_\2."),
    (r"^encoder\.layers\.(\d+)\.self_attn\.out_proj\.", r"transformer.resblocks.\1.attn.out_proj."),
    (r"^encoder\.layers\.(\d+)\.mlp\.fc1\.", r"transformer.resblocks.\1.mlp.c_fc."),
    (r"^encoder\.layers\.(\d+)\.mlp\.fc2\.", r"transformer.resblocks.\1.mlp.c_proj."),
    (r"^final_layer_norm\.", "ln_final."),
    (r"^head\.", "text_projection."),  # SigLIP's projection: a Linear with bias
]


def model_type(folder: Path) -> str | None:
    """"clip", "siglip" or "siglip2" when ``folder`` holds such a Hugging Face model with both
    towers; no error for anything else (a folder of another model, an unreadable config.json)."""
    if not folder.is_dir() or not os.path.lexists(folder / "config.json"):
        return None
    try:
        config = read_json(folder_file(folder, "config.json", "config.json"), "config.json", folder.name)
    except (CheckpointError, OSError):
        return None
    found = config.get("model_type") if isinstance(config, dict) else None
    return found if found in MODEL_TYPES else None


def is_folder(path: Path) -> bool:
    return model_type(path) is not None


def text_settings(hf_config: dict, name: str) -> tuple[dict, int, bool]:
    """(open_clip's text_cfg, the shared embedding size, quick_gelu) that a CLIP or SigLIP
    config.json describes; every setting read is checked, in one sentence if it is not one."""
    kind = hf_config.get("model_type")
    if kind not in MODEL_TYPES:
        raise CheckpointError(f"{name} is not a Hugging Face CLIP or SigLIP model (its model_type is {_brief(kind)})")
    text_config = hf_config.get("text_config", {})
    if not isinstance(text_config, dict):
        raise CheckpointError(f"{name}'s config.json text_config must be an object of settings, not {_brief(text_config)}")

    def setting(key: str, valid, expected: str):
        value = text_config.get(key, _DEFAULTS[kind].get(key))
        if not valid(value):
            raise CheckpointError(f"{name}'s config.json text_config {key} must be {expected}, not {_brief(value)}")
        return value

    def whole(key: str) -> int:
        return setting(key, lambda value: isinstance(value, int) and not isinstance(value, bool) and value > 0,
                       "a positive whole number")

    width, intermediate = whole("hidden_size"), whole("intermediate_size")
    context_length = whole("max_position_embeddings")
    if not 1 < context_length <= MAX_CONTEXT_LENGTH:
        raise CheckpointError(f"{name}'s text context length {context_length} is not one we read (2 to {MAX_CONTEXT_LENGTH})")
    activation = setting("hidden_act", lambda value: value in _ACTIVATIONS, f"one of {', '.join(_ACTIVATIONS)}")
    eps = setting("layer_norm_eps", lambda value: _is_number(value) and value > 0, "a positive number")
    quick_gelu, act_kwargs = _ACTIVATIONS[activation]
    # open_clip's MLP is int(width * mlp_ratio) wide: a ratio that rounds down to the file's width.
    mlp_ratio = intermediate / width
    if int(width * mlp_ratio) != intermediate:
        mlp_ratio = (intermediate + 0.5) / width
    text_cfg = {
        "context_length": context_length, "vocab_size": whole("vocab_size"), "width": width,
        "heads": whole("num_attention_heads"), "layers": whole("num_hidden_layers"), "mlp_ratio": mlp_ratio,
        "norm_kwargs": {"eps": float(eps)}, "act_kwargs": act_kwargs,
    }
    if kind == "clip":
        eos = setting("eos_token_id", lambda value: isinstance(value, int) and not isinstance(value, bool) and value >= 0,
                      "a token id")
        # transformers pools at the first eos_token_id, or (a config from before the fix) at the largest id.
        text_cfg |= {"pool_type": "argmax"} if eos == 2 else {"pool_type": "eos", "eos_id": eos}
        embed_dim = hf_config.get("projection_dim", CLIP_PROJECTION_DIM)
        if not isinstance(embed_dim, int) or isinstance(embed_dim, bool) or embed_dim <= 0:
            raise CheckpointError(f"{name}'s config.json projection_dim must be a positive whole number, not {_brief(embed_dim)}")
    else:
        embed_dim = setting("projection_size", lambda value: value is None or (isinstance(value, int) and value > 0),
                            "a positive whole number") or width
        # big_vision trained SigLIP on canonicalised text (lower case, no punctuation), as
        # transformers' SiglipTokenizer and open_clip clean it.
        text_cfg |= {
            "no_causal_mask": True, "pool_type": "last", "proj_bias": True,
            "tokenizer_kwargs": {"clean": "canonicalize"},
        }
    return text_cfg, embed_dim, quick_gelu


def text_tower(state: dict[str, torch.Tensor], name: str) -> dict[str, torch.Tensor]:
    """The text tower's tensors (``text_model.*``, CLIP's ``text_projection.weight``) under
    open_clip TextTransformer's names: q, k and v in one in_proj, CLIP's projection as the
    (width, embed_dim) matrix open_clip multiplies by."""
    converted: dict[str, torch.Tensor] = {}
    attention: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    for key, value in state.items():
        if not key.startswith("text_model."):
            continue
        key = key.removeprefix("text_model.")
        if key == "embeddings.position_ids":  # a buffer older files kept: 0, 1, 2, ...
            continue
        found = _SEPARATE_QKV.match(key)
        if found:
            block, role, kind = found.groups()
            attention.setdefault((block, kind), {})[role] = value
            continue
        for pattern, replacement in _RENAMES:
            key, count = re.subn(pattern, replacement, key)
            if count:
                break
        converted[key] = value
    for (block, kind), parts in attention.items():
        if set(parts) != {"q", "k", "v"}:
            raise CheckpointError(f"{name}'s text tower lacks part of layer {block}'s q, k and v")
        try:
            converted[f"transformer.resblocks.{block}.attn.in_proj_{kind}"] = torch.cat([parts[role] for role in "qkv"])
        except RuntimeError:
            raise CheckpointError(f"{name}'s text tower's q, k and v of layer {block} do not fit together") from None
    projection = state.get("text_projection.weight")  # CLIP: a Linear's (embed_dim, width)
    if projection is not None:
        if projection.dim() != 2:
            raise CheckpointError(f"{name}'s text_projection.weight is not a matrix")
        converted["text_projection"] = projection.t()
    return converted


def image_projection(state: dict[str, torch.Tensor], name: str) -> torch.Tensor | None:
    """CLIP's visual_projection as (embed_dim, width); None for SigLIP, whose pool is the embedding."""
    projection = state.get("visual_projection.weight")
    if projection is not None and projection.dim() != 2:
        raise CheckpointError(f"{name}'s visual_projection.weight is not a matrix")
    if "visual_projection.bias" in state:
        raise CheckpointError(f"{name}'s image projection has a bias, which CLIP's does not")
    return projection
