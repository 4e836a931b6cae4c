"""The publisher's eval transform: how a picture becomes a model's input, as whoever published the
model evaluates it (ViTConfig's resize_mode, crop_pct, interpolation, fill_color and
transform_library), or the whole picture squeezed to the input size (``whole=True``).

The numerics follow each publisher's own code, so that a prediction equals theirs:

- "torchvision" (timm's ``transforms_imagenet_eval``, open_clip's ``image_transform_v2``, our own
  squash): PIL's filters on the picture; "shortest" resizes to floor(input / crop_pct), the
  shorter side alone for a square input (torchvision's ``Resize(int)``: the longer side truncated)
  else keeping the ratio (timm's ``ResizeKeepRatio``: rounded), then crops the centre (offsets
  rounded); "longest" fits the longer side (ResizeKeepRatio, longest=1) and pads with fill_color
  (open_clip's ``CenterCropOrPad``); "pad_square" first pastes the picture in the middle of a
  square of fill_color (LLaVA's ``pad_to_square``), then resizes it as "shortest"; "squash" resizes to floor(input / crop_pct) whole, then crops
  the centre (timm's crop_mode "squash").
- "transformers" (transformers 5's image processors, CLIPImageProcessor and SiglipImageProcessor:
  the torchvision backend): an antialiased resize of the uint8 tensor, the shorter side with the
  longer truncated, and a centre crop whose offsets are truncated; "transformers-float" (DINOv3's
  processor) resizes the pixels rescaled to floats instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from einops import rearrange
from PIL import Image

from ..model.config import ViTConfig


@dataclass(frozen=True)
class Placement:
    """Where the input's pixels come from: the picture resized to ``resized`` (width, height), then
    the input's (0, 0) at ``offset`` (left, top) of it (negative: padding)."""

    resized: tuple[int, int]
    offset: tuple[int, int]
    # "pad_square": the picture first pasted at (left, top) of a square of its longer side, the
    # rest fill_color (LLaVA's pad_to_square); what is resized is that square.
    padding: tuple[int, int] = (0, 0)


def _shortest_size(width: int, height: int, short: int) -> tuple[int, int]:
    """(width, height) with the shorter side ``short``, the longer truncated (torchvision's and
    transformers' resize of the shortest edge)."""
    if width <= height:
        return short, int(short * height / width)
    return int(short * width / height), short


def _keep_ratio_size(width: int, height: int, target: tuple[int, int], longest: bool) -> tuple[int, int]:
    """timm's (and open_clip's) ResizeKeepRatio: both sides over the ratio of the shorter (or
    longer) side to its target, rounded. ``target``: (height, width)."""
    ratios = (height / target[0], width / target[1])
    ratio = max(ratios) if longest else min(ratios)
    return max(round(width / ratio), 1), max(round(height / ratio), 1)  # a thin strip keeps a pixel row


