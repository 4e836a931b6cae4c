"""A CLIP or SigLIP model's both towers from the folder its publisher ships, checked before
anything is allocated: open_clip's layout (vit_explorer.weights.from_open_clip) or a Hugging Face
transformers CLIPModel / SiglipModel folder (vit_explorer.weights.from_huggingface_text).

The image tower is read as every checkpoint is (``load_model``: renamed to ours, its config
inferred from the shapes, the publisher's normalisation); the text tower is open_clip's own
TextTransformer made from the folder's text_cfg (a Hugging Face config.json's text_config
translated into one), its sizes bounded and its layers compared with the file's first, then made
on the meta device, so that a config that claims more than the file holds, or a text tower whose
embedding does not meet the image's, is a sentence and costs nothing. Nothing outside the folder
is read (no link out of it), and its tokenizer.json is checked in a child process beside the
weights' reading (tokenizers.TokenizerCheck).
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re
from pathlib import Path

import torch

from ..model.config import _brief
from ..model.vit import ViT
from ..weights import from_huggingface, from_huggingface_text, from_open_clip
from ..weights import load_model
from ..weights.checks import MAX_BLOCKS, CheckpointError, links_inside, read_tensors, without_paths
from .tokenizers import MAX_PIECES, TOKENIZER_FILE, TokenizerCheck, clip_tokenizer, folder_tokenizer, tokenizer_path
from .towers import ImageTextModel

MAX_CONTEXT_LENGTH = 512
CLIP_VOCAB_SIZE = 49408  # OpenAI's byte-pair vocabulary, which open_clip ships
# Bounds on a text_cfg, checked before open_clip makes its tower (even on the meta device each
# layer costs milliseconds): far above the largest published (bigG: 32 layers, 1280 wide, 20 heads).
MAX_TEXT_WIDTH = 8192
MAX_MLP_RATIO = 16
MAX_VOCAB = MAX_PIECES
_BLOCK = re.compile(r"^transformer\.resblocks\.(\d+)\.")


def is_image_text_folder(path: str | Path) -> bool:
    """An open_clip folder, or a Hugging Face CLIP or SigLIP folder with both towers."""
    path = Path(path)
    return from_open_clip.is_folder(path) or from_huggingface_text.is_folder(path)


def load_image_text_model(folder: str | Path, image: ViT | None = None) -> ImageTextModel:
    """Both towers of the open_clip or Hugging Face folder ``folder``; ``image``: its image tower
    when the caller has it already (the app's shared model), else read from the folder."""
    folder = Path(folder)
    if folder.is_dir():
        links_inside(folder)  # transformers reads what it finds in the folder: nothing may lead out
    if from_open_clip.is_folder(folder):
        return _from_open_clip(folder, image)
    if from_huggingface_text.is_folder(folder):
        return _from_huggingface(folder, image)
    raise CheckpointError(
        f"{folder.name} is neither an open_clip model folder (no {from_open_clip.CONFIG_FILE}) nor a"
        " Hugging Face CLIP or SigLIP folder (a config.json of model_type clip, siglip or siglip2)"
    )


def _from_open_clip(folder: Path, image: ViT | None) -> ImageTextModel:
    config = from_open_clip.read_config(folder)
    model_cfg = config["model_cfg"]
    text_cfg = _open_clip_text_cfg(model_cfg, folder.name)
    with _tokenizer_check(folder, bool(text_cfg.get("hf_tokenizer_name"))) as check:
        if image is None:
            state, _ = read_tensors(from_open_clip.weights_path(folder))
            image = load_model(folder)
            _, projection = from_open_clip.image_tower(state, folder.name)
        else:  # the image tower is loaded (and its file checked): the rest of the file only
            state = from_open_clip.read_text_tensors(from_open_clip.weights_path(folder))
            projection = from_open_clip.projection(state, folder.name)
        weights = from_open_clip.text_tower(state, bool(model_cfg.get("custom_text")))
        text = _text_tower(weights, text_cfg, model_cfg.get("embed_dim"), bool(model_cfg.get("quick_gelu")), folder.name)
        if check is not None:
            tokenizer = folder_tokenizer(folder, text_cfg["context_length"], text_cfg, check)
        else:
            tokenizer = clip_tokenizer(text_cfg["context_length"])
    return _image_text_model(folder.name, state, image, projection, text, tokenizer, text_cfg["context_length"])


def _from_huggingface(folder: Path, image: ViT | None) -> ImageTextModel:
    hf_config = from_huggingface.read_config(folder, folder.name)
    text_cfg, embed_dim, quick_gelu = from_huggingface_text.text_settings(hf_config, folder.name)
    # A CLIP folder with only the slow tokenizer's files: the same byte-pair encoding as open_clip's.
    slow_clip = not os.path.lexists(folder / TOKENIZER_FILE) and hf_config["model_type"] == "clip" \
        and text_cfg["vocab_size"] == CLIP_VOCAB_SIZE
    with _tokenizer_check(folder, not slow_clip) as check:
        state = from_huggingface.read_weights(folder)
        if image is None:
            image = load_model(folder)
        projection = from_huggingface_text.image_projection(state, folder.name)
        text = _text_tower(from_huggingface_text.text_tower(state, folder.name), text_cfg, embed_dim, quick_gelu, folder.name)
        context_length = text_cfg["context_length"]
        tokenizer = clip_tokenizer(context_length) if check is None else folder_tokenizer(folder, context_length, text_cfg, check)
    return _image_text_model(folder.name, state, image, projection, text, tokenizer, context_length)


def _tokenizer_check(folder: Path, wanted: bool) -> TokenizerCheck | contextlib.nullcontext:
    """The folder's tokenizer.json checked in its child process from now on, beside the weights'
    reading (it costs the load little more than the longer of the two); None when not ``wanted``."""
    return TokenizerCheck(tokenizer_path(folder), folder.name) if wanted else contextlib.nullcontext()


def _image_text_model(name, state, image, projection, text, tokenizer, context_length) -> ImageTextModel:
    """Both towers, checked to meet in one space, with the folder's score."""
    image_dim = image.config.embed_dim if projection is None else projection.shape[0]
    if projection is not None and projection.shape[1] != image.config.embed_dim:
        raise CheckpointError(
            f"{name}'s image projection takes {projection.shape[1]} numbers, but its image tower gives {image.config.embed_dim}"
        )
    text_dim = text.text_projection.out_features if isinstance(text.text_projection, torch.nn.Linear) else text.text_projection.shape[1]
    if text_dim != image_dim:
        raise CheckpointError(
            f"{name}'s text tower does not fit its image tower: it embeds texts in {text_dim} numbers, images in {image_dim}"
        )
    sigmoid = "logit_bias" in state
    return ImageTextModel(
        image=image,
        image_projection=None if projection is None else projection.float().contiguous(),
        text=text,
        tokenizer=tokenizer,
        context_length=int(context_length),
        scoring="sigmoid" if sigmoid else "softmax",
        logit_scale=_scalar(state, "logit_scale", name, exp=True),
        logit_bias=_scalar(state, "logit_bias", name) if sigmoid else 0.0,
    )


def _open_clip_text_cfg(model_cfg: dict, name: str) -> dict:
    from open_clip.model import CLIPTextCfg

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
    return text_cfg


def _text_tower(
    weights: dict[str, torch.Tensor], text_cfg: dict, embed_dim, quick_gelu: bool, name: str
) -> torch.nn.Module:
    """open_clip's TextTransformer of ``text_cfg`` holding ``weights``: made on the meta device
    and compared with them first, so that a config claiming more than the file holds costs nothing."""
    from open_clip.model import _build_text_tower  # open_clip's own factory

    _check_text_size(weights, text_cfg, embed_dim, name)
    try:
        with torch.device("meta"):
            skeleton = _build_text_tower(embed_dim, text_cfg, quick_gelu=quick_gelu)
    except Exception as error:  # open_clip's asserts, a TypeError of an odd setting, ...
        reason = without_paths((str(error).strip().splitlines() or [type(error).__name__])[0][:160])
        raise CheckpointError(f"{name}'s text_cfg does not describe a text tower open_clip can make ({reason})") from None
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
    # The checked skeleton takes the file's tensors as they are: no random initialisation of a
    # tower about to be overwritten (a CLIP B/16's is a third of a second); its one computed
    # buffer, the causal mask, is made again on the CPU.
    skeleton.load_state_dict({key: value.float() for key, value in weights.items()}, assign=True)
    if getattr(skeleton, "attn_mask", None) is not None:
        skeleton.attn_mask = skeleton.build_causal_mask()
    if any(tensor.is_meta for tensor in (*skeleton.parameters(), *skeleton.buffers())):
        raise CheckpointError(f"{name}'s text tower has tensors its file does not give")
    return skeleton.eval().requires_grad_(False)


def _check_text_size(weights: dict[str, torch.Tensor], text_cfg: dict, embed_dim, name: str) -> None:
    """The sizes a text_cfg claims, bounded, and its layers those the file holds, before open_clip
    makes anything (10**6 layers would take half an hour on the meta device)."""

    def whole(value) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value > 0

    bounds = {
        "layers": MAX_BLOCKS, "width": MAX_TEXT_WIDTH, "heads": MAX_TEXT_WIDTH, "vocab_size": MAX_VOCAB,
    }
    for key, bound in bounds.items():
        value = text_cfg.get(key)
        if value is not None and not (whole(value) and value <= bound):
            raise CheckpointError(f"{name}'s text_cfg {key} must be a whole number from 1 to {bound:,}, not {_brief(value)}")
    if not (whole(embed_dim) and embed_dim <= MAX_TEXT_WIDTH):
        raise CheckpointError(f"{name}'s embed_dim must be a whole number from 1 to {MAX_TEXT_WIDTH:,}, not {_brief(embed_dim)}")
    ratio = text_cfg.get("mlp_ratio", 4.0)
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= MAX_MLP_RATIO:
        raise CheckpointError(f"{name}'s text_cfg mlp_ratio must be a number above 0 and at most {MAX_MLP_RATIO}, not {_brief(ratio)}")
    blocks = {int(found.group(1)) for key in weights if (found := _BLOCK.match(key))}
    layers = text_cfg.get("layers", 12)  # open_clip's CLIPTextCfg default
    if blocks != set(range(layers)):
        raise CheckpointError(f"{name}'s text_cfg says {layers} layers, but its file holds {len(blocks)}")


def _scalar(state: dict[str, torch.Tensor], key: str, name: str, exp: bool = False) -> float:
    value = state.get(key)
    if value is None or value.numel() != 1 or not value.is_floating_point():
        raise CheckpointError(f"{name} has no {key} (one number), which scoring a text needs")
    number = float(value.float().exp() if exp else value.float())
    if not math.isfinite(number):
        raise CheckpointError(f"{name}'s {key} is not a finite number")
    return number
