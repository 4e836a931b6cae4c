"""The open-vocabulary method chosen on the pages and in inspect --text (text/open_vocabulary.py):
the Attention page's "Ask in words" and the Several images page draw the chosen method's maps, as
the method computes them on a model read anew, and say which method they are; choosing one costs
no pass of the image tower; inspect --method writes its maps, and a method without --text or a
method there is not is one line, exit 2."""
import re

import numpy as np
import pytest
import torch

import vit_explorer as vx
from vit_explorer import cli, figures
from vit_explorer.app import images
from vit_explorer.text import load_image_text_model, maps, open_vocabulary, zero_shot

from apptest import PHOTO, charts, counting_forwards, decoded, errors, open_words_app, tiny_default  # noqa: F401
from textmodels import SMALL_CLIP, open_clip_folder, siglip_folder

PROMPTS = ["a cat", "a dog", "a rocket"]  # the box's default


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("text models")
    open_clip_folder(root / "clip", SMALL_CLIP)
    return {"clip": root / "clip", "siglip": siglip_folder(root / "siglip")}


def _by_hand(folder, image_key: str, method: str, prompts) -> np.ndarray:
    """(T, gh, gw) the method's maps of the app's image, on the folder's model read anew."""
    model = load_image_text_model(folder)
    _, image = images.resolve_image(image_key, model.image.config.img_size)
    captured = vx.capture(model.image, vx.preprocess(image, model.image.config), layers=())
    texts = model.embed_texts(zero_shot.label_prompts(list(prompts)))
    patches = open_vocabulary.patch_embeddings(model, captured, method)
    return maps.similarity_maps(patches, texts, captured.grid_size)[0].numpy()


def _heatmaps(app, pattern: str) -> list[np.ndarray]:
    (traces,) = [traces for title, traces in charts(app).items() if re.search(pattern, title)]
    return [decoded(trace["z"]) for trace in traces if trace["type"] == "heatmap"]


def test_ask_in_words_draws_the_chosen_methods_maps_without_a_pass(folders, monkeypatch):
    app = open_words_app(folders["clip"], "views/attention.py")
    assert app.selectbox(key="word_method").value == "maskclip"
    forwards = counting_forwards(monkeypatch)
    app.selectbox(key="word_method").set_value("naclip").run()
    assert not app.exception and errors(app) == [] and forwards == []  # the capture's tokens, the last block only
    expected = _by_hand(folders["clip"], app.session_state["image_key"], "naclip", PROMPTS)
    shown = _heatmaps(app, r"^Where each prompt is.*NACLIP")
    np.testing.assert_allclose(np.stack(shown).reshape(expected.shape), expected, atol=1e-5, rtol=0)
    (best,) = _heatmaps(app, r"coloured by the prompt.*NACLIP")
    assert np.array_equal(best.reshape(expected.shape[1:]), expected.argmax(axis=0))
    assert any("NACLIP" in caption.value and "Gaussian" in caption.value for caption in app.caption)
    maskclip = _by_hand(folders["clip"], app.session_state["image_key"], "maskclip", PROMPTS)
    assert np.abs(maskclip - expected).max() > 1e-3  # the page did change its maps


def test_several_images_draw_the_chosen_methods_maps(folders):
    app = open_words_app(folders["siglip"], "views/images.py")
    app.selectbox(key="word_method").set_value("clearclip").run()
    assert not app.exception and errors(app) == []
    chosen = app.multiselect(key="image_set").value
    shown = _heatmaps(app, r"^Where 'a cat' is in each image.*ClearCLIP")
    assert len(shown) == len(chosen) >= 2
    for image_key, values in zip(chosen, shown):
        expected = _by_hand(folders["siglip"], image_key, "clearclip", ["a cat"])[0]
        np.testing.assert_allclose(values.reshape(expected.shape), expected, atol=1e-5, rtol=0)


