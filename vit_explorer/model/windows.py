"""Window attention (Qwen2.5-VL's tower): a patch attends only to the patches of its window.

The grid is tiled into ``window`` x ``window`` squares of patches from the top-left corner (the
last row and column of windows are cut short where the grid ends), as transformers'
``get_vision_window_index`` does in merged units (window_size // spatial_merge_size //
patch_size of them, spatial_merge_size patches each). Qwen reorders its tokens so that each
window's are consecutive and attends within each run; here the tokens stay in row-major order
(every page draws on that grid) and the attention is masked instead: the same weights, zero
outside a patch's window. Prefix tokens, if a model has any, attend and are attended everywhere.
"""
from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=64)
def window_ids(grid_size: tuple[int, int], window: int) -> torch.Tensor:
    """(gh * gw,) long: each patch's window, row-major (window rows, then columns). Shared: never modify."""
    grid_h, grid_w = grid_size
    across = -(-grid_w // window)  # windows in a row of them
    rows = torch.arange(grid_h) // window
    cols = torch.arange(grid_w) // window
    return (rows[:, None] * across + cols[None, :]).flatten()


def window_mask(ids: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """(N, N) bool, True where a token may attend: patches (the last ``len(ids)`` tokens) within
    their window; the tokens before them everywhere and by everyone."""
    mask = torch.ones(num_tokens, num_tokens, dtype=torch.bool, device=ids.device)
    prefix = num_tokens - ids.shape[0]
    mask[prefix:, prefix:] = ids[:, None] == ids[None, :]
    return mask


class GridTables(tuple):
    """What a pass needs to know of its grid, besides the tokens: the rotary (sin, cos) tables
    (each (P, hd), or None without rotary positions), unpacked as a pair wherever they were, and
    ``windows``: each patch's window ((P,) long, :func:`window_ids`) for a model with window
    attention, else None."""

    windows: torch.Tensor | None

    def __new__(cls, sin: torch.Tensor | None, cos: torch.Tensor | None, windows: torch.Tensor | None = None):
        tables = super().__new__(cls, (sin, cos))
        tables.windows = windows
        return tables
