"""The catalogue: well-known pretrained ViTs in one call, downloaded once from their publishers;
where each lives once downloaded, and its download.

``load_pretrained(name)`` (vit_explorer.weights) reads an entry of :data:`CATALOGUE`
(weights/entries.py). The timm entries are the safetensors files timm publishes on the Hugging
Face Hub; torchvision's ViT-B/16 is torchvision's file, kept in torch.hub's cache where
torchvision finds it. Every file goes through downloads.fetch (a temporary file, checked, then
renamed into place; a deadline and a size limit) and is checked as weights/entry_checks.py says
(our names and shapes; torchvision's file against the hash in its name). CLIP and SigLIP bring
both towers: their repositories' open_clip files (config, weights, a SigLIP's tokenizer) in a
folder of their own (:func:`text_folder`, read by vit_explorer.text), moved into place once every
file is there and checked; the pages explore the image tower. Each entry names its weights'
licence on its card. Whatever goes wrong is a DownloadError sentence.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from . import from_open_clip, from_vlm
from .checks import CheckpointError, read_json
# The entries, their checks and the transfer, under the names this module has always offered.
from .downloads import (  # noqa: F401
    DEFAULT_TIMEOUT_SECONDS, TIMEOUT_VARIABLE, DownloadError, check_hash, download_timeout, fetch, remove_abandoned,
    size_limit,
)
from .entries import (  # noqa: F401
    _DINOV3, _SIGLIP_B, CATALOGUE, DINOV3_LICENCE, OPTIONAL_TOKENIZER_FILES, TIMM_FILE, TOKENIZER_FILES,
    VLM_CONFIG_FILE, CatalogueEntry, entry,
)
from .entry_checks import (  # noqa: F401
    check_file, check_open_clip_config, check_open_clip_weights, check_tokenizer_file, check_vlm_config,
    check_vlm_tower, expected_shapes, open_clip_shapes, our_names, vlm_tower_keys,
)
from .range_downloads import fetch_tensors

# The Hub the timm files come from; tests point it at a server of their own on loopback.
HUB_URL_VARIABLE = "VIT_EXPLORER_HUB_URL"
DEFAULT_HUB_URL = "https://huggingface.co"
# A mirror of download.pytorch.org/models for torchvision's ViTs (same file names).
TORCHVISION_URL_VARIABLE = "VIT_EXPLORER_TORCHVISION_URL"
CACHE_VARIABLE = "VIT_EXPLORER_CACHE"
# The most each of an open_clip folder's small files may bring: a config is kilobytes, Gemma's
# 256,000-token tokenizer.json (SigLIP 2) 34 MB.
SMALL_FILE_BYTES = {"tokenizer.json": 128 * 2**20}
SMALL_FILE_DEFAULT_BYTES = from_open_clip.MAX_CONFIG_BYTES


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_VARIABLE) or Path.home() / ".cache" / "vit_explorer") / "models"


def _torchvision_model(name: str) -> str | None:
    """The torchvision model name of a torchvision entry ("torchvision:vit_b_16"), else None."""
    kind, _, model = entry(name).source.partition(":")
    return model if kind == "torchvision" else None


def url(name: str) -> str:
    """Where the entry's weights are downloaded from."""
    model = _torchvision_model(name)
    if model is not None:
        return torchvision_url(model)
    if entry(name).vlm:  # the tower's ranges of whichever shards hold it
        return file_url(name, "").removesuffix("/resolve/main/")
    return file_url(name, entry(name).files[-1])


def file_url(name: str, file_name: str) -> str:
    """Where a file of a Hub entry's repository is (on the Hub, or the mirror VIT_EXPLORER_HUB_URL names)."""
    hub = (os.environ.get(HUB_URL_VARIABLE) or DEFAULT_HUB_URL).rstrip("/")
    return f"{hub}/{entry(name).source}/resolve/main/{file_name}"


# torchvision's file names of the catalogue's torchvision models (a test checks them against
# torchvision.models): asking torchvision.models imports torch._dynamo, 6 s of a server's first page
# view, since the model picker asks on every run whether each model is downloaded.
TORCHVISION_FILES = {"vit_b_16": "vit_b_16-c867db91.pth"}
TORCHVISION_MODELS_URL = "https://download.pytorch.org/models"


def torchvision_url(model: str) -> str:
    """Where torchvision publishes a model's ImageNet weights, or the mirror that
    VIT_EXPLORER_TORCHVISION_URL names."""
    file_name = TORCHVISION_FILES.get(model)
    if file_name is None:
        import torchvision.models

        file_name = torchvision.models.get_model_weights(model).DEFAULT.url.rsplit("/", 1)[1]
    mirror = os.environ.get(TORCHVISION_URL_VARIABLE) or TORCHVISION_MODELS_URL
    return f"{mirror.rstrip('/')}/{file_name}"


def torchvision_path(model: str) -> Path:
    """Where torchvision's own loader finds the file: torch.hub's checkpoints folder."""
    return Path(torch.hub.get_dir()) / "checkpoints" / torchvision_url(model).rsplit("/", 1)[1]


