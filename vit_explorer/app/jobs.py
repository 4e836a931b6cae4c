"""A view's heavy computation as a job (vit_explorer.jobs): asked for with a button, followed live
(place in the queue, a progress bar, Cancel), its result shared with everybody through ``memo``
under the key the inline computation uses."""
from __future__ import annotations

import os
from pathlib import Path

import streamlit as st

from ..ablation import HeadSweep
from ..jobs import JobBoard, JobRefused, JobSpec, JobStatus
from . import models, runs
from .memo import memo, shared_results
from .selection import Selection

FOLLOW_SECONDS = 1.0  # how often a followed job's place and progress are drawn again


@st.cache_resource
def job_board() -> JobBoard:
    """The jobs of every server of this machine: VIT_EXPLORER_JOBS_DIR, else a folder in the runs
    folder, which the replicas share."""
    return JobBoard(Path(os.environ.get("VIT_EXPLORER_JOBS_DIR") or runs.RUNS_DIR / "jobs"))


def _model_source(model_key: str) -> dict:
    kind, _, reference = model_key.partition(":")
    if kind == models.DEFAULT_MODEL:
        return {"path": str(models.default_weights())}
    return {"pretrained": reference} if kind == "pretrained" else {"path": reference}


def head_sweep(selection: Selection, mode: str) -> HeadSweep | None:
    """:meth:`Selection.head_sweep` as a job, for a model whose sweep is not quick: the sweep once
    it is done (for anybody), else None, with what to do or how it goes drawn in its place."""
    spec = JobSpec(
        "head sweep", _model_source(selection.model_key), selection.patch_size, selection.config.img_size,
        selection.image_key, {"mode": mode},
    )
    return _as_job(selection, spec, (*selection.key, "head sweep", mode), "Run the sweep")


def _as_job(selection: Selection, spec: JobSpec, key: tuple, label: str):
    if key in shared_results():
        return shared_results().get(key)
    board = job_board()
    status = board.status(spec.key)
    if status is not None and status.state == "done":
        return memo(key, lambda: board.result(spec.key))
    forwards, _ = board.estimate(spec, selection.config)
    token = st.session_state.get("owner_token")
    asked = status is not None and status.state != "failed" and token in status.owners
    if status is not None and status.state == "failed":
        st.error(status.error)
    if not asked:
        joining = status is not None and status.state != "failed"
        if st.button(
            "Ask for it too" if joining else label, icon=":material/play_arrow:",
            help=(
                "Somebody is computing this already: ask for it too, and it goes on should they cancel."
                if joining else
                f"About {forwards:.0f} forward passes, computed beside the server (one at a time, in turn),"
                " shared with everyone."
            ),
        ):
            try:
                board.submit(spec, selection.model_input(), selection.config, runs.owner_token())
            except JobRefused as refusal:
                st.error(str(refusal))
                return None
            st.rerun()  # drawn again as asked: the button gone, the job followed
    if status is not None and status.state in ("queued", "running"):
        _follow(spec.key, key)
    return None


@st.fragment(run_every=FOLLOW_SECONDS)
def _follow(job_key: str, key: tuple) -> None:
    """The job's place in the queue or its progress, and Cancel for those who asked; the whole page
    again once it has ended (its result, or why not)."""
    status = job_board().status(job_key)
    if status is None or status.state in ("done", "failed"):
        if key not in shared_results() and status is not None and status.state == "done":
            memo(key, lambda: job_board().result(job_key))
        st.rerun()
    _draw(status)
    token = st.session_state.get("owner_token")
    if token in status.owners and st.button(
        "Cancel", icon=":material/stop:", key=f"cancel_job_{job_key}",
        help="Withdraw your ask: it stops unless somebody else asked for it too.",
    ):
        job_board().cancel(job_key, token)
        st.rerun()


def _draw(status: JobStatus) -> None:
    if status.state == "queued":
        st.info(
            f"Waiting for its turn: {status.waiting}. Heavy computations run one after another beside the"
            " server, so that the pages stay quick for everybody."
        )
    else:
        st.progress(status.progress, text=f"Computing beside the server: {status.progress:.0%}")
