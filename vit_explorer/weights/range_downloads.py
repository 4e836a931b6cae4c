"""Some tensors of safetensors files on a server, without the rest of the files: each file's
header read by two HTTP range requests (its 8-byte length, then the header), then only the wanted
tensors' bytes, asked for in ranges (neighbours a little apart asked for as one), written into one
safetensors file of their own. A vision-language model's 7B folder then costs its vision tower's
few hundred megabytes (catalogue.download_vlm_tower).

A server that answers a range request with the whole file, a header that is not a safetensors
header or announces tensors it cannot hold, a range cut short and the download's deadline are
each a DownloadError sentence; nothing is kept of a download that did not end checked."""
from __future__ import annotations

import http.client
import json
import math
import os
import re
import time
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .checks import MAX_HEADER_BYTES, MAX_TENSORS
from .downloads import (
    CHUNK_BYTES, READ_TIMEOUT_SECONDS, TIMEOUT_VARIABLE, Deadline, DownloadError, download_timeout, failure, opener,
    remove_abandoned,
)

DTYPE_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
}
# Tensors of one file this close together are asked for in one range: a few unwanted bytes
# cost less than another request (a LayerNorm's weight lies between two wanted matrices).
MERGE_GAP_BYTES = 1 << 20
_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")


@dataclass(frozen=True)
class RemoteTensor:
    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int  # where its bytes begin in the remote file
    end: int


def _read_range(open_url: Callable, url: str, first: int, last: int, title: str, into=None) -> bytes:
    """Bytes ``first``..``last`` (inclusive) of ``url``; with ``into`` (a callable taking each
    chunk) they are streamed there instead of returned."""
    request = urllib.request.Request(url, headers={"Range": f"bytes={first}-{last}"})
    wanted = last - first + 1
    with open_url(request, timeout=READ_TIMEOUT_SECONDS) as response:
        answered = _CONTENT_RANGE.fullmatch(response.headers.get("Content-Range", "") or "")
        if response.status != 206 or answered is None:
            raise DownloadError(
                f"could not download {title}: {url} does not answer range requests (it offered the whole"
                " file), and we do not download a whole vision-language model for its tower"
            )
        if (int(answered.group(1)), int(answered.group(2))) != (first, last):
            raise DownloadError(f"could not download {title}: {url} answered another range than the one asked for")
        parts, done = [], 0
        while done < wanted and (chunk := response.read1(min(CHUNK_BYTES, wanted - done))):
            done += len(chunk)
            if into is None:
                parts.append(chunk)
            else:
                into(chunk)
        if done != wanted:
            raise DownloadError(f"the download of {title} was cut short: {done} of {wanted} bytes of a range came")
    return b"".join(parts)


def remote_header(open_url: Callable, url: str, title: str) -> dict[str, RemoteTensor]:
    """The tensors a remote safetensors file holds, from its header alone, each checked to be the
    bytes its dtype and shape make."""
    refused = f"could not download {title}: {url} is not a safetensors file"
    length = int.from_bytes(_read_range(open_url, url, 0, 7, title), "little")
    if not 2 <= length <= MAX_HEADER_BYTES:
        raise DownloadError(f"{refused} (a header of {length} bytes)")
    try:
        header = json.loads(_read_range(open_url, url, 8, 7 + length, title))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        raise DownloadError(refused) from None
    if not isinstance(header, dict) or len(header) > MAX_TENSORS + 1:
        raise DownloadError(refused)
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
            valid = (
                dtype in DTYPE_BYTES and isinstance(shape, list) and len(shape) <= 8
                and all(type(side) is int and side >= 0 for side in shape)
                and type(begin) is int and type(end) is int and 0 <= begin <= end
                and end - begin == math.prod(shape) * DTYPE_BYTES[dtype]
            )
        except (TypeError, KeyError, ValueError):
            valid = False
        if not valid:
            raise DownloadError(f"{refused} (its header's entry for {str(name)[:80]} does not add up)")
        tensors[name] = RemoteTensor(name, dtype, tuple(shape), 8 + length + begin, 8 + length + end)
    return tensors


