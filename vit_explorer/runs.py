"""The training runs of a shared server: a memory estimate, admission, a bounded queue, owners.

One ``RunManager`` per server owns every run launched from the app. A launch is admitted before
anything is allocated: its peak memory is estimated from the config alone and refused, in one
sentence, when it exceeds what a run may use. At most ``max_runs`` train at once, each in its own
process (``TrainingRun(process=True)``); further launches wait in a queue of ``queue_size`` and
start by themselves when a slot frees; beyond that they are refused. Only the person who
launched a run (its owner token) may stop it. Ended runs are found again in the runs folder
after a restart, from the sidecar every checkpoint has.

Limits come from the environment (see ``Limits.from_environment``).
"""
from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import torch

from .config import TrainConfig, ViTConfig
from .data import SHAPE_CLASSES, TORCHVISION_DATASETS
from .model import ViT
from .train import TrainingError, TrainingRun, model_config, resolve_device

GB = 2**30
# A spawned training process after importing torch and this package: 519 MB resident (VmHWM),
# about 690 MB once a first model has run (torch 2.14, Linux); the rest is allocator slack.
BASELINE_BYTES = 768 * 2**20
# Images per split when the config does not say (shapes renders these many; the others hold all).
SPLIT_SIZES = {"shapes": (16_000, 2_000), "cifar10": (50_000, 10_000), "mnist": (60_000, 10_000),
               "fashionmnist": (60_000, 10_000)}
EVAL_BATCH = 500  # train.py evaluates in batches of 500
RENDER_CHUNK = 256  # shapes are rendered 256 images at a time, with about 24 float maps each
MAX_LISTED_RUNS = 50  # ended runs kept in the list (their files stay in the runs folder)

logger = logging.getLogger(__name__)


class RunRefused(Exception):
    """A launch that cannot be admitted; ``str()`` is the sentence to show."""


@dataclass(frozen=True)
class MemoryEstimate:
    """An upper bound on a run's peak memory, by part, in bytes."""

    baseline: int  # the process itself: interpreter, torch, this package
    model: int  # parameters, gradients, AdamW's two moments, its foreach temporaries
    activations: int  # one training batch kept for backward (attention matrices included), or an eval batch
    data: int  # the datasets the engine keeps on the device, while a new epoch's is made

    @property
    def device(self) -> int:
        """What lives on the training device (a GPU's memory for a CUDA run)."""
        return self.model + self.activations + self.data

    @property
    def total(self) -> int:
        return self.baseline + self.device


def _parameter_count(config) -> int:
    with torch.device("meta"):  # shapes only: nothing is allocated
        return sum(parameter.numel() for parameter in ViT(config).parameters())


def _dataset_sizes(config: TrainConfig) -> tuple[int, int, int]:
    """(training images, test images, classes) the run will hold."""
    name = config.dataset
    if name in SPLIT_SIZES:
        train_n, test_n = SPLIT_SIZES[name]
        classes = len(SHAPE_CLASSES) if name == "shapes" else 10
    else:  # an image folder: count its files (a fifth of them become the test split)
        root = Path(name.removeprefix("folder:")).expanduser()
        total = sum(len(files) for _, _, files in os.walk(root))
        train_n, test_n = total, total // 5
        classes = sum(1 for entry in root.iterdir() if entry.is_dir()) if root.is_dir() else 2
    if name == "shapes":  # shapes renders as many as asked; the others keep at most that many
        train_n, test_n = config.train_size or train_n, config.test_size or test_n
    else:
        train_n, test_n = min(config.train_size or train_n, train_n), min(config.test_size or test_n, test_n)
    return train_n, test_n, max(classes, 2)


def _forward_floats(batch: int, tokens: int, dim: int, hidden: int, heads: int, depth: int, training: bool) -> int:
    """Floats alive at the peak of one batch's forward (training: kept for backward) and backward."""
    # Per block: norms, qkv, attention output, projection, residuals (about 12 (B, N, D)) and the
    # MLP's (B, N, 4D) twice.
    block = 12 * batch * tokens * dim + 2 * batch * tokens * hidden
    if not training:  # no grad: one block at a time, through the fused attention (no (N, N) matrix)
        return block
    # The (B, nh, N, N) scores and softmax of an unfused attention; every block is kept for
    # backward, plus one block's gradients at a time.
    return (block + 2 * batch * heads * tokens**2) * (depth + 1)


def _at_smallest_patch(config: TrainConfig) -> ViTConfig:
    """The run's model at the smallest patch size it will run at, the one with the most tokens:
    a FlexiViT run draws a patch size per step from ``patch_sizes``, its model's own among them or not."""
    vit = model_config(config)
    return vit.replace(patch_size=min((vit.patch_size, *(config.patch_sizes or ()))))


