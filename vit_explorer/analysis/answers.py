"""The Lesson's questions answered from the model's own numbers for one image: where a guess
ranks (a patch in an attention map, a head in the importance sweep), which way a softmax moves
with its scale, whether a prediction survives a knock-out, and when the answer forms in depth.

Pure functions of tensors the pages already have; nothing here runs the model.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..model.internals import LayerInternals, scale_sweep


@dataclass(frozen=True)
class Rank:
    """Where one guess stands among all the candidates, ordered by a score (1: the top one)."""

    rank: int  # 1 + the number of candidates strictly ahead of the guess
    total: int  # candidates in all
    tied: int  # other candidates with exactly the guess's score
    best: int  # the index of the top candidate (the first of them on a tie)
    value: float  # the guess's score
    best_value: float

    @property
    def right(self) -> bool:
        return self.rank == 1

    @property
    def undecided(self) -> bool:
        """Half the candidates or more share the guess's score: the numbers pick nothing out (an
        untrained model's even attention, say)."""
        return 2 * (self.tied + 1) >= self.total

    @property
    def close(self) -> bool:
        """In the top 5% (at least the top 3): near enough to say so."""
        return self.rank <= max(3, round(0.05 * self.total))

    def verdict(self, what: str) -> str:
        """How the guess of a ``what`` ("patch", "head") did, in a few words."""
        if self.undecided:
            return f"No {what} stands out"
        return "Right" if self.right else "Close" if self.close else "Not this time"


def _rank(scores: torch.Tensor, guess: int, descending: bool = True) -> Rank:
    scores = scores.double().reshape(-1)
    if not 0 <= guess < scores.numel():
        raise ValueError(f"the guess must be one of the {scores.numel()} candidates, not {guess}")
    ordered = scores if descending else -scores
    value = ordered[guess]
    best = int(ordered.argmax())
    return Rank(
        rank=1 + int((ordered > value).sum()), total=scores.numel(), tied=int((ordered == value).sum()) - 1,
        best=best, value=float(scores[guess]), best_value=float(scores[best]),
    )


def patch_rank(attention_map: torch.Tensor, patch: int) -> Rank:
    """Where ``patch`` (row-major) stands among the patches of an attention map (gh, gw): the
    most attended first."""
    return _rank(attention_map, patch)


def head_rank(sweep_values: torch.Tensor, layer: int, head: int) -> Rank:
    """Where head ``head`` of ``layer`` stands in an importance sweep (L, H) (ablation.HeadSweep's
    values: the change of the prediction's log-probability, or of the pooled feature's cosine,
    when that head alone is knocked out): the head whose removal lowers it most first. ``best``
    and the guess count heads row-major, layer * H + head."""
    depth, heads = sweep_values.shape
    if not (0 <= layer < depth and 0 <= head < heads):
        raise ValueError(f"layer {layer}, head {head} is not one of the {depth} x {heads} heads")
    return _rank(sweep_values, layer * heads + head, descending=False)


def softmax_change(
    steps: LayerInternals, head: int, token: int, factor: float,
) -> tuple[str, dict[str, tuple[float, float]]]:
    """Which way the softmax of ``token``'s row in ``head`` (internals.scale_sweep, from the
    recorded q and k) moves at ``factor`` times the model's scale: "flatter" (more entropy),
    "sharper" (less) or "unchanged" (equal scores: uniform at any scale); with the entropy and the
    largest weight at the model's scale and at ``factor``: {"entropy": (own, at factor), ...}."""
    sweep = scale_sweep(steps, head, token, (1.0, factor))
    entropy, largest = sweep["entropy"], sweep["largest weight"]
    change = entropy[1] - entropy[0]
    verdict = "unchanged" if abs(change) <= 1e-9 * max(1.0, entropy[0]) else "flatter" if change > 0 else "sharper"
    return verdict, {"entropy": tuple(entropy), "largest weight": tuple(largest)}


def prediction_survives(intact: torch.Tensor, knocked: torch.Tensor) -> bool:
    """Whether the top class of the knocked-out pass's scores (C,) is the intact one's."""
    return int(intact.argmax()) == int(knocked.argmax())


def settled_from(lens: torch.Tensor) -> int:
    """The first row of a logit lens (L+1, C) (row 0: the embeddings, row l: after block l - 1)
    from which the final top class stays the top class in every row after it."""
    tops = lens.argmax(dim=-1)
    final = tops[-1]
    row = lens.shape[0] - 1
    while row > 0 and tops[row - 1] == final:
        row -= 1
    return row


def sharpest_head(rows: torch.Tensor) -> int:
    """The head whose attention row (H, N) for one query has the least entropy."""
    return int(torch.special.entr(rows.double()).sum(dim=-1).argmin())


def ordinal(number: int) -> str:
    """1st, 2nd, 3rd, 4th, ..., 11th, 12th, 13th, ..., 21st."""
    suffix = "th" if 10 <= number % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(number % 10, "th")
    return f"{number}{suffix}"


def numbers(*values: float) -> list[str]:
    """The ``values`` with the fewest decimals (2 to 4) that tell different ones apart (a cosine
    of 0.998 beside 1: "1.000" and "0.998", not "1.00" twice)."""
    for decimals in range(2, 5):
        shown = [f"{value:.{decimals}f}" for value in values]
        if len(set(shown)) == len(set(values)):
            break
    return shown


def percents(*values: float) -> list[str]:
    """The shares ``values`` as percentages with the fewest decimals (1 to 4) that tell different
    ones apart and show none but exactly 0 or 1 as 0% or 100% (99.97%, not 100.0%)."""
    for decimals in range(1, 5):
        shown = [f"{value:.{decimals}%}" for value in values]
        rounded = any(text in (f"{0:.{decimals}%}", f"{1:.{decimals}%}") and value not in (0, 1)
                      for text, value in zip(shown, values))
        if len(set(shown)) == len(set(values)) and not rounded:
            break
    return shown
