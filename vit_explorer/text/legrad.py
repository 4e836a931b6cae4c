"""LeGrad (Bousselham et al. 2024, "LeGrad: an explainability method for vision transformers via
feature formation sensitivity"; WalBouss/LeGrad): a text's relevance over the patches from the
gradient of the image's cosine with the text, read at each of the last layers, with respect to
that layer's attention map; the positive part averaged over heads and queries and summed over
the layers. Beside Chefer's relevance (text.maps.relevance), and for SigLIP too.

As the authors' wrapper computes it (their default ``layer_index=-2``: the last two layers):

- a class-token CLIP: layer l's image embedding is ln_post of the mean of *all* its output tokens
  (the class token too), projected; the gradient is taken w.r.t. block l's self-attention;
- SigLIP: layer l's output tokens (without the final norm, as their hooks read them) go through
  the attention pool; the gradient is taken w.r.t. the pool's attention. The same is done for an
  empty prompt ("a photo of a"), and the patches that map ranks above 0.8 of its range are zeroed.

Each layer's score depends on that layer's attention only through that layer, so every recomputed
block starts from the tokens the capture kept (no gradient flows between layers): the last
blocks once forward and once backward, less than one forward and backward of the tower. The
shared model is not changed (the attention maps are the only tensors asking for gradients).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange

from ..model.capture import Capture
from .towers import ImageTextModel

LAYERS = 2  # the authors' default layer_index=-2
EMPTY_PROMPT = "a photo of a"  # the authors' SigLIP correction prompt
CORRECTION_THRESHOLD = 0.8


def check_model(model: ImageTextModel, layers: int = LAYERS) -> None:
    """Refuse, in a sentence, what the authors' code does not compute."""
    vit = model.image
    if vit.attn_pool is None and not (vit.config.global_pool == "cls" and vit.config.class_token):
        raise ValueError("LeGrad is defined for CLIP's class-token towers and SigLIP's attention pool; this model averages its patches")
    if vit.attn_pool is not None and vit.config.pool_include_prefix:
        raise ValueError("LeGrad is defined for SigLIP's attention pool over the patches; this model's pool also reads its class token")
    if not 1 <= layers <= vit.config.depth:
        raise ValueError(f"LeGrad reads between 1 and {vit.config.depth} of this model's layers, not {layers}")


def legrad(
    model: ImageTextModel, captured: Capture, text: torch.Tensor, layers: int = LAYERS,
    empty: torch.Tensor | None = None,
) -> torch.Tensor:
    """(B, gh, gw) LeGrad relevance of each patch to the image's cosine with ``text`` (E,), a unit
    text embedding, summed over the last ``layers`` layers, before the authors' final min-max
    (and up-sampling): the figures scale it. ``empty``: SigLIP's correction prompt's unit
    embedding (default: :data:`EMPTY_PROMPT` through the model's text tower)."""
    check_model(model, layers)
    vit = model.image
    if vit.attn_pool is not None:
        if empty is None:
            empty = model.embed_texts([EMPTY_PROMPT])[0]
        relevance = _siglip(model, captured, text, layers, empty)
    else:
        relevance = _clip(model, captured, text, layers)
    gh, gw = captured.grid_size
    return rearrange(relevance.detach().float().cpu(), "b (gh gw) -> b gh gw", gh=gh, gw=gw)


def _clip(model: ImageTextModel, captured: Capture, text: torch.Tensor, layers: int) -> torch.Tensor:
    vit = model.image
    parameter = next(vit.parameters())
    rope = vit.rope_tables(captured.grid_size)
    direction = text.to(parameter.device).float()
    attentions, scores = [], []
    with torch.enable_grad():
        for layer in range(vit.config.depth - layers, vit.config.depth):
            block = vit.blocks[layer]
            entering = captured.tokens[:, layer].to(parameter.device, parameter.dtype)  # (B, N, D), no graph
            q, k, v = block.attn._qkv(block.norm1(entering)).unbind(0)  # (B, nh, N, hd) each
            q, k = block.attn.rotate(q, rope), block.attn.rotate(k, rope)
            attention = ((q * block.attn.scale) @ k.transpose(-2, -1)).softmax(dim=-1).detach().requires_grad_(True)
            heads = rearrange(attention @ v, "b nh n hd -> b n (nh hd)")
            middle = entering + block.ls1(block.attn.proj(block.attn.norm(heads)))
            out = middle + block.ls2(block.mlp(block.norm2(middle)))
            image = model.project_image(vit.fc_norm(vit.norm(out.mean(dim=1))))  # every token's mean, as the authors
            attentions.append(attention)
            scores.append(image @ direction)
        gradients = torch.autograd.grad(torch.stack(scores).sum(), attentions)
    prefix = captured.num_prefix_tokens
    # The positive part, averaged over the heads and the query rows; the patches' columns.
    return sum(gradient.clamp(min=0).mean(dim=1).mean(dim=1)[:, prefix:] for gradient in gradients)


def _pool_attention(vit, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention pool (model.vit.AttentionPool) on (B, P, D) patch tokens with its attention
    (B, nh, 1, P) a leaf of the graph: -> (pooled (B, D), attention)."""
    pool = vit.attn_pool
    q = rearrange(pool.q(pool.latent), "1 q (nh hd) -> 1 nh q hd", nh=pool.num_heads)
    k, v = rearrange(pool.kv(tokens), "b n (kv nh hd) -> kv b nh n hd", kv=2, nh=pool.num_heads).unbind(0)
    attention = ((q * pool.scale) @ k.transpose(-2, -1)).softmax(dim=-1).detach().requires_grad_(True)
    x = pool.proj(rearrange(attention @ v, "b nh q hd -> b q (nh hd)"))
    x = x + pool.mlp(pool.norm(x))
    return x[:, 0], attention


def _siglip(model: ImageTextModel, captured: Capture, text: torch.Tensor, layers: int, empty: torch.Tensor) -> torch.Tensor:
    vit = model.image
    parameter = next(vit.parameters())
    prefix = captured.num_prefix_tokens
    directions = torch.stack([text, empty]).to(parameter.device).float()  # (2, E)
    relevance = torch.zeros(2, captured.tokens.shape[0], captured.tokens.shape[2] - prefix, device=parameter.device)
    with torch.enable_grad():
        for layer in range(vit.config.depth - layers, vit.config.depth):
            leaving = captured.tokens[:, layer + 1, prefix:].to(parameter.device, parameter.dtype)  # no final norm
            pooled, attention = _pool_attention(vit, leaving)
            scores = model.project_image(pooled) @ directions.t()  # (B, 2)
            for which in range(2):  # the text's map, then the empty prompt's
                gradient, = torch.autograd.grad(scores[:, which].sum(), attention, retain_graph=which == 0)
                relevance[which] += gradient.clamp(min=0).mean(dim=1)[:, 0]  # (B, P)
    mapped, empty_map = relevance
    lowest, highest = empty_map.amin(dim=1, keepdim=True), empty_map.amax(dim=1, keepdim=True)
    return mapped.masked_fill((empty_map - lowest) / (highest - lowest) > CORRECTION_THRESHOLD, 0.0)
