"""A view's heavy computation as a job (vit_explorer.serving.jobs): asked for with a button, followed live
(place in the queue, a progress bar, Cancel), its results shared with everybody through ``memo``
under the keys the inline computation uses: the head sweep (the Knock-out page's, the Lesson's
question, which asks for it at once), what the Compare page draws of model B, the Attention page's
rollout and every head's distance and entropy, the Several images page's batch, the Head types
page's measures, the Registers page's neurons over several images."""
from __future__ import annotations

import functools
import os
from dataclasses import astuple, replace
from pathlib import Path

import streamlit as st
import torch

from ..analysis.head_types import HeadTypes
from ..analysis.test_time_registers import RegisterNeurons
from ..model.ablation import HeadSweep
from ..model.capture import Capture
from ..serving.jobs import JobBoard, JobRefused, JobSpec, JobStatus
from ..training.pace import time_left
from . import costs, models, runs
from .images import SHAPE_SAMPLES
from .memo import memo, shared_results
from .selection import ImageSet, Selection

FOLLOW_SECONDS = 1.0  # how often a followed job's place and progress are drawn again
# What each kind of job is doing, for its progress bar (serving.job_kinds.KINDS).
DOING = {
    "head sweep": "knocking out each head in turn", "views": "computing model B's views",
    "rollout": "rolling out the attention through every layer", "head statistics": "measuring every head's distance and entropy",
    "tokens": "reading the images", "head types": "measuring every head on the pictures",
    "register neurons": "looking for the neurons that write the outliers", "patch sizes": "trying every patch size",
    "class embeddings": "writing ImageNet's classes through the text tower", "faithfulness": "removing the patches in each map's order",
    "patching": "running the picture again with one activation patched at a time",
}


@st.cache_resource
def job_board() -> JobBoard:
    """The jobs of every server of this machine: VIT_EXPLORER_JOBS_DIR, else a folder in the runs
    folder, which the replicas share."""
    return JobBoard(Path(os.environ.get("VIT_EXPLORER_JOBS_DIR") or runs.RUNS_DIR / "jobs"))


def _model_source(selection: Selection) -> dict:
    """The selection's model as a job names it; with the mean and std a person chose, if any."""
    kind, _, reference = selection.model_key.partition(":")
    if kind == models.DEFAULT_MODEL:
        source = {"path": str(models.default_weights())}
    else:
        source = {"pretrained": reference} if kind == "pretrained" else {"path": reference}
    if selection.normalization is not None:
        source.update(mean=list(selection.config.mean), std=list(selection.config.std))
    if selection.whole:  # another input than the publisher's: another job (the input travels with it)
        source["whole picture"] = True
    return source


def sweep(selection: Selection, mode: str, ask: bool = False) -> HeadSweep | None:
    """Every head knocked out alone on ``selection``'s image: :meth:`Selection.head_sweep` here if
    it is quick, else :func:`head_sweep` as a job (``ask``: asked for without the button)."""
    if not costs.is_heavy(selection.config, forwards=costs.sweep_forwards(selection.config)):
        return selection.head_sweep(mode)
    return head_sweep(selection, mode, ask)


def head_sweep(selection: Selection, mode: str, ask: bool = False) -> HeadSweep | None:
    """:meth:`Selection.head_sweep` as a job, for a model whose sweep is not quick: the sweep once
    it is done (for anybody), else None, with what to do or how it goes drawn in its place.
    ``ask``: the job is asked for at once, once in this session (a page that poses a question while
    it computes); asked before, then withdrawn or failed, it waits for the button again."""
    key = (*selection.key, "head sweep", mode)
    values = as_job(selection, job_spec(selection, "head sweep", mode=mode), (key,), "Run the sweep", ask=ask)
    return None if values is None else values[0]


def views(selection: Selection, layer: int, label: str) -> Capture | None:
    """What a page draws of ``selection`` computed as a job, for a model whose views are not quick
    (the Compare page's model B at a finer patch size or of a larger kind): :meth:`Selection.capture`,
    its default :meth:`Selection.rollout` and :meth:`Selection.attention` of ``layer``, under their
    keys, so that the page then reads them as it would have computed them; the capture once they
    are there, else None, with what to do or how it goes drawn in its place."""
    keys = (
        (*selection.key, "capture"), (*selection.key, "rollout", "mean", 0.0, None),
        (*selection.key, "attention", layer, None),
    )
    values = as_job(selection, job_spec(selection, "views", layer=layer), keys, label)
    return None if values is None else values[0]


def rollout(selection: Selection, fusion: str, discard: float, label: str) -> torch.Tensor | None:
    """:meth:`Selection.rollout` as a job, for a model whose Attention view with it is heavy: the
    rollout once it is there (for anybody), else None, with what to do or how it goes drawn in its
    place."""
    key = (*selection.key, "rollout", fusion, discard, None)
    values = as_job(selection, job_spec(selection, "rollout", fusion=fusion, discard=discard), (key,), label)
    return None if values is None else values[0]


