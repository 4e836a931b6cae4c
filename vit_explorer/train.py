"""Training: a generator of events (``train``) and a background run around it (``TrainingRun``).

``train(config)`` yields StepEvent, EpochEvent, SnapshotEvent (the attention of a fixed probe
image, so that a viewer can watch attention form) and finally DoneEvent. Under ``torchrun`` it
trains data-parallel (DDP); rank 0 writes the checkpoint. The data lives on the device and is
augmented there, so nothing waits for a loader.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
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
    test_loader = DeviceLoader(test_set, 500, train=False, rank=rank, world_size=world_size)
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


def readable_error(error: BaseException) -> str:
    """One sentence for a person, whatever went wrong in a run."""
    if isinstance(error, torch.cuda.OutOfMemoryError):
        return "the GPU ran out of memory; lower the batch size or use a smaller model"
    if isinstance(error, MemoryError) or "can't allocate memory" in str(error):
        return (
            "the run needed more memory than it may use; lower the batch size, use a larger patch"
            " size (fewer tokens) or a smaller dim or depth"
        )
    if isinstance(error, (ValueError, OSError)):
        return str(error).splitlines()[0] if str(error) else type(error).__name__
    first_line = str(error).splitlines()[0] if str(error) else ""
    return f"training failed: {type(error).__name__}" + (f": {first_line}" if first_line else "")


# A killed run whose peak memory came this close to its limit is taken to have run out of it.
NEAR_MEMORY_LIMIT = 0.9


def exit_sentence(
    exitcode: int, *, peak_rss: int | None = None, memory_limit: int | None = None, oom_killed: bool | None = None,
) -> str:
    """Why a run's process ended without reporting, in one sentence. A SIGKILL is blamed on
    memory when the kernel counted an out-of-memory kill meanwhile (``oom_killed``; None: the
    count is unknown) or the process's peak memory came near its limit; else someone ended it."""
    if exitcode == -signal.SIGKILL:
        lower = "lower the batch size, use a larger patch size (fewer tokens) or a smaller model"
        near_limit = peak_rss is not None and memory_limit is not None and peak_rss >= NEAR_MEMORY_LIMIT * memory_limit
        if oom_killed or near_limit:
            return f"the run's process was ended by the operating system, most likely for lack of memory; {lower}"
        if oom_killed is None:
            return f"the run's process was killed, from outside or for lack of memory; if it was memory, {lower}"
        used = "" if peak_rss is None else f" after using {peak_rss / 2**30:.1f} GB" + (
            "" if memory_limit is None else f" of the {memory_limit / 2**30:.1f} GB it may use"
        )
        return f"the run's process was killed from outside{used}, not for lack of memory; it can be started again"
    if exitcode < 0:
        return f"the run's process was ended by signal {signal.Signals(-exitcode).name}"
    return f"the run's process exited unexpectedly (exit code {exitcode})"


def _oom_kills() -> int | None:
    """How many processes the kernel has killed for lack of memory since boot (None: unknown)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/vmstat").read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == "oom_kill":
                return int(value)
    return None


FOLLOW_SECONDS = 0.25  # how often a run's events file and its process are looked at


def _memory_status(field: str, pid: int | str = "self") -> int:
    """A Vm* field of /proc/<pid>/status in bytes (VmHWM: the peak resident memory)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name == field:
            return int(value.split()[0]) * 1024
    raise OSError(f"/proc/{pid}/status has no {field}")


def run_files(config: TrainConfig) -> dict[str, Path]:
    """A run's shared files beside its checkpoint, which any process on the runs folder can
    follow: its events (JSON lines appended by the run), its latest attention snapshot (replaced
    whole) and the stop request anyone may leave."""
    folder, name = Path(config.out_dir).expanduser(), check_run_name(config.run_name)
    return {
        "events": folder / f"{name}.events.jsonl",
        "snapshot": folder / f"{name}.snapshot.npz",
        "stop": folder / f"{name}.stop",
    }


