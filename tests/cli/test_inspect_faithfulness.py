"""python -m vit_explorer inspect --faithfulness: the deletion and insertion curves of every map it
writes (the figure, faithfulness.csv, a sentence in the summary), as analysis.faithfulness computes
them by hand on the same maps; with --text, the best text's maps scored by the image's cosine with it."""
import csv
from pathlib import Path

import numpy as np
import pytest
import torch

import vit_explorer as vx
from vit_explorer import analysis, cli
from vit_explorer.analysis import faithfulness as fa
from vit_explorer.model.capture import layer_attentions
from vit_explorer.text import load_image_text_model, maps, zero_shot

from textmodels import SMALL_CLIP, open_clip_folder

PHOTO = Path(__file__).resolve().parents[2] / "assets" / "samples" / "chelsea.png"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    torch.manual_seed(0)
    config = vx.ViTConfig(image_size=(32, 48), patch_size=8, num_classes=4, embed_dim=32, depth=3, num_heads=2,
                          reg_tokens=1, class_names=("cat", "dog", "cup", "car"))
    model = vx.ViT(config)
    torch.nn.init.normal_(model.head.weight)
    path = tmp_path_factory.mktemp("weights") / "tiny.safetensors"
    vx.save_model(model, path)
    return path


def inspected_maps(model, x, texts=None, folder=None):
    """The maps inspect writes, made by hand: the last layer's heads (float16, as kept), rollout,
    the attribution, the sharpest head's 60% mask; with texts, the best one's relevance and similarity."""
    captured = vx.capture(model, x, layers=())
    prefix, grid = captured.num_prefix_tokens, captured.grid_size
    attentions = list(layer_attentions(model, captured))
    heads = analysis.query_map(attentions[-1].half()[0], grid, prefix, class_token=model.config.class_token)
    rollout = analysis.streamed_rollout(iter(attentions), num_prefix_tokens=prefix)
    tested = {"last layer's attention": heads.float().mean(0),
              "rollout": analysis.query_map(rollout, grid, prefix, class_token=model.config.class_token)[0]}
    if model.config.num_classes:
        tested["attribution"] = analysis.attribution(model, x)[0]
    head, mask = fa.sharpest_mask(heads)
    tested[f"head {head}'s mask"] = mask
    if texts is None:
        return tested, captured, None
    both = load_image_text_model(folder, image=model)
    embedded = both.embed_texts(zero_shot.label_prompts(texts))
    predicted = zero_shot.predict(both, captured.logits, tuple(texts), embedded)
    top = int(predicted.scores.argmax())
    tested[f"relevance of '{texts[top]}'"] = maps.relevance(both, x, embedded[top])[0]
    tested[f"similarity to '{texts[top]}'"] = maps.similarity_maps(
        maps.patch_embeddings(both, captured), embedded[top:top + 1], grid)[0, 0]
    return tested, captured, (maps.text_score(both, embedded[top]), f"the cosine with '{texts[top]}'")


def written_curves(out: Path) -> dict[tuple[str, str], tuple[float, np.ndarray]]:
    with open(out / "faithfulness.csv", newline="") as file:
        rows = list(csv.reader(file))
    assert rows[0][:3] == ["curve", "map", "area"]
    return {(row[0], row[1]): (float(row[2]), np.array(row[3:], dtype=float)) for row in rows[1:]}


def check(out: Path, expected: fa.Faithfulness) -> None:
    written = written_curves(out)
    assert len(written) == len(expected.names) * len(expected.curves)
    for curve, scores in expected.curves.items():
        for name, area, values in zip(expected.names, expected.area(curve).tolist(), scores.numpy()):
            shown_area, shown = written[(curve, name)]
            assert shown_area == pytest.approx(area, abs=1e-5)
            np.testing.assert_allclose(shown, values, atol=2e-6)
    assert (out / "faithfulness.html").is_file()


@pytest.mark.parametrize("mode", ["drop", "mean"])
def test_inspect_writes_the_curves_of_the_maps_it_writes(tiny, tmp_path, capsys, mode):
    out = tmp_path / "out"
    arguments = ["--faithfulness"] + ([] if mode == "drop" else ["mean"])
    assert cli.main(["inspect", str(PHOTO), "--weights", str(tiny), "--out", str(out), "--format", "html", *arguments]) == 0
    model = vx.load_model(tiny)
    x = vx.preprocess(vx.load_image(PHOTO), model.config)
    tested, captured, _ = inspected_maps(model, x)
    expected = fa.faithfulness_curves(model, x, tested, mode=mode, intact=captured.logits[0])
    check(out, expected)
    said = capsys.readouterr().out
    assert f"faithfulness ({mode}): deletion favours " in said and "faithfulness.csv" in said
    assert expected.reading(0.1).rstrip(".") in said


def test_inspect_writes_no_curves_unless_asked(tiny, tmp_path):
    assert cli.main(["inspect", str(PHOTO), "--weights", str(tiny), "--out", str(tmp_path), "--format", "html"]) == 0
    assert not (tmp_path / "faithfulness.csv").exists() and not (tmp_path / "faithfulness.html").exists()


def test_inspect_tests_the_best_texts_maps_by_its_cosine(tmp_path, capsys):
    folder = tmp_path / "clip"
    open_clip_folder(folder, SMALL_CLIP)
    out = tmp_path / "out"
    texts = ["a cat", "a dog", "a cup"]
    assert cli.main(["inspect", str(PHOTO), "--weights", str(folder), "--out", str(out), "--format", "html",
                     "--text", *texts, "--faithfulness"]) == 0
    model = vx.load_model(folder)
    x = vx.preprocess(vx.load_image(PHOTO), model.config)
    tested, captured, (score, what) = inspected_maps(model, x, texts, folder)
    expected = fa.faithfulness_curves(model, x, tested, intact=captured.logits[0], score=score, what=what)
    assert any(name.startswith("relevance of '") for name in expected.names)
    check(out, expected)
    assert expected.reading(0.1).rstrip(".") in capsys.readouterr().out
