"""python -m vit_explorer inspect: figures (and capture.npz when asked) for a real photo, from our
checkpoints and torchvision's, as PNG (when a browser exists) or HTML; bad input is one line and
exit 2."""
import csv
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision

import vit_explorer as vx
from vit_explorer import cli, figures
from vit_explorer.analysis import head_types as ht

PHOTO = Path(__file__).resolve().parents[2] / "assets" / "samples" / "chelsea.png"
FIGURES = [
    "input_grid", "attention_rollout", "attribution", "mean_attention_distance",
    "attention_entropy", "position_similarity", "embedding_filters", "token_pca", "logit_lens",
    "top5",
]


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """A random ViT with a non-square grid (4 x 6) and a register token."""
    torch.manual_seed(0)
    config = vx.ViTConfig(image_size=(32, 48), patch_size=8, num_classes=4, embed_dim=32, depth=3,
                          num_heads=2, reg_tokens=1, class_names=("cat", "dog", "cup", "car"))
    model = vx.ViT(config)
    torch.nn.init.normal_(model.head.weight)
    path = tmp_path_factory.mktemp("weights") / "tiny.safetensors"
    vx.save_model(model, path)
    return path, model


def expected_input(model):
    return vx.preprocess(vx.load_image(PHOTO), model.config)


def check_capture(npz_path, model, logits=None, layers=(-1,)):
    """capture.npz as --tensors writes it: the attention of ``layers`` only, float16."""
    config = model.config
    grid_h, grid_w = config.grid_size
    tokens = config.num_tokens
    layers = tuple(layer % config.depth for layer in layers)
    with np.load(npz_path) as data:
        assert data["attentions"].shape == (1, len(layers), config.num_heads, tokens, tokens)
        assert data["attentions"].dtype == np.float16 and tuple(data["attention_layers"]) == layers
        full = vx.capture(model, expected_input(model)).attentions[:, list(layers)]
        assert np.abs(data["attentions"].astype(np.float32) - full.numpy()).max() < 1e-3
        assert data["tokens"].shape == (1, config.depth + 1, tokens, config.embed_dim)
        assert data["patches"].shape == (1, grid_h, grid_w, 3, config.patch_size, config.patch_size)
        assert data["patch_embeddings"].shape == (1, grid_h * grid_w, config.embed_dim)
        assert data["rollout"].shape == (1, tokens, tokens)
        assert np.allclose(data["rollout"].sum(axis=-1), 1.0, atol=1e-5)
        assert data["attribution"].shape == (1, grid_h, grid_w)
        assert tuple(data["grid_size"]) == (grid_h, grid_w)
        assert int(data["num_prefix_tokens"]) == config.num_prefix_tokens
        assert data["logits"].shape == (1, config.num_classes)
        reference = model(expected_input(model)) if logits is None else logits
        assert np.allclose(data["logits"], reference.detach().numpy(), atol=1e-4)


def test_inspect_falls_back_to_html_without_a_browser(tiny_checkpoint, tmp_path, monkeypatch, capsys):
    path, model = tiny_checkpoint
    monkeypatch.setattr(figures, "find_browser", lambda: None)
    out = tmp_path / "out"
    code = cli.main(["inspect", str(PHOTO), "--weights", str(path), "--out", str(out),
                     "--layer", "1", "--tensors"])
    captured = capsys.readouterr()
    assert code == 0
    notes = captured.err.strip().splitlines()
    assert len(notes) == 1 and "HTML" in notes[0]
    for name in FIGURES + ["attention_heads_layer1"]:
        assert (out / f"{name}.html").is_file(), name
        assert f"{name}.html" in captured.out
    assert not list(out.glob("*.png"))
    assert (out / "plotly.min.js").is_file()
    assert "predicted" in captured.out and "capture.npz" in captured.out
    check_capture(out / "capture.npz", model, layers=(1,))


