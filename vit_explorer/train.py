"""Training: the loop, a generator of events (``train``), and what it reads and writes.

``train(config)`` yields StepEvent, EpochEvent, SnapshotEvent (the attention of a fixed probe
image, so that a viewer can watch attention form) and finally DoneEvent. Under ``torchrun`` it
trains data-parallel (DDP); rank 0 writes the checkpoint. The data lives on the device and is
augmented there, so nothing waits for a loader. Running it in the background is
``training_run.TrainingRun``'s; whether a run fits is ``admission``'s, from ``model_config``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from . import resources
from .capture import capture
from .config import PRESETS, TrainConfig, ViTConfig
from .data import (
    DEFAULT_DATA_ROOT, DeviceLoader, ImageDataset, load_dataset, native_image_size, shapes_dataset,
)
from .model import ViT
from .weights import load_model, resize_model, save_model

# The shipped model, trained on shapes by `python -m vit_explorer train` (see weights/README.md):
# beside the package in a checkout, under share/vit_explorer once installed.
DEFAULT_WEIGHTS = resources.shipped_weights()


EVAL_BATCH = 500  # test images per batch when the loop evaluates


class TrainingError(ValueError):
    """Training cannot go on: the loss diverged, the data is too small, nothing to resume, ..."""


@dataclass
class StepEvent:
    step: int  # optimizer steps done, 1..total_steps
    total_steps: int
    epoch: int  # 1..epochs
    loss: float  # mean training loss since the previous StepEvent
    accuracy: float  # training accuracy since the previous StepEvent
    lr: float
    images_per_s: float


@dataclass
class EpochEvent:
    epoch: int  # 1..epochs
    epochs: int
    train_loss: float
    train_accuracy: float
    test_loss: float
    test_accuracy: float
    seconds: float


@dataclass
class SnapshotEvent:
    step: int
    image: np.ndarray  # (H, W, 3) uint8: the probe image
    attentions: torch.Tensor  # (1, L, nh, N, N) float32 on the CPU, as vx.capture gives them
    grid_size: tuple[int, int]
    num_prefix_tokens: int
    prediction: str
    probabilities: list[float]  # one per class, in class_names order


@dataclass
class DoneEvent:
    checkpoint: str
    stopped: bool  # True when stopped early; the checkpoint then holds the weights so far
    test_accuracy: float
    seconds: float
    # FlexiViT runs: patch size -> test accuracy of the final weights at that size
    test_accuracy_by_patch_size: dict[int, float] | None = None


Event = StepEvent | EpochEvent | SnapshotEvent | DoneEvent


def resolve_device(name: str = "auto") -> torch.device:
    """"auto" picks cuda, then mps, then cpu; an explicit device must exist."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise TrainingError("device cuda was asked for but no CUDA GPU is available; use --device cpu")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise TrainingError("device mps was asked for but is not available; use --device cpu")
    return device


def check_run_name(name: str) -> str:
    """``name`` if it is a plain file name, which keeps a run's files inside its output folder;
    else a TrainingError."""
    if name in (".", "..") or any(character in name for character in "/\\\0"):
        raise TrainingError(
            f"the run name {name!r} must be a plain file name, without /, \\ or .. (its files go in the output folder)"
        )
    return name


def checkpoint_paths(config: TrainConfig) -> dict[str, Path]:
    """The checkpoint, its JSON sidecar (history + TrainConfig) and the optimizer state."""
    folder, name = Path(config.out_dir).expanduser(), check_run_name(config.run_name)
    # Appended, not with_suffix: a name with a dot ("vit.v2") keeps all of itself.
    return {
        "checkpoint": folder / f"{name}.safetensors",
        "sidecar": folder / f"{name}.json",
        "state": folder / f"{name}.state.pt",
    }


def model_config(config: TrainConfig, dataset: ImageDataset | None = None) -> ViTConfig:
    """The ViTConfig a run trains: preset or given config, image size, the dataset's classes."""
    image_size = config.image_size
    if isinstance(config.model, ViTConfig):
        base = config.model if image_size is None else config.model.replace(image_size=image_size)
    else:
        base = ViTConfig(image_size=image_size or native_image_size(config.dataset), **PRESETS[config.model])
    height, width = base.img_size
    for patch in config.patch_sizes or ():
        if height % patch or width % patch:
            raise ValueError(
                f"patch size {patch} does not tile {height}x{width} images; FlexiViT patch sizes"
                f" must divide the image size"
            )
    if dataset is None:
        return base
    return base.replace(
        in_chans=3,
        num_classes=len(dataset.class_names),
        class_names=dataset.class_names,
        mean=dataset.mean,
        std=dataset.std,
    )


