"""Score a labelled set, for the Several images page: the mIoU of the open-vocabulary methods on a
folder of pictures with masks on the server (text.segmentation.measure, bench.segment's protocol
with its defaults: windows at the model's input, each name embedded with the templates chosen).

The folder named holds ``images/``, ``masks/`` and ``classes.txt`` (data.labelled_folder: every
bad input a sentence). It must resolve, links followed, inside the folders the Features page's
image sets may use (app.features.image_folder_allowed: the data folder, weights/, the runs folder);
anything else is refused in a sentence that names no server path. A relative name is read in the
data folder.

It runs in the server with a progress bar, on at most MAX_PICTURES pictures (the whole folder is
``python -m bench.segment``'s), and its results are kept for everybody in memo under the model, its
sizes, the folder, its files' names, sizes and times, the methods, the threshold, the templates and
the limit: a rerun, or another session asking the same, computes nothing.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
import streamlit as st
import torch

from ..data.datasets import DEFAULT_DATA_ROOT, DatasetError
from ..data.labelled_folder import LabelledFolder, read_classes, read_labelled_folder
from ..text import ImageTextModel
from ..text import open_vocabulary, segmentation
from ..text.segmentation import Protocol, Result
from ..text.zero_shot import class_embeddings
from .features import image_folder_allowed
from .memo import memo, shared_results
from .selection import Selection

MAX_PICTURES = 50  # measured in the server, beside everybody's pages: a few minutes of a ViT-B/16 on CPU
CLASS_FILE = "classes.txt"
# The methods a set is scored by: those that need no second model (ProxyCLIP's proxy: bench.segment --proxy).
TEMPLATES = segmentation.TEMPLATES
METHODS = {name: entry for name, entry in open_vocabulary.METHODS.items() if not entry.needs_proxy}


def labelled_folder(text: str, limit: int | None = None) -> tuple[Path, LabelledFolder]:
    """The folder named by ``text`` and its first ``limit`` (at most MAX_PICTURES) pictures, checked;
    a DatasetError sentence for anything else."""
    name = text.strip()
    if not name:
        raise DatasetError(f"name a folder on the server holding images/, masks/ and {CLASS_FILE}")
    path = Path(name).expanduser()
    path = path if path.is_absolute() else DEFAULT_DATA_ROOT / path
    if not image_folder_allowed(path):
        raise DatasetError(
            "that folder is not one a page may read: name a folder inside the data folder, the app's weights"
            " folder or the runs folder"
        )
    if not path.is_dir():
        raise DatasetError(f"there is no folder {path.name} there")
    folder = read_labelled_folder(path / "images", path / "masks", read_classes(path / CLASS_FILE))
    count = min(limit or MAX_PICTURES, MAX_PICTURES)
    return path, LabelledFolder(folder.images[:count], folder.masks[:count], folder.sizes[:count], folder.classes)


def digest(path: Path, folder: LabelledFolder) -> str:
    """The folder's files as they are now: their names, sizes and modification times."""
    hashed = hashlib.sha256(os.path.realpath(path).encode())
    for file in (path / CLASS_FILE, *folder.images, *folder.masks):
        stat = file.stat()
        hashed.update(f"{file.name}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return hashed.hexdigest()


def scores_key(selection: Selection, path: Path, folder: LabelledFolder, methods: tuple[str, ...], threshold: float,
               templates: str) -> tuple:
    return (selection.model_id, selection.patch_size, selection.config.img_size, "labelled set scores",
            digest(path, folder), len(folder), methods, threshold, templates)


def scores(key: tuple, model: ImageTextModel, folder: LabelledFolder, methods: tuple[str, ...], threshold: float,
           templates: str) -> list[Result]:
    """Each method's result on the folder, once for everybody under ``key`` (:func:`scores_key`),
    a progress bar while it runs."""
    def compute() -> list[Result]:
        bar = st.progress(0.0, text="Embedding the class names ...")
        total, done = len(folder) * len(methods), [0]

        def step(number: int) -> None:
            done[0] += 1
            bar.progress(done[0] / total, text=f"Segmenting: {done[0]} of {total} ({methods[number]})")

        try:  # a refusal (a name the tokenizer cannot read, a method this tower lacks) is said where the bar was
            with torch.no_grad():
                texts = class_embeddings(model, folder.classes.names, segmentation.templates(templates), progress=lambda
                                         done, total: bar.progress(done / max(total, 1), text="Embedding the class names ..."))
                protocols = [Protocol(method, threshold=threshold) for method in methods]
                return segmentation.measure(model, folder, texts, protocols, step=step)
        finally:
            bar.empty()

    return memo(key, compute)


def kept(key: tuple) -> list[Result] | None:
    """The results under ``key`` if anybody has computed them and they are still kept."""
    return shared_results().get(key)


def table(results: list[Result], classes) -> list[dict]:
    """A row per class (its IoU in % under each method, None where in neither truth nor prediction),
    then the mIoU and the passes a picture."""
    methods = [result.protocol.method for result in results]
    ious = [result.ious for result in results]
    rows = [
        {"class": f"{index} {names[0]}", **{method: None if np.isnan(iou[index]) else round(100 * float(iou[index]), 1)
                                           for method, iou in zip(methods, ious)}}
        for index, names in enumerate(classes.classes)
    ]
    rows.append({"class": "mIoU", **{method: round(100 * result.mean_iou, 2) for method, result in zip(methods, results)}})
    rows.append({"class": "passes a picture", **{method: round(result.passes, 2) for method, result in zip(methods, results)}})
    return rows