def estimate_memory(config: TrainConfig) -> MemoryEstimate:
    """An upper bound on ``config``'s peak memory, from the config alone (nothing is allocated)."""
    train_n, test_n, classes = _dataset_sizes(config)
    vit = model_config(config).replace(num_classes=classes, class_names=None)
    height, width = vit.img_size
    pixels = vit.in_chans * height * width
    hidden = int(vit.embed_dim * vit.mlp_ratio)
    tokens = _at_smallest_patch(config).num_tokens
    # Parameters, gradients, two AdamW moments and two parameter-sized foreach temporaries.
    model = 6 * 4 * _parameter_count(vit)
    shape = dict(tokens=tokens, dim=vit.embed_dim, hidden=hidden, heads=vit.num_heads, depth=vit.depth)
    training = 4 * (_forward_floats(config.batch_size, training=True, **shape) + 3 * config.batch_size * pixels)
    evaluation = 4 * (_forward_floats(EVAL_BATCH, training=False, **shape) + 2 * EVAL_BATCH * pixels)
    # The probe's attention snapshot: captured, converted and sent (every layer, every head).
    snapshot = 3 * 4 * vit.depth * vit.num_heads * tokens**2
    # uint8 images: both splits, and a second training set while the next epoch's is made; plus
    # one chunk of shapes rendering, or a float copy of a split that has to be resized.
    data = 2 * train_n * pixels + test_n * pixels
    data += 4 * 24 * RENDER_CHUNK * height * width if config.dataset == "shapes" else 4 * train_n * pixels
    return MemoryEstimate(
        baseline=BASELINE_BYTES, model=model, activations=max(training, evaluation) + snapshot, data=data,
    )


def _environment_number(name: str, default: float, kind: type = int, minimum: float = 1) -> float:
    text = os.environ.get(name)
    if not text:
        return default
    try:
        value = kind(text)
    except ValueError:
        value = None
    if value is None or value < minimum:
        what = "a whole number" if kind is int else "a number"
        raise ValueError(f"{name} must be {what} of at least {minimum}, not {text!r}")
    return value