def _ranges(tensors: list[RemoteTensor]) -> list[tuple[int, int, list[RemoteTensor]]]:
    """The tensors of one file (sorted by where they lie, none overlapping) grouped into ranges to
    ask for."""
    groups: list[tuple[int, int, list[RemoteTensor]]] = []
    for tensor in tensors:
        if groups and tensor.start - groups[-1][1] <= MERGE_GAP_BYTES:
            first, _, members = groups[-1]
            groups[-1] = (first, tensor.end, [*members, tensor])
        else:
            groups.append((tensor.start, tensor.end, [tensor]))
    return groups


def fetch_tensors(
    title: str, wanted: dict[str, Callable[[list[str]], list[str]]], target: Path, check: Callable[[Path], None],
    progress: Callable[[int, int | None], None] | None, *, limit_bytes: int, mirror_variable: str,
    ends: float | None = None,
) -> Path:
    """The tensors ``wanted`` chooses ({a file's URL: from the names its header holds, those to
    take}) in one safetensors file at ``target``, checked by ``check`` before it is renamed into
    place; at most ``limit_bytes`` of tensor data, all within ``ends`` (time.monotonic(); the
    whole VIT_EXPLORER_DOWNLOAD_TIMEOUT without it)."""
    seconds = download_timeout()
    left = seconds if ends is None else ends - time.monotonic()
    if left <= 0:
        raise DownloadError(f"could not download {title}: it took longer than {seconds:g} s ({TIMEOUT_VARIABLE} allows more)")
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_abandoned(target, seconds)
    temporary = target.parent / f".{target.name}.{uuid.uuid4().hex}.tmp"
    url = next(iter(wanted), "")
    with Deadline(left) as deadline:
        open_url = opener(deadline).open
        try:
            plan: list[tuple[str, list[RemoteTensor]]] = []
            for url, select in wanted.items():
                held = remote_header(open_url, url, title)
                names = select(list(held))
                missing = [name for name in names if name not in held]
                if missing:
                    raise DownloadError(f"could not download {title}: {url} lacks {missing[0][:80]}, which its index says it holds")
                tensors = sorted((held[name] for name in set(names)), key=lambda tensor: tensor.start)
                if any(later.start < earlier.end for earlier, later in zip(tensors, tensors[1:])):
                    raise DownloadError(f"could not download {title}: {url}'s header has tensors that overlap")
                plan.append((url, tensors))
            total = sum(tensor.end - tensor.start for _, tensors in plan for tensor in tensors)
            if total > limit_bytes:
                raise DownloadError(
                    f"could not download {title}: its tower's tensors are {total / 2**20:.0f} MB, more than the"
                    f" {limit_bytes / 2**20:.0f} MB expected"
                )
            _write(open_url, title, plan, temporary, total, progress)
            check(temporary)
            os.replace(temporary, target)
        except DownloadError:
            raise
        except (OSError, http.client.HTTPException) as error:
            raise failure(error, deadline, title, url, seconds, mirror_variable) from None
        finally:
            temporary.unlink(missing_ok=True)
    return target


def _write(open_url: Callable, title: str, plan: list[tuple[str, list[RemoteTensor]]], path: Path, total: int,
           progress: Callable[[int, int | None], None] | None) -> None:
    """The planned tensors, in the order they arrive, as one safetensors file."""
    header, offset = {}, 0
    for _, tensors in plan:
        for tensor in tensors:
            size = tensor.end - tensor.start
            header[tensor.name] = {"dtype": tensor.dtype, "shape": list(tensor.shape), "data_offsets": [offset, offset + size]}
            offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data 8-byte aligned, as safetensors writes it
    done = 0
    with open(path, "wb") as file:
        file.write(len(encoded).to_bytes(8, "little") + encoded)
        for url, tensors in plan:
            for first, last, members in _ranges(tensors):
                position = first

                def keep(chunk: bytes) -> None:
                    """Write the part of ``chunk`` that lies inside a wanted tensor."""
                    nonlocal position, done
                    chunk_start = position
                    position += len(chunk)
                    for tensor in members:
                        low, high = max(tensor.start, chunk_start), min(tensor.end, position)
                        if low < high:
                            file.write(chunk[low - chunk_start:high - chunk_start])
                            done += high - low
                    if progress is not None:
                        progress(done, total)

                _read_range(open_url, url, first, last - 1, title, into=keep)
