"""ProxyCLIP (Lan et al. 2024, "ProxyCLIP: proxy attention improves CLIP for open-vocabulary
segmentation"; mc-lan/ProxyCLIP): CLIP's last block with its attention replaced by a proxy's.

The proxy is a vision model of spatially coherent features (a DINO of the catalogue, or the
sidebar's model), captured on the same picture. Its last layer's patch tokens after the final
norm (DINO's ``get_intermediate_layers``) give the attention: their cosines, shifted by
``beta`` times their mean and scaled by ``gamma``, negatives masked out, a softmax over each row.
CLIP's last block's values (of its normed input, the patches only) are resampled bilinearly to
the proxy's grid, as the authors do when the grids differ, and attended there; the output
projection, ln_post and the projection follow (no residual, no FFN). The maps come out on the
proxy's grid (:func:`grid_size`).

Once both captures are there this is a fraction of one block of each: the shared models are not
changed. A proxy whose picture has another shape than CLIP's (a grid of another aspect ratio),
or a batch of another size, is refused in a sentence (:class:`ValueError`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange

from ..model.capture import Capture
from ..model.vit import ViT
from .towers import ImageTextModel

BETA, GAMMA = 1.2, 3.0  # the authors' defaults (ProxyCLIPSegmentation)


def grid_size(proxy: Capture) -> tuple[int, int]:
    """The grid :func:`patch_embeddings` comes out on: the proxy's."""
    return proxy.grid_size


def check_models(model: ImageTextModel, captured: Capture, proxy: Capture) -> None:
    """Refuse, in a sentence, what the authors' code does not compute or cannot match."""
    vit = model.image
    if vit.attn_pool is not None or vit.config.global_pool != "cls" or not vit.config.class_token:
        raise ValueError("ProxyCLIP is defined for CLIP's class-token towers; this model pools its patches another way")
    if proxy.tokens.shape[0] != captured.tokens.shape[0]:
        raise ValueError(f"the proxy saw {proxy.tokens.shape[0]} images and CLIP {captured.tokens.shape[0]}: give both the same pictures")
    (gh, gw), (ph, pw) = captured.grid_size, proxy.grid_size
    if gh * pw != gw * ph:
        raise ValueError(
            f"the proxy's patch grid ({ph} x {pw}) has another shape than CLIP's ({gh} x {gw}), so its patches are not"
            " the same places of the picture: give both models the same crop"
        )


def proxy_features(proxy_model: ViT, proxy: Capture) -> torch.Tensor:
    """(B, P', C) the proxy's last patch tokens after its final norm (DINO's
    get_intermediate_layers(x)[0] without the class token)."""
    parameter = next(proxy_model.parameters())
    with torch.no_grad():
        return proxy_model.norm(proxy.tokens[:, -1, proxy.num_prefix_tokens:].to(parameter.device, parameter.dtype))


@torch.no_grad()
def patch_embeddings(
    model: ImageTextModel, captured: Capture, proxy_model: ViT, proxy: Capture, beta: float = BETA, gamma: float = GAMMA,
) -> torch.Tensor:
    """(B, ph * pw, E) unit embeddings of the patches on the proxy's grid, CLIP's last block
    attending with ``proxy``'s attention (``proxy_model`` captured on the same picture)."""
    check_models(model, captured, proxy)
    vit = model.image
    parameter = next(vit.parameters())
    block = vit.blocks[-1]
    features = F.normalize(proxy_features(proxy_model, proxy).to(parameter.device).float(), dim=-1)  # (B, P', C)
    similarity = features @ features.transpose(1, 2)  # (B, P', P')
    # The authors' mean runs over their batch, which is one crop at a time: here, each image's own.
    similarity = (similarity - similarity.mean(dim=(1, 2), keepdim=True) * beta) * gamma
    attention = similarity.masked_fill(similarity < 0, float("-inf")).softmax(dim=-1).to(parameter.dtype)

    entering = captured.tokens[:, -2].to(parameter.device, parameter.dtype)  # the last block's input
    v = block.attn._qkv(block.norm1(entering))[2][:, :, captured.num_prefix_tokens:]  # (B, nh, P, hd)
    (gh, gw), (ph, pw) = captured.grid_size, proxy.grid_size
    v = rearrange(v, "b nh (gh gw) hd -> (b nh) hd gh gw", gh=gh, gw=gw)
    v = F.interpolate(v, size=(ph, pw), mode="bilinear", align_corners=False)
    v = rearrange(v, "(b nh) hd ph pw -> b nh (ph pw) hd", b=entering.shape[0])
    heads = rearrange(attention[:, None] @ v, "b nh p hd -> b p (nh hd)")  # every head the proxy's attention
    out = block.attn.proj(block.attn.norm(heads))
    return model.project_image(vit.fc_norm(vit.norm(out))).cpu()