def smallest_patch_config(config: TrainConfig) -> ViTConfig:
    """The run's model at the smallest patch size it will run at, the one with the most tokens:
    a FlexiViT run draws a patch size per step from ``patch_sizes``, its model's own among them or not."""
    vit = model_config(config)
    return vit.replace(patch_size=min((vit.patch_size, *(config.patch_sizes or ()))))


def learning_rate(step: int, total_steps: int, config: TrainConfig) -> float:
    """Linear warmup to the peak over ``warmup_steps``, then a cosine decay to zero (0-based step)."""
    warmup = min(config.warmup_steps, total_steps - 1)
    if step < warmup:
        return config.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, total_steps - warmup)
    return config.lr * 0.5 * (1 + math.cos(math.pi * progress))


def _parameter_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    # No weight decay on biases, norms, position embeddings and prefix tokens (timm, DeiT).
    decay, no_decay = [], []
    for name, parameter in model.named_parameters():
        plain = parameter.ndim < 2 or name.endswith(("pos_embed", "cls_token", "reg_token"))
        (no_decay if plain else decay).append(parameter)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def _distributed_setup(device_name: str) -> tuple[int, int, torch.device, bool]:
    """(rank, world_size, device, whether we started the process group) under torchrun."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:
        return 0, 1, resolve_device(device_name), False
    device = resolve_device(device_name)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return dist.get_rank(), dist.get_world_size(), device, started


def _write_json(path: Path, data: dict) -> None:
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(json.dumps(data, indent=1))
    os.replace(temporary, path)


def load_history(checkpoint: str | Path) -> dict:
    """The sidecar of a checkpoint: {"train_config", "history", "step", "finished", ...}."""
    sidecar = Path(checkpoint).with_suffix(".json")
    if not sidecar.is_file():
        raise TrainingError(f"{sidecar} does not exist; it is written next to every training checkpoint")
    try:
        saved = json.loads(sidecar.read_text())
    except (ValueError, RecursionError):  # not UTF-8, not JSON, or nested beyond the parser's depth
        saved = None
    if not isinstance(saved, dict):
        raise TrainingError(f"{sidecar} is not a training sidecar (a JSON object)")
    return saved


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _saved_history(saved: dict, sidecar: Path) -> tuple[list[dict], list[dict]]:
    """(steps, epochs) of a sidecar, each record with every field of its event as a number; else
    a TrainingError, so that a damaged or foreign file never reaches a figure."""
    history = saved.get("history")
    records = {"steps": StepEvent, "epochs": EpochEvent}
    if isinstance(history, dict) and all(
        isinstance(history.get(key), list) and all(
            isinstance(record, dict)
            and all(_is_number(record.get(field.name)) for field in dataclasses.fields(event))
            for record in history[key]
        )
        for key, event in records.items()
    ):
        return list(history["steps"]), list(history["epochs"])
    raise TrainingError(f"{sidecar} does not hold a training history of steps and epochs")


def saved_history(checkpoint: str | Path) -> tuple[list[dict], list[dict]]:
    """(steps, epochs) of a checkpoint's sidecar, checked (see load_history); else a TrainingError."""
    return _saved_history(load_history(checkpoint), Path(checkpoint).with_suffix(".json"))


@dataclass(frozen=True)
class SavedRun:
    """What a checkpoint's sidecar says of the run that wrote it, checked."""

    config: TrainConfig
    steps: list[dict]
    epochs: list[dict]
    finished: bool
    progress: float  # steps done of the run's total, 0..1
    test_accuracy: float  # NaN before the first epoch ended


