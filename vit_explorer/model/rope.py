"""Rotary position embeddings (RoPE, Su et al. 2021) of the patch tokens, as DINOv3 and EVA-02 use them.

Instead of adding a position vector to the tokens, each patch's query and key are rotated, pair of
channels by pair, by angles that grow with its position along the two image axes; the score
q . k of two patches then depends on their positions only through the difference of their angles.
The prefix tokens (class, registers) are not rotated. Two flavours, with timm's numerics
(``layers/pos_embed_sincos.py``):

- "dinov3" (RotaryEmbeddingDinoV3): patch centres normalised to [-1, 1] per axis, so the angles
  span the same range at any grid; angle = 2 pi coordinate / period with periods
  ``temperature ** (2 i / (hd / 2))``, temperature 100; rotate-half layout (channel i turns with
  channel i + hd/2).
- "cat" (EVA-02, RotaryEmbeddingCat): patch indices 0, 1, ... (plus ``grid_offset``: the Perception
  Encoder's start at 1; rescaled to ``ref_feat_shape`` when set, for the 448 models fine-tuned from 224), angle = index * frequency with frequencies
  ``1 / temperature ** (i / (hd / 4))``, temperature 10000; interleaved layout (channel 2i turns
  with 2i + 1).
- "axial" (Qwen2.5-VL's and Qwen3-VL's towers, transformers' Qwen2_5_VLVisionRotaryEmbedding):
  EVA-02's patch indices and frequencies, DINOv3's rotate-half layout.

Either way a patch has hd/2 angles: the first hd/4 from its row coordinate, the last hd/4 from its
column coordinate ("ij"; "xy" swaps the two). The sin/cos tables of a grid are computed once (on
the CPU in float32, then kept per device) and shared by every pass: callers never modify them.
No coordinate augmentation: that is a training-time option of DINOv3 that inference does not use.
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch

from .config import ViTConfig


class RopeSpec(NamedTuple):
    """What a model's rotation depends on, besides the grid (hashable: it keys the table cache)."""

    rope_type: str
    head_dim: int
    temperature: float
    grid_indexing: str
    ref_feat_shape: tuple[int, int] | None
    periods_dtype: str
    grid_offset: float = 0.0

    @classmethod
    def of(cls, config: ViTConfig) -> RopeSpec | None:
        if config.rope_type is None:
            return None
        return cls(
            config.rope_type, config.head_dim, config.rope_base, config.rope_grid_indexing,
            config.ref_feat_shape, config.rope_periods_dtype, float(config.rope_grid_offset),
        )

    @property
    def rotate_half(self) -> bool:
        """DINOv3 and Qwen-VL pair channel i with i + hd/2; EVA-02 pairs neighbours 2i, 2i + 1."""
        return self.rope_type in ("dinov3", "axial")


