"""An SAE run: a TopK sparse autoencoder trained on the tokens leaving one layer of a ViT over an
image set, as a generator of events (``train_sae``), like training.train's loop.

The tokens are captured where the model is, by running the blocks up to the layer only
(tokens.layer_tokens). When every image's tokens fit ``buffer_bytes`` they are captured once and
shuffled every epoch; otherwise each epoch captures chunks of images that fit, in a new order, and
trains on each chunk in turn, so the whole set is never held. The step (``SAETrainer.step``):
Adam on the MSE of the scaled tokens plus the AuxK loss of Gao et al. 2024 (the dead latents'
top ``d_model // 2`` pre-activations reconstruct the residual, weight 1/32), then the decoder's
rows back to unit norm. A latent is dead when it has fired on none of the last
``min(DEAD_AFTER_TOKENS, one epoch's tokens)`` training tokens; ``dead_share`` reports their share.

How well a dictionary explains its layer is one number, measured on held-out tokens: the last
images of the set (a tenth, at most ``HELD_OUT_TOKENS`` tokens) are never trained on; at each
epoch's end (and when stopped) the dictionary encodes their tokens, and the last such measure is
the run's last curve point and its card's ``explained_variance`` (a training interval's own
number runs ahead of it, and an epoch's average lags behind: neither is what a new image gets).

Under torchrun (WORLD_SIZE > 1: gloo on the CPU, nccl on CUDA) each rank captures an equal share of
the images (the remainder of a division by the ranks is left out of training, not of the index),
gradients are averaged by one all-reduce per step, and rank 0 writes the index of the latents'
top patches and the dictionary with its card (the index first, so that whoever finds the
dictionary finds its index). Every rank yields the events.

When it ends, rank 0 measures the dictionary on ``evaluation_images`` held-out images
(features.evaluation: NMSE, L0, dead and dense shares, the model with it spliced in) and writes
the numbers on its card.
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .. import resources
from ..model.config import _brief, _check_whole, _is_number, _JsonConfig
from ..model.devices import distributed_setup
from ..model.vit import ViT
from ..weights import TORCHVISION_VITS, catalogue, load_model, load_pretrained, resize_model
from .evaluation import evaluate, held_out
from .index import build_index, save_index
from .sae import ACTIVATIONS, MAX_PREFIXES, SAEConfig, SAEError, SparseAutoencoder, save_sae
from .tokens import MAX_IMAGE_SIDE, ImageSource, check_source_name, source_tokens, tokens_per_image

DEAD_AFTER_TOKENS = 10_000_000  # Gao et al.'s window; shorter runs use one epoch's tokens
AUXK_COEFFICIENT = 1 / 32
THRESHOLD_MOMENTUM = 0.99  # BatchTopK's threshold while training: an average over about the last 100 steps
CALIBRATION_BATCHES = 64  # batches the finished encoder's threshold is averaged over
CAPTURE_TOKENS = 2**14  # tokens per capturing forward pass (and per index pass)
HELD_OUT_TOKENS = 2**14  # at most this many tokens (of whole images) measure the dictionary
HELD_OUT_SHARE = 10  # one image in this many is held out, when that is fewer tokens
DEVICES = ("auto", "cpu", "cuda", "mps")
PRETRAINED = "pretrained:"  # weights naming a catalogue model, as the app's model keys do


@dataclass(frozen=True)
class SAETrainConfig(_JsonConfig):
    """One SAE run: the model and layer, the images, the dictionary's shape, the optimisation."""

    weights: str  # a checkpoint load_model reads, "default" (the shipped model) or "pretrained:NAME" (the catalogue's)
    layer: int  # the block whose output tokens it reads (0-based)
    dataset: str = "shapes"  # tokens.SOURCE_NAMES
    images: int = 2000
    image_size: int | None = None  # None: the model's
    prefix_tokens: bool = False  # read the class token and registers too
    expansion: int = 16  # latents = expansion * embed_dim
    k: int = 32  # active latents per token
    epochs: int = 2
    batch_size: int = 1024  # tokens per step (over all ranks)
    lr: float = 2e-3  # with the defaults: 0.96 of the shipped model's layer 2 held out in 226 steps (4e-4: 0.83)
    seed: int = 0
    device: str = "auto"  # "auto": cuda, then mps, then cpu
    out_dir: str = "runs"
    name: str | None = None  # file stem; None: sae_<model stem>_layer<L>
    buffer_bytes: int = 512 * 2**20  # training tokens held at once (per rank)
    log_every: int = 10  # steps between SAEStepEvents
    index_top: int = 16  # top tokens kept per latent in the index
    activation: str = "topk"  # "topk" or "batchtopk" (sae.ACTIVATIONS)
    matryoshka: int = 1  # nested dictionaries (1: none): widths F / 2**(n-1), ..., F / 2, F each trained alone
    evaluation_images: int = 256  # images the finished dictionary is measured on (features.evaluation)

    def __post_init__(self) -> None:
        if not isinstance(self.weights, str) or not self.weights:
            raise ValueError(f"weights must be a checkpoint path or 'default', not {_brief(self.weights)}")
        if self.pretrained is not None and self.pretrained not in (*catalogue.CATALOGUE, *TORCHVISION_VITS):
            raise ValueError(f"{_brief(self.pretrained)} is not a model of the catalogue")
        _check_whole("layer", self.layer, 0)
        if not isinstance(self.dataset, str):
            raise ValueError(f"dataset must be the name of an image set, not {_brief(self.dataset)}")
        check_source_name(self.dataset)
        for name in ("images", "expansion", "k", "epochs", "batch_size", "buffer_bytes", "log_every", "index_top",
                     "matryoshka", "evaluation_images"):
            _check_whole(name, getattr(self, name), 1)
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {', '.join(ACTIVATIONS)}, not {_brief(self.activation)}")
        if self.matryoshka > MAX_PREFIXES + 1:
            raise ValueError(f"matryoshka must be at most {MAX_PREFIXES + 1} nested dictionaries, not {self.matryoshka:,}")
        _check_whole("seed", self.seed, 0)
        if self.image_size is not None:
            _check_whole("image_size", self.image_size, 1)
            if self.image_size > MAX_IMAGE_SIDE:  # its image set could not be read again (tokens.ImageSource)
                raise ValueError(f"image_size must be at most {MAX_IMAGE_SIDE} pixels, not {self.image_size:,}")
        if not isinstance(self.prefix_tokens, bool):
            raise ValueError(f"prefix_tokens must be true or false, not {_brief(self.prefix_tokens)}")
        if not (_is_number(self.lr) and self.lr > 0):
            raise ValueError(f"lr must be a positive number, not {_brief(self.lr)}")
        if not isinstance(self.device, str) or self.device.split(":")[0] not in DEVICES:
            raise ValueError(f"device must be auto, cpu, cuda or mps, not {_brief(self.device)}")
        if not isinstance(self.out_dir, str) or not self.out_dir:
            raise ValueError(f"out_dir must be a folder, not {_brief(self.out_dir)}")
        if self.name is not None and (
            not isinstance(self.name, str) or self.name in ("", ".", "..") or any(c in self.name for c in "/\\\0")
        ):
            raise ValueError(
                f"the run name {_brief(self.name)} must be a plain file name, without /, \\ or .."
                " (its files go in the output folder)"
            )

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def prefixes(self, width: int) -> tuple[int, ...]:
        """The Matryoshka prefixes of a dictionary of ``width`` latents: each half the next; a
        SAEError sentence when the smallest would have fewer than ``k`` latents."""
        prefixes = tuple(width >> level for level in range(self.matryoshka - 1, 0, -1))
        if prefixes and prefixes[0] < self.k:
            raise SAEError(f"{self.matryoshka} nested dictionaries of {width:,} latents make the smallest"
                           f" {prefixes[0]:,} wide, fewer than k = {self.k}: choose fewer")
        return prefixes

    @property
    def pretrained(self) -> str | None:
        """The catalogue name of a "pretrained:NAME" model, else None."""
        return self.weights.removeprefix(PRETRAINED) if self.weights.startswith(PRETRAINED) else None

    @property
    def weights_path(self) -> Path:
        """The model's file: a catalogue model's where it was downloaded."""
        if self.pretrained is not None:
            return catalogue.cached_path(self.pretrained)
        return resources.shipped_weights() if self.weights == "default" else Path(self.weights).expanduser()

    @property
    def run_name(self) -> str:
        return self.name or f"sae_{self.weights_path.stem}_layer{self.layer}"

    def paths(self) -> dict[str, Path]:
        """Where the run writes: the dictionary (with its card) and its index."""
        folder = Path(self.out_dir).expanduser()
        return {"dictionary": folder / f"{self.run_name}.safetensors", "index": folder / f"{self.run_name}.index.npz"}


