"""A sparse autoencoder (SAE) over one layer's tokens: TopK activation (Gao et al. 2024), as saev and
overcomplete train them for ViTs, or BatchTopK (Bussmann et al. 2024), and optionally Matryoshka
prefixes (Nabeshima 2024; Bussmann et al. 2025).

The tokens ``x`` (D) of one layer are rescaled by the dictionary's ``input_scale`` (so that their
mean squared norm is D whatever the model), centred by the decoder bias, encoded into ``width``
latents of which the ``k`` largest positive ones are kept, and decoded as a sum of unit-norm
directions (the rows of ``W_dec``) plus the bias. A BatchTopK dictionary keeps the ``k * B`` largest
of a training batch of B tokens (a token may use more or fewer than k) and, at inference, every
latent above ``threshold``, the minimum kept activation averaged over training (so a token's code
does not depend on its batch). A Matryoshka dictionary's ``prefixes`` (nested widths below
``width``) were each trained to reconstruct the tokens alone: latents 0..m-1 are a dictionary too,
the first ones the most general. Plain PyTorch rather than a library: the module
is 40 lines, its encode/decode must run inside our own forward pass (steering, per call) and in a
worker without the library's training stack, and its file is ours to check before anything is
allocated (see ARCHITECTURE.md, Features).

Saved as one safetensors file: the tensors, and in its metadata the dictionary's config and its
card (the model it was trained on, the layer, the image set, the settings, the final metrics).
"""
from __future__ import annotations

import dataclasses
import json
import math
import pickle
import stat
import struct
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..model.config import _JsonConfig, _brief, _check_whole, _is_number
from .tokens import ImageSource, check_source_name

SAE_KEY = "vit_explorer.sae"  # the metadata entry that marks one of our SAE files
CARD_KEY = "vit_explorer.sae_card"
# A file may claim any size: what a dictionary may hold is bounded before anything is allocated.
MAX_LATENTS = 2**20
ACTIVATIONS = ("topk", "batchtopk")
MAX_PREFIXES = 16  # Matryoshka's nested widths (each halving the last: 2**16 latents apart)
MAX_WIDTH_BYTES = 2**31  # encoder and decoder together, float32


class SAEError(ValueError):
    """An SAE that cannot be used here (another model's, a broken file); ``str()`` is one sentence."""


class NotAnSAEFile(SAEError):
    """A readable safetensors file that is no dictionary (a model's checkpoint beside them)."""


@dataclass(frozen=True)
class SAEConfig(_JsonConfig):
    """The shape of a dictionary: the tokens' width ``d_model``, its ``width`` latents, ``k`` active."""

    d_model: int
    width: int
    k: int = 32
    activation: str = "topk"  # ACTIVATIONS; files written before BatchTopK read as "topk"
    prefixes: tuple[int, ...] = ()  # Matryoshka: the nested widths below ``width``, increasing

    def __post_init__(self) -> None:
        _check_whole("d_model", self.d_model, 1)
        _check_whole("width", self.width, 1)
        _check_whole("k", self.k, 1)
        if self.activation not in ACTIVATIONS:
            raise SAEError(f"a dictionary's activation must be one of {', '.join(ACTIVATIONS)}, not {_brief(self.activation)}")
        if not isinstance(self.prefixes, (list, tuple)) or len(self.prefixes) > MAX_PREFIXES:
            raise SAEError(f"the Matryoshka prefixes must be a list of at most {MAX_PREFIXES} widths,"
                           f" not {_brief(self.prefixes)}")
        for prefix in self.prefixes:
            _check_whole("a Matryoshka prefix", prefix, 1)
        widths = [*self.prefixes, self.width]
        if any(a >= b for a, b in zip(widths, widths[1:])):
            raise SAEError(f"the Matryoshka prefixes must increase and stay below the width ({self.width}),"
                           f" not {_brief(list(self.prefixes))}")
        object.__setattr__(self, "prefixes", tuple(self.prefixes))  # a file's JSON list back to a tuple
        if self.width > MAX_LATENTS or 2 * 4 * self.width * self.d_model > MAX_WIDTH_BYTES:
            raise SAEError(
                f"a dictionary of {self.width:,} latents over {self.d_model:,} dimensions is larger than this"
                f" server allows ({MAX_LATENTS:,} latents, {MAX_WIDTH_BYTES / 2**30:.0f} GB)"
            )
        if self.k > self.width:
            raise SAEError(f"k ({self.k}) must be at most the number of latents ({self.width})")

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "prefixes": list(self.prefixes)}

    @property
    def widths(self) -> tuple[int, ...]:
        """The nested dictionaries' widths, the whole one last: (width,) without Matryoshka."""
        return (*self.prefixes, self.width)


