"""python -m vit_explorer inspect --text: for a CLIP or SigLIP folder (both towers), the prediction
over the texts and where each one is, as text.maps computes them; bad texts, and --text for a model
without a text tower, are one line and exit 2, before any model is loaded."""
from pathlib import Path

import numpy as np
import pytest

import vit_explorer as vx
from vit_explorer import cli, figures
from vit_explorer.text import load_image_text_model, maps, zero_shot

from textmodels import SMALL_CLIP, open_clip_folder, siglip_folder

PHOTO = Path(__file__).resolve().parents[2] / "assets" / "samples" / "chelsea.png"
TEXTS = ["a cat", "a dog", "a rocket"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("text models")
    open_clip_folder(root / "clip", SMALL_CLIP)
    return {"clip": root / "clip", "siglip": siglip_folder(root / "siglip")}


@pytest.mark.parametrize("name", ["clip", "siglip"])
def test_inspect_text_writes_the_prediction_and_each_texts_maps(folders, name, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(figures, "find_browser", lambda: None)  # HTML: the same figures, quicker
    out = tmp_path / "out"
    code = cli.main(["inspect", str(PHOTO), "--weights", str(folders[name]), "--out", str(out), "--tensors",
                     "--text", *TEXTS, " a cat "])  # a text given twice is read once
    printed = capsys.readouterr().out
    assert code == 0
    for figure in ["words_top5", "words_similarity", "words_best_text", "words_relevance_1", "words_relevance_2",
                   "words_relevance_3", "attention_rollout"]:
        assert (out / f"{figure}.html").is_file(), figure
    # The numbers, against text.maps on the folder read anew.
    model = load_image_text_model(folders[name])
    x = vx.preprocess(vx.load_image(PHOTO), model.image.config)
    captured = vx.capture(model.image, x, layers=())
    texts = model.embed_texts(zero_shot.label_prompts(TEXTS))
    predicted = zero_shot.predict(model, captured.logits, tuple(TEXTS), texts)
    similarities = maps.similarity_maps(maps.patch_embeddings(model, captured), texts, captured.grid_size)[0]
    with np.load(out / "capture.npz") as data:
        np.testing.assert_allclose(data["text_scores"], predicted.scores.numpy(), atol=1e-6, rtol=1e-5)
        np.testing.assert_allclose(data["text_similarity"], similarities.numpy(), atol=1e-5, rtol=0)
        mapped = list(data["text_mapped"])
        assert mapped == predicted.scores.argsort(descending=True).tolist()
        for index, relevance in zip(mapped, data["text_relevance"]):
            np.testing.assert_allclose(relevance, maps.relevance(model, x, texts[index])[0].numpy(), atol=1e-5, rtol=1e-4)
    best, score = predicted.top(1)[0]
    assert f"in words ({predicted.scoring} over 3 texts): {best} ({score:.1%})" in printed


def test_inspect_of_a_text_model_without_text_says_how_to_ask(folders, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(figures, "find_browser", lambda: None)
    code = cli.main(["inspect", str(PHOTO), "--weights", str(folders["clip"]), "--out", str(tmp_path / "out")])
    assert code == 0 and "--text" in capsys.readouterr().out
    assert not list((tmp_path / "out").glob("words_*"))


@pytest.mark.parametrize("texts, sentence", [
    ([], "type at least one label"),
    (["  "], "type at least one label"),
    ([f"thing {index}" for index in range(1001)], "too many"),
    (["x" * 100_000], "too long"),
])
def test_texts_that_cannot_be_read_are_one_line_and_exit_2(folders, tmp_path, capsys, texts, sentence, monkeypatch):
    loaded = []
    monkeypatch.setattr("vit_explorer.weights.load_model", lambda *args, **kw: loaded.append(args))
    code = cli.main(["inspect", str(PHOTO), "--weights", str(folders["clip"]), "--out", str(tmp_path / "out"), "--text", *texts])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and sentence in err and "Traceback" not in err
    assert loaded == [] and not (tmp_path / "out").exists()


def test_text_for_a_model_without_a_text_tower_is_one_line_and_exit_2(tmp_path, capsys):
    weights = tmp_path / "tiny.safetensors"
    vx.save_model(vx.ViT(vx.ViTConfig(image_size=32, patch_size=8, num_classes=0, embed_dim=32, depth=2, num_heads=2)), weights)
    code = cli.main(["inspect", str(PHOTO), "--weights", str(weights), "--out", str(tmp_path / "out"), "--text", "a cat"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert "--text needs a model with a text tower" in err and "tiny.safetensors is an image model only" in err
