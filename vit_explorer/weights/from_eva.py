"""timm's Eva family (DINOv3, EVA-02, EVA-01) and Meta's original DINOv3 files.

No checkpoint says which rotary positions its model uses, so the family is told from the keys
(and the file's name where the keys cannot), with timm's own model definitions (``eva.py``):

- DINOv3 (``vit_*_patch16_dinov3[_qkvb]``): no learned position embedding, 4 registers, LayerScale.
  Rotary "dinov3", LayerNorm eps 1e-5, ImageNet mean/std. Pooled on the class token, as upstream
  does (timm defaults to the patch tokens' mean: ``global_pool="mean", fc_norm=False`` gives
  timm's). The rotary periods rounded to bfloat16, as the original checkpoints keep them and as
  timm's model card rounds them to match (``rope_periods_dtype="float32"`` gives timm's own).
- EVA-02 (``eva02_*``): learned positions and rotary "cat" (ref_feat_shape 16 x 16 for every size,
  the CLIP B/16 included), a SwiGLU MLP. LayerNorm eps 1e-6, OpenAI CLIP mean/std.
- EVA-01 and other Eva models without rotary positions: a ViT with q and v biases.

timm's names are ours once model.from_timm_eva has renamed LayerScale and the q/v biases. Meta's
original DINOv3 files (``storage_tokens``, ``rope_embed.periods``) are renamed as timm's
checkpoint_filter_fn does; their stored periods give the heads and the temperature.
"""

from __future__ import annotations

import math
import re

import torch

from ..model.config import IMAGENET_MEAN, IMAGENET_STD, OPENAI_CLIP_MEAN, OPENAI_CLIP_STD
from ..model.rope import RopeSpec, _frequencies
from ..model.vit import from_timm_eva
from .checks import CheckpointError
from .normalization import is_aimv2

# Keys only an Eva (timm) or Meta's DINOv3 has: LayerScale's gamma_1, q/v biases, EVA-02's
# separate projections and split SwiGLU; Meta's registers, rotary periods, masked k bias and SwiGLU.
_EVA_KEYS = re.compile(
    r"^(blocks\.\d+\.(gamma_1|attn\.q_bias|attn\.q_proj\.weight|mlp\.fc1_g\.weight|attn\.qkv\.bias_mask|mlp\.w1\.weight)"
    r"|storage_tokens|rope_embed\.periods)$"
)
# Meta's DINOv3 training leftovers that never reach the tokens.
_META_UNUSED = re.compile(r"^(mask_token|local_cls_norm\..*|projectors\..*|rope_embed\.periods|.*\.bias_mask)$")
_META_RENAMES = [
    (r"^storage_tokens$", "reg_token"),
    (r"\.mlp\.w1\.", ".mlp.fc1_g."),  # SwiGLUFFN: w1 the gate, w2 the value, w3 the output
    (r"\.mlp\.w2\.", ".mlp.fc1_x."),
    (r"\.mlp\.w3\.", ".mlp.fc2."),
]
DINOV3 = dict(
    rope_type="dinov3", abs_pos_embed=False, layer_norm_eps=1e-5, rope_periods_dtype="bfloat16",
    image_size=224, mean=IMAGENET_MEAN, std=IMAGENET_STD, normalization_source="structure: DINOv3 (rotary positions)",
)
EVA02 = dict(
    rope_type="cat", ref_feat_shape=(16, 16), layer_norm_eps=1e-6, mean=OPENAI_CLIP_MEAN, std=OPENAI_CLIP_STD,
    normalization_source="structure: EVA-02 (rotary positions, SwiGLU)",
)
EVA = dict(layer_norm_eps=1e-6, mean=OPENAI_CLIP_MEAN, std=OPENAI_CLIP_STD, normalization_source="structure: Eva (EVA-01)")


def recognises(state: dict[str, torch.Tensor]) -> bool:
    # AIMv2's SwiGLU has Eva's fc1_g, but it is timm's plain ViT, named as ours.
    return not is_aimv2(state) and any(_EVA_KEYS.match(key) for key in state)


def convert(state: dict[str, torch.Tensor], name: str) -> tuple[dict[str, torch.Tensor], dict]:
    """(our state dict, config fields the shapes cannot tell) of an Eva-family file."""
    known: dict = {}
    if "storage_tokens" in state or "rope_embed.periods" in state:
        state, known = _from_meta_dinov3(state, name)
    else:
        try:
            state = from_timm_eva(state)
        except KeyError:  # a q_bias without its v_bias
            raise CheckpointError(f"{name} has q biases without their v biases, as no Eva has") from None
        except RuntimeError:  # biases that do not fit together
            raise CheckpointError(f"{name}'s q and v biases do not fit together as an Eva's") from None
    return state, {**_family(state, name), **known}


