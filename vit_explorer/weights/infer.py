"""A ViTConfig from a converted (timm-named) state dict: what the tensors' presence and shapes
say, the facts a format's reader knows (``known``) and the caller's overrides, checked against
the tensors before any model is built.

_architecture is where a family is recognised from its keys (a class token or not, registers, a
MAP head, LayerScale, CLIP's pre-norm, Eva's separate q/k/v and SwiGLU MLPs, ...; the mean and
std they tell, normalization.py); _with_positions
finds the image size from the position embeddings (a model with rotary positions only, DINOv3, has
none: its reader says so with ``rope_type``). A family with other modules or positions extends these.
"""

from __future__ import annotations

import math
import re

import torch

from ..model.config import ViTConfig, _brief
from .checks import MAX_BLOCKS, MAX_REGISTERS, CheckpointError
from .from_eva import perception_encoder
from .normalization import from_structure, is_aimv2

# Every ViT we build has these; a state dict without them is not one. Each tuple: one of its keys
# (a fused qkv or EVA-02's separate projections; a plain or packed fc1, or SwiGLU's gate fc1_g).
REQUIRED_KEYS = (
    ("patch_embed.proj.weight",), ("blocks.0.attn.qkv.weight", "blocks.0.attn.q_proj.weight"),
    ("blocks.0.mlp.fc1.weight", "blocks.0.mlp.fc1_g.weight"), ("blocks.0.mlp.fc2.weight",),
)
# Heads of the published ViTs whose width is not 64 channels a head (the timm / torchvision / HF
# convention): ViT-H/14 and So400m (SigLIP) 16 heads of 80 and 72, ViT-g/14 16 of 88, ViT-G and
# bigG/14 16 of 104. A file without a config does not say its heads; these are the only published
# answers at those widths, and every other width keeps the convention (DINOv2-g: 1536 in 24).
PUBLISHED_HEADS = {1152: 16, 1280: 16, 1408: 16, 1664: 16}
# The rank of each tensor whose shape is read: checked before anything is computed from them.
_RANKS = {
    "patch_embed.proj.weight": 4, "blocks.0.mlp.fc1.weight": 2, "blocks.0.mlp.fc2.weight": 2, "pos_embed": 3,
    "reg_token": 3, "attn_pool.latent": 3, "head.weight": 2,
}


def infer_config(
    state: dict[str, torch.Tensor], known: dict, requested: dict, name: str
) -> ViTConfig:
    """A ViTConfig from the tensor shapes, ``known`` source facts and the caller's overrides."""
    _check_shapes(state, name)
    tensors = _architecture(state, name)
    if "rope_type" not in known and "global_pool" not in known:
        tensors.update(perception_encoder(state, name) or {})  # its rotary positions are in no tensor
    num_prefix = int(tensors["class_token"]) + int(tensors["dist_token"]) + tensors["reg_tokens"]
    fields = {
        **tensors,
        **known,
        **requested,
        "patch_size": state["patch_embed.proj.weight"].shape[-1],  # other sizes: resize_model
        "normalization_source": _normalization_source(tensors, known, requested),
    }
    layout_given = "no_embed_class" in known or "no_embed_class" in requested
    return _with_positions(fields, num_prefix, state, layout_given, name)


def _normalization_source(tensors: dict, known: dict, requested: dict) -> str:
    """Where the config's mean and std come from: the caller ("given"), else the reader (the
    publisher's, unless it says otherwise), else the structure (normalization.from_structure)."""
    for given, default in ((requested, "given"), (known, "publisher")):
        if "normalization_source" in given or "mean" in given or "std" in given:
            return given.get("normalization_source", default)
    return tensors["normalization_source"]