def cached_path(name: str) -> Path:
    """Where the entry is once downloaded: its file, or an open_clip entry's folder."""
    model = _torchvision_model(name)
    if model is not None:
        return torchvision_path(model)
    if entry(name).open_clip is not None or entry(name).vlm:
        return cache_dir() / name
    return cache_dir() / f"{name}.safetensors"


def is_downloaded(name: str) -> bool:
    """Whether every file the entry needs is in the cache (asked by the model picker on every run:
    no import of torchvision.models or open_clip)."""
    path = cached_path(name)
    if entry(name).open_clip is None and not entry(name).vlm:
        return path.is_file()
    return all((path / file_name).is_file() for file_name in entry(name).files)


def text_folder(name: str) -> Path | None:
    """The folder of an entry that has a text tower (CLIP, SigLIP), which
    vit_explorer.text.load_image_text_model reads (complete once is_downloaded); None for an
    entry without one."""
    return cached_path(name) if name in CATALOGUE and entry(name).open_clip is not None else None



def _file_check(name: str, file_name: str) -> Callable[[Path], None]:
    if file_name == from_open_clip.WEIGHTS_FILE:
        return lambda path: check_open_clip_weights(name, path)
    if file_name == from_open_clip.CONFIG_FILE:
        return lambda path: check_open_clip_config(name, path)
    return lambda path: check_tokenizer_file(name, file_name, path)


def download(name: str, progress: Callable[[int, int | None], None] | None = None) -> Path:
    """The entry's file in the cache (an open_clip entry's folder), downloaded first if it is not
    there yet.

    ``progress(done_bytes, total_bytes or None)`` is called as the bytes arrive (over all of an
    open_clip entry's files). A file is written beside its final place under a temporary name,
    checked, and renamed into place.
    """
    model = _torchvision_model(name)
    if model is not None:
        return download_torchvision(model, progress)
    known = entry(name)
    if known.open_clip is not None:
        return download_open_clip(name, progress)
    if known.vlm:
        return download_vlm_tower(name, progress)
    return fetch(
        known.title, url(name), cached_path(name), lambda path: check_file(name, path), progress,
        expected_bytes=known.size_bytes, mirror_variable=HUB_URL_VARIABLE,
    )


def download_open_clip(name: str, progress: Callable[[int, int | None], None] | None = None) -> Path:
    """An open_clip entry's folder in the cache (both towers, their config, a SigLIP's tokenizer),
    downloaded first if any file it needs is missing.

    Each file goes through :func:`_fetch` into a staging folder beside the cache's, checked (the
    weights from their header against both towers of the entry's configs), all within one
    deadline; only when every one is there are they moved into the entry's folder, the weights
    last, so that :func:`is_downloaded` never sees part of a download. One ``progress`` over all
    the files: the bytes so far, and their total once the weights' size is known.
    """
    folder = cached_path(name)
    if is_downloaded(name):
        return folder
    known = entry(name)
    *small, weights = known.files
    wanted = [(file_name, True) for file_name in small]
    wanted += [(file_name, False) for file_name in OPTIONAL_TOKENIZER_FILES if known.tokenizer]
    wanted.append((weights, True))
    fetched: list[str] = []
    done = 0  # the bytes of the files fetched so far

    def report(base: int, is_weights: bool) -> Callable[[int, int | None], None] | None:
        if progress is None:
            return None
        return lambda file_done, file_total: progress(
            base + file_done, base + file_total if is_weights and file_total is not None else None,
        )

    with _staging(name) as (staging, ends):
        for file_name, required in wanted:
            expected_bytes = known.size_bytes if file_name == weights else SMALL_FILE_BYTES.get(file_name, SMALL_FILE_DEFAULT_BYTES)
            try:
                path = fetch(
                    known.title, file_url(name, file_name), staging / file_name, _file_check(name, file_name),
                    report(done, file_name == weights), expected_bytes=expected_bytes,
                    mirror_variable=HUB_URL_VARIABLE, ends=ends,
                )
            except DownloadError as error:
                if not required and error.status == 404:  # a file some repositories do not have
                    continue
                raise
            done += path.stat().st_size
            fetched.append(file_name)
        _put_in_place(staging, folder, fetched)
    # The image tower alone, which the catalogue downloaded for this entry before it took both.
    (cache_dir() / f"{name}.safetensors").unlink(missing_ok=True)
    return folder


# A VLM's preprocessing settings, which some repositories do not have.
VLM_PREPROCESSOR_FILE = "preprocessor_config.json"
_SHARD_NAME = re.compile(r"[A-Za-z0-9_.-]{1,200}\.safetensors")


