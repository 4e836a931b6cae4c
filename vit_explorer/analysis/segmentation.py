"""Segmentation by scores: every pixel's class from its names' cosines, by the rule of the
training-free open-vocabulary papers (SCLIP, NACLIP: their ``postprocess_result``), and the mIoU
of a folder of predictions as mmseg's IoUMetric counts it.

The rule: the cosines of every name (a class may have several, synonyms) times a logit scale go
through a softmax over all names; a class's probability is its best name's; each pixel takes the
class of largest probability, and class 0 (the background) where that probability is below a
threshold (``prob_thd``: 0.1 on VOC21 and Context60, 0 elsewhere); SCLIP on VOC21 also zeroes
first the classes covering at most a share of the picture's foreground (``area_thd``: 0.1).
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

IGNORE_INDEX = 255  # VOC's unlabelled border: counted neither as right nor wrong
# NACLIP's default logit scale (SCLIP: 40 too, 50 on Context60, 65 on VOC21).
LOGIT_SCALE = 40.0


def upsample(scores: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """(B, Q, h, w) scores -> (B, Q, H, W), bilinear, corners not aligned (the papers' choice)."""
    return F.interpolate(scores.float(), size=size, mode="bilinear", align_corners=False)


def class_probabilities(cosines: torch.Tensor, name_classes: Sequence[int], logit_scale: float = LOGIT_SCALE) -> torch.Tensor:
    """(B, Q, H, W) cosines of Q names -> (B, C, H, W): the softmax over the names at
    ``logit_scale``, each class's the largest of its names' (``name_classes[q]``: name q's class;
    a class without names, as a background that only the threshold gives, has probability 0)."""
    probabilities = (cosines.float() * logit_scale).softmax(dim=1)
    index = torch.as_tensor(name_classes, dtype=torch.long)
    count = int(index.max()) + 1
    if torch.equal(index, torch.arange(count)):  # one name a class
        return probabilities
    empty = probabilities.new_zeros(probabilities[:, 0].shape)
    return torch.stack([
        probabilities[:, index == number].amax(dim=1) if (index == number).any() else empty for number in range(count)
    ], dim=1)


def label_pixels(probabilities: torch.Tensor, threshold: float = 0.0, area_threshold: float | None = None) -> torch.Tensor:
    """(B, C, H, W) class probabilities -> (B, H, W) classes: the most likely, 0 (the background)
    where even that one's probability is below ``threshold``. ``area_threshold`` (SCLIP's
    ``area_thd``, 0.1 on VOC21): a class other than 0 that would take no more than that share of
    the pixels not given to class 0 is zeroed first, each picture on its own."""
    if area_threshold is not None:
        count = probabilities.shape[1]
        first = F.one_hot(probabilities.argmax(dim=1), count).sum(dim=(1, 2))[:, 1:]  # (B, C - 1) pixels each
        kept = (first > area_threshold * first.sum(dim=1, keepdim=True)).to(probabilities.dtype)
        probabilities = torch.cat([probabilities[:, :1], probabilities[:, 1:] * kept[..., None, None]], dim=1)
    best, labels = probabilities.max(dim=1)
    return labels.masked_fill(best < threshold, 0)


def confusion(predicted: np.ndarray, truth: np.ndarray, num_classes: int) -> np.ndarray:
    """(C, C) int64 pixel counts, row the true class, column the predicted one; pixels whose truth
    is IGNORE_INDEX are left out."""
    kept = truth != IGNORE_INDEX
    pairs = truth[kept].astype(np.int64) * num_classes + predicted[kept].astype(np.int64)
    return np.bincount(pairs, minlength=num_classes * num_classes).reshape(num_classes, num_classes)


def iou_per_class(counts: np.ndarray) -> np.ndarray:
    """(C,) intersection over union of each class over everything counted; NaN for a class that is
    neither in the truth nor predicted (it does not enter the mean)."""
    intersection = np.diag(counts).astype(np.float64)
    union = counts.sum(axis=0) + counts.sum(axis=1) - intersection
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(union > 0, intersection / union, np.nan)


def mean_iou(counts: np.ndarray) -> float:
    """The mean of :func:`iou_per_class` over the classes present in the truth or predicted."""
    ious = iou_per_class(counts)
    return float(np.nanmean(ious)) if np.isfinite(ious).any() else float("nan")