@dataclass
class SAEStepEvent:
    step: int  # optimizer steps done, 1..total_steps
    total_steps: int
    epoch: int  # 1..epochs
    mse: float  # mean squared error per token dimension, in the tokens' own scale, since the last event
    explained_variance: float  # 1 - residual / variance of those tokens
    l0: float  # active latents per token
    dead_share: float  # share of latents that have not fired for the dead window
    # On the held-out images' tokens (the card's number), at each epoch's end and when stopped; else None
    held_out_explained_variance: float | None = None


@dataclass
class SAECaptureEvent:
    images: int  # images whose tokens are captured so far, before the first step (0: starting)
    total_images: int  # the images captured before the first step (the first chunk)


@dataclass
class SAEDoneEvent:
    path: str  # the dictionary
    index_path: str
    metrics: dict  # explained_variance, mse, l0 on held_out_tokens held-out tokens; dead_share
    seconds: float
    stopped: bool = False  # stopped early: the files hold the dictionary so far


def model_identity(weights: str | os.PathLike) -> dict:
    """{"name", "path", "digest"} of a model's checkpoint: the digest (SHA-256 of its bytes, 16 hex
    digits; a folder's files in name order) names the same model wherever the file lies."""
    path = Path(weights)
    digest = hashlib.sha256()
    files = sorted(item for item in path.rglob("*") if item.is_file()) if path.is_dir() else [path]
    for file in files:
        if path.is_dir():
            digest.update(str(file.relative_to(path)).encode() + b"\0")
        with open(file, "rb") as handle:
            for block in iter(lambda: handle.read(2**22), b""):
                digest.update(block)
    return {"name": path.stem if path.is_file() else path.name, "path": str(path), "digest": digest.hexdigest()[:16]}