def download_vlm_tower(name: str, progress: Callable[[int, int | None], None] | None = None) -> Path:
    """A VLM entry's folder in the cache: the repository's config.json (and its
    preprocessor_config.json where it has one, fetched first: a Qwen-VL's config is checked
    against the entry as its folder reads it, pixel budget included) and one model.safetensors
    of the vision tower's tensors alone (a Qwen-VL's merger with them), downloaded first if it is
    not there yet.

    The shards' index (or the one weights file's header) says which files hold the tower; of
    those only the tower's byte ranges are asked for (range_downloads.fetch_tensors), so a 7B
    model costs its tower. Staged and checked as an open_clip entry is (the tower against the
    entry's architecture), the weights moved into place last; ``progress`` follows the tower's bytes.
    """
    folder = cached_path(name)
    if is_downloaded(name):
        return folder
    known = entry(name)
    with _staging(name) as (staging, ends):

        def small(file_name: str, check: Callable[[Path], None]) -> Path:
            return fetch(
                known.title, file_url(name, file_name), staging / file_name, check, None,
                expected_bytes=SMALL_FILE_DEFAULT_BYTES, mirror_variable=HUB_URL_VARIABLE, ends=ends,
            )

        kept = []
        try:  # first: a Qwen-VL's config is checked as its folder reads it, with its pixel budget
            small(VLM_PREPROCESSOR_FILE, lambda path: _read_json_file(name, path))
            kept.append(VLM_PREPROCESSOR_FILE)
        except DownloadError as error:
            if error.status != 404:
                raise
        hf_config = json.loads(small(VLM_CONFIG_FILE, lambda path: check_vlm_config(name, path)).read_bytes())
        kept.append(VLM_CONFIG_FILE)
        wanted = _tower_sources(name, small, hf_config)
        fetch_tensors(
            known.title, wanted, staging / TIMM_FILE, lambda path: check_vlm_tower(name, path, hf_config), progress,
            limit_bytes=size_limit(known.size_bytes), mirror_variable=HUB_URL_VARIABLE, ends=ends,
        )
        _put_in_place(staging, folder, [*kept, TIMM_FILE])
    return folder


@contextlib.contextmanager
def _staging(name: str) -> Iterator[tuple[Path, float]]:
    """A private staging folder beside the cache's folder of entry ``name`` (the abandoned ones of
    killed downloads removed first), and the time.monotonic() by which the whole download must
    end; the folder is removed however the download ends."""
    seconds = download_timeout()
    ends = time.monotonic() + seconds
    cache = cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    remove_abandoned(cached_path(name), seconds)
    staging = cache / f".{name}.{uuid.uuid4().hex}.tmp"
    staging.mkdir(mode=0o700)
    try:
        yield staging, ends
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _put_in_place(staging: Path, folder: Path, file_names: list[str]) -> None:
    """The checked files moved from staging into the entry's folder in their order, the weights
    last, so that is_downloaded never sees part of a download."""
    folder.mkdir(parents=True, exist_ok=True)
    for file_name in file_names:
        os.replace(staging / file_name, folder / file_name)


def _read_json_file(name: str, path: Path):
    try:
        return read_json(path, path.name, name)
    except CheckpointError as error:
        raise DownloadError(f"the downloaded {name} {error}") from None


def _tower_sources(name: str, small: Callable, hf_config: dict) -> dict[str, Callable[[list[str]], list[str]]]:
    """{the URL of each file holding part of the tower: which of its tensors to take}: from the
    shards' index, or from the one weights file's header where the repository has no index."""
    try:
        index = _read_json_file(name, small(from_vlm.INDEX_FILE, lambda path: _read_json_file(name, path)))
    except DownloadError as error:
        if error.status != 404:
            raise
        return {file_url(name, TIMM_FILE): lambda names: _tower_keys(name, names, hf_config)}
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(value, str) for value in weight_map.values()):
        raise DownloadError(f"the downloaded {name} {from_vlm.INDEX_FILE} has no weight_map from tensor names to shard files")
    by_shard: dict[str, list[str]] = {}
    for key in _tower_keys(name, list(weight_map), hf_config):
        shard = weight_map[key]
        if not _SHARD_NAME.fullmatch(shard) or shard.startswith("."):
            raise DownloadError(f"{name}'s {from_vlm.INDEX_FILE} names a shard outside its repository ({shard[:80]!r})")
        by_shard.setdefault(shard, []).append(key)

    def take(keys: list[str]) -> Callable[[list[str]], list[str]]:
        return lambda names: keys

    return {file_url(name, shard): take(keys) for shard, keys in by_shard.items()}


def _tower_keys(name: str, names: list[str], hf_config: dict) -> list[str]:
    try:
        return vlm_tower_keys(names, name, hf_config)[1]
    except CheckpointError as error:
        raise DownloadError(f"could not download {name}: {error}") from None


def download_torchvision(model: str, progress: Callable[[int, int | None], None] | None = None) -> Path:
    """A torchvision ViT's weights in torch.hub's cache (where torchvision loads them from),
    downloaded first if they are not there yet; checked against the hash in the file's name."""
    import torchvision.models

    source = f"torchvision:{model}"
    known = next((known for known in CATALOGUE.values() if known.source == source), None)
    title = known.title if known is not None else f"torchvision's {model}"
    # torchvision's metadata gives the file's size in MiB.
    size = known.size_bytes if known is not None else int(
        torchvision.models.get_model_weights(model).DEFAULT.meta["_file_size"] * 2**20
    )
    target = torchvision_path(model)
    return fetch(
        title, torchvision_url(model), target, lambda path: check_hash(path, target.name), progress,
        expected_bytes=size, mirror_variable=TORCHVISION_URL_VARIABLE,
    )
