"""Configuration dataclasses: frozen, validated, and round-trippable through JSON."""
from __future__ import annotations

import dataclasses
import json
import math
import numbers
from dataclasses import dataclass
from typing import Any

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
INCEPTION_MEAN = (0.5, 0.5, 0.5)  # timm's IMAGENET_INCEPTION_*: Google's ViTs, SigLIP, timm's default
INCEPTION_STD = (0.5, 0.5, 0.5)
# The normalisations a person may choose for a model whose own is not known (the app's sidebar):
# name -> (mean, std) of three channels.
NORMALIZATIONS = {
    "ImageNet": (IMAGENET_MEAN, IMAGENET_STD),
    "OpenAI CLIP": (OPENAI_CLIP_MEAN, OPENAI_CLIP_STD),
    "0.5 (Inception, SigLIP)": (INCEPTION_MEAN, INCEPTION_STD),
}
ACTIVATIONS = ("gelu", "gelu_tanh", "quick_gelu")  # the MLP activations ViTConfig.act_layer names
# Rotary position embeddings ViTConfig.rope_type names (timm's rope_type): DINOv3's, and EVA-02's
# ("cat": timm's RotaryEmbeddingCat); the temperature each uses unless told otherwise.
# "axial" is Qwen-VL's tower's (transformers' rope_type): EVA-02's patch indices and frequencies,
# DINOv3's rotate-half layout.
ROPE_TEMPERATURES = {"dinov3": 100.0, "cat": 10000.0, "axial": 10000.0}
NORM_LAYERS = ("layernorm", "rmsnorm")
# How position embeddings are resampled to another grid (ViTConfig.pos_embed_interpolation): timm's
# bicubic with antialiasing, Qwen3-VL's bilinear with align_corners (its learned 48 x 48 grid
# stretched corner to corner over each picture's), timm NaFlexViT SigLIP's bilinear with
# antialiasing, or bilinear without it (NaFlexViT's factorized positions: its row and column tables
# each resized linearly and summed are their sum resized so).
POS_EMBED_INTERPOLATIONS = ("bicubic", "bilinear_corners", "bilinear", "bilinear_no_antialias")  # ViTConfig.norm_layer: RMSNorm (no centring, no bias) for Qwen-VL
ROPE_PERIODS_DTYPES = ("float32", "bfloat16")
RESIZE_MODES = ("squash", "shortest", "longest", "pad_square")  # ViTConfig.resize_mode
INTERPOLATIONS = ("bicubic", "bilinear", "nearest")  # ViTConfig.interpolation
TRANSFORM_LIBRARIES = ("torchvision", "transformers", "transformers-float")  # ViTConfig.transform_library


def _pair(value: int | tuple[int, int] | list[int]) -> tuple[int, int]:
    if isinstance(value, numbers.Integral):
        return (value, value)
    height, width = value
    return (int(height), int(width))


