"""Reading checkpoint files that may come from anyone (the class server's uploads).

Nothing here runs pickle code, and what a file declares (a header's length, a zip's member
sizes, tensors' sizes) is checked against the file's own size before anything is allocated or
inflated; a folder's files must resolve inside that folder. Every refusal is a CheckpointError
whose message is one sentence that names no server path.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import pickletools
import re
import struct
import zipfile
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from ..model.config import _brief

# Bounds on what one uploaded checkpoint can make the server hold or do. The largest published
# ViTs fit well inside them (ViT-22B: 48 blocks, ~800 tensors; ViT-H/14: 2.5 GB).
MAX_BLOCKS = 256
MAX_REGISTERS = 64  # register tokens (DINOv2 and DINOv3 have 4): each one joins every attention
MAX_TENSORS = 10_000
MAX_CHECKPOINT_BYTES = 4 * 2**30
MAX_HEADER_BYTES = 2**20  # a safetensors header, a pickle or a JSON file: names and shapes only
# Bytes per value of each safetensors dtype.
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


class CheckpointError(ValueError):
    """A checkpoint that cannot be read or is not a ViT we can rebuild; the message says why."""


def looks_like_safetensors(path: Path) -> bool:
    # safetensors: an 8-byte little-endian header length, then the JSON header itself.
    with open(path, "rb") as file:
        start = file.read(9)
    return len(start) == 9 and start[8:9] == b"{"


def safetensors_header(path: Path) -> dict[str, str]:
    with open(path, "rb") as file:
        (header_bytes,) = struct.unpack("<Q", file.read(8))
    if header_bytes > MAX_HEADER_BYTES:
        raise CheckpointError(
            f"{path.name} has a {header_bytes / 2**20:.0f} MB header, far more than the names and"
            " shapes of a ViT's tensors need"
        )
    try:
        with safe_open(str(path), framework="pt") as file:
            if len(file.keys()) > MAX_TENSORS:
                raise CheckpointError(
                    f"{path.name} holds {len(file.keys())} tensors; a ViT has fewer than {MAX_TENSORS}"
                )
            return dict(file.metadata() or {})
    except SafetensorError as error:
        raise CheckpointError(
            f"{path.name} is truncated or not a valid safetensors file ({error})"
        ) from None


def _describe(start: bytes) -> str:
    """What a file that is not a checkpoint appears to be, from its first bytes."""
    signatures = {
        b"\x89PNG": "a PNG image",
        b"\xff\xd8\xff": "a JPEG image",
        b"GIF8": "a GIF image",
        b"%PDF": "a PDF",
        b"\x1f\x8b": "a gzip archive",
    }
    for magic, kind in signatures.items():
        if start.startswith(magic):
            return kind
    try:
        start.decode("utf-8")
    except UnicodeDecodeError as error:
        if error.start < len(start) - 3:  # not just a character cut off by the sample's end
            return "an unknown binary format"
    return "a text file"


def check_archive(path: Path) -> int:
    """Refuse a zip whose members would unpack to far more than the file holds, before torch.load
    allocates and inflates them: its central directory declares each member's size. Returns the
    bytes its members unpack to (weights/footprint.py's size of a PyTorch file)."""
    size = path.stat().st_size
    with open(path, "rb") as file:
        file.seek(max(0, size - 2**16 - 22))
        tail = file.read()
    # The end-of-central-directory record counts the members; Python's zipfile would otherwise
    # build an object for each of millions of them.
    end = tail.rfind(b"PK\x05\x06")
    if end < 0 or len(tail) < end + 22:
        raise CheckpointError(f"{path.name} is truncated or not a PyTorch/safetensors file")
    (members,) = struct.unpack("<H", tail[end + 10 : end + 12])
    if members > MAX_TENSORS:
        raise CheckpointError(f"{path.name} is an archive of {members} files; a ViT has fewer tensors")
    try:
        with zipfile.ZipFile(path) as archive:
            infos = archive.infolist()
    except (zipfile.BadZipFile, OSError, ValueError):
        raise CheckpointError(f"{path.name} is truncated or not a PyTorch/safetensors file") from None
    declared = sum(info.file_size for info in infos)
    # torch.save stores tensors uncompressed: an honest archive unpacks to about its own size.
    if declared > min(4 * size + 2**20, MAX_CHECKPOINT_BYTES):
        raise CheckpointError(
            f"{path.name} would unpack to {declared / 2**20:,.0f} MB from a {size / 2**20:,.1f} MB"
            " file, which is refused (PyTorch checkpoints are stored uncompressed)"
        )
    pickles = [info for info in infos if info.filename.endswith(".pkl")]
    if any(info.file_size > MAX_HEADER_BYTES for info in pickles):
        raise CheckpointError(
            f"{path.name} has a pickle of over {MAX_HEADER_BYTES // 2**20} MB, far more than the"
            " names and shapes of a ViT's tensors need"
        )
    return declared


def _refuse_raw_pickle(path: Path) -> None:
    """A pickle outside a zip: torch.save's format before PyTorch 1.6, or plain pickle.dump.

    Never unpickled: the old format declares storage sizes that torch.load allocates before it
    reads them, so a small file could ask for any amount of memory. The opcodes are only listed
    (pickletools runs nothing) to say which code a pickle would have called.
    """
    with open(path, "rb") as file:
        head = file.read(MAX_HEADER_BYTES)
    strings: list[str] = []
    called = None
    try:
        for opcode, argument, _ in pickletools.genops(io.BytesIO(head)):
            if opcode.name in ("GLOBAL", "INST"):
                called = argument.replace(" ", ".")[:60]
            elif opcode.name == "STACK_GLOBAL" and len(strings) >= 2:
                called = ".".join(strings[-2:])[:60]
            if called or opcode.name == "STOP":
                break
            if isinstance(argument, str):
                strings.append(argument)
    except ValueError:  # not a complete pickle: said below like any other unreadable file
        pass
    if called:
        raise CheckpointError(
            f"loading {path.name} was refused: it contains code or Python objects other than "
            f"tensors, which could run arbitrary commands ({called})"
        )
    raise CheckpointError(
        f"{path.name} is a Python pickle, not a checkpoint we read: PyTorch files from before"
        " version 1.6 are not read (they cannot be checked before loading); load it with torch.load"
        " and save it again with a current torch.save"
    )


def _check_loaded(tensors: dict[str, torch.Tensor], name: str, file_size: int) -> None:
    """Tensors may be views that share one storage: their data is bounded by the file's size
    before anything copies them (converting to float32 at most doubles fp16 weights)."""
    if len(tensors) > MAX_TENSORS:
        raise CheckpointError(f"{name} holds {len(tensors)} tensors; a ViT has fewer than {MAX_TENSORS}")
    odd = next(
        (
            key
            for key, value in tensors.items()
            if value.layout != torch.strided or value.device.type != "cpu"
        ),
        None,
    )
    if odd is not None:
        raise CheckpointError(f"{name}'s tensor {_brief(odd)} is not a plain (dense, stored) tensor")
    declared = sum(value.numel() * value.element_size() for value in tensors.values())
    if declared > min(2 * file_size + 2**20, MAX_CHECKPOINT_BYTES):
        raise CheckpointError(
            f"{name}'s tensors would hold {declared / 2**20:,.0f} MB of data in a"
            f" {file_size / 2**20:,.1f} MB file, which is refused"
        )


def read_tensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(state dict, safetensors metadata) of a file, or a CheckpointError saying what is wrong."""
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if not path.is_file():
        raise CheckpointError(f"{path.name} is not a file")
    size = path.stat().st_size
    if size == 0:
        raise CheckpointError(f"{path.name} is empty")
    if size > MAX_CHECKPOINT_BYTES:
        raise CheckpointError(
            f"{path.name} is {size / 2**30:.1f} GB; checkpoints over"
            f" {MAX_CHECKPOINT_BYTES // 2**30} GB are not loaded"
        )

    if looks_like_safetensors(path):
        metadata = safetensors_header(path)
        try:
            # safetensors checks that the tensors tile the file: they hold no more than it does.
            return load_file(str(path), device="cpu"), metadata
        except SafetensorError as error:
            raise CheckpointError(
                f"{path.name} is truncated or not a valid safetensors file ({error})"
            ) from None

    with open(path, "rb") as file:
        start = file.read(64)
    # torch.save writes a zip archive (or, before torch 1.6, a raw pickle starting with 0x80).
    if start.startswith(b"\x80"):
        _refuse_raw_pickle(path)
    if not start.startswith(b"PK\x03\x04"):
        raise CheckpointError(
            f"{path.name} is not a PyTorch/safetensors checkpoint "
            f"(it looks like {_describe(start)})"
        )
    check_archive(path)
    try:
        # weights_only: a pickle may only rebuild tensors and containers, never call code.
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        if "Weights only load failed" in str(error):
            found = re.search(r"GLOBAL ([\w.]+)", str(error))
            detail = f" ({found.group(1)[:60]})" if found else ""
            raise CheckpointError(
                f"loading {path.name} was refused: it contains code or Python objects other than "
                f"tensors, which could run arbitrary commands{detail}"
            ) from None
        raise CheckpointError(
            f"{path.name} is truncated or not a PyTorch/safetensors file"
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError, MemoryError):
        raise CheckpointError(
            f"{path.name} is truncated or not a PyTorch/safetensors file"
        ) from None
    tensors = _unwrap(loaded, path.name)
    _check_loaded(tensors, path.name, size)
    return tensors, {}


def _unwrap(loaded: object, name: str) -> dict[str, torch.Tensor]:
    """The tensor dict inside a training checkpoint ({"state_dict": ...}, {"model": ...}, DDP)."""
    while isinstance(loaded, Mapping):
        inner = next(
            (
                loaded[key]
                for key in ("state_dict", "model")
                if isinstance(loaded.get(key), Mapping)
            ),
            None,
        )
        if inner is None:
            break
        loaded = inner
    if not isinstance(loaded, Mapping):
        raise CheckpointError(
            f"{name} holds a {type(loaded).__name__}, not a state dict of tensors"
        )
    tensors = {str(key): value for key, value in loaded.items() if isinstance(value, torch.Tensor)}
    if not tensors:
        raise CheckpointError(f"{name} contains no tensors")
    if all(key.startswith("module.") for key in tensors):  # saved from DistributedDataParallel
        tensors = {key.removeprefix("module."): value for key, value in tensors.items()}
    return tensors


# ----------------------------------------------------------------------------- model folders


def folder_file(folder: Path, relative, what: str, must_exist: bool = True) -> Path:
    """The file ``relative`` names inside ``folder``; refused if it leads outside the folder
    (``..``, an absolute path, a symlink out), before anything there is opened, and in the same
    words whether or not such a file exists, so that an upload cannot probe the server's disk;
    ``must_exist``: also refused if it is not a file there."""
    outside = CheckpointError(
        f"{what} in {folder.name} leads outside the model folder, which is refused"
    )
    if not isinstance(relative, str) or not relative or "\0" in relative:
        raise outside
    parts = Path(relative).parts
    if Path(relative).is_absolute() or ".." in parts:
        raise outside
    inside = Path(os.path.realpath(folder))
    target = Path(os.path.realpath(folder / relative))
    if not target.is_relative_to(inside):
        raise outside
    if must_exist and not target.is_file():
        raise CheckpointError(
            f"{what} in {folder.name} is {_brief(relative)}, which is not a file in the folder"
        )
    return target


def read_json(path: Path, what: str, folder_name: str):
    if path.stat().st_size > MAX_HEADER_BYTES:
        raise CheckpointError(
            f"{what} in {folder_name} is over {MAX_HEADER_BYTES // 2**20} MB,"
            " far more than a config needs"
        )
    try:
        return json.loads(path.read_bytes())
    except (ValueError, RecursionError, MemoryError, UnicodeDecodeError):  # JSONDecodeError is a ValueError
        raise CheckpointError(f"{what} in {folder_name} is not valid JSON") from None


def links_inside(folder: Path, limit: int = MAX_TENSORS) -> None:
    """Refuse a folder holding a link that leads outside it (at any depth, ``limit`` entries at
    most): a library reading the folder (transformers' tokenizer files, chat templates) opens
    whatever it finds there, so nothing in it may lead elsewhere."""
    seen = 0
    for root, folders, files in os.walk(folder):
        seen += len(folders) + len(files)
        if seen > limit:
            raise CheckpointError(f"{folder.name} holds over {limit:,} files, far more than a model's folder")
        for entry in (*folders, *files):
            path = Path(root, entry)
            if path.is_symlink() and not Path(os.path.realpath(path)).is_relative_to(os.path.realpath(folder)):
                raise CheckpointError(f"{path.relative_to(folder)} in {folder.name} leads outside the model folder, which is refused")


def without_paths(message: str, folder: Path | None = None) -> str:
    """A library's error text with the server's paths taken out: ``folder`` (as given or
    resolved) becomes its name, any other absolute path "..."."""
    forms = () if folder is None else {str(folder), os.path.abspath(folder), os.path.realpath(folder)}
    for form in sorted(forms, key=len, reverse=True):
        message = message.replace(form, folder.name)
    return re.sub(r"(?<![\w.~-])/[^\s'\"`,;)]*", "...", message)
