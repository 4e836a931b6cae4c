"""Training: the loop, a generator of events (``train``), and what it reads and writes.

``train(config)`` yields StepEvent, EpochEvent, SnapshotEvent (the attention of a fixed probe
image, so that a viewer can watch attention form) and finally DoneEvent. Under ``torchrun`` it
trains data-parallel (DDP); rank 0 writes the checkpoint. The data lives on the device and is
augmented there, so nothing waits for a loader. Running it in the background is
``run.TrainingRun``'s; whether a run fits is ``admission``'s, from ``model_config``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import threading
import time
from collections.abc import Generator, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from .. import resources
from ..model.capture import capture
from ..model.config import PRESETS, TrainConfig, ViTConfig
from ..model.devices import distributed_setup
from ..data.datasets import (
    DEFAULT_DATA_ROOT, DeviceLoader, ImageDataset, load_dataset, native_image_size, shapes_dataset,
)
from ..model.vit import ViT
from ..weights import load_model, save_model

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
    """The ViTConfig a run trains: preset or given config, image size, positions, the dataset's classes."""
    image_size = config.image_size
    if isinstance(config.model, ViTConfig):
        base = config.model if image_size is None else config.model.replace(image_size=image_size)
    else:
        base = ViTConfig(image_size=image_size or native_image_size(config.dataset), **PRESETS[config.model])
    if config.positions == "rotary":
        # DINOv3's rotary positions: coordinates in [-1, 1] whatever the grid, no pos_embed to resample.
        base = base.replace(abs_pos_embed=False, rope_type="dinov3")
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
    rank, world_size, device, own_group = distributed_setup(config.device)
    try:
        yield from _train(config, stop or threading.Event(), rank, world_size, device, started_at)
    finally:
        if own_group:
            dist.destroy_process_group()


