"""DINOv3's own picture of dense features (Siméoni et al. 2025; their ``notebooks/pca.ipynb``).

The notebook's recipe, step by step, and what this module does for each:

1. The image resized to a multiple of the patch size keeping its aspect ratio, 768 px high
   (``resize_transform``: ``h_patches = IMAGE_SIZE / PATCH_SIZE``, ``w_patches = int(w * IMAGE_SIZE
   / (h * PATCH_SIZE))``): :func:`aspect_size`.
2. The last layer's patch tokens after the final norm (``get_intermediate_layers(..., norm=True)``,
   ``feats[-1]``, prefix tokens dropped): :func:`image_features` (or ``image_set.last_layer_features``
   of a capture already made).
3. The foreground: the notebook's linear classifier, trained on their data, median-filtered 3 x 3
   (``signal.medfilt2d``) and thresholded at 0.5. We have no such classifier: we take the side
   of the patches' first principal component away from the picture's border (DINOv2's rule of the
   first component, oriented), median-filtered the same way: :func:`foreground_masks`.
4. ``PCA(n_components=3, whiten=True)`` fitted on the foreground patches, applied to every patch,
   ``sigmoid(2 x)`` for the colours, the background set to black: :func:`dense_pca`.

Several images share one PCA (and one first component) fitted over the patches of all of them, so
that a colour means the same part in every picture. Each image keeps its own grid (its own aspect
ratio): features are a list of (gh * gw, D), one per image.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from ..data.images import preprocess
from ..model.vit import ViT
from .checks import AnalysisError
from .image_set import first_component
from .pixels import display_image
from .tokens import principal_axes

SIDE = 768  # the notebook's IMAGE_SIZE: the height of the input, in pixels
SCALE = 2.0  # the notebook's colours: sigmoid(projected.mul(2.0)), "to get vibrant colors"
# The most patches an image is read with here: a ViT-S/16 at 768 px on a 16:9 picture (48 x 85).
# A model with small patches would have many more (the shapes model at patch 4: 192 x 192).
MAX_PATCHES = 4096


def aspect_size(image_size: tuple[int, int], patch_size: int, side: int = SIDE) -> tuple[int, int]:
    """(height, width) in pixels of the input for a picture of ``image_size`` = (width, height),
    PIL's order: ``side`` px high in whole patches, the width following the picture's aspect ratio,
    rounded down to whole patches (at least one), as the notebook's ``resize_transform``."""
    width, height = image_size
    rows = side // patch_size
    columns = max(int(width * side / (height * patch_size)), 1)
    return rows * patch_size, columns * patch_size