def top_k(pre: torch.Tensor, k: int) -> torch.Tensor:
    """(..., F) -> the same with all but each row's ``k`` largest positive values set to 0."""
    values, indices = pre.topk(k, dim=-1)
    return torch.zeros_like(pre).scatter_(-1, indices, values.clamp(min=0))


class SparseAutoencoder(nn.Module):
    def __init__(self, config: SAEConfig):
        super().__init__()
        self.config = config
        d, f = config.d_model, config.width
        self.W_enc = nn.Parameter(torch.empty(d, f))
        self.b_enc = nn.Parameter(torch.zeros(f))
        self.W_dec = nn.Parameter(torch.empty(f, d))
        self.b_dec = nn.Parameter(torch.zeros(d))
        # tokens * input_scale have a mean squared norm of d_model (set from the data before training)
        self.register_buffer("input_scale", torch.ones(()))
        if config.activation == "batchtopk":  # the inference threshold, estimated while training
            self.register_buffer("threshold", torch.zeros(()))
        nn.init.kaiming_uniform_(self.W_dec)
        with torch.no_grad():
            self.W_dec.div_(self.W_dec.norm(dim=1, keepdim=True))
            self.W_enc.copy_(self.W_dec.T)  # encoder starts as the decoder's transpose (Gao et al.)

    def pre_activations(self, x: torch.Tensor) -> torch.Tensor:
        """(..., D) tokens -> (..., F) every latent's value before TopK."""
        return (x * self.input_scale - self.b_dec) @ self.W_enc + self.b_enc

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """(..., D) tokens -> (..., F) latents: ``k`` nonzero per token (TopK), or those above the
        threshold (BatchTopK at inference)."""
        pre = self.pre_activations(x)
        if self.config.activation == "batchtopk":
            return pre * (pre > self.threshold.clamp(min=0))
        return top_k(pre, self.config.k)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """(..., F) latents -> (..., D) tokens, in the tokens' own scale."""
        return (latents @ self.W_dec + self.b_dec) / self.input_scale

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        latents = self.encode(x)
        return self.decode(latents), latents

    def directions(self) -> torch.Tensor:
        """(F, D) each latent's unit direction in the tokens' space (what it adds per unit)."""
        return self.W_dec / self.input_scale

    @torch.no_grad()
    def normalise_decoder(self) -> None:
        """Rows of W_dec back to unit norm (the encoder's scale absorbs the change)."""
        norms = self.W_dec.norm(dim=1, keepdim=True).clamp(min=1e-12)
        self.W_dec.div_(norms)
        self.W_enc.mul_(norms.T)
        self.b_enc.mul_(norms[:, 0])


def explained_variance(x: torch.Tensor, reconstruction: torch.Tensor) -> torch.Tensor:
    """1 - |x - x_hat|^2 / |x - mean x|^2 over tokens (..., D): the share of the tokens' variance
    the dictionary explains."""
    residual = (x - reconstruction).pow(2).sum()
    total = (x - x.mean(dim=0, keepdim=True)).pow(2).sum().clamp(min=1e-12)
    return 1 - residual / total


def per_token_explained(x: torch.Tensor, reconstruction: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
    """(N,) for tokens (N, D): 1 - |x - x_hat|^2 / |x - mean|^2 per token, ``mean`` the training
    tokens' mean: how much of this token the dictionary explains."""
    residual = (x - reconstruction).pow(2).sum(-1)
    total = (x - mean).pow(2).sum(-1).clamp(min=1e-12)
    return 1 - residual / total


def save_sae(sae: SparseAutoencoder, path: str | Path, card: dict) -> None:
    from safetensors.torch import save_file

    tensors = {name: tensor.detach().cpu().contiguous() for name, tensor in sae.state_dict().items()}
    metadata = {SAE_KEY: sae.config.to_json(), CARD_KEY: json.dumps(card)}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata=metadata)


