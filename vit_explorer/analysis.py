"""What a ViT's attention and tokens say: pure functions from captured tensors to numbers.

Shapes: B batch, L layers, H heads, N tokens (prefix tokens first, then the gh x gw patches in
row-major order), D embed dim. Functions take and return torch tensors (float32, CPU) unless
they say otherwise; none of them draw or import streamlit.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from einops import rearrange, reduce

from .capture import Capture
from .config import ViTConfig
from .model import ViT
from .recorder import eval_mode, record_attention

HEAD_FUSIONS = ("mean", "max", "min")


class AnalysisError(ValueError):
    """A request the analysis cannot answer (wrong shape, unknown layer, bad option)."""


def _check_attentions(attentions: torch.Tensor) -> None:
    if attentions.ndim != 5 or attentions.shape[-1] != attentions.shape[-2]:
        raise AnalysisError(
            f"attentions must have shape (B, L, H, N, N), not {tuple(attentions.shape)}"
        )


def _full_precision(values: torch.Tensor) -> torch.Tensor:
    """float32 for half-precision values (a float16 capture), anything else as it is."""
    return values.float() if values.dtype in (torch.float16, torch.bfloat16) else values


def _has_class_token(num_prefix_tokens: int, class_token: bool | None) -> bool:
    # A capture only knows how many prefix tokens there are; registers without a class token
    # (timm's *_reg*_gap models) need class_token=False from model.config.class_token.
    return num_prefix_tokens > 0 if class_token is None else class_token


# --- model inputs back to pixels ---------------------------------------------------------------


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


# --- attention rollout and class-specific attribution -------------------------------------


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
    _check_attentions(attentions)
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
    layer first (vit_explorer.capture.layer_attentions computes each from a capture's tokens):
    only the (B, N, N) product and the layer at hand are held, never (B, L, H, N, N)."""
    if not 0.0 <= discard_ratio < 1.0:
        raise AnalysisError(f"discard_ratio must be in [0, 1), not {discard_ratio}")
    if head_fusion not in HEAD_FUSIONS:  # before any layer is computed
        raise AnalysisError(f"head_fusion must be one of {', '.join(HEAD_FUSIONS)}, not {head_fusion!r}")
    rollout = identity = None
    for attention in layers:
        if attention.ndim != 4 or attention.shape[-1] != attention.shape[-2]:
            raise AnalysisError(f"a layer's attention must have shape (B, H, N, N), not {tuple(attention.shape)}")
        if identity is None:
            identity = torch.eye(attention.shape[-1], device=attention.device)
        # In float32 a layer at a time: a float16 layer is never copied whole twice.
        fused = _fuse_heads(_full_precision(attention), head_fusion)  # (B, N, N)
        fused = _discard_smallest(fused, discard_ratio, num_prefix_tokens)
        mixed = 0.5 * fused + 0.5 * identity
        mixed = mixed / mixed.sum(dim=-1, keepdim=True)
        rollout = mixed if rollout is None else mixed @ rollout  # the first: its product with I, exactly
    if rollout is None:
        raise AnalysisError("rollout needs the attention of at least one layer")
    return rollout


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
    model: ViT, x: torch.Tensor, target: int | Sequence[int] | torch.Tensor | None = None
) -> torch.Tensor:
    """Class-specific relevance of each patch (Chefer, Gur & Wolf 2021, "Generic attention-model
    explainability"): R = I, then for every layer R <- R + mean_h(clamp(dA * A, min=0)) @ R,
    where dA is the gradient of the target logit with respect to that layer's attention A.

    ``target``: class index (one for all images or one per image); default the predicted class.
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
        target_index = _target_indices(logits.detach(), target)
        chosen = logits.gather(1, target_index[:, None]).sum()
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


# --- maps of one query's attention over the patch grid -------------------------------------


def query_map(
    matrix: torch.Tensor,
    grid_size: tuple[int, int],
    num_prefix_tokens: int,
    query: int | tuple[int, int] | None = None,
    *,
    class_token: bool | None = None,
) -> torch.Tensor:
    """One query's row of a token-mixing matrix (attention, rollout, relevance) over the patches.

    matrix: (..., N, N). ``query``: None for the class token, or without one the mean over the
    patch queries; an int patch index (0..gh*gw-1, row-major) or a (row, col) patch. Prefix
    columns are dropped. Returns (..., gh, gw). ``class_token`` defaults to "there are prefix
    tokens"; pass it for register-only models.
    """
    grid_h, grid_w = grid_size
    num_patches = grid_h * grid_w
    if matrix.shape[-1] != num_prefix_tokens + num_patches or matrix.shape[-2] != matrix.shape[-1]:
        raise AnalysisError(
            f"a matrix for {num_prefix_tokens} prefix tokens and a {grid_h}x{grid_w} grid must end"
            f" in ({num_prefix_tokens + num_patches}, {num_prefix_tokens + num_patches}),"
            f" not {tuple(matrix.shape[-2:])}"
        )
    if query is None:
        if _has_class_token(num_prefix_tokens, class_token):
            row = _full_precision(matrix[..., 0, :])
        else:
            row = _full_precision(matrix[..., num_prefix_tokens:, :]).mean(dim=-2)
    else:
        row = _full_precision(matrix[..., num_prefix_tokens + patch_index(query, grid_size), :])
    return rearrange(row[..., num_prefix_tokens:], "... (gh gw) -> ... gh gw", gh=grid_h)


def streamed_query_maps(
    layers: Iterable[torch.Tensor],
    grid_size: tuple[int, int],
    num_prefix_tokens: int,
    query: int | tuple[int, int] | None = None,
    *,
    class_token: bool | None = None,
) -> torch.Tensor:
    """(B, L, gh, gw): one query's attention to the patches (:func:`query_map`), the mean of the
    heads, in each of the layers' (B, H, N, N) attention given one at a time
    (vit_explorer.capture.layer_attentions): how where it looks changes with depth, one layer held."""
    maps = [
        query_map(attention, grid_size, num_prefix_tokens, query, class_token=class_token).mean(dim=1)
        for attention in layers
    ]
    if not maps:
        raise AnalysisError("the attention of at least one layer is needed")
    return torch.stack(maps, dim=1)


def patch_index(patch: int | tuple[int, int], grid_size: tuple[int, int]) -> int:
    """Row-major index of a patch given as an index or as (row, col); validated."""
    grid_h, grid_w = grid_size
    if isinstance(patch, Sequence):
        row, col = patch
        if not (0 <= row < grid_h and 0 <= col < grid_w):
            raise AnalysisError(f"patch ({row}, {col}) is outside the {grid_h}x{grid_w} grid")
        return int(row) * grid_w + int(col)
    if not 0 <= patch < grid_h * grid_w:
        raise AnalysisError(f"patch index must be in 0..{grid_h * grid_w - 1}, not {patch}")
    return int(patch)


def _layer_position(capture: Capture, layer: int) -> int:
    """Position in ``capture.attentions`` of encoder layer ``layer`` (negative from the end)."""
    depth = capture.tokens.shape[1] - 1
    wanted = layer + depth if layer < 0 else layer
    if not 0 <= wanted < depth:
        raise AnalysisError(f"layer {layer} does not exist; the model has layers 0..{depth - 1}")
    if wanted not in capture.layers:
        raise AnalysisError(
            f"layer {layer} was not captured; captured layers: {list(capture.layers)}"
        )
    return capture.layers.index(wanted)


def head_maps(
    capture: Capture,
    layer: int,
    query: int | tuple[int, int] | None = None,
    image: int = 0,
    *,
    class_token: bool | None = None,
) -> torch.Tensor:
    """(H, gh, gw): every head's attention from ``query`` (see :func:`query_map`) to the patches,
    for encoder layer ``layer`` (negative counts from the end) of batch element ``image``."""
    if not -capture.attentions.shape[0] <= image < capture.attentions.shape[0]:
        raise AnalysisError(
            f"image {image} is not in the batch of {capture.attentions.shape[0]} images"
        )
    attention = capture.attentions[image, _layer_position(capture, layer)]  # (H, N, N)
    return query_map(
        attention, capture.grid_size, capture.num_prefix_tokens, query, class_token=class_token
    )


def attention_map(
    capture: Capture,
    layer: int,
    head: int | None = None,
    query: int | tuple[int, int] | None = None,
    image: int = 0,
    *,
    class_token: bool | None = None,
) -> torch.Tensor:
    """(gh, gw): one head's attention from ``query`` to the patches (``head`` None: head mean)."""
    maps = head_maps(capture, layer, query, image, class_token=class_token)  # (H, gh, gw)
    if head is None:
        return maps.mean(dim=0)
    if not -maps.shape[0] <= head < maps.shape[0]:
        raise AnalysisError(f"head must be in 0..{maps.shape[0] - 1}, not {head}")
    return maps[head]


