"""Open-vocabulary dense maps: each patch carried into the texts' space by one method.

A minimal stand-in until the open-vocabulary methods land (branch openvocab): only MaskCLIP,
which is text.maps.patch_embeddings.
"""
from __future__ import annotations

import torch

from ..model.capture import Capture
from . import maps
from .towers import ImageTextModel

METHODS = {"maskclip": "MaskCLIP (Zhou et al. 2022): the last block's value path"}


def patch_embeddings(model: ImageTextModel, captured: Capture, method: str = "maskclip", proxy=None) -> torch.Tensor:
    """(B, gh * gw, E) unit patch embeddings in the texts' space, by ``method``."""
    if method not in METHODS:
        raise ValueError(f"unknown open-vocabulary method {method!r}; the methods are {', '.join(METHODS)}")
    return maps.patch_embeddings(model, captured)
