"""Checkpoints: our safetensors files, timm / torchvision / Hugging Face ViT imports, resizing.

Every format is converted to our (timm-named) state dict first; the config is then inferred from
the tensor shapes alone, so one code path builds and checks the model whatever the source was.
Files may come from anyone (the class server's uploads): no pickle code runs, what a file declares
is checked against its size before anything is allocated, and nothing outside a model's folder
is read.

    checks.py            reading untrusted files (CheckpointError, the limits)
    project.py           our own format: weights + config (+ class names, metadata) in one file
    from_timm.py, from_torchvision.py, from_huggingface.py
                         each source's state dict renamed to ours, with what the shapes cannot tell
    from_open_clip.py    open_clip's folders (CLIP, SigLIP): the image tower of both, its projection apart
    from_vlm.py, from_qwen_vl.py, from_internvl.py
                         a VLM folder's vision tower (LLaVA, PaliGemma, Gemma 3; Qwen2.5-VL's and Qwen3-VL's)
    from_huggingface_text.py
                         a Hugging Face CLIP / SigLIP folder's text tower under open_clip's names,
                         its text_cfg from config.json, the image projection (vit_explorer.text)
    from_eva.py          timm's Eva family (DINOv3, EVA-02) and Meta's DINOv3 files: rotary positions
    from_naflex.py       timm's NaFlexViT (SigLIP 2's NaFlex encoders): any aspect ratio, its preprocessing
    infer.py             the ViTConfig from the tensors (where a family is recognised by its keys)
    normalization.py     the mean and std: the publisher's, the structure's, or assumed (and said)
    build.py             the tensors checked against that config, then the model built
    footprint.py         the memory a model (or its text tower) takes to load, from its headers alone
    resize.py            resize_model: another patch size and/or image size
    catalogue.py         the pretrained models: where each lives once downloaded, its download;
                         entries.py (what each is), entry_checks.py (a download against its entry),
                         downloads.py (one file fetched: deadline, size limit, DownloadError)

A new source or family gets a reader beside the others, recognised in :func:`_convert` (or by
its model type in from_huggingface), and teaches infer.py its shapes.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch

from ..model.config import ViTConfig
from ..model.vit import ViT, from_timm_eva
from . import (
    catalogue, from_eva, from_huggingface, from_internvl, from_naflex, from_open_clip, from_qwen_vl, from_timm,
    from_torchvision, from_vlm,
)
from .build import build
from .checks import CheckpointError, read_tensors
from .from_torchvision import TORCHVISION_VITS
from .infer import infer_config
from .project import CONFIG_KEY, load_metadata, save_model, saved_config
from .resize import resize_model

__all__ = [
    "CONFIG_KEY", "CheckpointError", "load_metadata", "load_model", "load_pretrained",
    "resize_model", "save_model",
]


def load_model(path: str | os.PathLike, **overrides) -> ViT:
    """Load a ViT in eval mode on the CPU from any supported checkpoint; the format is detected.

    ``path``: our ``.safetensors`` file; a timm or torchvision state dict (``.safetensors``,
    ``.pth``, ``.bin``, possibly wrapped in ``{"state_dict": ...}`` or ``{"model": ...}``); a
    Hugging Face ViT folder (config.json + weights) or a weights file inside one; a timm Hub folder
    (its config.json names the architecture); timm's DINOv3 and
    EVA-02 (Eva) files and Meta's DINOv3 files are recognised from their keys. Whatever the
    weights do not reveal (num_heads: the published ViTs' at their width, infer.PUBLISHED_HEADS,
    else embed_dim // 64) and any other ViTConfig field
    can be given as a keyword; a different ``image_size``/``patch_size`` resamples the model.
    The mean and std are the publisher's, else the structure's, else assumed; the config's
    ``normalization_source`` says which (weights/normalization.py).
    """
    path = Path(path)
    if from_open_clip.is_folder(path):  # a CLIP or SigLIP: its image tower (vit_explorer.text reads both)
        config = from_open_clip.read_config(path)
        state, _ = read_tensors(from_open_clip.weights_path(path))
        converted, known = from_open_clip.convert(state, config, path.name)
        return _model_from_state(converted, known, overrides, path.name)
    if path.is_dir():
        if not os.path.lexists(path / "config.json"):
            raise CheckpointError(
                f"{path} is a folder but not a Hugging Face model (no config.json)"
            )
        hf_config = from_huggingface.read_config(path, path.name)
        if from_qwen_vl.recognises(hf_config):  # Qwen2.5-VL's windowed tower, Qwen3-VL's; their mergers
            converted, known = from_qwen_vl.read(path, hf_config, path.name)
            return _model_from_state(converted, known, overrides, path.name)
        if from_internvl.recognises(hf_config):  # InternVL's InternViT-300M
            converted, known = from_internvl.read(path, hf_config, path.name)
            return _model_from_state(converted, known, overrides, path.name)
        if from_vlm.is_vlm(hf_config):  # a VLM's folder: its vision tower alone
            tower = from_vlm.tower_config(hf_config, path.name)
            converted, known = from_huggingface.convert(from_vlm.read_tower(path, path.name), tower, path.name)
            known.update(from_vlm.language_model_reads(hf_config, path.name))
            return _model_from_state(converted, known, overrides, path.name)
        state = from_huggingface.read_weights(path)
        if from_timm.is_folder_config(hf_config):
            converted, known = from_timm.convert_folder(state, hf_config, path.name)
        else:
            converted, known = from_huggingface.convert(state, hf_config, path.name)
        return _model_from_state(converted, known, overrides, path.name)

    state, metadata = read_tensors(path)
    converted, known = _convert(state, metadata, path)
    return _model_from_state(converted, known, overrides, path.name)


def _convert(
    state: dict[str, torch.Tensor], metadata: dict[str, str], path: Path
) -> tuple[dict[str, torch.Tensor], dict]:
    """(our state dict, config fields the shapes cannot tell) of one file's tensors.

    The format is recognised here, from the file's metadata or its keys; timm comes last, since
    its names are ours.
    """
    saved = saved_config(metadata, path.name)
    if saved is not None:
        return state, saved
    if from_huggingface.recognises(state):
        hf_config = from_huggingface.read_config(path.parent, path.name)
        return from_huggingface.convert(state, hf_config, path.name)
    if from_torchvision.recognises(state):
        return from_torchvision.convert(state)
    if from_naflex.recognises(state):  # its embeds.* are its own; a rotary one has Eva's blocks too
        return from_naflex.convert(state, path.name)
    if from_eva.recognises(state):
        return from_eva.convert(state, path.name)
    return from_timm.convert(state, path.name)


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
        config = infer_config(state, known, rest, name)
    except CheckpointError:
        if "image_size" not in rest:
            raise
        # The weights were trained for another size: build that one, then resample it.
        geometry["image_size"] = rest.pop("image_size")
        config = infer_config(state, known, rest, name)
    try:
        model = build(state, config, name)
    except (RuntimeError, TypeError) as error:  # sizes torch cannot make
        last_line = str(error).strip().splitlines()[-1].strip()
        raise CheckpointError(f"{name} does not fit its config ({last_line})") from None
    return resize_model(model, **geometry) if geometry else model


def load_pretrained(name: str = "vit_b_16", progress=None) -> ViT:
    """A pretrained model of the catalogue (vit_explorer.weights.catalogue.CATALOGUE) or torchvision ViT.

    Downloaded on first use into the cache (~/.cache/vit_explorer/models, or torchvision's for
    its ViTs) and checked; ``progress(done_bytes, total_bytes or None)`` follows a download.
    Offline, or given a wrong file, it raises a CheckpointError that says so in one sentence.
    """
    if name in TORCHVISION_VITS:
        converted, known = from_torchvision.read_pretrained(name, progress)
        return _model_from_state(converted, known, {}, name)
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
    if entry.vlm:  # a VLM's folder of the tower alone, read as any VLM folder is
        return load_model(path)
    if entry.open_clip is not None:  # both towers' file: our ViT is the image tower, headless
        state, _ = from_open_clip.image_tower(from_open_clip.read_image_tensors(path / from_open_clip.WEIGHTS_FILE), name)
        return build(state, entry.vit_config(), name)
    state, _ = read_tensors(path)
    for key in entry.drop_keys:
        state.pop(key, None)
    if entry.eva_names:
        state = from_timm_eva(state)
    return build(state, entry.vit_config(), name)
