"""A prediction in words, for a model with a text tower (CLIP, SigLIP): the app's only glue for
vit_explorer.text. A page asks :func:`prediction` (under a knock-out too) and shows it beside
:func:`about`; the sidebar draws :func:`labels_box`.

- :func:`words_model`: both towers, loaded once for everybody into the shared models cache, the
  image tower being the shared ViT every page explores (``models.base_model``); None for a model
  without a text tower, or one whose text tower does not load (:func:`words_problem` says why).
- The labels in force are this session's (:func:`session_labels`): typed in the sidebar, checked
  (a bad list is a sentence and the last good labels stay), or None for ImageNet's 1,000 classes.
- :func:`label_embeddings`: typed labels embedded once for everybody (a few prompts, inline);
  ImageNet's class embeddings (7,000 prompts) read from their file beside the model, else
  computed once as a job ("class embeddings", serving/job_kinds.py) that writes that file, so
  that every server reads it from then on. Until then a page shows the job's button or progress
  in place of the prediction.
- :func:`head_descriptions`: the Head types page's heads in words (text/heads.py, TextSpan).
- Results are keyed by model and labels (a digest of them), never by session: two people with
  different labels never see each other's prediction.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import streamlit as st
import torch

from .. import figures
from ..model.ablation import KnockOut
from ..model.config import ViTConfig
from ..serving.cache import nbytes
from ..serving.jobs import JobSpec
from ..text import ImageTextModel, LabelError, is_image_text_folder, load_image_text_model, parse_labels
from ..text import heads, zero_shot
from ..text.descriptions import DESCRIPTIONS
from ..text.tokenizers import TOKENIZER_FILE
from ..text.towers import MAX_LABEL_CHARACTERS, MAX_LABELS
from ..weights import catalogue
from . import costs, jobs, models
from .memo import memo, shared_results, with_spinner
from .selection import ImageSet, Selection, prediction_caveats, unreadable_photo_reason

# The sidebar's text box, what it last held, the labels in force (a tuple, or None: ImageNet's
# classes) and why the last labels typed were not taken. Not "kept:" values (session.keep): those
# belong to a model and are forgotten with it, and a person's words fit any model with a text tower.
LABELS_WIDGET = "words_labels_box"
LABELS_TEXT = "words_labels_text"
LABELS = "words_labels"
LABELS_ERROR = "words_labels_error"
LABELS_MERGED = "words_labels_merged"  # the sentence saying which labels typed twice are scored once
CLASS_EMBEDDINGS_FILE = "imagenet_class_embeddings.safetensors"
IMAGENET_IDENTITY = "ImageNet classes x templates"  # what the class embeddings job reads: no image


def text_folder(model_key: str) -> Path | None:
    """The open_clip folder (both towers) behind a model key, or None for a model with no text
    tower: an uploaded or default folder, or a catalogue entry's (catalogue.text_folder)."""
    kind, _, reference = model_key.partition(":")
    if kind == models.DEFAULT_MODEL:
        path = models.default_weights()
    elif kind == "file":
        path = Path(reference)
    else:  # "pretrained": the catalogue's CLIP and SigLIP entries download open_clip folders
        path = catalogue.text_folder(reference)
        if path is None:
            return None
    return path if is_image_text_folder(path) else None


@dataclass(frozen=True)
class _Loaded:
    """What the models cache keeps of a model's text side: both towers, or why they do not load."""

    model: ImageTextModel | None
    problem: str | None


def _loaded(model_key: str) -> _Loaded | None:
    folder = text_folder(model_key)
    if folder is None:
        return None
    image = models.base_model(model_key)

    def load() -> _Loaded:
        try:
            models.admit_text(folder, image)
            model = load_image_text_model(folder, image=image)
        except (ValueError, OSError) as error:
            return _Loaded(None, f"This model's text tower could not be loaded, so it predicts nothing in words: {error}.")
        model.text.to(models.DEVICE)  # not shared yet: moved once, before anybody reads it
        return _Loaded(model, None)

    def text_bytes(loaded: _Loaded) -> int:  # the image tower is the base model's, counted there
        if loaded.model is None:
            return 64
        tokenizer = folder / TOKENIZER_FILE
        return nbytes(loaded.model.text) + nbytes(loaded.model.image_projection) + (
            tokenizer.stat().st_size if tokenizer.is_file() else 0
        )

    loaded = models.shared_models().get_or_compute(
        ("words", model_key), lambda: with_spinner("Loading the text tower ...", load), size=text_bytes,
    )
    # Touched last, as a resized model touches its base: the words model is never the more recent
    # of the two, so the image tower it holds is never evicted (and loaded twice) while it lives.
    models.base_model(model_key)
    return loaded


