"""A teacher's first hour (issue 47): a CLIP as the server's default model (an open_clip or a
Hugging Face folder, or the open_clip file inside one), an uploaded open_clip folder that
survives a reload, and a README whose page table knows every page of the navigation."""
import re
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from vit_explorer.app import models, session, words
from vit_explorer.weights import from_open_clip

from apptest import APP, errors, open_app, tiny_default, uploader  # noqa: F401 (tiny_default: autouse)
from textmodels import SMALL_CLIP, hf_clip_folder, open_clip_folder

ROOT = Path(__file__).resolve().parents[2]
TINY_HF_VISION = {"image_size": 32, "patch_size": 8, "hidden_size": 32, "intermediate_size": 64,
                  "num_hidden_layers": 2, "num_attention_heads": 2}


def clip_folder(tmp_path: Path, kind: str) -> Path:
    if kind == "open_clip":
        open_clip_folder(tmp_path / "clip", SMALL_CLIP)
    else:
        hf_clip_folder(tmp_path / "clip", text={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                                                "num_attention_heads": 2}, vision=TINY_HF_VISION, projection_dim=16)
    return tmp_path / "clip"


@pytest.mark.parametrize("kind, point_at", [("open_clip", "folder"), ("open_clip", "weights file"), ("hugging_face", "folder")])
def test_a_clip_folder_is_the_servers_default_model_with_its_words(tmp_path, monkeypatch, kind, point_at):
    folder = clip_folder(tmp_path, kind)
    target = folder / from_open_clip.WEIGHTS_FILE if point_at == "weights file" else folder
    monkeypatch.setenv("VIT_EXPLORER_DEFAULT_MODEL", str(target))
    app = open_app("views/pipeline.py")
    assert errors(app) == [] and app.session_state["model_key"] == models.DEFAULT_MODEL
    assert models.base_model(models.DEFAULT_MODEL).config.num_classes == 0  # the image tower
    assert words.words_model(models.DEFAULT_MODEL) is not None  # and its words beside it
    assert app.text_input(key=words.LABELS_WIDGET)  # the labels box: the class opens on CLIP's words


def folder_files(folder: Path) -> list[tuple[str, bytes, str]]:
    return [(path.name, path.read_bytes(), "application/octet-stream") for path in sorted(folder.iterdir())]


def test_an_uploaded_open_clip_folder_survives_a_reload(tmp_path):
    app = open_app("views/pipeline.py")
    uploader(app, "checkpoint_upload").set_value(folder_files(clip_folder(tmp_path, "open_clip"))).run()
    assert errors(app) == []
    model_key, address = app.session_state["model_key"], app.query_params[session.MODEL_PARAM]
    assert address.startswith("upload:")
    again = AppTest.from_file(APP, default_timeout=60)
    again.query_params[session.MODEL_PARAM] = address
    again.run()
    assert not again.exception and errors(again) == []
    assert again.session_state["model_key"] == model_key
    assert again.query_params[session.MODEL_PARAM] == address


def test_the_readmes_page_table_lists_every_page_of_the_navigation():
    import ast

    from vit_explorer.app import lesson

    calls = [node for node in ast.walk(ast.parse((ROOT / "app.py").read_text())) if isinstance(node, ast.Call)]
    titles = [keyword.value.value for call in calls if getattr(call.func, "attr", None) == "Page"
              for keyword in call.keywords if keyword.arg == "title"]
    readme = (ROOT / "README.md").read_text()
    rows = readme[readme.index("| page | what it shows |"):].split("\n\n")[0].splitlines()[2:]
    table = [row.split(" | ")[0].removeprefix("| ") for row in rows]
    assert len(titles) > 10 and sorted(table) == sorted(titles)
    numbers = dict(enumerate("zero one two three four five six seven eight nine ten eleven twelve thirteen".split()))
    assert f"| Lesson | {numbers[len(lesson.STEPS)]} steps" in readme


def test_the_labels_survive_a_reload_and_travel_in_a_link(tmp_path, monkeypatch):
    """Labels typed once are in the address: a reload (or a link a teacher sends the class) scores
    the same labels; labels in an address are checked as if typed."""
    monkeypatch.setenv("VIT_EXPLORER_DEFAULT_MODEL", str(clip_folder(tmp_path, "open_clip")))
    app = open_app("views/pipeline.py")
    app.text_input(key=words.LABELS_WIDGET).set_value("a cat, a dog, a rocket").run()
    assert app.query_params[session.LABELS_PARAM] == "a cat, a dog, a rocket"
    again = AppTest.from_file(APP, default_timeout=60)
    again.query_params[session.LABELS_PARAM] = app.query_params[session.LABELS_PARAM]
    again.switch_page("views/pipeline.py").run()
    assert not again.exception and errors(again) == []
    assert again.session_state[words.LABELS] == ("a cat", "a dog", "a rocket")
    assert any("The model says" in markdown.value for markdown in again.markdown)
    hostile = AppTest.from_file(APP, default_timeout=60)
    hostile.query_params[session.LABELS_PARAM] = "x" * 5000
    hostile.switch_page("views/pipeline.py").run()
    assert not hostile.exception and hostile.session_state.get(words.LABELS) is None
    assert any("were not taken" in error.value for error in hostile.sidebar.error)
