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
- "cat" (EVA-02, RotaryEmbeddingCat): patch indices 0, 1, ... (rescaled to ``ref_feat_shape`` when
  set, for the 448 models fine-tuned from 224), angle = index * frequency with frequencies
  ``1 / temperature ** (i / (hd / 4))``, temperature 10000; interleaved layout (channel 2i turns
  with 2i + 1).

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

    @classmethod
    def of(cls, config: ViTConfig) -> RopeSpec | None:
        if config.rope_type is None:
            return None
        return cls(
            config.rope_type, config.head_dim, config.rope_base, config.rope_grid_indexing,
            config.ref_feat_shape, config.rope_periods_dtype,
        )

    @property
    def rotate_half(self) -> bool:
        """DINOv3 pairs channel i with i + hd/2; EVA-02 pairs neighbours 2i, 2i + 1."""
        return self.rope_type == "dinov3"


def _frequencies(spec: RopeSpec) -> torch.Tensor:
    """(hd/4,) float32: DINOv3's periods, or EVA-02's frequencies (radians per patch index)."""
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
        axes = [torch.arange(side, dtype=torch.int64).to(torch.float32) for side in grid_size]
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
    (``tables`` from :func:`rope_tables`); the ``num_prefix_tokens`` first tokens are left as they
    are. The rotation is done in float32 at least and returned in x's dtype, as timm does."""
    sin, cos = tables  # (P, hd) each
    prefix, patches = x[:, :, :num_prefix_tokens], x[:, :, num_prefix_tokens:]
    turned = patches * cos + _turn_quarter(patches, rotate_half) * sin
    return torch.cat([prefix, turned.to(x.dtype)], dim=2)
