"""A trained model tested after its training: a checkpoint on a dataset's test split, at another
patch size or image size (learned positions resampled, rotary ones following the grid), and at
several image sizes side by side (the Train page's learned-against-rotary experiment)."""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ..data.datasets import DEFAULT_DATA_ROOT, DeviceLoader, load_dataset
from ..model.config import ViTConfig
from ..model.devices import resolve_device
from ..model.vit import ViT
from ..weights import load_model, resize_model
from .train import EVAL_BATCH, TrainingError, evaluate


def at_image_size(model: ViT, image_size: int | tuple[int, int]) -> ViT:
    """``model`` for inputs of ``image_size``, sharing its weights (to run, not to train; the
    original is untouched): learned position embeddings are resampled to the new grid
    (resize_model); rotary positions follow any grid, so only the config's size changes."""
    return resize_model(model, image_size=image_size, share_weights=True).train(model.training)


def accuracy_on_test_split(
    model: ViT, dataset: str = "shapes", *, data_root: str | Path | None = None, test_size: int | None = None,
    batch_size: int = EVAL_BATCH,
) -> tuple[float, int]:
    """(accuracy, number of test images) of ``model`` on a dataset's test split at the model's
    input size: shapes renders its test images at that size, other datasets' are resized to it."""
    config = model.config
    device = model.patch_embed.proj.weight.device
    root = Path(data_root).expanduser() if data_root else DEFAULT_DATA_ROOT
    test_set = load_dataset(dataset, "test", image_size=config.img_size, root=root, size=test_size, device=device)
    if config.num_classes != len(test_set.class_names) or (
        config.class_names is not None and tuple(config.class_names) != test_set.class_names
    ):
        known = ", ".join(config.class_names) if config.class_names else f"{config.num_classes} classes"
        raise TrainingError(f"the model knows {known}, but {dataset} has {', '.join(test_set.class_names)}")
    # Normalize as the model was trained, whatever the dataset's own statistics are.
    test_set.mean, test_set.std = config.mean, config.std
    _, accuracy = evaluate(model, DeviceLoader(test_set, batch_size, train=False))
    return accuracy, len(test_set)


# The input sizes a model is tested at after training, as multiples of its own (Train page).
IMAGE_SIZE_FACTORS = (1.0, 1.5, 2.0)


def scaled_image_sizes(config: ViTConfig, factors: Sequence[float] = IMAGE_SIZE_FACTORS) -> list[tuple[int, int]]:
    """(height, width) of ``config``'s input scaled by each factor, rounded to whole patches."""
    patch = config.patch_size
    return [
        tuple(max(patch, round(side * factor / patch) * patch) for side in config.img_size) for factor in factors
    ]


def accuracy_by_image_size(
    model: ViT, dataset: str, image_sizes: Sequence[int | tuple[int, int]], *, data_root: str | Path | None = None,
    test_size: int | None = None, batch_size: int = EVAL_BATCH,
) -> dict[tuple[int, int], float]:
    """(height, width) -> test accuracy of ``model`` on inputs of that size (at_image_size), the
    test images made at that size (accuracy_on_test_split): how well its positions carry to a grid it never saw."""
    sizes = [(size, size) if isinstance(size, int) else tuple(size) for size in image_sizes]
    return {
        size: accuracy_on_test_split(
            at_image_size(model, size), dataset, data_root=data_root, test_size=test_size, batch_size=batch_size
        )[0]
        for size in sizes
    }


def evaluate_checkpoint(
    weights: str | Path, dataset: str = "shapes", *, device: str = "auto", data_root: str | Path | None = None,
    test_size: int | None = None, batch_size: int = EVAL_BATCH, patch_size: int | None = None,
    image_size: int | None = None,
) -> tuple[float, int, ViTConfig]:
    """(test accuracy, number of test images, the config evaluated) of a checkpoint on a
    dataset's test split, at another patch size (FlexiViT resize) and/or image size if asked."""
    model = load_model(weights).to(resolve_device(device))
    if patch_size is not None:
        model = resize_model(model, patch_size=patch_size, image_size=image_size)
    elif image_size is not None:
        model = at_image_size(model, image_size)
    accuracy, count = accuracy_on_test_split(model, dataset, data_root=data_root, test_size=test_size, batch_size=batch_size)
    return accuracy, count, model.config
