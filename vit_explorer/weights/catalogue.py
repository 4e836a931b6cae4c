"""The catalogue: well-known pretrained ViTs in one call, downloaded once from their publishers.

``load_pretrained(name)`` (vit_explorer.weights) reads an entry of :data:`CATALOGUE`. The timm
entries are the safetensors files timm publishes on the Hugging Face Hub; torchvision's ViT-B/16
is torchvision's file, kept in torch.hub's cache where torchvision finds it. A download is written
to a temporary file beside its final place, checked (a safetensors header whose tensors have,
under our names, exactly the shapes the entry's architecture expects; torchvision's file against
the hash in its name) and only then renamed into place, so a half or wrong file is never loaded.
CLIP and SigLIP bring both towers: their repositories' open_clip files (config, weights, a
SigLIP's tokenizer) in a folder of their own (:func:`text_folder`, read by vit_explorer.text),
the text tower checked against open_clip's made from the entry's own config, the folder moved
into place once every file is there and checked; the pages explore the image tower.
Each entry names its weights' licence on its card. A mirror cannot hold a download up or fill the disk: it ends after ``VIT_EXPLORER_DOWNLOAD_TIMEOUT`` seconds
and at the entry's size (plus a margin), and whatever goes wrong is a DownloadError sentence.
"""
from __future__ import annotations

import contextlib
import glob
import hashlib
import http.client
import json
import math
import os
import re
import shutil
import socket
import struct
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..model.config import IMAGENET_MEAN, IMAGENET_STD, OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, ViTConfig
from ..model.vit import ViT, from_timm_eva
from . import from_open_clip
from .checks import CheckpointError

# The Hub the timm files come from; tests point it at a server of their own on loopback.
HUB_URL_VARIABLE = "VIT_EXPLORER_HUB_URL"
DEFAULT_HUB_URL = "https://huggingface.co"
# A mirror of download.pytorch.org/models for torchvision's ViTs (same file names).
TORCHVISION_URL_VARIABLE = "VIT_EXPLORER_TORCHVISION_URL"
CACHE_VARIABLE = "VIT_EXPLORER_CACHE"
CHUNK_BYTES = 1 << 20
# A whole download's time. 30 minutes bring a 350 MB model at 200 KB/s, a slow share of a
# classroom's line (SigLIP 2's both towers, 1.5 GB, need 0.85 MB/s); a mirror that drips slower
# than that is given up on.
TIMEOUT_VARIABLE = "VIT_EXPLORER_DOWNLOAD_TIMEOUT"
DEFAULT_TIMEOUT_SECONDS = 1800.0
READ_TIMEOUT_SECONDS = 30.0  # the longest wait for a connection or for any next bytes

_IMAGENET = dict(mean=IMAGENET_MEAN, std=IMAGENET_STD)
_VIT_S = dict(embed_dim=384, depth=12, num_heads=6)
_VIT_B = dict(embed_dim=768, depth=12, num_heads=12)
# timm's DINOv3 (Eva): rotary positions only, 4 registers, LayerScale, no qkv bias, eps 1e-5; the
# rotary periods rounded to bfloat16 as the original weights keep them (weights/from_eva.py).
_DINOV3 = dict(
    patch_size=16, num_classes=0, reg_tokens=4, init_values=1e-5, qkv_bias=False, layer_norm_eps=1e-5,
    rope_type="dinov3", abs_pos_embed=False, rope_periods_dtype="bfloat16", **_IMAGENET,
)
# SigLIP and SigLIP 2: big_vision trains with JAX's gelu, the tanh approximation (as transformers runs it).
_SIGLIP_B = dict(
    image_size=224, patch_size=16, num_classes=0, class_token=False, global_pool="map", act_layer="gelu_tanh", **_VIT_B,
)
DINOV3_LICENCE = "DINOv3 License (Meta), not Apache: github.com/facebookresearch/dinov3/blob/main/LICENSE.md"

# A timm repository's image tower.
TIMM_FILE = "model.safetensors"
# A SigLIP's Hugging Face tokenizer beside its open_clip files (open_clip writes them with
# save_pretrained); special_tokens_map.json is taken where the server has one.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
OPTIONAL_TOKENIZER_FILES = ("special_tokens_map.json",)
# The most each of an open_clip folder's small files may bring: a config is kilobytes, Gemma's
# 256,000-token tokenizer.json (SigLIP 2) 34 MB.
SMALL_FILE_BYTES = {"tokenizer.json": 128 * 2**20}
SMALL_FILE_DEFAULT_BYTES = from_open_clip.MAX_CONFIG_BYTES


