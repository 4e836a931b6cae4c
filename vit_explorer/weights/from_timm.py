"""timm's ViT state dicts (VisionTransformer): their parameter names are ours.

A timm family whose modules differ from VisionTransformer's (e.g. Eva's rotary positions) is
recognised here from its keys and renamed to ours, and config inference (infer.py) is taught
its shapes.
"""

from __future__ import annotations

import torch


def convert(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict]:
    """(our state dict, config fields the shapes cannot tell): nothing to rename or add; timm's
    mean/std 0.5 (augreg) is our default."""
    return dict(state), {}