def test_inspect_reads_a_torchvision_checkpoint(tmp_path, capsys):
    torch.manual_seed(1)
    reference = torchvision.models.VisionTransformer(
        image_size=32, patch_size=8, num_layers=2, num_heads=1, hidden_dim=64, mlp_dim=128,
        num_classes=3,
    ).eval()
    torch.nn.init.normal_(reference.heads.head.weight)
    path = tmp_path / "torchvision_vit.pth"
    torch.save(reference.state_dict(), path)
    out = tmp_path / "out"
    code = cli.main(["inspect", str(PHOTO), "--weights", str(path), "--out", str(out),
                     "--format", "html", "--tensors", "all"])
    assert code == 0, capsys.readouterr().err
    model = vx.load_model(path)
    for name in FIGURES + ["attention_heads_layer1"]:
        assert (out / f"{name}.html").is_file(), name
    with torch.no_grad():
        logits = reference(expected_input(model))
    check_capture(out / "capture.npz", model, logits, layers=(0, 1))


@pytest.mark.skipif(figures.find_browser() is None, reason="no Chrome/Chromium for PNG export")
def test_inspect_writes_png_with_a_browser(tiny_checkpoint, tmp_path, capsys):
    path, model = tiny_checkpoint
    out = tmp_path / "out"
    assert cli.main(["inspect", str(PHOTO), "--weights", str(path), "--out", str(out)]) == 0
    assert capsys.readouterr().err == ""
    for name in FIGURES + ["attention_heads_layer2"]:
        assert (out / f"{name}.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n"), name
    assert not (out / "capture.npz").exists()  # the tensors only when asked


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["missing.png"], "does not exist"),
        ([__file__], "test_inspect.py"),
        ([str(PHOTO), "--layer", "3"], "layers 0..2"),
        ([str(PHOTO), "--device", "tpu"], "unknown device"),
    ],
)
def test_inspect_bad_input_is_one_line_and_exit_2(tiny_checkpoint, tmp_path, capsys, arguments,
                                                  message):
    path, _ = tiny_checkpoint
    code = cli.main(["inspect", *arguments, "--weights", str(path), "--out", str(tmp_path)])
    error = capsys.readouterr().err
    assert code == 2
    assert error.startswith("error: ") and error.count("\n") == 1 and message in error


def test_inspect_bad_weights_is_one_line_and_exit_2(tmp_path, capsys):
    bad = tmp_path / "weights.pth"
    bad.write_text("not a checkpoint")
    code = cli.main(["inspect", str(PHOTO), "--weights", str(bad), "--out", str(tmp_path)])
    error = capsys.readouterr().err
    assert code == 2 and error.startswith("error: ") and error.count("\n") == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_inspect_on_cuda(tiny_checkpoint, tmp_path):
    path, model = tiny_checkpoint
    out = tmp_path / "out"
    assert cli.main(["inspect", str(PHOTO), "--weights", str(path), "--out", str(out),
                     "--format", "html", "--device", "cuda", "--tensors"]) == 0
    check_capture(out / "capture.npz", model)


