"""Resizing a model to another patch size (FlexiViT's PI-resize of the patch kernel) and/or image
size (position embeddings resampled; rotary positions need nothing: their angles follow the
grid of each pass); the numerics live in vit_explorer.model.vit, which the
forward at ``patch_size=`` shares."""

from __future__ import annotations

import torch
from einops import rearrange

from ..model.vit import ViT, resample_patch_embed, resample_pos_embed, resize_matrix
from .build import adopt


def resize_patches(x: torch.Tensor, old_patch: int, new_patch: int) -> torch.Tensor:
    """Resize each p x p patch of (B, C, H, W) images on its own, as PI-resize's matrix does."""
    patches = rearrange(
        x.double(), "b c (gh ph) (gw pw) -> b c gh gw (ph pw)", ph=old_patch, pw=old_patch
    )
    resized = patches @ resize_matrix((old_patch, old_patch), (new_patch, new_patch)).to(x.device)
    return rearrange(resized, "b c gh gw (ph pw) -> b c (gh ph) (gw pw)", ph=new_patch).to(x.dtype)


def resize_model(model: ViT, patch_size: int | None = None, image_size=None, *, share_weights: bool = False) -> ViT:
    """A copy of ``model`` for a new patch size and/or image size; the original is untouched.

    With ``share_weights`` only the resampled tensors (patch kernel, position embeddings) are
    new: the rest is the original's own storage, which saves a copy of the whole model (330 MB
    for a ViT-B) for a model that is only run, never trained (the app's shared models).
    """
    old = model.config
    new = old.replace(
        patch_size=patch_size if patch_size is not None else old.patch_size,
        image_size=image_size if image_size is not None else old.image_size,
    )
    if new.img_size != old.img_size:  # a size the person chose is read whole
        new = new.replace(unread_margin=0)
    state = {
        key: value.detach() if share_weights else value.detach().clone()
        for key, value in model.state_dict().items()
    }
    if new.patch_size != old.patch_size:
        # In float64 (then back), the most exact copy; a forward at patch_size= uses the kernel's dtype.
        weight = state["patch_embed.proj.weight"]
        state["patch_embed.proj.weight"] = resample_patch_embed(weight.double(), new.patch_size).to(weight.dtype)
    if "pos_embed" in state:  # a model with rotary positions only (DINOv3) has none
        prefix = 0 if old.no_embed_class else old.num_prefix_tokens
        state["pos_embed"] = resample_pos_embed(
            state["pos_embed"], old.grid_size, new.grid_size, prefix, old.pos_embed_interpolation,
            old.pos_embed_ar_preserving,
        )

    resized, result = adopt(new, state)  # the cloned tensors keep the model's device and dtype
    assert not result.missing_keys and not result.unexpected_keys, result
    return resized.train(model.training)
