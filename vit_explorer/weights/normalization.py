"""Where a checkpoint's normalisation (the mean and std its inputs were given) comes from.

Read where the publisher wrote it, else told by the structure where that is unambiguous, else
assumed, and the config says which (ViTConfig.normalization_source):

- the publisher: Hugging Face's preprocessor_config.json (from_huggingface), timm's
  ``pretrained_cfg`` in a Hub folder's config.json (from_timm), open_clip's ``preprocess_cfg`` in
  open_clip_config.json (from_open_clip); torchvision's ViTs are all ImageNet's; our own files
  carry theirs ("given").
- the structure (:func:`from_structure`), as timm's pretrained configs have it for every ViT of
  that shape: CLIP's image tower (a pre-norm, no patch bias) OpenAI CLIP's; DeiT's distillation
  token, LayerScale with a class token and no registers (DINOv2, DeiT III) and DINOv2's shape with
  registers (4, patch 14) ImageNet's; SigLIP's attention-pool head 0.5. Eva's families are told in
  from_eva (DINOv3 ImageNet's, EVA-02 OpenAI CLIP's).
- else assumed: timm's default, 0.5 (Google's ViTs; DeiT and DINO are ImageNet's, with the same
  shape), or ImageNet's for LayerScale, registers and a class token not of DINOv2's shape. The app
  says which was assumed and lets the person choose another (:func:`renormalized`).
"""

from __future__ import annotations

import torch

from ..model.config import (
    IMAGENET_MEAN, IMAGENET_STD, INCEPTION_MEAN, INCEPTION_STD, OPENAI_CLIP_MEAN, OPENAI_CLIP_STD,
)
from ..model.vit import ViT
from .build import adopt

ASSUMED = "assumed"


def _fields(mean, std, source: str) -> dict:
    return {"mean": tuple(mean), "std": tuple(std), "normalization_source": source}


def is_aimv2(state: dict[str, torch.Tensor]) -> bool:
    """Apple's AIMv2 as timm names it: a norm on the patch embeddings, RMSNorms (weights without a
    bias), no class token."""
    return "patch_embed.norm.weight" in state and "blocks.0.norm1.bias" not in state and "cls_token" not in state


def from_structure(state: dict[str, torch.Tensor]) -> dict:
    """mean, std and normalization_source (ViTConfig fields) told by a converted (timm-named)
    state dict's structure, or assumed where it does not tell (module docstring)."""
    kernel = state["patch_embed.proj.weight"]  # (D, C, p, p)
    if kernel.shape[1] != 3:
        return _fields((0.5,) * kernel.shape[1], (0.5,) * kernel.shape[1], ASSUMED)
    class_token, layer_scale = "cls_token" in state, "blocks.0.ls1.gamma" in state
    registers = state["reg_token"].shape[1] if "reg_token" in state and state["reg_token"].dim() == 3 else 0
    if "norm_pre.weight" in state and "patch_embed.proj.bias" not in state:
        return _fields(OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, "structure: CLIP's image tower (a pre-norm, no patch bias)")
    if is_aimv2(state):
        return _fields(OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, "structure: AIMv2 (RMSNorm, a patch-embedding norm)")
    if "dist_token" in state:
        return _fields(IMAGENET_MEAN, IMAGENET_STD, "structure: DeiT's distillation token")
    if "attn_pool.latent" in state:
        return _fields(INCEPTION_MEAN, INCEPTION_STD, "structure: SigLIP's attention-pool head")
    if class_token and layer_scale and not registers:
        return _fields(IMAGENET_MEAN, IMAGENET_STD, "structure: LayerScale with a class token (DINOv2, DeiT III)")
    if class_token and layer_scale:
        if registers == 4 and kernel.shape[-1] == 14:
            return _fields(IMAGENET_MEAN, IMAGENET_STD, "structure: DINOv2 with registers (4 registers, LayerScale, patch 14)")
        return _fields(IMAGENET_MEAN, IMAGENET_STD, ASSUMED)  # DINOv2's, the likeliest of several
    return _fields(INCEPTION_MEAN, INCEPTION_STD, ASSUMED)  # timm's default


def renormalized(model: ViT, mean, std, source: str = "chosen") -> ViT:
    """``model`` read with another mean and std: a model whose config says them, holding the same
    tensors (nothing copied); ``model`` itself is untouched, as a shared model must be."""
    config = model.config.replace(mean=tuple(mean), std=tuple(std), normalization_source=source)
    copy, result = adopt(config, {key: value.detach() for key, value in model.state_dict().items()})
    assert not result.missing_keys and not result.unexpected_keys, result
    return copy.train(model.training)
