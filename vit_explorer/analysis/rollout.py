"""How attention flows to the output: attention rollout (Abnar & Zuidema 2020), streamed a layer at
a time, and the class-specific attribution (Chefer et al. 2021)."""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence

import torch
from einops import rearrange

from ..model.recorder import eval_mode, record_attention
from ..model.vit import ViT
from .checks import AnalysisError, check_attentions, full_precision
from .maps import query_map

HEAD_FUSIONS = ("mean", "max", "min")


def _fuse_heads(attention: torch.Tensor, head_fusion: str) -> torch.Tensor:
    if head_fusion == "mean":
        return attention.mean(dim=-3)
    if head_fusion == "max":
        return attention.amax(dim=-3)
    if head_fusion == "min":
        return attention.amin(dim=-3)
    raise AnalysisError(f"head_fusion must be one of {', '.join(HEAD_FUSIONS)}, not {head_fusion!r}")


def _discard_smallest(fused: torch.Tensor, ratio: float, protected_columns: int) -> torch.Tensor:
    """Zero the ``ratio`` share of the smallest weights of each (N, N) matrix (vit-explain).

    The share is counted over the whole matrix; weights in the first ``protected_columns``
    columns (attention paid to the class token and registers) are never dropped. Weights equal to
    the largest one dropped go in reading order (row by row, then column), so that exactly the
    share goes, the same on every device (topk, before, chose among them as its implementation
    happened to: neither the first nor the last ones; float16 attention ties often).
    """
    tokens = fused.shape[-1]
    count = int(tokens * tokens * ratio)
    if count == 0:
        return fused
    ranked = fused.clone()
    ranked[..., :protected_columns] = math.inf
    count = min(count, tokens * (tokens - protected_columns))
    flat = rearrange(ranked, "b q k -> b (q k)")
    # The count-th smallest: a selection, not a partial sort (at 785 tokens, a ViT-B/16 at patch 8,
    # topk took 19 ms a matrix and kthvalue 6: a rollout 0.13 s less), then those below it and the
    # first of those equal to it.
    threshold = flat.kthvalue(count, dim=-1, keepdim=True).values  # (B, 1)
    below, tied = flat < threshold, flat == threshold
    dropped = below | (tied & (tied.cumsum(dim=-1) <= count - below.sum(dim=-1, keepdim=True)))
    return fused.masked_fill(rearrange(dropped, "b (q k) -> b q k", q=tokens), 0.0)


def attention_rollout(
    attentions: torch.Tensor,
    head_fusion: str = "mean",
    discard_ratio: float = 0.0,
    start_layer: int = 0,
    *,
    num_prefix_tokens: int = 1,
) -> torch.Tensor:
    """Attention rollout (Abnar & Zuidema 2020): how much each token draws from each input token.

    attentions: (B, L, H, N, N). Per layer the heads are fused (mean, max or min), the smallest
    ``discard_ratio`` share of weights is dropped (never attention paid to the first
    ``num_prefix_tokens`` tokens, the class token and registers), the residual connection is
    added as 0.5 * A + 0.5 * I and rows are renormalised; then R = A_L ... A_start. Returns
    (B, N, N) with rows summing to 1. :func:`streamed_rollout` is the same from one layer at a time.
    """
    check_attentions(attentions)
    layers = attentions.shape[1]
    if not 0 <= start_layer < layers:
        raise AnalysisError(f"start_layer must be in 0..{layers - 1}, not {start_layer}")
    return streamed_rollout(
        (attentions[:, layer] for layer in range(start_layer, layers)), head_fusion, discard_ratio,
        num_prefix_tokens=num_prefix_tokens,
    )


def streamed_rollout(
    layers: Iterable[torch.Tensor],
    head_fusion: str = "mean",
    discard_ratio: float = 0.0,
    *,
    num_prefix_tokens: int = 1,
) -> torch.Tensor:
    """:func:`attention_rollout` of the layers' (B, H, N, N) attention given one at a time, first
    layer first (vit_explorer.model.capture.layer_attentions computes each from a capture's tokens):
    only the (B, N, N) product and the layer at hand are held, never (B, L, H, N, N)."""
    _check_fusion(head_fusion, discard_ratio)  # before any layer is computed
    rollout = None
    for mixed in _mixed_layers(layers, head_fusion, discard_ratio, num_prefix_tokens):
        rollout = mixed if rollout is None else mixed @ rollout  # the first: its product with I, exactly
    if rollout is None:
        raise AnalysisError("rollout needs the attention of at least one layer")
    return rollout


