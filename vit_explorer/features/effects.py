"""Which latents matter for this prediction: each latent's effect on the model's output for one
image, first-order (activation x gradient, attribution patching: Nanda 2023, Syed et al. 2023), the
top few checked by really removing them.

The tokens leaving block ``layer`` are rewritten as the dictionary's reconstruction plus its error,
``tokens = decode(latents) + error``, the error held fixed: the pass from there gives the model's
own output exactly, and a latent's removal is the steered pass with its factor 0
(features.steering: ``activation * direction`` taken from every token it fires on). The metric:

- a classifier: the log-probability of its predicted class. It counts the other classes (a logit
  alone does not: raising every logit changes nothing), it is the model's own loss for that class,
  and a first-order change of it maps to points of probability through ``p (e^change - 1)``, which
  stays between -p and 1 - p (a linear estimate of the probability itself can claim more than 100
  points). Its gradient shrinks as the prediction saturates, like the probability's: there the
  estimates are small, and the real removals say how far first order is off.
- a text tower's labels (CLIP, SigLIP: :class:`LabelScores`): the log-score of the best label, a
  log-softmax over the labels (CLIP) or its own log-sigmoid (SigLIP), for the same reasons.
- a headless model without labels: the pooled output's length along its intact direction, as a share of its
  intact length (1 intact). Its cosine with the intact output is at its maximum there, so its
  gradient is 0 and would estimate 0 for every latent; the real removals report the cosine too.

Costs, in forwards of the model: the tokens at ``layer`` come from the caller (the page's capture);
one forward and one backward (about twice a forward) of the blocks above ``layer``, then the
removals of the top latents batched, each again those blocks (the last one for the pooled rows only
where the head reads nothing else, as model.patching.rest_of_pass does).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..model.patching import ROWS_SHARE, pooled_rows, rest_of_pass
from ..model.recorder import eval_mode
from ..model.vit import ViT
from .sae import SAEError, SparseAutoencoder

# The forwards one image's effects may cost (the gradient's forward and backward, then as many
# removals as fit), and the removals checked at most.
EFFECT_FORWARDS = 3.0
MAX_CHECKS = 5
BACKWARD_FORWARDS = 2.0  # a backward costs about two forwards


@dataclass(frozen=True)
class LabelScores:
    """A text tower's labels: ``logits`` maps the pooled output (B, D) to the labels' logits (B, T),
    differentiably; ``softmax``: the labels compete (CLIP), else each is its own sigmoid (SigLIP)."""

    names: tuple[str, ...]
    logits: Callable[[torch.Tensor], torch.Tensor]
    softmax: bool

    def log_scores(self, pooled: torch.Tensor) -> torch.Tensor:
        logits = self.logits(pooled).float()
        return logits.log_softmax(-1) if self.softmax else F.logsigmoid(logits)


@dataclass(frozen=True)
class LatentEffects:
    """What removing each latent would do to the metric on one image.

    ``estimates`` (F,): the first-order change of the metric if the latent were removed
    (``-sum over tokens of activation x gradient``; 0 where it does not fire); ``order``: the
    latents that fire, largest ``|estimate|`` first; ``real`` {latent: change}: the real change,
    for the top few; ``cosines`` {latent: cosine}: a headless model's pooled output removed vs
    intact, for those. ``target``: the predicted class or label (None headless without labels),
    ``probability`` its intact probability or score, ``label``: its name when labels were given."""

    metric: str
    estimates: torch.Tensor
    activations: torch.Tensor  # (F,) each latent's activation summed over the tokens
    order: tuple[int, ...]
    real: dict[int, float]
    cosines: dict[int, float]
    target: int | None
    probability: float | None
    forwards: float
    label: str | None = None

    def points(self, change: float) -> float:
        """A change of the metric as shown: of the log-probability, in points of probability
        (percentage points); of a headless model's pooled length, in percent of it."""
        return 100 * change if self.probability is None else 100 * self.probability * math.expm1(change)

    @property
    def unit(self) -> str:
        return "pts" if self.probability is not None else "% of its length"

    def top(self, count: int) -> tuple[int, ...]:
        return self.order[:count]


def points_text(value: float, unit: str = "pts") -> str:
    """A change with enough decimals to see it: "-0.0123 pts", scientific where that would read 0."""
    if value != 0 and abs(value) < 5e-5:
        return f"{value:+.2e} {unit}"
    return f"{value:+.4f} {unit}"


def score_change(before: torch.Tensor, after: torch.Tensor) -> tuple[int, float, float]:
    """(the best class or label, its probability intact, its change in points) from log-scores
    ``before`` and ``after`` (T,) of two passes, intact and steered: from the log-scores, since a
    difference of two probabilities near 1 in float32 would read 0."""
    target = int(before.argmax())
    probability = float(before[target].exp())
    return target, probability, 100 * probability * math.expm1(float(after[target]) - float(before[target]))


def tail_forwards(model: ViT, layer: int) -> float:
    """The blocks above ``layer`` (and the head) in forwards of the model, per image."""
    depth = model.config.depth
    blocks = depth - layer - 1
    if blocks and pooled_rows(model) is not None:
        blocks -= 1 - ROWS_SHARE
    return blocks / depth