def _brief(value: Any) -> str:
    """A value for an error message, cut short: it may come from a hostile file."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _check_whole(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name} must be a whole number of at least {minimum}, not {_brief(value)}")


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def _numbers(name: str, values: Any) -> tuple[float, ...]:
    if not isinstance(values, (list, tuple)) or not all(_is_number(value) for value in values):
        raise ValueError(
            f"{name} must be a list of numbers, one per input channel, not {_brief(values)}"
        )
    return tuple(float(value) for value in values)


class _JsonConfig:
    """replace() and the JSON round trip shared by the frozen config dataclasses."""

    def replace(self, **changes: Any):
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_dict(cls, data: dict[str, Any]):
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown {cls.__name__} fields: {', '.join(unknown)}")
        return cls(**data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, text: str):
        return cls.from_dict(json.loads(text))


@dataclass(frozen=True)
class ViTConfig(_JsonConfig):
    """Everything needed to build a :class:`vit_explorer.ViT`; field names follow timm."""

    image_size: int | tuple[int, int] = 224  # int for square images, (height, width) otherwise
    patch_size: int = 16
    in_chans: int = 3
    num_classes: int = 1000
    class_names: tuple[str, ...] | None = None
    embed_dim: int = 768
    depth: int = 12
    num_heads: int = 12
    mlp_ratio: float = 4.0
    qkv_bias: bool = True
    # "cls": class token output, "mean": mean of the patch tokens, "map": attention pooling by a
    # learned probe query (SigLIP's multihead attention pooling head, timm's attn_pool)
    global_pool: str = "cls"
    # The attention pool's heads (None: num_heads) and whether its probe reads the prefix tokens
    # too (timm's Eva does: the Perception Encoder's pool reads its class token; SigLIP has none).
    attn_pool_num_heads: int | None = None
    pool_include_prefix: bool = False
    class_token: bool = True
    dist_token: bool = False  # DeiT's distillation token after the class token, with head_dist
    reg_tokens: int = 0  # register tokens (Darcet et al. 2023), placed after the class token
    no_embed_class: bool = False  # True: position embedding covers patch tokens only (timm)
    fc_norm: bool | None = None  # None: a norm after pooling iff global_pool == "mean" (timm)
    init_values: float | None = None  # LayerScale init; None disables LayerScale
    layer_norm_eps: float = 1e-6
    # A VLM's vision tower (weights/from_vlm.py): which of capture's tokens its language model reads
    # (0 the embeddings, depth the last block's output, depth + 1 those after the final norm; None:
    # no VLM's tower), whether without the class token, its projector's average pooling per side,
    # and its pixel shuffle (InternVL: each s x s square of patch tokens joined into one vector).
    language_model_layer: int | None = None
    language_model_drops_class_token: bool = False
    language_model_pooling: int = 1
    language_model_shuffle: int = 1
    pre_norm: bool = False  # a LayerNorm (norm_pre) on the tokens before the first block (CLIP)
    final_norm: bool = True  # the LayerNorm after the last block (InternViT-300M, PE spatial have none)
    patch_bias: bool = True  # the patch embedding's bias (CLIP has none)
    act_layer: str = "gelu"  # MLP activation: "gelu", "gelu_tanh" (SigLIP) or "quick_gelu" (OpenAI CLIP)
    drop_rate: float = 0.0
    attn_drop_rate: float = 0.0
    drop_path_rate: float = 0.0
    mean: tuple[float, ...] = (0.5, 0.5, 0.5)  # normalization the model's inputs must be given
    std: tuple[float, ...] = (0.5, 0.5, 0.5)
    # Where mean and std came from: "given" (whoever made the config: our files, a caller),
    # "publisher[: where]" (the publisher's config beside the weights), "structure: <family>" (told
    # unambiguously by the tensors, weights/normalization.py) or "assumed" (nothing tells: timm's
    # default for such a ViT; the app says so and lets the person choose: "chosen").
    normalization_source: str = "given"
    # How a picture becomes the input, as the publisher evaluates the model (data/transforms.py):
    # resize_mode "squash" (the whole picture resized: ours; timm's crop_mode "squash" with
    # crop_pct < 1), "shortest" (the shorter side to input / crop_pct, the centre cropped: timm's
    # crop_pct, open_clip's default, CLIP's image processor) or "longest" (the longer side fitted,
    # padded with fill_color: open_clip's), "pad_square" (padded to a square with fill_color, then
    # as "shortest": LLaVA's image processor with do_pad); the filter; whose resampling and rounding:
    # "torchvision" (PIL's filters: timm, open_clip, ours) or "transformers" (its image processors;
    # "transformers-float": DINOv3's, which resizes the pixels rescaled to floats).
    resize_mode: str = "squash"
    crop_pct: float = 1.0
    interpolation: str = "bicubic"
    fill_color: int | tuple[int, ...] = 0
    transform_library: str = "torchvision"
    # Pixels at the right and bottom of the publisher's input that no patch reads: timm's and
    # transformers' patch convolutions take SigLIP So400m/14's 384 px input as 27 x 27 patches, its
    # top-left 378 px (image_size), so that model's transform makes image_size + unread_margin.
    unread_margin: int = 0
    # Positions. abs_pos_embed: the learned pos_embed added to the tokens (timm Eva's use_abs_pos_emb;
    # DINOv3 has none). rope_type: rotary positions on the patch tokens' queries and keys, None,
    # "dinov3" (centred coordinates in [-1, 1] per axis, rotate-half layout) or "cat" (EVA-02: patch
    # indices, interleaved pairs); rope_temperature None is the type's own (ROPE_TEMPERATURES).
    abs_pos_embed: bool = True
    rope_type: str | None = None
    rope_temperature: float | None = None
    rope_grid_indexing: str = "ij"  # "xy": the width coordinate takes the first half of the angles
    ref_feat_shape: tuple[int, int] | None = None  # "cat": coordinates rescaled to this grid (EVA-02)
    rope_grid_offset: float = 0.0  # "cat": added to every patch index (the Perception Encoder's 1)
    # "bfloat16": the rotary periods (frequencies) rounded to bfloat16, as the original DINOv3
    # checkpoints keep them (timm computes them in float32; its model card rounds them to match).
    rope_periods_dtype: str = "float32"
    # Attention and MLP variants of timm's Eva. qkv_fused False: separate q_proj, k_proj (never a
    # bias), v_proj (EVA-02 B/L). scale_attn_inner: a LayerNorm on the heads' outputs before proj
    # (EVA-02 CLIP). swiglu_mlp: SiLU-gated MLP (timm's packed GluMlp, fc1 holding gate then value;
    # with scale_mlp or swiglu_align_to its SwiGLU, fc1_g and fc1_x), act_layer unused; scale_mlp: a
    # LayerNorm on the hidden units before fc2 (EVA-02); swiglu_align_to: hidden width rounded up.
    qkv_fused: bool = True
    scale_attn_inner: bool = False
    swiglu_mlp: bool = False
    scale_mlp: bool = False
    swiglu_align_to: int = 0
    norm_layer: str = "layernorm"  # every norm of the model: "layernorm" or "rmsnorm" (NORM_LAYERS)
    # AIMv2: a norm on the patch embeddings (timm's embed_norm_layer), and linear layers without
    # biases after the qkv (the attention's output projection and the MLP's).
    patch_norm: bool = False
    linear_bias: bool = True
    # Window attention (Qwen2.5-VL): a patch attends only to the patches of its attn_window x
    # attn_window square (tiled from the top-left corner; 0: none), except in the blocks numbered in
    # full_attention_blocks, which attend to every token.
    attn_window: int = 0
    full_attention_blocks: tuple[int, ...] = ()
    # Qwen-VL's patch merger (merger_dim > 0): each spatial_merge_size^2 square of the last block's
    # patch tokens is normed, joined and mapped by an MLP to one token of merger_dim numbers, what
    # its language model reads.
    spatial_merge_size: int = 1
    merger_dim: int = 0
    # Qwen-VL's preprocessing: (min, max) pixels a picture is resized to, at multiples of
    # patch_size * spatial_merge_size and its aspect ratio kept; None: resized to image_size.
    pixel_budget: tuple[int, int] | None = None
    pos_embed_interpolation: str = "bicubic"  # one of POS_EMBED_INTERPOLATIONS
    # timm NaFlexViT's aspect-preserving positions ("par"): the table resampled to a square of the
    # grid's longer side, then its top-left gh x gw kept.
    pos_embed_ar_preserving: bool = False
    # NaFlexViT's preprocessing (timm's ResizeToSequence): each picture resized, its aspect ratio
    # kept, to multiples of patch_size on both sides with at most this many patches; None: resized
    # to image_size.
    max_patches: int | None = None
    # Qwen3-VL's DeepStack: the tokens leaving these blocks each go through a merger of their own
    # (its norm after the join), and the language model adds them into its first layers.
    deepstack_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        # Normalise JSON lists to tuples so that configs compare and hash equal after a round trip.
        set_field = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        self._check_types()
        if isinstance(self.image_size, (list, tuple)):
            set_field("image_size", _pair(self.image_size))
        if self.ref_feat_shape is not None:
            set_field("ref_feat_shape", _pair(self.ref_feat_shape))
        set_field("full_attention_blocks", tuple(self.full_attention_blocks))
        set_field("deepstack_layers", tuple(self.deepstack_layers))
        if self.pixel_budget is not None:
            set_field("pixel_budget", _pair(self.pixel_budget))
        if self.class_names is not None:
            set_field("class_names", tuple(str(name) for name in self.class_names))
        set_field("mean", _numbers("mean", self.mean))
        set_field("std", _numbers("std", self.std))
        if not all(s > 0 for s in self.std):
            raise ValueError(
                f"std must be positive for every channel (inputs are divided by it), not {self.std}"
            )

        height, width = self.img_size
        if height % self.patch_size or width % self.patch_size:
            raise ValueError(
                f"image size {height}x{width} is not divisible by patch size {self.patch_size}"
            )
        if self.embed_dim % self.num_heads:
            raise ValueError(
                f"embed_dim {self.embed_dim} is not divisible by num_heads {self.num_heads}"
            )
        if self.global_pool not in ("cls", "mean", "map"):
            raise ValueError(f"global_pool must be 'cls', 'mean' or 'map', not {self.global_pool!r}")
        if self.global_pool == "cls" and not self.class_token:
            raise ValueError("global_pool='cls' needs class_token=True; use global_pool='mean'")
        if self.dist_token and not (self.class_token and self.global_pool == "cls"):
            raise ValueError("dist_token=True needs class_token=True and global_pool='cls' (DeiT)")
        if self.act_layer not in ACTIVATIONS:
            raise ValueError(f"act_layer must be one of {', '.join(ACTIVATIONS)}, not {self.act_layer!r}")
        if self.class_names is not None and len(self.class_names) != self.num_classes:
            raise ValueError(
                f"{len(self.class_names)} class names given for {self.num_classes} classes"
            )
        if len(self.mean) != self.in_chans or len(self.std) != self.in_chans:
            raise ValueError(f"mean and std need one value per input channel ({self.in_chans})")
        self._check_rope()
        merge = self.patch_size * self.spatial_merge_size
        if self.merger_dim and (height % merge or width % merge):
            raise ValueError(
                f"image size {height}x{width} is not a multiple of {merge} pixels, which the patch merger joins"
            )
        self._check_transform()

    def _check_transform(self) -> None:
        for name, choices in (
            ("resize_mode", RESIZE_MODES), ("interpolation", INTERPOLATIONS), ("transform_library", TRANSFORM_LIBRARIES),
        ):
            if not isinstance(getattr(self, name), str) or getattr(self, name) not in choices:
                raise ValueError(f"{name} must be one of {', '.join(choices)}, not {_brief(getattr(self, name))}")
        if not _is_number(self.crop_pct) or not 0.25 <= self.crop_pct <= 1:
            raise ValueError(f"crop_pct must be a number between 0.25 and 1, not {_brief(self.crop_pct)}")
        fill = self.fill_color
        if isinstance(fill, list):
            fill = tuple(fill)
            object.__setattr__(self, "fill_color", fill)
        values = fill if isinstance(fill, tuple) and len(fill) == self.in_chans else (fill,)
        if not all(isinstance(v, numbers.Integral) and not isinstance(v, bool) and 0 <= v <= 255 for v in values):
            raise ValueError(
                f"fill_color must be a whole number from 0 to 255, or one per input channel, not {_brief(self.fill_color)}"
            )
        margin = self.unread_margin
        if not isinstance(margin, numbers.Integral) or isinstance(margin, bool) or not 0 <= margin < self.patch_size:
            raise ValueError(
                f"unread_margin must be a whole number of pixels below the patch size ({self.patch_size}), not {_brief(margin)}"
            )

    def _check_rope(self) -> None:
        if self.rope_type is not None and (not isinstance(self.rope_type, str) or self.rope_type not in ROPE_TEMPERATURES):
            raise ValueError(f"rope_type must be None or one of {', '.join(ROPE_TEMPERATURES)}, not {_brief(self.rope_type)}")
        if self.rope_type is not None and self.head_dim % 4:
            raise ValueError(
                f"rotary positions need a head dimension divisible by 4 (two axes, pairs of channels), not {self.head_dim}"
            )
        if self.rope_grid_indexing not in ("ij", "xy"):
            raise ValueError(f"rope_grid_indexing must be 'ij' or 'xy', not {_brief(self.rope_grid_indexing)}")
        if self.rope_periods_dtype not in ROPE_PERIODS_DTYPES:
            raise ValueError(
                f"rope_periods_dtype must be one of {', '.join(ROPE_PERIODS_DTYPES)}, not {_brief(self.rope_periods_dtype)}"
            )
        if self.ref_feat_shape is not None and self.rope_type != "cat":
            raise ValueError("ref_feat_shape rescales EVA-02's rotary coordinates: it needs rope_type='cat'")
        if not _is_number(self.rope_grid_offset) or not -4096 <= self.rope_grid_offset <= 4096:
            raise ValueError(f"rope_grid_offset must be a number, not {_brief(self.rope_grid_offset)}")
        if self.rope_grid_offset and self.rope_type != "cat":
            raise ValueError("rope_grid_offset moves EVA-02-style rotary patch indices: it needs rope_type='cat'")

    def _check_types(self) -> None:
        """Types and ranges, so that a config read from a file fails here with a sentence, not later."""
        pair = isinstance(self.image_size, (list, tuple)) and len(self.image_size) == 2
        for side in self.image_size if pair else [self.image_size]:
            _check_whole("image_size", side, 1)
        minimums = {
            "patch_size": 1, "in_chans": 1, "num_classes": 0, "embed_dim": 1, "depth": 1,
            "num_heads": 1, "reg_tokens": 0, "swiglu_align_to": 0, "attn_window": 0, "spatial_merge_size": 1,
            "merger_dim": 0,
        }
        for name, minimum in minimums.items():
            _check_whole(name, getattr(self, name), minimum)
        flags = (
            "qkv_bias", "class_token", "dist_token", "no_embed_class", "pre_norm", "patch_bias", "abs_pos_embed",
            "qkv_fused", "scale_attn_inner", "swiglu_mlp", "scale_mlp", "pool_include_prefix", "final_norm",
            "language_model_drops_class_token", "patch_norm", "linear_bias", "pos_embed_ar_preserving",
        )
        for name in flags:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, not {_brief(getattr(self, name))}")
        _check_whole("language_model_pooling", self.language_model_pooling, 1)
        _check_whole("language_model_shuffle", self.language_model_shuffle, 1)
        # Not checked against depth: a copy with fewer blocks (build's shape check) keeps it; its reader checks it.
        if self.language_model_layer is not None:
            _check_whole("language_model_layer", self.language_model_layer, 0)
        if self.attn_pool_num_heads is not None:
            _check_whole("attn_pool_num_heads", self.attn_pool_num_heads, 1)
            if self.embed_dim % self.attn_pool_num_heads:
                raise ValueError(f"attn_pool_num_heads {self.attn_pool_num_heads} does not divide embed_dim {self.embed_dim}")
        for name in ("full_attention_blocks", "deepstack_layers"):
            blocks = getattr(self, name)
            # Not checked against depth either (build's one-block copy keeps them); the reader checks them.
            if not isinstance(blocks, (list, tuple)) or len(blocks) > 4096:
                raise ValueError(f"{name} must be a list of block numbers, not {_brief(blocks)}")
            for block in blocks:
                _check_whole(name, block, 0)
        if self.deepstack_layers and not self.merger_dim:
            raise ValueError("deepstack_layers need a patch merger (merger_dim)")
        if self.pos_embed_interpolation not in POS_EMBED_INTERPOLATIONS:
            raise ValueError(
                f"pos_embed_interpolation must be one of {', '.join(POS_EMBED_INTERPOLATIONS)}, not {_brief(self.pos_embed_interpolation)}"
            )
        if self.max_patches is not None:
            _check_whole("max_patches", self.max_patches, 1)
            if self.pixel_budget is not None:
                raise ValueError("max_patches (NaFlexViT's) and pixel_budget (Qwen-VL's) are two preprocessings: give one")
        budget = self.pixel_budget
        if budget is not None:
            if not isinstance(budget, (list, tuple)) or len(budget) != 2:
                raise ValueError(f"pixel_budget must be (min, max) pixels or None, not {_brief(budget)}")
            for side in budget:
                _check_whole("pixel_budget", side, 1)
        if self.norm_layer not in NORM_LAYERS:
            raise ValueError(f"norm_layer must be one of {', '.join(NORM_LAYERS)}, not {_brief(self.norm_layer)}")
        if self.fc_norm is not None and not isinstance(self.fc_norm, bool):
            raise ValueError(f"fc_norm must be true, false or None, not {_brief(self.fc_norm)}")
        if not _is_number(self.mlp_ratio) or self.mlp_ratio <= 0:
            raise ValueError(f"mlp_ratio must be a positive number, not {_brief(self.mlp_ratio)}")
        if not _is_number(self.layer_norm_eps) or self.layer_norm_eps <= 0:
            raise ValueError(
                f"layer_norm_eps must be a positive number, not {_brief(self.layer_norm_eps)}"
            )
        if self.init_values is not None and not _is_number(self.init_values):
            raise ValueError(f"init_values must be a number or None, not {_brief(self.init_values)}")
        if self.rope_temperature is not None and (not _is_number(self.rope_temperature) or self.rope_temperature <= 0):
            raise ValueError(f"rope_temperature must be a positive number or None, not {_brief(self.rope_temperature)}")
        ref = self.ref_feat_shape
        if ref is not None:
            if not (isinstance(ref, (list, tuple)) and len(ref) == 2 or isinstance(ref, numbers.Integral)):
                raise ValueError(f"ref_feat_shape must be a grid size (height, width) or None, not {_brief(ref)}")
            for side in ref if isinstance(ref, (list, tuple)) else [ref]:
                _check_whole("ref_feat_shape", side, 1)
        for name in ("drop_rate", "attn_drop_rate", "drop_path_rate"):
            if not _is_number(getattr(self, name)) or not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{name} must be in [0, 1), not {_brief(getattr(self, name))}")
        if self.class_names is not None and not isinstance(self.class_names, (list, tuple)):
            raise ValueError(f"class_names must be a list of names, not {_brief(self.class_names)}")
        for name in ("global_pool", "act_layer", "rope_grid_indexing", "rope_periods_dtype", "normalization_source"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"{name} must be a string, not {_brief(getattr(self, name))}")

    @property
    def img_size(self) -> tuple[int, int]:
        return _pair(self.image_size)

    @property
    def grid_size(self) -> tuple[int, int]:
        height, width = self.img_size
        return (height // self.patch_size, width // self.patch_size)

    @property
    def num_patches(self) -> int:
        grid_h, grid_w = self.grid_size
        return grid_h * grid_w

    @property
    def num_prefix_tokens(self) -> int:
        return int(self.class_token) + int(self.dist_token) + self.reg_tokens

    @property
    def num_tokens(self) -> int:
        return self.num_prefix_tokens + self.num_patches

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads

    @property
    def mlp_hidden(self) -> int:
        """The MLP's hidden width, the units fc2 reads (timm's rounding and SwiGLU alignment)."""
        hidden = int(self.embed_dim * self.mlp_ratio)
        if self.swiglu_mlp and self.swiglu_align_to:
            hidden += -hidden % self.swiglu_align_to
        return hidden

    @property
    def mlp_matrices(self) -> int:
        """How many (D, hidden) matrices the MLP multiplies by: 2, or 3 with a SwiGLU gate."""
        return 3 if self.swiglu_mlp else 2

    @property
    def rope_base(self) -> float | None:
        """The rotary temperature in use (None without rotary positions)."""
        if self.rope_type is None:
            return None
        return float(self.rope_temperature or ROPE_TEMPERATURES[self.rope_type])

    @property
    def normalization_assumed(self) -> bool:
        """Whether nothing told this model's mean and std (normalization_source "assumed")."""
        return self.normalization_source == "assumed"

    @property
    def normalization_name(self) -> str | None:
        """The NORMALIZATIONS name of this model's mean and std; None for any other."""
        return normalization_name(self.mean, self.std)

    @property
    def use_fc_norm(self) -> bool:
        return self.global_pool == "mean" if self.fc_norm is None else self.fc_norm

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def normalization_name(mean, std) -> str | None:
    """The NORMALIZATIONS name of this mean and std (to a float32's precision); None for any other."""
    for name, (known_mean, known_std) in NORMALIZATIONS.items():
        if len(mean) == len(known_mean) and len(std) == len(known_std) and all(
            math.isclose(a, b, rel_tol=1e-6) for a, b in zip((*mean, *std), (*known_mean, *known_std))
        ):
            return name
    return None