@dataclass(frozen=True)
class CatalogueEntry:
    """One pretrained model: where it lives, what it is, and the architecture its file must fit."""

    title: str  # short name for menus
    source: str  # "timm/<name>" (a Hugging Face Hub repository) or "torchvision:<name>"
    # The download's size. timm files: parameters x 4 bytes (fp32 safetensors), computed from the
    # architecture, the header's few kilobytes aside; open_clip's: both towers' (the weights file,
    # its config and tokenizer aside); torchvision: its weights' metadata.
    size_bytes: int
    trained_on: str
    attention: str  # what its attention is known to look like: the model card's second half
    config: dict = field(default_factory=dict)  # ViTConfig fields; the rest are the defaults
    imagenet_classes: bool = False  # its head scores the 1000 ImageNet-1k classes
    drop_keys: tuple[str, ...] = ()  # tensors of the file that are no part of our model
    licence: str = "Apache-2.0"  # the weights' licence, as their publisher gives it
    # Not an open-source licence: the app asks the person to accept it before downloading.
    terms_to_accept: bool = False
    eva_names: bool = False  # the file names its tensors as timm's Eva does (model.from_timm_eva)
    # A CLIP or SigLIP whose repository holds open_clip's files (both towers): open_clip's model
    # config of the two (the name of one of its configs, or the config itself), which the download
    # is checked against, whatever the downloaded open_clip_config.json says. None: timm's file of
    # the image tower alone. size_bytes is then both towers' weights.
    open_clip: str | dict | None = None
    tokenizer: bool = False  # its text tower reads the Hugging Face tokenizer of its repository

    @property
    def card(self) -> str:
        return f"{self.title}: trained on {self.trained_on}. {self.attention} Licence: {self.licence}."

    @property
    def files(self) -> tuple[str, ...]:
        """The files of its Hub repository that a download brings, every one needed, the weights
        last (timm entries; torchvision's is its own)."""
        if self.open_clip is None:
            return (TIMM_FILE,)
        tokenizer = TOKENIZER_FILES if self.tokenizer else ()
        return (from_open_clip.CONFIG_FILE, *tokenizer, from_open_clip.WEIGHTS_FILE)

    def open_clip_config(self) -> dict:
        """open_clip's model config of both towers (importing open_clip, seconds: only to check or
        load a download)."""
        if isinstance(self.open_clip, dict):
            return json.loads(json.dumps(self.open_clip))
        import open_clip

        config = open_clip.get_model_config(self.open_clip)
        if config is None:
            raise KeyError(f"open_clip has no model config {self.open_clip!r}")
        return json.loads(json.dumps(config))

    def config_without_names(self) -> ViTConfig:
        return ViTConfig(**self.config)

    def vit_config(self) -> ViTConfig:
        class_names = imagenet_class_names() if self.imagenet_classes else None
        return ViTConfig(**self.config, class_names=class_names)


