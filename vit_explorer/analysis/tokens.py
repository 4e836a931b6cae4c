"""What the tokens say through the depth: the logit lens, position-embedding similarity, the
patch embedding's filters, token PCA and norms, a prediction's top-k."""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from einops import rearrange

from ..model.capture import Capture
from ..model.recorder import eval_mode
from ..model.vit import ViT, pi_resize_operator, resample_patch_embed
from .checks import AnalysisError


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


def scale_to_unit(values: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
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


def principal_axes(samples: torch.Tensor, k: int, randomized: bool = False) -> torch.Tensor:
    """(k, F) top-k principal axes of (M, F) samples, each signed so that its largest entry is
    positive (SVD signs are arbitrary; this keeps colours stable). Axes beyond the samples'
    numerical rank are zero, so that rounding noise is never stretched into colours.

    ``randomized``: from :func:`_randomized_svd` where the samples span more directions than it
    iterates (a few products with them instead of a full SVD). Fewer samples than features (the
    patch-embedding kernels at a large patch size): from the samples' Gram matrix, the same axes."""
    centred = samples - samples.mean(dim=0, keepdim=True)
    rank = DIRECTIONS_MULTIPLE * math.ceil((k + OVERSAMPLING) / DIRECTIONS_MULTIPLE)
    if randomized and min(centred.shape) > rank:
        singular, vh = _randomized_svd(centred, rank)  # (rank, F)
    elif centred.shape[1] > centred.shape[0]:
        singular, vh = _wide_svd(centred, k)  # (k, F)
    else:
        _, singular, vh = torch.linalg.svd(centred, full_matrices=False)  # (min(M, F), F)
    return _oriented(singular, vh, k, tuple(centred.shape), centred.dtype)


def _oriented(singular: torch.Tensor, vh: torch.Tensor, k: int, shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """(k, F) axes from an (M, F) matrix's singular values and leading right singular vectors:
    zero past its numerical rank, each signed so that its largest entry is positive."""
    tolerance = singular.amax() * max(shape) * torch.finfo(dtype).eps
    axes = vh[:k] * (singular[:k, None] > tolerance)
    largest = axes.gather(1, axes.abs().argmax(dim=1, keepdim=True))
    axes = axes * torch.where(largest < 0, -1.0, 1.0)
    if axes.shape[0] < k:
        axes = torch.cat([axes, axes.new_zeros(k - axes.shape[0], axes.shape[1])])
    return axes


def _wide_svd(matrix: torch.Tensor, k: int, right=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The singular values (M,) and the ``k`` leading right singular vectors (k, F) of an (M, F)
    matrix with M < F, from the eigenvectors U of its (M, M) Gram matrix in float64 (V = M^T U /
    s): one matrix product where LAPACK's SVD bidiagonalises the whole matrix, single-threaded (a
    ViT-B/16's 768 kernels at patch 224, F = 150,528: 12.7 s; at patch 56, 1.4 s; the Patches
    page's slider took its p95 to 9 s in a class).

    ``right``: (R, apply) for the matrix times R (M, F) -> (M, F'), given R R^T (F, F) and
    ``apply``, a function that multiplies by R: the singular vectors of that product, whose
    Gram matrix is M (R R^T) M^T, without forming it (kernels PI-resized to a larger patch)."""
    wide = matrix.double()
    metric, apply = right if right is not None else (None, lambda rows: rows)
    gram = wide @ wide.T if metric is None else wide @ metric.double() @ wide.T
    eigenvalues, vectors = torch.linalg.eigh(gram)  # ascending
    singular = eigenvalues.flip(0).clamp(min=0).sqrt()
    leading = singular[:k]
    # Directions with no spread (past the rank) stay zero rather than noise over nothing.
    spread = leading > leading[0] * max(matrix.shape) * torch.finfo(matrix.dtype).eps
    vh = apply(vectors.flip(1)[:, :k].T @ wide) / torch.where(spread, leading, 1.0)[:, None]
    return singular.to(matrix.dtype), (vh * spread[:, None]).to(matrix.dtype)


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
def embedding_filters(model: ViT, k: int = 28, patch_size: int | None = None) -> torch.Tensor:
    """(k, p, p, C) principal components of the patch-embedding kernels, as images (ViT paper
    Fig. 7 left: RGB filters for C = 3), each scaled to [0, 1] for display.

    The D kernels (C, p, p) are the samples; k is capped at their rank bound min(D, C*p*p).
    ``patch_size``: those of the kernels PI-resized to that patch size (what ``model(x,
    patch_size)`` embeds with, FlexiViT), from the kernels at their own size: enlarged ones' Gram
    matrix is the kernels' in the resize's metric (p_own^2 values each, not p^2).
    """
    weight = model.patch_embed.proj.weight.detach().float().cpu()  # (D, C, p, p)
    embed_dim, channels, own, _ = weight.shape
    patch = own if patch_size is None else patch_size
    if k < 1:
        raise AnalysisError(f"k must be at least 1, not {k}")
    k = min(k, embed_dim, channels * patch * patch)
    if patch > own:
        operator = pi_resize_operator(own, patch)  # (p^2, own^2) float64: w' = operator w per channel
        kernels = rearrange(weight, "d c p1 p2 -> d (c p1 p2)")
        centred = kernels - kernels.mean(dim=0, keepdim=True)
        metric = torch.block_diag(*[operator.T @ operator] * channels)  # (C own^2, C own^2)

        def resized(rows: torch.Tensor) -> torch.Tensor:  # (k, C own^2) -> (k, C p^2)
            return rearrange(rearrange(rows, "k (c q) -> k c q", c=channels) @ operator.T, "k c q -> k (c q)")

        singular, vh = _wide_svd(centred, k, (metric, resized))
        axes = _oriented(singular, vh, k, (embed_dim, channels * patch * patch), weight.dtype)
    else:
        if patch != own:
            weight = resample_patch_embed(weight, patch)
        axes = principal_axes(rearrange(weight, "d c p1 p2 -> d (c p1 p2)"), k)  # (k, C*p*p)
    filters = rearrange(axes, "k (c p1 p2) -> k p1 p2 c", c=channels, p1=patch, p2=patch)
    return scale_to_unit(filters, dims=(1, 2, 3))


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
    axes = principal_axes(samples, k, randomized=True)  # (k, D)
    projected = (samples - samples.mean(dim=0, keepdim=True)) @ axes.T  # (B*P, k)
    colours = scale_to_unit(projected, dims=(0,))
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