# Model sizes by name; image size, classes and normalization come from the dataset.
PRESETS: dict[str, dict[str, Any]] = {
    # tiny: patch 8 (17 tokens at 32x32) trains ~3x faster than patch 4 (65 tokens) on a CPU.
    "tiny": dict(patch_size=8, embed_dim=64, depth=4, num_heads=4, mlp_ratio=2.0),
    "small": dict(patch_size=4, embed_dim=128, depth=6, num_heads=4, mlp_ratio=4.0),
    "vit-ti": dict(patch_size=4, embed_dim=192, depth=12, num_heads=3, mlp_ratio=4.0),
    "vit-s": dict(patch_size=4, embed_dim=384, depth=12, num_heads=6, mlp_ratio=4.0),
}


def parse_patch_sizes(text: str) -> tuple[int, ...] | None:
    """"4,8,16" -> (4, 8, 16) for TrainConfig.patch_sizes; blank -> None (no FlexiViT training)."""
    parts = [part.strip() for part in text.split(",") if part.strip()]
    if not parts:
        return None
    if not all(part.isdigit() and int(part) > 0 for part in parts):
        raise ValueError(
            f"{text!r} is not a list of patch sizes; give positive whole numbers separated by commas, like 4,8,16"
        )
    return tuple(int(part) for part in parts)