def placement(size: tuple[int, int], config: ViTConfig, whole: bool = False) -> Placement:
    """Where the input of ``config`` comes from in a picture of ``size`` (width, height)."""
    width, height = size
    target_h, target_w = config.img_size
    if whole:
        return Placement((target_w, target_h), (0, 0))
    # The publisher's input, whose top-left img_size the model reads (the same offset).
    target_h, target_w = target_h + config.unread_margin, target_w + config.unread_margin
    scale = (math.floor(target_h / config.crop_pct), math.floor(target_w / config.crop_pct))
    padding = (0, 0)
    if config.resize_mode == "pad_square":  # the smaller half of the padding before, as LLaVA's
        side = max(width, height)
        padding, width, height = ((side - width) // 2, (side - height) // 2), side, side
    if config.resize_mode == "squash":
        resized = (scale[1], scale[0])
    elif config.resize_mode == "longest":
        resized = _keep_ratio_size(width, height, scale, longest=True)
    elif scale[0] == scale[1] or config.transform_library != "torchvision":
        resized = _shortest_size(width, height, min(scale))
    else:
        resized = _keep_ratio_size(width, height, scale, longest=False)
    if config.transform_library != "torchvision":  # offsets truncated (transformers' center_crop)
        offset = (int((resized[0] - target_w) / 2), int((resized[1] - target_h) / 2))
    else:
        offset = tuple(_centre_offset(side, target) for side, target in zip(resized, (target_w, target_h)))
    return Placement(resized, offset, padding)


def _centre_offset(side: int, target: int) -> int:
    """torchvision's centre crop offset (rounded), or minus the padding before (open_clip's
    CenterCropOrPad pads the shortfall, the smaller half first, then crops the padded centre)."""
    if side < target:
        return -((target - side) // 2)
    return int(round((side - target) / 2.0))


def visible_box(size: tuple[int, int], config: ViTConfig, whole: bool = False) -> tuple[float, float, float, float]:
    """(left, top, right, bottom) in the picture's pixels of what the input shows (beyond the
    picture where it is padded)."""
    spot = placement(size, config, whole)
    pad_left, pad_top = spot.padding
    width, height = (max(size),) * 2 if config.resize_mode == "pad_square" and not whole else size
    scale_x, scale_y = width / spot.resized[0], height / spot.resized[1]
    target_h, target_w = config.img_size
    left, top = spot.offset
    return (left * scale_x - pad_left, top * scale_y - pad_top,
            (left + target_w) * scale_x - pad_left, (top + target_h) * scale_y - pad_top)


def crops(size: tuple[int, int], config: ViTConfig) -> bool:
    """Whether the publisher's input leaves part of a picture of ``size`` out or pads it."""
    left, top, right, bottom = visible_box(size, config)
    width, height = size
    return max(abs(left), abs(top), abs(right - width), abs(bottom - height)) > 0.5


def reshapes(config: ViTConfig) -> bool:
    """Whether the publisher's input is other than the whole picture squeezed (it crops or pads, or
    its model leaves a margin unread)."""
    return config.resize_mode != "squash" or config.crop_pct != 1 or config.unread_margin > 0


def describe(size: tuple[int, int], config: ViTConfig, whole: bool = False) -> str:
    """What the input shows of a picture of ``size`` (width, height), in a sentence's words."""
    height, width = config.img_size
    if whole or not reshapes(config):
        return f"the whole picture squeezed to {width}x{height} px"
    spot = placement(size, config)
    resized = f"resized to {spot.resized[0]}x{spot.resized[1]} px"
    if config.resize_mode == "longest":
        return f"the whole picture {resized} and padded to {width}x{height} px, as its publisher does"
    if config.resize_mode == "pad_square":
        padded = "" if size[0] == size[1] else "padded to a square with the training images' mean colour, "
        return f"the whole picture {padded}{resized}, as its publisher does"
    if config.unread_margin:
        read = f"its top-left {width}x{height} px read (the last {config.unread_margin} px of each side make no whole patch)"
        if not crops(size, config) or spot.resized == (width + config.unread_margin, height + config.unread_margin):
            return f"the whole picture {resized}, {read}, as its publisher's model does"
        kept = f"{width + config.unread_margin}x{height + config.unread_margin} px"
        return f"the picture {resized}, its centre {kept} kept and {read}, as its publisher's model does"
    if not crops(size, config):
        return f"the whole picture {resized}, as its publisher does"
    return f"the picture {resized}, its centre {width}x{height} px kept, as its publisher crops it"


_TORCHVISION_FILTERS = {
    "bicubic": Image.Resampling.BICUBIC, "bilinear": Image.Resampling.BILINEAR, "nearest": Image.Resampling.NEAREST,
}


def input_pixels(image: Image.Image, config: ViTConfig, whole: bool = False) -> torch.Tensor:
    """(C, H, W) float32 on the 0..1 scale: the picture as the model's input, before normalisation."""
    spot = placement(image.size, config, whole)
    if config.resize_mode == "pad_square" and not whole and image.width != image.height:
        fill = config.fill_color if isinstance(config.fill_color, tuple) else (config.fill_color,) * len(image.getbands())
        square = Image.new(image.mode, (max(image.size),) * 2, fill if len(fill) > 1 else fill[0])
        square.paste(image, spot.padding)
        image = square
    if config.transform_library == "torchvision":
        if image.size != spot.resized:
            image = image.resize(spot.resized, _TORCHVISION_FILTERS[config.interpolation])
        return _cut(_tensor(image), spot, config).float() / 255
    from torchvision.transforms import InterpolationMode
    from torchvision.transforms.v2 import functional as tvF

    modes = {"bicubic": InterpolationMode.BICUBIC, "bilinear": InterpolationMode.BILINEAR,
             "nearest": InterpolationMode.NEAREST_EXACT}
    pixels = _tensor(image)  # uint8, resized as such (transformers' default)
    rescaled_first = config.transform_library == "transformers-float"
    if rescaled_first:
        pixels = pixels * (1 / 255)  # transformers' rescale, before DINOv3's resize
    if (pixels.shape[2], pixels.shape[1]) != spot.resized:
        pixels = tvF.resize(pixels, [spot.resized[1], spot.resized[0]], interpolation=modes[config.interpolation], antialias=True)
    pixels = _cut(pixels, spot, config)
    return pixels if rescaled_first else pixels.float() / 255


def _tensor(image: Image.Image) -> torch.Tensor:
    """(C, H, W) uint8 of a PIL image (RGB or L)."""
    return rearrange(torch.from_numpy(np.array(image)).reshape(image.height, image.width, -1), "h w c -> c h w")


def _cut(pixels: torch.Tensor, spot: Placement, config: ViTConfig) -> torch.Tensor:
    """The input's window of the resized pixels (C, h, w), padded with fill_color where it leaves them."""
    target_h, target_w = config.img_size
    left, top = spot.offset
    if left >= 0 and top >= 0 and left + target_w <= pixels.shape[2] and top + target_h <= pixels.shape[1]:
        return pixels[:, top:top + target_h, left:left + target_w]
    fill = config.fill_color if isinstance(config.fill_color, tuple) else (config.fill_color,) * pixels.shape[0]
    fill = torch.tensor(fill, dtype=torch.uint8).to(pixels.dtype) / (1 if pixels.dtype == torch.uint8 else 255)
    canvas = fill.to(pixels.dtype)[:, None, None].repeat(1, target_h, target_w)
    source_top, source_left = max(top, 0), max(left, 0)
    bottom, right = min(top + target_h, pixels.shape[1]), min(left + target_w, pixels.shape[2])
    canvas[:, source_top - top:bottom - top, source_left - left:right - left] = pixels[:, source_top:bottom, source_left:right]
    return canvas
