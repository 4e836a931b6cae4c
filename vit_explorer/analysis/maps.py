"""Maps over the patch grid: one query's attention to the patches per head and layer, the
attention pool's probe, the mask holding most of a map's mass, and points of the picture on
grids of other sizes (two models side by side)."""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch
from einops import rearrange

from ..model.capture import Capture
from .checks import AnalysisError, full_precision, has_class_token


def query_map(
    matrix: torch.Tensor,
    grid_size: tuple[int, int],
    num_prefix_tokens: int,
    query: int | tuple[int, int] | None = None,
    *,
    class_token: bool | None = None,
) -> torch.Tensor:
    """One query's row of a token-mixing matrix (attention, rollout, relevance) over the patches.

    matrix: (..., N, N). ``query``: None for the class token, or without one the mean over the
    patch queries; an int patch index (0..gh*gw-1, row-major) or a (row, col) patch. Prefix
    columns are dropped. Returns (..., gh, gw). ``class_token`` defaults to "there are prefix
    tokens"; pass it for register-only models.
    """
    grid_h, grid_w = grid_size
    num_patches = grid_h * grid_w
    if matrix.shape[-1] != num_prefix_tokens + num_patches or matrix.shape[-2] != matrix.shape[-1]:
        raise AnalysisError(
            f"a matrix for {num_prefix_tokens} prefix tokens and a {grid_h}x{grid_w} grid must end"
            f" in ({num_prefix_tokens + num_patches}, {num_prefix_tokens + num_patches}),"
            f" not {tuple(matrix.shape[-2:])}"
        )
    if query is None:
        if has_class_token(num_prefix_tokens, class_token):
            row = full_precision(matrix[..., 0, :])
        else:
            row = full_precision(matrix[..., num_prefix_tokens:, :]).mean(dim=-2)
    else:
        row = full_precision(matrix[..., num_prefix_tokens + patch_index(query, grid_size), :])
    return rearrange(row[..., num_prefix_tokens:], "... (gh gw) -> ... gh gw", gh=grid_h)


def streamed_query_maps(
    layers: Iterable[torch.Tensor],
    grid_size: tuple[int, int],
    num_prefix_tokens: int,
    query: int | tuple[int, int] | None = None,
    *,
    class_token: bool | None = None,
) -> torch.Tensor:
    """(B, L, gh, gw): one query's attention to the patches (:func:`query_map`), the mean of the
    heads, in each of the layers' (B, H, N, N) attention given one at a time
    (vit_explorer.model.capture.layer_attentions): how where it looks changes with depth, one layer held."""
    maps = [
        query_map(attention, grid_size, num_prefix_tokens, query, class_token=class_token).mean(dim=1)
        for attention in layers
    ]
    if not maps:
        raise AnalysisError("the attention of at least one layer is needed")
    return torch.stack(maps, dim=1)


def patch_index(patch: int | tuple[int, int], grid_size: tuple[int, int]) -> int:
    """Row-major index of a patch given as an index or as (row, col); validated."""
    grid_h, grid_w = grid_size
    if isinstance(patch, Sequence):
        row, col = patch
        if not (0 <= row < grid_h and 0 <= col < grid_w):
            raise AnalysisError(f"patch ({row}, {col}) is outside the {grid_h}x{grid_w} grid")
        return int(row) * grid_w + int(col)
    if not 0 <= patch < grid_h * grid_w:
        raise AnalysisError(f"patch index must be in 0..{grid_h * grid_w - 1}, not {patch}")
    return int(patch)


def _layer_position(capture: Capture, layer: int) -> int:
    """Position in ``capture.attentions`` of encoder layer ``layer`` (negative from the end)."""
    depth = capture.tokens.shape[1] - 1
    wanted = layer + depth if layer < 0 else layer
    if not 0 <= wanted < depth:
        raise AnalysisError(f"layer {layer} does not exist; the model has layers 0..{depth - 1}")
    if wanted not in capture.layers:
        raise AnalysisError(
            f"layer {layer} was not captured; captured layers: {list(capture.layers)}"
        )
    return capture.layers.index(wanted)


def head_maps(
    capture: Capture,
    layer: int,
    query: int | tuple[int, int] | None = None,
    image: int = 0,
    *,
    class_token: bool | None = None,
) -> torch.Tensor:
    """(H, gh, gw): every head's attention from ``query`` (see :func:`query_map`) to the patches,
    for encoder layer ``layer`` (negative counts from the end) of batch element ``image``."""
    if not -capture.attentions.shape[0] <= image < capture.attentions.shape[0]:
        raise AnalysisError(
            f"image {image} is not in the batch of {capture.attentions.shape[0]} images"
        )
    attention = capture.attentions[image, _layer_position(capture, layer)]  # (H, N, N)
    return query_map(
        attention, capture.grid_size, capture.num_prefix_tokens, query, class_token=class_token
    )


def attention_map(
    capture: Capture,
    layer: int,
    head: int | None = None,
    query: int | tuple[int, int] | None = None,
    image: int = 0,
    *,
    class_token: bool | None = None,
) -> torch.Tensor:
    """(gh, gw): one head's attention from ``query`` to the patches (``head`` None: head mean)."""
    maps = head_maps(capture, layer, query, image, class_token=class_token)  # (H, gh, gw)
    if head is None:
        return maps.mean(dim=0)
    if not -maps.shape[0] <= head < maps.shape[0]:
        raise AnalysisError(f"head must be in 0..{maps.shape[0] - 1}, not {head}")
    return maps[head]


