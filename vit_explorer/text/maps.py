"""Where in the image each text is: a map over the patches for every prompt.

- :func:`patch_embeddings`: each patch token carried into the shared space along the path the
  model's pooling would carry it if it attended to that patch alone (MaskCLIP, Zhou et al. 2022):
  a class token's model through the last block's value projection, ln_post and the projection
  (the residual and the last MLP left out, as MaskCLIP does); SigLIP's attention pool through its
  value projection, output projection and residual MLP; a mean-pooled model's tokens as they are.
  Their cosine with a text embedding is the dense similarity map (:func:`similarity_maps`): one
  small matrix product once the image is captured.
- :func:`relevance`: the attribution the Attention page computes for a class (Chefer et al.),
  with the image's cosine with the text as the score whose gradient is followed.
- :func:`best_prompt`: over several prompts, the prompt each patch is most like.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from einops import rearrange

from ..analysis.rollout import attribution
from ..model.capture import Capture
from .towers import ImageTextModel


@torch.no_grad()
def patch_embeddings(model: ImageTextModel, captured: Capture) -> torch.Tensor:
    """(B, gh * gw, E) unit embeddings of the patches in the space the texts share."""
    return last_block_embeddings(model, captured.tokens[:, -2:], captured.num_prefix_tokens)


@torch.no_grad()
def last_block_embeddings(model: ImageTextModel, tokens: torch.Tensor, num_prefix_tokens: int) -> torch.Tensor:
    """:func:`patch_embeddings` from the (B, 2, N, D) tokens entering and leaving the last block
    (a capture's last two, or several images' read together: app.selection.ImageSet)."""
    vit = model.image
    device = next(vit.parameters()).device
    prefix = num_prefix_tokens
    if vit.attn_pool is not None:
        pool = vit.attn_pool
        patches = vit.norm(tokens[:, -1, prefix:].to(device))
        values = pool.kv(patches).chunk(2, dim=-1)[1]  # (B, P, D): the pool's values, every head
        out = pool.proj(values)
        pooled = out + pool.mlp(pool.norm(out))
    elif vit.config.global_pool == "cls" and vit.config.class_token:
        block = vit.blocks[-1]
        entering = tokens[:, -2].to(device)  # (B, N, D): the last block's input
        values = block.attn._qkv(block.norm1(entering))[2]  # (B, nh, N, hd)
        out = block.ls1(block.attn.proj(block.attn.norm(rearrange(values, "b nh n hd -> b n (nh hd)"))))
        pooled = vit.fc_norm(vit.norm(out[:, prefix:]))
    else:  # mean pooling: the pooled token is the patches' mean, so each patch is a share of it
        pooled = vit.fc_norm(vit.norm(tokens[:, -1, prefix:].to(device)))
    return model.project_image(pooled).cpu()


def dense_path(model: ImageTextModel, detail: bool = False) -> str:
    """How :func:`patch_embeddings` carries the patches into the texts' space, in a few words (a
    title's), or with ``detail`` which steps (a caption's)."""
    vit = model.image
    if vit.attn_pool is not None:
        name, steps = "the attention pool's value path", "the pool's value and output projections and its MLP"
    elif vit.config.global_pool == "cls" and vit.config.class_token:
        name, steps = "MaskCLIP's value path", "the last block's value projection, the final norm and the projection"
    else:
        name, steps = "the mean pool's path", "the final norm, as the mean pooling reads every patch"
    return f"{name} (each patch through {steps})" if detail else name


def similarity_maps(patches: torch.Tensor, texts: torch.Tensor, grid_size: tuple[int, int]) -> torch.Tensor:
    """(B, P, E) patch and (T, E) text unit embeddings -> (B, T, gh, gw) cosines."""
    cosines = patches.float() @ texts.float().t()  # (B, P, T)
    return rearrange(cosines, "b (gh gw) t -> b t gh gw", gh=grid_size[0], gw=grid_size[1])


def best_prompt(similarities: torch.Tensor) -> torch.Tensor:
    """(B, T, gh, gw) -> (B, gh, gw): the index of the prompt each patch is most like."""
    return similarities.argmax(dim=1)


def text_score(model: ImageTextModel, text: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """The image's cosine with ``text`` (E,), a unit text embedding, as a function of the image
    tower's outputs (B, D) -> (B,): the score a label's relevance follows, and the score of the
    faithfulness curves of its maps (analysis.faithfulness)."""
    direction = text.float()

    def cosine(pooled: torch.Tensor) -> torch.Tensor:
        projection = model.image_projection
        if projection is not None:
            pooled = pooled.float() @ projection.t().to(pooled.device)
        return F.normalize(pooled.float(), dim=-1) @ direction.to(pooled.device)

    return cosine


def relevance(model: ImageTextModel, x: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
    """(B, gh, gw) relevance of each patch to the image's cosine with ``text`` (E,), a unit
    text embedding: the class attribution with that cosine as its target."""
    return attribution(model.image, x, score=text_score(model, text))
