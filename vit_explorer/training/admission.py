"""Admission: whether a training run fits, from its config alone, and the memory it is then granted
(and the bound on a job's worker, ``inference_memory``).

A run's peak memory is estimated before anything is allocated (``estimate_memory``), from the
model and the loop the run will use (``train.model_config``, ``train.EVAL_BATCH``), and a run that
does not fit is refused in one sentence (``admit``). ``Limits`` are what a server grants: runs at
once, the queue, the memory and threads of one run (from the environment). A run process keeps to
its grant (``limit_memory``) and reports what it used (``memory_status``).
"""
from __future__ import annotations

import functools
import os
import resource
from dataclasses import dataclass
from pathlib import Path

import torch

from ..data.datasets import SHAPE_CLASSES
from ..features.train import CAPTURE_TOKENS, HELD_OUT_TOKENS, SAETrainConfig
from ..model.config import TrainConfig, ViTConfig
from ..model.devices import resolve_device
from ..model.vit import ViT
from ..weights import CheckpointError, catalogue, load_metadata, load_model
from ..weights.footprint import Footprint
from ..weights.project import saved_config
from .train import EVAL_BATCH, model_config, smallest_patch_config

GB = 2**30
# A training process after importing torch and this package: 519 MB resident (VmHWM),
# about 690 MB once a first model has run (torch 2.14, Linux); the rest is allocator slack.
BASELINE_BYTES = 768 * 2**20
# Images per split when the config does not say (shapes renders these many; the others hold all).
SPLIT_SIZES = {"shapes": (16_000, 2_000), "cifar10": (50_000, 10_000), "mnist": (60_000, 10_000),
               "fashionmnist": (60_000, 10_000)}
RENDER_CHUNK = 256  # shapes are rendered 256 images at a time, with about 24 float maps each


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


@functools.lru_cache(maxsize=64)
def _parameter_count(config) -> int:
    # Building the model, even on the meta device, took 20 ms of a ViT-B's every view with a job
    # to ask for (the estimate its button says): once per config.
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


def _forward_floats(
    batch: int, tokens: int, dim: int, hidden: int, matrices: int, heads: int, depth: int, training: bool
) -> int:
    """Floats alive at the peak of one batch's forward (training: kept for backward) and backward."""
    # Per block: norms, qkv, attention output, projection, residuals (about 12 (B, N, D)) and the
    # MLP's (B, N, hidden): fc1's output and its activation, or with a SwiGLU gate (3 matrices)
    # the gate, the value, the gate's activation and their product.
    block = 12 * batch * tokens * dim + 2 * (matrices - 1) * batch * tokens * hidden
    if not training:  # no grad: one block at a time, through the fused attention (no (N, N) matrix)
        return block
    # The (B, nh, N, N) scores and softmax of an unfused attention; every block is kept for
    # backward, plus one block's gradients at a time.
    return (block + 2 * batch * heads * tokens**2) * (depth + 1)


@functools.lru_cache(maxsize=16)
def _model_config(path: str, stamp: float) -> ViTConfig:
    """The config of the model a sparse autoencoder run reads: from our file's header, else (a
    timm, torchvision or Hugging Face file) from the model loaded once."""
    try:
        fields = saved_config(load_metadata(path), Path(path).name)
    except CheckpointError:
        fields = None
    return ViTConfig.from_dict(fields) if fields is not None else load_model(path).config


