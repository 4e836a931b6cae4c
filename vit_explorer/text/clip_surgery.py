"""CLIP Surgery (Li et al. 2023, "CLIP Surgery for better explainability with enhancement in
open-vocabulary tasks"; xmed-lab/CLIP_Surgery): where each prompt is, in two steps.

- :func:`patch_embeddings`, the architecture surgery: over the last :data:`SURGERY_BLOCKS` blocks
  a second path runs beside the model's, each block adding v-v self-attention (the values
  attending to the values, no FFN) of the *original* path's tokens to it; its patch tokens go
  through ln_post and the projection. Every term is a function of the tokens the capture kept, so
  this costs six blocks' value projections and attention, less than one forward; nothing of the
  shared model changes.
- :func:`similarity_maps`, the feature surgery: the features every prompt shares (a patch times
  each text, weighted by how likely the image is that text, averaged over the prompts) are
  subtracted before the sum that makes the cosine. It depends on the set of prompts: with one
  prompt the authors subtract an empty prompt's embedding instead (:func:`empty_prompt`).

Only a class-token CLIP of at least six blocks is what the authors' code runs; others are refused
in a sentence (:class:`ValueError`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange

from ..model.capture import Capture
from .towers import LABEL_TEMPLATE, ImageTextModel

SURGERY_BLOCKS = 6  # the authors' `for i in range(1, 7)` over the last blocks of a ViT


def check_model(model: ImageTextModel) -> None:
    """Refuse, in a sentence, a tower the authors' code does not run."""
    vit = model.image
    if vit.attn_pool is not None or vit.config.global_pool != "cls" or not vit.config.class_token:
        raise ValueError("CLIP Surgery is defined for CLIP's class-token towers; this model pools its patches another way")
    if vit.config.depth < SURGERY_BLOCKS:
        raise ValueError(
            f"CLIP Surgery changes the last {SURGERY_BLOCKS} blocks; this model has only {vit.config.depth}"
        )


@torch.no_grad()
def patch_embeddings(model: ImageTextModel, captured: Capture) -> torch.Tensor:
    """(B, gh * gw, E) unit embeddings of the patches along the surgery's v-v path."""
    check_model(model)
    vit = model.image
    parameter = next(vit.parameters())
    tokens = captured.tokens
    start = vit.config.depth - SURGERY_BLOCKS
    path = tokens[:, start].to(parameter.device, parameter.dtype)  # (B, N, D): where the two paths part
    for layer in range(start, vit.config.depth):
        block = vit.blocks[layer]
        original = tokens[:, layer].to(parameter.device, parameter.dtype)  # the model's own input to this block
        v = block.attn._qkv(block.norm1(original))[2]  # (B, nh, N, hd)
        attention = ((v * block.attn.scale) @ v.transpose(-2, -1)).softmax(dim=-1)  # q = k = v
        heads = rearrange(attention @ v, "b nh n hd -> b n (nh hd)")
        path = path + block.ls1(block.attn.proj(block.attn.norm(heads)))  # the new path skips the FFN
    patches = vit.fc_norm(vit.norm(path[:, captured.num_prefix_tokens:]))
    return model.project_image(patches).cpu()


def empty_prompt(model: ImageTextModel, template: str = LABEL_TEMPLATE) -> torch.Tensor:
    """(E,) the unit embedding of ``template`` with an empty label: the redundant feature the
    authors subtract when there is a single prompt (their demo embeds "" in every template)."""
    return model.embed_texts([template.format("")])[0]


def similarity_maps(
    image: torch.Tensor, patches: torch.Tensor, texts: torch.Tensor, grid_size: tuple[int, int],
    redundant: torch.Tensor | None = None,
) -> torch.Tensor:
    """The feature surgery: (B, E) unit image embeddings (the pooled class token), (B, P, E)
    :func:`patch_embeddings` and (T, E) unit texts -> (B, T, gh, gw) similarities. Without
    ``redundant`` (E,) the shared features are those of the prompts themselves, which needs two
    prompts or more; with it, that embedding is subtracted from every text."""
    patches, texts = patches.float(), texts.float()
    if redundant is not None:
        similarity = patches @ (texts - redundant.float()).t()  # (B, P, T)
    elif texts.shape[0] < 2:
        raise ValueError(
            "CLIP Surgery removes what the prompts share, so one prompt alone needs the empty prompt's embedding to remove"
        )
    else:
        # The authors weigh each text by the image's softmax over them at temperature 1/2, take
        # sum_c p_c t_c w_t minus its mean over the texts; the same as one product with the
        # weighted texts minus their mean (no (B, P, T, E) tensor).
        weights = (image.float() @ texts.t() * 2).softmax(dim=-1)  # (B, T)
        weights = weights / weights.mean(dim=-1, keepdim=True)
        weighted = weights[:, :, None] * texts  # (B, T, E)
        shared = weighted.mean(dim=1, keepdim=True)  # (B, 1, E): the redundant feature
        similarity = patches @ (weighted - shared).transpose(1, 2)  # (B, P, T)
    return rearrange(similarity, "b (gh gw) t -> b t gh gw", gh=grid_size[0], gw=grid_size[1])


def maps(model: ImageTextModel, captured: Capture, texts: torch.Tensor) -> torch.Tensor:
    """Both steps on a capture against (T, E) unit texts -> (B, T, gh, gw): the v-v path's patches
    and the feature surgery; a single text loses the empty prompt's embedding instead (the
    authors' demo for one text)."""
    redundant = empty_prompt(model) if texts.shape[0] == 1 else None
    image = model.project_image(captured.logits)  # the class token, from the model's own path
    return similarity_maps(image, patch_embeddings(model, captured), texts, captured.grid_size, redundant)
