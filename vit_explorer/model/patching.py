"""Activation patching's mechanics for one call: at named sites of a pass, some tokens' or heads'
activations taken from another run, something added, or every value recorded (with its graph, so
that a gradient can be taken with respect to it). The analysis (which run, which metric, the heat
maps) is vit_explorer.analysis.patching.

Sites of layer L, with TransformerLens's hook names:

    resid    the tokens entering block L (blocks.L.hook_resid_pre)            (B, N, D)
    attn     the attention branch's output, before layer scale (hook_attn_out) (B, N, D)
    mlp      the MLP branch's output (hook_mlp_out)                            (B, N, D)
    head     each head's output before the projection (attn.hook_z)            (B, nh, N, hd)
    mlp_in   what the MLP reads, before its norm; the residual stream keeps its own (B, N, D)

The patch rides :data:`vit_explorer.model.vit.ACTIVE_PATCH` for the passes of this call only, as a
knock-out does, so that the shared model is never hooked. :func:`rest_of_pass` runs a patched pass
from a layer on, its last block for the tokens the head reads only.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from einops import rearrange

from .vit import ACTIVE_PATCH, ViT, active

Key = tuple[str, int]  # (site, layer)
# What the last block costs computed for a row or two (:func:`rest_of_pass`), as a share of the
# whole block: every token's q, k and v (3 of a block's 12 D^2 multiply-adds a token), the rest for
# those rows only.
ROWS_SHARE = 0.25


class Patch:
    """What one call's passes do at each site. ``replace`` maps (site, layer) to (mask, source):
    mask (B, N) over tokens, (B, nh) over heads for "head", True where the value is the source's
    (1 or B, ...) instead; ``add`` maps (site, layer) to a tensor added to the value; ``record``
    names the sites whose values (after the edits) are kept in :attr:`recorded`."""

    def __init__(
        self, model: ViT, replace: Mapping[Key, tuple[torch.Tensor, torch.Tensor]] | None = None,
        add: Mapping[Key, torch.Tensor] | None = None, record: Iterable[str] = (),
    ):
        self.replace = dict(replace or {})
        self.add = dict(add or {})
        self.record = frozenset(record)
        self.recorded: dict[Key, torch.Tensor] = {}
        self._layer = {module: layer for layer, block in enumerate(model.blocks) for module in (block, block.attn)}

    def edit(self, module: torch.nn.Module, site: str, value: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """``value`` of ``site`` at ``module``'s layer, edited; ``rows``: it holds those tokens only
        (a block computed for a few queries), so the edits' tokens are picked likewise."""
        key = (site, self._layer[module])
        if key in self.replace:
            mask, source = self.replace[key]
            if rows is not None:
                mask, source = (mask, source[:, :, rows]) if site == "head" else (mask[:, rows], source[:, rows])
            mask = mask[:, :, None, None] if site == "head" else mask[:, :, None]
            value = torch.where(mask.to(value.device), source.to(value.dtype), value)
        if key in self.add:
            added = self.add[key]
            value = value + (added if rows is None else added[:, rows]).to(value.dtype)
        if site in self.record:
            self.recorded[key] = value
        return value


@contextmanager
def patching(patch: Patch) -> Iterator[Patch]:
    """Forward passes in this context (thread) run with ``patch``."""
    token = ACTIVE_PATCH.set(patch)
    try:
        yield patch
    finally:
        ACTIVE_PATCH.reset(token)


def pooled_rows(model: ViT) -> tuple[int, ...] | None:
    """The tokens the head reads after the last block when they are prefix tokens (the class token,
    and DeiT's distillation token); None when it reads every patch (mean pool, attention pool)."""
    if model.config.dist_token:
        return (0, 1)
    if model.attn_pool is None and model.config.global_pool != "mean" and model.config.class_token:
        return (0,)
    return None


def rest_of_pass(model: ViT, x: torch.Tensor, start: int, grid_size: tuple[int, int] | None = None) -> torch.Tensor:
    """(B, N, D) tokens entering block ``start`` -> the model's output (B, classes or D), as
    ``forward_head(forward_blocks(x, start))`` computes it, under the patch of this context; the
    last block computed for the :func:`pooled_rows` only where the head reads nothing else (every
    token still gives its key and value), a :data:`ROWS_SHARE` of that block."""
    rows = pooled_rows(model)
    if rows is None:
        return model.forward_head(model.forward_blocks(x, start, grid_size=grid_size))
    rope = model.rope_tables(grid_size)
    for block in model.blocks[start:-1]:
        x = block(x, rope)
    return model.forward_head(model.norm(_last_block_rows(model, x, torch.tensor(rows, device=x.device), rope)))


def _last_block_rows(model: ViT, x: torch.Tensor, rows: torch.Tensor, rope) -> torch.Tensor:
    """``Block.forward`` of the last block for the tokens ``rows`` of x (B, N, D) only, with the
    patch of this context applied to those rows (as model.capture._block_rows, without a recorder)."""
    block = model.blocks[-1]
    attn = block.attn
    patch = active(ACTIVE_PATCH)

    def edit(module: torch.nn.Module, site: str, value: torch.Tensor, picked: torch.Tensor | None = None) -> torch.Tensor:
        return value if patch is None else patch.edit(module, site, value, picked)

    x = edit(block, "resid", x)
    q, k, v = attn._qkv(block.norm1(x)).unbind(0)  # (B, nh, N, hd) each
    q, k = attn.rotate(q, rope)[:, :, rows], attn.rotate(k, rope)
    heads = edit(attn, "head", F.scaled_dot_product_attention(q, k, v), rows)  # (B, nh, rows, hd)
    attended = edit(block, "attn", attn.proj(attn.norm(rearrange(heads, "b nh n hd -> b n (nh hd)"))), rows)
    middle = x[:, rows] + block.ls1(attended)
    mlp_out = edit(block, "mlp", block.mlp(block.norm2(edit(block, "mlp_in", middle, rows))), rows)
    return middle + block.ls2(mlp_out)
