"""ProxyCLIP (Lan et al. 2024, "ProxyCLIP: proxy attention improves CLIP for open-vocabulary
segmentation"; mc-lan/ProxyCLIP): CLIP's last block with its attention replaced by a proxy's.

The proxy is a vision model of spatially coherent features (a DINO of the catalogue, or the
sidebar's model), captured on the same picture. Its last layer's patch tokens after the final
norm (DINO's ``get_intermediate_layers``) give the attention: their cosines, shifted by
``beta`` times their mean and scaled by ``gamma``, negatives masked out, a softmax over each row.
CLIP's last block's values (of its normed input, the patches only) are resampled bilinearly to
the proxy's grid, as the authors do when the grids differ, and attended there; the output
projection, ln_post and the projection follow (no residual, no FFN). The maps come out on the
proxy's grid (:attr:`Proxy.grid_size`).

Once both captures are there this is a fraction of one block of each: the shared models are not
changed. A proxy whose picture has another shape than CLIP's (a grid of another aspect ratio),
or a batch of another size, and a picture whose patches the proxy sees all alike (every one
masked out: the authors' softmax gives NaN) are refused in a sentence (:class:`ValueError`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from einops import rearrange

from ..model.capture import Capture
from ..model.vit import ViT
from .towers import ImageTextModel

BETA, GAMMA = 1.2, 3.0  # the authors' defaults (ProxyCLIPSegmentation)


def proxy_input(x: torch.Tensor, config, proxy_config) -> torch.Tensor:
    """CLIP's input (B, C, H, W), normalised with ``config``'s mean and std, as the proxy reads it:
    the same pixels (the same crop) normalised with ``proxy_config``'s, as the authors un-normalise
    and normalise again; resized bilinearly when the proxy's input size differs, as they resize
    for SAM and MAE."""
    def column(values) -> torch.Tensor:
        return torch.tensor(values, dtype=x.dtype, device=x.device)[None, :, None, None]

    pixels = x * column(config.std) + column(config.mean)
    if tuple(pixels.shape[-2:]) != tuple(proxy_config.img_size):
        pixels = F.interpolate(pixels, size=tuple(proxy_config.img_size), mode="bilinear", align_corners=False)
    return (pixels - column(proxy_config.mean)) / column(proxy_config.std)


@dataclass(frozen=True)
class Proxy:
    """The proxy: a vision model (shared, never changed) and its capture of the same picture."""

    model: ViT
    captured: Capture

    @property
    def grid_size(self) -> tuple[int, int]:
        """The grid :func:`patch_embeddings` comes out on: the proxy's."""
        return self.captured.grid_size

    def features(self) -> torch.Tensor:
        """(B, P', C) the proxy's last patch tokens after its final norm (DINO's
        get_intermediate_layers(x)[0] without the class token)."""
        parameter = next(self.model.parameters())
        tokens = self.captured.tokens[:, -1, self.captured.num_prefix_tokens:]
        with torch.no_grad():
            return self.model.norm(tokens.to(parameter.device, parameter.dtype))


def check_models(model: ImageTextModel, captured: Capture, proxy: Proxy | None) -> None:
    """Refuse, in a sentence, what the authors' code does not compute or cannot match."""
    vit = model.image
    if vit.attn_pool is not None or vit.config.global_pool != "cls" or not vit.config.class_token:
        raise ValueError("ProxyCLIP is defined for CLIP's class-token towers; this model pools its patches another way")
    if proxy is None:
        raise ValueError("ProxyCLIP borrows another model's attention: choose a proxy model (a DINO) first")
    batch, proxy_batch = captured.tokens.shape[0], proxy.captured.tokens.shape[0]
    if proxy_batch != batch:
        raise ValueError(f"the proxy saw {proxy_batch} images and CLIP {batch}: give both the same pictures")
    (gh, gw), (ph, pw) = captured.grid_size, proxy.grid_size
    if gh * pw != gw * ph:
        raise ValueError(
            f"the proxy's patch grid ({ph} x {pw}) has another shape than CLIP's ({gh} x {gw}), so its patches are not"
            " the same places of the picture: give both models the same crop"
        )


@torch.no_grad()
def patch_embeddings(
    model: ImageTextModel, captured: Capture, proxy: Proxy | None, beta: float = BETA, gamma: float = GAMMA,
) -> torch.Tensor:
    """(B, ph * pw, E) unit embeddings of the patches on the proxy's grid, CLIP's last block
    attending with ``proxy``'s attention (its model captured on the same picture)."""
    check_models(model, captured, proxy)
    vit = model.image
    parameter = next(vit.parameters())
    block = vit.blocks[-1]
    features = F.normalize(proxy.features().to(parameter.device).float(), dim=-1)  # (B, P', C)
    similarity = features @ features.transpose(1, 2)  # (B, P', P')
    # The authors' mean runs over their batch, which is one crop at a time: here, each image's own.
    similarity = (similarity - similarity.mean(dim=(1, 2), keepdim=True) * beta) * gamma
    masked = similarity < 0
    if masked.all(dim=-1).any():  # the authors' softmax of a row of -inf: NaN
        raise ValueError(
            f"the proxy sees this picture's patches nearly alike (their mean cosine is above 1/beta = {1 / beta:.2f}),"
            " so its attention masks every patch out; try another proxy or picture"
        )
    attention = similarity.masked_fill(masked, float("-inf")).softmax(dim=-1).to(parameter.dtype)

    entering = captured.tokens[:, -2].to(parameter.device, parameter.dtype)  # the last block's input
    v = block.attn._qkv(block.norm1(entering))[2][:, :, captured.num_prefix_tokens:]  # (B, nh, P, hd)
    (gh, gw), (ph, pw) = captured.grid_size, proxy.grid_size
    v = rearrange(v, "b nh (gh gw) hd -> (b nh) hd gh gw", gh=gh, gw=gw)
    v = F.interpolate(v, size=(ph, pw), mode="bilinear", align_corners=False)
    v = rearrange(v, "(b nh) hd ph pw -> b nh (ph pw) hd", b=entering.shape[0])
    heads = rearrange(attention[:, None] @ v, "b nh p hd -> b p (nh hd)")  # every head the proxy's attention
    out = block.attn.proj(block.attn.norm(heads))
    return model.project_image(vit.fc_norm(vit.norm(out))).cpu()