class EventLog:
    """Writes a run's events to its files (see run_files): one whole line per event, flushed."""

    def __init__(self, config: TrainConfig):
        self.files = run_files(config)
        self._file = open(self.files["events"], "a", encoding="utf-8")  # noqa: SIM115 (closed in close)

    def _append(self, line: dict) -> None:
        self._file.write(json.dumps(line) + "\n")
        self._file.flush()

    def write(self, event: Event) -> None:
        if isinstance(event, SnapshotEvent):
            path = self.files["snapshot"]
            temporary = path.with_name(f".{path.name}.tmp")
            with open(temporary, "wb") as file:
                np.savez(
                    file, image=event.image, attentions=np.asarray(event.attentions, dtype=np.float32),
                    grid_size=np.array(event.grid_size), num_prefix_tokens=np.array(event.num_prefix_tokens),
                    prediction=np.array(event.prediction), probabilities=np.array(event.probabilities),
                    step=np.array(event.step),
                )
            os.replace(temporary, path)  # a reader loads the old snapshot or the new, never half of one
            self._append({"event": "snapshot", "step": event.step})
        else:
            kind = {StepEvent: "step", EpochEvent: "epoch", DoneEvent: "done"}[type(event)]
            self._append({"event": kind, **asdict(event)})

    def end(self, error: str | None, peak_rss: int | None) -> None:
        """The last line: why the run failed (None: it did not) and its process's peak memory."""
        self._append({"event": "end", "error": error, "peak_rss": peak_rss})

    def close(self) -> None:
        self._file.close()


class EventReader:
    """Reads the lines a run has appended to its events file since the last call."""

    def __init__(self, path: Path):
        self.path = path
        self._offset = 0
        self._partial = b""  # a line the run is still writing

    def read(self) -> list[dict]:
        try:
            with open(self.path, "rb") as file:
                file.seek(self._offset)
                data = file.read()
        except FileNotFoundError:
            return []
        self._offset += len(data)
        *lines, self._partial = (self._partial + data).split(b"\n")
        records = []
        for line in lines:
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                if isinstance(record, dict):
                    records.append(record)
        return records