CATALOGUE: dict[str, CatalogueEntry] = {
    "vit_b_16": CatalogueEntry(
        "ImageNet ViT-B/16 (torchvision)", "torchvision:vit_b_16", 346_328_924,
        "ImageNet-1k, supervised (torchvision's recipe)",
        "Supervised ViTs attend diffusely: the class token spreads over the object and background"
        " alike, and rollout is needed to see the object.",
        imagenet_classes=True, licence="BSD-3-Clause (torchvision)",
    ),
    "dino_vits16": CatalogueEntry(
        "DINO ViT-S/16", "timm/vit_small_patch16_224.dino", 86_662_656,
        "ImageNet-1k images without labels (DINO self-distillation)",
        "Its class token finds the object without ever seeing a label: last-layer heads segment"
        " the foreground, some heads one part each.",
        config=dict(image_size=224, patch_size=16, num_classes=0, **_VIT_S, **_IMAGENET),
    ),
    "dino_vits8": CatalogueEntry(
        "DINO ViT-S/8", "timm/vit_small_patch8_224.dino", 86_681_088,
        "ImageNet-1k images without labels (DINO self-distillation)",
        "The sharpest DINO maps (784 patches): the class token's heads trace object outlines.",
        config=dict(image_size=224, patch_size=8, num_classes=0, **_VIT_S, **_IMAGENET),
    ),
    "dino_vitb16": CatalogueEntry(
        "DINO ViT-B/16", "timm/vit_base_patch16_224.dino", 343_194_624,
        "ImageNet-1k images without labels (DINO self-distillation)",
        "Like DINO ViT-S/16 with twice the heads: the class token segments the object.",
        config=dict(image_size=224, patch_size=16, num_classes=0, **_VIT_B, **_IMAGENET),
    ),
    "dinov2_vits14_reg": CatalogueEntry(
        "DINOv2 ViT-S/14 with registers", "timm/vit_small_patch14_reg4_dinov2.lvd142m", 88_229_376,
        "LVD-142M, 142 million curated images without labels (DINOv2), at 518x518",
        "Clean, object-centred maps and token PCA that parts objects; the 4 registers take the"
        " high-norm artifact tokens that DINOv2 without registers puts on background patches.",
        config=dict(
            image_size=518, patch_size=14, num_classes=0, reg_tokens=4, no_embed_class=True,
            init_values=1e-5, **_VIT_S, **_IMAGENET,
        ),
    ),
    "deit_s": CatalogueEntry(
        "DeiT-S", "timm/deit_small_patch16_224.fb_in1k", 88_202_656,
        "ImageNet-1k, supervised with strong augmentation (DeiT)",
        "Supervised: the class token's attention covers the object but leaks onto context that"
        " predicts the class.",
        config=dict(image_size=224, patch_size=16, num_classes=1000, **_VIT_S, **_IMAGENET),
        imagenet_classes=True,
    ),
    "deit3_s": CatalogueEntry(
        "DeiT III-S", "timm/deit3_small_patch16_224.fb_in1k", 88_237_984,
        "ImageNet-1k, supervised (DeiT III recipe, LayerScale)",
        "Supervised and long-trained: sharper than DeiT, with high-norm artifact tokens in late"
        " layers that grab attention.",
        config=dict(
            image_size=224, patch_size=16, num_classes=1000, no_embed_class=True, init_values=1e-6,
            **_VIT_S, **_IMAGENET,
        ),
        imagenet_classes=True,
    ),
    "augreg_vitb16": CatalogueEntry(
        "AugReg ViT-B/16 (21k -> 1k)", "timm/vit_base_patch16_224.augreg2_in21k_ft_in1k", 346_270_624,
        "ImageNet-21k, then fine-tuned on ImageNet-1k (AugReg, supervised)",
        "The original ViT recipe: early heads mix local and global, the class token's maps are"
        " diffuse; rollout shows the object.",
        config=dict(image_size=224, patch_size=16, num_classes=1000, **_VIT_B),
        imagenet_classes=True,
    ),
    # CLIP and SigLIP: open_clip's files of the repositories open_clip itself loads them from
    # (open_clip/pretrained.py), both towers; the pages explore the image tower, headless (no
    # classes: the projection into the text space is the words' own, vit_explorer.text).
    "clip_vitb16": CatalogueEntry(
        "CLIP ViT-B/16 (OpenAI)", "timm/vit_base_patch16_clip_224.openai", 598_482_948,
        "400 million image-text pairs from the web (OpenAI CLIP, contrastive)",
        "Its text tower comes with it (no classes: texts score the image). Its attention is known"
        " to be noisy, with a few background tokens that everyone reads.",
        config=dict(
            image_size=224, patch_size=16, num_classes=0, pre_norm=True, patch_bias=False,
            act_layer="quick_gelu", layer_norm_eps=1e-5, mean=OPENAI_CLIP_MEAN,
            std=OPENAI_CLIP_STD, **_VIT_B,
        ),
        open_clip="ViT-B-16-quickgelu",  # ViT-B-16 as OpenAI trained it, with QuickGELU
    ),
    "siglip_vitb16": CatalogueEntry(
        "SigLIP ViT-B/16", "timm/ViT-B-16-SigLIP", 812_623_880,
        "WebLI image-text pairs (Google SigLIP, sigmoid contrastive loss)",
        "Its text tower comes with it. No class token: an attention-pool head's probe query"
        " gathers the image, and its attention is shown where a class token's would be.",
        config=_SIGLIP_B, open_clip="ViT-B-16-SigLIP", tokenizer=True,
    ),
    "siglip2_vitb16": CatalogueEntry(
        "SigLIP 2 ViT-B/16", "timm/ViT-B-16-SigLIP2", 1_500_751_880,
        "WebLI image-text pairs (Google SigLIP 2: sigmoid loss, captioning, self-distillation and"
        " masked prediction)",
        "Its text tower comes with it (Gemma's 256,000-token vocabulary, most of the download)."
        " SigLIP's architecture (an attention-pool probe, no class token), trained also for dense"
        " features: its patch tokens and maps are cleaner than SigLIP's.",
        config=_SIGLIP_B, open_clip="ViT-B-16-SigLIP2", tokenizer=True,
    ),
    "dinov3_vits16": CatalogueEntry(
        "DINOv3 ViT-S/16", "timm/vit_small_patch16_dinov3.lvd1689m", 86_347_776,
        "LVD-1689M, 1.7 billion curated web images without labels (DINOv3, distilled from its 7B)",
        "Dense features kept sharp to the last layer: token PCA and patch similarity part objects; 4"
        " registers take the high-norm tokens, and rotary positions make any image size native.",
        config=dict(image_size=224, **_VIT_S, **_DINOV3), licence=DINOV3_LICENCE, terms_to_accept=True, eva_names=True,
    ),
    "dinov3_vitb16": CatalogueEntry(
        "DINOv3 ViT-B/16", "timm/vit_base_patch16_dinov3.lvd1689m", 342_564_864,
        "LVD-1689M, 1.7 billion curated web images without labels (DINOv3, distilled from its 7B)",
        "Like DINOv3 ViT-S/16 with twice the heads: clean, object-centred maps at any image size.",
        config=dict(image_size=224, **_VIT_B, **_DINOV3), licence=DINOV3_LICENCE, terms_to_accept=True, eva_names=True,
    ),
}


class DownloadError(OSError):
    """A catalogue download failed or gave a wrong file; the message says why in one sentence."""

    status: int | None = None  # the HTTP status the server answered with, where it answered one


def imagenet_class_names() -> tuple[str, ...]:
    """The 1000 ImageNet-1k class names in the usual index order (shipped with torchvision)."""
    import torchvision.models

    return tuple(torchvision.models.ViT_B_16_Weights.IMAGENET1K_V1.meta["categories"])


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_VARIABLE) or Path.home() / ".cache" / "vit_explorer") / "models"


def entry(name: str) -> CatalogueEntry:
    if name not in CATALOGUE:
        raise KeyError(name)
    return CATALOGUE[name]


