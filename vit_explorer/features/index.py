"""Each latent's top-activating patches over an SAE's training images, how often it fires and how
its activations spread: what a browser of the dictionary shows (saev keeps it apart the same way).

``build_index`` streams the images once and never holds all latents: per latent it keeps a running
top ``n`` (``torch.topk`` over the running top and the batch's), a count, and a histogram. The
histogram's range is each latent's maximum, which is known only at the end, so while streaming each
latent's values go into ``HISTOGRAM_SUBBINS`` times finer bins over a range that doubles whenever a
value reaches it (exact: pairs of bins merge), and the end re-bins them from 0 to the maximum; a
value near a bin edge may land in the neighbouring bin (by at most 1/8 of a bin). Under torchrun
every rank indexes its share and the parts are merged.

Saved as .npz (no pickles); a broken file is refused in one sentence (SAEError).
"""
from __future__ import annotations

import copy
import math
import os
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from ..model.vit import ViT
from .sae import MAX_LATENTS, READ_ERRORS, SAEError, SparseAutoencoder, regular_file
from .tokens import ImageSource, layer_tokens, model_input

HISTOGRAM_SUBBINS = 16
NEVER = -(2**40)  # the range exponent of a latent that has not fired yet
MAX_INDEX_BYTES = 2**31  # what a file's arrays may hold, widened to the index's types, before they are read


@dataclass
class LatentIndex:
    """Per latent (F of them): its top ``n`` tokens by activation, strongest first, as the image's
    index in the training ImageSource and the token's position among the tokens the SAE reads
    (with ``num_prefix_tokens`` > 0 the first positions are the prefix tokens, the patch row-major
    on ``grid_size`` is position - num_prefix_tokens); image -1, position 0 and value 0 where it
    fired on fewer than ``n`` tokens."""

    images: np.ndarray  # (F, n) int64
    patches: np.ndarray  # (F, n) int64
    values: np.ndarray  # (F, n) float32
    frequency: np.ndarray  # (F,) float64: the share of tokens where it fires
    histogram: np.ndarray  # (F, bins) int64: its nonzero values in equal bins from 0 to its maximum
    maxima: np.ndarray  # (F,) float32: its largest value (0 if it never fired)
    tokens_seen: int
    grid_size: tuple[int, int]
    num_prefix_tokens: int = 0  # prefix tokens among the positions (0: patches only)

    def check(self) -> None:
        """An SAEError sentence unless its numbers are ones a run writes: finite values and shares,
        no negative count, a grid of patches, no entry before image -1 or position 0."""
        finite = all(np.isfinite(array).all() for array in (self.values, self.maxima, self.frequency))
        if not finite or not ((self.frequency >= 0) & (self.frequency <= 1)).all():
            raise SAEError("this SAE index file holds values that are not finite numbers or shares outside 0 to 1")
        if (self.histogram < 0).any() or self.tokens_seen < 0 or self.num_prefix_tokens < 0 \
                or min(self.grid_size) < 1 or (self.images < -1).any() or (self.patches < 0).any():
            raise SAEError("this SAE index file holds negative counts, images, positions or grid sides")

    def check_fits(self, images: int, grid_size: tuple[int, int], num_prefix_tokens: int) -> None:
        """An SAEError sentence unless it is the index of a dictionary whose image set has ``images``
        images, read on a ``grid_size`` grid after ``num_prefix_tokens`` prefix tokens: every entry
        is one of those images and one of those positions."""
        if tuple(self.grid_size) != tuple(grid_size) or self.num_prefix_tokens != num_prefix_tokens:
            raise SAEError(
                f"this SAE index file describes a {self.grid_size[0]}x{self.grid_size[1]} grid after"
                f" {self.num_prefix_tokens} prefix tokens, not its dictionary's {grid_size[0]}x{grid_size[1]}"
                f" after {num_prefix_tokens}"
            )
        if (self.images >= images).any():
            raise SAEError(f"this SAE index file points at images beyond its image set's {images:,}")
        if (self.patches >= num_prefix_tokens + grid_size[0] * grid_size[1]).any():
            raise SAEError("this SAE index file points at positions beyond the tokens its dictionary reads")

    def top(self, latent: int) -> list[tuple[int, int, float]]:
        """[(image, position, value)] of the tokens ``latent`` fires on most, strongest first."""
        found = self.images[latent] >= 0
        return [
            (int(image), int(patch), float(value))
            for image, patch, value in zip(self.images[latent][found], self.patches[latent][found],
                                           self.values[latent][found])
        ]