@pytest.mark.parametrize("changes", [
    dict(),  # DINO-like: class token, no classifier
    dict(class_token=False, global_pool="map"),  # SigLIP-like: the probe replaces the class token
])
def test_inspect_a_headless_model(tmp_path, monkeypatch, capsys, changes):
    torch.manual_seed(0)
    config = vx.ViTConfig(image_size=32, patch_size=8, num_classes=0, embed_dim=32, depth=2,
                          num_heads=2, **changes)
    path = tmp_path / "headless.safetensors"
    vx.save_model(vx.ViT(config), path)
    monkeypatch.setattr(figures, "find_browser", lambda: None)
    out = tmp_path / "out"
    assert cli.main(["inspect", str(PHOTO), "--weights", str(path), "--out", str(out), "--tensors"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("no classifier (num_classes=0), so no prediction")
    written = {file.stem for file in out.iterdir()}
    assert {"attention_masks", "token_norms_layer1", "token_pca", "attention_rollout"} <= written
    assert not {"attribution", "logit_lens", "top5"} & written
    assert ("attention_pool_probe" in written) == ("global_pool" in changes)
    with np.load(out / "capture.npz") as data:
        assert data["token_norms"].shape == (1, 3, config.num_tokens)
        assert ("pool_attentions" in data) == ("global_pool" in changes)


INSIDE = ["layernorm", "query", "keys_values", "scores", "attention", "scale_sweep", "rescaled_attention",
          "head_sources", "heads_projection", "attention_residual", "mlp_units", "mlp_residual"]


def test_inspect_writes_the_inside_a_layer_figures(tiny_checkpoint, tmp_path, monkeypatch, capsys):
    path, model = tiny_checkpoint
    monkeypatch.setattr(figures, "find_browser", lambda: None)
    out = tmp_path / "out"
    code = cli.main(["inspect", str(PHOTO), "--weights", str(path), "--out", str(out), "--layer", "1",
                     "--head", "1", "--query", "7", "--tensors"])
    assert code == 0, capsys.readouterr().err
    for name in INSIDE:
        assert (out / f"inside_layer1_{name}.html").is_file(), name
    # The page's attention row for patch 7 (token 1 + 7 behind the class and register tokens).
    html = (out / "inside_layer1_attention.html").read_text()
    assert "Attention of patch 7, layer 1, head 1: the softmax of the scores" in html
    steps = vx.layer_internals(model, vx.capture(model, expected_input(model)).tokens[:, 1], 1)
    with np.load(out / "capture.npz") as data:
        np.testing.assert_allclose(data["attentions"][0, 0, 1, 2 + 7], steps.attention[0, 1, 2 + 7], atol=1e-3)
    # Without --head or --query, no page figures.
    plain = tmp_path / "plain"
    assert cli.main(["inspect", str(PHOTO), "--weights", str(path), "--out", str(plain)]) == 0
    assert not list(plain.glob("inside_*"))


def test_inspect_writes_no_tensors_unless_asked_and_then_the_layers_asked(tiny_checkpoint, tmp_path, monkeypatch, capsys):
    path, model = tiny_checkpoint
    monkeypatch.setattr(figures, "find_browser", lambda: None)
    plain = tmp_path / "plain"
    assert cli.main(["inspect", str(PHOTO), "--weights", str(path), "--out", str(plain)]) == 0
    assert not (plain / "capture.npz").exists() and "capture.npz" not in capsys.readouterr().out
    assert (plain / "attention_rollout.html").is_file()
    asked = tmp_path / "asked"
    assert cli.main(["inspect", str(PHOTO), "--weights", str(path), "--out", str(asked), "--tensors", "0,-1"]) == 0
    check_capture(asked / "capture.npz", model, layers=(0, 2))
    assert cli.main(["inspect", str(PHOTO), "--weights", str(path), "--out", str(asked), "--tensors", "3"]) == 2
    assert capsys.readouterr().err.strip().endswith("--tensors 3 is not all or a list of layers 0..2 like 0,5")


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--head", "2"], "--head 2 does not exist; the model has heads 0..1"),
        (["--query", "24"], "--query 24 is neither cls nor a patch index 0..23 (4x6 grid, row by row)"),
        (["--query", "centre"], "--query centre is neither cls nor a patch index"),
    ],
)
def test_inspect_bad_head_or_query_is_one_line(tiny_checkpoint, tmp_path, capsys, arguments, message):
    path, _ = tiny_checkpoint
    code = cli.main(["inspect", str(PHOTO), "--weights", str(path), "--out", str(tmp_path), *arguments])
    error = capsys.readouterr().err
    assert code == 2 and error.startswith("error: ") and error.count("\n") == 1 and message in error