def pool_maps(capture: Capture, image: int = 0) -> torch.Tensor:
    """(H, gh, gw): where the attention pool's probe query reads, per head (a MAP-head model)."""
    if capture.pool_attentions is None:
        raise AnalysisError("this model has no attention-pool head, so there is no probe to show")
    grid_h, _ = capture.grid_size
    return rearrange(capture.pool_attentions[image, :, 0], "h (gh gw) -> h gh gw", gh=grid_h)


def pool_rollout_map(
    pool_attentions: torch.Tensor, rollout: torch.Tensor, grid_size: tuple[int, int],
    num_prefix_tokens: int,
) -> torch.Tensor:
    """(B, gh, gw): rollout continued through the attention pool. The probe's head-mean weights
    over the patch tokens (B, nh, 1, P) mix the rollout rows of those tokens (B, N, N)."""
    probe = pool_attentions.float().mean(dim=1)[:, 0]  # (B, P)
    row = torch.einsum("bp,bpn->bn", probe, rollout[:, num_prefix_tokens:].float())  # (B, N)
    return rearrange(row[:, num_prefix_tokens:], "b (gh gw) -> b gh gw", gh=grid_size[0])


def attention_mask_by_mass(attn_map: torch.Tensor, mass: float = 0.6) -> torch.Tensor:
    """DINO's threshold: the smallest set of patches that holds ``mass`` of the attention.

    attn_map: (..., gh, gw) non-negative; leading dims are independent maps. Returns a bool
    mask of the same shape. A map that sums to zero holds no attention: its mask is empty.
    """
    if not 0.0 < mass <= 1.0:
        raise AnalysisError(f"mass must be in (0, 1], not {mass}")
    if bool((attn_map < 0).any()):
        raise AnalysisError("attention mass is defined for non-negative maps only")
    grid_h, grid_w = attn_map.shape[-2:]
    flat = rearrange(attn_map.float(), "... gh gw -> ... (gh gw)")
    values, order = flat.sort(dim=-1, descending=True)
    total = values.sum(dim=-1, keepdim=True)
    share = values / total.clamp(min=torch.finfo(values.dtype).tiny)
    # Keep a patch while the larger patches before it hold less than `mass`.
    before = share.cumsum(dim=-1) - share
    keep_sorted = (before < mass - 1e-6) & (total > 0)
    keep = torch.empty_like(keep_sorted).scatter_(-1, order, keep_sorted)
    return rearrange(keep, "... (gh gw) -> ... gh gw", gh=grid_h, gw=grid_w)


