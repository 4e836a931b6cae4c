"""python -m vit_explorer sae --evaluate FILE and --stability A B: the numbers of features.evaluation
and features.stability, printed; another model's checkpoint is refused in a sentence."""
import shutil

import pytest
import torch

import vit_explorer as vx
from vit_explorer.cli import main
from vit_explorer.features.evaluation import Evaluation, evaluate, held_out
from vit_explorer.features.sae import load_sae
from vit_explorer.features.tokens import ImageSource
from vit_explorer.features.train import SAETrainConfig, train_sae

from helpers import randomize, tiny_config


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sae")
    weights = folder / "tiny.safetensors"
    vx.save_model(randomize(vx.ViT(tiny_config(depth=3))), weights)
    config = SAETrainConfig(weights=str(weights), layer=1, images=16, epochs=1, batch_size=128, expansion=4, k=4,
                            device="cpu", out_dir=str(folder), evaluation_images=8)
    return weights, list(train_sae(config))[-1].path


def test_evaluate_prints_the_measures_of_held_out_images_and_writes_them_on_the_card(trained, tmp_path, capsys):
    weights, path = trained
    copy = tmp_path / "copy.safetensors"
    shutil.copy(path, copy)
    copy.chmod(0o644)
    assert main(["sae", "--evaluate", str(copy), "--images", "12", "--write-card"]) == 0  # the card names the model
    printed = capsys.readouterr().out
    model = vx.load_model(weights)
    sae, card = load_sae(copy, model)
    source = held_out(ImageSource("shapes", 16, (16, 16)), 12)
    expected = evaluate(sae, model, source, 1, False)
    assert f"copy.safetensors, layer 1, 12 held-out shapes images: {expected.summary()}" in printed
    assert Evaluation.from_card(card["evaluation"]) == expected
    assert ImageSource.from_dict(card["evaluation_images"]) == source
    assert torch.equal(sae.W_dec, load_sae(path)[0].W_dec)  # the tensors unchanged
    assert copy.stat().st_mode & 0o777 == 0o644  # as readable as it was


def test_stability_of_a_dictionary_and_its_copy_is_whole(trained, tmp_path, capsys):
    _, path = trained
    copy = tmp_path / "copy.safetensors"
    shutil.copy(path, copy)
    assert main(["sae", "--stability", path, str(copy), "--images", "4"]) == 0
    assert "stability: 100.0% of 128 latents have a partner at cosine >= 0.9" in capsys.readouterr().out


def test_another_models_weights_are_refused_in_a_sentence(trained, tmp_path, capsys):
    _, path = trained
    other = tmp_path / "other.safetensors"
    vx.save_model(vx.ViT(tiny_config(depth=3)), other)
    assert main(["sae", "--evaluate", path, "--weights", str(other)]) == 2
    assert capsys.readouterr().err == (
        "error: this dictionary was trained on another model than --weights (their digests differ)\n")
    assert main(["sae", "--evaluate", str(tmp_path / "none.safetensors")]) == 2
    assert "error: there is no file" in capsys.readouterr().err
