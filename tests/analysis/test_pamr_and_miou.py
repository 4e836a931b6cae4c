"""Segmentation by words, the numbers under it: PAMR against its authors' code, each pixel's
class by the papers' rule, and the mIoU as mmseg's IoUMetric counts it."""
import numpy as np
import pytest
import torch

from vit_explorer.analysis import pamr, segmentation

from reference.naclip_pamr import PAMR


@pytest.mark.parametrize("dilations", [(8, 16), (1, 2)])
def test_pamr_equals_naclips_on_random_inputs(dilations):
    generator = torch.Generator().manual_seed(0)
    image = torch.randn(2, 3, 37, 45, generator=generator)
    mask = torch.randn(2, 11, 9, 12, generator=generator)  # more classes than a chunk
    with torch.no_grad():
        expected = PAMR(10, dilations=list(dilations))(image, mask)
    torch.testing.assert_close(pamr.pamr(image, mask, 10, dilations), expected, atol=1e-5, rtol=0)


def test_a_class_takes_its_best_synonym_and_weak_pixels_fall_to_the_background():
    # 3 names: class 0 "background", class 1 twice (two synonyms); 4 pixels.
    cosines = torch.tensor([[0.2, 0.0, 0.0, 0.1], [0.0, 0.3, 0.0, 0.12], [0.0, 0.0, 0.25, 0.1]]).reshape(1, 3, 2, 2)
    probabilities = segmentation.class_probabilities(cosines, [0, 1, 1], logit_scale=40)
    expected = (cosines * 40).softmax(1)
    torch.testing.assert_close(probabilities[:, 1], expected[:, 1:].amax(1))
    torch.testing.assert_close(probabilities[:, 0], expected[:, 0])
    assert segmentation.label_pixels(probabilities).flatten().tolist() == [0, 1, 1, 1]
    # The last pixel is nearly a tie of the three names: class 1 at 0.53, below a threshold of 0.6.
    assert segmentation.label_pixels(probabilities, 0.6).flatten().tolist() == [0, 1, 1, 0]


def test_mean_iou_counts_over_the_whole_set_and_skips_absent_classes_and_ignored_pixels():
    truth = np.array([[0, 0, 1, 1], [0, 255, 1, 1]])
    predicted = np.array([[0, 1, 1, 1], [0, 3, 1, 0]])
    counts = segmentation.confusion(predicted, truth, 4)
    # class 0: 2 right of truth 3 + predicted 3 -> 2 / 4; class 1: 3 / 5; class 2 absent; class 3 only on an ignored pixel.
    ious = segmentation.iou_per_class(counts)
    np.testing.assert_allclose(ious[:2], [2 / 4, 3 / 5])
    assert np.isnan(ious[2]) and np.isnan(ious[3])
    assert segmentation.mean_iou(counts) == pytest.approx((2 / 4 + 3 / 5) / 2)


def test_sclips_area_threshold_zeroes_a_class_over_too_little_of_the_foreground():
    # 10 pixels: class 1 first on 6, class 2 on 1, class 0 on 3; SCLIP's area_thd 0.1 of the 7 foreground pixels.
    first = [1, 1, 1, 1, 1, 1, 2, 0, 0, 0]
    probabilities = torch.full((1, 3, 1, 10), 0.1)
    for pixel, top in enumerate(first):
        probabilities[0, top, 0, pixel] = 0.8
    probabilities[0, 1, 0, 6] = 0.15  # where class 2 goes, class 1 is next
    assert segmentation.label_pixels(probabilities).flatten().tolist() == first
    # Class 2 holds 1/7 > 0.1 of the foreground: kept; at 0.2 it is zeroed and its pixel goes to class 1.
    assert segmentation.label_pixels(probabilities, area_threshold=0.1).flatten().tolist() == first
    assert segmentation.label_pixels(probabilities, area_threshold=0.2).flatten().tolist() == [1] * 7 + [0] * 3