def _frequencies(spec: RopeSpec) -> torch.Tensor:
    """(hd/4,) float32: DINOv3's periods, or EVA-02's (and Qwen-VL's) frequencies (radians per patch index)."""
    bands = spec.head_dim // 4
    if spec.rope_type == "dinov3":
        exponents = 2.0 * torch.arange(bands, dtype=torch.float32) / (spec.head_dim // 2)
    else:
        exponents = torch.arange(bands, dtype=torch.int64).to(torch.float32) / bands
    values = spec.temperature**exponents
    values = values if spec.rope_type == "dinov3" else 1.0 / values
    if spec.periods_dtype == "bfloat16":
        values = values.to(torch.bfloat16).to(torch.float32)
    return values


def _coordinates(spec: RopeSpec, grid_size: tuple[int, int]) -> torch.Tensor:
    """(gh * gw, 2) float32: each patch's coordinates, row-major, (row, column) for "ij"."""
    if spec.rope_type == "dinov3":
        axes = [torch.arange(0.5, side, dtype=torch.float32) / float(side) for side in grid_size]
    else:
        axes = [torch.arange(side, dtype=torch.int64).to(torch.float32) + spec.grid_offset for side in grid_size]
        if spec.ref_feat_shape is not None:
            axes = [axis / side * ref for axis, side, ref in zip(axes, grid_size, spec.ref_feat_shape)]
    grid = torch.stack(torch.meshgrid(*axes, indexing="ij"), dim=-1)  # (gh, gw, 2)
    if spec.rope_type == "dinov3":
        grid = 2.0 * grid - 1.0  # [0, 1] -> [-1, 1]
    if spec.grid_indexing == "xy":
        grid = grid.flip(-1)  # (column, row)
    return grid.flatten(0, 1)


def angles(spec: RopeSpec, grid_size: tuple[int, int]) -> torch.Tensor:
    """(gh * gw, hd/2) float32 radians: each patch's rotation angles, row-major; the first hd/4
    from its first coordinate, the rest from its second."""
    coordinates = _coordinates(spec, tuple(grid_size))[:, :, None]  # (P, 2, 1)
    if spec.rope_type == "dinov3":
        turned = 2 * math.pi * coordinates / _frequencies(spec)[None, None, :]
    else:
        turned = coordinates * _frequencies(spec)
    return turned.flatten(1)  # (P, 2 * hd/4)


def rope_angles(config: ViTConfig, grid_size: tuple[int, int] | None = None) -> torch.Tensor | None:
    """(gh * gw, hd/2) the rotation angles (radians) of every patch of ``grid_size`` (default: the
    config's grid) for a model of ``config``; None for a model without rotary positions."""
    spec = RopeSpec.of(config)
    return None if spec is None else angles(spec, tuple(grid_size or config.grid_size))


@functools.lru_cache(maxsize=64)
def rope_tables(
    spec: RopeSpec, grid_size: tuple[int, int], device: torch.device = torch.device("cpu")
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sin, cos), each (gh * gw, hd) float32, laid out as ``spec`` pairs the channels. Computed
    once per (spec, grid, device) and shared by every pass and thread: never modify them."""
    if torch.device(device).type != "cpu":
        sin, cos = rope_tables(spec, grid_size)
        return sin.to(device), cos.to(device)
    turned = angles(spec, grid_size)
    sin, cos = turned.sin(), turned.cos()
    if spec.rotate_half:
        return torch.cat([sin, sin], dim=-1), torch.cat([cos, cos], dim=-1)
    return sin.repeat_interleave(2, -1), cos.repeat_interleave(2, -1)


def _turn_quarter(x: torch.Tensor, rotate_half: bool) -> torch.Tensor:
    """Each pair (a, b) of channels -> (-b, a): the pair turned by 90 degrees."""
    if rotate_half:
        first, second = x.chunk(2, dim=-1)
        return torch.cat([-second, first], dim=-1)
    return torch.stack([-x[..., 1::2], x[..., ::2]], dim=-1).flatten(-2)


def apply_rope(
    x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor], rotate_half: bool, num_prefix_tokens: int
) -> torch.Tensor:
    """(B, nh, N, hd) queries or keys -> the same with every patch token rotated by its angles
    (``tables`` from :func:`rope_tables`, or some of their rows: (P, hd) each, or (B, 1, P, hd)
    with each image's own patches); the ``num_prefix_tokens`` first tokens are left as they
    are. The rotation is done in float32 at least and returned in x's dtype, as timm does."""
    sin, cos = tables  # (P, hd) or (B, 1, P, hd) each
    prefix, patches = x[:, :, :num_prefix_tokens], x[:, :, num_prefix_tokens:]
    turned = patches * cos + _turn_quarter(patches, rotate_half) * sin
    return torch.cat([prefix, turned.to(x.dtype)], dim=2)


# --- what the pages teach with: the angles' periods, and scores that depend only on the offset -----


class AnglePair(NamedTuple):
    """One of a patch's hd/2 rotation angles (``index``): the two channels of q and k it turns, the
    grid axis it turns with ("row": moving down the image, "column": moving across) and how many
    patches along that axis make one full turn (its period, on this grid)."""

    index: int
    channels: tuple[int, int]
    axis: str
    period: float


def angle_pairs(spec: RopeSpec, grid_size: tuple[int, int], count: int = 4) -> list[AnglePair]:
    """``count`` pairs per axis, evenly spread from the slowest-turning band to the fastest, the
    row's pairs first. The periods are read off the angles themselves (the step from one patch to
    the next along the pair's axis), so they hold for either flavour at any grid."""
    grid_size = tuple(grid_size)
    turned = angles(spec, grid_size)  # (P, hd/2)
    bands = spec.head_dim // 4
    chosen = sorted({round(step * (bands - 1) / max(count - 1, 1)) for step in range(count)}, reverse=True)
    # The first hd/4 angles follow the first coordinate: the row for "ij", the column for "xy".
    first, second = ("row", "column") if spec.grid_indexing == "ij" else ("column", "row")
    pairs = []
    for half, axis in enumerate((first, second)):
        # The next patch along this axis: one row down (index + gw) or one column across (index + 1).
        neighbour = grid_size[1] if axis == "row" else 1
        side = grid_size[0] if axis == "row" else grid_size[1]
        for band in chosen:
            index = half * bands + band
            step = float(turned[neighbour, index] - turned[0, index]) if side > 1 else 0.0
            channels = (index, index + spec.head_dim // 2) if spec.rotate_half else (2 * index, 2 * index + 1)
            pairs.append(AnglePair(index, channels, axis, 2 * math.pi / abs(step) if step else math.inf))
    return sorted(pairs, key=lambda pair: (pair.axis != "row", -pair.period))


def farthest_corner(position: int, grid_size: tuple[int, int]) -> int:
    """The corner patch (row-major index) farthest from patch ``position``: where a query moves to
    show that the scores move with it."""
    grid_h, grid_w = grid_size
    row, col = divmod(position, grid_w)
    return (0 if 2 * row >= grid_h - 1 else grid_h - 1) * grid_w + (0 if 2 * col >= grid_w - 1 else grid_w - 1)


def offset_scores(
    spec: RopeSpec, q_content: torch.Tensor, k_content: torch.Tensor, grid_size: tuple[int, int],
    query_position: int, scale: float | None = None,
) -> torch.Tensor:
    """(gh * gw,) the score (q . k) * scale of one query content rotated at patch ``query_position``
    against one key content rotated at every patch in turn, with the tables the model uses
    (``scale`` default 1/sqrt(hd), the model's). The contents (hd,) are fixed, so what changes
    from patch to patch is the positional part alone: it depends only on the key's offset from the
    query, and moving the query moves the whole map with it. With a token's q and a key's k before
    the rotation (LayerInternals.q_unrotated, k_unrotated) the value at that key's patch is the
    model's own score. No forward pass: two rotations and a matrix-vector product."""
    tables = rope_tables(spec, tuple(grid_size))  # (sin, cos), each (P, hd)
    scale = spec.head_dim**-0.5 if scale is None else scale
    # Both contents placed at every patch: (2, 1, P, hd) as apply_rope takes (B, nh, N, hd).
    placed = torch.stack([q_content, k_content]).float()[:, None, None, :].expand(-1, -1, tables[0].shape[0], -1)
    queries, keys = apply_rope(placed, tables, spec.rotate_half, 0)[:, 0]  # (P, hd) each
    return keys @ (queries[query_position] * scale)  # (P,)
