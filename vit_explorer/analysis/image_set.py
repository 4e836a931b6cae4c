"""Several images read together: what a model treats as the same across pictures.

Three analyses of one batched capture, each fitted or compared over all the images at once so
that a colour or a score means the same in every picture:

- :func:`joint_pca_foreground`, DINOv2's figure (Oquab et al. 2023, Fig. 1): a PCA of the last
  layer's patch tokens of all images; its first component, thresholded, separates foreground from
  background; a second PCA with three components over the foreground patches alone colours the
  parts.
- :func:`correspondence`: the cosine of one patch's features with every patch of every image, on
  a layer's tokens or its keys (the "facets" of Amir et al., dino-vit-features).
- :func:`norm_outliers`: the high-norm patch tokens (Darcet et al. 2023, "Vision Transformers
  need registers"), above the median norm plus k median absolute deviations.

Shapes: B images, P = gh * gw patches, D features. Patch tokens only: prefix tokens (class token,
registers) are dropped by :func:`patch_features`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from einops import rearrange

from ..model.internals import LayerInternals
from ..model.vit import ViT
from .checks import AnalysisError
from .tokens import principal_axes, scale_to_unit

MIN_IMAGES, MAX_IMAGES = 2, 6


def patch_features(tokens: torch.Tensor, num_prefix_tokens: int) -> torch.Tensor:
    """(B, N, D) tokens of one layer -> (B, P, D) float32 patch tokens (prefix tokens dropped)."""
    return tokens[:, num_prefix_tokens:].float()


@torch.no_grad()
def last_layer_features(model: ViT, tokens: torch.Tensor) -> torch.Tensor:
    """(B, P, D): the patch tokens leaving the last block, (B, N, D) ``tokens``, after the model's
    final norm, as DINOv2's figure takes them (its ``x_norm_patchtokens``)."""
    parameter = next(model.parameters())
    normed = model.norm(tokens.to(parameter.device, parameter.dtype)).float().cpu()
    return patch_features(normed, model.config.num_prefix_tokens)


def patch_keys(internals: LayerInternals, num_prefix_tokens: int) -> torch.Tensor:
    """(B, P, nh * hd): the layer's keys of the patches, heads side by side, as dino-vit-features'
    "key" facet."""
    keys = rearrange(internals.k, "b h n d -> b n (h d)")
    return keys[:, num_prefix_tokens:].float()


@torch.no_grad()
def layer_keys(model: ViT, tokens: torch.Tensor, layer: int, grid_size: tuple[int, int] | None = None) -> torch.Tensor:
    """(B, P, nh * hd): :func:`patch_keys` of ``layer`` from the (B, N, D) ``tokens`` entering it,
    computed by that layer's norm and qkv projection alone, the very operations its pass runs
    (a quarter of the block's work: the attention and the MLP are not needed for the keys).
    With rotary positions the keys are rotated as the pass rotates them, on ``grid_size`` (default:
    the model's grid)."""
    block = model.blocks[layer]
    parameter = next(model.parameters())
    normed = block.norm1(tokens.to(parameter.device, parameter.dtype))
    keys = block.attn.keys(normed, model.rope_tables(grid_size))  # (B, nh, N, hd)
    return rearrange(keys, "b h n d -> b n (h d)")[:, model.config.num_prefix_tokens:].float().cpu()


@dataclass(frozen=True)
class ForegroundPCA:
    """DINOv2's figure for a set of images on a gh x gw grid."""

    first_component: torch.Tensor  # (B, gh, gw) the joint first component in standard deviations (negated by flip)
    foreground: torch.Tensor  # (B, gh, gw) bool: first component above the threshold (after the flip)
    colours: torch.Tensor  # (B, gh, gw, 3) in [0, 1]: the foreground's three components; background 0
    explained: float  # the first component's share of the variance of all patches


def first_component(features: torch.Tensor) -> tuple[torch.Tensor, float]:
    """((B, P), share of variance): each patch's coordinate on the first principal axis of all
    images' patches together (B*P samples), divided by its standard deviation, so that a threshold
    reads in standard deviations and 0 splits by the sign."""
    samples = rearrange(features.float(), "b p d -> (b p) d")
    centred = samples - samples.mean(dim=0, keepdim=True)
    axis = principal_axes(samples, 1, randomized=True)[0]  # (D,) sign: its largest entry positive (arbitrary)
    projected = centred @ axis
    spread = projected.std()
    total = centred.pow(2).sum()
    explained = float(projected.pow(2).sum() / total) if total > 0 else 0.0
    scaled = projected / spread if spread > 0 else torch.zeros_like(projected)
    return scaled.reshape(features.shape[:2]), explained