def _train(config, stop, rank, world_size, device, started_at) -> Iterator[Event]:
    run = _Run(config, stop, rank, world_size, device)
    if run.is_main and config.snapshot_every:
        yield run.snapshot()
    run.model.train()
    for epoch in range(run.step // run.steps_per_epoch, config.epochs):
        epoch_started = time.perf_counter()
        sums, seen = yield from run.epoch_steps(epoch)
        if run.stopped:
            break
        yield run.test(epoch, sums, seen, epoch_started)
        run.save(finished=epoch + 1 == config.epochs)
    yield from run.finish(started_at)


class _Run:
    """One run's training state, on one rank: its data, model, optimizer, step and history."""

    def __init__(self, config: TrainConfig, stop, rank: int, world_size: int, device: torch.device):
        self.config, self.stop, self.world_size, self.device = config, stop, world_size, device
        self.is_main = rank == 0
        self.bf16 = config.precision == "bf16" or (config.precision == "auto" and device.type == "cuda")
        self.paths = checkpoint_paths(config)
        self.image_size = model_config(config).img_size  # validates patch and image size before any data work
        self._load_data(rank)
        self.total_steps = self.steps_per_epoch * config.epochs

        torch.manual_seed(config.seed)  # the same initial weights on every rank and every resume
        self.model = ViT(model_config(config, self.train_set)).to(device)
        self.optimizer = torch.optim.AdamW(
            _parameter_groups(self.model, config.weight_decay), lr=config.lr, fused=device.type == "cuda"
        )
        self.history: dict[str, list] = {"steps": [], "epochs": []}
        self.step = 0
        if config.resume:
            self.step, self.history = _resume(config, self.paths, self.model, self.optimizer, self.total_steps)
        self.step_model: nn.Module = self.model
        if world_size > 1:
            self.step_model = nn.parallel.DistributedDataParallel(
                self.model, device_ids=[device.index] if device.type == "cuda" else None
            )
        if config.compile:
            self.step_model = torch.compile(self.step_model)

        self.probe_image = rearrange(self.test_set.images[0], "c h w -> h w c").cpu().numpy()
        self.probe = self.test_loader.normalize(self.test_set.images[:1])
        self.stopped = False
        epochs = self.history["epochs"]
        self.test_accuracy = epochs[-1]["test_accuracy"] if epochs else float("nan")

    def _load_data(self, rank: int) -> None:
        config = self.config
        root = Path(config.data_root).expanduser() if config.data_root else DEFAULT_DATA_ROOT
        data_options = dict(image_size=self.image_size, root=root, seed=config.seed, device=self.device)
        self.train_set = load_dataset(config.dataset, "train", size=config.train_size, **data_options)
        self.test_set = load_dataset(config.dataset, "test", size=config.test_size, **data_options)
        # Shapes renders a new slice of its endless stream every epoch: fresh images teach more than
        # repeated, augmented ones, and crops could cut the shape off.
        self.fresh_shapes = config.dataset == "shapes"
        self.train_loader = DeviceLoader(
            self.train_set, config.batch_size, train=True, seed=config.seed,
            augment=config.augment and not self.fresh_shapes, rank=rank, world_size=self.world_size,
        )
        self.test_loader = DeviceLoader(self.test_set, EVAL_BATCH, train=False, rank=rank, world_size=self.world_size)
        self.steps_per_epoch = len(self.train_loader)
        if self.steps_per_epoch == 0:
            raise TrainingError(
                f"the training set has {len(self.train_set)} images, fewer than one batch of "
                f"{config.batch_size * self.world_size}; lower the batch size"
            )

    def snapshot(self) -> SnapshotEvent:
        return _snapshot(self.model, self.probe, self.probe_image, self.step)

    def train_step(self, images: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, float]:
        """One optimizer step; (the loss sum and correct count of its batch, on the device; its lr)."""
        config = self.config
        lr = learning_rate(self.step, self.total_steps, config)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        # FlexiViT: a patch size per step, a pure function of seed and step, so that every
        # DDP rank and a resumed run draw the same one.
        sizes = config.patch_sizes
        patch = sizes[np.random.default_rng((config.seed, self.step)).integers(len(sizes))] if sizes else None
        with _autocast(self.device, self.bf16):
            logits = self.step_model(images, patch_size=patch)
            loss = F.cross_entropy(logits.float(), labels, label_smoothing=config.label_smoothing)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        self.step += 1
        return torch.stack((loss.detach() * labels.numel(), (logits.argmax(-1) == labels).sum().float())), lr

    def epoch_steps(self, epoch: int) -> Generator[Event, None, tuple[torch.Tensor, int]]:
        """One epoch's steps (from where a resumed run left off), yielding a StepEvent every
        ``log_every`` steps and snapshots; returns the epoch's (loss sum, correct) and images.
        A stop ends it after the current step, with ``stopped`` set."""
        config, steps_per_epoch = self.config, self.steps_per_epoch
        sums, seen = torch.zeros(2, device=self.device), 0  # this epoch's loss sum, correct; images
        interval = torch.zeros(2, device=self.device)  # the same since the last StepEvent
        interval_started, interval_steps = time.perf_counter(), 0
        if self.fresh_shapes and epoch > 0:
            size = len(self.train_set)
            self.train_loader.dataset = shapes_dataset(
                size, self.image_size, config.seed, "train", self.device, start=epoch * size
            )
        for images, labels in self.train_loader.epoch(epoch, start=self.step % steps_per_epoch):
            batch, lr = self.train_step(images, labels)
            interval_steps += 1
            # Summed on the device; reading them back waits for it, so only every log_every steps.
            interval += batch
            stop_now = self.stop.is_set()
            if self.step % config.log_every == 0 or self.step % steps_per_epoch == 0 or stop_now:
                yield self._step_event(epoch, interval, interval_steps, lr, time.perf_counter() - interval_started)
                sums += interval
                seen += interval_steps * config.batch_size
                interval.zero_()
                interval_started, interval_steps = time.perf_counter(), 0
            if self.is_main and config.snapshot_every and self.step % config.snapshot_every == 0:
                yield self.snapshot()
            if stop_now:
                self.stopped = True
                break
        return sums, seen

    def _step_event(self, epoch: int, interval: torch.Tensor, steps: int, lr: float, seconds: float) -> StepEvent:
        """The StepEvent for the last ``steps`` steps (their loss sum and correct in ``interval``)."""
        loss_sum, correct = interval.tolist()
        count = steps * self.config.batch_size
        if not math.isfinite(loss_sum):
            raise TrainingError(
                f"the loss became {loss_sum / count} at step {self.step}; lower the learning rate (now {self.config.lr})"
            )
        event = StepEvent(
            step=self.step, total_steps=self.total_steps, epoch=epoch + 1, loss=loss_sum / count,
            accuracy=correct / count, lr=lr, images_per_s=count * self.world_size / max(seconds, 1e-9),
        )
        self.history["steps"].append(asdict(event))
        return event

    def test(self, epoch: int, sums: torch.Tensor, seen: int, epoch_started: float) -> EpochEvent:
        """The end of an epoch: test the model and record the epoch."""
        test_loss, self.test_accuracy = evaluate(self.model, self.test_loader, self.bf16)
        loss_sum, correct = sums.tolist()
        event = EpochEvent(
            epoch=epoch + 1, epochs=self.config.epochs, train_loss=loss_sum / max(seen, 1),
            train_accuracy=correct / max(seen, 1), test_loss=test_loss, test_accuracy=self.test_accuracy,
            seconds=time.perf_counter() - epoch_started,
        )
        self.history["epochs"].append(asdict(event))
        return event

    def finish(self, started_at: float) -> Iterator[Event]:
        """After the last epoch or a stop: the last snapshot, FlexiViT's accuracy per patch size, DoneEvent."""
        config, paths = self.config, self.paths
        if self.stopped:
            _, self.test_accuracy = evaluate(self.model, self.test_loader, self.bf16)
            self.save(finished=False)
        if self.is_main and config.snapshot_every and self.step % config.snapshot_every:
            yield self.snapshot()
        by_patch_size = None
        if config.patch_sizes:
            by_patch_size = {
                patch: evaluate(self.model, self.test_loader, self.bf16, patch)[1] for patch in config.patch_sizes
            }
            if self.is_main:
                sidecar = json.loads(paths["sidecar"].read_text())
                sidecar["test_accuracy_by_patch_size"] = {str(patch): value for patch, value in by_patch_size.items()}
                _write_json(paths["sidecar"], sidecar)
        if self.world_size > 1:
            dist.barrier()  # the checkpoint exists before any rank reports it
        yield DoneEvent(
            checkpoint=str(paths["checkpoint"]), stopped=self.stopped, test_accuracy=self.test_accuracy,
            seconds=time.perf_counter() - started_at, test_accuracy_by_patch_size=by_patch_size,
        )

    def save(self, finished: bool) -> None:
        """The checkpoint and its sidecar (rank 0); the optimizer state too while unfinished, for a resume."""
        if not self.is_main:
            return
        config, paths, history = self.config, self.paths, self.history
        paths["checkpoint"].parent.mkdir(parents=True, exist_ok=True)
        save_model(self.model, paths["checkpoint"], {"train_config": config.replace(resume=False).to_json()})
        _write_json(paths["sidecar"], {
            "train_config": config.replace(resume=False).to_dict(),
            "step": self.step, "total_steps": self.total_steps, "finished": finished, "history": history,
            "test_accuracy": history["epochs"][-1]["test_accuracy"] if history["epochs"] else None,
        })
        if finished:
            paths["state"].unlink(missing_ok=True)
        else:
            temporary = paths["state"].with_name(f".{paths['state'].name}.tmp")
            torch.save({"optimizer": self.optimizer.state_dict(), "step": self.step}, temporary)
            os.replace(temporary, paths["state"])


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