def saved_run(checkpoint: str | Path) -> SavedRun:
    """The run a checkpoint's sidecar describes; a TrainingError says in one sentence why a
    sidecar cannot be one."""
    sidecar = Path(checkpoint).with_suffix(".json")
    saved = load_history(checkpoint)
    steps, epochs = _saved_history(saved, sidecar)
    accuracy = saved.get("test_accuracy")
    if not (
        isinstance(saved.get("finished"), bool)
        and all(_is_number(saved.get(key)) and math.isfinite(saved[key]) for key in ("step", "total_steps"))
        and (accuracy is None or _is_number(accuracy))
    ):
        raise TrainingError(f"{sidecar} lacks a run's finished, step, total_steps or test_accuracy")
    try:
        config = TrainConfig.from_dict(saved.get("train_config"))
    except (TypeError, ValueError, AttributeError) as error:
        raise TrainingError(f"{sidecar} holds no valid training configuration ({error})") from None
    return SavedRun(
        config=config, steps=steps, epochs=epochs, finished=saved["finished"],
        progress=min(max(saved["step"] / max(saved["total_steps"], 1), 0.0), 1.0),
        test_accuracy=math.nan if accuracy is None else accuracy,
    )


@torch.no_grad()
def evaluate(
    model: nn.Module, loader: DeviceLoader, bf16: bool = False, patch_size: int | None = None
) -> tuple[float, float]:
    """(mean loss, accuracy) over the loader's data at ``patch_size`` (default: the model's own),
    summed over all ranks under DDP."""
    was_training = model.training
    model.eval()
    device = loader.dataset.images.device
    totals = torch.zeros(3, device=device, dtype=torch.float64)  # loss sum, correct, count
    for images, labels in loader.epoch(0):
        with _autocast(device, bf16):
            logits = model(images, patch_size=patch_size)
        totals[0] += F.cross_entropy(logits.float(), labels, reduction="sum")
        totals[1] += (logits.argmax(-1) == labels).sum()
        totals[2] += labels.numel()
    if dist.is_initialized():
        dist.all_reduce(totals)
    model.train(was_training)
    loss_sum, correct, count = totals.tolist()
    return loss_sum / max(count, 1), correct / max(count, 1)


def _autocast(device: torch.device, bf16: bool):
    return torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()


def _snapshot(model: ViT, probe: torch.Tensor, probe_image: np.ndarray, step: int) -> SnapshotEvent:
    result = capture(model, probe)
    probabilities = result.logits.softmax(-1)[0]
    names = model.config.class_names or tuple(str(i) for i in range(model.config.num_classes))
    return SnapshotEvent(
        step=step,
        image=probe_image,
        attentions=result.attentions,
        grid_size=result.grid_size,
        num_prefix_tokens=result.num_prefix_tokens,
        prediction=names[int(probabilities.argmax())],
        probabilities=probabilities.tolist(),
    )


def train(config: TrainConfig, stop: threading.Event | None = None) -> Iterator[Event]:
    """Train as ``config`` says, yielding events; ends with a DoneEvent and a checkpoint on disk.

    Setting ``stop`` ends training after the current step; the checkpoint (and the optimizer
    state next to it) is still written, so that ``config.replace(resume=True)`` continues.
    """
    started_at = time.perf_counter()
    rank, world_size, device, own_group = _distributed_setup(config.device)
    try:
        yield from _train(config, stop or threading.Event(), rank, world_size, device, started_at)
    finally:
        if own_group:
            dist.destroy_process_group()


