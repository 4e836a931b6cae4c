"""Streamlit glue for the explorer app: cached loaders and the selection every page shares.

The only module of the package that imports streamlit. Models live in ``st.cache_resource``
(one copy per process), captures in ``st.cache_data`` keyed by model, patch size and image, so
moving a slider redraws figures without a new forward pass. Session state holds only keys and
small values; everything heavy is looked up in the caches by key.

Model keys: ``"default"`` (the shipped shapes model), ``"pretrained:vit_b_16"`` (torchvision)
and ``"file:<path>"`` (an uploaded checkpoint or a run trained in the app).
"""
from __future__ import annotations

import hashlib
import os
import secrets
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import streamlit as st
import torch
from PIL import Image

from . import runs, train
from .analysis import attribution, display_image
from .capture import Capture, capture
from .config import TrainConfig
from .data import SHAPE_CLASSES, shapes_sample
from .images import load_image, preprocess
from .model import ViT
from .weights import load_model, load_pretrained, resize_model

DEFAULT_MODEL = "default"
PRETRAINED_MODEL = "pretrained:vit_b_16"
PHOTOS_DIR = Path(__file__).resolve().parent.parent / "assets" / "samples"
UPLOADS_DIR = Path(tempfile.gettempdir()) / "vit_explorer_uploads"
# Where runs trained in the app write their checkpoints.
RUNS_DIR = Path(os.environ.get("VIT_EXPLORER_RUNS_DIR") or Path(__file__).resolve().parent.parent / "runs" / "app")
# The largest attention tensor (depth x heads x N x N float32) a patch size may produce:
# ViT-B/16 at patch 8 (785 tokens) is about 355 MB and still fits.
MAX_ATTENTION_BYTES = 400 * 2**20
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


# --- models ------------------------------------------------------------------------------------


def default_weights() -> Path:
    """The shipped shapes model, or the checkpoint that VIT_EXPLORER_DEFAULT_MODEL names."""
    return Path(os.environ.get("VIT_EXPLORER_DEFAULT_MODEL") or train.DEFAULT_WEIGHTS)


@st.cache_resource(max_entries=4, show_spinner="Loading the model ...")
def base_model(model_key: str) -> ViT:
    """The model behind a key at its own patch size, in eval mode on the app's device."""
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


@st.cache_resource(max_entries=4, show_spinner="Resizing the patch embedding ...")
def model_at(model_key: str, patch_size: int) -> ViT:
    """The model resized to ``patch_size`` (FlexiViT PI-resize); the base model at its own size."""
    model = base_model(model_key)
    if patch_size == model.config.patch_size:
        return model
    return resize_model(model, patch_size=patch_size).eval()


