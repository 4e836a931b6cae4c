"""The Features page's dictionaries: the sparse autoencoders a model has (shipped beside it, or
trained in the app or with ``python -m vit_explorer sae`` into the runs folder), each loaded once
for everybody with its index, and what one says about the sidebar's image: its latents per patch,
how much of each patch it explains, a latent's top patches over the training images, the latents
that matter for the prediction, and the pass with a latent steered.

An SAE fits a model when its card names that model's file (the same bytes) and its layer exists;
others are left out of the picker. The files in these folders may be anyone's (a run's, or copied
there), so the picker reads each one's card once per file version and skips, with a sentence, a
file that is broken, leads outside its folder, or whose card, weights or image set the page could
not use (an image set is one a run makes; a ``folder:`` one only inside the data folder or the
dictionaries' folders); the index is checked against its dictionary when that is loaded, and a
bad one leaves the dictionary without its gallery, said in a sentence. Everything computed here
is a few small matrix products of the page's own capture (its tokens at the SAE's layer), or one
pass resumed from that layer.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .. import resources
from ..data.datasets import DEFAULT_DATA_ROOT, DatasetError
from ..weights import catalogue
from ..features import effects
from ..features.evaluation import Evaluation
from ..features.index import LatentIndex, load_index
from ..features.sae import (
    NotAnSAEFile, SAEConfig, SAEError, SparseAutoencoder, check_fits, check_weights, load_sae, per_token_explained,
    read_card,
)
from ..features.steering import Steering
from ..text import LabelError
from ..features.tokens import ImageSource
from ..features.train import model_identity
from ..model.ablation import KnockOut
from ..model.capture import Capture, capture, layer_attention
from . import costs, images, models, runs, words
from .memo import memo
from .selection import Selection

TOP_LATENTS = 10  # a patch's strongest latents shown
# A top-1 probability above which steering can barely move the prediction (the change reads +0.00
# pts in points of probability): the page says so and names a less certain picture.
SATURATED = 0.995
MAX_GALLERY_SET_BYTES = 2**30  # a stored image set a gallery reads whole (its first count images)


@dataclass(frozen=True)
class Dictionary:
    """One SAE file, loaded: the dictionary, its card and its index (None: no index beside it)."""

    path: Path
    stamp: float  # the file's modification time: a run of the same name writes a new dictionary
    sae: SparseAutoencoder
    card: dict
    index: LatentIndex | None
    index_problem: str | None = None  # why its index file beside it is not used (a sentence)

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


def _inside(path: Path, folders: list[Path]) -> bool:
    """Whether ``path`` resolves (links followed) inside one of ``folders``."""
    target = Path(os.path.realpath(path))
    return any(target.is_relative_to(os.path.realpath(folder)) for folder in folders)


def image_folder_allowed(folder: Path) -> bool:
    """Whether a page may read pictures from ``folder`` (links followed): inside the data folder or
    the dictionaries' folders (weights/, the runs folder), as a dictionary's ``folder:`` image set."""
    return _inside(folder, [DEFAULT_DATA_ROOT, *_folders()])


def _card(path: Path, stamp: float) -> tuple[SAEConfig, dict] | str | None:
    """An SAE file's config and card from its header, once per file version: a sentence for a
    broken one, None for a file that is no dictionary (a model's checkpoint)."""
    def read() -> tuple[SAEConfig, dict] | str | None:
        if not _inside(path, [path.parent]):
            return "it leads outside its folder, which is refused"
        try:
            return read_card(path)
        except NotAnSAEFile:
            return None
        except SAEError as error:
            return str(error)
    return memo(("sae card", str(path), stamp), read)


def _image_set(card: dict) -> ImageSource:
    """The dictionary's image set, which the page reads: an SAEError sentence unless its card names
    one (read_card checked that it is one a run makes) and a ``folder:`` set lies inside the data
    folder or the dictionaries' own folders."""
    if "images" not in card:
        raise SAEError("this SAE file's card lacks its image set, which every run writes")
    source = ImageSource.from_dict(card["images"])
    folder = source.folder()
    if folder is not None and not image_folder_allowed(folder):
        raise SAEError("this SAE file's card names an image folder outside the data and dictionary folders, which is refused")
    return source


def _problem(path: Path, stamp: float, selection: Selection) -> str | None:
    """Why this model's dictionary at ``path`` cannot be offered (a sentence), once per file
    version and model; None: it can. Its weights are scanned a chunk at a time, not loaded."""
    def check() -> str | None:
        config, card = _card(path, stamp)
        try:
            check_fits(config, card, selection.base_model)
            if "mean" not in card:  # what the page's explained shares are measured from
                raise SAEError("this SAE file's card lacks its tokens' mean, which every run writes")
            _image_set(card)
            check_weights(path)
        except SAEError as error:
            return str(error)
        return None
    return memo(("sae problem", str(path), stamp, selection.model_key), check)


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


def choices(selection: Selection) -> tuple[dict[str, Path], list[str]]:
    """({label: path} of the SAEs that fit the sidebar's model and are offered to this person,
    newest first; a sentence for each file skipped: broken, or this model's and unusable). Another
    model's dictionary is left out without a word; so is one that someone else trained in the app
    and has not kept for everyone (a run is its owner's)."""
    identity = _identity(selection.model_key)
    if identity is None:
        return {}, []
    found, skipped = [], []
    for folder in _folders():
        for path in sorted(folder.glob("*.safetensors")) if folder.is_dir() else ():
            try:
                stamp = path.stat().st_mtime
            except OSError:  # gone since listed, or a link to nothing
                continue
            read = _card(path, stamp)
            if isinstance(read, str):
                skipped.append(f"{path.name} was skipped: {read}.")
                continue
            model = None if read is None else read[1].get("model")
            if not isinstance(model, dict) or model.get("digest") != identity["digest"]:
                continue
            owner = runs.dictionary_owner(path)
            if owner is not None and not (owner["mine"] or owner["kept"]):
                continue
            problem = _problem(path, stamp, selection)
            if problem is None:
                found.append((stamp, path, read[1], owner))
            else:
                skipped.append(f"{path.name} was skipped: {problem}.")
    found.sort(key=lambda item: -item[0])
    return {_choice_label(path, card, owner): path for _, path, card, owner in found}, skipped


def explained(card: dict) -> str:
    """How much of its layer a dictionary explains, named by the tokens it was measured on: a
    run's held-out tokens, or (an older card) its training tokens."""
    metrics = card.get("metrics", {})
    value = metrics.get("explained_variance")
    if value is None:
        return "explains a share its card does not say"
    if "held_out_tokens" in metrics:
        return f"explains {100 * value:.1f}% of held-out tokens' variance"
    return f"explains {100 * value:.1f}% of its training tokens' variance"


def _choice_label(path: Path, card: dict, owner: dict | None) -> str:
    whose = "" if owner is None else (
        f"your run {owner['number']}: " if owner["mine"] else f"someone's run {owner['number']}, kept for everyone: "
    )
    return f"{whose}{path.stem} (layer {card['layer']}, {explained(card)})"


def label_of(path: Path) -> str | None:
    """The picker's label of the dictionary at ``path`` for this person (None: no dictionary there)."""
    try:
        read = _card(path, path.stat().st_mtime)
    except OSError:
        return None
    return _choice_label(path, read[1], runs.dictionary_owner(path)) if isinstance(read, tuple) else None


def default_choice(offered: dict[str, Path]) -> str:
    """What the page opens on, the same for everybody: the dictionary shipped beside the model,
    else of those everyone is offered, the one that explains most of its layer."""
    shipped = resources.app_root() / "weights"

    def rank(label: str) -> tuple[bool, bool, float]:
        path, owner = offered[label], runs.dictionary_owner(offered[label])
        try:
            read = _card(path, path.stat().st_mtime)
        except OSError:  # gone since listed
            read = None
        value = read[1].get("metrics", {}).get("explained_variance") if isinstance(read, tuple) else None
        value = value if isinstance(value, (int, float)) and math.isfinite(value) else -math.inf
        return path.parent == shipped, owner is None or owner["kept"], value

    return max(offered, key=rank)


def measured(card: dict) -> Evaluation | None:
    """The evaluation on a dictionary's card (features.evaluation, written when its run ended or
    by ``sae --evaluate --write-card``); None for a card without one."""
    entry = card.get("evaluation")
    return Evaluation.from_card(entry) if isinstance(entry, dict) else None


def frontier(choices: dict[str, Path], layer: int) -> tuple[list[str], list[float], list[float]]:
    """(names, L0s, NMSEs) of the offered dictionaries of ``layer`` that were measured: the points
    of the sparsity-fidelity frontier, read from their cards (each read once per file version)."""
    names, l0, nmse = [], [], []
    for path in choices.values():
        try:
            read = _card(path, path.stat().st_mtime)
        except OSError:  # gone since listed
            continue
        if not isinstance(read, tuple) or read[1].get("layer") != layer:
            continue
        evaluation = measured(read[1])
        if evaluation is not None:
            names.append(path.stem)
            l0.append(evaluation.l0)
            nmse.append(evaluation.nmse)
    return names, l0, nmse


def dictionary(path: Path, selection: Selection) -> Dictionary:
    """The SAE at ``path`` and its index, loaded once for everybody (checked against the model
    first: another model's dictionary is refused in a sentence, SAEError)."""
    stamp = path.stat().st_mtime

    def load() -> Dictionary:
        sae, card = load_sae(path, selection.base_model)
        index_path = path.with_suffix(".index.npz")
        if not index_path.exists():
            return Dictionary(path, stamp, sae, card, None)
        try:
            if not _inside(index_path, [path.parent]):
                raise SAEError("its index file leads outside its folder, which is refused")
            source, model = _image_set(card), selection.base_model
            patch = model.config.patch_size
            index = load_index(index_path, sae.config.width)
            index.check_fits(source.count, (source.image_size[0] // patch, source.image_size[1] // patch),
                             model.num_prefix_tokens if card.get("prefix_tokens", False) else 0)
        except SAEError as error:
            return Dictionary(path, stamp, sae, card, None, str(error))
        return Dictionary(path, stamp, sae, card, index)

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
        # (P, m): k a token, or as many as a BatchTopK dictionary's threshold lets the busiest keep
        values, indices = latents.topk(max(chosen.sae.config.k, int((latents > 0).sum(-1).max())), dim=-1)
        patches = explained[cap.num_prefix_tokens:] if chosen.prefix_tokens else explained
        return ImageFeatures(indices, values, patches.reshape(cap.grid_size).numpy(), float(total))

    return selection.memo("sae features", chosen.key, compute=compute)


def gallery(chosen: Dictionary, latent: int) -> tuple[list[np.ndarray], list[int], list[float]]:
    """A latent's top-activating training patches from the index: their images (H, W, 3), patch
    and value, strongest first; re-made from the image set (shapes render from their index). An
    SAEError sentence where the set is too large to read here or cannot be read on this server."""
    def compute() -> tuple[list[np.ndarray], list[int], list[float]]:
        # Positions count the prefix tokens first when the dictionary read them: those have no patch to outline.
        prefix = chosen.index.num_prefix_tokens
        top = [(image, position - prefix, value) for image, position, value in chosen.index.top(latent)
               if position >= prefix]
        if not top:
            return [], [], []
        source = _image_set(chosen.card)
        if source.held_bytes() > MAX_GALLERY_SET_BYTES:
            raise SAEError(
                f"its {source.count:,} training images at {source.image_size[0]}x{source.image_size[1]} are more than"
                f" this server reads for a gallery ({MAX_GALLERY_SET_BYTES / 2**30:.0f} GB), so its top patches are not shown"
            )
        try:
            pictures = source.images(torch.tensor([image for image, _, _ in top]))  # (n, C, H, W) uint8
        except DatasetError:  # its message may name a folder of the server
            raise SAEError(f"its training images ({source.dataset.partition(':')[0]}) cannot be read on this server,"
                           " so its top patches are not shown") from None
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


def label_scores(selection: Selection) -> tuple[effects.LabelScores | None, str | None]:
    """A headless model's text tower's labels in force (this session's, or ImageNet's once their
    embeddings are there: nothing drawn meanwhile) and their id; (None, None) without."""
    model = None if selection.config.num_classes else words.words_model(selection.model_key)
    labels = words.session_labels()
    if model is None or not words.embeddings_kept(selection.model_key, labels):
        return None, None
    try:
        texts = words.label_embeddings(selection.model_key, labels).float()
    except LabelError:  # labels its tokenizer cannot read: the sidebar says so
        return None, None
    return effects.LabelScores(
        words.label_names(labels), lambda pooled: model.logits(model.project_image(pooled), texts.to(pooled.device)),
        model.scoring == "softmax",
    ), words.labels_id(labels)


def latent_effects(selection: Selection, chosen: Dictionary) -> effects.LatentEffects:
    """Which latents matter for this image's prediction (features.effects): its class, the best of
    the labels for a model with a text tower, else its pooled output; from the page's capture: the
    blocks above the dictionary's layer, forward and backward, then the top few removed in one
    batch, at most effects.EFFECT_FORWARDS forwards; once for everybody (keyed by the labels)."""
    labels, labels_id = label_scores(selection)

    def compute() -> effects.LatentEffects:
        tokens = selection.capture().tokens[:, chosen.layer + 1]
        return effects.latent_effects(selection.model, chosen.sae, chosen.layer, tokens, chosen.prefix_tokens,
                                      labels=labels)

    return selection.memo("sae effects", chosen.key, labels_id, compute=compute,
                          spinner="Finding the latents that matter ...")


def less_certain_sample(selection: Selection) -> str | None:
    """The label of the built-in picture (other than this one) this model is least sure of, if it
    is below SATURATED: one batched pass over the pictures, once per model and size for everybody;
    pictures of this one's kind (shapes, photos) first. None where there is none, or where that
    pass is not quick at this size (costs.is_quick)."""
    options = images.sample_image_options(selection.config.img_size)
    if selection.config.num_classes == 0 or not costs.is_quick(selection.config, len(options), timed=False):
        return None

    def compute() -> list[tuple[str, str, float]]:
        named, inputs = [], []
        for image_key, label in options.items():
            try:
                cache_key, picture = images.resolve_image(image_key, selection.config.img_size)
                inputs.append(selection.preprocess(picture))  # as the sidebar's choice reads it
            except (OSError, ValueError):  # a photo missing from this installation, or unreadable here
                continue
            named.append((cache_key, label))
        parameter = next(selection.model.parameters())
        with torch.no_grad():
            batch = torch.cat(inputs).to(parameter.device, parameter.dtype)
            top = selection.model(batch).float().softmax(-1).amax(-1)
        return [(key, label, probability) for (key, label), probability in zip(named, top.tolist())]

    sure = memo((selection.model_id, selection.patch_size, selection.config.img_size, "sample certainty"), compute)
    kind = selection.image_key.partition(":")[0]
    candidates = sorted(
        (key.partition(":")[0] != kind, probability, label) for key, label, probability in sure
        if key != selection.image_key and probability < SATURATED
    )
    if not candidates:
        return None
    _, probability, label = candidates[0]
    return f"{label} ({100 * probability:.1f}% sure)"