def _merge_doublings(fine: torch.Tensor, doublings: torch.Tensor) -> torch.Tensor:
    """(F, FB) histograms over [0, R) -> the same over [0, R * 2**doublings) (per row): each doubling
    sums pairs of bins into the lower half. After log2(FB) doublings all counts are in bin 0."""
    most = min(int(doublings.max()) if doublings.numel() else 0, math.ceil(math.log2(fine.shape[1])))
    if most <= 0:
        return fine
    fine = fine.clone()
    half = fine.shape[1] // 2
    for step in range(most):
        rows = doublings > step
        merged = fine[rows].view(-1, half, 2).sum(-1)  # (rows, FB / 2)
        fine[rows] = torch.cat([merged, torch.zeros_like(merged)], dim=1)
    return fine


class _Partial:
    """One rank's index while the images stream: running top, counts, fine histograms."""

    def __init__(self, width: int, top: int, bins: int, device: torch.device):
        self.top, self.bins = top, bins
        self.values = torch.full((width, top), -math.inf, device=device)
        self.images = torch.full((width, top), -1, dtype=torch.int64, device=device)
        self.positions = torch.zeros((width, top), dtype=torch.int64, device=device)
        self.fired = torch.zeros(width, dtype=torch.int64, device=device)
        self.fine = torch.zeros((width, bins * HISTOGRAM_SUBBINS), dtype=torch.int64, device=device)
        # each latent's histogram covers [0, 2**exponent): a power of two above every value so far
        self.exponent = torch.full((width,), NEVER, dtype=torch.int64, device=device)
        self.tokens = torch.zeros(1, dtype=torch.int64, device=device)

    def add(self, values: torch.Tensor, latents: torch.Tensor, images: torch.Tensor, positions: torch.Tensor) -> None:
        """T tokens' strongest latents as TopK leaves them: ``latents`` (T, k) and their ``values``
        (T, k; 0 or less: not firing); each token's image index and position (T,)."""
        width, fires = self.fired.shape[0], values > 0
        token, slot = fires.nonzero(as_tuple=True)  # one entry per (token, latent) that fires
        latent, value = latents[token, slot], values[token, slot]
        counts = torch.bincount(latent, minlength=width)  # (F,)
        self.fired += counts
        self.tokens += values.shape[0]
        # Each latent's strongest entries of the batch: sorted by value, then grouped by latent.
        order = torch.argsort(value, descending=True, stable=True)
        order = order[torch.argsort(latent[order], stable=True)]
        place = torch.arange(order.shape[0], device=order.device) - (counts.cumsum(0) - counts)[latent[order]]
        kept, ranked = order[place < self.top], place[place < self.top]  # each latent's first n
        batch = torch.full((width, self.top), -math.inf, device=values.device)  # (F, n)
        batch[latent[kept], ranked] = value[kept]
        batch_images = torch.full((width, self.top), -1, dtype=torch.int64, device=values.device)
        batch_images[latent[kept], ranked] = images[token[kept]]
        batch_positions = torch.zeros((width, self.top), dtype=torch.int64, device=values.device)
        batch_positions[latent[kept], ranked] = positions[token[kept]]
        self._keep_top(batch, batch_images, batch_positions)
        # Widen the ranges that this batch's values reach, then count them in the fine bins.
        largest = batch[:, 0]
        needed = torch.where(largest > 0, torch.floor(torch.log2(largest.clamp(min=1e-30))).long() + 1, NEVER)
        exponent = torch.maximum(self.exponent, needed)
        self.fine = _merge_doublings(self.fine, exponent - self.exponent)
        self.exponent = exponent
        fine_bins = self.fine.shape[1]
        slots = (value * torch.exp2(-exponent[latent].float()) * fine_bins).long().clamp(max=fine_bins - 1)
        self.fine.view(-1).index_add_(0, latent * fine_bins + slots, torch.ones_like(slots))

    def _keep_top(self, values: torch.Tensor, images: torch.Tensor, positions: torch.Tensor) -> None:
        values = torch.cat([self.values, values], dim=1)  # (F, n + n')
        self.values, order = values.topk(self.top, dim=1)
        self.images = torch.cat([self.images, images], dim=1).gather(1, order)
        self.positions = torch.cat([self.positions, positions], dim=1).gather(1, order)

    def merge(self, other: _Partial) -> None:
        """Add another rank's part (of other images) into this one."""
        exponent = torch.maximum(self.exponent, other.exponent)
        self.fine = _merge_doublings(self.fine, exponent - self.exponent) + _merge_doublings(
            other.fine, exponent - other.exponent
        )
        self.exponent = exponent
        self._keep_top(other.values, other.images, other.positions)
        self.fired += other.fired
        self.tokens += other.tokens

    def gathered(self, world: int) -> None:
        """Every rank's parts merged into this one (on every rank)."""
        names = ("values", "images", "positions", "fired", "fine", "exponent", "tokens")
        parts = [copy.copy(self) for _ in range(world)]
        for name in names:
            tensors = [torch.empty_like(getattr(self, name)) for _ in range(world)]
            dist.all_gather(tensors, getattr(self, name))
            for part, tensor in zip(parts, tensors):
                setattr(part, name, tensor)
        first, *rest = parts
        for name in names:
            setattr(self, name, getattr(first, name))
        for part in rest:
            self.merge(part)

    def finish(self, grid_size: tuple[int, int], num_prefix_tokens: int) -> LatentIndex:
        found = self.values > -math.inf
        maxima = self.values[:, 0].clamp(min=0)  # (F,)
        # Each fine bin's count goes to the final bin (0 .. maximum) that holds its centre.
        fine_bins = self.fine.shape[1]
        centres = (torch.arange(fine_bins, device=maxima.device) + 0.5) / fine_bins
        centres = centres * torch.exp2(self.exponent.clamp(min=-126).float())[:, None]  # (F, FB)
        final = (centres / maxima.clamp(min=1e-30)[:, None] * self.bins).long().clamp(0, self.bins - 1)
        histogram = torch.zeros((maxima.shape[0], self.bins), dtype=torch.int64, device=maxima.device)
        histogram.scatter_add_(1, final, self.fine)
        tokens = int(self.tokens)
        return LatentIndex(
            images=self.images.masked_fill(~found, -1).cpu().numpy(),
            patches=self.positions.masked_fill(~found, 0).cpu().numpy(),
            values=self.values.masked_fill(~found, 0).float().cpu().numpy(),
            frequency=self.fired.cpu().double().numpy() / max(tokens, 1),
            histogram=histogram.cpu().numpy(),
            maxima=maxima.float().cpu().numpy(),
            tokens_seen=tokens,
            grid_size=tuple(grid_size),
            num_prefix_tokens=num_prefix_tokens,
        )