# What reading a file may raise, beside the library's own error: a parser meets deep nesting, a
# short read, a huge claim or bytes of another format. Each becomes one SAEError sentence.
# (RuntimeError: zipfile's encrypted member.)
READ_ERRORS = (OSError, ValueError, TypeError, KeyError, EOFError, struct.error, zipfile.BadZipFile, zlib.error,
               MemoryError, RecursionError, OverflowError, RuntimeError, pickle.UnpicklingError)
WEIGHTS_CHUNK = 2**20  # values checked at once when a file's weights are scanned without loading them


def regular_file(path: Path) -> bool:
    """Whether ``path`` is a plain file (links followed): a pipe or a device would block a read or never end."""
    return stat.S_ISREG(path.stat().st_mode)


def read_card(path: str | Path) -> tuple[SAEConfig, dict]:
    """(config, card) of an SAE file, from its header alone: nothing is allocated for what it claims,
    and the card's entries have the types a run writes (``check_card``)."""
    from safetensors import SafetensorError, safe_open

    from ..weights.checks import CheckpointError, safetensors_header

    path = Path(path)
    try:
        if not regular_file(path):
            raise SAEError("this is not a readable SAE file: it is not a plain file")
        if path.stat().st_size < 8:  # not even a header's length
            raise SAEError("this is not a readable SAE file: it is too short to be a safetensors file")
        metadata = safetensors_header(path)  # a bounded header of a valid file: its metadata
        with safe_open(str(path), framework="pt") as file:
            tensors = {name: file.get_slice(name) for name in file.keys()}
            shapes = {name: part.get_shape() for name, part in tensors.items()}
            dtypes = {part.get_dtype() for part in tensors.values()}
    except SAEError:
        raise
    except CheckpointError:
        raise SAEError("this is not a readable SAE file: its header is too large or not a safetensors header") from None
    except (SafetensorError, *READ_ERRORS):
        raise SAEError("this is not a readable SAE file: it is truncated or not a safetensors file") from None
    if SAE_KEY not in metadata:
        raise NotAnSAEFile("this file is not a sparse autoencoder saved by vit_explorer")
    try:
        config = SAEConfig.from_json(metadata[SAE_KEY])
        card = json.loads(metadata.get(CARD_KEY, "{}"))
    except SAEError:
        raise  # a dictionary larger than allowed: its own sentence
    except READ_ERRORS as error:
        detail = "nested too deeply" if isinstance(error, RecursionError) else _brief(str(error))
        raise SAEError(f"this SAE file's settings are unreadable: {detail}") from None
    if not isinstance(card, dict):
        raise SAEError("this SAE file's card is unreadable")
    expected = {"W_enc": [config.d_model, config.width], "W_dec": [config.width, config.d_model],
                "b_enc": [config.width], "b_dec": [config.d_model], "input_scale": [],
                **({"threshold": []} if config.activation == "batchtopk" else {})}
    if shapes != expected or dtypes != {"F32"}:
        raise SAEError("this SAE file's tensors do not match the dictionary it describes")
    check_card(card, config)
    return config, card


