"""timm's ViT state dicts (VisionTransformer): their parameter names are ours.

A timm family whose modules differ from VisionTransformer's has a reader of its own, recognised
before this fallback (weights._convert): Eva's (DINOv3, EVA-02) is from_eva.py.
"""

from __future__ import annotations

import torch


def convert(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict]:
    """(our state dict, config fields the shapes cannot tell): nothing to rename or add; timm's
    mean/std 0.5 (augreg) is our default."""
    return dict(state), {}
