"""Datasets: the shapes renderer, torchvision downloads, image folders, the device loader."""
import urllib.error

import pytest
import torch
import torchvision
from PIL import Image

from vit_explorer.data import datasets as data


def test_shapes_are_a_pure_function_of_seed_and_index():
    images, labels = data.render_shapes(torch.arange(10, 20), 32, seed=3)
    # The same images come out one at a time, in another batch, in another order.
    for offset, index in enumerate(range(10, 20)):
        alone, label = data.render_shapes(torch.tensor([index]), 32, seed=3)
        assert torch.equal(alone[0], images[offset]) and label.item() == labels[offset].item()
    reordered, _ = data.render_shapes(torch.arange(19, 9, -1), 32, seed=3)
    assert torch.equal(reordered.flip(0), images)


def test_shapes_streams_differ_by_seed_and_split():
    indices = torch.arange(32)
    train, _ = data.render_shapes(indices, 32, seed=0, split="train")
    assert not torch.equal(train, data.render_shapes(indices, 32, seed=1, split="train")[0])
    assert not torch.equal(train, data.render_shapes(indices, 32, seed=0, split="test")[0])
    # Different images, not merely different noise: most pixels move by more than the noise.
    other = data.render_shapes(indices, 32, seed=0, split="test")[0]
    assert (train.float() - other.float()).abs().mean() > 20


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_shapes_render_on_cuda_as_on_the_cpu():
    # A run on a GPU renders its data there: the same images, up to a pixel value's rounding.
    on_cpu, labels = data.render_shapes(torch.arange(64), 32, seed=2)
    on_gpu, gpu_labels = data.render_shapes(torch.arange(64, device="cuda"), 32, seed=2)
    assert on_gpu.is_cuda and torch.equal(gpu_labels.cpu(), labels)
    difference = (on_gpu.cpu().int() - on_cpu.int()).abs()
    assert difference.max() <= 1 and (difference > 0).float().mean() < 0.01