def _torchvision_model(name: str) -> str | None:
    """The torchvision model name of a torchvision entry ("torchvision:vit_b_16"), else None."""
    kind, _, model = entry(name).source.partition(":")
    return model if kind == "torchvision" else None


def url(name: str) -> str:
    """Where the entry's weights are downloaded from."""
    model = _torchvision_model(name)
    if model is not None:
        return torchvision_url(model)
    return file_url(name, entry(name).files[-1])


def file_url(name: str, file_name: str) -> str:
    """Where a file of a Hub entry's repository is (on the Hub, or the mirror VIT_EXPLORER_HUB_URL names)."""
    hub = (os.environ.get(HUB_URL_VARIABLE) or DEFAULT_HUB_URL).rstrip("/")
    return f"{hub}/{entry(name).source}/resolve/main/{file_name}"


# torchvision's file names of the catalogue's torchvision models (a test checks them against
# torchvision.models): asking torchvision.models imports torch._dynamo, 6 s of a server's first page
# view, since the model picker asks on every run whether each model is downloaded.
TORCHVISION_FILES = {"vit_b_16": "vit_b_16-c867db91.pth"}
TORCHVISION_MODELS_URL = "https://download.pytorch.org/models"


def torchvision_url(model: str) -> str:
    """Where torchvision publishes a model's ImageNet weights, or the mirror that
    VIT_EXPLORER_TORCHVISION_URL names."""
    file_name = TORCHVISION_FILES.get(model)
    if file_name is None:
        import torchvision.models

        file_name = torchvision.models.get_model_weights(model).DEFAULT.url.rsplit("/", 1)[1]
    mirror = os.environ.get(TORCHVISION_URL_VARIABLE) or TORCHVISION_MODELS_URL
    return f"{mirror.rstrip('/')}/{file_name}"


def torchvision_path(model: str) -> Path:
    """Where torchvision's own loader finds the file: torch.hub's checkpoints folder."""
    return Path(torch.hub.get_dir()) / "checkpoints" / torchvision_url(model).rsplit("/", 1)[1]


def cached_path(name: str) -> Path:
    """Where the entry is once downloaded: its file, or an open_clip entry's folder."""
    model = _torchvision_model(name)
    if model is not None:
        return torchvision_path(model)
    if entry(name).open_clip is not None:
        return cache_dir() / name
    return cache_dir() / f"{name}.safetensors"


def is_downloaded(name: str) -> bool:
    """Whether every file the entry needs is in the cache (asked by the model picker on every run:
    no import of torchvision.models or open_clip)."""
    path = cached_path(name)
    if entry(name).open_clip is None:
        return path.is_file()
    return all((path / file_name).is_file() for file_name in entry(name).files)


def text_folder(name: str) -> Path | None:
    """The folder of an entry that has a text tower (CLIP, SigLIP), which
    vit_explorer.text.load_image_text_model reads (complete once is_downloaded); None for an
    entry without one."""
    return cached_path(name) if name in CATALOGUE and entry(name).open_clip is not None else None


def _header_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape from a safetensors header; a DownloadError if the file has no valid
    header or its size is not the header's plus the tensor data the header announces."""
    size = path.stat().st_size
    with open(path, "rb") as file:
        start = file.read(8)
        if len(start) < 8:
            raise DownloadError("too short to be a safetensors file")
        (length,) = struct.unpack("<Q", start)
        if length > 100 * 2**20 or length > size - 8:
            raise DownloadError("not a safetensors file")
        try:
            header = json.loads(file.read(length))
            tensors = {key: value for key, value in header.items() if key != "__metadata__"}
            data_bytes = max((value["data_offsets"][1] for value in tensors.values()), default=0)
            shapes = {key: tuple(value["shape"]) for key, value in tensors.items()}
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError):
            raise DownloadError("not a safetensors file") from None
    if size != 8 + length + data_bytes:
        raise DownloadError(f"truncated ({size} of {8 + length + data_bytes} bytes)")
    return shapes


