"""Heads in words (TextSpan, Gandelsman, Efros & Steinhardt 2024, "Interpreting CLIP's image
representation via text-based decomposition"): what each of the last layers' heads writes into
the image embedding, described by the texts that span it.

A CLIP's image embedding is, up to ln_post's per-image centring and scale, the sum of what every
layer's heads and MLPs write into the class token: head h of layer l writes
proj_h(sum_i a_i v_i), with a the class token's attention. :func:`head_contributions` carries that
write into the shared space (centred and scaled as ln_post does that image, then projected), for a
set of images. :func:`describe_heads` then runs TextSpan's greedy search on each head: the
description along which the head's contributions vary most over the images is chosen, that
direction is projected out of the contributions and of the remaining descriptions, and again.

Only a class-token model with a projection (CLIP) writes its embedding this way; SigLIP's
attention pool mixes the heads' writes through an MLP, so it is not described (a sentence says so).
"""
from __future__ import annotations

import torch
from einops import rearrange

from ..analysis.checks import AnalysisError
from .towers import ImageTextModel

LAST_LAYERS = 4  # TextSpan's finding: CLIP's image embedding is written mostly by its last four layers
DESCRIPTIONS_PER_HEAD = 3


def describable(model: ImageTextModel) -> str | None:
    """Why this model's heads cannot be described in words; None when they can."""
    config = model.image.config
    if model.image.attn_pool is not None or not config.class_token or config.global_pool != "cls" or not config.final_norm:
        return (
            "Heads in words reads what each head writes into the class token, which is the image"
            " embedding of a CLIP; this model pools its tokens another way (an attention pool or a mean)."
        )
    return None


@torch.no_grad()
def head_contributions(
    model: ImageTextModel, tokens: torch.Tensor, grid_size: tuple[int, int], layers: list[int]
) -> torch.Tensor:
    """(B, len(layers), nh, E): what each head of ``layers`` writes into the image embedding of
    each image (directly, through the residual stream, ln_post's centring and scale of that image,
    and the projection; ln_post's bias and the other writes are left out). ``tokens``: (B, depth
    + 1, N, D), a capture's (entering the first block, then leaving each)."""
    problem = describable(model)
    if problem is not None:
        raise AnalysisError(problem)
    vit = model.image
    device = next(vit.parameters()).device
    final = tokens[:, -1, 0].to(device)  # (B, D): the class token ln_post reads
    scale = (final.var(dim=-1, unbiased=False) + vit.norm.eps).rsqrt()  # ln_post's 1 / sigma
    rope = vit.rope_tables(grid_size)
    out = []
    for layer in layers:
        block = vit.blocks[layer]
        attn = block.attn
        q, k, v = attn._qkv(block.norm1(tokens[:, layer].to(device))).unbind(0)  # (B, nh, N, hd)
        q, k = attn.rotate(q, rope), attn.rotate(k, rope)
        weights = ((q[:, :, :1] * attn.scale) @ k.transpose(-2, -1)).softmax(dim=-1)  # (B, nh, 1, N)
        heads = (weights @ v)[:, :, 0]  # (B, nh, hd): each head's output at the class token
        projection = rearrange(attn.proj.weight, "d (nh hd) -> nh hd d", nh=attn.num_heads)
        writes = torch.einsum("bnh,nhd->bnd", heads, projection)  # (B, nh, D), before proj's bias
        writes = block.ls1(writes)
        centred = writes - writes.mean(dim=-1, keepdim=True)
        normed = centred * scale[:, None, None] * vit.norm.weight
        out.append(model.project_image_linear(normed))
    return torch.stack(out, dim=1).cpu()


def describe_heads(
    contributions: torch.Tensor, texts: torch.Tensor, descriptions: tuple[str, ...], count: int = DESCRIPTIONS_PER_HEAD
) -> list[list[tuple[str, float]]]:
    """TextSpan on each head: ``contributions`` (B, H, E) over B images, ``texts`` (T, E) the
    descriptions' unit embeddings -> per head, ``count`` (description, share of the head's
    variance over the images it explains) in the order chosen."""
    if contributions.shape[0] < 2:
        raise AnalysisError("heads in words needs at least two images: a head is described by how its writes vary")
    described = []
    for head in range(contributions.shape[1]):
        writes = contributions[:, head].double()
        writes = writes - writes.mean(dim=0)
        total = float(writes.pow(2).sum()) or 1.0
        candidates = texts.double().clone()
        chosen = []
        for _ in range(min(count, len(descriptions))):
            lengths = candidates.norm(dim=-1).clamp_min(1e-12)
            spread = (writes @ (candidates / lengths[:, None]).t()).pow(2).sum(dim=0)  # (T,) variance along each
            for index, _ in chosen:
                spread[index] = -1.0
            best = int(spread.argmax())
            direction = candidates[best] / lengths[best]
            chosen.append((best, float(spread[best]) / total))
            writes = writes - (writes @ direction)[:, None] * direction
            candidates = candidates - (candidates @ direction)[:, None] * direction
        described.append([(descriptions[index], share) for index, share in chosen])
    return described