# --- statistics per layer and head ---------------------------------------------------------


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
    _check_attentions(attentions)
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
    patch_attention = _full_precision(attention[..., num_prefix_tokens:, num_prefix_tokens:])
    per_query = torch.einsum("bhqk,qk->bhq", patch_attention, distances)  # (B, H, P)
    return reduce(per_query, "b h p -> h", "mean")


def attention_entropy(attentions: torch.Tensor) -> torch.Tensor:
    """(B, L, H) entropy in nats of each query's attention row, averaged over all queries:
    :func:`head_entropies` of every layer of attentions (B, L, H, N, N)."""
    _check_attentions(attentions)
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


# --- tokens through the depth ----------------------------------------------------------------


@torch.no_grad()
def logit_lens(model: ViT, capture: Capture) -> torch.Tensor:
    """(B, L+1, num_classes): the model's final norm, pooling, fc_norm and head applied to the
    tokens after each block (index 0: the block-0 input); the last row equals the logits."""
    parameter = next(model.parameters())
    tokens = capture.tokens.to(parameter.device, parameter.dtype)  # (B, L+1, N, D)
    batch = tokens.shape[0]
    with eval_mode(model):
        stacked = rearrange(tokens, "b l n d -> (b l) n d")
        logits = model.forward_head(model.norm(stacked))  # (B*(L+1), C)
    return rearrange(logits.float().cpu(), "(b l) c -> b l c", b=batch)


