"""The Features page's dictionaries: the sparse autoencoders a model has (shipped beside it, or
trained in the app or with ``python -m vit_explorer sae`` into the runs folder), each loaded once
for everybody with its index, and what one says about the sidebar's image: its latents per patch,
how much of each patch it explains, a latent's top patches over the training images, and the pass
with a latent steered.

An SAE fits a model when its card names that model's file (the same bytes) and its layer exists;
others are left out of the picker. Everything computed here is a few small matrix products of the
page's own capture (its tokens at the SAE's layer), or one pass resumed from that layer.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .. import resources
from ..weights import catalogue
from ..features.index import LatentIndex, load_index
from ..features.sae import SAEError, SparseAutoencoder, load_sae, per_token_explained, read_card
from ..features.steering import Steering
from ..features.tokens import ImageSource
from ..features.train import model_identity
from ..model.ablation import KnockOut
from ..model.capture import Capture, capture, layer_attention
from . import models, runs
from .memo import memo
from .selection import Selection

TOP_LATENTS = 10  # a patch's strongest latents shown


@dataclass(frozen=True)
class Dictionary:
    """One SAE file, loaded: the dictionary, its card and its index (None: no index beside it)."""

    path: Path
    stamp: float  # the file's modification time: a run of the same name writes a new dictionary
    sae: SparseAutoencoder
    card: dict
    index: LatentIndex | None

    @property
    def key(self) -> tuple[str, float]:
        """What the results computed from this dictionary are cached under."""
        return str(self.path), self.stamp

    @property
    def layer(self) -> int:
        return int(self.card["layer"])

    @property
    def prefix_tokens(self) -> bool:
        return bool(self.card.get("prefix_tokens", False))


def _folders() -> list[Path]:
    return [resources.app_root() / "weights", runs.RUNS_DIR]


def _card(path: Path, stamp: float) -> dict | None:
    """An SAE file's card from its header, once per file version; None for a file that is not one."""
    def read() -> dict | None:
        try:
            return read_card(path)[1]
        except SAEError:
            return None
    return memo(("sae card", str(path), stamp), read)


def model_file(model_key: str) -> Path | None:
    """The file the app loaded this model from (None: a catalogue model not downloaded)."""
    if model_key == models.DEFAULT_MODEL:
        return models.default_weights()
    if model_key.startswith("file:"):
        return Path(model_key.removeprefix("file:"))
    name = model_key.removeprefix("pretrained:")
    return catalogue.cached_path(name) if catalogue.is_downloaded(name) else None


def run_weights(model_key: str) -> str | None:
    """What an SAE run is told to read for this model (features.train.SAETrainConfig.weights): its
    file, or a catalogue model by name (its file needs the catalogue's settings); None: not here."""
    if model_key.startswith("pretrained:"):
        return model_key if model_file(model_key) is not None else None
    path = model_file(model_key)
    return None if path is None else str(path)


def _identity(model_key: str) -> dict | None:
    path = model_file(model_key)
    if path is None or not path.exists():
        return None
    stat = path.stat()
    return memo(("model identity", str(path), stat.st_mtime, stat.st_size), lambda: model_identity(str(path)))


def choices(selection: Selection) -> dict[str, Path]:
    """{label: path} of the SAEs that fit the sidebar's model, newest first."""
    identity = _identity(selection.model_key)
    if identity is None:
        return {}
    found = []
    for folder in _folders():
        for path in folder.glob("*.safetensors") if folder.is_dir() else ():
            stamp = path.stat().st_mtime
            card = _card(path, stamp)
            layer = None if card is None else card.get("layer")
            model = None if card is None else card.get("model")
            if isinstance(model, dict) and model.get("digest") == identity["digest"] \
                    and type(layer) is int and 0 <= layer < selection.config.depth:
                found.append((stamp, path, card))
    found.sort(key=lambda item: -item[0])
    return {_choice_label(path, card): path for _, path, card in found}


def _choice_label(path: Path, card: dict) -> str:
    explained = card.get("metrics", {}).get("explained_variance")
    shown = "" if explained is None else f", explains {100 * explained:.0f}%"
    return f"{path.stem} (layer {card['layer']}{shown})"


def dictionary(path: Path, selection: Selection) -> Dictionary:
    """The SAE at ``path`` and its index, loaded once for everybody (checked against the model
    first: another model's dictionary is refused in a sentence, SAEError)."""
    stamp = path.stat().st_mtime

    def load() -> Dictionary:
        sae, card = load_sae(path, selection.base_model)
        index_path = path.with_suffix(".index.npz")
        return Dictionary(path, stamp, sae, card, load_index(index_path) if index_path.exists() else None)

    return memo(("sae", str(path), stamp, selection.model_key), load, spinner="Loading the dictionary ...")


