"""The same weights at every patch size, given the plan of what to run at each (app.costs makes
it and says what it costs): one image's pass per size, timed or not, and the accuracy on a
held-out batch. What the Patches page shows, computed in the server or in a job's worker alike."""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..data.datasets import SHAPES_TEST_SEED, ImageDataset, shapes_dataset
from ..model.vit import ViT
from ..weights import resize_model

# progress(fraction done, what runs now); it may raise to stop the comparison.
Progress = Callable[[float, str], None]


@dataclass(frozen=True)
class PlannedSize:
    """One patch size's share of the comparison: what :func:`predictions` and
    :func:`held_out_accuracy` run at it."""

    patch_size: int
    timed_passes: int  # after one warm-up pass of the image; 0: one untimed pass (already timed)
    held_out_images: int  # 0: no held-out batch
    cost: float = 1.0  # its share of the work (any unit), for the progress bar


def median_forward(model: ViT, x: torch.Tensor, passes: int, warm_up: bool = True) -> tuple[torch.Tensor, float]:
    """(class scores or features of the first image, milliseconds): a warm-up pass (allocations,
    first-call work), then the median of ``passes`` timed passes; ``x`` runs where the model is."""
    x = x.to(next(model.parameters()).device)
    times = []
    with torch.no_grad():
        output = model(x) if warm_up else None
        for _ in range(passes):
            started = time.perf_counter()
            output = model(x)
            if x.is_cuda:
                torch.cuda.synchronize()  # the pass has run, not only been queued
            times.append(time.perf_counter() - started)
    return output[0].float().cpu(), 1000 * statistics.median(times)


def _each_size(model: ViT, plan: Sequence[PlannedSize], progress: Progress | None, what: str):
    """The plan's sizes, reporting before each the share of the work done so far."""
    total = sum(planned.cost for planned in plan)
    done = 0.0
    for index, planned in enumerate(plan):
        if progress is not None:
            grid_h, grid_w = model.grid_size(planned.patch_size)
            tokens = model.config.num_prefix_tokens + grid_h * grid_w
            progress(done / total, f"{what} patch {planned.patch_size} ({tokens} tokens), {index + 1} of {len(plan)} ...")
        yield planned
        done += planned.cost
    if progress is not None:
        progress(1.0, "Done.")


def predictions(
    model: ViT, x: torch.Tensor, plan: Sequence[PlannedSize], progress: Progress | None = None,
    forward_ms: dict[int, float] | None = None,
) -> list[dict]:
    """Per planned patch size: grid, tokens, the forward time of the image ``x`` (1, C, H, W) (a
    warm-up pass, then the median of the plan's timed passes) and, for a model with classes, its
    top-1 prediction. ``forward_ms`` (patch size -> milliseconds) are times measured before for
    this model and input size: then each size runs the image once, untimed. Each size runs on the
    model resized to it once (FlexiViT PI-resize), so the time is the transformer's at that size,
    not the kernel's resampling; ``model`` is unchanged."""
    config = model.config
    names = config.class_names
    timed = forward_ms is None
    x = x.to(next(model.parameters()).device)
    rows = []
    for planned in _each_size(model, plan, progress, "Timing" if timed else "Running"):
        patch = planned.patch_size
        resized = model if patch == config.patch_size else resize_model(model, patch_size=patch, share_weights=True).eval()
        if timed:
            output, milliseconds = median_forward(resized, x, planned.timed_passes)
        else:
            with torch.no_grad():
                output, milliseconds = resized(x)[0].float().cpu(), forward_ms[patch]
        del resized  # a large patch's kernel is hundreds of MB: gone before the next size
        grid_h, grid_w = model.grid_size(patch)
        row = {
            "patch size": patch,
            "grid": f"{grid_h}x{grid_w}",
            "tokens": config.num_prefix_tokens + grid_h * grid_w,
            "forward ms": milliseconds,
        }
        if config.num_classes:
            probabilities = output.softmax(dim=-1)
            best = int(probabilities.argmax())
            row["prediction"] = names[best] if names else f"class {best}"
            row["probability"] = float(probabilities[best])
        rows.append(row)
    return rows


def held_out_set(config, images: int, start: int) -> ImageDataset:
    """``images`` images of the shapes test stream from ``start`` on, at the model's input size."""
    return shapes_dataset(images, config.img_size, SHAPES_TEST_SEED, "test", start=start)


def held_out_accuracy(
    model: ViT, dataset: ImageDataset, plan: Sequence[PlannedSize], progress: Progress | None = None
) -> dict[int, float]:
    """Patch size -> accuracy of the model on ``dataset`` at each planned size (one batch per size)."""
    config = model.config
    device = next(model.parameters()).device
    mean = torch.tensor(config.mean, device=device).view(1, -1, 1, 1)
    std = torch.tensor(config.std, device=device).view(1, -1, 1, 1)
    images = (dataset.images.to(device).float() / 255 - mean) / std
    labels = dataset.labels.to(device)
    accuracy = {}
    for planned in _each_size(model, plan, progress, f"Testing on {len(dataset)} held-out images:"):
        with torch.no_grad():
            predicted = model(images, patch_size=planned.patch_size).argmax(dim=-1)
        accuracy[planned.patch_size] = float((predicted == labels).float().mean())
    return accuracy