def patch_size_options(config) -> list[int]:
    """Patch sizes that tile the model's input exactly and keep the attention tensor in memory."""
    height, width = config.img_size
    options = []
    for patch in range(2, min(height, width) + 1):
        if height % patch or width % patch:
            continue
        tokens = config.num_prefix_tokens + (height // patch) * (width // patch)
        if config.depth * config.num_heads * tokens**2 * 4 <= MAX_ATTENTION_BYTES:
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


def photo_names() -> list[str]:
    return sorted(path.name for path in PHOTOS_DIR.iterdir() if path.suffix in (".png", ".jpg"))


@st.cache_data(max_entries=64, show_spinner=False)
def shapes_image(index: int, image_size: tuple[int, int]) -> tuple[Image.Image, str]:
    return shapes_sample(index, image_size)


@st.cache_resource(max_entries=16, show_spinner=False)
def photo(name: str) -> Image.Image:
    return load_image(PHOTOS_DIR / name)


@st.cache_resource(max_entries=16, show_spinner=False)
def uploaded_image(digest: str, _data: bytes) -> Image.Image:
    return load_image(_data)


def sample_image_options(image_size: tuple[int, int]) -> dict[str, str]:
    """Image key -> label for the built-in pictures (shapes are drawn at the model's size)."""
    options = {
        f"shapes:{index}": f"Shapes #{index}: {shapes_image(index, image_size)[1]}"
        for index in range(SHAPE_SAMPLES)
    }
    options.update({f"photo:{name}": f"Photo: {Path(name).stem}" for name in photo_names()})
    return options


def resolve_image(image_key: str, image_size: tuple[int, int]) -> tuple[str, Image.Image]:
    """(cache key, RGB image) for an image key; shapes depend on the model's input size."""
    kind, _, reference = image_key.partition(":")
    if kind == "shapes":
        return f"{image_key}@{image_size[0]}x{image_size[1]}", shapes_image(int(reference), image_size)[0]
    if kind == "photo":
        return image_key, photo(reference)
    _, data = st.session_state["uploaded_images"][image_key]
    return image_key, uploaded_image(reference, data)


# --- captures --------------------------------------------------------------------------------


@st.cache_data(max_entries=8, show_spinner="Running the model ...")
def cached_capture(model_key: str, patch_size: int, image_key: str, _model: ViT, _image: Image.Image) -> Capture:
    """One forward pass, dissected; keyed by the strings only (the model and image follow from them)."""
    return capture(_model, preprocess(_image, _model.config))


@st.cache_data(max_entries=16, show_spinner="Tracing the class back to the patches ...")
def cached_attribution(
    model_key: str, patch_size: int, image_key: str, target: int, _model: ViT, _image: Image.Image
) -> np.ndarray:
    """(gh, gw) relevance of each patch for class ``target``; one backward pass per class."""
    return attribution(_model, preprocess(_image, _model.config), target)[0].cpu().numpy()


@st.cache_data(max_entries=8, show_spinner="Trying every patch size ...")
def predictions_by_patch_size(model_key: str, image_key: str, _model: ViT, _image: Image.Image) -> list[dict]:
    """The top-1 prediction of the model resized to each allowed patch size."""
    names = _model.config.class_names
    rows = []
    for patch in patch_size_options(_model.config):
        resized = _model if patch == _model.config.patch_size else resize_model(_model, patch_size=patch)
        x = preprocess(_image, resized.config).to(DEVICE)
        with torch.no_grad():
            probabilities = resized.eval()(x).float().softmax(dim=-1)[0].cpu()
        best = int(probabilities.argmax())
        grid_h, grid_w = resized.config.grid_size
        rows.append({
            "patch size": patch,
            "grid": f"{grid_h}x{grid_w}",
            "tokens": resized.config.num_tokens,
            "prediction": names[best] if names else f"class {best}",
            "probability": float(probabilities[best]),
        })
    return rows


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
        return base_model(self.model_key)

    def capture(self) -> Capture:
        return cached_capture(self.model_key, self.patch_size, self.image_key, self.model, self.image)

    def attribution(self, target: int) -> np.ndarray:
        return cached_attribution(self.model_key, self.patch_size, self.image_key, target, self.model, self.image)

    def model_input(self) -> torch.Tensor:
        return preprocess(self.image, self.config)  # (1, C, H, W)

    def display_image(self) -> np.ndarray:
        """(H, W, 3) uint8: the picture exactly as the model sees it (resized, 8-bit)."""
        return display_image(self.model_input(), self.config)

    def class_names(self) -> list[str]:
        names = self.config.class_names
        return list(names) if names else [f"class {i}" for i in range(self.config.num_classes)]


# --- session state ------------------------------------------------------------------------------


def init_state() -> None:
    state = st.session_state
    state.setdefault("model_key", DEFAULT_MODEL)
    state.setdefault("image_key", "shapes:0")
    state.setdefault("uploaded_models", {})  # model key -> label
    state.setdefault("uploaded_images", {})  # image key -> (label, bytes)


def selection() -> Selection:
    state = st.session_state
    patch = patch_size()
    model = model_at(state["model_key"], patch)
    image_key, image = resolve_image(state["image_key"], model.config.img_size)
    return Selection(state["model_key"], patch, image_key, model, image)


def patch_size() -> int:
    """The patch size chosen on the Patches page, if valid for the current model, else its own."""
    config = base_model(st.session_state["model_key"]).config
    kept = st.session_state.get(kept_key("patch_size"))
    return kept if kept in patch_size_options(config) else config.patch_size


def kept_key(widget_key: str) -> str:
    return f"kept:{widget_key}"


def keep(widget_key: str, default: Any, valid: Callable[[Any], bool] = lambda value: True) -> dict:
    """Widget arguments that keep a page widget's value when the person visits another page.

    Streamlit forgets a widget's state once a run does not draw it; the value is copied to a
    key of our own on every change and restored from there (if still valid) when drawn again.
    """
    state = st.session_state
    if widget_key not in state or not valid(state[widget_key]):
        kept = state.get(kept_key(widget_key), default)
        state[widget_key] = kept if valid(kept) else default
    return dict(key=widget_key, on_change=_copy_to_kept, args=(widget_key,))


def _copy_to_kept(widget_key: str) -> None:
    st.session_state[kept_key(widget_key)] = st.session_state[widget_key]


def set_kept(widget_key: str, value: Any) -> None:
    """Change a kept widget's value from a callback (before the widget is drawn)."""
    st.session_state[widget_key] = value
    st.session_state[kept_key(widget_key)] = value


def model_options() -> dict[str, str]:
    """Model key -> label: the shipped model, ImageNet ViT-B/16, finished runs and uploads."""
    options = {
        DEFAULT_MODEL: "Shipped shapes ViT (offline)",
        PRETRAINED_MODEL: "ImageNet ViT-B/16 (torchvision; downloads once)",
    }
    for run_id, run in training_runs().items():
        if run.checkpoint is not None:
            options[f"file:{run.checkpoint}"] = f"Trained here: {run_id}"
    options.update(st.session_state["uploaded_models"])
    return options


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


def select_model(model_key: str) -> str | None:
    """Load ``model_key`` and make it the current model; None on success, else the reason."""
    try:
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


def add_checkpoint_upload(files: Sequence) -> str | None:
    """Store an uploaded checkpoint (one file, or a Hugging Face folder's files) and select it.

    Returns None on success, else one sentence saying why the model stays as it was.
    """
    names = [file.name for file in files]
    folder = UPLOADS_DIR / _upload_digest(files)
    folder.mkdir(parents=True, exist_ok=True)
    for file in files:
        (folder / Path(file.name).name).write_bytes(file.getvalue())
    if "config.json" in names:
        target = folder  # a Hugging Face ViT: config.json beside its weights
    elif len(files) == 1:
        target = folder / Path(names[0]).name
    else:
        return (
            "Upload one checkpoint file, or a Hugging Face model's config.json together with"
            " its weights."
        )
    model_key = f"file:{target}"
    error = select_model(model_key)
    if error is None:
        st.session_state["uploaded_models"][model_key] = f"Uploaded: {', '.join(names)}"
    return error


def add_image_upload(file) -> str | None:
    """Decode an uploaded image and select it; None on success, else the one-line reason."""
    data = file.getvalue()
    digest = hashlib.sha256(data).hexdigest()[:16]
    try:
        uploaded_image(digest, data)
    except ValueError as error:
        return f"Could not use {file.name}: {error}"
    image_key = f"upload:{digest}"
    st.session_state["uploaded_images"][image_key] = (f"Uploaded: {file.name}", data)
    st.session_state["image_key"] = image_key
    return None


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
    """This person's token: in the page's address, so that a reload keeps their runs theirs."""
    token = st.query_params.get(OWNER_PARAM)
    if not token:
        token = secrets.token_urlsafe(12)
        st.query_params[OWNER_PARAM] = token
    return token


def start_run(config: TrainConfig) -> str:
    """Launch ``config`` for this person (it starts now or waits its turn); its id.

    Raises runs.RunRefused with the sentence to show when the server cannot take it.
    """
    return run_manager().launch(config, owner_token())


def stop_run(run_id: str) -> None:
    run_manager().stop(run_id, owner_token())


def owns_run(run_id: str) -> bool:
    return run_manager().owns(run_id, owner_token())


def someone_elses_run(run_id: str) -> bool:
    """Launched by another person (runs found in the runs folder after a restart are no one's)."""
    return run_manager().owner_of(run_id) not in (None, owner_token())


def active_runs() -> dict[str, train.TrainingRun]:
    return run_manager().running()