def build_index(
    sae: SparseAutoencoder, model: ViT, source: ImageSource, layer: int, prefix_tokens: bool, batch_size: int,
    top: int = 16, bins: int = 20, rank: int = 0, world: int = 1,
) -> LatentIndex:
    """The index of ``sae`` (reading the tokens leaving ``layer``) over every image of ``source``, run
    ``batch_size`` images a pass. Under torchrun (``world`` > 1, a process group up) each rank runs
    its share and every rank returns the whole index."""
    device = sae.W_dec.device
    partial = _Partial(sae.config.width, top, bins, device)
    with torch.no_grad():
        for indices, images in source.batches(batch_size, rank, world):
            tokens = layer_tokens(model, model_input(model, images), layer, prefix_tokens)  # (B, P, D)
            per_image = tokens.shape[1]
            values, latents = _active(sae, tokens.flatten(0, 1).to(device))
            image_of_token = indices.to(device).repeat_interleave(per_image)  # (B * P,)
            position = torch.arange(per_image, device=device).repeat(len(indices))
            partial.add(values, latents, image_of_token, position)
        if world > 1:
            partial.gathered(world)
    return partial.finish(model.grid_size(), model.num_prefix_tokens if prefix_tokens else 0)


def _active(sae: SparseAutoencoder, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, m) values and latents of tokens (n, D): each token's active latents (zeros pad the rest)."""
    if sae.config.activation == "topk":  # (n, k), not scattered back to (n, F)
        return sae.pre_activations(tokens).topk(sae.config.k, dim=-1)
    latents = sae.encode(tokens)  # BatchTopK: above its threshold, as many as a token has
    most = max(1, int((latents > 0).sum(-1).max()))
    return latents.topk(most, dim=-1)