def _check_shapes(state: dict[str, torch.Tensor], name: str) -> None:
    if not all(any(key in state for key in keys) for keys in REQUIRED_KEYS):
        sample = ", ".join(_brief(key)[1:-1] for key in sorted(state)[:6])
        raise CheckpointError(
            f"{name} is not a ViT checkpoint we can read (found keys like {sample})"
        )
    for key, rank in _RANKS.items():
        if key in state and (state[key].dim() != rank or 0 in state[key].shape):
            raise CheckpointError(
                f"{name}'s {key} has shape {tuple(state[key].shape)}, which no ViT's has"
            )
    # Each register is a token in every attention: a file may not make every pass quadratic in it.
    if "reg_token" in state and state["reg_token"].shape[1] > MAX_REGISTERS:
        raise CheckpointError(
            f"{name} has {state['reg_token'].shape[1]} register tokens; we load ViTs with up to {MAX_REGISTERS}"
        )


def _architecture(state: dict[str, torch.Tensor], name: str) -> dict:
    """The ViTConfig fields the tensors tell: which exist, and their shapes."""
    patch_weight = state["patch_embed.proj.weight"]  # (D, C, p, p)
    embed_dim, in_chans, patch_h, patch_w = patch_weight.shape
    if patch_h != patch_w:
        raise CheckpointError(
            f"{name} has non-square patches ({patch_h}x{patch_w}), which we do not support"
        )
    depth = _block_count(state, name)
    class_token = "cls_token" in state
    attention_pool = "attn_pool.latent" in state
    if attention_pool and state["attn_pool.latent"].shape[1] != 1:
        raise CheckpointError(
            f"{name} has an attention pool with {state['attn_pool.latent'].shape[1]} probe"
            " queries; our ViT supports one"
        )
    mean_pool = not attention_pool and ("fc_norm.weight" in state or not class_token)
    return {
        "embed_dim": embed_dim,
        "in_chans": in_chans,
        "depth": depth,
        # AIMv2's heads are 128 channels wide at every width (8 at 1024, 24 at 3072): no tensor says.
        "num_heads": embed_dim // 128 if is_aimv2(state) and embed_dim % 128 == 0 else PUBLISHED_HEADS.get(embed_dim, max(1, embed_dim // 64)),
        **_attention(state),
        **_mlp(state, embed_dim),
        "class_token": class_token,
        "dist_token": "dist_token" in state,
        "reg_tokens": state["reg_token"].shape[1] if "reg_token" in state else 0,
        "global_pool": "map" if attention_pool else "mean" if mean_pool else "cls",
        "pre_norm": "norm_pre.weight" in state,
        "final_norm": "norm.weight" in state or "fc_norm.weight" in state,
        "patch_bias": "patch_embed.proj.bias" in state,
        # A CLIP image tower (norm_pre, no patch bias) is built by timm with LayerNorm eps 1e-5, AIMv2
        # with RMSNorm eps 1e-5.
        "layer_norm_eps": 1e-5 if ("norm_pre.weight" in state and "patch_embed.proj.bias" not in state) or is_aimv2(state) else 1e-6,
        # timm's RmsNorm has a weight and no bias; every LayerNorm we read has both.
        "norm_layer": "rmsnorm" if "blocks.0.norm1.weight" in state and "blocks.0.norm1.bias" not in state else "layernorm",
        "patch_norm": "patch_embed.norm.weight" in state,
        "linear_bias": "blocks.0.attn.proj.bias" in state,
        # Mean pooling without fc_norm weights means the final norm comes before the pooling.
        "fc_norm": None if "fc_norm.weight" in state or not mean_pool else False,
        # LayerScale's init value only matters for training from scratch; the weights set gamma.
        "init_values": 1.0 if "blocks.0.ls1.gamma" in state else None,
        "num_classes": state["head.weight"].shape[0] if "head.weight" in state else 0,
        "abs_pos_embed": "pos_embed" in state,
        **from_structure(state),  # mean, std and where they came from, unless a reader or the caller knows
    }


