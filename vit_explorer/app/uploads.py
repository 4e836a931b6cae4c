"""Every upload, and all the code that guards what is kept of one: the private uploads folder
(refused if it is a link, another user's or writable by others), its quota, staging and the checks
an upload passes before it stays, and releasing a handled upload's bytes from Streamlit."""
from __future__ import annotations

import hashlib
import os
import shutil
import stat
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import streamlit as st
from streamlit.runtime.memory_uploaded_file_manager import MemoryUploadedFileManager
from streamlit.runtime.scriptrunner import get_script_run_ctx

from ..data.images import load_image
from ..serving.cache import trim_to_quota
from ..text import load_image_text_model
from ..text.tokenizers import is_parser_failure
from ..weights import catalogue, from_open_clip
from . import models


def default_uploads_dir() -> Path:
    """VIT_EXPLORER_UPLOADS_DIR, else uploads/ in this user's cache (VIT_EXPLORER_CACHE or
    ~/.cache/vit_explorer): a folder of this server's own, not the temp directory every user and
    every other instance on the machine can write to."""
    configured = os.environ.get("VIT_EXPLORER_UPLOADS_DIR")
    if configured:
        return Path(configured)
    cache = os.environ.get(catalogue.CACHE_VARIABLE) or Path.home() / ".cache" / "vit_explorer"
    return Path(cache) / "uploads"


UPLOADS_DIR = default_uploads_dir()
# Uploaded checkpoints and images together; the oldest are removed first to make room.
UPLOADS_QUOTA_BYTES = int(float(os.environ.get("VIT_EXPLORER_UPLOADS_MB") or 4096) * 2**20)
_UPLOADS_LOCK = threading.Lock()  # one upload at a time moves into the folder and trims it
# Uploads written but not checked yet (under _UPLOADS_LOCK): trimming never removes them.
_INCOMING: list[Path] = []
# An image's own limit (the browser refuses larger files before sending them); the server-wide
# server.maxUploadSize (.streamlit/config.toml) is for checkpoints.
IMAGE_UPLOAD_MB = 25
# What the image uploader offers: the formats PIL reads that images.load_image turns into RGB.
IMAGE_TYPES = ["png", "jpg", "jpeg", "webp", "gif", "bmp", "tif", "tiff"]


def uploaded_image_path(digest: str) -> Path:
    return UPLOADS_DIR / f"image-{digest}"


def _upload_digest(files: Sequence) -> str:
    digest = hashlib.sha256()
    for file in sorted(files, key=lambda file: file.name):
        digest.update(file.name.encode())
        digest.update(file.getvalue())
    return digest.hexdigest()[:16]


class UnsafeUploadsFolder(OSError):
    """The uploads folder is not this server's own; the message says why in one sentence."""


def uploads_folder() -> Path:
    """UPLOADS_DIR, created private (0700) when missing.

    Refused when it is a link (trimming it deleted what the link pointed to), another user's, or
    writable by others (who could swap an upload for a link to someone's files).
    """
    UPLOADS_DIR.parent.mkdir(parents=True, exist_ok=True)
    try:
        UPLOADS_DIR.mkdir(mode=0o700)
    except FileExistsError:
        pass
    info = UPLOADS_DIR.lstat()
    if stat.S_ISLNK(info.st_mode):
        problem = "is a symbolic link"
    elif not stat.S_ISDIR(info.st_mode):
        problem = "is not a folder"
    elif info.st_uid != os.getuid():
        problem = "belongs to another user"
    elif info.st_mode & 0o022:
        problem = "is writable by other users"
    else:
        return UPLOADS_DIR
    raise UnsafeUploadsFolder(
        f"Uploads are off: the uploads folder {UPLOADS_DIR} {problem}; set VIT_EXPLORER_UPLOADS_DIR"
        " to a private folder of the user running this server."
    )


def upload_key(widget_key: str) -> str:
    """The uploader's key now: a new one after each upload it handed over, so it starts empty."""
    handled = st.session_state.get(f"uploads handled:{widget_key}", 0)
    return widget_key if handled == 0 else f"{widget_key}#{handled}"