def pool_maps(capture: Capture, image: int = 0) -> torch.Tensor:
    """(H, gh, gw): where the attention pool's probe query reads, per head (a MAP-head model)."""
    if capture.pool_attentions is None:
        raise AnalysisError("this model has no attention-pool head, so there is no probe to show")
    grid_h, grid_w = capture.grid_size
    # The patches are the last tokens the probe reads (a Perception Encoder's also reads its class token).
    return rearrange(capture.pool_attentions[image, :, 0, -grid_h * grid_w :], "h (gh gw) -> h gh gw", gh=grid_h)


def pool_rollout_map(
    pool_attentions: torch.Tensor, rollout: torch.Tensor, grid_size: tuple[int, int],
    num_prefix_tokens: int,
) -> torch.Tensor:
    """(B, gh, gw): rollout continued through the attention pool. The probe's head-mean weights
    over the tokens it reads (B, nh, 1, P), the last P (the patches, or every token where the pool
    reads the prefix too), mix the rollout rows of those tokens (B, N, N)."""
    probe = pool_attentions.float().mean(dim=1)[:, 0]  # (B, P)
    row = torch.einsum("bp,bpn->bn", probe, rollout[:, -probe.shape[1] :].float())  # (B, N)
    return rearrange(row[:, num_prefix_tokens:], "b (gh gw) -> b gh gw", gh=grid_size[0])


def map_query(captured: Capture, class_token: bool | None = None) -> torch.Tensor:
    """(B, 1, N): the query the maps of a token-mixing matrix are drawn for, as weights over the
    tokens, so that ``map_query(c) @ matrix`` is the row :func:`query_map` (the class token's, or
    the mean of the patch queries) or :func:`pool_rollout_map` (the attention pool's probe) reads,
    for a matrix computed one row at a time (analysis.rollout_rows)."""
    prefix = captured.num_prefix_tokens
    batch = captured.tokens.shape[0]
    query = torch.zeros(batch, 1, captured.num_tokens)
    if captured.pool_attentions is not None:
        probe = captured.pool_attentions.float().mean(dim=1)[:, 0]  # (B, P): the last P tokens
        query[:, 0, captured.num_tokens - probe.shape[1] :] = probe
    elif has_class_token(prefix, class_token):
        query[:, 0, 0] = 1.0
    else:
        query[:, 0, prefix:] = 1.0 / (captured.num_tokens - prefix)
    return query


def attention_mask_by_mass(attn_map: torch.Tensor, mass: float = 0.6) -> torch.Tensor:
    """DINO's threshold: the smallest set of patches that holds ``mass`` of the attention.

    attn_map: (..., gh, gw) non-negative; leading dims are independent maps. Returns a bool
    mask of the same shape. A map that sums to zero holds no attention: its mask is empty.
    """
    if not 0.0 < mass <= 1.0:
        raise AnalysisError(f"mass must be in (0, 1], not {mass}")
    if bool((attn_map < 0).any()):
        raise AnalysisError("attention mass is defined for non-negative maps only")
    grid_h, grid_w = attn_map.shape[-2:]
    flat = rearrange(attn_map.float(), "... gh gw -> ... (gh gw)")
    values, order = flat.sort(dim=-1, descending=True)
    total = values.sum(dim=-1, keepdim=True)
    share = values / total.clamp(min=torch.finfo(values.dtype).tiny)
    # Keep a patch while the larger patches before it hold less than `mass`.
    before = share.cumsum(dim=-1) - share
    keep_sorted = (before < mass - 1e-6) & (total > 0)
    keep = torch.empty_like(keep_sorted).scatter_(-1, order, keep_sorted)
    return rearrange(keep, "... (gh gw) -> ... gh gw", gh=grid_h, gw=grid_w)


def matching_layer(layer: int, depth: int, other_depth: int) -> int:
    """The layer of a model ``other_depth`` deep at the same relative depth as ``layer`` of one
    ``depth`` deep: round(layer * (other_depth - 1) / (depth - 1)), halves rounded up, so that
    first meets first and last meets last. A one-layer model's layer is the other's last."""
    if not 0 <= layer < depth:
        raise AnalysisError(f"layer must be in 0..{depth - 1}, not {layer}")
    if other_depth < 1:
        raise AnalysisError(f"a model has at least one layer, not {other_depth}")
    if depth == 1:
        return other_depth - 1
    return math.floor(layer * (other_depth - 1) / (depth - 1) + 0.5)


def point_patch(point: tuple[float, float], grid_size: tuple[int, int]) -> int:
    """Row-major index of the patch of a ``grid_size`` grid that holds ``point``, given as (down,
    across) fractions of the image's height and width in [0, 1]: the same point of the picture
    on models whose grids differ (the far edges belong to the last row and column)."""
    down, across = point
    if not (0 <= down <= 1 and 0 <= across <= 1):
        raise AnalysisError(f"a point is (down, across) fractions in [0, 1], not {point}")
    grid_h, grid_w = grid_size
    row, col = min(int(down * grid_h), grid_h - 1), min(int(across * grid_w), grid_w - 1)
    return row * grid_w + col


def patch_point(patch: int, grid_size: tuple[int, int]) -> tuple[float, float]:
    """The centre of a patch (row-major index) as (down, across) fractions of the image."""
    row, col = divmod(patch_index(patch, grid_size), grid_size[1])
    return (row + 0.5) / grid_size[0], (col + 0.5) / grid_size[1]
