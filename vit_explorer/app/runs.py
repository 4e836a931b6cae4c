"""This server's training runs as a person sees them: the shared RunManager, the owner token that
the page address carries, starting and stopping one's own runs, and keeping one's dictionary for
everyone."""
from __future__ import annotations

import secrets
from pathlib import Path

import streamlit as st

from .. import resources
from ..model.config import TrainConfig
from ..training.run import TrainingRun
from ..training.runs import RunManager, run_record

OWNER_PARAM = "owner"  # the address parameter that keeps a person's owner token
# Where runs trained in the app write their checkpoints.
RUNS_DIR = resources.default_runs_dir()


@st.cache_resource
def run_manager() -> RunManager:
    """The server's runs: each trains in its own process; ended ones are found in RUNS_DIR again."""
    return RunManager(RUNS_DIR)


def training_runs() -> dict[str, TrainingRun]:
    """Every run of this server by id, launched, waiting or found in the runs folder."""
    return run_manager().runs()


def owner_token() -> str:
    """This person's token, created when they first launch a run: kept in the session and in the
    page's address (session.keep_in_address), so that neither moving between pages nor a reload
    takes their runs from them."""
    state = st.session_state
    if "owner_token" not in state:
        state["owner_token"] = secrets.token_urlsafe(12)
        st.query_params[OWNER_PARAM] = state["owner_token"]
    return state["owner_token"]


def start_run(config: TrainConfig) -> str:
    """Launch ``config`` for this person (it starts now or waits its turn); its id.

    Raises admission.RunRefused with the sentence to show when the server cannot take it.
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


def keep_run(run_id: str) -> None:
    """Offer this person's ended SAE run's dictionary to everyone on the Features page."""
    token = st.session_state.get("owner_token")
    if token is not None:
        run_manager().keep(run_id, token)


def dictionary_owner(path: Path) -> dict | None:
    """Whose a dictionary in the runs folder is: {"number", "kept", "mine"} of the app's run that
    wrote it; None for any other file (shipped, or trained with the command line), which is everyone's."""
    record = run_record(path) if path.parent == RUNS_DIR else None
    if record is None:
        return None
    return {"number": record["number"], "kept": record["kept"],
            "mine": record["owner"] == st.session_state.get("owner_token")}


def active_runs() -> dict[str, TrainingRun]:
    return run_manager().running()
