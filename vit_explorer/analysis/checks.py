"""What every analysis shares: its error, and the checks and conversions of the captured tensors
it is given."""
from __future__ import annotations

import torch


class AnalysisError(ValueError):
    """A request the analysis cannot answer (wrong shape, unknown layer, bad option)."""


def check_attentions(attentions: torch.Tensor) -> None:
    if attentions.ndim != 5 or attentions.shape[-1] != attentions.shape[-2]:
        raise AnalysisError(
            f"attentions must have shape (B, L, H, N, N), not {tuple(attentions.shape)}"
        )


def full_precision(values: torch.Tensor) -> torch.Tensor:
    """float32 for half-precision values (a float16 capture), anything else as it is."""
    return values.float() if values.dtype in (torch.float16, torch.bfloat16) else values


def has_class_token(num_prefix_tokens: int, class_token: bool | None) -> bool:
    # A capture only knows how many prefix tokens there are; registers without a class token
    # (timm's *_reg*_gap models) need class_token=False from model.config.class_token.
    return num_prefix_tokens > 0 if class_token is None else class_token