def check_card(card: dict, config: SAEConfig) -> None:
    """An SAEError sentence unless each entry a run writes on the card (those present) has the
    type it writes: what a page reads of a card is then a number, a name or a list of numbers."""
    def whole(value) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 0

    def number(value) -> bool:  # metrics may be NaN (a run whose tokens have no variance)
        return isinstance(value, (int, float)) and not isinstance(value, bool)

    checks = {
        "layer": (whole, "a layer number"),
        "embed_dim": (whole, "a whole number"),
        "depth": (whole, "a whole number"),
        "prefix_tokens": (lambda value: isinstance(value, bool), "true or false"),
        "stopped": (lambda value: isinstance(value, bool), "true or false"),
        "model": (lambda value: isinstance(value, dict) and all(isinstance(value.get(key), str)
                                                                 for key in ("name", "digest")), "a model's name and digest"),
        "metrics": (lambda value: isinstance(value, dict) and all(number(item) for item in value.values()),
                    "numbers by name"),
        # features.evaluation.Evaluation.to_card: each named measure a number, or null where it does
        # not apply (the loss recovered of a headless model)
        "evaluation": (lambda value: isinstance(value, dict) and len(value) <= 32 and all(
            isinstance(name, str) and len(name) <= 64 and (item is None or number(item)) for name, item in value.items()
        ), "numbers by name"),
        "mean": (lambda value: isinstance(value, list) and len(value) == config.d_model
                 and all(_is_number(item) for item in value), f"{config.d_model} finite numbers"),
        "settings": (lambda value: isinstance(value, dict), "a run's settings"),
    }
    for key, (valid, what) in checks.items():
        if key in card and not valid(card[key]):
            raise SAEError(f"this SAE file's card has {key} {_brief(card[key])}, not {what}")
    for key in ("images", "evaluation_images"):  # what it was trained on, and measured on
        if key not in card:
            continue
        images = card[key]
        try:
            check_source_name(images["dataset"])  # its own words would repeat the name
        except (ValueError, TypeError, KeyError):  # DatasetError is a ValueError
            raise SAEError("this SAE file's card names an unknown image set") from None
        try:
            ImageSource.from_dict(images)
        except (ValueError, TypeError) as error:
            raise SAEError(f"this SAE file's card names an image set no run makes: {error}") from None


def _weights_refused() -> SAEError:
    return SAEError("this SAE file's weights are not all finite numbers (NaN or infinity), or its input scale is not"
                    " positive")


def check_weights(path: str | Path) -> None:
    """An SAEError sentence unless every weight of the SAE file (already read by ``read_card``) is
    finite and its input scale positive, read a chunk at a time: nothing the size of the
    dictionary is held."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as file:
            if not file.get_tensor("input_scale") > 0:
                raise _weights_refused()
            if "threshold" in file.keys() and not torch.isfinite(file.get_tensor("threshold")):
                raise _weights_refused()
            for name in ("W_enc", "W_dec", "b_enc", "b_dec"):
                part = file.get_slice(name)
                rows, *rest = part.get_shape()
                step = max(1, WEIGHTS_CHUNK // math.prod(rest))
                for start in range(0, rows, step):
                    if not torch.isfinite(part[start : start + step]).all():
                        raise _weights_refused()
    except SAEError:
        raise
    except (SafetensorError, *READ_ERRORS):
        raise SAEError("this SAE file's tensors are unreadable") from None


def check_fits(config: SAEConfig, card: dict, model=None, layer: int | None = None) -> None:
    """An SAEError sentence unless the dictionary reads ``model``'s tokens (their width, one of its
    layers) and, with ``layer``, that layer."""
    trained_on = card.get("layer")
    if model is not None:
        if config.d_model != model.config.embed_dim:
            raise SAEError(
                f"this dictionary reads {config.d_model}-wide tokens and the model's are"
                f" {model.config.embed_dim}-wide: it was trained on another model"
            )
        depth = model.config.depth
        if isinstance(trained_on, bool) or not isinstance(trained_on, int) or not 0 <= trained_on < depth:
            raise SAEError(
                f"this dictionary reads layer {_brief(trained_on)}, which the model (layers 0..{depth - 1}) does not"
                " have: it was trained on another model"
            )
    if layer is not None and trained_on != layer:
        raise SAEError(f"this dictionary reads layer {_brief(trained_on)}, not layer {layer}")


def load_sae(path: str | Path, model=None, layer: int | None = None) -> tuple[SparseAutoencoder, dict]:
    """(the SAE in eval mode on the CPU, its card) from an SAE file. Checked from its header before
    anything is allocated: with ``model`` (a ViT) its tokens' width and its layer must be the
    model's, with ``layer`` the card's layer must be that one; its weights must be finite; else an
    SAEError sentence."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    config, card = read_card(path)
    check_fits(config, card, model, layer)
    sae = SparseAutoencoder(config)
    try:
        sae.load_state_dict(load_file(str(path)))
    except (SafetensorError, RuntimeError, *READ_ERRORS):
        raise SAEError("this SAE file's tensors are unreadable") from None
    if not (all(torch.isfinite(tensor).all() for tensor in sae.state_dict().values()) and sae.input_scale > 0):
        raise _weights_refused()
    return sae.eval(), card
