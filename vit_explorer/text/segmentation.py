"""Segment a picture by words: every pixel labelled by the name its patch is most like, as the
training-free open-vocabulary papers do it (SCLIP, NACLIP: their segmentors and configs).

The protocol (:class:`Protocol`, written out by :meth:`Protocol.describe`):
- the input: ``slide`` (the papers' default) resizes the picture so that its shorter side is
  ``short_side`` pixels (the papers: 336; here by default the model's input, so that a 224 px
  picture costs one pass), then reads it in windows of the model's input size, half a window
  apart (the papers' 224 and 112), each window's cosines up-sampled to it and the overlaps
  averaged. Without ``slide``, one pass: with a ``short_side``, the whole picture at its aspect
  ratio, that short side, each side rounded to the patch size (NACLIP on VOC at 336), the
  model's positions resampled for this picture (weights.resize_model: a new small model sharing
  the weights); without, the picture squeezed to the model's input (as the app's pages).
- the maps: each window's patches carried into the texts' space by an open-vocabulary method
  (text.open_vocabulary), their cosines with each name up-sampled (bilinear) to the picture.
- optionally PAMR (analysis.pamr: 10 steps, dilations 8 and 16) on the cosines, with the picture.
- the rule (analysis.segmentation): a softmax over every name at ``logit_scale`` (40), a class's
  probability its best name's, class 0 (the background) below ``threshold`` (and, as SCLIP on
  VOC21, a class over too small a share of the foreground zeroed: ``area_threshold``).

A labelled folder is measured by :func:`measure`: every picture segmented by every protocol, the
confusions summed over the folder (mmseg's IoUMetric: analysis.segmentation), each name embedded
with one of :data:`TEMPLATES` first (:func:`templates`).

Nothing here changes the model: every pass is a capture of this call.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.nn.functional as F
from einops import rearrange
from PIL import Image

from ..analysis import pamr, segmentation
from ..analysis.checks import AnalysisError
from ..data.images import preprocess, to_rgb
from ..data.labelled_folder import LabelledFolder
from ..model.capture import capture
from ..weights.resize import resize_model
from . import open_vocabulary, proxyclip
from .towers import ImageTextModel

WINDOW_BATCH = 8  # windows captured together
# The cosines of every name at the picture's size are held at once (PAMR's neighbours a few
# classes at a time on top): a picture and names past this are refused before anything is computed.
MAX_SCORE_BYTES = 512 * 2**20
# How each name of a class file is embedded: its templates' embeddings averaged (the papers: OpenAI's 80).
TEMPLATES = {
    "openai": "OpenAI's 80 ImageNet templates (the papers')",
    "simple": "open_clip's 7 short ImageNet templates",
    "plain": "'a photo of {}.'",
}


@dataclass(frozen=True)
class Protocol:
    """How a picture is segmented (the module's docstring says each step)."""

    method: str = "maskclip"
    slide: bool = True
    # The shorter side the picture is resized to (slide, or whole at its aspect ratio); None: the
    # model's input's for slide, the picture squeezed to the model's input for whole.
    short_side: int | None = None
    logit_scale: float = segmentation.LOGIT_SCALE
    threshold: float = 0.0
    area_threshold: float | None = None  # SCLIP's area_thd (0.1 on VOC21): see analysis.segmentation
    pamr: bool = False

    def describe(self, input_size: tuple[int, int]) -> str:
        crop = f"{input_size[0]}x{input_size[1]}"
        if self.slide:
            short = self.short_side or min(input_size)
            read = (f"shorter side resized to {short} px (bilinear), read in {crop} windows"
                    f" {input_size[0] // 2} px apart, overlaps averaged")
        elif self.short_side:
            read = (f"whole at its aspect ratio, shorter side resized to {self.short_side} px (bilinear), sides rounded"
                    " to the patch size, positions resampled to its grid (one pass)")
        else:
            read = f"squeezed whole to {crop} (one pass)"
        background = (f"class 0 where the best class's probability < {self.threshold:g}" if self.threshold
                      else "no threshold (class 0 only where its names win)")
        if self.area_threshold is not None:
            background += f"; classes over at most {self.area_threshold:g} of the foreground zeroed first"
        refine = f"PAMR {pamr.STEPS} steps, dilations {pamr.DILATIONS}" if self.pamr else "no PAMR"
        return (f"{self.method}: {read}; cosines up-sampled bilinear to the picture; {refine}; softmax over the names"
                f" at logit scale {self.logit_scale:g}, a class its best name; {background}")


def resized_size(height: int, width: int, short_side: int, window: tuple[int, int]) -> tuple[int, int]:
    """The picture's size with its shorter side ``short_side`` (aspect kept, rounded as mmseg's
    Resize does), never smaller than one ``window`` (height, width)."""
    scale = max(short_side / min(height, width), window[0] / height, window[1] / width)
    return max(int(height * scale + 0.5), window[0]), max(int(width * scale + 0.5), window[1])


def aspect_size(height: int, width: int, short_side: int, patch_size: int) -> tuple[int, int]:
    """The picture's size with its shorter side ``short_side``, each side rounded to a whole
    number of patches (at least one)."""
    scale = short_side / min(height, width)
    return tuple(max(patch_size, round(side * scale / patch_size) * patch_size) for side in (height, width))


def windows(height: int, width: int, crop: tuple[int, int], stride: tuple[int, int]) -> list[tuple[int, int, int, int]]:
    """(top, bottom, left, right) of each window, as the papers' forward_slide places them: a grid
    ``stride`` apart, the last row and column moved back to end at the picture's edge."""
    rows = max(height - crop[0] + stride[0] - 1, 0) // stride[0] + 1
    columns = max(width - crop[1] + stride[1] - 1, 0) // stride[1] + 1
    boxes = []
    for row in range(rows):
        for column in range(columns):
            bottom, right = min(row * stride[0] + crop[0], height), min(column * stride[1] + crop[1], width)
            boxes.append((max(bottom - crop[0], 0), bottom, max(right - crop[1], 0), right))
    return boxes


def check_size(height: int, width: int, names: int, refine: bool = False) -> None:
    """Refuse a picture whose cosines with ``names`` names (and PAMR's neighbours of a few classes
    at a time, with ``refine``) would not fit MAX_SCORE_BYTES."""
    neighbours = 8 * len(pamr.DILATIONS)
    held = 4 * height * width * (names + (neighbours * (min(names, pamr.CLASS_CHUNK) + 3) if refine else 0))
    if held > MAX_SCORE_BYTES:
        raise AnalysisError(
            f"a {width}x{height} picture with {names} names needs {held / 2**30:.1f} GB of scores"
            f"{' and PAMR' if refine else ''}; at most {MAX_SCORE_BYTES / 2**30:.1f} GB: make the picture smaller"
            " or use fewer names"
        )


def normalized(image: Image.Image, size: tuple[int, int], mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """(1, 3, H, W) the picture resized to ``size`` (height, width), bilinear, normalised."""
    image = to_rgb(image).resize((size[1], size[0]), Image.Resampling.BILINEAR)
    pixels = rearrange(torch.from_numpy(np.asarray(image, dtype=np.float32) / 255.0), "h w c -> 1 c h w")
    return (pixels - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(1, 3, 1, 1)


@torch.no_grad()
def window_cosines(model: ImageTextModel, pixels: torch.Tensor, texts: torch.Tensor, method: str = "maskclip", proxy=None) -> torch.Tensor:
    """(1, C, H, W) normalised picture, at least one model input in each side, and (Q, E) unit
    texts -> (1, Q, H, W) each name's cosine at every pixel, read in windows of the model's input
    half a window apart, each window's map up-sampled to it, overlaps averaged."""
    crop = tuple(model.image.config.img_size)
    height, width = pixels.shape[-2:]
    boxes = windows(height, width, crop, (max(crop[0] // 2, 1), max(crop[1] // 2, 1)))
    total = pixels.new_zeros((1, texts.shape[0], height, width))
    count = pixels.new_zeros((1, 1, height, width))
    for start in range(0, len(boxes), WINDOW_BATCH):
        batch = boxes[start:start + WINDOW_BATCH]
        crops = torch.cat([pixels[..., top:bottom, left:right] for top, bottom, left, right in batch])
        cosines = patch_cosines(model, crops, texts, method, proxy)
        cosines = segmentation.upsample(cosines, crop)  # (b, Q, crop)
        for (top, bottom, left, right), one in zip(batch, cosines):
            total[..., top:bottom, left:right] += one
            count[..., top:bottom, left:right] += 1
    return total / count


@torch.no_grad()
def patch_cosines(model: ImageTextModel, pixels: torch.Tensor, texts: torch.Tensor, method: str = "maskclip", proxy=None) -> torch.Tensor:
    """(B, C, h, w) model inputs -> (B, Q, gh, gw) each patch's cosine with each text: one pass
    (and one of ``proxy``, ProxyCLIP's proxy ViT, on the same pixels)."""
    pixels = pixels.to(next(model.image.parameters()).device)
    captured = capture(model.image, pixels, layers=())
    borrowed = None
    if proxy is not None and open_vocabulary.method_entry(method).needs_proxy:
        borrowed = proxyclip.Proxy(proxy, capture(proxy, proxyclip.proxy_input(pixels, model.image.config, proxy.config), layers=()))
    return open_vocabulary.similarity_maps(model, captured, texts, method, borrowed)


def label(cosines: torch.Tensor, picture: torch.Tensor, name_classes: Sequence[int], protocol: Protocol) -> np.ndarray:
    """(1, Q, h, w) cosines -> (H, W) uint8 classes at ``picture``'s size, by the protocol's rule;
    ``picture`` (1, C, H, W) the normalised pixels PAMR follows (C may be 0 without PAMR)."""
    cosines = segmentation.upsample(cosines, tuple(picture.shape[-2:]))
    if protocol.pamr:
        cosines = pamr.pamr(picture, cosines)
    probabilities = segmentation.class_probabilities(cosines, name_classes, protocol.logit_scale)
    return segmentation.label_pixels(probabilities, protocol.threshold, protocol.area_threshold)[0].numpy().astype(np.uint8)


def segment(model: ImageTextModel, image: Image.Image, texts: torch.Tensor, name_classes: Sequence[int],
            protocol: Protocol, proxy=None) -> np.ndarray:
    """(H, W) uint8 the class of every pixel of ``image`` (its own size), ``texts`` (Q, E) the unit
    embeddings of the names, ``name_classes`` each name's class."""
    config = model.image.config
    image = to_rgb(image)
    height, width = image.height, image.width
    check_size(height, width, len(name_classes), protocol.pamr)
    mean, std = config.mean, config.std
    if protocol.slide:
        size = resized_size(height, width, protocol.short_side or min(config.img_size), tuple(config.img_size))
        pixels = normalized(image, size, mean, std)
        cosines = window_cosines(model, pixels, texts, protocol.method, proxy)
    elif protocol.short_side:
        size = aspect_size(height, width, protocol.short_side, config.patch_size)
        pixels = normalized(image, size, mean, std)
        at_size = replace(model, image=resize_model(model.image, image_size=size, share_weights=True))
        cosines = patch_cosines(at_size, pixels, texts, protocol.method, proxy)
    else:
        # The whole picture squeezed, never a publisher's crop: every pixel of it gets a label.
        pixels = preprocess(image, config, whole=True)
        cosines = patch_cosines(model, pixels, texts, protocol.method, proxy)
    # PAMR follows the model's input brought to the picture's size, as the papers' predict does.
    picture = F.interpolate(pixels, size=(height, width), mode="bilinear", align_corners=False) if protocol.pamr else \
        pixels.new_empty((1, 0, height, width))
    return label(cosines, picture, name_classes, protocol)


def passes(height: int, width: int, protocol: Protocol, input_size: tuple[int, int]) -> int:
    """How many passes of the image tower :func:`segment` makes for a ``height`` x ``width`` picture."""
    if not protocol.slide:
        return 1
    size = resized_size(height, width, protocol.short_side or min(input_size), input_size)
    return len(windows(*size, input_size, (max(input_size[0] // 2, 1), max(input_size[1] // 2, 1))))


def templates(name: str) -> tuple[str, ...]:
    """The templates of :data:`TEMPLATES` ``name``, each with one '{}' for the name."""
    if name == "plain":
        return ("a photo of {}.",)
    from open_clip.zero_shot_metadata import OPENAI_IMAGENET_TEMPLATES, SIMPLE_IMAGENET_TEMPLATES

    chosen = OPENAI_IMAGENET_TEMPLATES if name == "openai" else SIMPLE_IMAGENET_TEMPLATES
    return tuple(template("{}") for template in chosen)


@dataclass(frozen=True)
class Result:
    """A protocol measured on a folder."""

    protocol: Protocol
    counts: np.ndarray  # (C, C) confusion over the folder
    passes: float  # passes of the image tower a picture, on average

    @property
    def mean_iou(self) -> float:
        return segmentation.mean_iou(self.counts)

    @property
    def ious(self) -> np.ndarray:
        """(C,) each class's IoU, NaN for a class in neither truth nor prediction."""
        return segmentation.iou_per_class(self.counts)


def measure(model: ImageTextModel, folder: LabelledFolder, texts: torch.Tensor, protocols: Sequence[Protocol],
            proxy=None, step: Callable[[int], None] | None = None) -> list[Result]:
    """Every picture of ``folder`` segmented by every protocol; ``texts`` (Q, E) the unit
    embeddings of the class file's names (``folder.classes.names``); ``proxy``: ProxyCLIP's proxy
    ViT. Each result's passes are the image tower's windows a picture (:func:`passes`; a proxy's
    pass not counted); ``step(number)`` is called after each picture segmented by protocol
    ``number``. Every picture's size is checked before any is read."""
    classes = folder.classes
    for height, width in folder.sizes:
        check_size(height, width, len(classes.names), any(protocol.pamr for protocol in protocols))
    input_size = tuple(model.image.config.img_size)
    counts = [np.zeros((len(classes), len(classes)), dtype=np.int64) for _ in protocols]
    for index in range(len(folder)):
        image, truth = folder.read(index)
        for number, protocol in enumerate(protocols):
            predicted = segment(model, image, texts, classes.name_classes, protocol, proxy)
            counts[number] += segmentation.confusion(predicted, truth, len(classes))
            if step is not None:
                step(number)
    return [
        Result(protocol, count, sum(passes(*size, protocol, input_size) for size in folder.sizes) / max(len(folder), 1))
        for protocol, count in zip(protocols, counts)
    ]