def joint_pca_foreground(
    features: torch.Tensor, grid_size: tuple[int, int], threshold: float = 0.0, flip: bool = False,
    first: tuple[torch.Tensor, float] | None = None,
) -> ForegroundPCA:
    """DINOv2's figure from (B, P, D) patch features of B images.

    A patch is foreground where its first joint component (in standard deviations, negated with
    ``flip``: the sign of a principal axis is arbitrary) exceeds ``threshold``. The three colours
    are a second PCA fitted on the foreground patches of all images together, each component
    min-max scaled to [0, 1] over them; background patches are 0 (black). ``first``:
    :func:`first_component` of these features if already computed (it does not depend on the
    threshold, and its PCA over every patch is the larger of the two).
    """
    grid_h, grid_w = grid_size
    if features.ndim != 3 or features.shape[1] != grid_h * grid_w:
        raise AnalysisError(
            f"features must be (B, {grid_h * grid_w}, D) patch features for a {grid_h}x{grid_w} grid,"
            f" not {tuple(features.shape)}"
        )
    component, explained = first_component(features) if first is None else first
    if flip:
        component = -component
    foreground = component > threshold  # (B, P)
    colours = features.new_zeros(*features.shape[:2], 3)
    if foreground.any():
        chosen = features[foreground].float()  # (F, D) every image's foreground patches
        axes = principal_axes(chosen, 3, randomized=True)  # (3, D)
        projected = (chosen - chosen.mean(dim=0, keepdim=True)) @ axes.T  # (F, 3)
        colours[foreground] = scale_to_unit(projected, dims=(0,))

    def grid(values: torch.Tensor) -> torch.Tensor:
        return values.reshape(values.shape[0], grid_h, grid_w, *values.shape[2:])

    return ForegroundPCA(grid(component), grid(foreground), grid(colours), explained)


def cosine_matrix(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(P, Q): the cosine of every row of ``a`` (P, D) with every row of ``b`` (Q, D)."""
    a = torch.nn.functional.normalize(a.double(), dim=-1)
    b = torch.nn.functional.normalize(b.double(), dim=-1)
    return (a @ b.T).float()


def correspondence(features: torch.Tensor, image: int, patch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The cosine of patch ``patch`` of image ``image`` with every patch of every image, (B, P),
    and each image's best match, (B,) patch indices (on ``image`` itself: the patch itself)."""
    batch, patches = features.shape[:2]
    if not 0 <= image < batch or not 0 <= patch < patches:
        raise AnalysisError(f"patch {patch} of image {image} is outside {batch} images of {patches} patches")
    source = features[image, patch][None]  # (1, D)
    cosines = cosine_matrix(source, rearrange(features, "b p d -> (b p) d"))[0].reshape(batch, patches)
    best = cosines.argmax(dim=1)
    best[image] = patch  # a patch is its own best match (cosine 1); rounding must not pick a twin
    return cosines, best


@dataclass(frozen=True)
class NormOutliers:
    """The high-norm patches of a set of images at one layer."""

    norms: torch.Tensor  # (B, P) L2 norm of each patch token
    threshold: float  # median + k * MAD over all the images' patches
    median: float
    mad: float  # median absolute deviation from the median
    outliers: torch.Tensor  # (B, P) bool: norm above the threshold


def norm_outliers(features: torch.Tensor, k: float) -> NormOutliers:
    """Patch tokens whose L2 norm exceeds median + ``k`` x MAD, the median and the median absolute
    deviation taken over all the images' patches together (robust: a few huge artefact tokens
    move neither). Equal norms everywhere (MAD 0) give no outlier: the rule is strict."""
    norms = torch.linalg.vector_norm(features.float(), dim=-1)  # (B, P)
    median = norms.flatten().median()
    mad = (norms - median).abs().flatten().median()
    threshold = float(median + k * mad)
    return NormOutliers(norms, threshold, float(median), float(mad), norms > threshold)