def estimate_sae_memory(config: SAETrainConfig) -> MemoryEstimate:
    """An upper bound on a sparse autoencoder run's peak memory: the model, the dictionary with
    its gradients and Adam's two moments, one step's latents, the tokens held at once (at most
    ``buffer_bytes``, and the held-out ones) and one capturing pass. RunRefused: no readable model there, or no such layer."""
    path = config.weights_path
    try:
        if config.pretrained in catalogue.CATALOGUE:  # its file is the publisher's: the entry knows the model
            vit = catalogue.entry(config.pretrained).vit_config()
        else:
            vit = _model_config(str(path), path.stat().st_mtime)
    except (CheckpointError, OSError) as error:
        raise RunRefused(f"The model to read cannot be loaded: {error}") from None
    if not 0 <= config.layer < vit.depth:
        raise RunRefused(f"Layer {config.layer} does not exist: the model has layers 0..{vit.depth - 1}.")
    if config.image_size is not None:
        vit = vit.replace(image_size=config.image_size)
    width, dim = config.expansion * vit.embed_dim, vit.embed_dim
    per_image = vit.num_tokens if config.prefix_tokens else vit.num_patches
    dictionary = 4 * 4 * (2 * width * dim + width + dim)  # parameters, gradients, two Adam moments
    # Pre-activations, the kept latents, their gradients and AuxK's residual pass, per token of a step.
    step = 4 * 6 * config.batch_size * width
    capture_batch = max(1, CAPTURE_TOKENS // vit.num_tokens)
    capture = inference_memory(vit, capture_batch) - BASELINE_BYTES - 4 * _parameter_count(vit)
    # The training tokens held at once, and the held-out ones that measure the dictionary.
    tokens = (min(config.buffer_bytes, 4 * config.images * per_image * dim)
              + 4 * min(HELD_OUT_TOKENS, config.images * per_image) * dim)
    height, width_px = vit.img_size
    pixels = config.images * vit.in_chans * height * width_px if config.dataset != "shapes" else 0
    return MemoryEstimate(
        baseline=BASELINE_BYTES, model=4 * _parameter_count(vit) + dictionary, activations=max(step, capture),
        data=tokens + pixels,
    )


def estimate_memory(config: TrainConfig | SAETrainConfig) -> MemoryEstimate:
    """An upper bound on ``config``'s peak memory, from the config alone (nothing is allocated)."""
    if isinstance(config, SAETrainConfig):
        return estimate_sae_memory(config)
    train_n, test_n, classes = _dataset_sizes(config)
    vit = model_config(config).replace(num_classes=classes, class_names=None)
    height, width = vit.img_size
    pixels = vit.in_chans * height * width
    tokens = smallest_patch_config(config).num_tokens
    # Parameters, gradients, two AdamW moments and two parameter-sized foreach temporaries.
    model = 6 * 4 * _parameter_count(vit)
    shape = dict(
        tokens=tokens, dim=vit.embed_dim, hidden=vit.mlp_hidden, matrices=vit.mlp_matrices, heads=vit.num_heads,
        depth=vit.depth,
    )
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


def inference_memory(config, batch: int, kept_floats: int = 0) -> int:
    """An upper bound on the peak memory of a process of its own that runs ``config``'s model
    without gradients on ``batch`` images at once (a job's worker): the baseline, the parameters,
    one block's activations with its (B, nh, N, N) scores (should the attention not be fused), and
    ``kept_floats`` floats the computation keeps across the pass."""
    tokens = config.num_tokens
    block = _forward_floats(
        batch, tokens, config.embed_dim, config.mlp_hidden, config.mlp_matrices, config.num_heads, config.depth,
        training=False,
    )
    scores = 2 * batch * config.num_heads * tokens**2
    return BASELINE_BYTES + 4 * (_parameter_count(config) + block + scores + kept_floats)


def environment_number(name: str, default: float, kind: type = int, minimum: float = 1) -> float:
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
        max_runs = int(environment_number("VIT_EXPLORER_MAX_RUNS", max(1, cores // 2)))
        queue_size = int(environment_number("VIT_EXPLORER_RUN_QUEUE", 4, minimum=0))
        memory_gb = environment_number(
            "VIT_EXPLORER_RUN_MEMORY_LIMIT", available_memory() / 2 / max_runs / GB, float, minimum=0.1,
        )
        threads = int(environment_number("VIT_EXPLORER_RUN_THREADS", max(1, (cores - 1) // max_runs)))
        return cls(max_runs=max_runs, queue_size=queue_size, memory=int(memory_gb * GB), threads=threads)


def _gb(size: int) -> str:
    return f"{size / GB:.1f} GB"


def admit(config: TrainConfig | SAETrainConfig, limits: Limits) -> MemoryEstimate:
    """The run's estimate if it fits; else RunRefused with the estimate, the limit and what to lower."""
    estimate = estimate_memory(config)
    if isinstance(config, SAETrainConfig):
        lower = (
            f"lower the latents per dimension ({config.expansion}), the tokens per step ({config.batch_size})"
            f" or the images ({config.images})"
        )
    else:
        vit = smallest_patch_config(config)
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


def _size(size: int) -> str:
    return _gb(size) if size >= GB else f"{size / 2**20:,.0f} MB"


def admit_model(
    footprint: Footprint | None, models_bytes: int | None = None, device: torch.device | None = None,
    what: str = "this model", beside: int = 0,
) -> None:
    """Refuse in a sentence (CheckpointError), before its loader allocates anything, a model whose
    ``footprint`` (weights.footprint, from its headers) would not fit: its float32 weights, with
    the ``beside`` bytes of the model it goes with (a text tower's image tower), in the shared
    models' budget ``models_bytes`` (the app's VIT_EXPLORER_MODELS_MB; None: no such budget, as
    in the command line), its loading peak in the machine's available memory, its weights in a
    CUDA ``device``'s free memory. None: nothing to size (the loader refuses it)."""
    if footprint is None:
        return
    weights, peak = footprint.weights, footprint.peak
    if models_bytes is not None and weights + beside > models_bytes:
        together = f" ({_size(weights + beside)} with the image tower it goes with)" if beside else ""
        raise CheckpointError(
            f"{what} holds {_size(weights)} of weights in float32{together}, more than the {_size(models_bytes)}"
            " this server keeps for its shared models; choose a smaller model, or raise VIT_EXPLORER_MODELS_MB"
            " where the machine has the memory"
        )
    available = available_memory()
    if peak > available:
        raise CheckpointError(
            f"{what} would need about {_size(peak)} of memory to load ({_size(weights)} of weights in"
            f" float32), more than the {_size(available)} this machine has available now; choose a smaller"
            " model, or try again when the machine has more memory free"
        )
    if device is not None and device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        if weights > free:
            raise CheckpointError(
                f"{what} holds {_size(weights)} of weights in float32, more than the {_size(free)} free on"
                " the GPU now; choose a smaller model"
            )


def memory_status(field: str, pid: int | str = "self") -> int:
    """A Vm* field of /proc/<pid>/status in bytes (VmHWM: the peak resident memory)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name == field:
            return int(value.split()[0]) * 1024
    raise OSError(f"/proc/{pid}/status has no {field}")


def limit_memory(memory: int) -> None:
    """Keep this process to the ``memory`` bytes admitted: an allocation beyond them then fails here
    with a MemoryError rather than waking the OOM killer."""
    # The kernel counts the address space torch has mapped but not touched as data too: grant
    # that much on top of the admitted memory.
    untouched = memory_status("VmData") - memory_status("VmRSS")
    resource.setrlimit(resource.RLIMIT_DATA, (untouched + memory, resource.RLIM_INFINITY))