def affordable_checks(model: ViT, layer: int) -> int:
    """How many removals fit in EFFECT_FORWARDS with the gradient's pass (at least 1, at most MAX_CHECKS)."""
    tail = tail_forwards(model, layer)
    if tail == 0:
        return MAX_CHECKS
    return max(1, min(MAX_CHECKS, int((EFFECT_FORWARDS - (1 + BACKWARD_FORWARDS) * tail) / tail)))


def _rest(model: ViT, tokens: torch.Tensor, layer: int) -> torch.Tensor:
    """(B, N, D) tokens leaving block ``layer`` -> the model's output (B, classes or D)."""
    if layer + 1 == model.config.depth:
        return model.forward_head(model.norm(tokens))
    return rest_of_pass(model, tokens, layer + 1, model.grid_size())


def latent_effects(
    model: ViT, sae: SparseAutoencoder, layer: int, tokens: torch.Tensor, prefix_tokens: bool = False,
    checks: int | None = None, labels: LabelScores | None = None,
) -> LatentEffects:
    """Each latent's effect on ``model``'s output for one image whose tokens leaving block
    ``layer`` are ``tokens`` (1, N, D) (``capture(...).tokens[:, layer + 1]``), through the
    dictionary ``sae`` on them (the prefix tokens too with ``prefix_tokens``); ``checks``: the top
    latents really removed (default: as many as fit in EFFECT_FORWARDS with the gradient's pass);
    ``labels``: a headless model's text tower's labels, whose best one's score is measured."""
    if tokens.shape[0] != 1:
        raise SAEError("latent effects are computed for one image at a time")
    if not 0 <= layer < model.config.depth:
        raise SAEError(f"layer {layer} does not exist; the model has layers 0..{model.config.depth - 1}")
    checks = affordable_checks(model, layer) if checks is None else checks
    parameter = next(model.parameters())
    device = sae.W_dec.device  # the shared dictionary is never moved: the tokens go to it
    prefix = 0 if prefix_tokens else model.num_prefix_tokens
    kept = tokens[:, :prefix].to(parameter.device, parameter.dtype)

    def log_scores(output: torch.Tensor) -> torch.Tensor:  # (B, classes or D) -> (B, classes or labels)
        return output.log_softmax(-1) if model.config.num_classes else labels.log_scores(output)

    def rebuilt(read: torch.Tensor) -> torch.Tensor:  # (B, P, D) where the dictionary is -> the model's tokens
        read = read.to(parameter.device, parameter.dtype)
        return torch.cat([kept.expand(read.shape[0], -1, -1), read], dim=1)

    with eval_mode(model):
        read = tokens[0, prefix:].to(device, torch.float32)  # (P, D)
        with torch.no_grad():
            latents = sae.encode(read)  # (P, F)
            error = read - sae.decode(latents)
        latents.requires_grad_(True)
        with torch.enable_grad():
            output = _rest(model, rebuilt((sae.decode(latents) + error)[None]), layer).float()  # (1, classes or D)
            if model.config.num_classes or labels is not None:
                scores = log_scores(output)
                target = int(scores[0].argmax())
                score = scores[0, target]
                metric = "log-probability of the predicted class" if labels is None else "log-score of the best label"
            else:
                output = output[0]
                target, intact_output = None, output.detach()
                score = output @ intact_output / intact_output.pow(2).sum().clamp(min=1e-12)
                metric = "pooled output along its intact direction"
            (gradient,) = torch.autograd.grad(score, latents)
        latents = latents.detach()
        estimates = -(latents * gradient).sum(0)  # (F,) removing a latent: 0 - activation, per token
        order = estimates.abs().argsort(descending=True)
        ranked = order[(latents > 0).any(0)[order]].tolist()  # the latents that fire, largest |estimate| first
        chosen = ranked[:checks]
        real, cosines = {}, {}
        if chosen:
            with torch.no_grad():
                directions = sae.directions()[chosen]  # (K, D)
                removed = read[None] - latents[:, chosen].T[:, :, None] * directions[:, None, :]  # (K, P, D)
                outputs = _rest(model, rebuilt(removed), layer).float()  # (K, classes or D)
            if target is not None:
                changes = log_scores(outputs)[:, target] - score.detach()
            else:
                changes = outputs @ intact_output / intact_output.pow(2).sum().clamp(min=1e-12) - 1
                values = F.cosine_similarity(outputs, intact_output[None], dim=-1)
                cosines = dict(zip(chosen, values.tolist()))
            real = dict(zip(chosen, changes.tolist()))
    tail = tail_forwards(model, layer)
    return LatentEffects(
        metric=metric, estimates=estimates, activations=latents.sum(0), order=tuple(ranked), real=real,
        cosines=cosines, target=target,
        probability=None if target is None else float(score.detach().exp()),
        forwards=(1 + BACKWARD_FORWARDS + len(chosen)) * tail,
        label=None if labels is None or target is None else labels.names[target],
    )
