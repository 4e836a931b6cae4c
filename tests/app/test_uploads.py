"""Uploads on a shared class server: a folder of the server's own, trimmed without following
links, bad uploads refused without a trace on disk, and no upload's bytes kept in memory."""
import gc
import io
import json
import os
import weakref
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from streamlit.runtime.scriptrunner import get_script_run_ctx
from apptest import PHOTO, errors, open_app, tiny_default, tiny_model, uploader  # noqa: F401 (tiny_default: autouse)
from textmodels import SMALL_CLIP, open_clip_folder, siglip_folder

import vit_explorer as vx
from vit_explorer.app import images, models, uploads
from vit_explorer.serving.cache import disk_bytes, trim_to_quota


def someone_elses_folder(root: Path) -> dict[str, bytes]:
    """A folder outside the uploads with files and a sub-folder; returns what it holds."""
    (root / "sub").mkdir(parents=True)
    for name in ("notes.txt", "thesis.pdf", "sub/data.csv"):
        (root / name).write_bytes(name.encode() * 100)
    return contents(root)


def contents(root: Path) -> dict[str, bytes]:
    return {str(path.relative_to(root)): path.read_bytes() for path in sorted(root.rglob("*")) if path.is_file()}


def png(index: int = 0, padding: int = 0) -> bytes:
    buffer = io.BytesIO()
    vx.data.datasets.shapes_sample(index, 32)[0].save(buffer, format="PNG")
    return buffer.getvalue() + b"\0" * padding  # PIL reads past trailing bytes


def checkpoint_upload(tmp_path: Path, **changes) -> tuple[str, bytes, str]:
    path = tmp_path / "other.safetensors"
    vx.save_model(tiny_model(**changes), path)
    return path.name, path.read_bytes(), "application/octet-stream"


# --- the folder --------------------------------------------------------------------------------


def test_trimming_removes_links_themselves_and_never_what_they_point_to(tmp_path):
    outside = someone_elses_folder(tmp_path / "outside")
    uploads = tmp_path / "uploads"
    uploads.mkdir()
    (uploads / "linked-folder").symlink_to(tmp_path / "outside")
    (uploads / "linked-file").symlink_to(tmp_path / "outside" / "thesis.pdf")
    (uploads / "old-upload").mkdir()
    (uploads / "old-upload" / "model.safetensors").write_bytes(b"x" * 500)
    (uploads / "old-upload" / "config.json").symlink_to(tmp_path / "outside" / "sub")
    for age, name in enumerate(["old-upload", "linked-file", "linked-folder"]):
        os.utime(uploads / name, (100 + age, 100 + age), follow_symlinks=False)
    (uploads / "new").write_bytes(b"x" * 500)
    # A link counts as itself: the folder it points to is not part of the uploads.
    assert disk_bytes(uploads / "linked-folder") < 200
    assert disk_bytes(uploads / "old-upload") < 700
    removed = trim_to_quota(uploads, 500, keep={uploads / "new"})
    assert sorted(path.name for path in removed) == ["linked-file", "linked-folder", "old-upload"]
    assert [path.name for path in uploads.iterdir()] == ["new"]
    assert contents(tmp_path / "outside") == outside


def test_a_linked_uploads_folder_is_never_trimmed(tmp_path):
    outside = someone_elses_folder(tmp_path / "outside")
    (tmp_path / "uploads").symlink_to(tmp_path / "outside")
    with pytest.raises(ValueError, match="symbolic link"):
        trim_to_quota(tmp_path / "uploads", 0)
    assert contents(tmp_path / "outside") == outside