def _decoded(record: dict, snapshot: Path) -> Event | None:
    """The event an events-file line stands for; None for a line (or snapshot) that cannot be read."""
    kind = record.pop("event", None)
    try:
        if kind == "snapshot":
            with np.load(snapshot, allow_pickle=False) as saved:
                return SnapshotEvent(
                    step=int(saved["step"]), image=saved["image"],
                    attentions=torch.from_numpy(saved["attentions"]),
                    grid_size=tuple(int(size) for size in saved["grid_size"]),
                    num_prefix_tokens=int(saved["num_prefix_tokens"]), prediction=str(saved["prediction"]),
                    probabilities=[float(value) for value in saved["probabilities"]],
                )
        if kind == "done":
            by_patch = record.get("test_accuracy_by_patch_size")
            if by_patch is not None:
                record["test_accuracy_by_patch_size"] = {int(patch): value for patch, value in by_patch.items()}
        return {"step": StepEvent, "epoch": EpochEvent, "done": DoneEvent}[kind](**record)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def process_identity(pid: int) -> tuple[int, int] | None:
    """(pid, its start time in clock ticks since boot) while that process lives, else None: a
    recorded pid names the same process only while both match (pids are reused)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # after "pid (command) "
    if fields[0] in ("Z", "X"):  # a zombie has ended
        return None
    return pid, int(fields[19])


def _train_in_child(spec_json: str) -> None:
    """A run process's whole life: train, append every event to the run's events file, end with
    an "end" line. It reports to no one in particular, so it outlives the server that started it."""
    spec = json.loads(spec_json)
    with contextlib.suppress(OSError):
        # Well below the server: on a small machine the people browsing come first and the run
        # takes what they leave (at nice 5 eight sessions beside one run stalled the app).
        os.nice(15)
    torch.set_num_threads(spec["threads"])
    config = TrainConfig.from_json(spec["config"])
    memory_limit = spec["memory_limit"]
    log = EventLog(config)
    stop = run_files(config)["stop"]
    error = None
    try:
        if memory_limit is not None and resolve_device(config.device).type == "cpu":
            # The kernel counts the address space torch has mapped but not touched as data too:
            # grant that much on top of the admitted memory, so that an allocation beyond it
            # fails here with a MemoryError rather than waking the OOM killer.
            untouched = _memory_status("VmData") - _memory_status("VmRSS")
            resource.setrlimit(resource.RLIMIT_DATA, (untouched + memory_limit, resource.RLIM_INFINITY))
        for event in train(config, stop=_StopRequest(stop)):
            log.write(event)
    except BaseException as failure:  # whoever follows the run reads why; the process then ends normally
        error = readable_error(failure)
    log.end(error, _memory_status("VmHWM"))
    log.close()


class _StopRequest:
    """``train``'s stop flag for a run process: set once someone has left the run's stop file."""

    def __init__(self, path: Path):
        self.path = path

    def is_set(self) -> bool:
        return self.path.exists()


class TrainingRun:
    """``train(config)`` in the background, with a thread-safe view of how it is going.

    By default it trains on a thread of this process. With ``process=True`` it trains in a
    process of its own (a session of its own too, so that it outlives this one) with ``threads``
    CPU threads and at most ``memory_limit`` bytes (CPU runs): a crash, an out-of-memory or a
    runaway config then ends that run only. Such a run appends its events to a file beside its
    checkpoint (``run_files``), which a thread here follows, as any other process may
    (``TrainingRun.follow``); ``publish=True`` writes that file from a thread run too. ``status``
    is "pending", "running", "stopped", "finished" or "failed" (then ``error`` says why in one
    sentence). Nothing ever raises into the caller or touches a UI. ``on_end`` is called (from
    the run's thread) once the run has ended.
    """

    def __init__(
        self, config: TrainConfig, *, process: bool = False, threads: int = 1,
        memory_limit: int | None = None, on_end: Callable[[], None] | None = None, publish: bool = False,
    ):
        self.config = config
        self._lock = threading.Lock()
        self._process_mode = process
        self._publish = publish
        self._stop = threading.Event()
        self._threads = threads
        self._memory_limit = memory_limit
        self._on_end = on_end
        self._thread: threading.Thread | None = None
        self._process: subprocess.Popen | None = None
        self._followed: tuple[int, int] | None = None  # (pid, start time) of a process started elsewhere
        self._followed_here = True  # that process is on this machine, where its life can be watched
        self._status = "pending"
        self._error: str | None = None
        self._peak_rss: int | None = None
        self._steps: list[dict] = []
        self._epochs: list[dict] = []
        self._latest_snapshot: SnapshotEvent | None = None
        self._done: DoneEvent | None = None
        self._progress = 0.0
        self._pace_from: tuple[float, float] | None = None  # (time, progress) at the first step
        if config.resume:
            with contextlib.suppress(TrainingError, OSError):
                paths = checkpoint_paths(config)
                self._steps, self._epochs = _saved_history(load_history(paths["checkpoint"]), paths["sidecar"])

    @classmethod
    def restored(cls, checkpoint: str | Path) -> "TrainingRun":
        """A run that ended earlier (in another server's life), rebuilt from its checkpoint's
        sidecar; a TrainingError says in one sentence why a sidecar cannot be one."""
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
        run = cls(config)
        run._steps, run._epochs = steps, epochs
        run._status = "finished" if saved["finished"] else "stopped"
        run._progress = min(max(saved["step"] / max(saved["total_steps"], 1), 0.0), 1.0)
        run._done = DoneEvent(
            checkpoint=str(checkpoint), stopped=not saved["finished"],
            test_accuracy=math.nan if accuracy is None else accuracy, seconds=math.nan,
        )
        return run

    def follow(self, pid: int, started: int, host: str | None = None) -> "TrainingRun":
        """Follow this run's process, started elsewhere (another server, or this one before a
        restart) as process ``pid`` at ``started`` (see process_identity) on ``host`` (None: this
        machine), through its files. A process on another machine cannot be watched from here:
        its run is followed until its events end (whoever sees it die writes that end)."""
        with self._lock:
            if self._thread is not None or self._status != "pending":
                raise RuntimeError("this run has already been started")
            self._followed, self._status = (pid, started), "running"
            self._followed_here = host in (None, socket.gethostname())
            self._thread = threading.Thread(target=self._follow, name=f"follow-{self.config.run_name}", daemon=True)
            self._thread.start()
        return self

    def start(self) -> "TrainingRun":
        with self._lock:
            if self._thread is not None or self._status != "pending":
                raise RuntimeError("this run has already been started")
            self._status = "running"
            target = self._work
            if self._process_mode:
                target = self._follow
                try:
                    self._process = self._spawn()
                except BaseException as failure:  # could not start: this run fails alone
                    self._status, self._error = "failed", readable_error(failure)
                    target = None
            if target is not None:
                self._thread = threading.Thread(target=target, name=f"train-{self.config.run_name}", daemon=True)
                self._thread.start()
        if target is None and self._on_end is not None:
            self._on_end()
        return self

    def _spawn(self) -> subprocess.Popen:
        files = run_files(self.config)
        files["events"].parent.mkdir(parents=True, exist_ok=True)
        files["events"].write_bytes(b"")  # a run of the same name before: its events are not this one's
        files["stop"].unlink(missing_ok=True)
        spec = json.dumps({
            "config": self.config.to_json(), "threads": self._threads, "memory_limit": self._memory_limit,
        })
        package_root = str(Path(__file__).resolve().parent.parent)
        path = os.pathsep.join(filter(None, (package_root, os.environ.get("PYTHONPATH"))))
        return subprocess.Popen(
            [sys.executable, "-c", "import sys; from vit_explorer.train import _train_in_child;"
             " _train_in_child(sys.argv[1])", spec],
            env={**os.environ, "PYTHONPATH": path}, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            start_new_session=True,  # neither a Ctrl-C meant for the server nor its end reaches the run
        )

    def stop(self) -> None:
        """Ask the run to end after its current step; it still writes a checkpoint. A run process
        (here or elsewhere) is asked through its stop file, which any server may leave."""
        self._stop.set()
        if (stop_file := self._stop_file()) is not None:
            with contextlib.suppress(OSError):
                stop_file.touch()

    def _stop_file(self) -> Path | None:
        """The file that asks this run's process to stop (None: the run trains on a thread here)."""
        return run_files(self.config)["stop"] if self._process_mode or self._followed is not None else None

    @property
    def stop_requested(self) -> bool:
        """Whether a stop has been asked for a run still running (by anyone, for a run process:
        its stop file). Such a run still finishes its step, tests itself and writes its checkpoint,
        which at nice 15 on a busy machine can take a minute."""
        if self.status != "running":
            return False
        if self._stop.is_set():
            return True
        stop_file = self._stop_file()
        return stop_file is not None and stop_file.exists()

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the run to end; True if it has."""
        if self._thread is not None:
            self._thread.join(timeout)
        return self._thread is not None and not self._thread.is_alive()

    def _record(self, event: Event) -> None:
        with self._lock:
            if isinstance(event, StepEvent):
                self._steps.append(asdict(event))
                self._progress = event.step / event.total_steps
                if self._pace_from is None:
                    self._pace_from = (time.perf_counter(), self._progress)
            elif isinstance(event, EpochEvent):
                self._epochs.append(asdict(event))
            elif isinstance(event, SnapshotEvent):
                self._latest_snapshot = event
            else:
                self._done = event

    def _end(self, error: str | None) -> None:
        with self._lock:
            if error is not None:
                self._status, self._error = "failed", error
            else:
                self._status = "stopped" if self._done is not None and self._done.stopped else "finished"
                if self._status == "finished":
                    self._progress = 1.0
        if self._on_end is not None:
            self._on_end()

    def _work(self) -> None:
        error = None
        log = None
        try:
            if self._publish:
                run_files(self.config)["events"].parent.mkdir(parents=True, exist_ok=True)
                log = EventLog(self.config)
            for event in train(self.config, stop=self._stop):
                self._record(event)
                if log is not None:
                    log.write(event)
        except BaseException as failure:  # a failed run reports, it never takes the caller down
            error = readable_error(failure)
        if log is not None:
            with contextlib.suppress(OSError):
                log.end(error, None)
                log.close()
        self._end(error)

    def _follow(self) -> None:
        """Read the run's events as its process appends them, until it ends."""
        process, files = self._process, run_files(self.config)
        reader = EventReader(files["events"])
        ended = None
        # Should the process be killed before it reports, these tell whether memory was why: its
        # peak memory as seen from here (peak_rss), and the kernel's count of out-of-memory kills.
        oom_kills = _oom_kills()
        pid = process.pid if process is not None else self._followed[0]
        caught_up = False
        try:
            while ended is None:
                if process is not None:
                    alive = process.poll() is None
                else:
                    alive = process_identity(pid) == self._followed if self._followed_here else ended is None
                for record in reader.read():
                    if record.get("event") == "end":
                        ended = record
                    elif (event := _decoded(record, files["snapshot"])) is not None:
                        self._record(event)
                if not caught_up:  # the pace is measured from now, not from the steps read at once
                    caught_up = True
                    with self._lock:
                        self._pace_from = (time.perf_counter(), self._progress) if self._steps else None
                if alive and self._followed_here:
                    with contextlib.suppress(OSError, ValueError):  # gone meanwhile
                        peak = _memory_status("VmHWM", pid)
                        with self._lock:
                            self._peak_rss = max(self._peak_rss or 0, peak)
                if not alive:
                    break
                if ended is None:
                    time.sleep(FOLLOW_SECONDS)
            if process is not None:
                process.wait()
        except BaseException as failure:  # could not follow the run: it fails alone
            if process is not None and process.poll() is None:
                process.kill()
                process.wait()
            ended = {"error": readable_error(failure)}
        if ended is not None:
            peak, error = ended.get("peak_rss"), ended.get("error")
            with self._lock:
                self._peak_rss = peak if isinstance(peak, int) and peak > 0 else self._peak_rss  # its own count: exact
            error = error if isinstance(error, str) or error is None else "the run ended with an unreadable report"
        elif process is not None:
            now = _oom_kills()
            error = exit_sentence(
                process.returncode or 0, peak_rss=self.peak_rss, memory_limit=self._memory_limit,
                oom_killed=None if None in (now, oom_kills) else now > oom_kills,
            )
        else:  # started elsewhere: its exit status went to that server
            error = (
                "the run's process ended without reporting why: it was killed, from outside or for lack of"
                " memory; it can be started again, smaller if it was memory"
            )
        if ended is None:  # the process ended without its end line: say why, for every follower
            with contextlib.suppress(OSError), open(files["events"], "a", encoding="utf-8") as events:
                events.write(json.dumps({"event": "end", "error": error, "peak_rss": self.peak_rss}) + "\n")
        self._end(error)

    @property
    def pid(self) -> int | None:
        """The training process's id (process mode, once started)."""
        if self._process is not None:
            return self._process.pid
        return self._followed[0] if self._followed is not None else None

    @property
    def peak_rss(self) -> int | None:
        """The training process's peak resident memory in bytes (process mode): so far while it
        runs (read every FOLLOW_SECONDS), then its own exact count once it has ended (a
        killed process's last reading)."""
        with self._lock:
            return self._peak_rss

    @property
    def status(self) -> str:
        with self._lock:
            return self._status

    @property
    def error(self) -> str | None:
        with self._lock:
            return self._error

    @property
    def progress(self) -> float:
        with self._lock:
            return self._progress

    @property
    def eta_seconds(self) -> float | None:
        """Seconds left at the pace since the first step; None until that pace is known."""
        with self._lock:
            if self._status == "finished":
                return 0.0
            if self._status != "running" or self._pace_from is None:
                return None
            started, progress_then = self._pace_from
            if self._progress <= progress_then:
                return None
            rate = (self._progress - progress_then) / (time.perf_counter() - started)
            return (1 - self._progress) / rate

    @property
    def history(self) -> dict[str, list[dict]]:
        with self._lock:
            return {"steps": list(self._steps), "epochs": list(self._epochs)}

    @property
    def latest_snapshot(self) -> SnapshotEvent | None:
        with self._lock:
            return self._latest_snapshot

    @property
    def checkpoint(self) -> str | None:
        """The checkpoint's path once the run has written its final one."""
        with self._lock:
            return self._done.checkpoint if self._done is not None else None

    @property
    def test_accuracy(self) -> float | None:
        with self._lock:
            return self._done.test_accuracy if self._done is not None else None


def evaluate_checkpoint(
    weights: str | Path, dataset: str = "shapes", *, device: str = "auto", data_root: str | Path | None = None,
    test_size: int | None = None, batch_size: int = 500, patch_size: int | None = None,
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