def words_model(model_key: str) -> ImageTextModel | None:
    """Both towers of ``model_key`` (the image tower the shared ViT), shared by everybody; None for
    a model without a text tower or one whose text tower does not load (:func:`words_problem`)."""
    loaded = _loaded(model_key)
    return None if loaded is None else loaded.model


def words_problem(model_key: str) -> str | None:
    """Why a model that brings a text tower predicts nothing in words (one sentence), else None."""
    loaded = _loaded(model_key)
    return None if loaded is None else loaded.problem


# --- the labels in force: this session's --------------------------------------------------------


def session_labels() -> tuple[str, ...] | None:
    """The labels this session scores (None: ImageNet's 1,000 classes)."""
    return st.session_state.get(LABELS)


def _labels_typed() -> None:
    """The text box's callback: the labels typed, checked; refused, the last good ones stay."""
    state = st.session_state
    text = state[LABELS_WIDGET]
    state.pop(LABELS_ERROR, None)
    state.pop(LABELS_MERGED, None)
    if not text.strip():
        state[LABELS], state[LABELS_TEXT] = None, ""
        return
    try:
        labels = tuple(parse_labels(text))
    except LabelError as error:
        still = "ImageNet's classes" if state.get(LABELS) is None else "your last labels"
        state[LABELS_ERROR] = f"Those labels were not taken: {error}; the prediction is still over {still}."
        return  # the box shows the labels in force again (labels_box)
    state[LABELS], state[LABELS_TEXT] = labels, ", ".join(labels)
    typed = [part.strip() for part in text.replace("\n", ",").split(",") if part.strip()]
    repeated = list(dict.fromkeys(label for index, label in enumerate(typed) if label in typed[:index]))
    if repeated:
        names, one = ", ".join(f"'{label}'" for label in repeated), len(repeated) == 1
        state[LABELS_MERGED] = f"{names} {'was' if one else 'were'} typed more than once and {'is' if one else 'are'} scored once."


def take_labels(text: str) -> None:
    """Labels from the page's address (a reload, or a link a teacher sends the class), taken and
    checked as if typed in the box."""
    st.session_state[LABELS_WIDGET] = text
    _labels_typed()


def _labels_not_read(error: LabelError) -> None:
    """Labels taken but that this model cannot embed: back to ImageNet's classes, and the sentence
    why beside the labels box (now, and on the next runs until other labels are typed)."""
    state = st.session_state
    state[LABELS_ERROR] = f"This model could not read your labels: {error}; the prediction is over ImageNet's classes."
    state[LABELS], state[LABELS_TEXT] = None, ""
    st.sidebar.error(state[LABELS_ERROR])


def labels_box(model_key: str) -> None:
    """The sidebar's "Labels" text box, for a model with a text tower only (or the sentence saying
    why its text tower does not load); empty means ImageNet's classes."""
    problem = words_problem(model_key)
    if problem is not None:
        st.warning(problem)
    if words_model(model_key) is None:
        return
    state = st.session_state
    state[LABELS_WIDGET] = state.get(LABELS_TEXT, "")  # what is in force, also after a refusal
    st.text_input(
        "Labels (comma-separated)", key=LABELS_WIDGET, on_change=_labels_typed,
        placeholder="empty: ImageNet's 1,000 classes",
        help="What the model should choose between, in your words: a cat, a dog, a rocket. Each is scored as"
        f" \"{zero_shot.LABEL_TEMPLATE.format('{label}')}\"; at most {MAX_LABELS:,} labels of {MAX_LABEL_CHARACTERS}"
        " characters. Empty: ImageNet's 1,000 classes.",
    )
    if LABELS_ERROR in state:
        st.error(state[LABELS_ERROR])
    if LABELS_MERGED in state:
        st.caption(state[LABELS_MERGED])


def labels_id(labels: tuple[str, ...] | None) -> str:
    """What results over ``labels`` are keyed by: a digest (a thousand labels make a long key)."""
    if labels is None:
        return "imagenet"
    return hashlib.sha256(json.dumps(labels).encode()).hexdigest()[:32]


