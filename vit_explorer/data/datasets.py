"""Datasets as in-memory uint8 tensors, and a loader that batches and augments them on the device.

The built-in ``shapes`` dataset needs no download: every image is rendered from its (seed, index)
with vectorised signed-distance math, so a whole batch is drawn in a few tensor operations.
CIFAR-10, MNIST and FashionMNIST come from torchvision; ``folder:PATH`` reads a person's own
folder of class sub-folders (torchvision's ImageFolder layout).
"""
from __future__ import annotations

import dataclasses
import functools
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from einops import rearrange
from PIL import Image

# Six outlines a 4x4-patch ViT tells apart within a minute of CPU training; a star (too like the
# cross) and a heart (too like a rotated square) made it need several times more images.
SHAPE_CLASSES = ("circle", "square", "triangle", "cross", "ring", "crescent")
SHAPES_TEST_SEED = 20_240_611  # the test stream is one fixed set, whatever the training seed
DEFAULT_DATA_ROOT = Path(os.environ.get("VIT_EXPLORER_DATA", "~/.cache/vit_explorer/data")).expanduser()

TORCHVISION_DATASETS = {
    # name: (torchvision class, display name, native size, mean, std); grayscale stats are
    # repeated over 3 channels because grayscale images are fed to the model as RGB.
    "cifar10": ("CIFAR10", "CIFAR-10", 32, (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "mnist": ("MNIST", "MNIST", 28, (0.1307,) * 3, (0.3081,) * 3),
    "fashionmnist": ("FashionMNIST", "FashionMNIST", 28, (0.2860,) * 3, (0.3530,) * 3),
}
DATASET_NAMES = ("shapes", *TORCHVISION_DATASETS, "folder:PATH")
FOLDER_IMAGE_SIZE = 64


class DatasetError(ValueError):
    """A dataset that cannot be used: unknown name, missing folder, failed download."""


@dataclass
class ImageDataset:
    """A whole split in memory: uint8 images (N, 3, H, W) and int64 labels (N,)."""

    images: torch.Tensor
    labels: torch.Tensor
    class_names: tuple[str, ...]
    mean: tuple[float, ...]
    std: tuple[float, ...]

    def __len__(self) -> int:
        return self.images.shape[0]

    @property
    def image_size(self) -> tuple[int, int]:
        return tuple(self.images.shape[-2:])


# --- shapes: a counter-based hash gives each (seed, split, index, slot) its own random number ---

_MASK_SHIFT = {s: (1 << (64 - s)) - 1 for s in (27, 30, 31, 40)}


def _int64(constant: int) -> int:
    return constant - (1 << 64) if constant >= 1 << 63 else constant


_GOLDEN = _int64(0x9E3779B97F4A7C15)
_MIX1 = _int64(0xBF58476D1CE4E5B9)
_MIX2 = _int64(0x94D049BB133111EB)


def _shift_right(x: torch.Tensor, shift: int) -> torch.Tensor:
    # torch's >> is arithmetic on int64; masking makes it the logical shift the hash needs.
    return (x >> shift) & _MASK_SHIFT[shift]


def _splitmix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser; int64 multiplication wraps around like uint64 would."""
    x = (x ^ _shift_right(x, 30)) * _MIX1
    x = (x ^ _shift_right(x, 27)) * _MIX2
    return x ^ _shift_right(x, 31)


def _sample_keys(indices: torch.Tensor, seed: int, split: str) -> torch.Tensor:
    stream = _splitmix(torch.tensor([seed * 2 + (split == "test")], dtype=torch.int64, device=indices.device))
    return _splitmix(stream + indices.to(torch.int64) * _GOLDEN)  # (B,)


def _uniform(keys: torch.Tensor, count: int, offset: int) -> torch.Tensor:
    """(B, count) floats in [0, 1), a pure function of each sample's key and the slot number."""
    slots = torch.arange(offset, offset + count, dtype=torch.int64, device=keys.device)
    bits = _splitmix(keys[:, None] + (slots + 1) * _GOLDEN)
    return _shift_right(bits, 40).to(torch.float32) * 2.0**-24


def _box(px: torch.Tensor, py: torch.Tensor, half_x: float, half_y: float) -> torch.Tensor:
    dx, dy = px.abs() - half_x, py.abs() - half_y
    outside = torch.hypot(dx.clamp(min=0), dy.clamp(min=0))
    return outside + torch.maximum(dx, dy).clamp(max=0)


def _triangle(px: torch.Tensor, py: torch.Tensor, half_side: float) -> torch.Tensor:
    # Inigo Quilez's exact equilateral-triangle distance.
    k = math.sqrt(3.0)
    px = px.abs() - half_side
    py = py + half_side / k
    fold = px + k * py > 0
    px, py = (
        torch.where(fold, (px - k * py) / 2, px),
        torch.where(fold, (-k * px - py) / 2, py),
    )
    px = px - px.clamp(-2 * half_side, 0)
    return -torch.hypot(px, py) * torch.sign(py)


def _shape_distance(label: int, px: torch.Tensor, py: torch.Tensor) -> torch.Tensor:
    """Signed distance (negative inside) in units of the shape's radius."""
    name = SHAPE_CLASSES[label]
    if name == "circle":
        return torch.hypot(px, py) - 0.9
    if name == "square":
        return _box(px, py, 0.75, 0.75)
    if name == "triangle":
        return _triangle(px, py, 0.95)
    if name == "cross":
        return torch.minimum(_box(px, py, 0.95, 0.28), _box(px, py, 0.28, 0.95))
    if name == "ring":
        return (torch.hypot(px, py) - 0.72).abs() - 0.24
    return torch.maximum(torch.hypot(px, py) - 0.95, 0.8 - torch.hypot(px - 0.45, py))  # crescent


def _segment_distance(px, py, ax, ay, bx, by) -> torch.Tensor:
    abx, aby = bx - ax, by - ay
    t = (((px - ax) * abx + (py - ay) * aby) / (abx**2 + aby**2 + 1e-6)).clamp(0, 1)
    return torch.hypot(px - ax - t * abx, py - ay - t * aby)


@functools.lru_cache(maxsize=8)
def _noise_texture(height: int, width: int, device: torch.device) -> torch.Tensor:
    """(3, H + 256, W + 256) uniform noise in [-0.5, 0.5), the same in every process."""
    generator = torch.Generator().manual_seed(0)
    return (torch.rand(3, height + 256, width + 256, generator=generator) - 0.5).to(device)


CLUTTER_LINES = 4
LINE_OPACITY = 0.7
NOISE_GRID = 4
BLOTCH_AMPLITUDE = 0.22
NOISE_AMPLITUDE = 0.16
SHAPE_RADIUS = (0.34, 0.44)  # smallest, largest radius as a fraction of the shorter side


def render_shapes(
    indices: torch.Tensor, image_size: int | tuple[int, int] = 32, seed: int = 0, split: str = "train"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Render shapes images ``indices`` of a stream: uint8 (B, 3, H, W) and labels (B,).

    Each image holds one shape of random colour, size, rotation and position on a noisy
    background of colour gradients, blotches and thin lines; the shape is always lighter or
    darker than the background, so that it can be found. Labels cycle through the classes, so
    every class has the same number of images up to one.
    """
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', not {split!r}")
    height, width = (image_size, image_size) if isinstance(image_size, int) else image_size
    device = indices.device
    keys = _sample_keys(indices, seed, split)
    batch = keys.shape[0]
    labels = indices.to(torch.int64) % len(SHAPE_CLASSES)
    u = _uniform(keys, 16 + 7 * CLUTTER_LINES, 0)  # per-image parameters
    unit = min(height, width)

    # Pixel centres in units of the shorter side, (1, H, W) broadcast against (B, 1, 1).
    ys = ((torch.arange(height, device=device) + 0.5) / unit)[None, :, None]
    xs = ((torch.arange(width, device=device) + 0.5) / unit)[None, None, :]
    column = lambda values: values[:, None, None]  # noqa: E731

    # Light shape on a dark background or the other way round, each colour drawn in its band.
    light = column(u[:, 0] < 0.5)
    shape_colour = 0.55 + 0.45 * u[:, 1:4]  # (B, 3)
    background = 0.42 * u[:, 4:10].view(batch, 2, 3)  # (B, 2, 3): two gradient end colours
    shape_colour = torch.where(light.view(batch, 1), shape_colour, 1.0 - shape_colour)
    background = torch.where(light.view(batch, 1, 1), background, 1.0 - background)

    angle = 2 * math.pi * u[:, 10]
    ramp = column(torch.cos(angle)) * (xs - width / unit / 2) + column(torch.sin(angle)) * (
        ys - height / unit / 2
    )
    ramp = (ramp * 0.8 + 0.5).clamp(0, 1)[:, None]  # (B, 1, H, W)
    image = background[:, 0, :, None, None] * (1 - ramp) + background[:, 1, :, None, None] * ramp

    # Blotches: a coarse grid of random values, smoothly upsampled.
    coarse = _uniform(keys, 3 * NOISE_GRID * NOISE_GRID, 1000)
    coarse = rearrange(coarse, "b (c h w) -> b c h w", c=3, h=NOISE_GRID) - 0.5
    blotches = F.interpolate(coarse, size=(height, width), mode="bicubic", align_corners=False)
    image = image + BLOTCH_AMPLITUDE * blotches

    # Thin lines in colours between the background's and the shape's: clutter, not a shape.
    lines = rearrange(u[:, 16:], "b (k p) -> k p b", k=CLUTTER_LINES)
    for ax, ay, bx, by, *mix in lines:
        ax, bx = (column(v * width / unit) for v in (ax, bx))
        ay, by = (column(v * height / unit) for v in (ay, by))
        coverage = (1.2 - _segment_distance(xs, ys, ax, ay, bx, by) * unit).clamp(0, 1)[:, None]
        mix = 0.3 + 0.4 * torch.stack(mix, 1)  # (B, 3)
        colour = background[:, 0] + (shape_colour - background[:, 0]) * mix
        image = image + LINE_OPACITY * coverage * (colour[:, :, None, None] - image)

    # The shape: rotate and scale the pixel grid into its frame, then anti-alias its distance.
    smallest, largest = SHAPE_RADIUS
    radius = (smallest + (largest - smallest) * u[:, 11]) * min(height, width) / unit  # (B,)
    cx = radius + (width / unit - 2 * radius) * u[:, 12]
    cy = radius + (height / unit - 2 * radius) * u[:, 13]
    cos, sin = torch.cos(2 * math.pi * u[:, 14]), torch.sin(2 * math.pi * u[:, 14])
    dx, dy = xs - column(cx), ys - column(cy)
    px = (column(cos) * dx + column(sin) * dy) / column(radius)  # (B, H, W)
    py = (column(cos) * dy - column(sin) * dx) / column(radius)
    distance = torch.empty_like(px)
    for label in labels.unique().tolist():
        chosen = labels == label
        distance[chosen] = _shape_distance(label, px[chosen], py[chosen])
    coverage = (0.5 - distance * column(radius) * unit).clamp(0, 1)[:, None]  # (B, 1, H, W)
    image = image + coverage * (shape_colour[:, :, None, None] - image)

    # Pixel noise: a window, at a random offset, of one fixed noise texture (hashing every
    # pixel would cost more than all the rest of the rendering).
    texture = _noise_texture(height, width, device)
    offset = (u[:, 15] * (texture.shape[1] - height) * (texture.shape[2] - width)).long()
    rows = (offset // (texture.shape[2] - width))[:, None] + torch.arange(height, device=device)
    cols = (offset % (texture.shape[2] - width))[:, None] + torch.arange(width, device=device)
    noise = texture[:, rows[:, :, None], cols[:, None, :]]  # (3, B, H, W)
    image = image + NOISE_AMPLITUDE * rearrange(noise, "c b h w -> b c h w")
    return (image.clamp(0, 1) * 255).round().to(torch.uint8), labels


def shapes_dataset(
    size: int, image_size: int | tuple[int, int] = 32, seed: int = 0, split: str = "train",
    device: torch.device | str = "cpu", chunk: int = 256, start: int = 0,
) -> ImageDataset:
    """Images ``start`` to ``start + size`` of a shapes stream, rendered in chunks on ``device``."""
    if size < 1:
        raise DatasetError(f"the shapes dataset needs at least 1 image, not {size}")
    end = start + size
    parts = [
        render_shapes(torch.arange(begin, min(begin + chunk, end), device=device), image_size, seed, split)
        for begin in range(start, end, chunk)
    ]
    return ImageDataset(
        images=torch.cat([images for images, _ in parts]),
        labels=torch.cat([labels for _, labels in parts]),
        class_names=SHAPE_CLASSES,
        mean=(0.5, 0.5, 0.5),
        std=(0.25, 0.25, 0.25),
    )


def shapes_sample(
    index: int, image_size: int | tuple[int, int] = 32, split: str = "test", seed: int = SHAPES_TEST_SEED
) -> tuple[Image.Image, str]:
    """One shapes image as an RGB PIL image and its class name (for sample pictures)."""
    images, labels = render_shapes(torch.tensor([index]), image_size, seed, split)
    pixels = rearrange(images[0], "c h w -> h w c").numpy()
    return Image.fromarray(np.ascontiguousarray(pixels), mode="RGB"), SHAPE_CLASSES[int(labels[0])]


# --- torchvision datasets and image folders ---


def _torchvision_dataset(name: str, train: bool, root: Path) -> ImageDataset:
    import torchvision.datasets as datasets

    class_name, display, _, mean, std = TORCHVISION_DATASETS[name]
    dataset_class = getattr(datasets, class_name)
    try:
        dataset = dataset_class(str(root), train=train, download=False)
    except RuntimeError:  # torchvision: "Dataset not found or corrupted"
        try:
            dataset = dataset_class(str(root), train=train, download=True)
        except Exception as error:
            raise DatasetError(
                f"could not download {display} (no internet?); put it in {root} or use --dataset shapes"
            ) from error
    data = torch.as_tensor(np.asarray(dataset.data))
    if data.ndim == 3:  # grayscale (N, H, W) -> RGB, as the model and the app work in RGB
        data = data[:, None].expand(-1, 3, -1, -1)
    else:  # (N, H, W, C)
        data = rearrange(data, "n h w c -> n c h w")
    return ImageDataset(
        images=data.contiguous(),
        labels=torch.as_tensor(np.asarray(dataset.targets), dtype=torch.int64),
        class_names=tuple(dataset.classes),
        mean=mean,
        std=std,
    )


def _folder_dataset(path: Path, image_size: tuple[int, int]) -> ImageDataset:
    import torchvision.datasets as datasets
    from torchvision.transforms import v2

    if not path.is_dir():
        raise DatasetError(f"image folder {path} does not exist")
    try:
        folder = datasets.ImageFolder(str(path))
    except FileNotFoundError as error:
        raise DatasetError(
            f"{path} has no class sub-folders with images; expected {path}/<class name>/<image>"
        ) from error
    if len(folder.classes) < 2:
        raise DatasetError(f"{path} needs at least 2 class sub-folders, found {len(folder.classes)}")
    to_tensor = v2.Compose([
        v2.ToImage(),
        v2.Resize(min(image_size), antialias=True),
        v2.CenterCrop(image_size),
        v2.ToDtype(torch.uint8, scale=True),
    ])
    images = [to_tensor(folder.loader(file).convert("RGB")) for file, _ in folder.samples]
    return ImageDataset(
        images=torch.stack(images),
        labels=torch.tensor(folder.targets, dtype=torch.int64),
        class_names=tuple(folder.classes),
        mean=(0.485, 0.456, 0.406),
        std=(0.229, 0.224, 0.225),
    )


def _split_folder(dataset: ImageDataset, train: bool, test_fraction: float = 0.2) -> ImageDataset:
    """A fixed, class-stratified train/test split of one folder (every 5th image per class)."""
    keep = torch.zeros(len(dataset), dtype=torch.bool)
    step = round(1 / test_fraction)
    for label in range(len(dataset.class_names)):
        members = (dataset.labels == label).nonzero().flatten()
        keep[members[::step]] = True
    keep = ~keep if train else keep
    return dataclasses.replace(dataset, images=dataset.images[keep], labels=dataset.labels[keep])


def native_image_size(name: str) -> int:
    """The image size a dataset comes in (shapes can be rendered at any size; 32 by default)."""
    if name == "shapes":
        return 32
    if name in TORCHVISION_DATASETS:
        return TORCHVISION_DATASETS[name][2]
    check_dataset_name(name)
    return FOLDER_IMAGE_SIZE


def check_dataset_name(name: str) -> None:
    if name == "shapes" or name in TORCHVISION_DATASETS:
        return
    if name.startswith("folder:") and len(name) > len("folder:"):
        return
    raise DatasetError(f"unknown dataset {name!r}; choose one of {', '.join(DATASET_NAMES)}")


def load_dataset(
    name: str,
    split: str,
    *,
    image_size: int | tuple[int, int] | None = None,
    root: str | Path = DEFAULT_DATA_ROOT,
    seed: int = 0,
    size: int | None = None,
    device: torch.device | str = "cpu",
) -> ImageDataset:
    """One split ("train" or "test") of a dataset, resized to ``image_size`` if given.

    ``name`` is "shapes", "cifar10", "mnist", "fashionmnist" or "folder:PATH". For shapes,
    ``size`` images are rendered from the training ``seed`` (train) or the fixed test stream;
    for the others ``size`` keeps the first images of the split.
    """
    check_dataset_name(name)
    if split not in ("train", "test"):
        raise DatasetError(f"split must be 'train' or 'test', not {split!r}")
    size_hw = None
    if image_size is not None:
        size_hw = (image_size, image_size) if isinstance(image_size, int) else tuple(image_size)
    if name == "shapes":
        stream_seed = seed if split == "train" else SHAPES_TEST_SEED
        default_size = 16_000 if split == "train" else 2_000
        return shapes_dataset(size or default_size, size_hw or 32, stream_seed, split, device)
    if name in TORCHVISION_DATASETS:
        dataset = _torchvision_dataset(name, split == "train", Path(root).expanduser())
    else:
        folder_size = size_hw or (FOLDER_IMAGE_SIZE, FOLDER_IMAGE_SIZE)
        folder = _folder_dataset(Path(name[len("folder:") :]).expanduser(), folder_size)
        dataset = _split_folder(folder, split == "train")
    if size is not None:
        dataset = dataclasses.replace(dataset, images=dataset.images[:size], labels=dataset.labels[:size])
    if size_hw is not None and dataset.image_size != size_hw:
        resized = F.interpolate(
            dataset.images.float(), size=size_hw, mode="bilinear", antialias=True, align_corners=False
        )
        dataset.images = resized.round().clamp(0, 255).to(torch.uint8)
    dataset.images = dataset.images.to(device)
    dataset.labels = dataset.labels.to(device)
    return dataset


# --- batching and augmentation on the device ---


def augment(images: torch.Tensor, generator: torch.Generator, padding: int) -> torch.Tensor:
    """Per-image random crop with zero padding and horizontal flip of a (B, C, H, W) batch.

    torchvision's v2 transforms draw one set of parameters per call, i.e. per batch; drawing
    them per image and cropping with one gather keeps the whole batch on the device instead.
    """
    batch, _, height, width = images.shape
    device = images.device
    if padding > 0:
        padded = F.pad(images, (padding,) * 4)
        offsets = torch.randint(0, 2 * padding + 1, (2, batch), generator=generator, device=device)
        rows = offsets[0][:, None] + torch.arange(height, device=device)  # (B, H)
        cols = offsets[1][:, None] + torch.arange(width, device=device)  # (B, W)
        batch_index = torch.arange(batch, device=device)[:, None, None]
        images = padded.permute(0, 2, 3, 1)[batch_index, rows[:, :, None], cols[:, None, :]]  # (B, H, W, C)
        images = images.permute(0, 3, 1, 2)
    flip = torch.rand(batch, generator=generator, device=device) < 0.5
    return torch.where(flip[:, None, None, None], images.flip(-1), images)


class DeviceLoader:
    """Batches of a dataset that lives on the device: normalized float images and labels.

    Training batches are a fresh permutation per epoch (a pure function of seed and epoch, so
    that a resumed run sees the same batches), sharded over ``world_size`` ranks like
    DistributedSampler, and augmented per image. Evaluation batches cover the shard in order.
    """

    def __init__(
        self, dataset: ImageDataset, batch_size: int, *, train: bool, seed: int = 0,
        augment: bool = True, rank: int = 0, world_size: int = 1,
    ):
        self.dataset = dataset
        self.batch_size = batch_size
        self.train = train
        self.seed = seed
        self.augment = augment
        # Pad-and-crop by an eighth of the image, like the 4 pixels usual for 32x32 CIFAR-10.
        self.padding = min(dataset.image_size) // 8
        self.rank = rank
        self.world_size = world_size
        device = dataset.images.device
        self.mean = torch.tensor(dataset.mean, device=device).view(1, -1, 1, 1) * 255
        self.std = torch.tensor(dataset.std, device=device).view(1, -1, 1, 1) * 255

    def __len__(self) -> int:
        if self.train:
            return len(self.dataset) // (self.batch_size * self.world_size)
        return math.ceil(len(self._eval_indices()) / self.batch_size)

    def _eval_indices(self) -> range:
        return range(self.rank, len(self.dataset), self.world_size)

    def normalize(self, images: torch.Tensor) -> torch.Tensor:
        return (images.float() - self.mean) / self.std

    def _generator(self, *parts: int) -> torch.Generator:
        generator = torch.Generator(device=self.dataset.images.device)
        generator.manual_seed(hash((self.seed, *parts)) & 0x7FFF_FFFF_FFFF_FFFF)
        return generator

    def epoch(self, epoch: int, start: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The batches of one epoch, beginning at batch ``start`` (to resume mid-epoch)."""
        images, labels = self.dataset.images, self.dataset.labels
        if not self.train:
            indices = torch.tensor(self._eval_indices(), device=images.device)
            for begin in range(start * self.batch_size, len(indices), self.batch_size):
                chosen = indices[begin : begin + self.batch_size]
                yield self.normalize(images[chosen]), labels[chosen]
            return
        order = torch.randperm(len(self.dataset), generator=self._generator(epoch), device=images.device)
        per_step = self.batch_size * self.world_size
        for step in range(start, len(self)):
            # Every rank draws the same permutation and takes its own slice of each global batch.
            chosen = order[step * per_step + self.rank : (step + 1) * per_step : self.world_size]
            batch = images[chosen]
            if self.augment:
                batch = augment(batch, self._generator(epoch, step, self.rank), self.padding)
            yield self.normalize(batch), labels[chosen]
