"""Statistics of each layer's and head's attention: mean attention distance, entropy and evenness,
and when a distribution is near uniform or near chance."""
from __future__ import annotations

import math
from collections.abc import Callable

import torch
from einops import rearrange, reduce

from ..model.capture import Capture, layer_attention
from ..model.vit import ViT
from .checks import AnalysisError, check_attentions, full_precision


def patch_centres(grid_size: tuple[int, int], patch_size: int) -> torch.Tensor:
    """(gh * gw, 2) pixel coordinates (y, x) of the patch centres, row-major."""
    grid_h, grid_w = grid_size
    rows, cols = torch.meshgrid(torch.arange(grid_h), torch.arange(grid_w), indexing="ij")
    centres = torch.stack([rows, cols], dim=-1).float() * patch_size + (patch_size - 1) / 2
    return rearrange(centres, "gh gw yx -> (gh gw) yx")


def mean_attention_distance(
    attentions: torch.Tensor,
    grid_size: tuple[int, int],
    patch_size: int,
    num_prefix_tokens: int,
) -> torch.Tensor:
    """(L, H) mean attention distance in pixels (ViT paper Fig. 7 right), averaged over the batch:
    :func:`head_distances` of every layer of attentions (B, L, H, N, N)."""
    check_attentions(attentions)
    return torch.stack([
        head_distances(attentions[:, layer], grid_size, patch_size, num_prefix_tokens)
        for layer in range(attentions.shape[1])
    ])


def head_distances(
    attention: torch.Tensor,
    grid_size: tuple[int, int],
    patch_size: int,
    num_prefix_tokens: int,
) -> torch.Tensor:
    """(H,) one layer's mean attention distance in pixels per head, from its attention
    (B, H, N, N), averaged over the batch.

    For each patch query: sum over patch keys of attention * distance between patch centres,
    then the mean over queries. Prefix tokens are dropped as queries and keys and the remaining
    weights are not renormalised (the published convention), so attention paid to the class
    token counts as distance 0.
    """
    grid_h, grid_w = grid_size
    if attention.ndim != 4 or attention.shape[-1] != num_prefix_tokens + grid_h * grid_w:
        raise AnalysisError(
            f"attention of shape {tuple(attention.shape)} is not (B, H, N, N) over {num_prefix_tokens}"
            f" prefix tokens and a {grid_h}x{grid_w} grid"
        )
    centres = patch_centres(grid_size, patch_size).to(attention.device)
    distances = torch.cdist(centres, centres)  # (P, P)
    # A contraction: no (B, H, P, P) product is materialised.
    patch_attention = full_precision(attention[..., num_prefix_tokens:, num_prefix_tokens:])
    per_query = torch.einsum("bhqk,qk->bhq", patch_attention, distances)  # (B, H, P)
    return reduce(per_query, "b h p -> h", "mean")


def captured_head_statistics(
    model: ViT, captured: Capture, on_layer: Callable[[int], None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(L, H) mean attention distance in pixels (averaged over the batch) and (L, H) mean entropy
    in nats (of the first image) of ``captured``'s every layer, one layer at a time, never holding
    (L, H, N, N): a layer the capture kept read as it is, any other computed again from its tokens
    with its heads' entropies from the same scores (layer_attention's ``entropies``: reading them
    from the weights took as long as computing the layer). ``on_layer(index)`` after each layer (a
    job's progress)."""
    distances, entropies = [], []
    for layer in range(model.config.depth):
        if layer in captured.layers:
            attention = captured.attentions[:, captured.layers.index(layer)]
            entropy = head_entropies(attention)
        else:
            entropy = torch.empty(captured.tokens.shape[0], model.config.num_heads)
            attention = layer_attention(model, captured.tokens[:, layer], layer, captured.grid_size, entropies=entropy)
        distances.append(head_distances(attention, captured.grid_size, model.config.patch_size, captured.num_prefix_tokens))
        entropies.append(entropy[0])
        if on_layer is not None:
            on_layer(layer)
    return torch.stack(distances), torch.stack(entropies)


def attention_entropy(attentions: torch.Tensor) -> torch.Tensor:
    """(B, L, H) entropy in nats of each query's attention row, averaged over all queries:
    :func:`head_entropies` of every layer of attentions (B, L, H, N, N)."""
    check_attentions(attentions)
    # A layer at a time keeps the temporaries small.
    return torch.stack([head_entropies(attentions[:, layer]) for layer in range(attentions.shape[1])], dim=1)


def head_entropies(attention: torch.Tensor) -> torch.Tensor:
    """(B, H) one layer's entropy in nats of each query's attention row, averaged over the queries,
    from its attention (B, H, N, N). 0 for one-hot rows, log N for uniform rows: how focused each
    head is."""
    if attention.ndim != 4 or attention.shape[-1] != attention.shape[-2]:
        raise AnalysisError(f"a layer's attention must have shape (B, H, N, N), not {tuple(attention.shape)}")
    # entr(w) = -w log w, 0 at 0, in one pass: a third less time than the product of a clamped log.
    return torch.special.entr(attention.float()).sum(dim=-1).mean(dim=-1)


def entropy_evenness(entropy: torch.Tensor, tokens: int) -> float:
    """:func:`attention_evenness` of attention whose rows have these mean entropies (any shape,
    e.g. :func:`attention_entropy`'s, each over the same number of rows of ``tokens`` keys):
    the same number without the attention itself."""
    return float(entropy.float().mean()) / math.log(tokens) if tokens >= 2 else 0.0


# Thresholds for telling a reader that a model shows nothing learned: a random or untrained ViT
# spreads its attention evenly and guesses, and a figure scaled to its own range hides both.
NEAR_UNIFORM = 0.95  # attention evenness at or above which attention is called near uniform
CHANCE_CLOSENESS = 0.3  # how far from chance towards certainty (log scale) still counts as chance


def attention_evenness(rows: torch.Tensor) -> float:
    """How evenly attention rows (..., K) spread, each row summing to 1: their mean entropy as a
    share of log K, the entropy of a uniform row. 0 when every row looks at one token, 1 when every
    row looks at all tokens alike (0 for K = 1: there is nothing to spread over)."""
    keys = rows.shape[-1]
    if keys < 2:
        return 0.0
    rows = rows.reshape(-1, keys)
    total = 0.0
    # A few million weights at a time: a large model's whole attention in float32 is gigabytes.
    for chunk in rows.split(max(1, 2**22 // keys)):
        weights = chunk.float()
        total += float(-(weights * weights.clamp_min(torch.finfo(torch.float32).tiny).log()).sum())
    return total / rows.shape[0] / math.log(keys)


def near_uniform(evenness: float, threshold: float = NEAR_UNIFORM) -> bool:
    """Whether attention of this :func:`attention_evenness` is nearly uniform. A trained model's
    layers sit well below 0.95 (the shipped shapes model: 0.56-0.92, head mean per layer); a
    randomly initialised one above 0.99."""
    return evenness >= threshold


def near_chance(probabilities: torch.Tensor, closeness: float = CHANCE_CLOSENESS) -> bool:
    """Whether a prediction's top-1 probability (probabilities: (C,)) is close to chance, 1/C:
    no more than the share ``closeness`` of the way from chance to certainty on a log scale,
    i.e. top-1 <= C ** (closeness - 1), a factor C ** closeness above chance (2x for 10 classes,
    8x for 1000). A single class is never a guess."""
    classes = probabilities.shape[-1]
    if classes < 2:
        return False
    return float(probabilities.float().max()) <= classes ** (closeness - 1.0)