def available_memory() -> int:
    """The machine's available memory in bytes (MemAvailable, else the free pages)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


@dataclass(frozen=True)
class Limits:
    max_runs: int  # runs training at once
    queue_size: int  # launches that may wait for a slot
    memory: int  # bytes one run may use
    threads: int  # CPU threads of one run

    @classmethod
    def from_environment(cls) -> "Limits":
        """VIT_EXPLORER_MAX_RUNS (default: half the cores), VIT_EXPLORER_RUN_QUEUE (default 4),
        VIT_EXPLORER_RUN_MEMORY_LIMIT in GB (default: half the available memory, shared by the
        runs; the other half stays the server's) and VIT_EXPLORER_RUN_THREADS (default: the
        cores but one, shared by the runs)."""
        cores = os.cpu_count() or 1
        max_runs = int(_environment_number("VIT_EXPLORER_MAX_RUNS", max(1, cores // 2)))
        queue_size = int(_environment_number("VIT_EXPLORER_RUN_QUEUE", 4, minimum=0))
        memory_gb = _environment_number(
            "VIT_EXPLORER_RUN_MEMORY_LIMIT", available_memory() / 2 / max_runs / GB, float, minimum=0.1,
        )
        threads = int(_environment_number("VIT_EXPLORER_RUN_THREADS", max(1, (cores - 1) // max_runs)))
        return cls(max_runs=max_runs, queue_size=queue_size, memory=int(memory_gb * GB), threads=threads)


def _gb(size: int) -> str:
    return f"{size / GB:.1f} GB"


def admit(config: TrainConfig, limits: Limits) -> MemoryEstimate:
    """The run's estimate if it fits; else RunRefused with the estimate, the limit and what to lower."""
    estimate = estimate_memory(config)
    vit = _at_smallest_patch(config)
    lower = (
        f"lower the batch size ({config.batch_size}), use a larger patch size (patch {vit.patch_size}"
        f" gives {vit.num_tokens} tokens per image) or a smaller dim or depth ({vit.embed_dim}, {vit.depth})"
    )
    if estimate.total > limits.memory:
        raise RunRefused(
            f"This run would need about {_gb(estimate.total)} of memory, more than the"
            f" {_gb(limits.memory)} a run may use on this server; {lower}."
        )
    device = resolve_device(config.device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        if estimate.device > free:
            raise RunRefused(
                f"This run would need about {_gb(estimate.device)} of GPU memory, more than the"
                f" {_gb(free)} free now; {lower}."
            )
    return estimate


def ordinal(number: int) -> str:
    suffix = "th" if 10 <= number % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(number % 10, "th")
    return f"{number}{suffix}"


class RunManager:
    """Every run of one server, by id ("run 1", "run 2", ...), in launch order; thread-safe."""

    def __init__(self, runs_dir: str | Path, limits: Limits | None = None, *, process: bool = True):
        self.runs_dir = Path(runs_dir)
        self.limits = limits or Limits.from_environment()
        self._process = process  # False: threads of this process (quick tests of the bookkeeping)
        self._lock = threading.RLock()
        self._runs: dict[str, TrainingRun] = {}
        self._owners: dict[str, str] = {}
        self._queue: deque[str] = deque()
        self._rediscover()

    def _rediscover(self) -> None:
        """Ended runs from the runs folder, under the ids they had (their names end in _N)."""
        found = []
        for sidecar in self.runs_dir.glob("*.json"):
            checkpoint = sidecar.with_suffix(".safetensors")
            number = re.search(r"_(\d+)$", sidecar.stem)
            if number is None or not checkpoint.is_file():
                continue
            try:
                found.append((int(number.group(1)), TrainingRun.restored(checkpoint)))
            except TrainingError as error:  # its sentence names the file
                logger.warning("not listed as a run: %s", error)
            except Exception as error:  # whatever one file holds, the server and the other runs go on
                logger.warning(
                    "not listed as a run: %s could not be read (%s: %s)", sidecar, type(error).__name__, error
                )
        for number, run in sorted(found, key=lambda item: item[0])[-MAX_LISTED_RUNS:]:
            self._runs[f"run {number}"] = run

    def _next_number(self) -> int:
        numbers = [int(run_id.split()[-1]) for run_id in self._runs]
        return max(numbers, default=0) + 1

    def launch(self, config: TrainConfig, owner: str) -> str:
        """Admit ``config`` and start it, or queue it; its id. RunRefused says why not."""
        admit(config, self.limits)
        with self._lock:
            if len(self.running()) >= self.limits.max_runs and len(self._queue) >= self.limits.queue_size:
                raise RunRefused(
                    f"The server is busy: {self.limits.max_runs} runs are training and"
                    f" {len(self._queue)} are waiting, the most it takes; try again when one has ended."
                )
            number = self._next_number()
            run_id = f"run {number}"
            name = f"app_{config.dataset.split(':')[0]}_{time.strftime('%Y%m%d-%H%M%S')}_{number}"
            self._runs[run_id] = TrainingRun(
                config.replace(out_dir=str(self.runs_dir), name=name), process=self._process,
                threads=self.limits.threads, memory_limit=self.limits.memory, on_end=self._promote,
            )
            self._owners[run_id] = owner
            self._queue.append(run_id)
            self._forget_old_runs()
        self._promote()
        return run_id

    def _forget_old_runs(self) -> None:
        ended = [run_id for run_id, run in self._runs.items() if run.status not in ("pending", "running")]
        for run_id in ended[: max(0, len(ended) - MAX_LISTED_RUNS)]:
            del self._runs[run_id]
            self._owners.pop(run_id, None)

    def _promote(self) -> None:
        """Start queued runs, first come first served, while there are free slots."""
        with self._lock:
            while self._queue and len(self.running()) < self.limits.max_runs:
                self._runs[self._queue.popleft()].start()

    def runs(self) -> dict[str, TrainingRun]:
        with self._lock:
            return dict(self._runs)

    def running(self) -> dict[str, TrainingRun]:
        with self._lock:
            return {run_id: run for run_id, run in self._runs.items() if run.status == "running"}

    def queued(self) -> list[str]:
        with self._lock:
            return list(self._queue)

    def place(self, run_id: str) -> int | None:
        """1 for the next run to start, 2 for the one after, ...; None when not waiting."""
        with self._lock:
            return self._queue.index(run_id) + 1 if run_id in self._queue else None

    def owns(self, run_id: str, owner: str) -> bool:
        with self._lock:
            return self._owners.get(run_id) == owner

    def owner_of(self, run_id: str) -> str | None:
        """The token that launched a run; None for runs found in the runs folder."""
        with self._lock:
            return self._owners.get(run_id)

    def stop(self, run_id: str, owner: str) -> bool:
        """Stop a running run, or withdraw a waiting one, if ``owner`` launched it; whether it did."""
        with self._lock:
            if not self.owns(run_id, owner):
                return False
            if run_id in self._queue:
                self._queue.remove(run_id)
                del self._runs[run_id], self._owners[run_id]
                return True
            self._runs[run_id].stop()
            return True

    def shutdown(self, timeout: float = 60) -> None:
        """Withdraw the waiting runs, stop the running ones and wait for them (their checkpoints)."""
        with self._lock:
            for run_id in self._queue:
                del self._runs[run_id], self._owners[run_id]
            self._queue.clear()
            running = list(self.running().values())
        for run in running:
            run.stop()
        for run in running:
            run.join(timeout)