def test_inspect_method_writes_that_methods_maps(folders, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(figures, "find_browser", lambda: None)  # HTML: the same figures, quicker
    out = tmp_path / "out"
    code = cli.main(["inspect", str(PHOTO), "--weights", str(folders["siglip"]), "--out", str(out), "--tensors",
                     "--text", *PROMPTS, "--method", "sclip"])
    assert code == 0 and "maps by SCLIP" in capsys.readouterr().out
    model = load_image_text_model(folders["siglip"])
    x = vx.preprocess(vx.load_image(PHOTO), model.image.config)
    captured = vx.capture(model.image, x, layers=())
    texts = model.embed_texts(zero_shot.label_prompts(PROMPTS))
    expected = maps.similarity_maps(open_vocabulary.patch_embeddings(model, captured, "sclip"), texts, captured.grid_size)[0]
    with np.load(out / "capture.npz") as data:
        np.testing.assert_allclose(data["text_similarity"], expected.numpy(), atol=1e-5, rtol=0)
    assert "SCLIP" in (out / "words_similarity.html").read_text()


def _exit_code(argv: list[str]) -> int:
    """cli.main's exit: its return, or argparse's exit for a choice there is not."""
    try:
        return cli.main(argv)
    except SystemExit as exited:
        return exited.code


@pytest.mark.parametrize("arguments, sentence", [
    (["--method", "naclip"], "--method naclip chooses how the maps of --text are made: give --text too"),
    (["--text", "a cat", "--method", "gradcam"], "invalid choice: 'gradcam'"),
    (["--text", "a cat", "--method", "proxyclip"], "--method proxyclip and --proxy go together"),
])
def test_a_method_that_cannot_be_used_is_one_line_and_exit_2(folders, tmp_path, capsys, monkeypatch, arguments, sentence):
    loaded = []
    monkeypatch.setattr("vit_explorer.weights.load_model", lambda *args, **kw: loaded.append(args))
    code = _exit_code(["inspect", str(PHOTO), "--weights", str(folders["clip"]), "--out", str(tmp_path / "out"), *arguments])
    err = capsys.readouterr().err.strip()
    assert code == 2 and sentence in err.splitlines()[-1] and "Traceback" not in err
    assert loaded == [] and not (tmp_path / "out").exists()


def test_the_methods_keep_the_capture_untouched(folders):
    model = load_image_text_model(folders["clip"])
    captured = vx.capture(model.image, torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(0)), layers=())
    tokens = captured.tokens.clone()
    for method, entry in open_vocabulary.METHODS.items():  # CLIP Surgery (6 blocks) and ProxyCLIP: tests/text
        if entry.maps is None and not entry.needs_proxy:
            open_vocabulary.patch_embeddings(model, captured, method)
    assert torch.equal(captured.tokens, tokens)


def test_proxyclip_borrows_the_chosen_proxys_attention_on_the_page(folders, tiny_default):
    """ProxyCLIP with the server's default ViT as the proxy (the first model already here): the
    page's maps are on the proxy's grid and equal the method computed by hand."""
    from vit_explorer.text import proxyclip

    app = open_words_app(folders["clip"], "views/attention.py")
    app.selectbox(key="word_method").set_value("proxyclip").run()
    assert not app.exception and errors(app) == [] and app.selectbox(key="word_proxy").value == "default"
    model = load_image_text_model(folders["clip"])
    _, image = images.resolve_image(app.session_state["image_key"], model.image.config.img_size)
    x = vx.preprocess(image, model.image.config)
    captured = vx.capture(model.image, x, layers=())
    proxy_model = vx.load_model(tiny_default)
    proxy = proxyclip.Proxy(proxy_model, vx.capture(proxy_model, proxyclip.proxy_input(x, model.image.config, proxy_model.config), layers=()))
    texts = model.embed_texts(zero_shot.label_prompts(PROMPTS))
    expected = open_vocabulary.similarity_maps(model, captured, texts, "proxyclip", proxy)[0].numpy()
    assert expected.shape[1:] == proxy.grid_size != captured.grid_size
    shown = _heatmaps(app, r"^Where each prompt is.*ProxyCLIP")
    np.testing.assert_allclose(np.stack(shown).reshape(expected.shape), expected, atol=1e-5, rtol=0)


def test_a_method_not_defined_for_the_tower_is_a_sentence_on_the_page(folders):
    app = open_words_app(folders["clip"], "views/attention.py")
    app.selectbox(key="word_method").set_value("clip_surgery").run()  # a 2-block CLIP: it needs 6
    assert not app.exception and errors(app) == []
    (said,) = [warning.value for warning in app.warning if warning.value.startswith("CLIP Surgery cannot map")]
    assert "6" in said and "\n" not in said