def within_limit(size: tuple[int, int], patch_size: int) -> bool:
    """Whether an input of ``size`` = (height, width) px has at most MAX_PATCHES patches."""
    return (size[0] // patch_size) * (size[1] // patch_size) <= MAX_PATCHES


@torch.no_grad()
def image_features(model: ViT, image: Image.Image) -> tuple[torch.Tensor, np.ndarray]:
    """(gh * gw, D) float32 patch tokens leaving the last block after the final norm, from one pass
    of ``image`` resized to the model's input size (no attention recorded), and (H, W, 3) uint8
    the picture as the model saw it. The whole picture, never a publisher's crop: the size is the
    picture's own aspect ratio (aspect_size), chosen to show all of it."""
    parameter = next(model.parameters())
    x = preprocess(image, model.config, whole=True)  # (1, C, H, W)
    tokens = model.forward_features(x.to(parameter.device, parameter.dtype))  # (1, N, D)
    return tokens[0, model.config.num_prefix_tokens:].float().cpu(), display_image(x, model.config)


def _check(features: Sequence[torch.Tensor], grids: Sequence[tuple[int, int]]) -> None:
    if not features or len(features) != len(grids):
        raise AnalysisError(f"one grid per image is needed: {len(features)} images, {len(grids)} grids")
    for values, (grid_h, grid_w) in zip(features, grids):
        if values.ndim != 2 or values.shape[0] != grid_h * grid_w:
            raise AnalysisError(
                f"features must be ({grid_h * grid_w}, D) patch features for a {grid_h}x{grid_w} grid,"
                f" not {tuple(values.shape)}"
            )


def _border(grid_h: int, grid_w: int) -> torch.Tensor:
    """(gh, gw) bool: the patches on the edge of the picture."""
    border = torch.ones(grid_h, grid_w, dtype=torch.bool)
    border[1:-1, 1:-1] = False
    return border


def _median_3x3(values: torch.Tensor) -> torch.Tensor:
    """(gh, gw) -> (gh, gw): the median of each patch's 3 x 3 neighbourhood, outside the grid
    counting as background (-inf), as ``medfilt2d``'s zero padding does to a probability."""
    padded = F.pad(values[None, None], (1, 1, 1, 1), value=-float("inf"))
    return F.unfold(padded, 3).median(dim=1).values.reshape(values.shape)  # (9, gh*gw) -> (gh, gw)


def foreground_masks(
    features: Sequence[torch.Tensor], grids: Sequence[tuple[int, int]], flip: bool = False
) -> list[torch.Tensor]:
    """(gh, gw) bool per image: the patches on the object's side of the first principal component
    of all the images' patches together, median-filtered 3 x 3 like the notebook's mask.

    The component's sign is arbitrary: it is oriented so that the picture's border (mostly
    background) lies on average below 0, and ``flip`` takes the other side. A patch counts as
    foreground where its filtered coordinate is above 0."""
    _check(features, grids)
    component, _ = first_component(torch.cat(list(features))[None].float())  # (1, sum of P)
    maps = [part.reshape(grid) for part, grid in zip(component[0].split([g[0] * g[1] for g in grids]), grids)]
    border = torch.cat([values[_border(*values.shape)] for values in maps])
    sign = -1.0 if (border.mean() > 0) != flip else 1.0
    return [_median_3x3(sign * values) > 0 for values in maps]


@dataclass(frozen=True)
class DensePCA:
    """DINOv3's picture of one image or a set."""

    colours: list[torch.Tensor]  # (gh, gw, 3) per image in (0, 1): sigmoid(2 x) of the whitened components; background 0
    foreground: list[torch.Tensor]  # (gh, gw) bool per image: the patches the PCA was fitted on


def dense_pca(
    features: Sequence[torch.Tensor], grids: Sequence[tuple[int, int]], foreground: Sequence[torch.Tensor]
) -> DensePCA:
    """The notebook's ``PCA(n_components=3, whiten=True)`` fitted on the ``foreground`` patches of
    every image together ((gh * gw, D) ``features`` and (gh, gw) bool masks, one each), applied to
    every patch, coloured ``sigmoid(2 x)``, the background black.

    Whitened as scikit-learn does: each component divided by its standard deviation over the
    foreground (the singular value over sqrt(F - 1)), so it has unit variance there. The axes are
    the randomized PCA's of :func:`analysis.token_pca`, signed (largest entry positive) as
    scikit-learn's ``svd_flip`` signs them: the same features always give the same colours."""
    _check(features, grids)
    masks = [mask.reshape(-1) for mask in foreground]
    if [mask.numel() for mask in masks] != [values.shape[0] for values in features]:
        raise AnalysisError("each foreground mask must cover its image's grid")
    samples = torch.cat(list(features)).float()  # (sum of P, D)
    chosen = torch.cat(masks)
    colours = samples.new_zeros(samples.shape[0], 3)
    if chosen.any():
        fitted = samples[chosen]  # (F, D)
        mean = fitted.mean(dim=0, keepdim=True)
        axes = principal_axes(fitted, 3, randomized=True)  # (3, D)
        spread = ((fitted - mean) @ axes.T).pow(2).sum(dim=0).div(max(fitted.shape[0] - 1, 1)).sqrt()  # (3,)
        whitened = ((samples - mean) @ axes.T) / torch.where(spread > 0, spread, 1.0)  # (sum of P, 3)
        colours = torch.sigmoid(SCALE * whitened) * chosen[:, None]
    sizes = [grid_h * grid_w for grid_h, grid_w in grids]
    return DensePCA(
        [part.reshape(*grid, 3) for part, grid in zip(colours.split(sizes), grids)],
        [mask.reshape(grid) for mask, grid in zip(masks, grids)],
    )