def test_inspect_a_dinov3_shaped_checkpoint(tmp_path, monkeypatch, capsys):
    """Rotary positions, registers, no pos_embed, SwiGLU: the figures, the page's rotated q and k,
    and no position-embedding figure (there is none to compare)."""
    torch.manual_seed(0)
    config = vx.ViTConfig(
        image_size=(32, 48), patch_size=8, num_classes=0, embed_dim=32, depth=2, num_heads=2, reg_tokens=4,
        qkv_bias=False, init_values=1e-5, rope_type="dinov3", abs_pos_embed=False, swiglu_mlp=True,
        layer_norm_eps=1e-5,
    )
    model = vx.ViT(config).eval()
    path = tmp_path / "dinov3.safetensors"
    vx.save_model(model, path)
    monkeypatch.setattr(figures, "find_browser", lambda: None)
    out = tmp_path / "out"
    code = cli.main(["inspect", str(PHOTO), "--weights", str(path), "--out", str(out), "--layer", "1",
                     "--head", "0", "--query", "3", "--tensors"])
    assert code == 0, capsys.readouterr().err
    written = {file.stem for file in out.iterdir()}
    assert {"attention_heads_layer1", "attention_rollout", "mean_attention_distance", "token_pca"} <= written
    assert "position_similarity" not in written
    assert "rotated" in (out / "inside_layer1_query.html").read_text()
    with np.load(out / "capture.npz") as data:
        assert int(data["num_prefix_tokens"]) == 5 and tuple(data["grid_size"]) == (4, 6)
        cap = vx.capture(model, expected_input(model))
        np.testing.assert_allclose(data["attentions"][0, -1], cap.attentions[0, 1], atol=1e-3)


def test_inspect_writes_the_head_types_over_the_image_and_more(tiny_checkpoint, tmp_path, monkeypatch, capsys):
    path, model = tiny_checkpoint
    monkeypatch.setattr(figures, "find_browser", lambda: None)
    more = PHOTO.parent / "coffee.png"
    out = tmp_path / "out"
    assert cli.main(["inspect", str(PHOTO), "--weights", str(path), "--out", str(out), "--head-types", str(more)]) == 0
    printed = capsys.readouterr().out
    assert "; heads over 2 images: " in printed and "head_types.json" in printed and "head_types.csv" in printed
    assert (out / "head_types.html").is_file()
    written = json.loads((out / "head_types.json").read_text())
    x = torch.cat([expected_input(model), vx.preprocess(vx.load_image(more), model.config)])
    expected = vx.classify_heads(model, x)  # both images in one pass: the same numbers
    assert written["images"] == 2 and written["thresholds"]["positional"] == ht.POSITIONAL
    assert [row["label"] for row in written["heads"]] == [label for row in expected.labels for label in row]
    np.testing.assert_allclose([row["consistency"] for row in written["heads"]], expected.consistency.flatten(), atol=1e-5)
    np.testing.assert_allclose([row["distance_px"] for row in written["heads"]], expected.distance.flatten(), rtol=1e-4)
    with open(out / "head_types.csv", newline="") as file:
        rows = list(csv.DictReader(file))
    config = model.config
    assert len(rows) == config.depth * config.num_heads and rows[0]["layer"] == "0" and rows[-1]["head"] == "1"
    assert float(rows[3]["prefix_share"]) == pytest.approx(written["heads"][3]["prefix_share"])
    # The image alone: nothing is consistent or not with one picture.
    alone = tmp_path / "alone"
    assert cli.main(["inspect", str(PHOTO), "--weights", str(path), "--out", str(alone), "--head-types"]) == 0
    assert all(row["consistency"] is None for row in json.loads((alone / "head_types.json").read_text())["heads"])
    # An unreadable extra image is one sentence, before anything runs.
    capsys.readouterr()
    assert cli.main(["inspect", str(PHOTO), "--weights", str(path), "--out", str(tmp_path / "bad"),
                     "--head-types", str(tmp_path / "missing.png")]) == 2
    error = capsys.readouterr().err
    assert error.startswith("error: ") and error.count("\n") == 1 and not (tmp_path / "bad").exists()
