"""Segment by words on a model whose answer is known (tests/textmodels.planted_clip): the planted
region is found, by the whole picture and by sliding windows, with PAMR too."""
import numpy as np
import pytest
import torch

from vit_explorer.text.segmentation import Protocol, passes, segment, windows

from textmodels import planted_clip, planted_picture


def _iou(predicted: np.ndarray, truth: np.ndarray) -> float:
    return (predicted & truth).sum() / (predicted | truth).sum()


@pytest.mark.parametrize("protocol", [
    Protocol(slide=False), Protocol(slide=True), Protocol(slide=True, pamr=True), Protocol(slide=False, threshold=0.9),
    Protocol(slide=False, short_side=64),  # 64 x 96: a 8 x 12 grid, the object on whole patches
], ids=["whole", "slide", "slide+pamr", "whole+threshold", "whole at its aspect ratio"])
def test_the_planted_object_is_found(protocol):
    model, obj, background = planted_clip()
    height, width = 32, 48 if protocol.slide or protocol.short_side else 32  # sliding: two windows, 16 px apart
    box = (8, 24, 16, 32)  # 2 x 2 patches
    picture = planted_picture(height, width, box)
    labels = segment(model, picture, torch.stack([background, obj]), [0, 1], protocol)
    assert labels.shape == (height, width) and labels.dtype == np.uint8
    truth = np.zeros((height, width), dtype=bool)
    truth[box[0]:box[1], box[2]:box[3]] = True
    assert _iou(labels == 1, truth) >= 0.9
    assert _iou(labels == 0, ~truth) >= 0.9
    assert model.image.config.img_size == (32, 32)  # a picture at its own size used a copy


def test_a_high_threshold_leaves_uncertain_pixels_to_the_background():
    model, obj, background = planted_clip()
    picture = planted_picture(32, 32, (0, 16, 0, 32))
    texts = torch.stack([background, obj, obj])  # class 1 and 2 tie on the object: each at most half
    sure = segment(model, picture, texts, [0, 1, 2], Protocol(slide=False, threshold=0.0))
    unsure = segment(model, picture, texts, [0, 1, 2], Protocol(slide=False, threshold=0.6))
    assert (sure[:16] != 0).all() and (unsure[:16] == 0).all()


def test_windows_cover_the_picture_as_the_papers_place_them():
    # SCLIP / NACLIP's forward_slide: 224 crops 112 apart over a 336 x 500 picture.
    boxes = windows(336, 500, (224, 224), (112, 112))
    assert len(boxes) == 2 * 4 and boxes[-1] == (112, 336, 276, 500)
    covered = np.zeros((336, 500), dtype=int)
    for top, bottom, left, right in boxes:
        assert (bottom - top, right - left) == (224, 224)
        covered[top:bottom, left:right] += 1
    assert covered.min() >= 1
    assert passes(224, 224, Protocol(), (224, 224)) == 1
    assert passes(375, 500, Protocol(), (224, 224)) == 2  # VOC's usual 500 x 375 at the model's input: 224 x 299
    assert passes(375, 500, Protocol(short_side=336), (224, 224)) == 6  # at 336 x 448


def test_a_picture_too_large_to_segment_is_a_sentence_before_anything_is_computed():
    from vit_explorer.analysis import AnalysisError
    from vit_explorer.text.segmentation import check_size

    check_size(375, 500, 56, refine=True)  # VOC with its 56 names and PAMR: about 0.2 GB
    with pytest.raises(AnalysisError, match=r"a 4000x3000 picture with 21 names needs .* GB of scores and PAMR"):
        check_size(3000, 4000, 21, refine=True)