# How a run's model knows where each patch is (TrainConfig.positions): "learned", a position
# embedding added to the tokens, resampled to another grid; "rotary", DINOv3's rotary positions on
# coordinates in [-1, 1], which follow any grid as they are.
POSITIONS = ("learned", "rotary")


@dataclass(frozen=True)
class TrainConfig(_JsonConfig):
    """One training run: data, model, optimisation, hardware and where the checkpoint goes."""

    dataset: str = "shapes"  # "shapes", "cifar10", "mnist", "fashionmnist" or "folder:PATH"
    model: str | ViTConfig = "tiny"  # a PRESETS name, or a full ViTConfig
    image_size: int | None = None  # None: the ViTConfig's, else the dataset's own size
    epochs: int = 10
    batch_size: int = 64
    lr: float = 5e-3  # peak learning rate, reached after warmup_steps, then cosine to zero
    weight_decay: float = 0.05
    warmup_steps: int = 100
    label_smoothing: float = 0.0
    seed: int = 0
    device: str = "auto"  # "auto" picks cuda, then mps, then cpu
    precision: str = "auto"  # "auto": bf16 autocast on CUDA, fp32 elsewhere; or "bf16", "fp32"
    compile: bool = False  # torch.compile the training step's model
    augment: bool = True  # random crop with padding and horizontal flip (not shapes: fresh images)
    data_root: str | None = None  # where downloads go; None: ~/.cache/vit_explorer/data
    out_dir: str = "runs"
    name: str | None = None  # checkpoint file stem; None: vit_<dataset>
    train_size: int | None = None  # images to train on (shapes: per epoch); None: shapes 16000, others all
    test_size: int | None = None  # images to test on; None: shapes 2000, others all
    snapshot_every: int = 50  # steps between attention snapshots of the probe image; 0: never
    log_every: int = 10  # steps between StepEvents (each one waits for the device)
    resume: bool = False  # continue from the checkpoint in out_dir
    # FlexiViT (Beyer et al. 2023): each step runs at a patch size drawn from these, the weights
    # resized on the fly from the model's own patch size; None: always the model's own size.
    patch_sizes: tuple[int, ...] | None = None
    positions: str = "learned"  # one of POSITIONS; "learned" keeps a given ViTConfig's own

    def __post_init__(self) -> None:
        if self.patch_sizes is not None:
            object.__setattr__(self, "patch_sizes", tuple(sorted({int(p) for p in self.patch_sizes})))
            if not self.patch_sizes or self.patch_sizes[0] < 1:
                raise ValueError("patch_sizes must hold at least one positive patch size")
        if isinstance(self.model, dict):
            object.__setattr__(self, "model", ViTConfig.from_dict(self.model))
        if isinstance(self.model, str) and self.model not in PRESETS:
            raise ValueError(f"unknown model preset {self.model!r}; choose one of {', '.join(PRESETS)}")
        positive = {
            "epochs": self.epochs, "batch_size": self.batch_size, "train_size": self.train_size,
            "test_size": self.test_size, "log_every": self.log_every,
        }
        for name, value in positive.items():
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1, not {value}")
        if not self.lr > 0:
            raise ValueError(f"lr must be positive, not {self.lr}")
        if self.weight_decay < 0 or self.warmup_steps < 0 or self.snapshot_every < 0:
            raise ValueError("weight_decay, warmup_steps and snapshot_every must not be negative")
        if not 0 <= self.label_smoothing < 1:
            raise ValueError(f"label_smoothing must be in [0, 1), not {self.label_smoothing}")
        if self.image_size is not None and self.image_size < 1:
            raise ValueError(f"image_size must be positive, not {self.image_size}")
        if self.device.split(":")[0] not in ("auto", "cpu", "cuda", "mps"):
            raise ValueError(f"device must be auto, cpu, cuda or mps, not {self.device!r}")
        if self.precision not in ("auto", "bf16", "fp32"):
            raise ValueError(f"precision must be auto, bf16 or fp32, not {self.precision!r}")
        if self.positions not in POSITIONS:
            raise ValueError(f"positions must be {' or '.join(POSITIONS)}, not {_brief(self.positions)}")

    @property
    def run_name(self) -> str:
        if self.name:
            return self.name
        dataset = self.dataset.split(":", 1)[0]
        return f"vit_{dataset}"

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        if isinstance(self.model, ViTConfig):
            data["model"] = self.model.to_dict()
        return data
