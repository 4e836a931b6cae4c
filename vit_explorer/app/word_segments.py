"""Segment by words, for the Attention page's "Ask in words": every pixel of the picture labelled
by the prompt its patch is most like (text.segmentation's rule: a softmax over the prompts at the
papers' logit scale, class 0, the background, where the best prompt's probability is below the
threshold), optionally refined by PAMR, and the mask to download (a PNG of class indices).

Costs no pass of the model: it reads the page's prompt maps (app.word_maps.similarities),
up-sampled to the picture. The picture is segmented at its own size up to MAX_PIXELS (above, at
that many pixels, its aspect kept; the mask downloaded is brought back to the picture's size),
so that PAMR's neighbours stay a few hundred MB whatever was uploaded.
"""
from __future__ import annotations

import io
from dataclasses import replace

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, PngImagePlugin

from ..data.transforms import reshapes
from ..text.segmentation import Protocol, label
from . import word_maps, words
from .selection import Selection

MAX_PIXELS = 512 * 512
BACKGROUND = "background"


def segmented_size(height: int, width: int) -> tuple[int, int]:
    """The picture's size, or at most MAX_PIXELS with its aspect kept."""
    scale = min(1.0, (MAX_PIXELS / (height * width)) ** 0.5)
    return max(1, int(height * scale)), max(1, int(width * scale))


def segmentation(
    selection: Selection, prompts: tuple[str, ...], threshold: float, pamr: bool, method: str = word_maps.DEFAULT_METHOD,
    proxy_key: str | None = None,
) -> np.ndarray:
    """(H, W) uint8: 0 the background, k prompt k - 1, at the segmented size of the picture, from
    ``method``'s maps (ProxyCLIP's with the proxy ``proxy_key``). Of the whole picture, even where
    the page reads its publisher's crop: every pixel gets a label (one pass more, then)."""
    if reshapes(selection.config) and not selection.whole:
        selection = replace(selection, whole=True)

    def compute() -> np.ndarray:
        cosines = torch.from_numpy(word_maps.similarities(selection, prompts, method, proxy_key))[None]  # (1, T, gh, gw)
        size = segmented_size(selection.image.height, selection.image.width)
        # PAMR follows the model's input brought to the picture's size, as the papers' predict does.
        picture = F.interpolate(selection.model_input(), size=size, mode="bilinear", align_corners=False) if pamr \
            else torch.empty((1, 0, *size))
        return label(cosines, picture, range(1, len(prompts) + 1), Protocol(slide=False, threshold=threshold, pamr=pamr))

    return selection.memo("words segmentation", words.labels_id(prompts), method, proxy_key, threshold, pamr, compute=compute,
                          spinner="Labelling every pixel ..." if pamr else None)


def picture(selection: Selection, size: tuple[int, int]) -> np.ndarray:
    """(H, W, 3) uint8 the picture at ``size`` (height, width), under the mask."""
    return selection.memo("words segmentation picture", size, compute=lambda: np.asarray(
        selection.image.convert("RGB").resize((size[1], size[0]), Image.Resampling.BILINEAR)
    ))


def class_list(prompts: tuple[str, ...]) -> str:
    """The classes of the mask, one a line: 'index<TAB>name', 0 the background."""
    return "".join(f"{index}\t{name}\n" for index, name in enumerate((BACKGROUND, *prompts)))


def mask_png(labels: np.ndarray, size: tuple[int, int], prompts: tuple[str, ...]) -> bytes:
    """The mask ``labels`` of :func:`segmentation` at the picture's ``size`` (width, height; nearest
    neighbour), a greyscale PNG whose pixels are class indices, the class list in its "classes"
    text chunk. The page's download button calls it on a click, in a thread of its own: it reads
    only its arguments."""
    mask = Image.fromarray(labels)
    if mask.size != tuple(size):
        mask = mask.resize(tuple(size), Image.Resampling.NEAREST)
    info = PngImagePlugin.PngInfo()
    info.add_text("classes", class_list(prompts))
    out = io.BytesIO()
    mask.save(out, format="PNG", pnginfo=info)
    return out.getvalue()