def _attention(state: dict[str, torch.Tensor]) -> dict:
    """A fused qkv or EVA-02's separate q/k/v projections (the keys' without a bias), and EVA-02
    CLIP's LayerNorm on the heads' outputs."""
    fused = "blocks.0.attn.qkv.weight" in state
    return {
        "qkv_fused": fused,
        "qkv_bias": ("blocks.0.attn.qkv.bias" if fused else "blocks.0.attn.q_proj.bias") in state,
        "scale_attn_inner": "blocks.0.attn.norm.weight" in state,
    }


def _mlp(state: dict[str, torch.Tensor], embed_dim: int) -> dict:
    """The MLP: plain, or SiLU-gated (SwiGLU) split into fc1_g and fc1_x or packed in an fc1 twice
    as tall as fc2 is wide; its width is what fc2 reads, its LayerNorm (scale_mlp) if it has one."""
    hidden = state["blocks.0.mlp.fc2.weight"].shape[1]
    scale_mlp = "blocks.0.mlp.norm.weight" in state
    ratio = hidden / embed_dim
    if int(embed_dim * ratio) != hidden:  # the quotient rounded down: the next float gives the width
        ratio = math.nextafter(ratio, math.inf)
    fields = {"mlp_ratio": ratio, "scale_mlp": scale_mlp, "swiglu_mlp": False, "swiglu_align_to": 0}
    if "blocks.0.mlp.fc1_g.weight" in state:
        # timm builds the split layout for scale_mlp or an aligned width; any alignment that
        # divides the width keeps it.
        fields.update(swiglu_mlp=True, swiglu_align_to=0 if scale_mlp else math.gcd(hidden, 8))
    elif "blocks.0.mlp.fc1.weight" in state and state["blocks.0.mlp.fc1.weight"].shape[0] == 2 * hidden:
        fields["swiglu_mlp"] = True  # timm's GluMlp: the gate, then the value
    return fields


def _with_positions(
    fields: dict, num_prefix: int, state: dict[str, torch.Tensor], layout_given: bool, name: str
) -> ViTConfig:
    """The config whose patch grid (and image size, unless given) the position embeddings cover."""
    _split_unread_margin(fields, name)
    if "pos_embed" not in state:
        # Rotary positions follow any grid: the image size is the reader's or the caller's.
        if fields.get("rope_type") is None:
            raise CheckpointError(
                f"{name} has no absolute position embedding (pos_embed), nor rotary positions we"
                " know of, which our ViT needs"
            )
        return _config(fields, state, name)
    # Position embeddings cover the patch grid, plus the prefix tokens unless no_embed_class;
    # timm's default layout (prefix tokens included) is tried first.
    num_positions = state["pos_embed"].shape[1]
    image_size, patch_size = fields.get("image_size"), fields["patch_size"]
    layouts = [False, True] if num_prefix else [False]
    if layout_given:
        layouts = [fields["no_embed_class"]]
    try:
        for no_embed_class in layouts:
            num_patches = num_positions - (0 if no_embed_class else num_prefix)
            grid = _grid_for(num_patches, image_size, patch_size)
            if grid is not None:
                fields["no_embed_class"] = no_embed_class
                fields["image_size"] = image_size if image_size is not None else grid[0] * patch_size
                return _config(fields, state, name)
    except CheckpointError:
        raise
    except ValueError as error:  # an image size the caller gave is not a valid one
        raise CheckpointError(f"{name} has an invalid config: {error}") from None
    if image_size is not None:  # its config's size (or the caller's): no grid the positions cover
        grid = ViTConfig(image_size=image_size, patch_size=patch_size, num_classes=0).grid_size
        raise CheckpointError(
            f"{name}'s config says {grid[1] * patch_size} x {grid[0] * patch_size} px images, {grid[0] * grid[1]:,}"
            f" patches of {patch_size} px, but it holds {num_positions:,} position embeddings"
        )
    raise CheckpointError(
        f"cannot tell the image size of {name} from its {num_positions} position embeddings; "
        "pass image_size=(height, width) to load_model"
    )