def head_statistics(selection: Selection, label: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    """:meth:`Selection.head_statistics` as a job, for a model whose Attention view with them is
    heavy: (distances, entropies) once they are there (for anybody), else None, with what to do or
    how it goes drawn in their place."""
    values = as_job(selection, job_spec(selection, "head statistics"), ((*selection.key, "head statistics"),), label)
    return None if values is None else values[0]


def image_tokens(image_set: ImageSet, label: str) -> bool:
    """:meth:`ImageSet.image_tokens` of the images no page has read (:meth:`ImageSet.unread`) as a
    job, in one batch, each image's tokens kept under its key: whether they are all there (else
    what to do or how it goes is drawn in their place)."""
    unread = image_set.unread()
    identity = "\n".join(image_set.image_keys[index] for index in unread)
    spec = job_spec(image_set.selection, "tokens", identity, images=len(unread))
    keys = tuple(image_set.tokens_key(index) for index in unread)
    return as_job(image_set.selection, spec, keys, label, image_set.model_input()[unread]) is not None


def read_set(image_set: ImageSet) -> bool:
    """The set's tokens read (Several images, the Probe page): in the server where that is light
    (costs.set_forwards), else as a job (:func:`image_tokens`) with a sentence on why; whether
    they are all there (else the job's button or progress is drawn in their place)."""
    cost = costs.set_forwards(image_set)
    if costs.is_heavy(image_set.selection.config, forwards=cost):
        st.write(
            f"Pictures no page has read with this model yet: {len(image_set.unread())}, about {cost:.0f} forward"
            " passes. They are read when you ask, beside the server, so that the pages stay quick for everybody,"
            " and then serve everyone."
        )
        if not image_tokens(image_set, "Read the pictures"):
            return False
    image_set.image_tokens()
    return True


def head_types(image_set: ImageSet, label: str) -> HeadTypes | None:
    """:meth:`ImageSet.head_types` as a job (one pass of every image, then every layer's attention
    from their tokens), the tokens of the images no page has read kept under their keys meanwhile,
    so that the page's maps of a head run no pass: the head types once they are there (for anybody),
    else None, with what to do or how it goes drawn in their place."""
    found = image_set.cached_head_types()
    if found is not None:
        return found
    unread = image_set.unread()
    spec = job_spec(
        image_set.selection, "head types", "\n".join(image_set.image_keys), images=len(image_set.image_keys), kept=unread,
    )
    keys = (*(image_set.tokens_key(index) for index in unread), (*image_set.key, "head types"))
    values = as_job(image_set.selection, spec, keys, label, image_set.model_input())
    return None if values is None else values[-1]


def register_neurons(selection: Selection, layer: int, k: float, last: int | None, label: str) -> RegisterNeurons | None:
    """:meth:`Selection.register_neurons` on this image and the bundled photos as a job, for a model
    whose search over them is heavy: the neurons once found (for anybody), else None, with what to
    do or how it goes drawn in their place."""
    x = selection.with_photos()
    spec = job_spec(selection, "register neurons", layer=layer, k=k, last=last, images=len(x))
    values = as_job(selection, spec, ((*selection.key, "register neurons", layer, k, True, last),), label, x)
    return None if values is None else values[0]


def patch_size_job(selection: Selection, label: str) -> list[dict] | None:
    """:func:`costs.compare_patch_sizes` as a job (vit_explorer.serving.jobs' "patch sizes", on the plan made
    here), for a model whose comparison is heavy: its rows and held-out accuracy go into memo under
    the keys the comparison in the server uses. The rows once they are there (for anybody), else
    None, with the button ``label`` to ask for them or how the job goes drawn in their place."""
    config = selection.base_model.config
    native = replace(selection, patch_size=config.patch_size, model=selection.base_model)
    forward_ms = shared_results().get(costs.forward_ms_key(selection))
    held_out = costs.has_held_out(config) and costs.held_out_key(selection) not in shared_results()
    cost = costs.comparison_cost(selection)
    spec = job_spec(
        native, "patch sizes", forwards=cost,
        plan=[astuple(planned) for planned in costs.comparison_plan(config, timed=forward_ms is None)],
        forward_ms=None if forward_ms is None else sorted(forward_ms.items()),
        image_share=costs.patch_size_comparison_cost(config, timed=forward_ms is None) / max(cost, 1e-9),
        held_out=[costs.HELD_OUT_IMAGES, SHAPE_SAMPLES] if held_out else None,
        held_out_plan=[astuple(planned) for planned in costs.comparison_plan(config, held_out=True)] if held_out else None,
    )
    keys = (costs.rows_key(selection), *([costs.held_out_key(selection)] if held_out else []))
    if as_job(native, spec, keys, label) is None:
        return None
    return costs.compare_patch_sizes(selection, run=False)


def job_spec(selection: Selection, kind: str, identity: str | None = None, **settings) -> JobSpec:
    """``kind`` on ``selection``'s model at its sizes, for its image unless ``identity`` says what
    the input is."""
    return JobSpec(
        kind, _model_source(selection), selection.patch_size, selection.config.img_size,
        selection.image_key if identity is None else identity, settings,
    )


def as_job(
    selection: Selection, spec: JobSpec, keys: tuple[tuple, ...], label: str, x: torch.Tensor | None = None,
    ask: bool = False,
) -> tuple | None:
    """The job's values, kept under ``keys`` (one each), once done; else None, with the button
    to ask for it (for the input ``x``: by default the selection's image) or its progress.
    ``ask``: asked for without the button, the first time this session meets it."""
    found = tuple(shared_results().get(key) for key in keys)
    if all(value is not None for value in found):
        return found
    board = job_board()
    status = board.status(spec.key)
    if status is not None and status.state == "done":
        return _kept(spec.key, keys)
    forwards, _ = board.estimate(spec, selection.config)
    token = st.session_state.get("owner_token")
    asked = status is not None and status.state != "failed" and token in status.owners
    if status is not None and status.state == "failed":
        st.error(status.error)
    asked_before = st.session_state.setdefault("jobs asked at once", set())
    if not asked and ask and spec.key not in asked_before and (status is None or status.state != "failed"):
        asked_before.add(spec.key)  # once: withdrawn or failed, it waits for the button
        status = _submit(board, spec, selection, x)
        if status is None:
            return None
        asked = True
    if not asked:
        joining = status is not None and status.state != "failed"
        if st.button(  # keyed by the job: a page may draw several (the Attention page: three)
            "Ask for it too" if joining else label, icon=":material/play_arrow:", key=f"ask_job_{spec.key}",
            help=(
                "Somebody is computing this already: ask for it too, and it goes on should they cancel."
                if joining else
                f"About {forwards:.0f} forward passes, computed beside the server (one at a time, in turn),"
                " shared with everyone."
            ),
        ):
            if _submit(board, spec, selection, x) is not None:
                st.rerun()  # drawn again as asked: the button gone, the job followed
            return None
    if status is not None and status.state in ("queued", "running"):
        _follow(spec.key, keys, costs.pass_times().seconds(selection.config))
    return None


def _submit(board: JobBoard, spec: JobSpec, selection: Selection, x: torch.Tensor | None) -> JobStatus | None:
    """Ask for the job for this person; its status, or None with the refusal said."""
    try:
        return board.submit(spec, selection.model_input() if x is None else x, selection.config, runs.owner_token())
    except JobRefused as refusal:
        st.error(str(refusal))
        return None


def _kept(job_key: str, keys: tuple[tuple, ...]) -> tuple:
    """A done job's values, each kept in ``memo`` under its key (read from its files once)."""
    result = functools.cache(lambda: job_board().result(job_key))
    return tuple(memo(key, lambda index=index: result()[index]) for index, key in enumerate(keys))


@st.fragment(run_every=FOLLOW_SECONDS)
def _follow(job_key: str, keys: tuple[tuple, ...], pass_seconds: float | None = None) -> None:
    """The job's place in the queue or its progress (and the time left, from ``pass_seconds``: a
    pass of its model timed on this server), and Cancel for those who asked; the whole page again
    once it has ended (its results, or why not)."""
    status = job_board().status(job_key)
    if status is None or status.state in ("done", "failed"):
        if status is not None and status.state == "done":
            _kept(job_key, keys)
        st.rerun()
    _draw(status, pass_seconds)
    token = st.session_state.get("owner_token")
    if token in status.owners and st.button(
        "Cancel", icon=":material/stop:", key=f"cancel_job_{job_key}",
        help="Withdraw your ask: it stops unless somebody else asked for it too.",
    ):
        job_board().cancel(job_key, token)
        st.rerun()


def _draw(status: JobStatus, pass_seconds: float | None = None) -> None:
    if status.state == "queued":
        st.info(
            f"Waiting for its turn: {status.waiting}. Heavy computations run one after another beside the"
            " server, so that the pages stay quick for everybody."
        )
    else:
        doing = DOING.get(status.kind, "computing")
        seconds_left = status.seconds_left
        if seconds_left is None and pass_seconds is not None:  # before the worker's own pace: its passes left
            seconds_left = (1 - status.progress) * status.forwards * pass_seconds
        st.progress(status.progress, text=(
            f"Computing beside the server: {status.progress:.0%}{time_left(seconds_left)} ({doing})"
        ))