def label_names(labels: tuple[str, ...] | None) -> tuple[str, ...]:
    return zero_shot.imagenet_classes() if labels is None else labels


def over(labels: tuple[str, ...] | None) -> str:
    """What a prediction is over, in words."""
    if labels is None:
        return f"zero-shot over ImageNet's 1,000 classes ({len(zero_shot.imagenet_templates())} prompts each)"
    return f"over your labels ({len(labels):,}), each read as \"{zero_shot.LABEL_TEMPLATE.format('{label}')}\""


def about(model_key: str) -> str:
    """The sentence beside a prediction in words: what it is over and how the model scores."""
    model = words_model(model_key)
    what = over(session_labels())
    return f"A prediction in words, {what}. {model.scoring_sentence() if model is not None else ''}".strip()


# --- the labels' embeddings, once for everybody --------------------------------------------------


def label_embeddings(model_key: str, labels: tuple[str, ...] | None) -> torch.Tensor | None:
    """(T, E) unit text embeddings of ``labels`` for ``model_key`` (a model with a text tower),
    once for everybody. Typed labels: embedded here (a few prompts). None: ImageNet's class
    embeddings, from their file, else from the job that writes it; None until they are there,
    with the job's button or its progress drawn in their place."""
    model = words_model(model_key)
    if model is None:
        raise ValueError(f"{model_key} has no text tower")
    if labels is not None:
        return memo(
            ("words", model_key, "label embeddings", labels_id(labels)),
            lambda: model.embed_texts(zero_shot.label_prompts(list(labels))),
            spinner="Reading your labels ...",
        )
    key = ("words", model_key, "imagenet class embeddings")
    found = shared_results().get(key)
    if found is not None:
        return found
    folder = text_folder(model_key)
    path = class_embeddings_path(folder)
    classes, templates = zero_shot.imagenet_classes(), zero_shot.imagenet_templates()
    saved = zero_shot.load_class_embeddings(path, classes, templates, model.embed_dim)
    if saved is not None:  # written by this server's job or another's
        return memo(key, lambda: saved)
    config = models.base_model(model_key).config
    spec = JobSpec(
        "class embeddings", {"path": str(folder)}, config.patch_size, config.img_size, IMAGENET_IDENTITY,
        class_embeddings_settings(model, config, folder, path, len(classes) * len(templates)),
    )
    note = st.empty()  # said while they are not there; gone on the run that finds them done
    note.info(
        f"ImageNet's class embeddings for this model are computed once ({len(classes):,} classes x"
        f" {len(templates)} prompts through the text tower), then kept on disk for everybody."
    )
    values = jobs.as_job(_Asker(config), spec, (key,), "Compute ImageNet's class embeddings", x=torch.zeros(1))
    if values is None:
        return None
    note.empty()
    return values[0]


def embeddings_kept(model_key: str, labels: tuple[str, ...] | None) -> bool:
    """Whether :func:`label_embeddings` of ``labels`` returns them without drawing anything (typed
    labels, or ImageNet's already read): for a part of a page that should stay silent meanwhile."""
    return labels is not None or shared_results().get(("words", model_key, "imagenet class embeddings")) is not None


@dataclass(frozen=True)
class _Asker:
    """What jobs.as_job reads of who asks: the model's config (the job's input is given: no image)."""

    config: ViTConfig


def class_embeddings_path(folder: Path) -> Path:
    """Where a model's ImageNet class embeddings are kept: beside it in its folder (an upload's, the
    catalogue's: the server's own), else, for a folder the server cannot write, in its cache."""
    if os.access(folder, os.W_OK):
        return folder / CLASS_EMBEDDINGS_FILE
    digest = hashlib.sha256(str(folder.resolve()).encode()).hexdigest()[:24]
    return catalogue.cache_dir() / "class_embeddings" / f"{digest}.safetensors"


