"""How much memory a model takes to load, from its files' headers alone: nothing is allocated, so
a model that would not fit can be refused before its loader runs (training/admission.admit_model).

The files sized are the ones :func:`vit_explorer.weights.load_model` reads, chosen by the same
readers: an open_clip folder's whole weights file (both towers are read, the image tower kept); a
VLM folder's tower alone (from_vlm.tower_shards, as Qwen-VL's and InternVL's readers pick it);
a Hugging Face or timm folder's weights file or every shard; one file. A safetensors header gives
each tensor's dtype and shape; a PyTorch zip its members' declared sizes (dtypes unknown: taken as
float32, as nearly every published ViT checkpoint is).
"""
from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ..model.config import ViTConfig
from ..model.vit import ViT
from . import from_huggingface, from_huggingface_text, from_internvl, from_open_clip, from_qwen_vl, from_vlm
from .checks import DTYPE_BYTES, CheckpointError, check_archive, looks_like_safetensors, safetensors_header

_FLOATS = {"F64", "F32", "F16", "BF16"}


@dataclass(frozen=True)
class Footprint:
    """A model's memory, in bytes, before it is loaded."""

    weights: int  # what the loaded model holds: its tensors in float32
    converted: int  # bytes held beside the float32 copies of tensors read in another dtype (float16, bfloat16)

    @property
    def peak(self) -> int:
        """The most the model holds while it is loaded and first used: its float32 weights (a
        float32 safetensors file's own pages, mapped, once read), the tensors converted from another
        dtype beside their copies (a VLM tower's: half of them, each widened and freed as it is read,
        see model_footprint), and a quarter of the weights for the copies a reader makes when
        it joins q, k and v (a quarter of a ViT block's weights; transformers' names, InternViT's).
        Measured (VmHWM once every weight was read, over the imports' own) on ViT-S/16-sized
        models (87 MB in float32), estimate in brackets: timm's float32 file 1.02x the weights
        (1.25x), its float16 file 1.50x (1.75x), torch.save's file 1.02x (1.25x), a Hugging Face
        folder 1.27x (1.25x), a LLaVA folder's CLIP tower 1.27x (1.25x), in bfloat16 1.27x
        (1.50x); bench.vlm_tower's LLaVA-1.5-shaped folder in float16 (CLIP ViT-L/14-336): 1.40x
        (1.50x)."""
        return self.weights + self.converted + self.weights // 4


def model_footprint(path: str | os.PathLike) -> Footprint | None:
    """The memory loading ``path`` takes, from its headers; None where the loader will refuse it
    in its own words (no model folder, no file, a format it does not read). CheckpointError: a
    header that is not what it claims, a shard outside the folder (the loader's own sentences)."""
    path = Path(path)
    if from_open_clip.is_folder(path):  # the text tower's tensors are read too, but stay mapped, untouched
        return _footprint(_safetensors_sizes(from_open_clip.weights_path(path), path.name), "visual.")
    if path.is_dir():
        if not os.path.lexists(path / "config.json"):
            return None
        hf_config = from_huggingface.read_config(path, path.name)
        tower = _tower(hf_config)
        if tower is not None:
            _, shards = from_vlm.tower_shards(path, path.name, *tower)
            sizes = [size for shard, keys in shards.items() for size in _safetensors_sizes(shard, path.name, keys)]
            # Each tensor becomes float32 as it is read, its copy freed at once; yet the allocator
            # keeps some of what was freed (bench.vlm_tower: 0.3x the float16 tower's bytes): half counted.
            converted = sum(stored for _, stored, as_float in sizes if stored != as_float) // 2
            return Footprint(weights=sum(as_float for *_, as_float in sizes), converted=converted)
        if from_vlm.is_vlm(hf_config):  # a VLM we do not read: its loader says so
            return None
        # A whole CLIP or SigLIP: its text tower's tensors are read too, but stay as stored, untouched.
        whole = hf_config.get("model_type") in ("clip", "siglip", "siglip2")
        return _files_footprint(from_huggingface.weight_files(path), path.name, ("vision_model.",) if whole else ("",))
    return _file_footprint(path) if path.is_file() else None


