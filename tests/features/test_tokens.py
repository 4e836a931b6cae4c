"""What an SAE reads: its images by index, a layer's tokens (the capture's, fewer blocks run) and
the model's input."""
import re

import pytest
import torch
from PIL import Image

import vit_explorer as vx
from vit_explorer.features.tokens import ImageSource, layer_tokens, model_input, source_tokens, tokens_per_image

from helpers import VARIANTS, counting_blocks, randomize, tiny_config
from rotary import ROTARY, rotary_model


@pytest.mark.parametrize("variant", [*VARIANTS, *ROTARY])
def test_layer_tokens_are_the_captures_and_run_no_block_above(variant, monkeypatch):
    model = rotary_model(variant) if variant in ROTARY else randomize(vx.ViT(tiny_config(depth=3, **VARIANTS[variant])))
    x = torch.randn(2, 3, *model.config.img_size, generator=torch.Generator().manual_seed(0))
    cap = vx.capture(model, x, layers=())
    ran = counting_blocks(monkeypatch, model)
    for layer in range(model.config.depth):
        ran.clear()
        patches = layer_tokens(model, x, layer)
        assert ran == list(range(layer + 1))
        assert torch.allclose(patches, cap.tokens[:, layer + 1, cap.num_prefix_tokens:], atol=1e-5)
        assert torch.allclose(layer_tokens(model, x, layer, prefix_tokens=True), cap.tokens[:, layer + 1], atol=1e-5)
    assert patches.shape[1] == tokens_per_image(model) and patches.dtype == torch.float32
    with pytest.raises(ValueError, match="layer 3 does not exist; the model has layers 0..2"):
        layer_tokens(model, x, 3)


def test_model_input_is_preprocess_of_each_image():
    model = vx.ViT(tiny_config(mean=(0.2, 0.4, 0.6), std=(0.5, 0.25, 0.3)))
    images = ImageSource("shapes", 4, 16).images(torch.arange(4))
    pictures = [Image.fromarray(image.permute(1, 2, 0).numpy()) for image in images]
    expected = torch.cat([vx.preprocess(picture, model.config) for picture in pictures])
    assert torch.allclose(model_input(model, images), expected, atol=1e-6)
    larger = ImageSource("shapes", 4, 32).images(torch.arange(4))  # resized to the model's 16 x 16
    assert model_input(model, larger).shape == (4, 3, 16, 16)


def test_shapes_are_addressable_by_index_and_shared_between_ranks():
    source = ImageSource("shapes", 10, (16, 24), seed=3)
    everything = torch.cat([images for _, images in source.batches(4)])
    assert everything.shape == (10, 3, 16, 24) and everything.dtype == torch.uint8
    assert torch.equal(source.images(torch.tensor([7, 2, 7])), everything[[7, 2, 7]])
    assert torch.equal(everything, vx.load_dataset("shapes", "train", image_size=(16, 24), size=10, seed=3).images)
    shares = [torch.cat([indices for indices, _ in source.batches(3, rank, 3)]) for rank in range(3)]
    assert sorted(torch.cat(shares).tolist()) == list(range(10))
    assert ImageSource.from_dict(source.to_dict()) == source and source.to_dict()["image_size"] == [16, 24]
    other_seed = ImageSource("shapes", 10, (16, 24), seed=4).images(torch.tensor([0]))
    assert not torch.equal(other_seed, everything[:1])


def test_photos_and_folders(tmp_path):
    photos = ImageSource("photos", 100, 24)
    assert len(photos) == 4  # as many as there are
    assert photos.images(torch.tensor([3])).shape == (1, 3, 24, 24)
    for name, colour in (("red", (255, 0, 0)), ("blue", (0, 0, 255))):
        (tmp_path / name).mkdir()
        for number in range(5):
            Image.new("RGB", (20, 20), colour).save(tmp_path / name / f"{number}.png")
    folder = ImageSource(f"folder:{tmp_path}", 100, 8)
    assert len(folder) == 8  # the folder's training split: 4 of each class's 5
    assert folder.images(torch.arange(8)).shape == (8, 3, 8, 8)


def test_source_tokens_are_image_by_image():
    model = randomize(vx.ViT(tiny_config()))
    source = ImageSource("shapes", 6, 16)
    indices = torch.tensor([5, 0, 3])
    tokens = source_tokens(model, source, indices, 1, False, batch_size=2, device="cpu")  # (3 * P, D)
    expected = layer_tokens(model, model_input(model, source.images(indices)), 1)  # (3, P, D)
    assert torch.allclose(tokens, expected.flatten(0, 1), atol=1e-6)


@pytest.mark.parametrize("name, message", [
    ("imagenet",
     "unknown image set 'imagenet'; choose one of shapes, photos, cifar10, mnist, fashionmnist, folder:PATH"),
    ("folder:", "unknown image set 'folder:'"),
])
def test_a_bad_image_set_is_one_sentence(name, message):
    with pytest.raises(vx.DatasetError, match="^" + re.escape(message)):
        ImageSource(name, 4, 16)


def test_an_image_outside_the_set_is_refused():
    with pytest.raises(vx.DatasetError, match=r"^this image set has images 0..3, not 4$"):
        ImageSource("shapes", 4, 16).images(torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="count must be a whole number of at least 1, not 0"):
        ImageSource("shapes", 0, 16)