def _cosine_similarity_matrix(vectors: torch.Tensor) -> torch.Tensor:
    unit = F.normalize(vectors.float(), dim=-1)
    return unit @ unit.transpose(-2, -1)


@torch.no_grad()
def position_embedding_similarity(model: ViT) -> torch.Tensor:
    """(gh, gw, gh, gw): cosine similarity between the patches' position embeddings
    (ViT paper Fig. 7 centre); [i, j] is the similarity map of patch (i, j)."""
    config = model.config
    if model.pos_embed is None:
        raise AnalysisError(
            "This model has no learned position embeddings: its positions are rotations of the"
            " queries and keys (rotary positions)."
        )
    pos_embed = model.pos_embed[0].detach().cpu()  # (embed_len, D)
    if not config.no_embed_class:
        pos_embed = pos_embed[config.num_prefix_tokens :]
    similarity = _cosine_similarity_matrix(pos_embed)  # (P, P)
    grid_h, grid_w = config.grid_size
    return rearrange(
        similarity, "(qh qw) (kh kw) -> qh qw kh kw", qh=grid_h, qw=grid_w, kh=grid_h, kw=grid_w
    )


def _scale_to_unit(values: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """Min-max scale to [0, 1] over ``dims``; constant values map to 0.5."""
    low = values.amin(dim=dims, keepdim=True)
    high = values.amax(dim=dims, keepdim=True)
    span = high - low
    scaled = (values - low) / span.clamp(min=1e-12)
    return torch.where(span > 1e-12, scaled, torch.full_like(values, 0.5))


# Randomized PCA as scikit-learn's PCA does it for a few components of a large matrix: at least
# 10 more directions than asked, 7 power iterations (Halko, Martinsson & Tropp 2011, Algorithm
# 4.4). The directions come in multiples of 16: MKL multiplied 588 x 768 by 768 x 11 in 4x the
# time it took for 768 x 16.
OVERSAMPLING, POWER_ITERATIONS, DIRECTIONS_MULTIPLE = 10, 7, 16


def _principal_axes(samples: torch.Tensor, k: int, randomized: bool = False) -> torch.Tensor:
    """(k, F) top-k principal axes of (M, F) samples, each signed so that its largest entry is
    positive (SVD signs are arbitrary; this keeps colours stable). Axes beyond the samples'
    numerical rank are zero, so that rounding noise is never stretched into colours.

    ``randomized``: from :func:`_randomized_svd` where the samples span more directions than it
    iterates (a few products with them instead of a full SVD)."""
    centred = samples - samples.mean(dim=0, keepdim=True)
    rank = DIRECTIONS_MULTIPLE * math.ceil((k + OVERSAMPLING) / DIRECTIONS_MULTIPLE)
    if randomized and min(centred.shape) > rank:
        singular, vh = _randomized_svd(centred, rank)  # (rank, F)
    else:
        _, singular, vh = torch.linalg.svd(centred, full_matrices=False)  # (min(M, F), F)
    tolerance = singular.amax() * max(centred.shape) * torch.finfo(centred.dtype).eps
    axes = vh[:k] * (singular[:k, None] > tolerance)
    largest = axes.gather(1, axes.abs().argmax(dim=1, keepdim=True))
    axes = axes * torch.where(largest < 0, -1.0, 1.0)
    if axes.shape[0] < k:
        axes = torch.cat([axes, axes.new_zeros(k - axes.shape[0], axes.shape[1])])
    return axes


def _randomized_svd(matrix: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``rank`` leading singular values (rank,) and right singular vectors (rank, F) of an
    (M, F) matrix by subspace iteration from a fixed random start (the same matrix always gives
    the same axes). The leading ones match a full SVD's to float32 rounding on ViT tokens, at a
    tenth of its time for 588 x 768 (three images' patches; one CPU thread: 8 ms against 100)."""
    start = torch.randn(matrix.shape[1], rank, generator=torch.Generator().manual_seed(0), dtype=matrix.dtype)
    basis = start.to(matrix.device)  # (F, rank)
    for _ in range(POWER_ITERATIONS):  # orthonormalised at each step, or the leading direction swamps the rest
        basis = torch.linalg.qr(matrix @ basis).Q  # (M, rank)
        basis = torch.linalg.qr(matrix.T @ basis).Q  # (F, rank)
    _, singular, vh = torch.linalg.svd(matrix @ basis, full_matrices=False)  # (M, rank): a small SVD
    return singular, vh @ basis.T


@torch.no_grad()
def embedding_filters(model: ViT, k: int = 28) -> torch.Tensor:
    """(k, p, p, C) principal components of the patch-embedding kernels, as images (ViT paper
    Fig. 7 left: RGB filters for C = 3), each scaled to [0, 1] for display.

    The D kernels (C, p, p) are the samples; k is capped at their rank bound min(D, C*p*p).
    """
    weight = model.patch_embed.proj.weight.detach().float().cpu()  # (D, C, p, p)
    embed_dim, channels, patch, _ = weight.shape
    if k < 1:
        raise AnalysisError(f"k must be at least 1, not {k}")
    k = min(k, embed_dim, channels * patch * patch)
    axes = _principal_axes(rearrange(weight, "d c p1 p2 -> d (c p1 p2)"), k)  # (k, C*p*p)
    filters = rearrange(axes, "k (c p1 p2) -> k p1 p2 c", c=channels, p1=patch, p2=patch)
    return _scale_to_unit(filters, dims=(1, 2, 3))


def token_pca(tokens: torch.Tensor, grid_size: tuple[int, int], k: int = 3) -> torch.Tensor:
    """Colour patch tokens by their top-k principal components (as in the DINO/DINOv2 figures).

    tokens: (gh*gw, D) -> (gh, gw, k); or (B, gh*gw, D) -> (B, gh, gw, k), with one PCA fitted on
    all the batch's tokens so that colours mean the same in every image. Each component is
    min-max scaled to [0, 1] (jointly over the batch).
    """
    grid_h, grid_w = grid_size
    batched = tokens.ndim == 3
    if tokens.ndim not in (2, 3) or tokens.shape[-2] != grid_h * grid_w:
        raise AnalysisError(
            f"tokens must be (gh*gw, D) or (B, gh*gw, D) patch tokens for a {grid_h}x{grid_w}"
            f" grid, not {tuple(tokens.shape)}"
        )
    if not 1 <= k <= tokens.shape[-1]:
        raise AnalysisError(f"k must be in 1..{tokens.shape[-1]}, not {k}")
    tokens = tokens.float() if batched else tokens.float()[None]
    samples = rearrange(tokens, "b p d -> (b p) d")
    # Randomized, as scikit-learn's PCA at this size: a full SVD of 784 tokens (patch 8) took
    # about 100 ms, a tenth of the patch-size change's wait.
    axes = _principal_axes(samples, k, randomized=True)  # (k, D)
    projected = (samples - samples.mean(dim=0, keepdim=True)) @ axes.T  # (B*P, k)
    colours = _scale_to_unit(projected, dims=(0,))
    colours = rearrange(colours, "(b gh gw) k -> b gh gw k", b=tokens.shape[0], gh=grid_h)
    return colours if batched else colours[0]


def token_norms(tokens: torch.Tensor) -> torch.Tensor:
    """L2 norm of each token, (..., N, D) -> (..., N): high-norm outliers are the artifact
    tokens that registers absorb (Darcet et al. 2023)."""
    return torch.linalg.vector_norm(tokens.float(), dim=-1)


def top_k(
    logits: torch.Tensor, class_names: Sequence[str] | None = None, k: int = 5
) -> list[tuple[str, float]] | list[list[tuple[str, float]]]:
    """The k most probable classes as (name, softmax probability), most probable first.

    logits (C,) -> one list; (B, C) -> a list per image. Without names classes are "class i".
    """
    if logits.ndim not in (1, 2):
        raise AnalysisError(f"logits must be (C,) or (B, C), not {tuple(logits.shape)}")
    num_classes = logits.shape[-1]
    if class_names is not None and len(class_names) != num_classes:
        raise AnalysisError(f"{len(class_names)} class names for {num_classes} classes")
    names = list(class_names) if class_names is not None else [f"class {i}" for i in range(num_classes)]
    probabilities = logits.float().softmax(dim=-1)
    values, indices = probabilities.topk(min(k, num_classes), dim=-1)

    def named(row_values: torch.Tensor, row_indices: torch.Tensor) -> list[tuple[str, float]]:
        return [(names[i], float(p)) for p, i in zip(row_values.tolist(), row_indices.tolist())]

    if logits.ndim == 1:
        return named(values, indices)
    return [named(row_values, row_indices) for row_values, row_indices in zip(values, indices)]


# --- two models side by side ------------------------------------------------------------------


def matching_layer(layer: int, depth: int, other_depth: int) -> int:
    """The layer of a model ``other_depth`` deep at the same relative depth as ``layer`` of one
    ``depth`` deep: round(layer * (other_depth - 1) / (depth - 1)), halves rounded up, so that
    first meets first and last meets last. A one-layer model's layer is the other's last."""
    if not 0 <= layer < depth:
        raise AnalysisError(f"layer must be in 0..{depth - 1}, not {layer}")
    if other_depth < 1:
        raise AnalysisError(f"a model has at least one layer, not {other_depth}")
    if depth == 1:
        return other_depth - 1
    return math.floor(layer * (other_depth - 1) / (depth - 1) + 0.5)


def point_patch(point: tuple[float, float], grid_size: tuple[int, int]) -> int:
    """Row-major index of the patch of a ``grid_size`` grid that holds ``point``, given as (down,
    across) fractions of the image's height and width in [0, 1]: the same point of the picture
    on models whose grids differ (the far edges belong to the last row and column)."""
    down, across = point
    if not (0 <= down <= 1 and 0 <= across <= 1):
        raise AnalysisError(f"a point is (down, across) fractions in [0, 1], not {point}")
    grid_h, grid_w = grid_size
    row, col = min(int(down * grid_h), grid_h - 1), min(int(across * grid_w), grid_w - 1)
    return row * grid_w + col


def patch_point(patch: int, grid_size: tuple[int, int]) -> tuple[float, float]:
    """The centre of a patch (row-major index) as (down, across) fractions of the image."""
    row, col = divmod(patch_index(patch, grid_size), grid_size[1])
    return (row + 0.5) / grid_size[0], (col + 0.5) / grid_size[1]
