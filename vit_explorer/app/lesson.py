"""The Lesson page's state: the step it shows (read from the address when a session starts, so
that a teacher's link opens that step, and written back on every run), the learner's answers to
its questions (this session's only, per model, sizes and image: another image asks again), the
teacher's link to a step, the buttons that open another page on what a step showed, and what
the steps say of the model (its prefix tokens and positions, its prediction)."""
from __future__ import annotations

import urllib.parse
from collections.abc import Callable
from typing import Any

import streamlit as st

from . import models, session, words
from .selection import Selection

PAGE = "views/lesson.py"
URL_PATH = "lesson"
STEP_PARAM = "step"  # the address parameter of the step shown
STEPS = (
    "Your photo, cut into patches",
    "Each patch becomes a vector",
    "The class token and the positions",
    "Where one token looks",
    "How a head decides: queries, keys and the softmax",
    "Many heads, each asking its own question",
    "The MLP and the residual stream",
    "Layer after layer",
    "The prediction",
    "One experiment: knock out a head",
    "Which map should you believe?",
)


def step() -> int:
    """The step shown, 1 to len(STEPS): this session's; in a new session the address's, else 1."""
    state = st.session_state
    if "lesson_step" not in state:
        value = st.query_params.get(STEP_PARAM, "")
        state["lesson_step"] = int(value) if value.isdigit() and 1 <= int(value) <= len(STEPS) else 1
    return state["lesson_step"]


def go_to(number: int) -> None:
    """Show step ``number`` (a callback: Back, Next, the step picker); nothing else changes."""
    st.session_state["lesson_step"] = min(max(number, 1), len(STEPS))


def picked_step() -> None:
    go_to(st.session_state["lesson_step_picker"])


def step_picker() -> dict:
    """Widget arguments of the step picker, showing the step shown (changed by Back and Next too)."""
    st.session_state["lesson_step_picker"] = step()
    return dict(key="lesson_step_picker", on_change=picked_step)


def keep_step_in_address() -> None:
    """The step in the page's address, beside the image and model (session.keep_in_address), so that
    the address is always the link to what is on the screen."""
    if st.query_params.get(STEP_PARAM) != str(step()):
        st.query_params[STEP_PARAM] = str(step())


def teacher_link() -> tuple[str, bool]:
    """(the address that opens the step shown on this session's image and model, whether it names
    the model). Never the owner token: whoever holds that can stop this person's runs."""
    state = st.session_state
    params = {STEP_PARAM: str(step()), session.IMAGE_PARAM: state["image_key"]}
    model = session.model_in_address(state["model_key"])
    if model is not None:
        params[session.MODEL_PARAM] = model
    return f"{st.context.url or URL_PATH}?{urllib.parse.urlencode(params)}", model is not None


def answer(question: str, selection: Selection) -> Any:
    """The learner's answer to ``question`` on this model, size and image, or None."""
    return st.session_state.get("lesson_answers", {}).get((question, selection.key))


def _set_answer(question: str, selection_key: tuple, value: Any) -> None:
    st.session_state.setdefault("lesson_answers", {})[(question, selection_key)] = value


def answer_widget(question: str, selection: Selection) -> dict:
    """Widget arguments that show the learner's answer to ``question`` (None: not answered yet)
    and keep what they choose, per model, sizes and image."""
    key = f"lesson_answer_{question}"
    st.session_state[key] = answer(question, selection)
    return dict(key=key, on_change=lambda: _set_answer(question, selection.key, st.session_state[key]))


def patch_clicked(question: str, selection: Selection, chart_key: str) -> Callable[[], None]:
    """The ``on_select`` callback of a patch picker drawn with ``key=chart_key``: the clicked patch
    is the answer to ``question``."""
    def pick() -> None:
        points = st.session_state[chart_key].selection.points
        if points:
            _set_answer(question, selection.key, int(points[0]["point_index"]))

    return pick


def ask_again(question: str, selection: Selection) -> None:
    """Forget the answer to ``question`` on this selection (a callback: "Ask me again")."""
    st.session_state.get("lesson_answers", {}).pop((question, selection.key), None)


def explore_button(page: str, title: str, **kept: Any) -> None:
    """A button that opens ``page`` (titled ``title``) on these kept widget values: the layer, head
    and query the step showed."""
    if st.button(f"Explore this on its page: {title}", icon=":material/open_in_new:", key="lesson_explore"):
        session.open_page(page, **kept)


def positions_sentences(config) -> str:
    """What the step on the class token and the positions says of this model: its prefix tokens,
    and whether its positions are added, rotary or none."""
    parts = []
    if config.class_token:
        parts.append(
            "One more token joins the patches, in front: a learned class token. It belongs to no patch and"
            " starts the same for every image; through the layers it gathers what the classifier reads."
        )
    else:
        parts.append(f"This model has no class token: at the end it reads {models.pooled_output(config)}.")
    if config.dist_token:
        parts.append("A distillation token follows it (DeiT), trained to agree with a teacher network.")
    if config.reg_tokens:
        parts.append(
            f"{config.reg_tokens} register tokens follow: scratch space with no patch of their own, which"
            " keeps the patch tokens free of artefacts (Darcet et al. 2023)."
        )
    rotary, added = config.rope_type is not None, config.abs_pos_embed
    if added:
        parts.append(
            "Attention by itself ignores where a token came from, so a learned position vector is added to"
            " each patch's token" + (" (and the model turns its queries and keys by position too)." if rotary else ".")
        )
    elif rotary:
        parts.append(
            "Attention by itself ignores where a token came from. This model adds nothing to the tokens:"
            f" in every layer it turns each patch's query and key, cut into {config.head_dim // 2} pairs of numbers,"
            " by angles computed from the patch's row and column (rotary positions), so that a score sees"
            " where two patches are relative to each other."
        )
    else:
        parts.append(
            "Attention by itself ignores where a token came from, and this model has no positions: it reads a bag"
            " of patches."
        )
    return " ".join(parts)


def predicted(selection: Selection, knock_out=None):
    """(scores (C,), their names, the key of a knock-out figure of them) of what the model says:
    its classifier's probabilities, or for a model with a text tower its prediction in words over
    the sidebar's labels (with ``knock_out``: of the pass without it); None for a headless model
    without one, or while ImageNet's class embeddings are computed (their button or progress drawn
    instead)."""
    if selection.config.num_classes:
        captured = selection.capture() if knock_out is None else selection.knock_out_capture(knock_out)
        return captured.logits[0].softmax(-1), selection.class_names(), ("knock-out top-k",)
    if words.words_model(selection.model_key) is None:
        return None
    said = words.prediction(selection, knock_out)
    return None if said is None else (said.scores, said.labels, ("words knock-out top-k", words.labels_id(words.session_labels())))