@pytest.mark.parametrize("size", [32, (24, 40), 64])
def test_shapes_rendering_shape_dtype_and_balance(size):
    images, labels = data.render_shapes(torch.arange(96), size)
    height, width = (size, size) if isinstance(size, int) else size
    assert images.shape == (96, 3, height, width) and images.dtype == torch.uint8
    assert labels.dtype == torch.int64
    counts = torch.bincount(labels, minlength=len(data.SHAPE_CLASSES))
    assert counts.tolist() == [96 // len(data.SHAPE_CLASSES)] * len(data.SHAPE_CLASSES)
    # Images use the colour range (not blank) and vary from one to the next.
    assert images.float().std() > 30
    assert len({bytes(image.numpy()) for image in images}) == 96


def test_the_shape_stands_out_from_its_background():
    # Each shape is much lighter or darker than its surroundings: the brightest and darkest
    # pixels of every image are far apart, whatever the colours drawn.
    images, _ = data.render_shapes(torch.arange(200), 64)
    brightness = images.float().mean(1).flatten(1)
    spread = brightness.quantile(0.97, dim=1) - brightness.quantile(0.03, dim=1)
    assert (spread > 60).all()


def test_shapes_sample_is_a_pil_image_with_its_class():
    image, name = data.shapes_sample(3, image_size=48)
    assert isinstance(image, Image.Image) and image.size == (48, 48) and image.mode == "RGB"
    assert name == data.SHAPE_CLASSES[3]
    again, _ = data.shapes_sample(3, image_size=48)
    assert again.tobytes() == image.tobytes()


def test_shapes_dataset_split_uses_a_fixed_test_stream():
    first = data.load_dataset("shapes", "test", size=16, seed=0)
    second = data.load_dataset("shapes", "test", size=16, seed=99)
    assert torch.equal(first.images, second.images)  # the test set ignores the training seed
    train = data.load_dataset("shapes", "train", size=16, seed=0)
    assert not torch.equal(train.images, first.images)
    assert first.class_names == data.SHAPE_CLASSES and len(first.mean) == 3


def test_unknown_dataset_is_a_clear_error():
    with pytest.raises(data.DatasetError, match="unknown dataset 'imagenet'; choose one of shapes"):
        data.load_dataset("imagenet", "train")


def test_offline_download_says_what_to_do(monkeypatch, tmp_path):
    def no_network(self):
        raise urllib.error.URLError("Temporary failure in name resolution")

    monkeypatch.setattr(torchvision.datasets.CIFAR10, "download", no_network)
    with pytest.raises(data.DatasetError) as error:
        data.load_dataset("cifar10", "train", root=tmp_path)
    assert str(error.value) == (
        f"could not download CIFAR-10 (no internet?); put it in {tmp_path} or use --dataset shapes"
    )


def test_grayscale_datasets_become_rgb(monkeypatch, tmp_path):
    class FakeMNIST:
        def __init__(self, root, train, download):
            self.data = torch.arange(4 * 28 * 28, dtype=torch.uint8).view(4, 28, 28)
            self.targets = torch.tensor([0, 1, 2, 3])
            self.classes = [str(i) for i in range(10)]

    monkeypatch.setattr(torchvision.datasets, "MNIST", FakeMNIST)
    mnist = data.load_dataset("mnist", "test", root=tmp_path)
    assert mnist.images.shape == (4, 3, 28, 28)
    assert torch.equal(mnist.images[:, 0], mnist.images[:, 2])
    assert mnist.mean == (0.1307,) * 3
    resized = data.load_dataset("mnist", "test", root=tmp_path, image_size=32)
    assert resized.images.shape == (4, 3, 32, 32)


def _image_folder(root, classes=("cats", "dogs"), per_class=5):
    for number, name in enumerate(classes):
        (root / name).mkdir(parents=True)
        for index in range(per_class):
            colour = (40 * number, 10 * index, 200)
            Image.new("RGB", (50 + index, 40), colour).save(root / name / f"{index}.png")
    return root


def test_image_folder_loads_resized_and_split(tmp_path):
    folder = _image_folder(tmp_path / "pets")
    train = data.load_dataset(f"folder:{folder}", "train", image_size=16)
    test = data.load_dataset(f"folder:{folder}", "test", image_size=16)
    assert train.class_names == ("cats", "dogs")
    assert train.images.shape == (8, 3, 16, 16) and test.images.shape == (2, 3, 16, 16)
    assert sorted(test.labels.tolist()) == [0, 1]  # every class is in the test split
    # Pixels survive: a solid image stays its colour after resizing.
    assert train.images[0, 2].float().mean().round() == 200


def test_image_folder_errors(tmp_path):
    with pytest.raises(data.DatasetError, match="does not exist"):
        data.load_dataset(f"folder:{tmp_path / 'missing'}", "train")
    (tmp_path / "empty").mkdir()
    with pytest.raises(data.DatasetError, match="has no class sub-folders with images"):
        data.load_dataset(f"folder:{tmp_path / 'empty'}", "train")
    _image_folder(tmp_path / "one", classes=("only",))
    with pytest.raises(data.DatasetError, match="needs at least 2 class sub-folders"):
        data.load_dataset(f"folder:{tmp_path / 'one'}", "train")


def test_device_loader_shards_an_epoch_like_distributed_sampler():
    dataset = data.load_dataset("shapes", "train", size=64)
    # Tag every image with its index in one pixel to follow it through the loader.
    dataset.images[:, :, 0, 0] = torch.arange(64, dtype=torch.uint8)[:, None]
    dataset.images[:, :, :, :] = dataset.images[:, :, :1, :1]
    seen = []
    for rank in range(2):
        loader = data.DeviceLoader(dataset, 8, train=True, seed=5, augment=False, rank=rank, world_size=2)
        assert len(loader) == 4
        for images, labels in loader.epoch(1):
            pixel = images[:, 0, 0, 0] * dataset.std[0] * 255 + dataset.mean[0] * 255
            indices = pixel.round().long()
            assert torch.equal(labels, indices % len(data.SHAPE_CLASSES))
            seen += indices.tolist()
    assert sorted(seen) == list(range(64))  # the two ranks cover the epoch once, together
    loader = data.DeviceLoader(dataset, 8, train=True, seed=5, augment=False)
    full = [labels for _, labels in loader.epoch(1)]
    resumed = [labels for _, labels in loader.epoch(1, start=5)]
    assert all(torch.equal(a, b) for a, b in zip(full[5:], resumed))  # resuming mid-epoch


def test_augment_crops_and_flips_each_image_on_its_own():
    images = torch.arange(16, dtype=torch.float32).view(1, 1, 4, 4).repeat(64, 3, 1, 1)
    out = data.augment(images, torch.Generator().manual_seed(0), padding=1)
    assert out.shape == images.shape
    distinct = {tuple(image[0].flatten().tolist()) for image in out}
    assert len(distinct) > 8  # parameters are drawn per image, not per batch
    # Every output is a shifted (and possibly mirrored) window of its zero-padded input.
    padded = torch.nn.functional.pad(images[0, 0], (1, 1, 1, 1))
    windows = {
        tuple(window.flatten().tolist())
        for dy in range(3) for dx in range(3)
        for window in (padded[dy : dy + 4, dx : dx + 4], padded[dy : dy + 4, dx : dx + 4].flip(-1))
    }
    assert distinct <= windows
