"""What an SAE reads: the images it trains on (ImageSource) and one layer's tokens of them.

An ImageSource is addressable by index, so that a gallery can show training image ``i`` again
without a pass over the set: shapes re-render image ``i`` from their seed, the other sets keep
their first ``count`` images (loaded once per process, two sets at most). Its dict goes on the
SAE's card. ``layer_tokens`` runs the blocks up to the SAE's layer only: the layers above it are
not run, so capturing a layer's tokens costs (layer + 1) / depth of the forward passes.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from .. import resources
from ..data.datasets import DATASET_NAMES, DatasetError, check_dataset_name, load_dataset, render_shapes
from ..data.images import load_image
from ..model.config import _JsonConfig, _brief, _check_whole, _pair
from ..model.recorder import eval_mode
from ..model.vit import ViT

PHOTOS = "photos"  # the bundled sample photos (assets/samples)
SOURCE_NAMES = ("shapes", PHOTOS, *(name for name in DATASET_NAMES if name != "shapes"))
PHOTO_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp")
LUMA = (0.299, 0.587, 0.114)  # PIL's RGB -> L weights, for a model that reads one channel
# A side no ViT here reads (the catalogue's largest inputs are 768 px): a card claiming more would
# make a gallery render or resize pictures of any size.
MAX_IMAGE_SIDE = 2048


def check_source_name(name: str) -> None:
    """A DatasetError sentence unless ``name`` names an image set an SAE can train on."""
    if name == PHOTOS:
        return
    try:
        check_dataset_name(name)
    except DatasetError:
        raise DatasetError(f"unknown image set {_brief(name)}; choose one of {', '.join(SOURCE_NAMES)}") from None


@dataclass(frozen=True)
class ImageSource(_JsonConfig):
    """The first ``count`` training images of ``dataset`` at ``image_size`` (H, W): shapes from the
    stream of ``seed``, the bundled photos, a torchvision set or a folder (as many as it has, if
    fewer). Image ``i`` is always the same image."""

    dataset: str
    count: int
    image_size: tuple[int, int]
    seed: int = 0

    def __post_init__(self) -> None:
        check_source_name(self.dataset)
        _check_whole("count", self.count, 1)
        _check_whole("seed", self.seed, 0)
        try:
            size = _pair(self.image_size)
        except (TypeError, ValueError):
            raise DatasetError(f"image_size must be a side or a (height, width) pair, not {_brief(self.image_size)}")
        for side in size:
            _check_whole("image_size", side, 1)
        if max(size) > MAX_IMAGE_SIDE:
            raise DatasetError(f"image sides of at most {MAX_IMAGE_SIDE} pixels are read, not {max(size):,}")
        object.__setattr__(self, "image_size", size)  # a card's [h, w] list back to a tuple

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "image_size": list(self.image_size)}

    def _stored(self) -> torch.Tensor | None:
        """(n, C, H, W) uint8: the images of a finite set (None for shapes, rendered on demand)."""
        if self.dataset == "shapes":
            return None
        return _stored_images(self.dataset, self.count, self.image_size, self.seed)

    def held_bytes(self) -> int:
        """At most how many bytes reading one of its images holds: its whole set when stored
        (the first ``count`` images), else one rendered image."""
        height, width = self.image_size
        return 3 * height * width * (1 if self.dataset == "shapes" else self.count)

    def folder(self) -> Path | None:
        """The folder a ``folder:PATH`` set reads (None for the other sets)."""
        return Path(self.dataset.removeprefix("folder:")).expanduser() if self.dataset.startswith("folder:") else None

    def __len__(self) -> int:
        stored = self._stored()
        return self.count if stored is None else stored.shape[0]

    def shard(self, rank: int = 0, world: int = 1) -> torch.Tensor:
        """(n,) int64 the indices of this rank's share: every ``world``-th image from ``rank``."""
        return torch.arange(rank, len(self), world)

    def images(self, indices: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) uint8 images ``indices`` (any order, repeats allowed)."""
        indices = torch.as_tensor(indices, dtype=torch.int64).reshape(-1)
        outside = indices[(indices < 0) | (indices >= len(self))]
        if outside.numel():
            raise DatasetError(f"this image set has images 0..{len(self) - 1}, not {int(outside[0])}")
        stored = self._stored()
        if stored is None:
            return render_shapes(indices, self.image_size, self.seed, "train")[0]
        return stored[indices]

    def batches(
        self, batch_size: int, rank: int = 0, world: int = 1, indices: torch.Tensor | None = None
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(indices (B,), uint8 images (B, C, H, W)) of this rank's share (or of ``indices``), in order."""
        chosen = self.shard(rank, world) if indices is None else indices
        for batch in chosen.split(batch_size):
            yield batch, self.images(batch)


