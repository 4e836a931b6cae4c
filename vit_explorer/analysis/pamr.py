"""PAMR, pixel-adaptive mask refinement (Araslanov & Roth, CVPR 2020): each pixel's class scores
replaced, a few times over, by its neighbours' weighted by how alike their colours are, so that a
patch-sized map snaps to the picture's edges. SCLIP and NACLIP refine their maps with it.

Ported from visinf/1-stage-wseg's models/mods/pamr.py (Copyright 2020 TU Darmstadt, Apache 2.0),
as NACLIP and SCLIP ship it (pamr.py): the same neighbours (8 a dilation, replicate padding), the
same affinity and softmax; the shift convolutions are written as slices, and the classes are
refined a few at a time (each class's refinement is its own), so that the memory held is the
picture's neighbours times a few classes rather than times all of them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

# The papers' setting: NACLIP's "PAMR on" (10 steps), SCLIP's pamr_stride.
STEPS = 10
DILATIONS = (8, 16)
# The 3 x 3 positions of the neighbours, in the order of the original's shift kernels.
_NEIGHBOURS = ((0, 0), (0, 1), (0, 2), (1, 0), (1, 2), (2, 0), (2, 1), (2, 2))
_WITH_CENTRE = ((0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2), (2, 0), (2, 1), (2, 2))
CLASS_CHUNK = 8


def _shifted(x: torch.Tensor, dilations: tuple[int, ...], positions) -> torch.Tensor:
    """(B, K, H, W) -> (B, K, P, H, W): each pixel's neighbours at ``positions`` of a 3 x 3 grid
    spread by each dilation, the border replicated (the original's conv2d with one-hot kernels)."""
    height, width = x.shape[-2:]
    out = []
    for d in dilations:
        padded = F.pad(x, [d] * 4, mode="replicate")
        out.extend(padded[..., i * d:i * d + height, j * d:j * d + width] for i, j in positions)
    return torch.stack(out, dim=2)


def affinity(image: torch.Tensor, dilations: tuple[int, ...] = DILATIONS) -> torch.Tensor:
    """(B, K, H, W) picture -> (B, 1, P, H, W): each pixel's weights over its neighbours (sum 1)."""
    deviation = _shifted(image, dilations, _WITH_CENTRE).std(2, keepdim=True)  # (B, K, 1, H, W)
    difference = (image.unsqueeze(2) - _shifted(image, dilations, _NEIGHBOURS)).abs()
    weights = (-difference / (1e-8 + 0.1 * deviation)).mean(1, keepdim=True)
    return weights.softmax(dim=2)


def pamr(image: torch.Tensor, mask: torch.Tensor, steps: int = STEPS, dilations: tuple[int, ...] = DILATIONS) -> torch.Tensor:
    """(B, K, H, W) picture and (B, C, h, w) class scores -> (B, C, H, W) refined scores (the
    scores first resized to the picture, bilinear, corners aligned as the original does)."""
    mask = F.interpolate(mask, size=image.shape[-2:], mode="bilinear", align_corners=True)
    weights = affinity(image, dilations)
    refined = []
    for chunk in mask.split(CLASS_CHUNK, dim=1):
        for _ in range(steps):
            chunk = (_shifted(chunk, dilations, _NEIGHBOURS) * weights).sum(2)
        refined.append(chunk)
    return torch.cat(refined, dim=1)