def release_upload(widget_key: str, files: Sequence) -> None:
    """Free a handled upload's bytes, kept or refused, and rerun with an empty uploader.

    Streamlit keeps uploaded files in memory (its MemoryUploadedFileManager) until the session
    shuts down, and a session whose browser left expires without shutting down: three refused
    900 MB images kept 6 GB for good. What an upload keeps is on disk by now. The uploader's old
    key, and the files its value still holds, are dropped at the end of the rerun.
    """
    ctx = get_script_run_ctx()
    if ctx is not None and isinstance(ctx.uploaded_file_mgr, MemoryUploadedFileManager):
        for file in files:
            ctx.uploaded_file_mgr.remove_file(session_id=ctx.session_id, file_id=file.file_id)
    handled = f"uploads handled:{widget_key}"
    st.session_state[handled] = st.session_state.get(handled, 0) + 1
    st.rerun()


# An open_clip folder's files (CLIP, SigLIP: both towers, weights/from_open_clip.py), the
# tokenizer's optional: CLIP's ships inside open_clip.
OPEN_CLIP_FILES = (from_open_clip.CONFIG_FILE, from_open_clip.WEIGHTS_FILE)
OPEN_CLIP_TOKENIZER_FILES = (*catalogue.TOKENIZER_FILES, *catalogue.OPTIONAL_TOKENIZER_FILES)


def add_checkpoint_upload(files: Sequence) -> str | None:
    """Store an uploaded checkpoint (one file, a Hugging Face folder's files, or an open_clip
    folder's: both towers of a CLIP or SigLIP, with its tokenizer), check that it loads (an
    open_clip folder's text tower and tokenizer too), and select it.

    Returns None on success, else one sentence saying why the model stays as it was; a refused
    upload leaves nothing on disk.
    """
    names = [file.name for file in files]
    open_clip = from_open_clip.CONFIG_FILE in names
    if "config.json" not in names and not open_clip and len(files) > 1:
        return (
            "Upload one checkpoint file, a Hugging Face model's config.json together with its"
            f" weights, or an open_clip model's {' and '.join(OPEN_CLIP_FILES)} (with its tokenizer's files)."
        )
    plain = all(name not in ("", ".", "..") and Path(name).name == name for name in names)
    if not plain or len(set(names)) < len(names):
        return "Upload files with plain, distinct names."  # a name with a path could write elsewhere
    if open_clip:
        if from_open_clip.WEIGHTS_FILE not in names:
            return f"An open_clip model needs its {from_open_clip.WEIGHTS_FILE} beside its {from_open_clip.CONFIG_FILE}."
        others = [name for name in names if name not in (*OPEN_CLIP_FILES, *OPEN_CLIP_TOKENIZER_FILES)]
        if others:
            return (
                f"An open_clip model's upload takes {', '.join(OPEN_CLIP_FILES)} and its tokenizer's files"
                f" ({', '.join(OPEN_CLIP_TOKENIZER_FILES)}), not {', '.join(others[:3])}."
            )
    digest = _upload_digest(files)
    # A Hugging Face ViT is its folder: config.json beside its weights; an open_clip model too.
    folder = "config.json" in names or open_clip
    target = UPLOADS_DIR / digest if folder else UPLOADS_DIR / digest / names[0]
    model_key = f"file:{target}"
    error = _store_upload(
        digest, {file.name: file.getvalue() for file in files},
        check=lambda: _loading_problem(model_key, names, text=open_clip),
    )
    if error:
        return error
    error = models.select_model(model_key)
    if error is None:
        st.session_state["uploaded_models"][model_key] = f"Uploaded: {', '.join(names)}"
    return error


def _loading_problem(model_key: str, names: Sequence[str], text: bool = False) -> str | None:
    """Why an uploaded checkpoint does not load (loaded, it stays in the shared models); or None.
    ``text``: an open_clip folder, whose text tower and tokenizer must load too (beside the
    shared image tower; the Words glue loads them again when a page asks)."""
    try:
        image = models.base_model(model_key)
        if text:
            models.admit_text(Path(model_key.removeprefix("file:")), image)
            load_image_text_model(model_key.removeprefix("file:"), image=image)
    except (ValueError, OSError) as error:
        if text:  # the loaders name a folder by its name: here the upload's digest, which says nothing
            return f"Could not load that model: {str(error).replace(Path(model_key).name, 'the upload')}."
        return f"Could not load that model: {error}."
    except BaseException as error:
        # A hostile file may break a loader anywhere, a Rust panic (a BaseException) too: the page
        # must not break with it; Streamlit's own control flow (a rerun, a stop) goes on.
        if not is_parser_failure(error):
            raise
        return f"Could not load {', '.join(names)}: it is not a checkpoint this app can read."
    return None