def text_footprint(path: str | os.PathLike) -> Footprint | None:
    """The memory of the text tower that vit_explorer.text reads beside an image tower already
    loaded: an open_clip folder's tensors outside ``visual.``, a Hugging Face CLIP or SigLIP
    folder's ``text_model.`` ones and its projection (a PyTorch file's whole, its tensors unnamed
    in any header); None for a folder with no text tower."""
    path = Path(path)
    if from_open_clip.is_folder(path):
        sizes = _safetensors_sizes(from_open_clip.weights_path(path), path.name)
        return _footprint([size for size in sizes if not size[0].startswith("visual.")])
    if not path.is_dir() or not from_huggingface_text.is_folder(path):
        return None
    return _files_footprint(from_huggingface.weight_files(path), path.name, ("text_model.", "text_projection"))


@functools.lru_cache(maxsize=64)  # building even on the meta device takes ~20 ms for a ViT-B
def config_footprint(config: ViTConfig) -> Footprint:
    """The memory a model of ``config`` takes to load from a float32 file (a catalogue entry
    before its download): its parameters counted on the meta device."""
    with torch.device("meta"):
        weights = 4 * sum(tensor.numel() for tensor in ViT(config).state_dict().values())
    return Footprint(weights=weights, converted=0)


def _tower(hf_config: dict) -> tuple | None:
    """from_vlm.tower_shards' (prefixes, patch key) for the tower a VLM folder's reader reads (none:
    its defaults, LLaVA's and the others'); None for a folder that is no VLM's we read."""
    if from_qwen_vl.recognises(hf_config):
        return from_qwen_vl.PREFIXES, from_qwen_vl.PATCH_KEY
    if from_internvl.recognises(hf_config):
        return from_internvl.PREFIXES, from_internvl.PATCH_KEY
    if from_vlm.is_vlm(hf_config) and hf_config["model_type"] in from_vlm.VLM_TOWERS:
        return ()
    return None


def _files_footprint(files: list[Path], name: str, prefixes: tuple[str, ...]) -> Footprint | None:
    """The footprint of the tensors under ``prefixes`` in a folder's weights files (a PyTorch
    file's whole: its tensors are named in no header); None if one is no checkpoint."""
    parts = []
    for file in files:
        if looks_like_safetensors(file):
            parts.append(_footprint([size for size in _safetensors_sizes(file, name) if size[0].startswith(prefixes)]))
        else:
            parts.append(_file_footprint(file))
    if any(part is None for part in parts):
        return None
    return Footprint(weights=sum(part.weights for part in parts), converted=sum(part.converted for part in parts))


def _file_footprint(path: Path) -> Footprint | None:
    if looks_like_safetensors(path):
        return _footprint(_safetensors_sizes(path, path.name))
    with open(path, "rb") as file:
        start = file.read(4)
    if start == b"PK\x03\x04":  # torch.save's zip: what its members unpack to, taken as float32
        return Footprint(weights=check_archive(path), converted=0)
    return None  # a pickle or no checkpoint at all: refused by the loader, unread


def _footprint(sizes: list[tuple[str, int, int]], prefix: str | tuple[str, ...] = "") -> Footprint:
    """The footprint of the tensors under ``prefix`` among a file's (name, stored, float32) sizes."""
    kept = [(stored, as_float) for key, stored, as_float in sizes if key.startswith(prefix)]
    converted = sum(stored for stored, as_float in kept if stored != as_float)
    return Footprint(weights=sum(as_float for _, as_float in kept), converted=converted)


def _safetensors_sizes(path: Path, name: str, keys: list[str] | None = None) -> list[tuple[str, int, int]]:
    """(name, bytes as stored, bytes in float32) of each of ``keys`` (every tensor by default)
    in a safetensors file, from its header (its length and tensor count checked first)."""
    if not looks_like_safetensors(path):
        raise CheckpointError(f"{path.name} in {name} is not a safetensors file")
    safetensors_header(path)
    sizes = []
    try:
        with safe_open(str(path), framework="pt") as file:
            present = set(file.keys())
            missing = [key for key in keys or () if key not in present]
            if missing:  # in from_vlm's words
                raise CheckpointError(f"{path.name} in {name} lacks {missing[0]}, which its index says it holds")
            for key in file.keys() if keys is None else keys:
                piece = file.get_slice(key)
                count = math.prod(piece.get_shape())
                dtype = piece.get_dtype()
                width = DTYPE_BYTES.get(dtype, 8)
                sizes.append((key, count * width, count * (4 if dtype in _FLOATS else width)))
    except SafetensorError as error:
        raise CheckpointError(f"{path.name} in {name} is truncated or not a valid safetensors file ({error})") from None
    return sizes