@torch.no_grad()
def initialise(sae: SparseAutoencoder, tokens: torch.Tensor, world: int = 1) -> None:
    """Set ``input_scale`` so that the tokens (N, D) scaled have a mean squared norm of D, and the
    decoder bias to their scaled mean (over every rank's tokens under torchrun)."""
    sums = torch.cat([tokens.pow(2).sum().view(1), tokens.sum(0), tokens.new_tensor([tokens.shape[0]])])
    if world > 1:
        dist.all_reduce(sums)
    count = sums[-1]
    scale = torch.sqrt(tokens.shape[1] / (sums[0] / count).clamp(min=1e-12))
    sae.input_scale.copy_(scale)
    sae.b_dec.copy_(sums[1:-1] / count * scale)


class SAETrainer:
    """The optimisation of one dictionary (already initialised): Adam, the TopK reconstruction plus
    AuxK loss, unit decoder rows, and how long each latent has gone without firing."""

    def __init__(self, sae: SparseAutoencoder, lr: float, dead_after_tokens: int = DEAD_AFTER_TOKENS, world: int = 1):
        self.sae, self.world, self.dead_after = sae, world, dead_after_tokens
        self.optimizer = torch.optim.Adam(sae.parameters(), lr=lr)
        device = sae.W_dec.device
        self.since_fired = torch.zeros(sae.config.width, dtype=torch.int64, device=device)  # tokens
        # Sums for the metrics are taken around this point near the tokens' mean (their scaled
        # mean at initialisation), so that the variance does not cancel out in floating point.
        self.reference = sae.b_dec.detach().clone()
        self.stats_dtype = torch.float32 if device.type == "mps" else torch.float64
        self.threshold_steps = 0  # BatchTopK: the steps its threshold has averaged

    def dead(self) -> torch.Tensor:
        """(F,) bool: the latents that have not fired for the dead window."""
        return self.since_fired >= self.dead_after

    def step(self, tokens: torch.Tensor, stop: bool = False) -> tuple[torch.Tensor, bool]:
        """One optimizer step on tokens (B, D); under torchrun every rank steps together. Returns the
        step's sums (what ``metrics`` reads) and whether any rank asked to stop."""
        sae, dead = self.sae, self.dead()
        target = tokens * sae.input_scale  # (B, D) scaled
        pre = sae.pre_activations(tokens)  # (B, F)
        values, latents, rows = self._active(pre)
        # The decode reads the rows each token uses, not a (B, F) product with a matrix of zeros:
        # for a ViT-B/16 layer (12,288 latents, k = 32) a 384th of the multiply-adds.
        parts = self._decoded_parts(values, latents, rows, tokens.shape[0])  # per nested dictionary: (B, D) what its new latents add
        error = sae.b_dec - target  # (B, D), becoming the whole dictionary's error
        loss = 0.0
        for part in parts:  # Matryoshka: every prefix reconstructs alone; else one part, the whole
            error = error + part
            loss = loss + error.pow(2).mean()
        if dead.any():
            loss = loss + AUXK_COEFFICIENT * self._auxk(pre, dead, -error.detach())
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        active = values > 0
        fired = torch.bincount(latents[active], minlength=sae.config.width)  # (F,)
        smallest = values.detach()[active].min() if rows is not None and active.any() else values.new_zeros(())
        if self.world > 1:
            fired, stop, smallest = self._all_reduce(fired, stop, smallest)
        self.optimizer.step()
        sae.normalise_decoder()
        if sae.config.activation == "batchtopk":
            self._estimate_threshold(smallest)
        self.since_fired += tokens.shape[0] * self.world
        self.since_fired[fired > 0] = 0
        with torch.no_grad():
            centred = (target - self.reference).to(self.stats_dtype)  # (B, D)
            sums = torch.stack([
                centred.new_tensor(tokens.shape[0]), error.pow(2).sum().to(self.stats_dtype),
                centred.pow(2).sum(), active.sum().to(self.stats_dtype),
            ])
            return torch.cat([sums, centred.sum(0)]), stop

    def _active(self, pre: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The kept latents of pre-activations (B, F): values and latents, and their tokens. TopK:
        each token's k largest, (B, k) each, tokens None; BatchTopK: the batch's k B largest,
        however they fall on its tokens (Bussmann et al. 2024), (k B,) each, token by token."""
        batch, width = pre.shape
        k = self.sae.config.k
        if self.sae.config.activation == "topk":
            values, latents = pre.topk(k, dim=-1)  # (B, k)
            return values.clamp(min=0), latents, None
        values, positions = pre.clamp(min=0).flatten().topk(min(k * batch, pre.numel()))  # (k B,)
        positions, order = positions.sort()  # token by token, as embedding_bag's bags
        return values[order], positions % width, positions // width

    def _decoded_parts(self, values: torch.Tensor, latents: torch.Tensor, rows: torch.Tensor | None,
                       batch: int) -> list[torch.Tensor]:
        """(B, D) what each nested dictionary's own latents add to every token (the first prefix's
        latents, then those up to the next prefix, ...): one part without Matryoshka."""
        widths = self.sae.config.widths
        # (TopK: every token's k in a row of a (B, k) bag; BatchTopK: (B,) where each token's start)
        offsets = None if rows is None else torch.searchsorted(rows, torch.arange(batch, device=rows.device))
        if len(widths) == 1:
            return [F.embedding_bag(latents, self.sae.W_dec, offsets, mode="sum", per_sample_weights=values)]
        part = torch.bucketize(latents, latents.new_tensor(widths), right=True)  # which nested dictionary adds each
        return [F.embedding_bag(latents, self.sae.W_dec, offsets, mode="sum", per_sample_weights=values * (part == index))
                for index in range(len(widths))]

    @torch.no_grad()
    def calibrate(self, tokens: torch.Tensor, batch_size: int, batches: int = CALIBRATION_BATCHES) -> None:
        """BatchTopK's threshold estimated again with the finished encoder: the smallest activation
        each batch of ``tokens`` (N, D) would keep, averaged over up to ``batches`` of them (and the
        ranks). The running average lags while the encoder still moves: on the shipped model's
        layer 2 after 200 steps it kept 3.5 latents a token where training kept 8."""
        smallest = []
        for rows in torch.arange(tokens.shape[0], device=tokens.device).split(batch_size)[:batches]:
            values, _, _ = self._active(self.sae.pre_activations(tokens[rows]))
            kept = values[values > 0]
            smallest.append(kept.min() if kept.numel() else values.new_zeros(()))
        estimate = torch.stack(smallest).mean()
        if self.world > 1:
            dist.all_reduce(estimate)
            estimate /= self.world
        self.sae.threshold.copy_(estimate)

    @torch.no_grad()
    def _estimate_threshold(self, smallest: torch.Tensor) -> None:
        """BatchTopK's inference threshold: the smallest activation a batch kept, averaged over the
        run (an exponential average, so that the early steps' are forgotten)."""
        threshold = self.sae.threshold
        threshold.copy_(smallest if self.threshold_steps == 0 else
                        THRESHOLD_MOMENTUM * threshold + (1 - THRESHOLD_MOMENTUM) * smallest)
        self.threshold_steps += 1

    def _auxk(self, pre: torch.Tensor, dead: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The dead latents' top ``d_model // 2`` pre-activations reconstruct what the live ones
        missed (normalised MSE): a gradient that brings dead latents back (Gao et al. 2024)."""
        k_aux = min(self.sae.config.d_model // 2, int(dead.sum()))
        values, indices = pre.masked_fill(~dead, -math.inf).topk(k_aux, dim=-1)  # (B, k_aux)
        auxiliary = F.embedding_bag(indices, self.sae.W_dec, per_sample_weights=values.clamp(min=0), mode="sum")
        return (auxiliary - residual).pow(2).sum() / residual.pow(2).sum().clamp(min=1e-12)

    def _all_reduce(self, fired: torch.Tensor, stop: bool, smallest: torch.Tensor) -> tuple[torch.Tensor, bool, torch.Tensor]:
        """One all-reduce per step: the gradients (averaged), which latents fired, the stop flag and
        the smallest kept activation (averaged: BatchTopK's threshold is the same on every rank)."""
        parameters = [parameter for parameter in self.sae.parameters() if parameter.grad is not None]
        flat = torch.cat([parameter.grad.flatten() for parameter in parameters]
                         + [fired.float(), fired.new_tensor([float(stop), float(smallest)], dtype=torch.float32)])
        dist.all_reduce(flat)
        offset = 0
        for parameter in parameters:
            parameter.grad.copy_(flat[offset : offset + parameter.numel()].view_as(parameter) / self.world)
            offset += parameter.numel()
        return flat[offset:-2], bool(flat[-2] > 0), flat[-1] / self.world

    def metrics(self, sums: torch.Tensor) -> dict[str, float]:
        """explained_variance, mse (per token dimension, in the tokens' scale), l0 and dead_share of
        summed step results (count, squared error, squared distance to the reference, active
        latents, then the (D,) distance to the reference)."""
        count, error, spread, active = sums[:4].tolist()
        variance = spread - float(sums[4:].pow(2).sum()) / max(count, 1)
        scale = float(self.sae.input_scale)
        return {
            "explained_variance": 1 - error / variance if variance > 0 else float("nan"),
            "mse": error / max(count * self.sae.config.d_model, 1) / scale**2,
            "l0": active / max(count, 1),
            "dead_share": float(self.dead().float().mean()),
        }

    def mean(self, sums: torch.Tensor) -> torch.Tensor:
        """(D,) the mean of the tokens summed in ``sums``, in their own scale."""
        return (self.reference + sums[4:].to(self.reference.dtype) / sums[0].clamp(min=1)) / self.sae.input_scale


def fit(
    sae: SparseAutoencoder, batches: Iterable[torch.Tensor], lr: float = 4e-4,
    dead_after_tokens: int = DEAD_AFTER_TOKENS,
) -> SAETrainer:
    """Train an initialised ``sae`` (see ``initialise``) on token batches (B, D), one step each, as
    ``train_sae`` does on a layer's tokens."""
    trainer = SAETrainer(sae, lr, dead_after_tokens)
    for tokens in batches:
        trainer.step(tokens)
    return trainer


def held_out_images(images: int, per_image: int) -> int:
    """How many of a set's ``images`` (the last ones) are held out of training to measure it:
    a tenth, at most HELD_OUT_TOKENS tokens' worth, at least one; an SAEError for a single image."""
    if images < 2:
        raise SAEError("an SAE run needs at least 2 images: one is held out to measure the dictionary")
    return max(1, min(images // HELD_OUT_SHARE, HELD_OUT_TOKENS // per_image))


@torch.no_grad()
def held_out_metrics(sae: SparseAutoencoder, tokens: torch.Tensor, batch_size: int) -> dict[str, float]:
    """explained_variance (1 - residual / variance around their own mean), mse (per token
    dimension, in the tokens' scale) and l0 of the dictionary on tokens (N, D) it never trained on,
    ``batch_size`` tokens at a time."""
    residual = active = variance = 0.0
    count = tokens.shape[0]
    mean = sum(rows.double().sum(0) for rows in tokens.split(batch_size)) / count  # (D,)
    for rows in tokens.split(batch_size):
        reconstruction, latents = sae(rows)
        residual += float((rows - reconstruction).double().pow(2).sum())
        variance += float((rows.double() - mean).pow(2).sum())
        active += float((latents > 0).sum())
    return {
        "explained_variance": 1 - residual / variance if variance > 0 else float("nan"),
        "mse": residual / (count * tokens.shape[1]), "l0": active / count,
    }


def _generator(*parts: int) -> torch.Generator:
    return torch.Generator().manual_seed(hash(parts) & 0x7FFF_FFFF_FFFF_FFFF)


def _model(config: SAETrainConfig, model: ViT | None, device: torch.device) -> ViT:
    """The model the run reads: the given one (never moved or changed: it may be shared) or the
    checkpoint's on ``device``, at ``config.image_size`` if one is asked."""
    size = config.image_size
    if model is None and config.pretrained is not None:  # downloaded once, checked, with its publisher's settings
        model = load_pretrained(config.pretrained).to(device)
    if model is None:
        return load_model(config.weights_path, **({} if size is None else {"image_size": size})).to(device)
    if size is not None and model.config.img_size != (size, size):
        return resize_model(model, image_size=size, share_weights=True)
    return model


def train_sae(
    config: SAETrainConfig, stop: threading.Event | None = None, model: ViT | None = None
) -> Iterator[SAECaptureEvent | SAEStepEvent | SAEDoneEvent]:
    """Train as ``config`` says, yielding SAECaptureEvents while the tokens of the first chunk are
    captured, an SAEStepEvent every ``log_every`` steps (and at each epoch's end) and finally an
    SAEDoneEvent, with the dictionary and its index on disk. Setting
    ``stop`` ends training after the current step; both files are still written. ``model``: the
    ViT of ``config.weights`` already loaded (the card still names the file)."""
    started = time.perf_counter()
    rank, world, device, own_group = distributed_setup(config.device)
    try:
        yield from _train(config, stop or threading.Event(), model, rank, world, device, started)
    finally:
        if own_group:
            dist.destroy_process_group()


def _train(config, stop, model, rank, world, device, started) -> Iterator[SAECaptureEvent | SAEStepEvent | SAEDoneEvent]:
    model = _model(config, model, device)
    depth, width = model.config.depth, model.config.embed_dim
    if config.layer >= depth:
        raise SAEError(f"layer {config.layer} does not exist; the model has layers 0..{depth - 1}")
    source = ImageSource(config.dataset, config.images, model.config.img_size, config.seed)
    per_image = tokens_per_image(model, config.prefix_tokens)
    trained = len(source) - held_out_images(len(source), per_image)  # the first images; the rest measure it
    if trained < world:
        raise SAEError(f"{trained} images cannot be shared by {world} processes")
    shard = torch.arange(rank, trained, world)[: trained // world]  # equal shares: every rank steps together
    chunk_images = max(1, config.buffer_bytes // (per_image * width * 4))
    local_batch = max(1, config.batch_size // world)
    steps_per_epoch = sum(math.ceil(len(chunk) * per_image / local_batch) for chunk in shard.split(chunk_images))
    total_steps = steps_per_epoch * config.epochs
    capture_images = max(1, CAPTURE_TOKENS // model.config.num_tokens)

    def capture(indices: torch.Tensor, report: bool) -> Iterator[SAECaptureEvent]:
        """The tokens of images ``indices`` (the generator's return value), a pass of images at a
        time; with ``report`` an event after each, since nothing else moves before the first step."""
        out = torch.empty(len(indices) * per_image, width, device=device)
        if report:
            yield SAECaptureEvent(images=0, total_images=len(indices))
        for start in range(0, len(indices), capture_images):
            piece = indices[start : start + capture_images]
            rows = slice(start * per_image, (start + len(piece)) * per_image)
            out[rows] = source_tokens(model, source, piece, config.layer, config.prefix_tokens, capture_images, device)
            if report:
                yield SAECaptureEvent(images=start + len(piece), total_images=len(indices))
        return out

    with torch.random.fork_rng(devices=[]):  # the same initial dictionary on every rank; others' RNG untouched
        torch.manual_seed(config.seed)
        latents = config.expansion * width
        sae = SparseAutoencoder(SAEConfig(width, latents, config.k, config.activation, config.prefixes(latents))).to(device)
    trainer, held, step, stopped = None, None, 0, False
    held_out_tokens, measured = None, None  # every rank measures the same dictionary on all of them
    first_epoch = None
    for epoch in range(config.epochs):
        order = shard[torch.randperm(len(shard), generator=_generator(config.seed, rank, epoch))]
        epoch_sums = interval = None
        for number, chunk in enumerate(order.split(chunk_images)):
            # One chunk holds the whole share: captured once, reshuffled every epoch.
            tokens = held if held is not None else (yield from capture(chunk, report=trainer is None))  # (chunk * P, D)
            if chunk_images >= len(shard):
                held = tokens
            if trainer is None:
                initialise(sae, tokens, world)
                trainer = SAETrainer(sae, config.lr, min(DEAD_AFTER_TOKENS, len(shard) * per_image * world), world)
            shuffle = torch.randperm(tokens.shape[0], generator=_generator(config.seed, rank, epoch, number))
            for rows in shuffle.to(device).split(local_batch):
                sums, stopped = trainer.step(tokens[rows], stop.is_set())
                interval = sums if interval is None else interval + sums
                step += 1
                if step % config.log_every == 0 or step % steps_per_epoch == 0 or stopped:
                    if world > 1:
                        dist.all_reduce(interval)
                    epoch_sums = interval if epoch_sums is None else epoch_sums + interval
                    event = _step_event(trainer, interval, step, total_steps, epoch)
                    if step % steps_per_epoch == 0 or stopped:
                        if sae.config.activation == "batchtopk":  # the threshold the held-out tokens are read with
                            trainer.calibrate(tokens, local_batch)
                        if held_out_tokens is None:
                            held_out_tokens = source_tokens(model, source, torch.arange(trained, len(source)),
                                                            config.layer, config.prefix_tokens, capture_images, device)
                        measured = held_out_metrics(sae, held_out_tokens, config.batch_size)
                        event.held_out_explained_variance = measured["explained_variance"]
                    yield event
                    interval = None
                if stopped:
                    break
            if stopped:
                break
        first_epoch = epoch_sums if first_epoch is None else first_epoch
        if stopped:
            break
    measured.update(dead_share=float(trainer.dead().float().mean()), held_out_tokens=held_out_tokens.shape[0])
    yield _finish(config, model, sae, source, trainer.mean(first_epoch), measured, stopped, capture_images,
                  rank, world, started)


def _step_event(trainer: SAETrainer, interval: torch.Tensor, step: int, total_steps: int, epoch: int) -> SAEStepEvent:
    metrics = trainer.metrics(interval)
    if not math.isfinite(metrics["mse"]):
        raise SAEError(f"the reconstruction error became {metrics['mse']} at step {step}; lower the learning rate")
    return SAEStepEvent(step=step, total_steps=total_steps, epoch=epoch + 1, **metrics)


def _finish(config, model, sae, source, mean, metrics, stopped, capture_images, rank, world, started) -> SAEDoneEvent:
    """The index (every rank indexes its share), then the dictionary and its card (rank 0)."""
    paths = config.paths()
    sae.eval()
    index = build_index(sae, model, source, config.layer, config.prefix_tokens, capture_images,
                        top=config.index_top, rank=rank, world=world)
    if rank == 0:
        save_index(index, paths["index"])
        measured_on = held_out(source, config.evaluation_images)
        evaluation = evaluate(sae, model, measured_on, config.layer, config.prefix_tokens, batch_size=capture_images)
        card = {
            "model": model_identity(config.weights_path), "embed_dim": model.config.embed_dim,
            "depth": model.config.depth, "layer": config.layer, "prefix_tokens": config.prefix_tokens,
            "images": source.to_dict(), "settings": config.to_dict(), "metrics": metrics,
            "mean": mean.tolist(), "stopped": stopped,
            "evaluation": evaluation.to_card(), "evaluation_images": measured_on.to_dict(),
        }
        temporary = paths["dictionary"].with_name(f".{paths['dictionary'].name}.tmp")
        save_sae(sae, temporary, card)
        os.replace(temporary, paths["dictionary"])
    if world > 1:
        dist.barrier()  # the files exist before any rank reports them
    return SAEDoneEvent(path=str(paths["dictionary"]), index_path=str(paths["index"]), metrics=metrics,
                        seconds=time.perf_counter() - started, stopped=stopped)