def _split_unread_margin(fields: dict, name: str) -> None:
    """A publisher's input size that is not a whole number of patches (SigLIP So400m/14 at 384 px)
    is what its convolution reads, the top-left whole patches, plus an unread margin."""
    image_size, patch_size = fields.get("image_size"), fields.get("patch_size")
    if not isinstance(patch_size, int) or patch_size < 1 or fields.get("unread_margin"):
        return
    sides = (image_size, image_size) if isinstance(image_size, int) else image_size
    if not (isinstance(sides, (tuple, list)) and len(sides) == 2 and all(isinstance(side, int) and not isinstance(side, bool) for side in sides)):
        return  # left to ViTConfig's own sentence
    margins = {side % patch_size for side in sides}
    if margins == {0}:
        return
    if len(margins) > 1 or min(sides) < patch_size:
        raise CheckpointError(
            f"{name}'s input of {sides[1]}x{sides[0]} px is not a whole number of {patch_size}-pixel patches"
            " by the same margin on both sides, which we do not reproduce"
        )
    margin = margins.pop()
    read = tuple(side - margin for side in sides)
    fields["image_size"] = read[0] if isinstance(image_size, int) else read
    fields["unread_margin"] = margin


def _config(fields: dict, state: dict[str, torch.Tensor], name: str) -> ViTConfig:
    try:
        config = ViTConfig(**fields)
    except (ValueError, TypeError) as error:  # a setting the file or the caller gave is not valid
        raise CheckpointError(f"{name} has an invalid config: {error}") from None
    return _check_sizes(config, state, name)


def _grid_for(num_positions: int, image_size, patch_size: int) -> tuple[int, int] | None:
    """The patch grid for ``num_positions`` positions: the requested image's grid, else a square."""
    if num_positions < 1:
        return None
    if image_size is not None:
        grid = ViTConfig(image_size=image_size, patch_size=patch_size, num_classes=0).grid_size
        return grid if grid[0] * grid[1] == num_positions else None
    side = math.isqrt(num_positions)
    return (side, side) if side * side == num_positions else None


def _block_count(state: dict[str, torch.Tensor], name: str) -> int:
    """How many blocks the file holds, numbered 0, 1, 2, ... (a key like blocks.999999999.x
    must not make the model that deep)."""
    indices = {found.group(1) for key in state if (found := re.match(r"blocks\.(\d+)\.", key))}
    if len(indices) > MAX_BLOCKS:
        raise CheckpointError(f"{name} has {len(indices)} blocks; we load ViTs of up to {MAX_BLOCKS}")
    if indices != {str(index) for index in range(len(indices))}:
        raise CheckpointError(
            f"{name}'s blocks are not numbered 0, 1, 2, ... without gaps, as a ViT's are"
        )
    return len(indices)


def _check_sizes(config: ViTConfig, state: dict[str, torch.Tensor], name: str) -> ViTConfig:
    """The sizes a file's metadata (or the caller) may claim must be those of its tensors: a
    model of a claimed depth or width is never built, not even on "meta"."""
    kernel = state["patch_embed.proj.weight"]  # (D, C, p, p)
    hidden = state["blocks.0.mlp.fc2.weight"].shape[1]  # the MLP's width, plain or gated
    from_tensors = {
        "depth": _block_count(state, name),
        "embed_dim": kernel.shape[0],
        "in_chans": kernel.shape[1],
        "num_classes": state["head.weight"].shape[0] if "head.weight" in state else 0,
        "reg_tokens": state["reg_token"].shape[1] if "reg_token" in state else 0,
        "mlp_ratio": hidden / kernel.shape[0],
    }
    claimed = {field: getattr(config, field) for field in from_tensors}
    if config.mlp_hidden == hidden:  # Mlp's own rounding of the ratio (and SwiGLU's alignment)
        claimed["mlp_ratio"] = from_tensors["mlp_ratio"]
    for field, value in from_tensors.items():
        if claimed[field] != value:
            raise CheckpointError(
                f"{name} cannot be built with {field} {_brief(claimed[field])}:"
                f" its tensors have {field} {value}"
            )
    return config

