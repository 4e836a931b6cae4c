"""Activation patching's mechanics for one call: at named sites of a pass, some tokens' or heads'
activations taken from another run, something added, or every value recorded (with its graph, so
that a gradient can be taken with respect to it). The analysis (which run, which metric, the heat
maps) is vit_explorer.analysis.patching.

Sites of layer L, with TransformerLens's hook names:

    resid    the tokens entering block L (blocks.L.hook_resid_pre)            (B, N, D)
    attn     the attention branch's output, before layer scale (hook_attn_out) (B, N, D)
    mlp      the MLP branch's output (hook_mlp_out)                            (B, N, D)
    head     each head's output before the projection (attn.hook_z)            (B, nh, N, hd)
    mlp_in   the residual the MLP reads, before its norm (hook_resid_mid)      (B, N, D)

The patch rides :data:`vit_explorer.model.vit.ACTIVE_PATCH` for the passes of this call only, as a
knock-out does, so that the shared model is never hooked.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager

import torch

from .vit import ACTIVE_PATCH, ViT

Key = tuple[str, int]  # (site, layer)


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

    def edit(self, module: torch.nn.Module, site: str, value: torch.Tensor) -> torch.Tensor:
        key = (site, self._layer[module])
        if key in self.replace:
            mask, source = self.replace[key]
            mask = mask[:, :, None, None] if site == "head" else mask[:, :, None]
            value = torch.where(mask.to(value.device), source.to(value.dtype), value)
        if key in self.add:
            value = value + self.add[key].to(value.dtype)
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
