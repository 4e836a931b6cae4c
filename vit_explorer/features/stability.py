"""Seed stability: do two dictionaries (two seeds, or two settings) of the same layer find the same
latents? Their decoder directions are matched one to one by the Hungarian algorithm
(scipy.optimize.linear_sum_assignment on their cosines, as overcomplete's cosine_hungarian_loss
matches them), and a latent is found again when its partner lies at cosine >= 0.9.

Two shares: of every latent (as overcomplete counts), and, given tokens, of the first dictionary's
firings on them (each latent weighted by how often it fires). An overcomplete dictionary keeps
latents that almost never fire (AuxK revives them now and then): on planted data with 48
directions a 96-latent dictionary fires 48 of them on > 0.3% of tokens and two seeds share those,
while the others are noise, so the share of every latent says ~50% where the used share says 95%.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from .sae import SAEError, SparseAutoencoder

MATCHED = 0.9  # a latent whose partner's direction is at least this close is found again
# The assignment is cubic in the latents: 8,192 of them take about a minute on a 2-core CPU.
MAX_MATCHED_LATENTS = 8192
ENCODED_TOKENS = 4096  # tokens encoded at once when counting firings


@dataclass(frozen=True)
class Stability:
    cosines: np.ndarray  # (F1,) each of the first dictionary's latents' cosine with its partner (0: none)
    share: float  # of the first dictionary's latents, those found again
    used_share: float | None  # of its firings on the tokens given, those of latents found again


def matched_cosines(first: SparseAutoencoder, second: SparseAutoencoder) -> np.ndarray:
    """(F1,) each of the first dictionary's latents' decoder cosine with its partner in the second
    (the pairs maximising their sum; 0 for a latent left without one when F1 > F2); an SAEError
    sentence for dictionaries of different token widths or too many latents."""
    if first.config.d_model != second.config.d_model:
        raise SAEError(f"these dictionaries read {first.config.d_model}- and {second.config.d_model}-wide tokens:"
                       " they are not of the same layer")
    largest = max(first.config.width, second.config.width)
    if largest > MAX_MATCHED_LATENTS:
        raise SAEError(f"matching {largest:,} latents one to one is more than this computes"
                       f" ({MAX_MATCHED_LATENTS:,} at most)")
    from scipy.optimize import linear_sum_assignment

    with torch.no_grad():
        cosines = (F.normalize(first.W_dec.float(), dim=1) @ F.normalize(second.W_dec.float(), dim=1).T).cpu().numpy()
    rows, columns = linear_sum_assignment(cosines, maximize=True)
    matched = np.zeros(first.config.width)
    matched[rows] = cosines[rows, columns]
    return matched


def stability(first: SparseAutoencoder, second: SparseAutoencoder, tokens: torch.Tensor | None = None,
              threshold: float = MATCHED) -> Stability:
    """How many of ``first``'s latents ``second`` finds again (at cosine >= ``threshold``); with
    ``tokens`` (N, D) of their layer, also the share of ``first``'s firings on them."""
    cosines = matched_cosines(first, second)
    found = cosines >= threshold
    used = None
    if tokens is not None:
        firings = np.zeros(first.config.width)
        with torch.no_grad():
            for piece in tokens.split(ENCODED_TOKENS):  # (n, F1) at a time, not (N, F1)
                firings += (first.encode(piece.to(first.W_dec.device).float()) > 0).sum(0).cpu().double().numpy()
        used = float((firings * found).sum() / firings.sum()) if firings.sum() > 0 else float("nan")
    return Stability(cosines, float(found.mean()), used)