def save_index(index: LatentIndex, path: str | Path) -> None:
    """Write ``index`` as .npz (replacing a file there only once it is complete)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.tmp")
    with open(temporary, "wb") as file:
        np.savez(
            file, images=index.images, patches=index.patches, values=index.values, frequency=index.frequency,
            histogram=index.histogram, maxima=index.maxima, tokens_seen=np.int64(index.tokens_seen),
            grid_size=np.asarray(index.grid_size, dtype=np.int64), num_prefix_tokens=np.int64(index.num_prefix_tokens),
        )
    os.replace(temporary, path)


def load_index(path: str | Path, width: int | None = None) -> LatentIndex:
    """The index saved at ``path`` (of a dictionary of ``width`` latents, when given), or an SAEError
    sentence. Bounded before anything is read: the archive's member count from its end record,
    then each array's kind and shape from its .npy header (what it will hold once widened to the
    index's types), before any array is read; the values are then checked (``LatentIndex.check``)."""
    path = Path(path)
    try:
        size = path.stat().st_size
        if not regular_file(path):
            raise OSError("not a plain file")
        members = _member_count(path, size)
    except OSError:
        raise SAEError("this is not a readable SAE index file") from None
    try:
        if size > MAX_INDEX_BYTES:
            raise SAEError(f"this SAE index file is larger than {MAX_INDEX_BYTES / 2**30:.0f} GB")
        if members != len(INDEX_ARRAYS):
            raise SAEError("this SAE index file lacks some of its arrays or holds the wrong kinds")
        with zipfile.ZipFile(path) as archive:
            headers = _headers(archive)
            shapes = {name: header[0] for name, header in headers.items()}
            _check_shapes(shapes, width)
            arrays = {name: _read(archive, name, header) for name, header in headers.items()}
    except SAEError:
        raise
    except READ_ERRORS:
        raise SAEError("this SAE index file is truncated or holds something else than arrays") from None
    index = LatentIndex(
        images=arrays["images"].astype(np.int64), patches=arrays["patches"].astype(np.int64),
        values=arrays["values"].astype(np.float32), frequency=arrays["frequency"].astype(np.float64),
        histogram=arrays["histogram"].astype(np.int64), maxima=arrays["maxima"].astype(np.float32),
        tokens_seen=int(arrays["tokens_seen"]), grid_size=tuple(int(side) for side in arrays["grid_size"]),
        num_prefix_tokens=int(arrays["num_prefix_tokens"]),
    )
    index.check()
    return index