def test_the_default_uploads_folder_is_in_the_users_cache_not_the_temp_directory(monkeypatch, tmp_path):
    monkeypatch.delenv("VIT_EXPLORER_UPLOADS_DIR", raising=False)
    monkeypatch.delenv("VIT_EXPLORER_CACHE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert uploads.default_uploads_dir() == tmp_path / "home" / ".cache" / "vit_explorer" / "uploads"
    monkeypatch.setenv("VIT_EXPLORER_CACHE", str(tmp_path / "cache"))
    assert uploads.default_uploads_dir() == tmp_path / "cache" / "uploads"
    monkeypatch.setenv("VIT_EXPLORER_UPLOADS_DIR", str(tmp_path / "mine"))
    assert uploads.default_uploads_dir() == tmp_path / "mine"


def test_the_uploads_folder_is_created_private_and_refused_unless_it_is_the_servers_own(monkeypatch, tmp_path):
    monkeypatch.setattr(uploads, "UPLOADS_DIR", tmp_path / "cache" / "uploads")
    assert uploads.uploads_folder() == tmp_path / "cache" / "uploads"
    assert (tmp_path / "cache" / "uploads").stat().st_mode & 0o777 == 0o700
    (tmp_path / "cache" / "uploads").chmod(0o777)
    with pytest.raises(uploads.UnsafeUploadsFolder, match="is writable by other users; set VIT_EXPLORER_UPLOADS_DIR"):
        uploads.uploads_folder()
    (tmp_path / "cache" / "uploads").chmod(0o700)
    monkeypatch.setattr(os, "getuid", lambda: os.stat(tmp_path).st_uid + 1)
    with pytest.raises(uploads.UnsafeUploadsFolder, match="belongs to another user"):
        uploads.uploads_folder()


def test_an_upload_into_a_linked_folder_is_refused_and_touches_nothing_there(monkeypatch, tmp_path):
    outside = someone_elses_folder(tmp_path / "outside")
    (tmp_path / "linked").symlink_to(tmp_path / "outside")
    monkeypatch.setattr(uploads, "UPLOADS_DIR", tmp_path / "linked")
    app = open_app("views/pipeline.py")
    uploader(app, "image_upload").set_value(("cat.png", PHOTO.read_bytes(), "image/png")).run()
    assert not app.exception
    assert errors(app) == [
        f"Uploads are off: the uploads folder {tmp_path / 'linked'} is a symbolic link; set"
        " VIT_EXPLORER_UPLOADS_DIR to a private folder of the user running this server."
    ]
    assert app.session_state["image_key"] == images.DEFAULT_IMAGE
    assert contents(tmp_path / "outside") == outside


# --- memory -------------------------------------------------------------------------------------


def test_the_image_uploader_takes_images_only_within_their_own_limit():
    app = open_app()
    image = uploader(app, "image_upload")
    assert image.proto.max_upload_size_mb == uploads.IMAGE_UPLOAD_MB < 100
    assert image.allowed_type == [f".{kind}" for kind in uploads.IMAGE_TYPES]
    assert {".png", ".jpg", ".jpeg", ".webp"} <= set(image.allowed_type)
    assert uploader(app, "checkpoint_upload").proto.max_upload_size_mb == 1024  # config.toml


@pytest.mark.parametrize("kind", ["accepted image", "oversize image", "refused checkpoint"])
def test_a_handled_upload_leaves_no_bytes_in_the_server(monkeypatch, kind):
    """Streamlit's upload manager holds a file until its session shuts down, and a session whose
    browser left expires without shutting down; the uploader's value holds it too."""
    monkeypatch.setattr(uploads, "IMAGE_UPLOAD_MB", 1)
    handled = []

    def recording(handler):
        def handle(upload):
            ctx = get_script_run_ctx()
            files = upload if isinstance(upload, list) else [upload]
            handled.extend((ctx.uploaded_file_mgr, ctx.session_id, file.file_id, weakref.ref(file)) for file in files)
            return handler(upload)
        return handle

    monkeypatch.setattr(uploads, "add_image_upload", recording(uploads.add_image_upload))
    monkeypatch.setattr(uploads, "add_checkpoint_upload", recording(uploads.add_checkpoint_upload))
    upload = {
        "accepted image": ("image_upload", ("cat.png", PHOTO.read_bytes(), "image/png")),
        "oversize image": ("image_upload", ("big.png", png(padding=2**21), "image/png")),
        "refused checkpoint": ("checkpoint_upload", ("broken.pth", b"\0" * 2**20, "application/octet-stream")),
    }
    widget_key, files = upload[kind]
    app = open_app()
    uploader(app, widget_key).set_value(files).run()
    assert not app.exception and len(handled) == 1
    assert (errors(app) == []) == (kind == "accepted image")
    (manager, session_id, file_id, file) = handled[0]
    assert manager.get_files(session_id, [file_id]) == []
    gc.collect()
    assert file() is None  # nothing holds the uploaded file any more
    assert uploader(app, widget_key).value in (None, [])  # the uploader starts empty


# --- open_clip folders (both towers) ------------------------------------------------------------


def folder_files(folder: Path) -> list[tuple[str, bytes, str]]:
    return [(path.name, path.read_bytes(), "application/octet-stream") for path in sorted(folder.iterdir())]


def open_clip_upload(tmp_path: Path, kind: str) -> Path:
    """A small CLIP's or SigLIP's open_clip folder (SigLIP's with its tokenizer's files)."""
    if kind == "clip":
        open_clip_folder(tmp_path / "clip", SMALL_CLIP)
        return tmp_path / "clip"
    folder = siglip_folder(tmp_path / "siglip")
    (folder / "special_tokens_map.json").write_text(json.dumps({"eos_token": "</s>", "pad_token": "<pad>"}))
    return folder


@pytest.mark.parametrize("kind", ["clip", "siglip"])
def test_an_open_clip_folder_is_kept_as_a_folder_and_selected_with_both_towers(tmp_path, kind):
    from vit_explorer.text import load_image_text_model

    folder = open_clip_upload(tmp_path, kind)
    app = open_app("views/attention.py")
    uploader(app, "checkpoint_upload").set_value(folder_files(folder)).run()
    assert not app.exception and errors(app) == []
    model_key = app.session_state["model_key"]
    kept = Path(model_key.removeprefix("file:"))
    assert model_key.startswith("file:") and kept.parent == uploads.UPLOADS_DIR and kept.is_dir()
    assert contents(kept) == contents(folder)
    names = ", ".join(path.name for path in sorted(folder.iterdir()))
    assert app.session_state["uploaded_models"][model_key] == f"Uploaded: {names}"
    assert models.base_model(model_key).config.num_classes == 0  # the image tower, headless
    words = load_image_text_model(kept, image=models.base_model(model_key))
    assert words.scoring == ("softmax" if kind == "clip" else "sigmoid")


@pytest.mark.parametrize("kind, expected", [
    ("open_clip folder whose tokenizer is not one", "Could not load that model: the upload's tokenizer.json is not a tokenizer we can read"),
    ("open_clip folder whose text tower does not fit", "Could not load that model: the upload's text_cfg says 3 layers, but its file holds 2."),
    ("open_clip folder without its weights", "An open_clip model needs its open_clip_model.safetensors beside its open_clip_config.json."),
    ("open_clip folder with another file", "An open_clip model's upload takes open_clip_config.json, open_clip_model.safetensors and its"
                                           " tokenizer's files (tokenizer.json, tokenizer_config.json, special_tokens_map.json), not pytorch_model.bin."),
])
def test_a_bad_open_clip_folder_says_what_is_wrong(tmp_path, kind, expected):
    app = open_app()
    uploader(app, "checkpoint_upload").set_value(bad_upload(kind, tmp_path)).run()
    (error,) = errors(app)
    assert error.startswith(expected), error
    assert app.session_state["model_key"] == "default"
    assert not uploads.UPLOADS_DIR.exists() or list(uploads.UPLOADS_DIR.iterdir()) == []


def test_the_checkpoint_uploader_names_open_clip_folders():
    app = open_app()
    assert "open_clip_config.json" in uploader(app, "checkpoint_upload").label


# --- bad uploads ----------------------------------------------------------------------------------


# Kind of bad upload -> its uploader.
BAD_UPLOADS = {
    "not a ViT": "checkpoint_upload",
    "hostile Hugging Face folder": "checkpoint_upload",
    "open_clip folder whose tokenizer is not one": "checkpoint_upload",
    "open_clip folder whose text tower does not fit": "checkpoint_upload",
    "open_clip folder without its weights": "checkpoint_upload",
    "open_clip folder with another file": "checkpoint_upload",
    "not an image": "image_upload",
    "oversize image": "image_upload",
}


def bad_open_clip_upload(kind: str, tmp_path: Path) -> list[tuple[str, bytes, str]]:
    if kind == "open_clip folder whose tokenizer is not one":
        folder = open_clip_upload(tmp_path / "bad", "siglip")
        (folder / "tokenizer.json").write_text(json.dumps({"model": {"type": "Nonsense"}}))
    elif kind == "open_clip folder whose text tower does not fit":
        folder = open_clip_upload(tmp_path / "bad", "clip")
        config = json.loads((folder / "open_clip_config.json").read_text())
        config["model_cfg"]["text_cfg"]["layers"] = 3  # the weights have 2
        (folder / "open_clip_config.json").write_text(json.dumps(config))
    else:
        folder = open_clip_upload(tmp_path / "bad", "clip")
        if kind == "open_clip folder without its weights":
            (folder / "open_clip_model.safetensors").unlink()
        else:
            (folder / "pytorch_model.bin").write_bytes(b"\0" * 100)
    return folder_files(folder)


def bad_upload(kind: str, tmp_path: Path) -> list[tuple[str, bytes, str]]:
    if kind.startswith("open_clip folder"):
        return bad_open_clip_upload(kind, tmp_path)
    tensors = tmp_path / "tensors.safetensors"
    save_file({"foo.weight": torch.zeros(2000)}, tensors)
    return {
        "not a ViT": [("weights.safetensors", tensors.read_bytes(), "application/octet-stream")],
        "hostile Hugging Face folder": [
            ("config.json", json.dumps(["not", "a", "config"]).encode(), "application/json"),
            ("model.safetensors", tensors.read_bytes(), "application/octet-stream"),
        ],
        "not an image": [("notes.png", b"just some text " * 1000, "image/png")],
        "oversize image": [("big.png", png(padding=3 * 2**19), "image/png")],
    }[kind]


@pytest.mark.parametrize("kind", BAD_UPLOADS)
def test_a_bad_upload_keeps_the_model_and_image_says_why_and_leaves_nothing(monkeypatch, tmp_path, kind):
    monkeypatch.setattr(uploads, "IMAGE_UPLOAD_MB", 1)
    app = open_app("views/attention.py")
    uploader(app, "checkpoint_upload").set_value(checkpoint_upload(tmp_path)).run()
    app.selectbox(key="image_picker").set_value("photo:chelsea.png").run()
    model_key, image_key = app.session_state["model_key"], app.session_state["image_key"]
    assert errors(app) == [] and model_key.startswith("file:")
    kept = contents(uploads.UPLOADS_DIR)
    # Room for what is kept and little more: a bad upload must not make room for itself.
    monkeypatch.setattr(uploads, "UPLOADS_QUOTA_BYTES", disk_bytes(uploads.UPLOADS_DIR) + 1000)
    files = bad_upload(kind, tmp_path)
    uploader(app, BAD_UPLOADS[kind]).set_value(files if len(files) > 1 else files[0]).run()
    assert not app.exception
    (error,) = errors(app)
    assert "\n" not in error and error.endswith("."), error
    assert (app.session_state["model_key"], app.session_state["image_key"]) == (model_key, image_key)
    assert contents(uploads.UPLOADS_DIR) == kept
    assert [path.name for path in uploads.UPLOADS_DIR.iterdir() if path.name.startswith(".")] == []


def test_an_oversize_image_is_refused_before_it_is_decoded(monkeypatch):
    monkeypatch.setattr(uploads, "IMAGE_UPLOAD_MB", 1)
    decoded = []
    monkeypatch.setattr(uploads, "load_image", lambda data: decoded.append(data))
    app = open_app()
    uploader(app, "image_upload").set_value(("big.png", png(padding=2**21), "image/png")).run()
    assert errors(app) == ["big.png is 2.0 MB, more than the 1 MB this app takes for an image."]
    assert decoded == []


# --- uploads removed by the quota ------------------------------------------------------------


def test_a_checkpoint_removed_by_the_quota_says_so_and_leaves_the_picker(monkeypatch, tmp_path):
    app = open_app("views/attention.py")
    uploader(app, "checkpoint_upload").set_value(checkpoint_upload(tmp_path)).run()
    model_key = app.session_state["model_key"]
    assert errors(app) == [] and model_key.startswith("file:")
    # Room for the checkpoint or a picture, not both: the picture pushes the checkpoint out.
    monkeypatch.setattr(uploads, "UPLOADS_QUOTA_BYTES", disk_bytes(uploads.UPLOADS_DIR) + 1000)
    uploader(app, "image_upload").set_value(("shape.png", png(), "image/png")).run()
    assert not Path(model_key.partition(":")[2]).exists()
    assert not app.exception and errors(app) == []
    assert [warning.value for warning in app.sidebar.warning] == [
        "Your uploaded checkpoint was removed to make room for newer uploads; upload it again."
    ]
    assert app.session_state["model_key"] == "default"
    assert model_key not in app.selectbox(key="model_picker").options
    models.shared_models().clear()  # out of the model cache too: nothing asks for it any more
    app.run()
    assert not app.exception and errors(app) == [] and len(app.sidebar.warning) == 0


@pytest.mark.parametrize("hostile", ["a tokenizer that panics", "a tokenizer config naming a file outside"])
def test_a_hostile_open_clip_upload_is_one_sentence_and_every_other_session_renders(tmp_path, hostile):
    """What the words side reads of an upload (tests/text/test_hostile_words.py has the corpus):
    refused in a sentence that names no server path, and the other sessions' pages render."""
    folder = open_clip_upload(tmp_path, "siglip")
    if hostile == "a tokenizer that panics":  # pyo3's PanicException, a BaseException
        tokenizer = json.loads((folder / "tokenizer.json").read_text())
        tokenizer["normalizer"] = {"type": "Precompiled", "precompiled_charsmap": "AAAAAP8AAAA="}
        (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    else:  # the folder's own tokenizer.json a 2-byte stub, transformers sent elsewhere
        (folder / "tokenizer.json").write_text("{}")
        config = json.loads((folder / "tokenizer_config.json").read_text())
        (folder / "tokenizer_config.json").write_text(json.dumps(config | {"fast_tokenizer_files": ["/etc/hostname"]}))
    other = open_app("views/attention.py")
    assert not other.exception and errors(other) == []
    app = open_app("views/attention.py")
    uploader(app, "checkpoint_upload").set_value(folder_files(folder)).run()
    assert not app.exception
    (error,) = errors(app)
    assert error.startswith("Could not load that model: the upload's tokenizer") or "leads outside" in error, error
    assert "\n" not in error and str(uploads.UPLOADS_DIR) not in error and "/etc" not in error, error
    assert app.session_state["model_key"] == "default"
    for page in ("views/pipeline.py", "views/attention.py"):
        other.switch_page(page).run()
        assert not other.exception and errors(other) == []
    app.run()
    assert not app.exception
