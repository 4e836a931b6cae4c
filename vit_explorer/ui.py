"""Streamlit glue for the explorer app: cached loaders and the selection every page shares.

The only module of the package that imports streamlit. Models live in ``st.cache_resource``
(one copy per process), captures in ``st.cache_data`` keyed by model, patch size and image, so
moving a slider redraws figures without a new forward pass. Session state holds only keys and
small values; everything heavy is looked up in the caches by key.

Model keys: ``"default"`` (the shipped shapes model), ``"pretrained:<name>"`` (a catalogue
entry, vit_explorer.catalogue) and ``"file:<path>"`` (an uploaded checkpoint or a run trained in
the app).
"""
from __future__ import annotations

import gc
import hashlib
import io
import os
import secrets
import shutil
import socket
import stat
import statistics
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import orjson
# Imported here, once, before any session runs: plotly's validators and Streamlit's elements
# import pandas lazily on whichever thread needs it first, and a second session's thread then
# finds it half-initialised ("module 'pandas' has no attribute 'Series'", seen on the Attention
# page's first view in Chromium). Frozen below with the other imports.
import pandas  # noqa: F401
import plotly.graph_objects as go
import plotly.io as pio
import streamlit as st
import torch
from _plotly_utils.utils import convert_to_base64
from PIL import Image
from streamlit.runtime.memory_uploaded_file_manager import MemoryUploadedFileManager
from streamlit.runtime.scriptrunner import get_script_run_ctx

from . import catalogue, figures, resources, runs, train  # noqa: F401 (figures: frozen below with plotly)
from .ablation import HeadSweep, KnockOut, head_sweep
from .analysis import attribution, display_image, near_chance
from .cache import ByteBoundedCache, nbytes, trim_to_quota
from .capture import Capture, capture, layer_internals
from .config import TrainConfig
from .data import SHAPE_CLASSES, SHAPES_TEST_SEED, ImageDataset, shapes_dataset, shapes_sample
from .image_set import MAX_IMAGES, MIN_IMAGES, first_component, last_layer_features, layer_keys
from .images import load_image, preprocess
from .internals import LayerInternals
from .model import ViT
from .weights import load_model, load_pretrained, resize_model

DEFAULT_MODEL = "default"
PRETRAINED_MODEL = "pretrained:vit_b_16"
PHOTOS_DIR = resources.app_root() / "assets" / "samples"


def default_uploads_dir() -> Path:
    """VIT_EXPLORER_UPLOADS_DIR, else uploads/ in this user's cache (VIT_EXPLORER_CACHE or
    ~/.cache/vit_explorer): a folder of this server's own, not the temp directory every user and
    every other instance on the machine can write to."""
    configured = os.environ.get("VIT_EXPLORER_UPLOADS_DIR")
    if configured:
        return Path(configured)
    cache = os.environ.get(catalogue.CACHE_VARIABLE) or Path.home() / ".cache" / "vit_explorer"
    return Path(cache) / "uploads"


UPLOADS_DIR = default_uploads_dir()
# Where runs trained in the app write their checkpoints.
RUNS_DIR = resources.default_runs_dir()
# The largest attention tensor (depth x heads x N x N, counted in float32) a patch size may
# produce: ViT-B/16 at patch 8 (785 tokens) is about 355 MB and still fits (the app keeps it in
# float16, 177 MB; the bound also keeps a capture within a few seconds on a CPU).
MAX_ATTENTION_BYTES = 400 * 2**20
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# Captures, analyses and figures shared by all sessions (a ViT-B/16 capture at patch 8 is 180 MB).
CACHE_BYTES = int(float(os.environ.get("VIT_EXPLORER_CACHE_MB") or 2048) * 2**20)
# Models loaded or resized for any session (a ViT-B/16 is 330 MB).
MODELS_BYTES = int(float(os.environ.get("VIT_EXPLORER_MODELS_MB") or 3072) * 2**20)
# Uploaded checkpoints and images together; the oldest are removed first to make room.
UPLOADS_QUOTA_BYTES = int(float(os.environ.get("VIT_EXPLORER_UPLOADS_MB") or 4096) * 2**20)
_UPLOADS_LOCK = threading.Lock()  # one upload at a time moves into the folder and trims it
# Uploads written but not checked yet (under _UPLOADS_LOCK): trimming never removes them.
_INCOMING: list[Path] = []
# An image's own limit (the browser refuses larger files before sending them); the server-wide
# server.maxUploadSize (.streamlit/config.toml) is for checkpoints.
IMAGE_UPLOAD_MB = 25
# What the image uploader offers: the formats PIL reads that images.load_image turns into RGB.
IMAGE_TYPES = ["png", "jpg", "jpeg", "webp", "gif", "bmp", "tif", "tiff"]
# Work a view does unasked: about 3 forward passes of a ViT-S/16 at 224 (multiply-adds).
QUICK_COST = 13e9
# Held-out images per patch size on the Patches page: the shipped model's comparison at all its
# patch sizes then stays within QUICK_COST (and is computed once per model for everybody).
HELD_OUT_IMAGES = 128
T = TypeVar("T")
# What a page says in place of a view that needs class scores, for a model without a classifier.
NO_CLASSIFIER = (
    "{what} needs class scores, and this model has no classification head (num_classes=0):"
    " it outputs a feature vector, not classes."
)


# --- models ------------------------------------------------------------------------------------


def default_weights() -> Path:
    """The shipped shapes model, or the checkpoint that VIT_EXPLORER_DEFAULT_MODEL names."""
    return Path(os.environ.get("VIT_EXPLORER_DEFAULT_MODEL") or train.DEFAULT_WEIGHTS)


@st.cache_resource
def shared_models() -> ByteBoundedCache:
    """Every session's models (each loaded once), bounded in bytes of parameters and buffers."""
    return ByteBoundedCache(MODELS_BYTES)


def base_model(model_key: str) -> ViT:
    """The model behind a key at its own patch size, in eval mode on the app's device."""
    def load() -> ViT:
        kind, _, reference = model_key.partition(":")
        if kind == DEFAULT_MODEL:
            weights = default_weights()
            if not weights.is_file():
                raise FileNotFoundError(
                    f"the default model {weights} is missing; train it with"
                    " `python -m vit_explorer train` or upload a checkpoint"
                )
            model = load_model(weights)
        elif kind == "pretrained":
            model = load_pretrained(reference)
        else:
            model = load_model(reference)
        return model.to(DEVICE).eval()

    return shared_models().get_or_compute(("base", model_key), lambda: _with_spinner("Loading the model ...", load))


def model_at(model_key: str, patch_size: int, image_size: tuple[int, int]) -> ViT:
    """The model resized to ``patch_size`` (FlexiViT PI-resize) and ``image_size`` (position
    embeddings resampled); the base model itself at its own sizes."""
    model = base_model(model_key)
    image_size = tuple(image_size)
    if patch_size == model.config.patch_size and image_size == model.config.img_size:
        return model
    resized = shared_models().get_or_compute(
        ("resized", model_key, patch_size, image_size),
        lambda: _with_spinner(
            "Resizing the model ...",
            lambda: resize_model(model, patch_size=patch_size, image_size=image_size, share_weights=True).eval(),
        ),
        size=lambda resized: _own_bytes(resized, model),
    )
    # The resized model holds the base model's storage, counted with the base: touched last, the
    # base is never the least recently used of the two, so it is not evicted while they live.
    base_model(model_key)
    return resized


def _own_bytes(resized: ViT, base: ViT) -> int:
    """Bytes of the resampled tensors of a resized model: the rest is the base model's storage."""
    base_storage = {tensor.data_ptr() for tensor in base.state_dict().values()}
    return sum(nbytes(tensor) for tensor in resized.state_dict().values() if tensor.data_ptr() not in base_storage)