def add_image_upload(file) -> str | None:
    """Decode an uploaded image and select it; None on success, else the one-line reason."""
    # Before anything reads or decodes it: a browser refuses larger files, other clients may not.
    if file.size > IMAGE_UPLOAD_MB * 2**20:
        return (
            f"{file.name} is {file.size / 2**20:.1f} MB, more than the {IMAGE_UPLOAD_MB} MB this app"
            " takes for an image."
        )
    data = file.getvalue()
    try:
        load_image(data)  # decoded once here, so that a bad file is refused before it is kept
    except ValueError as error:
        return f"Could not use {file.name}: {error}."
    digest = hashlib.sha256(data).hexdigest()[:16]
    error = _store_upload(uploaded_image_path(digest).name, data)
    if error:
        return error
    image_key = f"upload:{digest}"
    st.session_state["uploaded_images"][image_key] = f"Uploaded: {file.name}"
    st.session_state["image_key"] = image_key
    return None


def _store_upload(
    name: str, content: bytes | dict[str, bytes], check: Callable[[], str | None] = lambda: None
) -> str | None:
    """Keep an upload in UPLOADS_DIR as ``name`` (a file's bytes, or a folder's files by name),
    ``check()`` it there, then trim the folder to its quota, oldest uploads first. None on
    success, else the one-line reason, and then nothing of the upload is left on disk.

    Written into a private staging folder first and moved into place whole, so that nobody reads
    a half-written upload; nothing is trimmed for an upload that is then refused.
    """
    size = len(content) if isinstance(content, bytes) else sum(map(len, content.values()))
    if size > UPLOADS_QUOTA_BYTES:
        return (
            f"That upload is {size / 2**20:.0f} MB, more than this server keeps for all uploads"
            f" together ({UPLOADS_QUOTA_BYTES / 2**20:.0f} MB, VIT_EXPLORER_UPLOADS_MB)."
        )
    try:
        with _UPLOADS_LOCK:
            folder = uploads_folder()
            staging = Path(tempfile.mkdtemp(dir=folder, prefix=".incoming-"))
            _INCOMING.append(staging)
    except UnsafeUploadsFolder as refusal:
        return str(refusal)
    except OSError as failure:
        return f"Could not keep that upload: {failure.strerror or failure}."
    target = folder / name
    created = checking = False
    error: str | None = "Could not keep that upload."  # until it is in place and checked
    try:
        staged = staging / name
        if isinstance(content, bytes):
            staged.write_bytes(content)
        else:
            staged.mkdir()
            for file_name, data in content.items():
                (staged / file_name).write_bytes(data)
        with _UPLOADS_LOCK:
            created = not os.path.lexists(target)  # else the same bytes are there already
            if created:
                staged.rename(target)
            _INCOMING.append(target)
            checking = True
        error = check()
    except OSError as failure:
        error = f"Could not keep that upload: {failure.strerror or failure}."
    finally:
        with _UPLOADS_LOCK:
            shutil.rmtree(staging, ignore_errors=True)
            _INCOMING.remove(staging)
            if checking:
                _INCOMING.remove(target)
            if error is None:
                os.utime(target, follow_symlinks=False)  # a repeated upload counts as new
                trim_to_quota(folder, UPLOADS_QUOTA_BYTES, keep={target, *_INCOMING})
            elif created and isinstance(content, bytes):
                target.unlink(missing_ok=True)
            elif created:
                shutil.rmtree(target, ignore_errors=True)
    return error


def forget_removed_uploads() -> None:
    """Take this session's uploaded checkpoints that the quota removed out of its picker, and
    leave a removed current model for the default one, saying so."""
    state = st.session_state
    uploads = state["uploaded_models"]
    for model_key in [key for key in uploads if not Path(key.partition(":")[2]).exists()]:
        del uploads[model_key]
        if state["model_key"] == model_key:
            if models.select_model(models.DEFAULT_MODEL) is not None:
                state["model_key"] = models.DEFAULT_MODEL  # the page then says why the default does not load
            state["model_notice"] = (
                "Your uploaded checkpoint was removed to make room for newer uploads; upload it again."
            )
