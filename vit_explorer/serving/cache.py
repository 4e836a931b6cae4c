"""Bounded storage for a shared app: a thread-safe in-memory cache bounded in bytes, and a
folder trimmed to a quota on disk.

Streamlit's ``st.cache_data`` copies (pickles) its value on every hit: a ViT-B/16 capture at
patch 8 is about 200 MB, so every rerun would copy it. Values here are shared as they are, so they
must be treated as read-only (captures, analysis results, plotly figures: nothing in the app
mutates them). Two threads that ask for the same missing key compute it once; the second waits.
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import stat
import threading
from collections import OrderedDict
from collections.abc import Callable, Collection, Hashable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
from PIL import Image

T = TypeVar("T")


def nbytes(value: Any) -> int:
    """Roughly how much memory ``value`` holds: its tensors and arrays, strings and containers."""
    if isinstance(value, torch.Tensor):
        return value.element_size() * value.numel()
    if isinstance(value, np.ndarray):
        return value.nbytes
    if isinstance(value, torch.nn.Module):
        return sum(nbytes(tensor) for tensor in (*value.parameters(), *value.buffers()))
    if isinstance(value, Image.Image):
        return value.width * value.height * len(value.getbands())
    if isinstance(value, (str, bytes)):
        return len(value)
    if isinstance(value, Mapping):
        return sum(nbytes(item) for item in value.values()) + 64 * len(value)
    if isinstance(value, (list, tuple, set, frozenset)):
        return sum(nbytes(item) for item in value) + 8 * len(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return sum(nbytes(getattr(value, field.name)) for field in dataclasses.fields(value))
    figure_data = getattr(value, "_data", None)  # a plotly figure keeps its traces here
    if isinstance(figure_data, list):
        return nbytes(figure_data) + nbytes(getattr(value, "_layout", {}))
    return 64


class ByteBoundedCache:
    """Least-recently-used cache whose values together hold at most ``max_bytes``.

    A value larger than the whole budget is returned but not kept. ``get_or_compute`` runs the
    computation outside the cache's lock, so a slow capture never blocks other keys.
    """

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._entries: OrderedDict[Hashable, tuple[Any, int]] = OrderedDict()
        self._in_flight: dict[Hashable, threading.Lock] = {}
        self._lock = threading.Lock()
        self.total_bytes = 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def __contains__(self, key: Hashable) -> bool:
        with self._lock:
            return key in self._entries

    def get(self, key: Hashable, default: Any = None) -> Any:
        """The value of ``key`` if it is there (computing nothing), else ``default``."""
        with self._lock:
            if key not in self._entries:
                return default
            self._entries.move_to_end(key)
            return self._entries[key][0]

    def get_or_compute(self, key: Hashable, compute: Callable[[], T], size: Callable[[T], int] = nbytes) -> T:
        """The value of ``key``, computed now if missing; ``size`` says what a value holds of its
        own (by default everything it references)."""
        while True:
            with self._lock:
                if key in self._entries:
                    self._entries.move_to_end(key)
                    return self._entries[key][0]
                in_flight = self._in_flight.get(key)
                if in_flight is None:
                    in_flight = self._in_flight[key] = threading.Lock()
                    in_flight.acquire()
                    break
            # Someone else is computing this key: wait for them, then look again (they may
            # have failed, or the value may have been too large to keep).
            with in_flight:
                pass
            with self._lock:
                if key in self._entries:
                    self._entries.move_to_end(key)
                    return self._entries[key][0]
                if key in self._in_flight:
                    continue
            # The other computation left nothing behind: compute it here.
            return self._compute_and_store(key, compute, size)
        try:
            return self._compute_and_store(key, compute, size)
        finally:
            with self._lock:
                self._in_flight.pop(key, None)
            in_flight.release()

    def _compute_and_store(self, key: Hashable, compute: Callable[[], T], size: Callable[[T], int]) -> T:
        value = compute()
        held = size(value)
        with self._lock:
            if held <= self.max_bytes and key not in self._entries:
                self._entries[key] = (value, held)
                self.total_bytes += held
                while self.total_bytes > self.max_bytes:
                    _, (_, evicted) = self._entries.popitem(last=False)
                    self.total_bytes -= evicted
        return value

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.total_bytes = 0


def disk_bytes(path: Path) -> int:
    """Bytes of a file, or of the files under a folder; links count as themselves, never as
    what they point to (a link may point anywhere on the machine)."""
    info = path.lstat()
    if not stat.S_ISDIR(info.st_mode):
        return info.st_size
    total = 0
    for folder, folders, files in os.walk(path):  # os.walk never enters linked folders
        for name in (*folders, *files):
            entry = os.lstat(os.path.join(folder, name))
            total += 0 if stat.S_ISDIR(entry.st_mode) else entry.st_size
    return total


def trim_to_quota(folder: Path, max_bytes: int, keep: Collection[Path] = ()) -> list[Path]:
    """Remove the oldest entries of ``folder`` (its files and sub-folders, by modification time)
    until it holds at most ``max_bytes``; entries in ``keep`` are never removed. Returns what was
    removed.

    Links are never followed: a link is removed itself, and a linked ``folder`` is refused, so
    that trimming can only ever delete what is inside the folder.
    """
    if folder.is_symlink():
        raise ValueError(f"{folder} is a symbolic link; refusing to trim what it points to")
    entries = sorted(folder.iterdir(), key=lambda entry: entry.lstat().st_mtime)
    sizes = {entry: disk_bytes(entry) for entry in entries}
    total = sum(sizes.values())
    removed = []
    for entry in entries:
        if total <= max_bytes:
            break
        if entry in keep:
            continue
        if stat.S_ISDIR(entry.lstat().st_mode):
            shutil.rmtree(entry, ignore_errors=True)  # unlinks links inside, never follows them
        else:
            entry.unlink(missing_ok=True)
        total -= sizes[entry]
        removed.append(entry)
    return removed
