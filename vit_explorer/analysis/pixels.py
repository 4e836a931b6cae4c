"""A model's input back to the pixels it saw: the normalisation undone, an image to show."""
from __future__ import annotations

import numpy as np
import torch
from einops import rearrange

from ..model.config import ViTConfig
from .checks import AnalysisError


def denormalize(pixels: torch.Tensor, config: ViTConfig) -> torch.Tensor:
    """Undo the model's input normalisation: (..., C, h, w) -> pixels in [0, 1].

    Works for images (B, C, H, W) and for ``Capture.patches`` (B, gh, gw, C, p, p) alike.
    """
    mean = torch.tensor(config.mean, dtype=torch.float32)[:, None, None]  # (C, 1, 1)
    std = torch.tensor(config.std, dtype=torch.float32)[:, None, None]
    return (pixels.detach().float().cpu() * std + mean).clamp(0.0, 1.0)


def display_image(x: torch.Tensor, config: ViTConfig) -> np.ndarray:
    """The image the model actually sees, (H, W, 3) uint8, from one normalised input (C, H, W)
    or (1, C, H, W); one-channel inputs are repeated to grey RGB."""
    if x.ndim == 4:
        if x.shape[0] != 1:
            raise AnalysisError(f"display_image takes one image, not a batch of {x.shape[0]}")
        x = x[0]
    pixels = rearrange(denormalize(x, config), "c h w -> h w c")
    if pixels.shape[-1] == 1:
        pixels = pixels.expand(-1, -1, 3)
    return (pixels * 255).round().to(torch.uint8).numpy()