def our_names(name: str, shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """A file's tensor shapes under our names: timm Eva's renamed as model.from_timm_eva renames
    the tensors themselves (on the meta device, nothing allocated)."""
    if not entry(name).eva_names:
        return shapes
    try:
        with torch.device("meta"):
            renamed = from_timm_eva({key: torch.empty(shape) for key, shape in shapes.items()})
    except (KeyError, RuntimeError, ValueError):  # q and v biases that are missing or do not fit
        raise DownloadError(f"the downloaded {name} file is not the expected model (its q and v biases do not fit)") from None
    return {key: tuple(value.shape) for key, value in renamed.items()}


def expected_shapes(name: str) -> dict[str, tuple[int, ...]]:
    """The parameter shapes the entry's architecture has (built on the meta device, no memory)."""
    with torch.device("meta"):
        model = ViT(entry(name).config_without_names())
    return {key: tuple(value.shape) for key, value in model.state_dict().items()}


def check_file(name: str, path: Path) -> None:
    """Raise DownloadError unless ``path`` holds exactly the tensors the entry's model needs."""
    try:
        found = _header_shapes(path)
    except DownloadError as error:
        raise DownloadError(f"the downloaded {name} file is {error}") from None
    for key in entry(name).drop_keys:
        found.pop(key, None)
    found = our_names(name, found)
    expected = expected_shapes(name)
    if found != expected:
        raise DownloadError(f"the downloaded {name} file is not the expected model ({_differences(expected, found)})")


def _differences(expected: dict[str, tuple[int, ...]], found: dict[str, tuple[int, ...]]) -> str:
    """What keeps ``found`` from being ``expected``, in words ("" when nothing does)."""
    missing = sorted(set(expected) - set(found))[:3]
    extra = sorted(set(found) - set(expected))[:3]
    wrong = [key for key in expected if key in found and found[key] != expected[key]][:3]
    return "; ".join(
        f"{what}: {', '.join(keys)}"
        for what, keys in (("missing", missing), ("unexpected", extra), ("wrong shape", wrong))
        if keys
    )


@dataclass(frozen=True)
class OpenClipShapes:
    """The tensors an open_clip entry's weights file holds, from the entry's own configs: its image
    tower under our names (the entry's ViT), the projection into the shared space as
    (embed_dim, width) or None, the text tower under open_clip's names, and the one-number scores
    (logit_scale; SigLIP's logit_bias)."""

    image: dict[str, tuple[int, ...]]
    projection: tuple[int, int] | None
    text: dict[str, tuple[int, ...]]
    scalars: tuple[str, ...]

    @property
    def numel(self) -> int:
        shapes = [*self.image.values(), *self.text.values(), *([self.projection] if self.projection else [])]
        return sum(math.prod(shape) for shape in shapes) + len(self.scalars)


def _text_tower_shapes(model_cfg: dict) -> dict[str, tuple[int, ...]]:
    """The shapes of open_clip's TextTransformer of ``model_cfg``, made on the meta device."""
    from open_clip.model import _build_text_tower

    with torch.device("meta"):
        tower = _build_text_tower(
            model_cfg["embed_dim"], dict(model_cfg["text_cfg"]), quick_gelu=bool(model_cfg.get("quick_gelu")),
        )
    return {key: tuple(value.shape) for key, value in tower.state_dict().items()}


def open_clip_shapes(name: str) -> OpenClipShapes:
    """What an open_clip entry's weights must hold (nothing allocated; imports open_clip)."""
    known = entry(name)
    model_cfg = known.open_clip_config()
    vision = model_cfg["vision_cfg"]
    width = known.config_without_names().embed_dim
    # A timm trunk's projection is its head ("none": the trunk's own output, SigLIP's); open_clip's
    # own ViT (CLIP) projects with visual.proj.
    timm_unprojected = vision.get("timm_model_name") and vision.get("timm_proj", "linear") == "none"
    scalars = ("logit_scale", "logit_bias") if model_cfg.get("init_logit_bias") is not None else ("logit_scale",)
    return OpenClipShapes(
        image=expected_shapes(name),
        projection=None if timm_unprojected else (model_cfg["embed_dim"], width),
        text=_text_tower_shapes(model_cfg),
        scalars=scalars,
    )


def check_open_clip_weights(name: str, path: Path) -> None:
    """Raise DownloadError unless ``path`` holds exactly both towers the entry's configs make."""
    try:
        found = _header_shapes(path)
    except DownloadError as error:
        raise DownloadError(f"the downloaded {name} file is {error}") from None
    expected = open_clip_shapes(name)
    custom_text = bool(entry(name).open_clip_config().get("custom_text"))
    with torch.device("meta"):
        state = {key: torch.empty(shape) for key, shape in found.items()}
    problems = []
    try:
        image, projection = from_open_clip.image_tower(state, name)
    except (CheckpointError, RuntimeError):  # no tower of either layout, or one torch cannot reshape
        image, projection = {}, None
        problems.append("image tower: none we can read")
    else:
        if detail := _differences(expected.image, {key: tuple(value.shape) for key, value in image.items()}):
            problems.append(f"image tower {detail}")
        projection = None if projection is None else tuple(projection.shape)
        if projection != expected.projection:
            problems.append(f"image projection: {projection or 'none'} where {expected.projection or 'none'} is expected")
    text = {key: tuple(value.shape) for key, value in from_open_clip.text_tower(state, custom_text).items()}
    if detail := _differences(expected.text, text):
        problems.append(f"text tower {detail}")
    scores = [key for key in expected.scalars if key not in found or math.prod(found[key]) != 1]
    if scores:
        problems.append(f"not one number: {', '.join(scores)}")
    # A CLIP's text tower is every top-level tensor but the scores (from_open_clip.text_tower).
    in_text = (lambda key: key.startswith("text.")) if custom_text else (lambda key: key not in ("logit_scale", "logit_bias"))
    others = sorted(key for key in found if not key.startswith("visual.") and key not in expected.scalars and not in_text(key))
    if others:
        problems.append(f"unexpected: {', '.join(others[:3])}")
    if problems:
        raise DownloadError(f"the downloaded {name} file is not the expected model ({'; '.join(problems)})")


def _same_text_tower(found: dict, expected: dict) -> bool:
    """Whether the model config ``found`` (a downloaded file's) makes the text tower ``expected``
    does: the same sizes and activation, then (on the meta device) the same tensors."""
    from open_clip.model import CLIPTextCfg

    try:
        text, wanted = CLIPTextCfg(**found["text_cfg"]), CLIPTextCfg(**expected["text_cfg"])
    except TypeError:  # settings open_clip does not know
        return False
    sizes = ("context_length", "vocab_size", "width", "heads", "layers", "mlp_ratio")
    if any(getattr(text, size) != getattr(wanted, size) for size in sizes) or text.hf_model_name \
            or found.get("embed_dim") != expected["embed_dim"] \
            or bool(found.get("custom_text")) != bool(expected.get("custom_text")) \
            or bool(text.hf_tokenizer_name) != bool(wanted.hf_tokenizer_name):
        return False
    try:  # its sizes are the entry's: made on the meta device, it costs what the entry's does
        return _text_tower_shapes(found) == _text_tower_shapes(expected)
    except Exception:  # any other setting open_clip cannot make a tower of
        return False


def _read_json(name: str, file_name: str, path: Path):
    try:
        return json.loads(path.read_bytes())
    except (ValueError, RecursionError, UnicodeDecodeError):  # JSONDecodeError is a ValueError
        raise DownloadError(f"the downloaded {name} {file_name} is not JSON") from None


def check_open_clip_config(name: str, path: Path) -> None:
    """Raise DownloadError unless ``path`` is an open_clip config whose model_cfg makes the entry's
    text tower (vit_explorer.text makes the text tower from this file)."""
    what = f"the downloaded {name} {from_open_clip.CONFIG_FILE}"
    config = _read_json(name, from_open_clip.CONFIG_FILE, path)
    model_cfg = config.get("model_cfg") if isinstance(config, dict) else None
    if not isinstance(model_cfg, dict) or not isinstance(model_cfg.get("text_cfg"), dict) \
            or not isinstance(model_cfg.get("vision_cfg"), dict):
        raise DownloadError(f"{what} has no model_cfg with a text_cfg and a vision_cfg")
    if not _same_text_tower(model_cfg, entry(name).open_clip_config()):
        raise DownloadError(f"{what} describes another text tower than {entry(name).title}'s")
    # The text tower is then made as the entry knows it was trained: a hub config that leaves out
    # an activation flag (OpenAI's QuickGELU) must not change the tower silently.
    config["model_cfg"] = entry(name).open_clip_config()
    path.write_text(json.dumps(config), encoding="utf-8")


def check_tokenizer_file(name: str, file_name: str, path: Path) -> None:
    """Raise DownloadError unless ``path`` is a JSON object (tokenizer.json: with a model);
    vit_explorer.text reads the tokenizer itself when the text tower is loaded."""
    content = _read_json(name, file_name, path)
    if not isinstance(content, dict) or (file_name == "tokenizer.json" and not isinstance(content.get("model"), dict)):
        raise DownloadError(f"the downloaded {name} {file_name} is not a tokenizer's {file_name}")


def _file_check(name: str, file_name: str) -> Callable[[Path], None]:
    if file_name == from_open_clip.WEIGHTS_FILE:
        return lambda path: check_open_clip_weights(name, path)
    if file_name == from_open_clip.CONFIG_FILE:
        return lambda path: check_open_clip_config(name, path)
    return lambda path: check_tokenizer_file(name, file_name, path)


def download(name: str, progress: Callable[[int, int | None], None] | None = None) -> Path:
    """The entry's file in the cache (an open_clip entry's folder), downloaded first if it is not
    there yet.

    ``progress(done_bytes, total_bytes or None)`` is called as the bytes arrive (over all of an
    open_clip entry's files). A file is written beside its final place under a temporary name,
    checked, and renamed into place.
    """
    model = _torchvision_model(name)
    if model is not None:
        return download_torchvision(model, progress)
    known = entry(name)
    if known.open_clip is not None:
        return download_open_clip(name, progress)
    return _fetch(
        known.title, url(name), cached_path(name), lambda path: check_file(name, path), progress,
        expected_bytes=known.size_bytes, mirror_variable=HUB_URL_VARIABLE,
    )


def download_open_clip(name: str, progress: Callable[[int, int | None], None] | None = None) -> Path:
    """An open_clip entry's folder in the cache (both towers, their config, a SigLIP's tokenizer),
    downloaded first if any file it needs is missing.

    Each file goes through :func:`_fetch` into a staging folder beside the cache's, checked (the
    weights from their header against both towers of the entry's configs), all within one
    deadline; only when every one is there are they moved into the entry's folder, the weights
    last, so that :func:`is_downloaded` never sees part of a download. One ``progress`` over all
    the files: the bytes so far, and their total once the weights' size is known.
    """
    folder = cached_path(name)
    if is_downloaded(name):
        return folder
    known = entry(name)
    seconds = download_timeout()
    ends = time.monotonic() + seconds
    cache = cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    _remove_abandoned(folder, seconds)
    staging = cache / f".{name}.{uuid.uuid4().hex}.tmp"
    staging.mkdir(mode=0o700)
    *small, weights = known.files
    wanted = [(file_name, True) for file_name in small]
    wanted += [(file_name, False) for file_name in OPTIONAL_TOKENIZER_FILES if known.tokenizer]
    wanted.append((weights, True))
    fetched: list[str] = []
    done = 0  # the bytes of the files fetched so far

    def report(base: int, is_weights: bool) -> Callable[[int, int | None], None] | None:
        if progress is None:
            return None
        return lambda file_done, file_total: progress(
            base + file_done, base + file_total if is_weights and file_total is not None else None,
        )

    try:
        for file_name, required in wanted:
            expected_bytes = known.size_bytes if file_name == weights else SMALL_FILE_BYTES.get(file_name, SMALL_FILE_DEFAULT_BYTES)
            try:
                path = _fetch(
                    known.title, file_url(name, file_name), staging / file_name, _file_check(name, file_name),
                    report(done, file_name == weights), expected_bytes=expected_bytes,
                    mirror_variable=HUB_URL_VARIABLE, ends=ends,
                )
            except DownloadError as error:
                if not required and error.status == 404:  # a file some repositories do not have
                    continue
                raise
            done += path.stat().st_size
            fetched.append(file_name)
        folder.mkdir(parents=True, exist_ok=True)
        for file_name in fetched:  # the weights last
            os.replace(staging / file_name, folder / file_name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    # The image tower alone, which the catalogue downloaded for this entry before it took both.
    (cache / f"{name}.safetensors").unlink(missing_ok=True)
    return folder


def download_torchvision(model: str, progress: Callable[[int, int | None], None] | None = None) -> Path:
    """A torchvision ViT's weights in torch.hub's cache (where torchvision loads them from),
    downloaded first if they are not there yet; checked against the hash in the file's name."""
    import torchvision.models

    source = f"torchvision:{model}"
    known = next((known for known in CATALOGUE.values() if known.source == source), None)
    title = known.title if known is not None else f"torchvision's {model}"
    # torchvision's metadata gives the file's size in MiB.
    size = known.size_bytes if known is not None else int(
        torchvision.models.get_model_weights(model).DEFAULT.meta["_file_size"] * 2**20
    )
    target = torchvision_path(model)
    return _fetch(
        title, torchvision_url(model), target, lambda path: _check_hash(path, target.name), progress,
        expected_bytes=size, mirror_variable=TORCHVISION_URL_VARIABLE,
    )


def _check_hash(path: Path, name: str) -> None:
    """torch.hub's convention for ``name``: "model-<first hex digits of the file's SHA-256>.pth"."""
    expected = re.search(torch.hub.HASH_REGEX, name)
    if expected is None:
        return
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(CHUNK_BYTES):
            digest.update(chunk)
    if not digest.hexdigest().startswith(expected.group(1)):
        raise DownloadError(f"the downloaded file does not match its checksum ({expected.group(1)}...)")


def download_timeout() -> float:
    """Seconds a whole download may take (VIT_EXPLORER_DOWNLOAD_TIMEOUT, default 30 minutes)."""
    text = os.environ.get(TIMEOUT_VARIABLE)
    if not text:
        return DEFAULT_TIMEOUT_SECONDS
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not seconds > 0:
        raise DownloadError(f"{TIMEOUT_VARIABLE} must be a number of seconds above 0, not {text!r}")
    return seconds


def size_limit(expected_bytes: int) -> int:
    """The most a download of ``expected_bytes`` may bring: a timm file's header and a mirror's
    slightly different copy fit, an endless stream does not."""
    return expected_bytes + expected_bytes // 20 + CHUNK_BYTES


class _Deadline:
    """Ends a download's connections at its deadline: a read blocked on a mirror that drips its
    answer (the TLS handshake, status line and headers included) then returns at once."""

    def __init__(self, seconds: float):
        self.passed = False
        self._ended = False
        # Duplicates of the connections' sockets: shutting one down ends its connection, even
        # once TLS has taken the original over.
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True

    def watch(self, sock: socket.socket) -> socket.socket:
        with self._lock:
            self._sockets.append(sock.dup())
            if self.passed:
                self._shut_all()
        return sock

    def _expire(self) -> None:
        with self._lock:
            if not self._ended:
                self.passed = True
                self._shut_all()

    def _shut_all(self) -> None:
        for sock in self._sockets:
            with contextlib.suppress(OSError):  # the server may have closed it already
                sock.shutdown(socket.SHUT_RDWR)

    def connection(self, connection_class: type[http.client.HTTPConnection]) -> Callable:
        """A factory of ``connection_class`` whose sockets this deadline watches."""

        def connect(*args, **kwargs) -> http.client.HTTPConnection:
            connection = connection_class(*args, **kwargs)
            create = connection._create_connection  # http.client's own hook for making the socket
            connection._create_connection = lambda *args, **kwargs: self.watch(create(*args, **kwargs))
            return connection

        return connect

    def __enter__(self) -> "_Deadline":
        self._timer.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._timer.cancel()
        with self._lock:
            self._ended = True
            for sock in self._sockets:
                sock.close()


class _WatchedHTTPHandler(urllib.request.HTTPHandler):
    def __init__(self, deadline: _Deadline):
        super().__init__()
        self._deadline = deadline

    def http_open(self, request):
        return self.do_open(self._deadline.connection(http.client.HTTPConnection), request)


class _WatchedHTTPSHandler(urllib.request.HTTPSHandler):
    def __init__(self, deadline: _Deadline):
        super().__init__()
        self._deadline = deadline

    def https_open(self, request):
        return self.do_open(self._deadline.connection(http.client.HTTPSConnection), request)


def _unreachable(error: OSError) -> str:
    """Why a server could not be reached, in words (no errno)."""
    if isinstance(error, socket.gaierror):
        return "its name could not be resolved"
    if isinstance(error, ConnectionRefusedError):
        return "the connection was refused"
    if isinstance(error, TimeoutError):
        return "it did not answer"
    return (error.strerror or str(error) or type(error).__name__).rstrip(".").lower()


def _broken_answer(error: http.client.HTTPException) -> str:
    if isinstance(error, http.client.IncompleteRead):
        return "the connection was cut in the middle of the file"
    if isinstance(error, http.client.LineTooLong):
        return "an over-long header line"
    if isinstance(error, http.client.RemoteDisconnected):
        return "the connection was closed without an answer"
    if isinstance(error, http.client.BadStatusLine):
        return "no HTTP status line"
    return type(error).__name__


def _remove_abandoned(target: Path, seconds: float) -> None:
    """Temporary files (or an open_clip download's staging folders) of downloads that ended without
    cleaning up (their process was killed): older than a whole download may last, so no download
    is still writing them."""
    for temporary in target.parent.glob(f".{glob.escape(target.name)}.*.tmp"):
        with contextlib.suppress(OSError):
            if time.time() - temporary.lstat().st_mtime > seconds + READ_TIMEOUT_SECONDS:
                if temporary.is_dir() and not temporary.is_symlink():
                    shutil.rmtree(temporary)
                else:
                    temporary.unlink()


def _fetch(
    title: str, source: str, target: Path, check: Callable[[Path], None],
    progress: Callable[[int, int | None], None] | None, *, expected_bytes: int, mirror_variable: str,
    ends: float | None = None,
) -> Path:
    """``source`` into ``target``, checked; ``ends``: the time.monotonic() by which a download of
    several files must end (the whole VIT_EXPLORER_DOWNLOAD_TIMEOUT for one file)."""
    if target.is_file():
        return target
    seconds = download_timeout()
    left = seconds if ends is None else ends - time.monotonic()
    limit = size_limit(expected_bytes)
    failed = f"could not download {title} from {source}"
    if left <= 0:
        raise DownloadError(f"{failed}: it took longer than {seconds:g} s ({TIMEOUT_VARIABLE} allows more)")
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_abandoned(target, seconds)
    temporary = target.parent / f".{target.name}.{uuid.uuid4().hex}.tmp"
    with _Deadline(left) as deadline:
        opener = urllib.request.build_opener(_WatchedHTTPHandler(deadline), _WatchedHTTPSHandler(deadline))
        try:
            with opener.open(source, timeout=min(READ_TIMEOUT_SECONDS, left)) as response, \
                    open(temporary, "wb") as file:
                total = response.length
                if total is not None and total > limit:
                    raise DownloadError(
                        f"{failed}: the server announced {total} bytes for a file of about {expected_bytes}"
                    )
                done = 0
                # read1: whatever has arrived, so that the deadline and the size are checked as
                # the bytes come, however slowly.
                while chunk := response.read1(CHUNK_BYTES):
                    done += len(chunk)
                    if done > limit:
                        raise DownloadError(
                            f"{failed}: the server sent more than {limit} bytes for a file of about {expected_bytes}"
                        )
                    file.write(chunk)
                    if progress is not None:
                        progress(done, total)
                if deadline.passed and done != total:
                    raise TimeoutError  # cut short by the deadline, whatever the server meant to send
                if total is not None and done != total:
                    raise DownloadError(f"the download of {title} stopped after {done} of {total} bytes")
            check(temporary)
            os.replace(temporary, target)
        except DownloadError:
            raise
        except (OSError, http.client.HTTPException) as error:
            if deadline.passed:
                raise DownloadError(
                    f"{failed}: it took longer than {seconds:g} s ({TIMEOUT_VARIABLE} allows more)"
                ) from None
            if isinstance(error, urllib.error.HTTPError):
                answered = DownloadError(f"could not download {title}: {source} answered {error.code} {error.reason}")
                answered.status = error.code
                raise answered from None
            if isinstance(error, http.client.HTTPException):
                raise DownloadError(f"{failed}: the server's answer was broken ({_broken_answer(error)})") from None
            if isinstance(error, urllib.error.URLError) and isinstance(error.reason, OSError):
                raise DownloadError(
                    f"{failed} (no internet?): {_unreachable(error.reason)}; {mirror_variable} can name a mirror"
                ) from None
            if isinstance(error, TimeoutError):
                raise DownloadError(f"{failed}: the server sent nothing for {READ_TIMEOUT_SECONDS:g} s") from None
            raise DownloadError(f"{failed}: {_unreachable(error)}") from None
        finally:
            temporary.unlink(missing_ok=True)
    return target