@functools.lru_cache(maxsize=2)
def _stored_images(dataset: str, count: int, image_size: tuple[int, int], seed: int) -> torch.Tensor:
    if dataset == PHOTOS:
        return _photos(image_size)[:count]
    return load_dataset(dataset, "train", image_size=image_size, size=count, seed=seed).images


def _photos(image_size: tuple[int, int]) -> torch.Tensor:
    """(n, 3, H, W) uint8: the bundled photos, each resized whole (no crop) as preprocess(whole=True) does."""
    folder = resources.app_root() / "assets" / "samples"
    files = sorted(path for path in folder.glob("*") if path.suffix.lower() in PHOTO_SUFFIXES)
    if not files:
        raise DatasetError("the bundled photos are missing from this installation; choose another image set")
    height, width = image_size
    pictures = [np.asarray(load_image(path).resize((width, height), Image.Resampling.BICUBIC)) for path in files]
    return torch.from_numpy(np.stack(pictures)).permute(0, 3, 1, 2).contiguous()  # (n, 3, H, W)


def model_input(model: ViT, images: torch.Tensor) -> torch.Tensor:
    """uint8 images (B, C, H, W) -> the model's input where the model is: resized to its image size
    if need be and normalised with its mean and std, as data.images.preprocess does for one image."""
    config = model.config
    parameter = next(model.parameters())
    pixels = images.to(parameter.device, torch.float32) / 255
    if config.in_chans == 1 and pixels.shape[1] == 3:
        pixels = torch.einsum("bchw,c->bhw", pixels, pixels.new_tensor(LUMA))[:, None]  # (B, 1, H, W)
    if tuple(pixels.shape[-2:]) != config.img_size:
        pixels = F.interpolate(pixels, size=config.img_size, mode="bicubic", antialias=True, align_corners=False)
    mean = pixels.new_tensor(config.mean).view(1, -1, 1, 1)
    std = pixels.new_tensor(config.std).view(1, -1, 1, 1)
    return ((pixels - mean) / std).to(parameter.dtype)


def tokens_per_image(model: ViT, prefix_tokens: bool = False) -> int:
    """How many tokens of one image an SAE of this model reads: its patches (and prefix tokens)."""
    grid_height, grid_width = model.grid_size()
    return grid_height * grid_width + (model.num_prefix_tokens if prefix_tokens else 0)


def layer_tokens(model: ViT, images: torch.Tensor, layer: int, prefix_tokens: bool = False) -> torch.Tensor:
    """(B, P, D) float32 the tokens leaving block ``layer`` (``capture(...).tokens[:, layer + 1]``)
    for normalised ``images`` (B, C, H, W), where the model is: its patch tokens, after the prefix
    tokens too with ``prefix_tokens``. Eval mode, no gradients; the blocks above ``layer`` do not run."""
    if not 0 <= layer < model.config.depth:
        raise ValueError(f"layer {layer} does not exist; the model has layers 0..{model.config.depth - 1}")
    parameter = next(model.parameters())
    with torch.no_grad(), eval_mode(model):
        x = model._pos_embed(model.patch_embed(images.to(parameter.device, parameter.dtype)))  # (B, N, D)
        x = model.norm_pre(x)
        rope = model.rope_tables(model.grid_size())
        for block in model.blocks[: layer + 1]:
            x = block(x, rope)
    return (x if prefix_tokens else x[:, model.num_prefix_tokens:]).float()


def source_tokens(
    model: ViT, source: ImageSource, indices: torch.Tensor, layer: int, prefix_tokens: bool, batch_size: int,
    device: torch.device | str,
) -> torch.Tensor:
    """(len(indices) * P, D) float32 on ``device``: the tokens of images ``indices``, image by image
    (row ``i * P + p`` is token ``p`` of ``indices[i]``), run ``batch_size`` images a pass."""
    per_image = tokens_per_image(model, prefix_tokens)
    out = torch.empty(len(indices) * per_image, model.config.embed_dim, device=device)
    row = 0
    for _, images in source.batches(batch_size, indices=indices):
        tokens = layer_tokens(model, model_input(model, images), layer, prefix_tokens)  # (B, P, D)
        out[row : row + tokens.shape[0] * per_image] = tokens.flatten(0, 1).to(device)
        row += tokens.shape[0] * per_image
    return out
