"""A CLIP or SigLIP model's both towers from the folder its publisher ships (open_clip's layout:
vit_explorer.weights.from_open_clip), checked before anything is allocated.

The image tower is read as every checkpoint is (renamed to ours, its config inferred from the
shapes, the publisher's normalisation from preprocess_cfg); the text tower is open_clip's own
TextTransformer made from the folder's text_cfg, first on the meta device, so that a config that
claims more than the file holds, or a text tower whose embedding does not meet the image's, is
a sentence and costs nothing.
"""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import torch

from ..model.vit import ViT
from ..weights import from_open_clip
from ..weights import load_model
from ..weights.checks import CheckpointError, read_tensors
from .tokenizers import clip_tokenizer, folder_tokenizer
from .towers import ImageTextModel

MAX_CONTEXT_LENGTH = 512


def is_image_text_folder(path: str | Path) -> bool:
    return from_open_clip.is_folder(Path(path))


def load_image_text_model(folder: str | Path, image: ViT | None = None) -> ImageTextModel:
    """Both towers of the open_clip folder ``folder``; ``image``: its image tower when the caller
    has it already (the app's shared model), else read from the folder."""
    folder = Path(folder)
    if not from_open_clip.is_folder(folder):
        raise CheckpointError(f"{folder.name} is not an open_clip model folder (no {from_open_clip.CONFIG_FILE})")
    config = from_open_clip.read_config(folder)
    model_cfg = config["model_cfg"]
    state, _ = read_tensors(folder / from_open_clip.WEIGHTS_FILE)
    if image is None:
        image = load_model(folder)
    _, projection = from_open_clip.image_tower(state, folder.name)
    text, text_cfg = _text_tower(state, model_cfg, folder.name)
    image_dim = image.config.embed_dim if projection is None else projection.shape[0]
    if projection is not None and projection.shape[1] != image.config.embed_dim:
        raise CheckpointError(
            f"{folder.name}'s image projection takes {projection.shape[1]} numbers, but its image tower gives {image.config.embed_dim}"
        )
    text_dim = text.text_projection.out_features if isinstance(text.text_projection, torch.nn.Linear) else text.text_projection.shape[1]
    if text_dim != image_dim:
        raise CheckpointError(
            f"{folder.name}'s text tower does not fit its image tower: it embeds texts in {text_dim} numbers, images in {image_dim}"
        )
    context_length = int(text_cfg["context_length"])
    if text_cfg.get("hf_tokenizer_name"):
        tokenizer = folder_tokenizer(folder, context_length, text_cfg)
    else:
        tokenizer = clip_tokenizer(context_length)
    sigmoid = "logit_bias" in state
    return ImageTextModel(
        image=image,
        image_projection=None if projection is None else projection.float().contiguous(),
        text=text,
        tokenizer=tokenizer,
        context_length=context_length,
        scoring="sigmoid" if sigmoid else "softmax",
        logit_scale=_scalar(state, "logit_scale", folder.name, exp=True),
        logit_bias=_scalar(state, "logit_bias", folder.name) if sigmoid else 0.0,
    )


def _text_tower(state: dict[str, torch.Tensor], model_cfg: dict, name: str) -> tuple[torch.nn.Module, dict]:
    from open_clip.model import CLIPTextCfg, _build_text_tower  # open_clip's own factory

    text_cfg = dict(model_cfg["text_cfg"])
    if text_cfg.get("hf_model_name"):
        raise CheckpointError(f"{name}'s text tower is a Hugging Face {text_cfg['hf_model_name']}, which we do not load")
    known = {field.name for field in dataclasses.fields(CLIPTextCfg)}
    unknown = sorted(set(text_cfg) - known)
    if unknown:
        raise CheckpointError(f"{name}'s text_cfg has settings open_clip does not know: {', '.join(unknown[:4])}")
    context_length = text_cfg.setdefault("context_length", 77)
    if not isinstance(context_length, int) or not 1 < context_length <= MAX_CONTEXT_LENGTH:
        raise CheckpointError(f"{name}'s text context length {context_length!r} is not one we read (2 to {MAX_CONTEXT_LENGTH})")
    weights = from_open_clip.text_tower(state, bool(model_cfg.get("custom_text")))
    embed_dim = model_cfg.get("embed_dim")
    quick_gelu = bool(model_cfg.get("quick_gelu"))
    try:
        with torch.device("meta"):
            skeleton = _build_text_tower(embed_dim, text_cfg, quick_gelu=quick_gelu)
    except (TypeError, ValueError, AssertionError, RuntimeError) as error:
        raise CheckpointError(f"{name}'s text_cfg does not describe a text tower open_clip can make ({error})") from None
    expected = {key: tuple(value.shape) for key, value in skeleton.state_dict().items()}
    found = {key: tuple(value.shape) for key, value in weights.items()}
    missing = sorted(set(expected) - set(found))
    wrong = sorted(key for key in set(expected) & set(found) if found[key] != expected[key])
    extra = sorted(set(found) - set(expected))
    if missing or wrong or extra:
        detail = "; ".join(
            f"{what}: {', '.join(keys[:3])}"
            for what, keys in (("missing", missing), ("wrong shape", wrong), ("unexpected", extra))
            if keys
        )
        raise CheckpointError(f"{name}'s text tower does not fit its text_cfg ({detail})")
    text = _build_text_tower(embed_dim, text_cfg, quick_gelu=quick_gelu)
    text.load_state_dict({key: value.float() for key, value in weights.items()})
    return text.eval().requires_grad_(False), text_cfg


def _scalar(state: dict[str, torch.Tensor], key: str, name: str, exp: bool = False) -> float:
    value = state.get(key)
    if value is None or value.numel() != 1 or not value.is_floating_point():
        raise CheckpointError(f"{name} has no {key} (one number), which scoring a text needs")
    number = float(value.float().exp() if exp else value.float())
    if not math.isfinite(number):
        raise CheckpointError(f"{name}'s {key} is not a finite number")
    return number