def token_count(config, patch_size: int, image_size: tuple[int, int] | None = None) -> int:
    """Tokens the model has at ``patch_size`` on an input of ``image_size`` (its own by default)."""
    height, width = image_size or config.img_size
    return config.num_prefix_tokens + (height // patch_size) * (width // patch_size)


def attention_bytes(config, tokens: int | None = None) -> int:
    """Bytes of one image's float32 attention, every layer and head."""
    tokens = config.num_tokens if tokens is None else tokens
    return config.depth * config.num_heads * tokens**2 * 4


def image_size_problem(config, image_size: tuple[int, int]) -> str | None:
    """Why the model (at its own patch size) cannot be explored at ``image_size``; None if it can."""
    height, width = image_size
    patch = config.patch_size
    if height < patch or width < patch or height % patch or width % patch:
        return f"The input size must be a multiple of the patch size ({patch} px) on both sides."
    tokens = token_count(config, patch, image_size)
    if attention_bytes(config, tokens) > MAX_ATTENTION_BYTES:
        return (
            f"At {height}x{width} px this model has {tokens} tokens and its attention would take"
            f" {attention_bytes(config, tokens) / 2**20:.0f} MB, more than the"
            f" {MAX_ATTENTION_BYTES / 2**20:.0f} MB this app allows; choose a smaller size."
        )
    return None


def patch_size_options(config) -> list[int]:
    """Patch sizes that tile the model's input exactly and keep the attention tensor in memory."""
    height, width = config.img_size
    options = []
    for patch in range(2, min(height, width) + 1):
        if height % patch or width % patch:
            continue
        if attention_bytes(config, token_count(config, patch)) <= MAX_ATTENTION_BYTES:
            options.append(patch)
    return sorted(set(options) | {config.patch_size})


def parameter_count(model: ViT) -> int:
    return sum(parameter.numel() for parameter in model.parameters())


def describe(config) -> str:
    """One line that says what a ViT is: input, grid, width, depth, heads and tokens."""
    height, width = config.img_size
    grid_h, grid_w = config.grid_size
    prefix = []
    if config.class_token:
        prefix.append("class token")
    if config.reg_tokens:
        prefix.append(f"{config.reg_tokens} registers")
    return (
        f"{height}x{width} px input, patch {config.patch_size} -> {grid_h}x{grid_w} grid,"
        f" dim {config.embed_dim}, {config.depth} layers x {config.num_heads} heads,"
        f" {' + '.join(prefix) or 'no class token'} ({config.num_tokens} tokens),"
        f" {config.num_classes} classes"
    )


# --- images --------------------------------------------------------------------------------------

SHAPE_SAMPLES = len(SHAPE_CLASSES)
# The picture the app opens on: a sample the shipped model classifies right and surely.
DEFAULT_IMAGE = "shapes:4"  # ring, 99.97% (shapes:0, a circle, is only 61% sure)
IMAGE_PARAM = "image"  # the address parameter that keeps the chosen image across a reload


def photo_names() -> list[str]:
    return sorted(path.name for path in PHOTOS_DIR.iterdir() if path.suffix in (".png", ".jpg"))


@st.cache_data(max_entries=64, show_spinner=False)
def shapes_image(index: int, image_size: tuple[int, int]) -> tuple[Image.Image, str]:
    return shapes_sample(index, image_size)


@st.cache_resource(max_entries=16, show_spinner=False)
def photo(name: str) -> Image.Image:
    return load_image(PHOTOS_DIR / name)


# The sidebar draws the chosen picture 160 px wide: it is sent at most twice that (sharp on
# high-density screens).
SIDEBAR_IMAGE_PX = 320


def sidebar_image(image_key: str, image: Image.Image) -> bytes:
    """``image`` as the sidebar shows it: encoded once per image for everybody. Given the PIL
    image, st.image encodes it again as PNG on every run of every session (0.3-1 s for a
    512 x 512 photo on a busy 2-core server); small pictures (the shapes) stay PNG, photos go as
    JPEG, both shrunk to SIDEBAR_IMAGE_PX."""
    def encode() -> bytes:
        small = image.copy()
        small.thumbnail((SIDEBAR_IMAGE_PX, SIDEBAR_IMAGE_PX))
        buffer = io.BytesIO()
        if small.width * small.height <= 128 * 128:
            small.save(buffer, format="PNG")
        else:
            small.save(buffer, format="JPEG", quality=90)
        return buffer.getvalue()

    return memo((image_key, image.size, "sidebar image"), encode)


def uploaded_image_path(digest: str) -> Path:
    return UPLOADS_DIR / f"image-{digest}"


def uploaded_image(digest: str) -> Image.Image:
    """A decoded upload, shared by every session that uploaded the same bytes."""
    path = uploaded_image_path(digest)
    if not path.is_file():
        raise FileNotFoundError(
            "that uploaded image was removed to make room for newer uploads; upload it again"
        )
    return memo(("uploaded image", digest), lambda: load_image(path))


def sample_image_options(image_size: tuple[int, int]) -> dict[str, str]:
    """Image key -> label for the built-in pictures (shapes are drawn at the model's size): a
    fresh dict of labels made once per size (each run of the sidebar asks; through
    st.cache_data each label cost unpickling its picture)."""
    def options() -> dict[str, str]:
        shapes = {
            f"shapes:{index}": f"Shapes #{index}: {shapes_image(index, image_size)[1]}"
            for index in range(SHAPE_SAMPLES)
        }
        return {**shapes, **{f"photo:{name}": f"Photo: {Path(name).stem}" for name in photo_names()}}

    return dict(memo((tuple(image_size), "sample image options"), options))


def uploaded_image_options() -> dict[str, str]:
    """This session's uploads that are still kept (the uploads folder has a quota), key -> label."""
    uploads = st.session_state["uploaded_images"]
    for image_key in [key for key in uploads if not uploaded_image_path(key.partition(":")[2]).is_file()]:
        del uploads[image_key]
    return dict(uploads)


def resolve_image(image_key: str, image_size: tuple[int, int]) -> tuple[str, Image.Image]:
    """(cache key, RGB image) for an image key; shapes depend on the model's input size."""
    kind, _, reference = image_key.partition(":")
    if kind == "shapes":
        return f"{image_key}@{image_size[0]}x{image_size[1]}", shapes_image(int(reference), image_size)[0]
    if kind == "photo":
        return image_key, photo(reference)
    return image_key, uploaded_image(reference)


# --- captures and everything computed from them ---------------------------------------------


@st.cache_resource
def shared_results() -> ByteBoundedCache:
    """Captures, analyses and figures of every session, bounded in bytes, shared without copies."""
    return ByteBoundedCache(CACHE_BYTES)


def _with_spinner(text: str | None, compute: Callable[[], T]) -> T:
    if text is None:
        return compute()
    with st.spinner(text):
        return compute()


def memo(key: tuple, compute: Callable[[], T], spinner: str | None = None) -> T:
    """``compute()`` once per key for everybody; the value is shared, so it is never mutated.
    Figures in it (alone, a tuple's items or a dict's values) are :class:`SentFigure` s."""
    return shared_results().get_or_compute(
        key, lambda: _sent_figures(_with_spinner(spinner, compute)), size=_memo_bytes
    )


class SentFigure(go.Figure):
    """A memoised figure as ``st.plotly_chart`` sends it, and nothing else: its JSON, made once
    when cached. Streamlit collects every generation after every run of every session, and a
    cached go.Figure (with its to_dict) held a few hundred objects for the collection to walk,
    tens of thousands with a few images in the cache: most of the server's CPU per warm view.
    Serializing it again on every run (``to_dict``, a deep copy, then plotly's JSON) cost more."""

    def __init__(self, figure: go.Figure):  # go.Figure's own __init__ would build it again
        self._sent = _SentDict(figure)

    def to_dict(self) -> dict:
        return self._sent

    def to_plotly_json(self) -> dict:
        return self._sent


class _SentDict(dict):
    """What ``st.plotly_chart`` reads of ``to_dict()``: the layout's size, and the figure's JSON,
    which plotly's serializer takes from ``to_plotly_json`` and orjson writes as it is (orjson
    is a requirement: plotly's other engine would write this dict itself)."""

    def __init__(self, figure: go.Figure):
        size = {name: figure.layout[name] for name in ("width", "height") if figure.layout[name] is not None}
        super().__init__(layout=size)
        # The JSON st.plotly_chart would send: to_dict's, from the figure's own dicts. to_dict deep-
        # copies them first, the largest part of a figure's cost after building it; this figure
        # is dropped once serialized, so its arrays may become typed-array specs in place.
        figure_dict = {"data": figure._data, "layout": figure._layout}
        convert_to_base64(figure_dict)
        self.json = pio.to_json(figure_dict, validate=False).encode()

    def to_plotly_json(self) -> orjson.Fragment:
        return orjson.Fragment(self.json)


def _sent_figures(value: T) -> T:
    if type(value) is dict:
        return {name: _sent_figures(item) for name, item in value.items()}
    if type(value) is tuple:
        return tuple(_sent_figures(item) for item in value)
    if type(value) is go.Figure:
        return SentFigure(value)
    return value


def _memo_bytes(value) -> int:
    """The cache's bytes of a memo value (a figure: its JSON)."""
    if type(value) is dict:
        return sum(_memo_bytes(item) for item in value.values()) + 64 * len(value)
    if type(value) is tuple:
        return sum(_memo_bytes(item) for item in value) + 8 * len(value)
    if isinstance(value, SentFigure):
        return len(value.to_dict().json)
    return nbytes(value)


def forward_cost(config, patch_size: int | None = None) -> float:
    """Multiply-adds of one image's forward pass (patch embedding and blocks), to compare patch
    sizes and models."""
    tokens = token_count(config, patch_size or config.patch_size)
    height, width = config.img_size
    dim = config.embed_dim
    per_token = (4 + 2 * config.mlp_ratio) * dim * dim  # qkv + proj + MLP
    embedding = height * width * config.in_chans * dim  # every pixel into every channel, at any patch size
    return embedding + config.depth * (tokens * per_token + 2 * tokens * tokens * dim)


def is_quick(config, forwards: float = 1.0) -> bool:
    """Whether ``forwards`` forward passes of this model are cheap enough to run unasked."""
    return forwards * forward_cost(config) <= QUICK_COST


# --- every patch size side by side ---------------------------------------------------------------

# Each patch size is timed once per model and input size (a pass's time does not depend on the
# image): a warm-up pass, then the median of TIMED_PASSES passes, or of one where a pass costs more
# than EXPENSIVE_PASS passes at the model's own patch size (three would make that size most of
# the wait, and one warm sample of it is long enough). Later images get one untimed pass per size.
TIMED_PASSES = 3
EXPENSIVE_PASS = 2.0
# What a pass costs beyond its multiply-adds, per block, in multiply-adds: the operators'
# fixed overhead, most of a small model's pass (about 0.1 ms per block on a CPU).
BLOCK_OVERHEAD = 3e6


@dataclass(frozen=True)
class PlannedSize:
    """One patch size's share of the comparison: what ``predictions_by_patch_size`` and
    ``held_out_accuracy_by_patch_size`` run at it, and what ``comparison_cost`` counts."""

    patch_size: int
    timed_passes: int  # after one warm-up pass of the image; 0: one untimed pass (already timed)
    held_out_images: int  # 0: no held-out batch


def comparison_plan(config, held_out: bool = False, timed: bool = True) -> list[PlannedSize]:
    """``timed``: whether the forward times are measured now (nobody has for this model and size)."""
    native = pass_cost(config)
    return [
        PlannedSize(
            patch,
            0 if not timed else 1 if pass_cost(config, patch) > EXPENSIVE_PASS * native else TIMED_PASSES,
            HELD_OUT_IMAGES if held_out else 0,
        )
        for patch in patch_size_options(config)
    ]


def pass_cost(config, patch_size: int | None = None, images: int = 1) -> float:
    """:func:`forward_cost` of a batch of ``images`` plus the operators' fixed overhead."""
    return images * forward_cost(config, patch_size) + config.depth * BLOCK_OVERHEAD


def resize_cost(config, patch_size: int) -> float:
    """Multiply-adds worth of resizing the model to ``patch_size``: the PI-resize operator (a
    pseudo-inverse, about 30 multiply-adds' time per new x old x old element) and its product
    with the kernel in float64 (about 6x a float32 multiply-add), as measured on a CPU."""
    if patch_size == config.patch_size:
        return 0.0
    new, old = patch_size**2, config.patch_size**2
    return 30 * new * old * old + 6 * new * old * config.in_chans * config.embed_dim


def size_cost(config, planned: PlannedSize) -> float:
    """Multiply-adds of one patch size's share of the comparison."""
    patch = planned.patch_size
    cost = resize_cost(config, patch) + (1 + planned.timed_passes) * pass_cost(config, patch)
    if planned.held_out_images:
        cost += pass_cost(config, patch, planned.held_out_images)
    return cost


def patch_size_comparison_cost(config, held_out: bool = False, timed: bool = True) -> float:
    """What trying every patch size costs, in forward passes of the model at its own size, from
    the plan the comparison runs (:func:`comparison_plan`)."""
    plan = comparison_plan(config, held_out, timed)
    return sum(size_cost(config, planned) for planned in plan) / pass_cost(config)


def _median_forward(model: ViT, x: torch.Tensor, passes: int, warm_up: bool = True) -> tuple[torch.Tensor, float]:
    """(class scores or features of the first image, milliseconds): a warm-up pass (allocations,
    first-call work), then the median of ``passes`` timed passes."""
    times = []
    with torch.no_grad():
        output = model(x) if warm_up else None
        for _ in range(passes):
            started = time.perf_counter()
            output = model(x)
            if x.is_cuda:
                torch.cuda.synchronize()  # the pass has run, not only been queued
            times.append(time.perf_counter() - started)
    return output[0].float().cpu(), 1000 * statistics.median(times)


# progress(fraction done, what runs now); it may raise to stop the comparison.
Progress = Callable[[float, str], None]


def _each_size(config, held_out: bool, progress: Progress | None, what: str, timed: bool = True):
    """The comparison plan's sizes, reporting before each the share of the work done so far."""
    plan = comparison_plan(config, held_out, timed)
    costs = [size_cost(config, planned) for planned in plan]
    for index, planned in enumerate(plan):
        if progress is not None:
            tokens = token_count(config, planned.patch_size)
            progress(
                sum(costs[:index]) / sum(costs),
                f"{what} patch {planned.patch_size} ({tokens} tokens), {index + 1} of {len(plan)} ...",
            )
        yield planned
    if progress is not None:
        progress(1.0, "Done.")


def predictions_by_patch_size(
    model: ViT, image: Image.Image, progress: Progress | None = None, forward_ms: dict[int, float] | None = None
) -> list[dict]:
    """Per allowed patch size: grid, tokens, the forward time (a warm-up pass, then the median of
    the plan's timed passes) and, for a model with classes, the image's top-1 prediction.
    ``forward_ms`` (patch size -> milliseconds) are times measured before for this model and input
    size: then each size runs the image once, untimed. Each size runs on the model resized to it
    once (FlexiViT PI-resize), so the time is the transformer's at that size, not the kernel's
    resampling; the shared model is unchanged."""
    config = model.config
    names = config.class_names
    x = preprocess(image, config).to(DEVICE)
    timed = forward_ms is None
    rows = []
    for planned in _each_size(config, False, progress, "Timing" if timed else "Running", timed):
        patch = planned.patch_size
        resized = model if patch == config.patch_size else resize_model(model, patch_size=patch, share_weights=True).eval()
        if timed:
            output, milliseconds = _median_forward(resized, x, planned.timed_passes)
        else:
            with torch.no_grad():
                output, milliseconds = resized(x)[0].float().cpu(), forward_ms[patch]
        del resized  # a large patch's kernel is hundreds of MB: gone before the next size
        grid_h, grid_w = model.grid_size(patch)
        row = {
            "patch size": patch,
            "grid": f"{grid_h}x{grid_w}",
            "tokens": config.num_prefix_tokens + grid_h * grid_w,
            "forward ms": milliseconds,
        }
        if config.num_classes:
            probabilities = output.softmax(dim=-1)
            best = int(probabilities.argmax())
            row["prediction"] = names[best] if names else f"class {best}"
            row["probability"] = float(probabilities[best])
        rows.append(row)
    return rows


def has_held_out(config) -> bool:
    """Whether the Patches page can test the model on a held-out batch of its dataset: only the
    built-in shapes, which render offline in a blink (another dataset may need a download)."""
    return config.class_names == SHAPE_CLASSES


def held_out_set(config) -> ImageDataset:
    """A batch of the shapes test stream at the model's input size."""
    # Past the sample pictures of the sidebar, which come from the start of the same test stream.
    return shapes_dataset(HELD_OUT_IMAGES, config.img_size, SHAPES_TEST_SEED, "test", start=SHAPE_SAMPLES)


def held_out_accuracy_by_patch_size(
    model: ViT, dataset: ImageDataset, progress: Progress | None = None
) -> dict[int, float]:
    """Patch size -> accuracy of the model on ``dataset`` at that size (one batch per size)."""
    config = model.config
    mean = torch.tensor(config.mean, device=DEVICE).view(1, -1, 1, 1)
    std = torch.tensor(config.std, device=DEVICE).view(1, -1, 1, 1)
    images = (dataset.images.to(DEVICE).float() / 255 - mean) / std
    labels = dataset.labels.to(DEVICE)
    accuracy = {}
    for planned in _each_size(config, True, progress, f"Testing on {len(dataset)} held-out images:"):
        with torch.no_grad():
            predicted = model(images, patch_size=planned.patch_size).argmax(dim=-1)
        accuracy[planned.patch_size] = float((predicted == labels).float().mean())
    return accuracy


def duration(seconds: float) -> str:
    """A wait in words: "12 s", "3 min"."""
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"


# Held-out accuracy this close to the best counts as holding up (128 images: a point is about one image).
HELD_OUT_MARGIN = 0.05


def patch_size_summary(rows: Sequence[dict], trained: int) -> str:
    """What the comparison table shows, in a sentence or two derived from its rows."""
    most = max(rows, key=lambda row: row["tokens"])
    fewest = min(rows, key=lambda row: row["tokens"])
    ratio = most["forward ms"] / fewest["forward ms"]
    sentences = [
        f"A pass at patch {most['patch size']} ({most['tokens']} tokens) took {ratio:.1f}x as long as"
        f" at patch {fewest['patch size']} ({fewest['tokens']} tokens)."
        if ratio >= 1.5 else
        f"A pass at patch {most['patch size']} ({most['tokens']} tokens) took about as long as at"
        f" patch {fewest['patch size']} ({fewest['tokens']} tokens): for this model the time went to"
        " fixed costs (or to other work on this server), not to the tokens."
    ]
    held_out = {row["patch size"]: row["held-out accuracy"] for row in rows if row.get("held-out accuracy") is not None}
    if held_out:
        best = max(held_out, key=held_out.get)
        close = [patch for patch, accuracy in held_out.items() if patch != best and accuracy >= held_out[best] - HELD_OUT_MARGIN]
        far = [patch for patch in held_out if patch != best and patch not in close]
        sentence = f"On the held-out images it does best at patch {best} ({held_out[best]:.0%}; trained at {trained})"
        if close:
            sentence += f", {_sizes(close)} stay within {HELD_OUT_MARGIN * 100:.0f} points of that"
        if far:
            sentence += f", and at {_sizes(far)} it falls to {_percentages(held_out[patch] for patch in sorted(far))}"
        sentences.append(sentence + ".")
    elif "prediction" in rows[0]:
        own = next((row["prediction"] for row in rows if row["patch size"] == trained), None)
        same = [row["patch size"] for row in rows if row["prediction"] == own and row["patch size"] != trained]
        if own is not None:
            sentences.append(
                f"On this image it predicts {own} at its trained patch size {trained}"
                + (f", and so it does at {_sizes(same)}." if same else ", and something else at every other size.")
            )
    return " ".join(sentences)


def _sizes(patches: Sequence[int]) -> str:
    patches = sorted(patches)
    if len(patches) == 1:
        return f"patch {patches[0]}"
    return f"patches {', '.join(map(str, patches[:-1]))} and {patches[-1]}"


def _percentages(values) -> str:
    values = [f"{value:.0%}" for value in values]
    return values[0] if len(values) == 1 else f"{', '.join(values[:-1])} and {values[-1]}"


@dataclass(frozen=True)
class Selection:
    """What every page looks at: the chosen model at the chosen patch size and the chosen image."""

    model_key: str
    patch_size: int
    image_key: str  # includes the render size for shapes
    model: ViT
    image: Image.Image  # the picture as given, before resizing

    @property
    def config(self):
        return self.model.config

    @property
    def base_model(self) -> ViT:
        """The model at its own patch size (and at the chosen input size)."""
        return model_at(self.model_key, base_model(self.model_key).config.patch_size, self.config.img_size)

    @property
    def key(self) -> tuple[str, int, tuple[int, int], str]:
        return (self.model_key, self.patch_size, self.config.img_size, self.image_key)

    def memo(self, *key, compute: Callable[[], T], spinner: str | None = None) -> T:
        """``compute()`` once per (this model, patch size and image, ``key``) for everybody."""
        return memo((*self.key, *key), compute, spinner)

    def capture(self) -> Capture:
        """The forward pass dissected, attention in float16: the views only draw it, and half the
        bytes are half the memory every cached capture holds and half of what a pass writes."""
        return self.memo(
            "capture", compute=lambda: capture(self.model, self.model_input(), attention_dtype=torch.float16),
            spinner="Running the model ...",
        )

    def cached_capture(self) -> Capture | None:
        """:meth:`capture` if a page has made it already (for anybody), else None: nothing runs."""
        return shared_results().get((*self.key, "capture"))

    def attribution(self, target: int) -> np.ndarray:
        """(gh, gw) relevance of each patch for class ``target``; one backward pass per class."""
        return self.memo(
            "attribution", target,
            compute=lambda: attribution(self.model, self.model_input(), target)[0].cpu().numpy(),
            spinner="Tracing the class back to the patches ...",
        )

    def comparison_cost(self) -> float:
        """What ``predictions_by_patch_size`` would compute now, in forward passes (the forward
        times and the held-out accuracy are per model, so they count only until somebody has
        computed them)."""
        config = self.base_model.config
        held_out = has_held_out(config) and self._held_out_key not in shared_results()
        return patch_size_comparison_cost(config, held_out=held_out, timed=self._forward_ms_key not in shared_results())

    def forward_seconds(self) -> float:
        """Seconds of one forward pass of this image at the model's own patch size: the median of
        TIMED_PASSES (one sample on a busy server can be several times off), timed once per model
        and input size for everybody (the page's capture has just warmed the model up)."""
        model = self.base_model
        key = (self.model_key, self.config.img_size, "forward seconds")
        return memo(key, lambda: _median_forward(model, self.model_input().to(DEVICE), TIMED_PASSES, warm_up=False)[1] / 1000)

    @property
    def _held_out_key(self) -> tuple:
        return (self.model_key, "held-out accuracy by patch size")

    @property
    def _forward_ms_key(self) -> tuple:
        return (self.model_key, self.config.img_size, "forward ms by patch size")

    def predictions_by_patch_size(self, run: bool = True) -> list[dict] | None:
        """Per allowed patch size: tokens, forward time and (with classes) the top-1 prediction of
        this image, and the accuracy on a held-out batch ("held-out accuracy") where the model's
        dataset has one. Runs under a progress bar; a stopped run leaves nothing cached.

        With ``run=False`` only what somebody already computed for this model and image, or None.
        """
        key = (self.model_key, self.config.img_size, self.image_key, "predictions by patch size")
        if not run and key not in shared_results():
            return None
        model = self.base_model
        config = model.config
        held_out = has_held_out(config)
        forward_ms = shared_results().get(self._forward_ms_key)  # None: nobody has timed them yet
        # One bar over both parts, each advancing by its share of the plan's cost.
        image_share = patch_size_comparison_cost(config, timed=forward_ms is None) / max(self.comparison_cost(), 1e-9)
        slot = st.empty()

        def report(start: float, share: float) -> Progress:
            return lambda done, text: slot.progress(min(start + share * done, 1.0), text=text)

        rows = memo(key, lambda: predictions_by_patch_size(model, self.image, report(0.0, image_share), forward_ms))
        if forward_ms is None:  # these rows timed every size: the times of later images
            memo(self._forward_ms_key, lambda: {row["patch size"]: row["forward ms"] for row in rows})
        if held_out:
            accuracy = memo(self._held_out_key, lambda: held_out_accuracy_by_patch_size(
                model, held_out_set(config), report(image_share, 1 - image_share)
            ))
            rows = [{**row, "held-out accuracy": accuracy[row["patch size"]]} for row in rows]
        slot.empty()
        return rows

    def model_input(self) -> torch.Tensor:
        return preprocess(self.image, self.config)  # (1, C, H, W)

    def display_image(self) -> np.ndarray:
        """(H, W, 3) uint8: the picture exactly as the model sees it (resized, 8-bit)."""
        return self.memo("display image", compute=lambda: display_image(self.model_input(), self.config))

    def class_names(self) -> list[str]:
        names = self.config.class_names
        return list(names) if names else [f"class {i}" for i in range(self.config.num_classes)]

    def internals(self, layer: int, token: int) -> LayerInternals:
        """Every step of encoder layer ``layer`` for query ``token`` of this image
        (vit_explorer.internals), from the captured tokens entering the layer: this layer's q, k, v
        projection and the rest of the block for that one token, so that another layer or query
        costs a fifth of a block (at patch 8 the whole block was most of a view) and another head
        nothing."""
        return self.memo(
            "internals", layer, token,
            compute=lambda: layer_internals(self.model, self.capture().tokens[:, layer], layer, queries=[token]),
            spinner=f"Opening layer {layer} ...",
        )

    def knock_out_capture(self, knock_out: KnockOut) -> Capture:
        """:meth:`capture` of the pass with ``knock_out``'s heads and branches removed (that call
        only: the shared model is untouched); nothing knocked out is the intact capture. The
        layers before the first one knocked out are the intact capture's, not run again."""
        intact = self.capture()
        if knock_out.is_empty:
            return intact
        return self.memo(
            "knock-out capture", knock_out, spinner="Running the model without them ...",
            compute=lambda: capture(
                self.model, self.model_input(), attention_dtype=torch.float16, knock_out=knock_out,
                intact=intact,
            ),
        )

    def head_sweep(self, mode: str, run: bool = True) -> HeadSweep | None:
        """Every head knocked out alone on this image (vit_explorer.ablation.head_sweep), with a
        progress bar while it runs, once for everybody. With ``run=False`` only what somebody
        already computed, or None."""
        key = (*self.key, "head sweep", mode)
        if not run and key not in shared_results():
            return None

        def compute() -> HeadSweep:
            bar = st.progress(0.0, text="Knocking out each head alone ...")
            result = head_sweep(self.model, self.model_input(), mode, progress=lambda share: bar.progress(
                share, text=f"Knocking out each head alone: {share:.0%}"
            ))
            bar.empty()
            return result

        return memo(key, compute)


@dataclass(frozen=True)
class ImageSet:
    """Several images read together by the selected model (the Several images page): each image's
    tokens memoised for everybody by model, sizes and image key, so that a set with one more image
    runs that one alone; what the page reads of them is memoised by the set's image keys."""

    selection: Selection  # the model at its patch size and input size, and the sidebar's image
    image_keys: tuple[str, ...]  # cache keys (shapes include their render size)
    images: tuple[Image.Image, ...]  # as given, before resizing

    @property
    def key(self) -> tuple:
        selection = self.selection
        return (selection.model_key, selection.patch_size, selection.config.img_size, "image set", self.image_keys)

    def memo(self, *key, compute: Callable[[], T], spinner: str | None = None) -> T:
        return memo((*self.key, *key), compute, spinner)

    def model_input(self) -> torch.Tensor:
        """(B, C, H, W): every image resized to the model's input size, whatever its own size;
        once per set (the pass and the pictures shown both read it)."""
        return self.memo("model input", compute=lambda: torch.cat([
            preprocess(image, self.selection.config) for image in self.images
        ]))

    def image_tokens(self) -> list[torch.Tensor]:
        """(depth + 1, N, D) per image: the tokens entering the first block, then leaving each
        (the page reads tokens only). The sidebar's image is read from its capture, which every
        page shares (made now if no page has yet), and so is any image that a page has captured
        already; the others go through the model together in one batch, and each one's tokens are
        kept by themselves, so that a set with one more image runs that one alone."""
        selection = self.selection
        found = [
            None if captured is None else captured.tokens[0]
            for captured in (
                selection.capture() if image_key == selection.image_key
                else replace(selection, image_key=image_key, image=image).cached_capture()
                for image_key, image in zip(self.image_keys, self.images)
            )
        ]
        missing = [index for index, tokens in enumerate(found) if tokens is None]
        ran: dict[int, torch.Tensor] = {}

        def run(indices: list[int]) -> torch.Tensor:
            """One pass of the images ``indices``; the first one's tokens (the others' are kept
            before this returns, so that a session waiting for the first one finds them too)."""
            x = self.model_input()[indices]
            batch = capture(selection.model, x, layers=[-1], attention_dtype=torch.float16).tokens
            ran.update({index: tokens.clone() for index, tokens in zip(indices, batch)})  # own storage each
            for index in indices[1:]:
                memo(self._tokens_key(index), lambda index=index: ran[index])
            return ran[indices[0]]

        spinner = f"Running the model on {len(missing)} image{'s' if len(missing) > 1 else ''} ..."
        for index in missing:  # the first one missing runs every one still missing
            found[index] = memo(self._tokens_key(index), lambda index=index: ran[index] if index in ran else run([
                index, *(later for later in missing if later > index and self._tokens_key(later) not in shared_results())
            ]), spinner=spinner)
        return found

    def _tokens_key(self, index: int) -> tuple:
        selection = self.selection
        return (selection.model_key, selection.patch_size, selection.config.img_size, "set image tokens", self.image_keys[index])

    def tokens(self, index: int) -> torch.Tensor:
        """(B, N, D) every image's tokens at ``index`` of :meth:`image_tokens` (0: entering the
        first block, -1: leaving the last)."""
        return self.memo("tokens", index, compute=lambda: torch.stack([tokens[index] for tokens in self.image_tokens()]))

    def keys(self, layer: int) -> torch.Tensor:
        """(B, P, nh * hd) the patches' keys in ``layer``: that layer's norm and qkv projection
        run again on the batch's captured tokens (a quarter of one block)."""
        return self.memo(
            "keys", layer, compute=lambda: layer_keys(self.selection.model, self.tokens(layer), layer),
            spinner=f"Computing the keys of layer {layer} ...",
        )

    def first_component(self) -> tuple[torch.Tensor, float]:
        """The joint first principal component of the last layer's patch features (image_set.
        first_component): once per image set, whatever the threshold."""
        return self.memo("first component", compute=lambda: first_component(self.last_layer_features()))

    def last_layer_features(self) -> torch.Tensor:
        """(B, P, D) the last layer's patch tokens after the final norm (DINOv2's figure's features)."""
        return self.memo("last layer features", compute=lambda: last_layer_features(self.selection.model, self.tokens(-1)))

    def display_images(self) -> list[np.ndarray]:
        """(H, W, 3) uint8 per image: each picture as the model sees it."""
        return self.memo("display images", compute=lambda: [
            display_image(x, self.selection.config) for x in self.model_input()
        ])


def image_set(selection: Selection, image_keys: Sequence[str]) -> ImageSet:
    """The images behind ``image_keys`` for the selected model; ValueError with the sentence to
    show for too few or too many, or for an image that can no longer be read."""
    if not MIN_IMAGES <= len(image_keys) <= MAX_IMAGES:
        raise ValueError(
            f"Pick between {MIN_IMAGES} and {MAX_IMAGES} images"
            f" ({len(image_keys)} chosen)."
        )
    resolved = []
    for image_key in image_keys:
        try:
            resolved.append(resolve_image(image_key, selection.config.img_size))
        except (ValueError, OSError) as error:
            raise ValueError(f"One of the images cannot be read: {error}.") from error
    return ImageSet(selection, tuple(key for key, _ in resolved), tuple(image for _, image in resolved))


# --- session state ------------------------------------------------------------------------------


def init_state() -> None:
    state = st.session_state
    state.setdefault("model_key", DEFAULT_MODEL)
    state.setdefault("uploaded_models", {})  # model key -> label
    state.setdefault("uploaded_images", {})  # image key -> label (the bytes are in UPLOADS_DIR)
    if "image_key" not in state:  # a new session, or a reload: the address says which image
        state["image_key"] = _image_in_address()
    if "owner_token" not in state and st.query_params.get(OWNER_PARAM):
        state["owner_token"] = st.query_params[OWNER_PARAM]
    forget_removed_uploads()


def keep_in_address() -> None:
    """Write the owner token and the chosen image into the page's address on every run: a reload
    then keeps them, and Streamlit's page navigation, which drops the address's parameters, does
    not take a person's runs from them. A person who never trained has no token to keep, and the
    default image needs no parameter."""
    state = st.session_state
    image_key = state["image_key"] if state["image_key"] != DEFAULT_IMAGE else None
    for param, value in ((OWNER_PARAM, state.get("owner_token")), (IMAGE_PARAM, image_key)):
        if value is None:
            st.query_params.pop(param, None)
        elif st.query_params.get(param) != value:
            st.query_params[param] = value


def _image_in_address() -> str:
    """The image key in the address if it names a picture this server still has, else the default."""
    image_key = st.query_params.get(IMAGE_PARAM, "")
    kind, _, reference = image_key.partition(":")
    if kind == "shapes" and reference.isdigit() and int(reference) < SHAPE_SAMPLES:
        return image_key
    if kind == "photo" and reference in photo_names():
        return image_key
    if kind == "upload" and reference.isalnum() and uploaded_image_path(reference).is_file():
        st.session_state["uploaded_images"][image_key] = "Uploaded image"
        return image_key
    return DEFAULT_IMAGE


def selection() -> Selection:
    state = st.session_state
    kind, _, digest = state["image_key"].partition(":")
    if kind == "upload" and not uploaded_image_path(digest).is_file():
        # Cleaned up for newer uploads (the folder has a quota): back to a built-in picture.
        state["image_key"] = DEFAULT_IMAGE
        state["image_notice"] = "Your uploaded image was removed to make room for newer uploads; upload it again."
    size = image_size()
    patch = patch_size(size)
    model = model_at(state["model_key"], patch, size)
    image_key, image = resolve_image(state["image_key"], model.config.img_size)
    return Selection(state["model_key"], patch, image_key, model, image)


def image_size() -> tuple[int, int]:
    """The input size chosen in the sidebar, if valid for the current model, else its own."""
    config = base_model(st.session_state["model_key"]).config
    # A side never edited has no kept value: it stays the model's own.
    chosen = tuple(
        st.session_state.get(kept_key(key), native)
        for key, native in zip(("input_height", "input_width"), config.img_size)
    )
    return config.img_size if image_size_problem(config, chosen) else chosen


def patch_size(image_size: tuple[int, int]) -> int:
    """The patch size chosen on the Patches page, if valid for the model at ``image_size``, else its own."""
    config = base_model(st.session_state["model_key"]).config.replace(image_size=image_size)
    kept = st.session_state.get(kept_key("patch_size"))
    return kept if kept in patch_size_options(config) else config.patch_size


def kept_key(widget_key: str) -> str:
    return f"kept:{widget_key}"


def keep(widget_key: str, default: Any, valid: Callable[[Any], bool] = lambda value: True) -> dict:
    """Widget arguments that keep a page widget's value when the person visits another page.

    Streamlit forgets a widget's state once a run does not draw it; the value is copied to a
    key of our own on every change and restored from there (if still valid) when drawn again.
    Restored on every run: widgets of two pages may share a key (layer, head and query on the
    Attention and Inside pages) but not an id, and a widget drawn for the first time starts from
    a value set here, never from one the other page's widget left behind.
    """
    state = st.session_state
    candidates = [state[key] for key in (kept_key(widget_key), widget_key) if key in state]
    state[widget_key] = next((value for value in candidates if valid(value)), default)
    return dict(key=widget_key, on_change=_copy_to_kept, args=(widget_key,))


def _copy_to_kept(widget_key: str) -> None:
    st.session_state[kept_key(widget_key)] = st.session_state[widget_key]


def patch_picked(chart_key: str, kept_widget: str) -> Callable[[], None]:
    """The ``on_select`` callback of a patch picker (figures.patch_picker) drawn with
    ``key=chart_key``: the clicked patch becomes the kept value of the page widget ``kept_widget``."""
    def pick() -> None:
        points = st.session_state[chart_key].selection.points
        if points:
            set_kept(kept_widget, int(points[0]["point_index"]))

    return pick


def set_kept(widget_key: str, value: Any) -> None:
    """Change a kept widget's value from a callback (before the widget is drawn)."""
    st.session_state[widget_key] = value
    st.session_state[kept_key(widget_key)] = value


# Model labels longer than this are cut in the sidebar's picker (and in its open list): a name is
# shortened in the middle (its start and end tell checkpoints apart), the whole label shown below.
MAX_LABEL = 34


def model_options(whole: bool = False) -> dict[str, str]:
    """Model key -> label: the shipped model, the catalogue (downloaded or not), finished runs
    and uploads; names cut to fit the picker unless ``whole``."""
    weights = default_weights().resolve()
    shipped = weights == train.DEFAULT_WEIGHTS.resolve()
    # A server started with VIT_EXPLORER_DEFAULT_MODEL says which checkpoint it opens with.
    options = {DEFAULT_MODEL: "Shipped shapes ViT (offline)" if shipped else f"Default: {weights.stem}"}
    for name, entry in catalogue.CATALOGUE.items():
        # The state first: a long title may be cut, what selecting it costs never is.
        where = "Downloaded" if catalogue.is_downloaded(name) else f"{entry.size_bytes / 1e6:.0f} MB download"
        options[f"pretrained:{name}"] = f"{where}: {entry.title}"
    for run_id, run in training_runs().items():
        if run.checkpoint is not None:
            options[f"file:{run.checkpoint}"] = f"Trained here: {run_id}"
    options.update(st.session_state["uploaded_models"])
    return options if whole else {key: _fit(label) for key, label in options.items()}


def model_title(model_key: str) -> str:
    """A catalogue model's title ("DINO ViT-S/16")."""
    return catalogue.entry(model_key.removeprefix("pretrained:")).title


def _fit(label: str) -> str:
    """A "Kind: name" label within MAX_LABEL characters, the name cut in the middle if need be."""
    if len(label) <= MAX_LABEL:
        return label
    kind, _, name = label.rpartition(": ")
    if name.endswith(")") and " (" in name:  # "ImageNet ViT-B/16 (torchvision)": the aside goes first
        return _fit(f"{kind}: {name.rpartition(' (')[0]}" if kind else name.rpartition(" (")[0])
    room = MAX_LABEL - len(kind) - 2 if kind else MAX_LABEL
    head = (room - 1) // 2
    shortened = f"{name[:head]}…{name[len(name) - (room - 1 - head):]}"
    return f"{kind}: {shortened}" if kind else shortened


def request_model(model_key: str) -> None:
    """Ask for a model; the app loads it at the start of the next run (see apply_requested_model)."""
    st.session_state["requested_model"] = model_key


def apply_requested_model() -> str | None:
    """Load the requested model and select it; on failure keep the current one and say why."""
    requested = st.session_state.pop("requested_model", None)
    if requested is None or requested == st.session_state["model_key"]:
        return None
    error = select_model(requested)
    st.session_state["model_picker"] = st.session_state["model_key"]
    return error


def model_cards() -> str:
    """The catalogue's model cards as a Markdown list: what each was trained on, how it attends."""
    return "\n".join(f"- **{entry.title}**: {entry.card.removeprefix(entry.title + ': ')}" for entry in catalogue.CATALOGUE.values())


def model_card(model_key: str) -> str | None:
    kind, _, name = model_key.partition(":")
    return catalogue.CATALOGUE[name].card if kind == "pretrained" and name in catalogue.CATALOGUE else None


def download_with_progress(name: str) -> None:
    """Download a catalogue entry (if not cached yet) under a progress bar."""
    if catalogue.is_downloaded(name):
        return
    entry = catalogue.entry(name)
    label = f"Downloading {entry.title} ({entry.size_bytes / 1e6:.0f} MB) from {catalogue.url(name)}"
    bar = st.progress(0.0, text=label)

    def report(done: int, total: int | None) -> None:
        bar.progress(min(done / (total or entry.size_bytes), 1.0), text=label)

    try:
        catalogue.download(name, report)
    finally:
        bar.empty()


# Whether the catalogue's hosts answer: checked at most once a minute per host, each check
# within a second and a half (name lookup included), so that no page waits on a dead network.
REACHABLE_SECONDS = 60
REACHABLE_TIMEOUT = 1.5
# Said in place of the catalogue's models where none can be had.
CATALOGUE_OFFLINE = (
    "The pretrained models are not available offline: none is downloaded and this server cannot"
    f" reach their publishers (a local mirror can be set with {catalogue.HUB_URL_VARIABLE} or"
    f" {catalogue.TORCHVISION_URL_VARIABLE})."
)


def obtainable(model_key: str) -> bool:
    """Whether a catalogue model can be had now: downloaded, or its download host answers."""
    name = model_key.removeprefix("pretrained:")
    if catalogue.is_downloaded(name):
        return True
    address = urllib.parse.urlsplit(catalogue.url(name))
    return host_reachable(address.hostname, address.port or (443 if address.scheme == "https" else 80))


@st.cache_data(ttl=REACHABLE_SECONDS, max_entries=16, show_spinner=False)
def host_reachable(host: str, port: int) -> bool:
    """Whether a TCP connection to ``host:port`` opens within REACHABLE_TIMEOUT seconds."""
    opened = threading.Event()

    def connect() -> None:
        try:
            with socket.create_connection((host, port), timeout=REACHABLE_TIMEOUT):
                opened.set()
        except OSError:
            pass

    # In a thread of its own: a name lookup without a network can hang far longer than the timeout.
    threading.Thread(target=connect, daemon=True).start()
    return opened.wait(REACHABLE_TIMEOUT)


def unreadable_photo_reason(selection: Selection) -> str | None:
    """One sentence on why the model cannot make sense of the chosen photo, or None if it can."""
    if selection.image_key.startswith("shapes:"):
        return None
    config = selection.config
    height, width = config.img_size
    if config.class_names == SHAPE_CLASSES:
        if selection.image.size == (width, height):
            return None  # a shapes picture saved at the model's size and uploaded again, most likely
        return (
            f"This model was trained on synthetic shapes at {height}x{width} pixels, so a photo"
            " means nothing to it."
        )
    given = min(selection.image.size)
    if min(height, width) < 64 and given >= 4 * min(height, width):
        return (
            f"This model reads {height}x{width} pixels, far fewer than the {selection.image.size[0]}"
            f"x{selection.image.size[1]} photo, so it sees a blur."
        )
    return None


def select_model(model_key: str) -> str | None:
    """Load ``model_key`` and make it the current model; None on success, else the reason."""
    kind, _, name = model_key.partition(":")
    try:
        if kind == "pretrained" and name in catalogue.CATALOGUE:
            download_with_progress(name)
        base_model(model_key)
    except (ValueError, OSError) as error:
        return f"Could not load that model: {error}"
    state = st.session_state
    state["model_key"] = model_key
    # Layer, head, query and patch size belong to the previous model: forget the kept values
    # and the widgets' own state, so that the widgets start from the new model's defaults.
    for key in [str(key) for key in state if str(key).startswith("kept:")]:
        del state[key]
        state.pop(key.removeprefix("kept:"), None)
    return None


def _upload_digest(files: Sequence) -> str:
    digest = hashlib.sha256()
    for file in sorted(files, key=lambda file: file.name):
        digest.update(file.name.encode())
        digest.update(file.getvalue())
    return digest.hexdigest()[:16]


class UnsafeUploadsFolder(OSError):
    """The uploads folder is not this server's own; the message says why in one sentence."""


def uploads_folder() -> Path:
    """UPLOADS_DIR, created private (0700) when missing.

    Refused when it is a link (trimming it deleted what the link pointed to), another user's, or
    writable by others (who could swap an upload for a link to someone's files).
    """
    UPLOADS_DIR.parent.mkdir(parents=True, exist_ok=True)
    try:
        UPLOADS_DIR.mkdir(mode=0o700)
    except FileExistsError:
        pass
    info = UPLOADS_DIR.lstat()
    if stat.S_ISLNK(info.st_mode):
        problem = "is a symbolic link"
    elif not stat.S_ISDIR(info.st_mode):
        problem = "is not a folder"
    elif info.st_uid != os.getuid():
        problem = "belongs to another user"
    elif info.st_mode & 0o022:
        problem = "is writable by other users"
    else:
        return UPLOADS_DIR
    raise UnsafeUploadsFolder(
        f"Uploads are off: the uploads folder {UPLOADS_DIR} {problem}; set VIT_EXPLORER_UPLOADS_DIR"
        " to a private folder of the user running this server."
    )


def upload_key(widget_key: str) -> str:
    """The uploader's key now: a new one after each upload it handed over, so it starts empty."""
    handled = st.session_state.get(f"uploads handled:{widget_key}", 0)
    return widget_key if handled == 0 else f"{widget_key}#{handled}"


def release_upload(widget_key: str, files: Sequence) -> None:
    """Free a handled upload's bytes, kept or refused, and rerun with an empty uploader.

    Streamlit keeps uploaded files in memory (its MemoryUploadedFileManager) until the session
    shuts down, and a session whose browser left expires without shutting down: three refused
    900 MB images kept 6 GB for good. What an upload keeps is on disk by now. The uploader's old
    key, and the files its value still holds, are dropped at the end of the rerun.
    """
    ctx = get_script_run_ctx()
    if ctx is not None and isinstance(ctx.uploaded_file_mgr, MemoryUploadedFileManager):
        for file in files:
            ctx.uploaded_file_mgr.remove_file(session_id=ctx.session_id, file_id=file.file_id)
    handled = f"uploads handled:{widget_key}"
    st.session_state[handled] = st.session_state.get(handled, 0) + 1
    st.rerun()


def add_checkpoint_upload(files: Sequence) -> str | None:
    """Store an uploaded checkpoint (one file, or a Hugging Face folder's files), check that it
    loads, and select it.

    Returns None on success, else one sentence saying why the model stays as it was; a refused
    upload leaves nothing on disk.
    """
    names = [file.name for file in files]
    if "config.json" not in names and len(files) > 1:
        return (
            "Upload one checkpoint file, or a Hugging Face model's config.json together with"
            " its weights."
        )
    plain = all(name not in ("", ".", "..") and Path(name).name == name for name in names)
    if not plain or len(set(names)) < len(names):
        return "Upload files with plain, distinct names."  # a name with a path could write elsewhere
    digest = _upload_digest(files)
    # A Hugging Face ViT is its folder: config.json beside its weights.
    target = UPLOADS_DIR / digest if "config.json" in names else UPLOADS_DIR / digest / names[0]
    model_key = f"file:{target}"
    error = _store_upload(
        digest, {file.name: file.getvalue() for file in files},
        check=lambda: _loading_problem(model_key, names),
    )
    if error:
        return error
    error = select_model(model_key)
    if error is None:
        st.session_state["uploaded_models"][model_key] = f"Uploaded: {', '.join(names)}"
    return error


def _loading_problem(model_key: str, names: Sequence[str]) -> str | None:
    """Why an uploaded checkpoint does not load (loaded, it stays in the shared models); or None."""
    try:
        base_model(model_key)
    except (ValueError, OSError) as error:
        return f"Could not load that model: {error}."
    except Exception:  # a hostile file may break a loader anywhere: the page must not break with it
        return f"Could not load {', '.join(names)}: it is not a checkpoint this app can read."
    return None


def add_image_upload(file) -> str | None:
    """Decode an uploaded image and select it; None on success, else the one-line reason."""
    # Before anything reads or decodes it: a browser refuses larger files, other clients may not.
    if file.size > IMAGE_UPLOAD_MB * 2**20:
        return (
            f"{file.name} is {file.size / 2**20:.1f} MB, more than the {IMAGE_UPLOAD_MB} MB this app"
            " takes for an image."
        )
    data = file.getvalue()
    try:
        load_image(data)  # decoded once here, so that a bad file is refused before it is kept
    except ValueError as error:
        return f"Could not use {file.name}: {error}."
    digest = hashlib.sha256(data).hexdigest()[:16]
    error = _store_upload(uploaded_image_path(digest).name, data)
    if error:
        return error
    image_key = f"upload:{digest}"
    st.session_state["uploaded_images"][image_key] = f"Uploaded: {file.name}"
    st.session_state["image_key"] = image_key
    return None


def _store_upload(
    name: str, content: bytes | dict[str, bytes], check: Callable[[], str | None] = lambda: None
) -> str | None:
    """Keep an upload in UPLOADS_DIR as ``name`` (a file's bytes, or a folder's files by name),
    ``check()`` it there, then trim the folder to its quota, oldest uploads first. None on
    success, else the one-line reason, and then nothing of the upload is left on disk.

    Written into a private staging folder first and moved into place whole, so that nobody reads
    a half-written upload; nothing is trimmed for an upload that is then refused.
    """
    size = len(content) if isinstance(content, bytes) else sum(map(len, content.values()))
    if size > UPLOADS_QUOTA_BYTES:
        return (
            f"That upload is {size / 2**20:.0f} MB, more than this server keeps for all uploads"
            f" together ({UPLOADS_QUOTA_BYTES / 2**20:.0f} MB, VIT_EXPLORER_UPLOADS_MB)."
        )
    try:
        with _UPLOADS_LOCK:
            folder = uploads_folder()
            staging = Path(tempfile.mkdtemp(dir=folder, prefix=".incoming-"))
            _INCOMING.append(staging)
    except UnsafeUploadsFolder as refusal:
        return str(refusal)
    except OSError as failure:
        return f"Could not keep that upload: {failure.strerror or failure}."
    target = folder / name
    created = checking = False
    error: str | None = "Could not keep that upload."  # until it is in place and checked
    try:
        staged = staging / name
        if isinstance(content, bytes):
            staged.write_bytes(content)
        else:
            staged.mkdir()
            for file_name, data in content.items():
                (staged / file_name).write_bytes(data)
        with _UPLOADS_LOCK:
            created = not os.path.lexists(target)  # else the same bytes are there already
            if created:
                staged.rename(target)
            _INCOMING.append(target)
            checking = True
        error = check()
    except OSError as failure:
        error = f"Could not keep that upload: {failure.strerror or failure}."
    finally:
        with _UPLOADS_LOCK:
            shutil.rmtree(staging, ignore_errors=True)
            _INCOMING.remove(staging)
            if checking:
                _INCOMING.remove(target)
            if error is None:
                os.utime(target, follow_symlinks=False)  # a repeated upload counts as new
                trim_to_quota(folder, UPLOADS_QUOTA_BYTES, keep={target, *_INCOMING})
            elif created and isinstance(content, bytes):
                target.unlink(missing_ok=True)
            elif created:
                shutil.rmtree(target, ignore_errors=True)
    return error


def forget_removed_uploads() -> None:
    """Take this session's uploaded checkpoints that the quota removed out of its picker, and
    leave a removed current model for the default one, saying so."""
    state = st.session_state
    uploads = state["uploaded_models"]
    for model_key in [key for key in uploads if not Path(key.partition(":")[2]).exists()]:
        del uploads[model_key]
        if state["model_key"] == model_key:
            if select_model(DEFAULT_MODEL) is not None:
                state["model_key"] = DEFAULT_MODEL  # the page then says why the default does not load
            state["model_notice"] = (
                "Your uploaded checkpoint was removed to make room for newer uploads; upload it again."
            )


# --- training runs ---------------------------------------------------------------------------

OWNER_PARAM = "owner"


@st.cache_resource
def run_manager() -> runs.RunManager:
    """The server's runs: each trains in its own process; ended ones are found in RUNS_DIR again."""
    return runs.RunManager(RUNS_DIR)


def training_runs() -> dict[str, train.TrainingRun]:
    """Every run of this server by id, launched, waiting or found in the runs folder."""
    return run_manager().runs()


def owner_token() -> str:
    """This person's token, created when they first launch a run: kept in the session and in the
    page's address (keep_in_address), so that neither moving between pages nor a reload takes
    their runs from them."""
    state = st.session_state
    if "owner_token" not in state:
        state["owner_token"] = secrets.token_urlsafe(12)
        st.query_params[OWNER_PARAM] = state["owner_token"]
    return state["owner_token"]


def start_run(config: TrainConfig) -> str:
    """Launch ``config`` for this person (it starts now or waits its turn); its id.

    Raises runs.RunRefused with the sentence to show when the server cannot take it.
    """
    return run_manager().launch(config, owner_token())


def stop_run(run_id: str) -> None:
    run_manager().stop(run_id, owner_token())


def owns_run(run_id: str) -> bool:
    token = st.session_state.get("owner_token")
    return token is not None and run_manager().owns(run_id, token)


def someone_elses_run(run_id: str) -> bool:
    """Launched by another person (runs found in the runs folder after a restart are no one's)."""
    return run_manager().owner_of(run_id) not in (None, st.session_state.get("owner_token"))


def active_runs() -> dict[str, train.TrainingRun]:
    return run_manager().running()


def prediction_caveats(selection: Selection, probabilities: torch.Tensor) -> list[str]:
    """Why the prediction (C,) shown for ``selection`` says little, one sentence each (none: it
    can be read as it is): a picture the model cannot read, a top class no likelier than a guess."""
    caveats = []
    reason = unreadable_photo_reason(selection)
    if reason is not None:
        caveats.append(f"Read nothing into this prediction: {reason[0].lower()}{reason[1:]}")
    if near_chance(probabilities):
        classes = probabilities.shape[-1]
        caveats.append(
            f"The top probability, {float(probabilities.max()):.1%}, is close to chance ({1 / classes:.1%}"
            f" for {classes} classes): the model does not recognise anything here, as when its weights"
            " are random or untrained."
        )
    return caveats


# --- a second model beside the sidebar's (the Compare page) ------------------------------------

SAME_MODEL = "same model"  # the Compare page's model B: the sidebar's model at another patch size


def other_patch_size(options: Sequence[int], current: int) -> int:
    """The patch size model B starts from: the nearest below ``current`` (a finer grid at a
    modest cost), else the nearest above, else ``current`` itself."""
    smaller = [patch for patch in options if patch < current]
    larger = [patch for patch in options if patch > current]
    return max(smaller) if smaller else min(larger) if larger else current


def undownloaded_entry(model_key: str) -> tuple[str, catalogue.CatalogueEntry] | None:
    """(name, entry) of the catalogue model a key names if it is not downloaded yet, else None:
    loading it would download it, which waits to be asked for."""
    kind, _, name = model_key.partition(":")
    if kind == "pretrained" and name in catalogue.CATALOGUE and not catalogue.is_downloaded(name):
        return name, catalogue.CATALOGUE[name]
    return None


def compared_selection(
    model_key: str, patch_size: int | None = None, image_size: tuple[int, int] | None = None
) -> Selection:
    """Model B of the Compare page on the session's image: ``model_key`` at ``patch_size`` and
    ``image_size`` (None: the model's own), preprocessed for its own size, mean and std.

    Loaded and resized through the shared model cache, so B counts against the models' byte
    budget like any other model; raises ValueError or OSError when it cannot be loaded.
    """
    config = base_model(model_key).config
    patch_size = patch_size or config.patch_size
    model = model_at(model_key, patch_size, image_size or config.img_size)
    image_key, image = resolve_image(st.session_state["image_key"], model.config.img_size)
    return Selection(model_key, patch_size, image_key, model, image)


def _import_what_runs_import_lazily() -> None:
    """Imports and builds once what the first runs would: plotly's classes for each trace and
    layout part (imported on first use), its JSON and Streamlit's plotly modules, PIL's format
    plugins, pyarrow's pandas bridge. Made before the freeze below, they are frozen with the rest;
    made by a run, they stayed in every collection for the life of the process (half the objects
    a warm server's collection walked)."""
    import plotly.tools  # noqa: F401 (st.plotly_chart's)
    import pyarrow.pandas_compat  # noqa: F401 (st.dataframe's)
    from plotly.subplots import make_subplots

    Image.init()
    axis = dict(title=dict(text=""), tickfont=dict(size=9))
    colorbar = dict(title=dict(text=""), tickfont=dict(size=9))
    figure = go.Figure(
        data=[
            go.Heatmap(z=[[0.0]], colorbar=colorbar, textfont=dict(size=9)), go.Bar(x=[0], y=[0], marker=dict(color="red")),
            go.Histogram(x=[0], marker=dict(color="red")), go.Image(z=[[[0, 0, 0]]]),
            go.Scatter(x=[0], y=[0], line=dict(color="red"), selected=dict(marker=dict(color="red")),
                       unselected=dict(marker=dict(opacity=0.5))),
        ],
        layout=dict(
            xaxis=axis, yaxis=axis, coloraxis=dict(colorbar=colorbar), margin=dict(t=0),
            title=dict(text=""), font=dict(size=9), annotations=[dict(text="", font=dict(size=9))],
            shapes=[dict(type="line", line=dict(color="red"))], legend=dict(x=0), hoverlabel=dict(font_size=9),
        ),
    )
    pio.to_json(figure, validate=False)
    make_subplots(rows=1, cols=2, subplot_titles=("", ""))


# Streamlit collects every generation after every script run (runner.postScriptGC, on by
# default): a full collection walks every object the process holds, and the modules of torch,
# plotly, streamlit and this package are about 250k of them that are never garbage, so each run
# paid 0.1-1 s of the server's one interpreter (39% of its CPU under a class's load). Frozen once
# here, after the imports (this module is imported once per process), they are left out of every
# collection, and the one after a run walks only what the runs made since. The collection first
# drops what is already garbage, since anything frozen is never collected. Turning the post-run
# collection off instead (runner.postScriptGC=false) saves about as much CPU, but leaves cyclic
# garbage (a run's frames, figures, tensors) to Python's own full collections: rarer (3 in 36
# page views), each as long as before (0.4-0.7 s) and run on whichever thread allocates, the
# event loop's included, where they stall every session. (Slower pages once seen with it off
# did not reproduce: three A/B pairs on the shared 2-core machine went both ways.)
_import_what_runs_import_lazily()
gc.collect()
gc.freeze()
