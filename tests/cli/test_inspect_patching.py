"""python -m vit_explorer inspect IMAGE --patch CORRUPTED: the patching heat maps and patching.csv,
the numbers analysis.patching's own; bad input one line and exit 2."""
import csv
from pathlib import Path

import pytest
import torch

import vit_explorer as vx
from vit_explorer import cli, figures
from vit_explorer.analysis import patching

SAMPLES = Path(__file__).resolve().parents[2] / "assets" / "samples"
CLEAN, CORRUPTED = SAMPLES / "chelsea.png", SAMPLES / "coffee.png"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    config = vx.ViTConfig(image_size=16, patch_size=8, num_classes=4, embed_dim=32, depth=2, num_heads=2,
                          class_names=("cat", "dog", "cup", "car"))
    model = vx.ViT(config).eval()
    torch.nn.init.normal_(model.head.weight)
    path = tmp_path_factory.mktemp("weights") / "tiny.safetensors"
    vx.save_model(model, path)
    return path, vx.load_model(path)


def test_inspect_patch_writes_the_heat_maps_and_a_csv_of_the_analysis_numbers(checkpoint, tmp_path, capsys):
    path, model = checkpoint
    out = tmp_path / "out"
    code = cli.main(["inspect", str(CLEAN), "--weights", str(path), "--out", str(out), "--format", "html",
                     "--patch", str(CORRUPTED), "--metric", "cat-dog", "--exact"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "each was resized to the model's 16x16" in captured.err  # two sizes: said, not refused
    assert "patching (logit 'cat' - logit 'dog', denoising, exact): the largest head is" in captured.out
    for method in ("attribution", "exact"):
        for site in patching.SITES:
            assert (out / f"patching_{method}_{site}.html").is_file()
    assert (out / "patching_agreement_head.html").is_file()
    with open(out / "patching.csv") as file:
        rows = list(csv.DictReader(file))
    tokens, depth, heads = model.config.num_tokens, model.config.depth, model.config.num_heads
    assert len(rows) == 2 * depth * (3 * tokens + heads)
    clean, corrupted = (vx.preprocess(vx.load_image(picture), model.config) for picture in (CLEAN, CORRUPTED))
    runs = patching.paired_runs(model, clean, corrupted)
    expected = patching.exact_patching(model, runs, patching.class_difference(0, 1, model.config.class_names), "head")
    written = {(int(row["layer"]), int(row["cell"])): float(row["value"]) for row in rows
               if row["method"] == "exact" and row["site"] == "head"}
    assert written == pytest.approx({(layer, head): float(expected[layer, head]) for layer in range(depth) for head in range(heads)}, abs=1e-5)


@pytest.mark.skipif(figures.find_browser() is None, reason="no Chrome/Chromium for PNG export")
def test_inspect_patch_writes_png(checkpoint, tmp_path):
    path, _ = checkpoint
    out = tmp_path / "out"
    assert cli.main(["inspect", str(CLEAN), "--weights", str(path), "--out", str(out), "--patch", str(CORRUPTED)]) == 0
    assert (out / "patching_attribution_resid.png").read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize("arguments, message", [
    (["--patch", str(CORRUPTED), "--metric", "cat-bird"], "no class 'bird'"),
    (["--patch", str(CLEAN)], "nothing to patch"),
])
def test_inspect_patch_bad_input_is_one_line_and_exit_2(checkpoint, tmp_path, capsys, arguments, message):
    path, _ = checkpoint
    code = cli.main(["inspect", str(CLEAN), "--weights", str(path), "--out", str(tmp_path), "--format", "html", *arguments])
    error = capsys.readouterr().err
    assert code == 2 and error.startswith("error: ") and error.count("\n") == 1 and message in error, error