def rollout_rows(
    layers: Iterable[torch.Tensor],
    queries: torch.Tensor,
    head_fusion: str = "mean",
    discard_ratio: float = 0.0,
    *,
    num_prefix_tokens: int = 1,
) -> torch.Tensor:
    """(B, Q, N): ``queries`` (B, Q, N), weights over the tokens (a class token's row: 1 at
    token 0), times :func:`streamed_rollout` of the same layers, without the (N, N) product: each
    layer's mixed matrix is held and the rows are carried from the last layer down, Q N^2 a layer
    instead of N^3 (at 1,378 tokens a ViT-S/14's rollout costs as much as its forward pass)."""
    _check_fusion(head_fusion, discard_ratio)
    mixed = list(_mixed_layers(layers, head_fusion, discard_ratio, num_prefix_tokens))
    if not mixed:
        raise AnalysisError("rollout needs the attention of at least one layer")
    rows = queries.to(mixed[0])
    for matrix in reversed(mixed):
        rows = rows @ matrix
    return rows


def _check_fusion(head_fusion: str, discard_ratio: float) -> None:
    if not 0.0 <= discard_ratio < 1.0:
        raise AnalysisError(f"discard_ratio must be in [0, 1), not {discard_ratio}")
    if head_fusion not in HEAD_FUSIONS:
        raise AnalysisError(f"head_fusion must be one of {', '.join(HEAD_FUSIONS)}, not {head_fusion!r}")


def _mixed_layers(
    layers: Iterable[torch.Tensor], head_fusion: str, discard_ratio: float, num_prefix_tokens: int
) -> Iterable[torch.Tensor]:
    """Each layer's (B, N, N) rollout step: heads fused, the smallest share discarded, the
    residual added as 0.5 * A + 0.5 * I, rows renormalised."""
    identity = None
    for attention in layers:
        if attention.ndim != 4 or attention.shape[-1] != attention.shape[-2]:
            raise AnalysisError(f"a layer's attention must have shape (B, H, N, N), not {tuple(attention.shape)}")
        if identity is None:
            identity = torch.eye(attention.shape[-1], device=attention.device)
        # In float32 a layer at a time: a float16 layer is never copied whole twice.
        fused = _fuse_heads(full_precision(attention), head_fusion)  # (B, N, N)
        fused = _discard_smallest(fused, discard_ratio, num_prefix_tokens)
        mixed = 0.5 * fused + 0.5 * identity
        yield mixed / mixed.sum(dim=-1, keepdim=True)


def _target_indices(logits: torch.Tensor, target: int | Sequence[int] | torch.Tensor | None):
    batch, num_classes = logits.shape
    if target is None:
        return logits.argmax(dim=-1)
    target = torch.as_tensor(target, device=logits.device).long().reshape(-1)
    if target.numel() == 1:
        target = target.expand(batch)
    if target.numel() != batch:
        raise AnalysisError(f"got {target.numel()} targets for a batch of {batch} images")
    if bool(((target < 0) | (target >= num_classes)).any()):
        raise AnalysisError(f"target classes must be in 0..{num_classes - 1}")
    return target


def attribution(
    model: ViT, x: torch.Tensor, target: int | Sequence[int] | torch.Tensor | None = None,
    score: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Class-specific relevance of each patch (Chefer, Gur & Wolf 2021, "Generic attention-model
    explainability"): R = I, then for every layer R <- R + mean_h(clamp(dA * A, min=0)) @ R,
    where dA is the gradient of the target logit with respect to that layer's attention A.

    ``target``: class index (one for all images or one per image); default the predicted class.
    ``score`` instead: a function of the model's output (B, out) -> (B,) whose gradient is followed,
    e.g. an image's similarity with a text (vit_explorer.text.maps).
    Returns (B, gh, gw): the class token's row of R over the patches, or without a class token
    the mean of the patch rows. The model's mode, parameters and their gradients are untouched.
    """
    config = model.config
    if x.ndim == 3:
        x = x.unsqueeze(0)
    device = next(model.parameters()).device
    # The input carries the graph, so gradients reach the attention even for frozen weights.
    x = x.detach().to(device, next(model.parameters()).dtype).requires_grad_(True)
    with torch.enable_grad(), eval_mode(model), record_attention(
        model, range(config.depth), keep_graph=True
    ) as attentions:
        logits = model(x)  # (B, num_classes)
        if score is None:
            chosen = logits.gather(1, _target_indices(logits.detach(), target)[:, None]).sum()
        else:
            chosen = score(logits).sum()
        layers = [attentions[index] for index in range(config.depth)]
        gradients = torch.autograd.grad(chosen, layers)

    tokens = config.num_tokens
    relevance = torch.eye(tokens, device=device).expand(x.shape[0], tokens, tokens)
    for attention, gradient in zip(layers, gradients):
        weighted = (gradient * attention).detach().clamp(min=0).mean(dim=1)  # (B, N, N)
        relevance = relevance + weighted.float() @ relevance
    return query_map(
        relevance.cpu(), config.grid_size, config.num_prefix_tokens, class_token=config.class_token
    )
