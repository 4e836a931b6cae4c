"""bench.segment on a tiny labelled folder made here: its mIoU equals the one counted by hand, a
picture costs one pass of the image tower, and bad input is one sentence."""
import numpy as np
import pytest
import torch
from PIL import Image

from bench import segment as bench
from vit_explorer.data.labelled_folder import read_classes, read_labelled_folder
from vit_explorer.text.segmentation import Protocol

from textmodels import labelled_folder, planted_clip


def test_the_benchmarks_miou_is_the_one_counted_by_hand(tmp_path):
    model, obj, background = planted_clip()
    images, masks, classes_file = labelled_folder(tmp_path)
    classes = read_classes(classes_file)
    folder = read_labelled_folder(images, masks, classes)
    cat = torch.nn.functional.normalize(torch.tensor([0.0, 0, 1, 0, 0, 0, 0, 0]), dim=0)  # like no patch
    texts = torch.stack([background, background, obj, cat])  # names in the class file's order
    results = bench.measure(model, folder, texts, [Protocol(slide=False), Protocol(slide=True)], progress=False)
    # By hand. Object: a: 512 predicted, 640 true, 512 both; b: rows 8-12 unlabelled, so 384, 384, 384.
    # Background: a: 512 predicted, 384 true, 384 both; b: 512 each; c: 1024 each. Cat: nowhere, left out.
    object_iou = (512 + 384) / (640 + 384)
    background_iou = (384 + 512 + 1024) / (512 + 512 + 1024)
    for result in results:
        assert result.mean_iou == pytest.approx((object_iou + background_iou) / 2, abs=1e-12)
        assert result.passes == 1.0  # a 32 px picture at a 32 px model: one window
    table = bench.table(results, classes)
    assert "90.62" in table and "  2 cat" in table and table.count("-") == 2


def _main(capsys, *arguments) -> tuple[int, str]:
    code = bench.main([*map(str, arguments)])
    return code, capsys.readouterr().err


def test_bad_input_is_a_sentence_before_any_model_is_loaded(tmp_path, capsys):
    images, masks, classes_file = labelled_folder(tmp_path)
    never = tmp_path / "no model here"
    common = ("--weights", never, "--folder", images, "--masks", masks)
    (tmp_path / "huge.txt").write_text("\n".join(f"class {index}" for index in range(100_000)))
    code, said = _main(capsys, *common, "--classes", tmp_path / "huge.txt")
    assert code == 2 and said.startswith("bench.segment: the class file huge.txt is over 64 KB") and said.count("\n") == 1
    (tmp_path / "two.txt").write_text("background\nobject\n")
    Image.fromarray(np.full((32, 32), 2, dtype=np.uint8)).save(masks / "c.png")
    code, said = _main(capsys, *common, "--classes", tmp_path / "two.txt")
    assert code == 2 and "the mask c.png has pixels of class 2, but the class file names 2 classes" in said
    code, said = _main(capsys, *common, "--classes", classes_file, "--threshold", "2")
    assert code == 2 and "--threshold 2.0 is not a probability" in said
