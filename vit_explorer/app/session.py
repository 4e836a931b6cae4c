"""A session's choices and where they are kept: its session state, the page address (owner
token, image, model and labels, across reloads and in a link sent to others), widget values kept across
pages (and set to open another page on them), and the ``Selection`` they make (the sidebar's, and
the Compare page's model B)."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import streamlit as st

from ..data.transforms import reshapes
from ..model.ablation import MODES, KnockOut
from ..weights import catalogue, from_open_clip
from . import images, models, runs, uploads, words
from .selection import Selection

IMAGE_PARAM = "image"  # the address parameter that keeps the chosen image across a reload
MODEL_PARAM = "model"  # and the chosen model
LABELS_PARAM = "labels"  # and the labels a model with a text tower scores


def init_state() -> None:
    state = st.session_state
    state.setdefault("uploaded_models", {})  # model key -> label
    state.setdefault("uploaded_images", {})  # image key -> label (the bytes are in UPLOADS_DIR)
    if "model_key" not in state:  # a new session: the model the address names is asked for
        state["model_key"] = models.DEFAULT_MODEL
        requested = _model_in_address()
        if requested != models.DEFAULT_MODEL:
            models.request_model(requested)  # loaded (or its licence asked) like a pick in the sidebar
    if "image_key" not in state:  # a new session, or a reload: the address says which image
        state["image_key"] = _image_in_address()
    if "owner_token" not in state and st.query_params.get(runs.OWNER_PARAM):
        state["owner_token"] = st.query_params[runs.OWNER_PARAM]
    if "labels_read" not in state:  # a new session: the labels the address names, checked as if typed
        state["labels_read"] = True
        if st.query_params.get(LABELS_PARAM):
            words.take_labels(st.query_params[LABELS_PARAM])
    uploads.forget_removed_uploads()


def keep_in_address() -> None:
    """Write the owner token, the chosen image and the chosen model into the page's address on
    every run: a reload then keeps them, and Streamlit's page navigation, which drops the address's
    parameters, does not take a person's runs from them. A person who never trained has no token
    to keep, and the default image and model need no parameter."""
    state = st.session_state
    image_key = state["image_key"] if state["image_key"] != images.DEFAULT_IMAGE else None
    model = model_in_address(state["model_key"])
    model = model if model != models.DEFAULT_MODEL else None
    labels = state.get(words.LABELS_TEXT) or None
    for param, value in ((runs.OWNER_PARAM, state.get("owner_token")), (IMAGE_PARAM, image_key), (MODEL_PARAM, model),
                         (LABELS_PARAM, labels)):
        if value is None:
            st.query_params.pop(param, None)
        elif st.query_params.get(param) != value:
            st.query_params[param] = value


def model_in_address(model_key: str) -> str | None:
    """How the address names a model, without a server path: "default", "pretrained:<name>",
    "upload:<digest>" (an uploaded checkpoint, while the uploads folder keeps it) or "run:<id>" (a
    run trained here); None for a model it cannot name (a file the server was started with)."""
    kind, _, reference = model_key.partition(":")
    if kind in (models.DEFAULT_MODEL, "pretrained"):
        return model_key
    path = Path(reference)
    if path.is_relative_to(uploads.UPLOADS_DIR):
        return f"upload:{path.relative_to(uploads.UPLOADS_DIR).parts[0]}"
    found = [run_id for run_id, run in runs.training_runs().items() if run.checkpoint == reference]
    return f"run:{found[0]}" if found else None


def _model_in_address() -> str:
    """The model key the address names (model_in_address's forms) if this server has it, else the default."""
    kind, _, reference = st.query_params.get(MODEL_PARAM, "").partition(":")
    if kind == "pretrained" and reference in catalogue.CATALOGUE:
        return f"pretrained:{reference}"
    if kind == "upload" and reference.isalnum():
        folder = uploads.UPLOADS_DIR / reference
        files = sorted(folder.iterdir()) if folder.is_dir() and not folder.is_symlink() else []
        # As uploads.add_checkpoint_upload keeps them: a Hugging Face or open_clip folder, else its one file.
        is_folder = any((folder / name).is_file() for name in ("config.json", from_open_clip.CONFIG_FILE))
        path = folder if is_folder else files[0] if len(files) == 1 else None
        if path is not None:
            model_key = f"file:{path}"
            st.session_state["uploaded_models"].setdefault(model_key, "Uploaded checkpoint")
            return model_key
    if kind == "run":
        run = runs.training_runs().get(reference)
        if run is not None and run.checkpoint is not None:
            return f"file:{run.checkpoint}"
    return models.DEFAULT_MODEL


def _image_in_address() -> str:
    """The image key in the address if it names a picture this server still has, else the default."""
    image_key = st.query_params.get(IMAGE_PARAM, "")
    kind, _, reference = image_key.partition(":")
    if kind == "shapes" and reference.isdigit() and int(reference) < images.SHAPE_SAMPLES:
        return image_key
    if kind == "photo" and reference in images.photo_names():
        return image_key
    if kind == "upload" and reference.isalnum() and uploads.uploaded_image_path(reference).is_file():
        st.session_state["uploaded_images"][image_key] = "Uploaded image"
        return image_key
    return images.DEFAULT_IMAGE


def selection() -> Selection:
    state = st.session_state
    kind, _, digest = state["image_key"].partition(":")
    if kind == "upload" and not uploads.uploaded_image_path(digest).is_file():
        # Cleaned up for newer uploads (the folder has a quota): back to a built-in picture.
        state["image_key"] = images.DEFAULT_IMAGE
        state["image_notice"] = "Your uploaded image was removed to make room for newer uploads; upload it again."
    base = models.base_model(state["model_key"]).config
    # A model whose preprocessing follows the picture (Qwen-VL, NaFlexViT) sizes its input from it.
    picture = images.resolve_image(state["image_key"], base.img_size)[1].size if models.follows_picture(base) else None
    size = image_size(picture)
    patch = patch_size(size)
    normalization = normalization_choice(state["model_key"])
    model = models.model_at(state["model_key"], patch, size, normalization)
    image_key, image = images.resolve_image(state["image_key"], model.config.img_size)
    return Selection(state["model_key"], patch, image_key, model, image, normalization, whole_picture(model.config))


WHOLE_PICTURE_WIDGET = "whole_picture"  # the sidebar's choice: the publisher's crop (False) or the whole picture


def whole_picture(config) -> bool:
    """Whether this person reads pictures whole (squeezed to the input size) rather than as the
    model's publisher crops or pads them (a choice in the sidebar, for such a model only)."""
    return reshapes(config) and kept(WHOLE_PICTURE_WIDGET, False, lambda value: isinstance(value, bool))


NORMALIZATION_WIDGET = "normalization"  # the sidebar's choice for a model whose normalisation was assumed


def normalization_choice(model_key: str) -> str | None:
    """The normalisation this person chose in the sidebar for ``model_key``, the session's model,
    whose own was assumed; None: its own (models.normalization_choice). Kept like a page widget's
    value, so that choosing another model forgets it."""
    if model_key != st.session_state["model_key"]:
        return None
    return models.normalization_choice(models.base_model(model_key).config, kept(NORMALIZATION_WIDGET, None))


def image_size(picture_size: tuple[int, int] | None = None) -> tuple[int, int]:
    """The input size chosen in the sidebar, if valid for the current model, else its own: for
    a model whose preprocessing follows the picture (Qwen-VL, NaFlexViT), the size it gives the picture of
    ``picture_size`` (width, height)."""
    config = models.base_model(st.session_state["model_key"]).config
    own = config.img_size
    if picture_size is not None:
        follows = models.picture_input_size(config, picture_size)
        own = own if follows is None or models.image_size_problem(config, follows) else follows
    # A side never edited has no kept value: it stays the model's own.
    chosen = tuple(
        st.session_state.get(kept_key(key), native)
        for key, native in zip(("input_height", "input_width"), own)
    )
    return own if models.image_size_problem(config, chosen) else chosen


def patch_size(image_size: tuple[int, int]) -> int:
    """The patch size chosen on the Patches page, if valid for the model at ``image_size``, else its own."""
    config = models.base_model(st.session_state["model_key"]).config.replace(image_size=image_size)
    kept = st.session_state.get(kept_key("patch_size"))
    return kept if kept in models.patch_size_options(config) else config.patch_size


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


def kept(widget_key: str, default: Any, valid: Callable[[Any], bool] = lambda value: True) -> Any:
    """The value a page's widget keeps (:func:`keep`) if there is one and it is still valid, else
    ``default``: for another page to read, without drawing that widget."""
    value = st.session_state.get(kept_key(widget_key))
    return value if value is not None and valid(value) else default


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


def cell_picked(chart_key: str, layer_widget: str, head_widget: str) -> Callable[[], None]:
    """The ``on_select`` callback of a layer x head grid (figures.head_types_grid) drawn with
    ``key=chart_key``, whose points' x is the head and y the layer: the clicked cell's layer and
    head become the kept values of the page widgets ``layer_widget`` and ``head_widget``."""
    def pick() -> None:
        points = st.session_state[chart_key].selection.points
        if points:
            set_kept(layer_widget, int(points[0]["y"]))
            set_kept(head_widget, int(points[0]["x"]))

    return pick


def set_kept(widget_key: str, value: Any) -> None:
    """Change a kept widget's value from a callback (before the widget is drawn)."""
    st.session_state[widget_key] = value
    st.session_state[kept_key(widget_key)] = value


def open_page(page: str, **kept: Any) -> None:
    """Go to ``page`` with these kept widget values (layer, head, query, ...), so that it opens on
    them; from a page that does not draw those widgets itself."""
    for widget_key, value in kept.items():
        set_kept(widget_key, value)
    st.switch_page(page)


def knockout_heads_key(layer: int) -> str:
    """The Knock-out page's kept widget of the heads knocked out in ``layer``."""
    return f"knockout_heads_{layer}"


def kept_knock_out(config) -> KnockOut | None:
    """The knock-out this person chose on the Knock-out page, for another page to compose with; None
    when nothing is knocked out or it does not fit this model."""
    layers = range(config.depth)
    chosen = KnockOut(
        heads={layer: kept(knockout_heads_key(layer), []) for layer in layers},
        attention=kept("knockout_attention", []), mlp=kept("knockout_mlp", []),
        mode=kept("knockout_mode", "zero", lambda mode: mode in MODES),
    )
    return None if chosen.is_empty or chosen.problem(config) else chosen


# --- a second model beside the sidebar's (the Compare page) ------------------------------------

SAME_MODEL = "same model"  # the Compare page's model B: the sidebar's model at another patch size


def other_patch_size(options: Sequence[int], current: int) -> int:
    """The patch size model B starts from: the nearest below ``current`` (a finer grid at a
    modest cost), else the nearest above, else ``current`` itself."""
    smaller = [patch for patch in options if patch < current]
    larger = [patch for patch in options if patch > current]
    return max(smaller) if smaller else min(larger) if larger else current


def compared_selection(
    model_key: str, patch_size: int | None = None, image_size: tuple[int, int] | None = None
) -> Selection:
    """Model B of the Compare page on the session's image: ``model_key`` at ``patch_size`` and
    ``image_size`` (None: the model's own), preprocessed for its own size, mean, std and crop (the
    sidebar's model: with the normalisation chosen there).

    Loaded and resized through the shared model cache, so B counts against the models' byte
    budget like any other model; raises ValueError or OSError when it cannot be loaded.
    """
    config = models.base_model(model_key).config
    patch_size = patch_size or config.patch_size
    normalization = normalization_choice(model_key)  # the sidebar's model read as the sidebar reads it
    model = models.model_at(model_key, patch_size, image_size or config.img_size, normalization)
    image_key, image = images.resolve_image(st.session_state["image_key"], model.config.img_size)
    return Selection(model_key, patch_size, image_key, model, image, normalization, whole_picture(model.config))