def perception_encoder(state: dict[str, torch.Tensor], name: str) -> dict | None:
    """The config fields of Meta's Perception Encoder (timm's vit_pe_*, an Eva) if ``state`` is
    one, else None. Its rotary positions are in no tensor, so it is told by what only it has: a
    pre-norm without a patch bias (as CLIP's tower) and an attention pool beside its class token
    (core) or no final norm (spatial, lang). Its positions are EVA-02's "cat" on patch indices
    from 1, width first, on its own grid at any size; the core's pool has 8 heads and reads the
    class token too; spatial and lang pool the patches' mean, unnormed."""
    pool, final_norm = "attn_pool.latent" in state, "norm.weight" in state or "fc_norm.weight" in state
    if "norm_pre.weight" not in state or "patch_embed.proj.bias" in state:
        return None
    positions, kernel = state.get("pos_embed"), state.get("patch_embed.proj.weight")
    if kernel is not None and kernel.shape[0] == 1536:  # core G has no class token and a wider pool
        raise CheckpointError(f"{name} looks like a gigantic Perception Encoder, whose heads and positions we do not load yet")
    if not (pool and "cls_token" in state or not final_norm):
        return None
    side = math.isqrt(positions.shape[1] - 1) if positions is not None and positions.dim() == 3 else 0
    if "cls_token" not in state or side < 1 or side * side != positions.shape[1] - 1:
        raise CheckpointError(
            f"{name} has a pre-norm and {'an attention pool' if pool else 'no final norm'} as a Perception"
            " Encoder has, but not its class token and square grid of learned positions"
        )
    fields = dict(
        rope_type="cat", rope_grid_offset=1.0, rope_grid_indexing="xy", ref_feat_shape=(side, side),
        layer_norm_eps=1e-5, mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5), normalization_source="structure: Perception Encoder",
    )
    if pool:
        return {**fields, "attn_pool_num_heads": 8, "pool_include_prefix": True}
    return {**fields, "global_pool": "mean", "fc_norm": False, "final_norm": False}


def _family(state: dict[str, torch.Tensor], name: str) -> dict:
    """The facts of the file's family (module docstring) that its tensors do not hold."""
    pe = perception_encoder(state, name)
    if pe is not None:
        return pe
    lowered = name.lower()
    if "pos_embed" not in state:
        if "reg_token" in state or "dinov3" in lowered:
            return dict(DINOV3)
        raise CheckpointError(
            f"{name} has neither learned position embeddings nor a DINOv3's registers, so its rotary"
            " positions cannot be told; only DINOv3's and EVA-02's are supported"
        )
    fc1 = state.get("blocks.0.mlp.fc1.weight")
    swiglu = "blocks.0.mlp.fc1_g.weight" in state or (
        fc1 is not None and "blocks.0.mlp.fc2.weight" in state and fc1.shape[0] == 2 * state["blocks.0.mlp.fc2.weight"].shape[-1]
    )
    if swiglu or "eva02" in lowered:
        return dict(EVA02)
    if "rope" in lowered:  # timm's RoPE-ViT (rope_type "axial" or "mixed")
        raise CheckpointError(f"{name} looks like a RoPE-ViT, whose rotary positions are not supported")
    return dict(EVA)


def _from_meta_dinov3(state: dict[str, torch.Tensor], name: str) -> tuple[dict[str, torch.Tensor], dict]:
    """Meta's names renamed to ours; the stored periods give the heads and the temperature."""
    known = _from_periods(state.get("rope_embed.periods"), state, name)
    converted = {}
    for key, value in state.items():
        if _META_UNUSED.match(key):
            continue
        for pattern, replacement in _META_RENAMES:
            key = re.sub(pattern, replacement, key)
        if key.endswith(".attn.qkv.bias"):
            # The keys' third is masked to zero (bias_mask): whatever the file holds there is unused.
            value = value.clone()
            value[value.shape[0] // 3 : 2 * value.shape[0] // 3] = 0
        converted[key] = value
    return converted, known


def _from_periods(periods: torch.Tensor | None, state: dict[str, torch.Tensor], name: str) -> dict:
    """num_heads, rope_temperature and rope_periods_dtype from DINOv3's stored rotary periods,
    temperature ** (4 i / hd) for i < hd / 4, checked to be exactly those of a whole temperature."""
    if periods is None:
        return {}
    kernel = state.get("patch_embed.proj.weight")
    invalid = CheckpointError(f"{name}'s rotary periods are not those of a DINOv3 (temperature ** (4 i / head_dim))")
    if kernel is None or kernel.dim() != 4 or periods.dim() != 1 or not periods.is_floating_point():
        raise invalid
    bands, embed_dim = periods.shape[0], kernel.shape[0]
    if bands < 2 or embed_dim % (4 * bands):
        raise invalid
    stored = periods.float()
    # The last period is temperature ** ((n - 1) / n): the stored dtype's rounding barely moves it.
    estimate = float(stored[-1]) ** (bands / (bands - 1))
    if not math.isfinite(estimate) or not 1 < estimate < 1e9:
        raise invalid
    dtype = "bfloat16" if periods.dtype == torch.bfloat16 else "float32"
    temperature = float(round(estimate))
    spec = RopeSpec("dinov3", 4 * bands, temperature, "ij", None, dtype)
    if not torch.allclose(_frequencies(spec), stored, rtol=2**-8, atol=0):  # a bfloat16 step
        raise invalid
    return {"num_heads": embed_dim // (4 * bands), "rope_temperature": temperature, "rope_periods_dtype": dtype}