def _train(config, stop, rank, world_size, device, started_at) -> Iterator[Event]:
    bf16 = config.precision == "bf16" or (config.precision == "auto" and device.type == "cuda")
    paths = checkpoint_paths(config)
    is_main = rank == 0
    root = Path(config.data_root).expanduser() if config.data_root else DEFAULT_DATA_ROOT
    image_size = model_config(config).img_size  # validates patch and image size before any data work

    data_options = dict(image_size=image_size, root=root, seed=config.seed, device=device)
    train_set = load_dataset(config.dataset, "train", size=config.train_size, **data_options)
    test_set = load_dataset(config.dataset, "test", size=config.test_size, **data_options)
    # Shapes renders a new slice of its endless stream every epoch: fresh images teach more than
    # repeated, augmented ones, and crops could cut the shape off.
    fresh_shapes = config.dataset == "shapes"
    train_loader = DeviceLoader(
        train_set, config.batch_size, train=True, seed=config.seed,
        augment=config.augment and not fresh_shapes, rank=rank, world_size=world_size,
    )
    test_loader = DeviceLoader(test_set, EVAL_BATCH, train=False, rank=rank, world_size=world_size)
    steps_per_epoch = len(train_loader)
    if steps_per_epoch == 0:
        raise TrainingError(
            f"the training set has {len(train_set)} images, fewer than one batch of "
            f"{config.batch_size * world_size}; lower the batch size"
        )
    total_steps = steps_per_epoch * config.epochs

    torch.manual_seed(config.seed)  # the same initial weights on every rank and every resume
    model = ViT(model_config(config, train_set)).to(device)
    optimizer = torch.optim.AdamW(
        _parameter_groups(model, config.weight_decay), lr=config.lr, fused=device.type == "cuda"
    )
    history: dict[str, list] = {"steps": [], "epochs": []}
    step = 0
    if config.resume:
        step, history = _resume(config, paths, model, optimizer, total_steps)

    step_model: nn.Module = model
    if world_size > 1:
        step_model = nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None
        )
    if config.compile:
        step_model = torch.compile(step_model)

    probe_image = rearrange(test_set.images[0], "c h w -> h w c").cpu().numpy()
    probe = test_loader.normalize(test_set.images[:1])
    if is_main and config.snapshot_every:
        yield _snapshot(model, probe, probe_image, step)

    def save(finished: bool) -> None:
        if not is_main:
            return
        paths["checkpoint"].parent.mkdir(parents=True, exist_ok=True)
        save_model(model, paths["checkpoint"], {"train_config": config.replace(resume=False).to_json()})
        _write_json(paths["sidecar"], {
            "train_config": config.replace(resume=False).to_dict(),
            "step": step, "total_steps": total_steps, "finished": finished, "history": history,
            "test_accuracy": history["epochs"][-1]["test_accuracy"] if history["epochs"] else None,
        })
        if finished:
            paths["state"].unlink(missing_ok=True)
        else:
            temporary = paths["state"].with_name(f".{paths['state'].name}.tmp")
            torch.save({"optimizer": optimizer.state_dict(), "step": step}, temporary)
            os.replace(temporary, paths["state"])

    model.train()
    stopped = False
    test_accuracy = history["epochs"][-1]["test_accuracy"] if history["epochs"] else float("nan")
    flexi_sizes = config.patch_sizes
    for epoch in range(step // steps_per_epoch, config.epochs):
        epoch_started = time.perf_counter()
        sums, seen = torch.zeros(2, device=device), 0  # this epoch's loss sum, correct; images
        interval = torch.zeros(2, device=device)  # the same since the last StepEvent
        interval_started, interval_steps = time.perf_counter(), 0
        if fresh_shapes and epoch > 0:
            train_loader.dataset = shapes_dataset(
                len(train_set), image_size, config.seed, "train", device, start=epoch * len(train_set)
            )
        for images, labels in train_loader.epoch(epoch, start=step % steps_per_epoch):
            lr = learning_rate(step, total_steps, config)
            for group in optimizer.param_groups:
                group["lr"] = lr
            # FlexiViT: a patch size per step, a pure function of seed and step, so that every
            # DDP rank and a resumed run draw the same one.
            patch = (
                flexi_sizes[np.random.default_rng((config.seed, step)).integers(len(flexi_sizes))]
                if flexi_sizes else None
            )
            with _autocast(device, bf16):
                logits = step_model(images, patch_size=patch)
                loss = F.cross_entropy(logits.float(), labels, label_smoothing=config.label_smoothing)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            interval_steps += 1
            # Summed on the device; reading them back waits for it, so only every log_every steps.
            interval += torch.stack((loss.detach() * labels.numel(), (logits.argmax(-1) == labels).sum().float()))
            stop_now = stop.is_set()
            if step % config.log_every == 0 or step % steps_per_epoch == 0 or stop_now:
                loss_sum, correct = interval.tolist()
                count = interval_steps * config.batch_size
                if not math.isfinite(loss_sum):
                    raise TrainingError(
                        f"the loss became {loss_sum / count} at step {step}; lower the learning rate (now {config.lr})"
                    )
                seconds = time.perf_counter() - interval_started
                event = StepEvent(
                    step=step, total_steps=total_steps, epoch=epoch + 1, loss=loss_sum / count,
                    accuracy=correct / count, lr=lr,
                    images_per_s=interval_steps * config.batch_size * world_size / max(seconds, 1e-9),
                )
                history["steps"].append(asdict(event))
                yield event
                sums += interval
                seen += count
                interval.zero_()
                interval_started, interval_steps = time.perf_counter(), 0
            if is_main and config.snapshot_every and step % config.snapshot_every == 0:
                yield _snapshot(model, probe, probe_image, step)
            if stop_now:
                stopped = True
                break
        if stopped:
            break
        test_loss, test_accuracy = evaluate(model, test_loader, bf16)
        loss_sum, correct = sums.tolist()
        event = EpochEvent(
            epoch=epoch + 1, epochs=config.epochs, train_loss=loss_sum / max(seen, 1),
            train_accuracy=correct / max(seen, 1), test_loss=test_loss, test_accuracy=test_accuracy,
            seconds=time.perf_counter() - epoch_started,
        )
        history["epochs"].append(asdict(event))
        yield event
        save(finished=epoch + 1 == config.epochs)

    if stopped:
        _, test_accuracy = evaluate(model, test_loader, bf16)
        save(finished=False)
    if is_main and config.snapshot_every and step % config.snapshot_every:
        yield _snapshot(model, probe, probe_image, step)
    by_patch_size = None
    if flexi_sizes:
        by_patch_size = {patch: evaluate(model, test_loader, bf16, patch)[1] for patch in flexi_sizes}
        if is_main:
            sidecar = json.loads(paths["sidecar"].read_text())
            sidecar["test_accuracy_by_patch_size"] = {str(patch): value for patch, value in by_patch_size.items()}
            _write_json(paths["sidecar"], sidecar)
    if world_size > 1:
        dist.barrier()  # the checkpoint exists before any rank reports it
    yield DoneEvent(
        checkpoint=str(paths["checkpoint"]), stopped=stopped, test_accuracy=test_accuracy,
        seconds=time.perf_counter() - started_at, test_accuracy_by_patch_size=by_patch_size,
    )


def _resume(config, paths, model, optimizer, total_steps) -> tuple[int, dict]:
    """Load weights, optimizer state and history of an interrupted run; return (step, history)."""
    if not paths["state"].is_file():
        if paths["sidecar"].is_file() and load_history(paths["checkpoint"]).get("finished"):
            raise TrainingError(f"{paths['checkpoint']} is a finished run; there is nothing to resume")
        raise TrainingError(f"there is no interrupted run to resume in {paths['checkpoint'].parent}")
    saved = load_history(paths["checkpoint"])
    previous = TrainConfig.from_dict(saved["train_config"])
    ignored = {"resume", "device", "compile", "precision", "log_every", "snapshot_every", "data_root"}
    changed = [
        name for name, value in config.to_dict().items()
        if name not in ignored and previous.to_dict()[name] != value
    ]
    if changed:
        raise TrainingError(f"cannot resume with a changed configuration ({', '.join(changed)})")
    model.load_state_dict(load_model(paths["checkpoint"]).state_dict())
    state = torch.load(paths["state"], map_location=next(model.parameters()).device, weights_only=True)
    optimizer.load_state_dict(state["optimizer"])
    if saved["total_steps"] != total_steps:
        raise TrainingError("cannot resume: the number of steps per epoch has changed")
    return int(state["step"]), saved["history"]


def evaluate_checkpoint(
    weights: str | Path, dataset: str = "shapes", *, device: str = "auto", data_root: str | Path | None = None,
    test_size: int | None = None, batch_size: int = EVAL_BATCH, patch_size: int | None = None,
    image_size: int | None = None,
) -> tuple[float, int, ViTConfig]:
    """(test accuracy, number of test images, the config evaluated) of a checkpoint on a
    dataset's test split, at another patch and/or image size if asked (FlexiViT resize)."""
    target = resolve_device(device)
    model = load_model(weights).to(target)
    if patch_size is not None or image_size is not None:
        model = resize_model(model, patch_size=patch_size, image_size=image_size)
    config = model.config
    root = Path(data_root).expanduser() if data_root else DEFAULT_DATA_ROOT
    test_set = load_dataset(dataset, "test", image_size=config.img_size, root=root, size=test_size, device=target)
    if config.num_classes != len(test_set.class_names) or (
        config.class_names is not None and tuple(config.class_names) != test_set.class_names
    ):
        known = ", ".join(config.class_names) if config.class_names else f"{config.num_classes} classes"
        raise TrainingError(f"the model knows {known}, but {dataset} has {', '.join(test_set.class_names)}")
    # Normalize as the model was trained, whatever the dataset's own statistics are.
    test_set.mean, test_set.std = config.mean, config.std
    loader = DeviceLoader(test_set, batch_size, train=False)
    _, accuracy = evaluate(model, loader)
    return accuracy, len(test_set), config