def class_embeddings_settings(model: ImageTextModel, config, folder: Path, path: Path, prompts: int) -> dict:
    """The job's settings: where it reads and writes, and what its cost is estimated from (the
    text tower's size and one prompt's multiply-adds against one image pass)."""
    text = model.text
    lookup = sum(
        parameter.numel() for name, parameter in text.named_parameters()
        if name.startswith(("token_embedding", "positional_embedding"))
    )
    parameters = sum(parameter.numel() for parameter in text.parameters())
    width, layers = int(getattr(text, "width", model.embed_dim)), int(getattr(text, "layers", 1))
    context = model.context_length
    per_prompt = context * (parameters - lookup) + layers * 2 * context * context * width
    return {
        "folder": str(folder), "path": str(path), "prompts": prompts,
        "forwards": round(prompts * per_prompt / costs.forward_cost(config), 1),
        # The folder's weights, read whole: open_clip's one file, a Hugging Face folder's file or shards.
        "file_bytes": sum(file.stat().st_size for file in folder.glob("*.safetensors") if file.name != CLASS_EMBEDDINGS_FILE),
        "tokenizer_bytes": (folder / TOKENIZER_FILE).stat().st_size if (folder / TOKENIZER_FILE).is_file() else 0,
        "text_parameters": parameters, "context_length": context, "width": width,
        "heads": int(getattr(text, "heads", 1)), "embed_dim": model.embed_dim,
    }


# --- the prediction -----------------------------------------------------------------------------


def prediction(selection: Selection, knock_out: KnockOut | None = None) -> zero_shot.Prediction | None:
    """``selection``'s image scored against this session's labels (with ``knock_out``: the pass
    without those heads and branches); None for a model without a text tower, or while ImageNet's
    class embeddings are not there yet (their button or progress drawn in its place)."""
    model = words_model(selection.model_key)
    if model is None:
        return None
    labels = session_labels()
    try:
        texts = label_embeddings(selection.model_key, labels)
    except LabelError as error:  # labels this model's tokenizer cannot read: said beside the box
        _labels_not_read(error)
        return None
    if texts is None:
        return None
    if knock_out is not None and knock_out.is_empty:
        knock_out = None
    captured = selection.capture() if knock_out is None else selection.knock_out_capture(knock_out)
    return selection.memo(
        "words prediction", labels_id(labels), knock_out,
        compute=lambda: zero_shot.predict(model, captured.logits, label_names(labels), texts),
    )


def top_labels_figure(selection: Selection, predicted: zero_shot.Prediction):
    """The bar of the prediction's top 5 labels, built once for everybody (Pipeline and the
    Lesson draw the same one)."""
    return selection.memo("words top-5 figure", labels_id(session_labels()), compute=lambda: (
        figures.zero_shot_bar(predicted.scores, predicted.labels, predicted.scoring, k=5)
    ))


def chooses(predicted: zero_shot.Prediction) -> bool:
    """Whether the scores choose between labels: not one label under CLIP's softmax, which gives
    it 100% whatever the image (a SigLIP's sigmoid scores one label on its own)."""
    return predicted.scoring != "softmax" or len(predicted.labels) > 1


def caveats(selection: Selection, predicted: zero_shot.Prediction) -> list[str]:
    """Why a prediction in words says little: a picture the model cannot read; for CLIP's softmax
    also one label alone, or a top label no likelier than a guess (SigLIP's sigmoids are not
    shares of one)."""
    if not chooses(predicted):
        return [
            f"With one label there is nothing to choose between: the softmax gives '{predicted.labels[0]}' 100%"
            " whatever the image; type two labels or more."
        ]
    if predicted.scoring == "softmax":
        return prediction_caveats(selection, predicted.scores)
    reason = unreadable_photo_reason(selection)
    return [] if reason is None else [f"Read nothing into this prediction: {reason[0].lower()}{reason[1:]}"]


def head_descriptions(image_set: ImageSet) -> tuple[list[int], list[list[tuple[str, float]]]]:
    """(the layers described, per head of those layers in order: its descriptions with the share
    of its variance each explains), over ``image_set``, once for everybody (text/heads.py).
    Asked with a button: the descriptions' embeddings cost about 3 forward passes of a ViT-B/16
    the first time for a model (then they are memoised with it)."""
    model_key = image_set.selection.model_key
    model = words_model(model_key)
    depth = model.image.config.depth
    layers = list(range(max(0, depth - heads.LAST_LAYERS), depth))

    def describe() -> list[list[tuple[str, float]]]:
        texts = memo(
            ("words", model_key, "description embeddings"), lambda: model.embed_texts(list(DESCRIPTIONS)),
            spinner=f"Reading the {len(DESCRIPTIONS)} descriptions ...",
        )
        tokens = torch.stack(image_set.image_tokens())
        writes = heads.head_contributions(model, tokens, image_set.selection.config.grid_size, layers)
        return heads.describe_heads(writes.flatten(1, 2), texts, DESCRIPTIONS)

    return layers, image_set.memo("heads in words", compute=describe, spinner="Describing the heads in words ...")