@dataclass(frozen=True)
class ImageFeatures:
    """What the dictionary makes of this image's tokens at its layer: each patch's active latents
    (P, k) and values, and how much of each patch (gh, gw) and of the whole image it explains."""

    latents: torch.Tensor  # (P, k) latent indices, strongest first
    values: torch.Tensor  # (P, k)
    explained: np.ndarray  # (gh, gw)
    explained_overall: float

    def top(self, patch: int) -> tuple[list[int], np.ndarray]:
        """A patch's active latents (nonzero), strongest first, at most TOP_LATENTS."""
        values = self.values[patch]
        keep = values > 0
        return self.latents[patch][keep][:TOP_LATENTS].tolist(), values[keep][:TOP_LATENTS].numpy()

    def latent_map(self, latent: int, grid_size: tuple[int, int]) -> np.ndarray:
        """(gh, gw) the latent's activation on every patch (0 where it is not among a patch's k)."""
        hits = (self.latents == latent) * self.values  # (P, k)
        return hits.sum(dim=1).reshape(grid_size).numpy()

    def strongest(self) -> list[int]:
        """The latents strongest anywhere on this image, strongest first."""
        best: dict[int, float] = {}
        for latent, value in zip(self.latents.flatten().tolist(), self.values.flatten().tolist()):
            if value > best.get(latent, 0.0):
                best[latent] = value
        return sorted(best, key=best.get, reverse=True)


def _tokens(cap: Capture, layer: int, prefix_tokens: bool) -> torch.Tensor:
    """(P, D) the image's tokens leaving ``layer`` that the dictionary reads (the patches, or all)."""
    tokens = cap.tokens[0, layer + 1]
    return tokens if prefix_tokens else tokens[cap.num_prefix_tokens:]


def image_features(selection: Selection, chosen: Dictionary) -> ImageFeatures:
    """The dictionary on this image's captured tokens: no pass of the model (its capture is the
    page's), one encode and decode of P tokens."""
    def compute() -> ImageFeatures:
        cap = selection.capture()
        tokens = _tokens(cap, chosen.layer, chosen.prefix_tokens).float()
        with torch.no_grad():
            reconstruction, latents = chosen.sae(tokens)
            mean = torch.tensor(chosen.card["mean"], dtype=torch.float32)
            explained = per_token_explained(tokens, reconstruction, mean)
            total = 1 - (tokens - reconstruction).pow(2).sum() / (tokens - mean).pow(2).sum().clamp(min=1e-12)
        values, indices = latents.topk(chosen.sae.config.k, dim=-1)  # (P, k)
        patches = explained[cap.num_prefix_tokens:] if chosen.prefix_tokens else explained
        return ImageFeatures(indices, values, patches.reshape(cap.grid_size).numpy(), float(total))

    return selection.memo("sae features", chosen.key, compute=compute)


def gallery(chosen: Dictionary, latent: int) -> tuple[list[np.ndarray], list[int], list[float]]:
    """A latent's top-activating training patches from the index: their images (H, W, 3), patch
    and value, strongest first; re-made from the image set (shapes render from their index)."""
    def compute() -> tuple[list[np.ndarray], list[int], list[float]]:
        # Positions count the prefix tokens first when the dictionary read them: those have no patch to outline.
        prefix = chosen.index.num_prefix_tokens
        top = [(image, position - prefix, value) for image, position, value in chosen.index.top(latent)
               if position >= prefix]
        if not top:
            return [], [], []
        source = ImageSource.from_dict(chosen.card["images"])
        pictures = source.images(torch.tensor([image for image, _, _ in top]))  # (n, C, H, W) uint8
        return ([picture.permute(1, 2, 0).numpy() for picture in pictures],
                [patch for _, patch, _ in top], [value for _, _, value in top])

    return memo(("sae gallery", chosen.key, latent), compute, spinner="Finding its top patches ...")


def steered_capture(
    selection: Selection, chosen: Dictionary, latent: int, factor: float, knock_out: KnockOut | None = None,
) -> Capture:
    """The page's pass with ``latent`` scaled by ``factor`` at the dictionary's layer (and
    ``knock_out``'s heads and branches removed, when given), resumed from the intact capture at the
    first layer they change: at most one pass. The shared model and every other session are untouched."""
    intact = selection.capture()
    steering = Steering(chosen.sae, chosen.layer, {latent: factor}, chosen.prefix_tokens)
    return selection.memo(
        "steered capture", chosen.key, latent, factor, knock_out, spinner="Running the model with it steered ...",
        compute=lambda: capture(
            selection.model, selection.model_input(), layers=intact.layers, attention_dtype=intact.attentions.dtype,
            knock_out=knock_out, steering=steering, intact=intact,
        ),
    )


def steered_attention(
    selection: Selection, chosen: Dictionary, latent: int, factor: float, layer: int, knock_out: KnockOut | None = None,
) -> torch.Tensor:
    """(heads, N, N) ``layer``'s attention in the steered pass, from the steered tokens entering it."""
    steered = steered_capture(selection, chosen, latent, factor, knock_out)
    return selection.memo("steered attention", chosen.key, latent, factor, layer, knock_out, compute=lambda: layer_attention(
        selection.model, steered.tokens[:, layer], layer, steered.grid_size, torch.float16,
    )[0])
