"""A model that would not fit the shared models' budget is refused in a sentence before it is
loaded or downloaded, and the model in use stays."""

from apptest import errors, open_app, tiny_default, tiny_model, uploader  # noqa: F401 (tiny_default: autouse)
from textmodels import SMALL_CLIP, open_clip_folder

import vit_explorer as vx
from vit_explorer.app import models, uploads


def test_an_upload_over_the_budget_is_refused_before_it_loads(monkeypatch, tmp_path):
    app = open_app()
    model_key = app.session_state["model_key"]
    path = tmp_path / "wide.safetensors"
    vx.save_model(tiny_model(embed_dim=128), path)  # 3.2 MB in float32
    monkeypatch.setattr(models, "MODELS_BYTES", 2**20)
    monkeypatch.setattr(models, "load_model", lambda *args, **kwargs: loaded.append(args))
    loaded = []
    uploader(app, "checkpoint_upload").set_value((path.name, path.read_bytes(), "application/octet-stream")).run()
    assert not app.exception
    assert errors(app) == [
        "Could not load that model: this model holds 3 MB of weights in float32, more than the 1 MB this server"
        " keeps for its shared models; choose a smaller model, or raise VIT_EXPLORER_MODELS_MB where the machine"
        " has the memory."
    ]
    assert loaded == [] and app.session_state["model_key"] == model_key
    assert [path for path in uploads.UPLOADS_DIR.iterdir()] == []  # nothing of it kept


def test_a_catalogue_model_over_the_budget_is_refused_before_its_download(monkeypatch):
    downloads = []
    monkeypatch.setattr(models, "MODELS_BYTES", 64 * 2**20)
    monkeypatch.setattr(models.catalogue, "is_downloaded", lambda name: False)
    monkeypatch.setattr(models.catalogue, "download", lambda *args: downloads.append(args))
    assert models.select_model("pretrained:dino_vitb16") == (
        "Could not load that model: this model holds 327 MB of weights in float32, more than the 64 MB this server"
        " keeps for its shared models; choose a smaller model, or raise VIT_EXPLORER_MODELS_MB where the machine"
        " has the memory"
    )
    assert downloads == []
    assert models.memory_note("dino_vitb16") == "about 343 MB in memory once loaded"


def test_model_b_over_the_budget_is_refused_before_its_download_and_a_stays(monkeypatch):
    downloads = []
    monkeypatch.setattr(models.catalogue, "is_downloaded", lambda name: False)
    monkeypatch.setattr(models.catalogue, "download", lambda *args: downloads.append(args))
    app = open_app("views/compare.py")
    app.selectbox(key="compare_model").set_value("pretrained:dino_vits16").run()
    monkeypatch.setattr(models, "MODELS_BYTES", 64 * 2**20)
    next(button for button in app.button if button.label.startswith("Download DINO")).click().run()
    assert not app.exception and downloads == []
    assert errors(app) == [
        "Could not load model B, model A stays as it is: this model holds 83 MB of weights in float32, more than the"
        " 64 MB this server keeps for its shared models; choose a smaller model, or raise VIT_EXPLORER_MODELS_MB"
        " where the machine has the memory"
    ]
    assert app.session_state["model_key"] == "default"


def test_a_text_tower_that_would_not_fit_beside_its_image_tower_is_refused_before_it_is_read(monkeypatch, tmp_path):
    """SMALL_CLIP's text tower is mostly its 49,408 x 32 token embedding: 6 MB; its image tower 0.4 MB."""
    open_clip_folder(tmp_path / "clip", SMALL_CLIP)
    app = open_app()
    model_key = app.session_state["model_key"]
    monkeypatch.setattr(models, "MODELS_BYTES", 4 * 2**20)
    read = []
    monkeypatch.setattr(uploads, "load_image_text_model", lambda *args, **kwargs: read.append(args))
    files = [(path.name, path.read_bytes(), "application/octet-stream") for path in sorted((tmp_path / "clip").iterdir())]
    uploader(app, "checkpoint_upload").set_value(files).run()
    assert not app.exception and read == []
    assert errors(app) == [
        "Could not load that model: its text tower holds 6 MB of weights in float32 (7 MB with the image tower it"
        " goes with), more than the 4 MB this server keeps for its shared models; choose a smaller model, or raise"
        " VIT_EXPLORER_MODELS_MB where the machine has the memory."
    ]
    assert app.session_state["model_key"] == model_key and list(uploads.UPLOADS_DIR.iterdir()) == []
