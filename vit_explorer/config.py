"""Configuration dataclasses: frozen, validated, and round-trippable through JSON."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def _pair(value: int | tuple[int, int] | list[int]) -> tuple[int, int]:
    if isinstance(value, int):
        return (value, value)
    height, width = value
    return (int(height), int(width))


@dataclass(frozen=True)
class ViTConfig:
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
    global_pool: str = "cls"  # "cls": class token output, "mean": mean of the patch tokens
    class_token: bool = True
    reg_tokens: int = 0  # register tokens (Darcet et al. 2023), placed after the class token
    no_embed_class: bool = False  # True: position embedding covers patch tokens only (timm)
    fc_norm: bool | None = None  # None: a norm after pooling iff global_pool == "mean" (timm)
    init_values: float | None = None  # LayerScale init; None disables LayerScale
    layer_norm_eps: float = 1e-6
    drop_rate: float = 0.0
    attn_drop_rate: float = 0.0
    drop_path_rate: float = 0.0
    mean: tuple[float, ...] = (0.5, 0.5, 0.5)  # normalization the model's inputs must be given
    std: tuple[float, ...] = (0.5, 0.5, 0.5)

    def __post_init__(self) -> None:
        # Normalise JSON lists to tuples so that configs compare and hash equal after a round trip.
        set_field = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        if not isinstance(self.image_size, int):
            set_field("image_size", _pair(self.image_size))
        if self.class_names is not None:
            set_field("class_names", tuple(str(name) for name in self.class_names))
        set_field("mean", tuple(float(m) for m in self.mean))
        set_field("std", tuple(float(s) for s in self.std))

        height, width = self.img_size
        if self.patch_size < 1 or height % self.patch_size or width % self.patch_size:
            raise ValueError(
                f"image size {height}x{width} is not divisible by patch size {self.patch_size}"
            )
        if self.num_heads < 1 or self.embed_dim % self.num_heads:
            raise ValueError(
                f"embed_dim {self.embed_dim} is not divisible by num_heads {self.num_heads}"
            )
        if self.global_pool not in ("cls", "mean"):
            raise ValueError(f"global_pool must be 'cls' or 'mean', not {self.global_pool!r}")
        if self.global_pool == "cls" and not self.class_token:
            raise ValueError("global_pool='cls' needs class_token=True; use global_pool='mean'")
        if self.reg_tokens < 0:
            raise ValueError(f"reg_tokens must be >= 0, not {self.reg_tokens}")
        if self.class_names is not None and len(self.class_names) != self.num_classes:
            raise ValueError(
                f"{len(self.class_names)} class names given for {self.num_classes} classes"
            )
        if len(self.mean) != self.in_chans or len(self.std) != self.in_chans:
            raise ValueError(f"mean and std need one value per input channel ({self.in_chans})")

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
        return int(self.class_token) + self.reg_tokens

    @property
    def num_tokens(self) -> int:
        return self.num_prefix_tokens + self.num_patches

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads

    @property
    def use_fc_norm(self) -> bool:
        return self.global_pool == "mean" if self.fc_norm is None else self.fc_norm

    def replace(self, **changes: Any) -> "ViTConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ViTConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown ViTConfig fields: {', '.join(unknown)}")
        return cls(**data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, text: str) -> "ViTConfig":
        return cls.from_dict(json.loads(text))