# What save_index writes: each array's kind ("iu" whole numbers, "f" floats), its dimensions, and
# the bytes per value once widened to LatentIndex's types.
INDEX_ARRAYS = {
    "images": ("iu", 2, 8), "patches": ("iu", 2, 8), "values": ("f", 2, 4), "frequency": ("f", 1, 8),
    "histogram": ("iu", 2, 8), "maxima": ("f", 1, 4), "tokens_seen": ("iu", 0, 8), "grid_size": ("iu", 1, 8),
    "num_prefix_tokens": ("iu", 0, 8),
}
_WRONG_KINDS = "this SAE index file lacks some of its arrays or holds the wrong kinds"


def _member_count(path: Path, size: int) -> int:
    """The archive's member count from its end record, before zipfile builds an entry for each."""
    with open(path, "rb") as file:
        file.seek(max(0, size - 2**16 - 22))
        tail = file.read()
    end = tail.rfind(b"PK\x05\x06")
    if end < 0 or len(tail) < end + 22:
        raise SAEError("this is not a readable SAE index file")
    return struct.unpack("<H", tail[end + 10 : end + 12])[0]


def _headers(archive: zipfile.ZipFile) -> dict[str, tuple[tuple[int, ...], np.dtype, int, bool]]:
    """name -> (shape, dtype, offset of the data, Fortran order) of every array, from the .npy
    headers alone. Members are stored as np.savez writes them (nothing inflates) and hold exactly
    their array."""
    infos = {info.filename.removesuffix(".npy"): info for info in archive.infolist()}
    if set(infos) != set(INDEX_ARRAYS):
        raise SAEError(_WRONG_KINDS)
    headers = {}
    for name, info in infos.items():
        if info.compress_type != zipfile.ZIP_STORED:
            raise SAEError("this SAE index file's arrays are compressed, which save_index never does")
        with archive.open(info) as member:
            version = np.lib.format.read_magic(member)
            if version not in ((1, 0), (2, 0)):
                raise SAEError(_WRONG_KINDS)
            read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            shape, fortran_order, dtype = read_header(member)
            offset = member.tell()
        kinds, dimensions, _ = INDEX_ARRAYS[name]
        if dtype.kind not in kinds or dtype.itemsize > 8 or len(shape) != dimensions:
            raise SAEError(_WRONG_KINDS)
        if info.file_size != offset + math.prod(shape) * dtype.itemsize:
            raise SAEError("this SAE index file is truncated or holds something else than arrays")
        headers[name] = (shape, dtype, offset, fortran_order)
    return headers


def _check_shapes(shapes: dict[str, tuple[int, ...]], width: int | None) -> None:
    """The arrays' shapes agree on the latents (``width`` of them, when given) and, widened, fit."""
    latents, top = shapes["images"]
    bins = shapes["histogram"][1]
    consistent = (
        shapes["patches"] == shapes["values"] == (latents, top) and shapes["frequency"] == shapes["maxima"] == (latents,)
        and shapes["histogram"][0] == latents and shapes["grid_size"] == (2,)
    )
    if not consistent:
        raise SAEError("this SAE index file's arrays do not agree on the number of latents")
    if width is not None and latents != width:
        raise SAEError(f"this SAE index file describes {latents:,} latents and its dictionary has {width:,}")
    widened = sum(math.prod(shape) * INDEX_ARRAYS[name][2] for name, shape in shapes.items())
    if latents > MAX_LATENTS or widened > MAX_INDEX_BYTES:
        raise SAEError(
            f"this SAE index file's arrays ({latents:,} latents x {top:,} patches, {bins:,} bins) would hold"
            f" more than {MAX_INDEX_BYTES / 2**30:.0f} GB"
        )


def _read(archive: zipfile.ZipFile, name: str, header: tuple[tuple[int, ...], np.dtype, int, bool]) -> np.ndarray:
    """One array, read as its checked header says (no pickle: its kind is a number's)."""
    shape, dtype, offset, fortran_order = header
    with archive.open(f"{name}.npy") as member:
        member.seek(offset)
        data = member.read(math.prod(shape) * dtype.itemsize)
    return np.frombuffer(data, dtype=dtype).reshape(shape, order="F" if fortran_order else "C")
