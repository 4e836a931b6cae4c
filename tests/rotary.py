"""Rotary-position models shared by the tests: timm's Eva built small with random weights (and its
attention recomputed with timm's own functions), and tiny rotary ViTs of ours."""
import timm
import torch
import torch.nn.functional as F
from timm.layers import apply_rot_embed_cat

import vit_explorer as vx

from helpers import randomize

SMALL = dict(embed_dim=64, depth=2, num_heads=2, num_classes=5)


def timm_eva(name: str, overrides: dict, image_size: tuple[int, int]):
    model = randomize(timm.create_model(
        name, pretrained=False, img_size=image_size, dynamic_img_size=True, **SMALL, **overrides
    ))
    with torch.no_grad():
        for block in model.blocks:  # peaked attention, so that a wrong rotation shows
            (block.attn.qkv if block.attn.qkv is not None else block.attn.q_proj).weight.mul_(4)
    return model


def timm_attentions(eva, x: torch.Tensor) -> list[torch.Tensor]:
    """Every layer's (B, nh, N, N) attention of timm's pass, recomputed explicitly from each attention
    module's input and rotary tables with timm's own functions."""
    found = []

    def explicit(attn, args, kwargs, output):
        tokens, rope = args[0], kwargs["rope"]
        batch, count, _ = tokens.shape
        if attn.qkv is not None:
            bias = None if attn.q_bias is None else torch.cat((attn.q_bias, attn.k_bias, attn.v_bias))
            qkv = F.linear(tokens, attn.qkv.weight, bias).reshape(batch, count, 3, attn.num_heads, -1)
            q, k, _ = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        else:
            q, k = (proj(tokens).reshape(batch, count, attn.num_heads, -1).transpose(1, 2)
                    for proj in (attn.q_proj, attn.k_proj))
        prefix = attn.num_prefix_tokens
        q, k = (torch.cat([t[:, :, :prefix], apply_rot_embed_cat(t[:, :, prefix:], rope, half=attn.rotate_half)], dim=2)
                for t in (q, k))
        found.append(((q * attn.scale) @ k.transpose(-2, -1)).softmax(-1))

    handles = [block.attn.register_forward_hook(explicit, with_kwargs=True) for block in eva.blocks]
    try:
        with torch.no_grad():
            eva.forward_features(x)
    finally:
        for handle in handles:
            handle.remove()
    return found


SIZES = {"vit_small": ((224, 224), (224, 320)), "eva02_base_patch14_448": ((448, 448), (448, 336))}


def sizes(name: str) -> tuple[tuple[int, int], tuple[int, int]]:
    """The model's own input size and a non-square one that its patch size tiles."""
    if name in SIZES:
        return SIZES[name]
    return ((224, 224), (224, 322)) if "patch14" in name else ((224, 224), (224, 320))


TINY = dict(image_size=(16, 32), patch_size=4, num_classes=5, embed_dim=32, depth=3, num_heads=2)
ROTARY = {
    "DINOv3: registers, SwiGLU, LayerScale": dict(
        rope_type="dinov3", abs_pos_embed=False, reg_tokens=2, swiglu_mlp=True, swiglu_align_to=8, init_values=0.1,
    ),
    "EVA-02: abs + rope, separate q/k/v, scale_mlp": dict(
        rope_type="cat", ref_feat_shape=(2, 4), qkv_fused=False, swiglu_mlp=True, scale_mlp=True, global_pool="mean",
    ),
}


def rotary_model(family: str) -> vx.ViT:
    model = randomize(vx.ViT(vx.ViTConfig(**TINY, **ROTARY[family])))
    with torch.no_grad():
        for block in model.blocks:  # peaked attention, so that a wrong rotation shows
            (block.attn.qkv if block.attn.qkv_fused else block.attn.q_proj).weight.mul_(4)
    return model
