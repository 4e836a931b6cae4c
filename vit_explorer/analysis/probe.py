"""A probe a person labels: a few patches of one image or several clicked as "object" and
"background" (or up to four labels of their own), a logistic regression (scikit-learn, on
standardised tokens) fitted on one layer's tokens of those patches, and every patch of every image
of the set segmented by it at once. DINOv3's own notebooks train such a probe on a few labelled
images to find the foreground.

- :func:`fit_probe`: one layer's tokens (B, P, D) -> :class:`Probe`: the held-out accuracy (a
  split of the labelled patches: a quarter held out when there are enough of them, else each held
  out once in a few folds, and the sentence says which and how many), then the probe fitted on
  every labelled patch, its label (B, gh, gw) and probabilities (B, gh, gw, labels) for every patch.
- :func:`probe_layers`: the same labels on every layer's tokens (a capture's (B, L + 1, N, D)):
  the held-out accuracy across the layers, with the same split at every layer (which layer knows
  the object best).

A label is ``(image, patch, label)``: ``image`` an index into the set or, with ``images`` (the
set's keys, an upload's digest say), a key; ``patch`` a row-major index or a (row, column) pair;
``label`` a name of ``names`` or its index. Bad labels are an :class:`AnalysisError` in one
sentence (none labelled, one label only, every patch one label, a patch on an image no longer in
the set, a patch labelled twice two ways), and nothing given is changed: the person's labels stay
as they were, to fix and try again.

No forward pass: the tokens come from a capture the page already has.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from sklearn.linear_model import LogisticRegression
from sklearn.model_selection import StratifiedKFold, train_test_split
from sklearn.pipeline import Pipeline, make_pipeline
from sklearn.preprocessing import StandardScaler

from .checks import AnalysisError

MAX_LABELS = 4
DEFAULT_NAMES = ("object", "background")
# A single split holds out this share once there are SPLIT_AT labelled patches and at least
# SPLIT_EACH of every label; with fewer, every labelled patch is held out once, in at most FOLDS folds.
HELD_OUT_SHARE = 0.25
SPLIT_AT = 40
SPLIT_EACH = 5
FOLDS = 5
C = 1.0  # the regression's inverse L2 strength (scikit-learn's default)
MAX_ITER = 1000


def make_classifier(seed: int = 0, c: float = C) -> Pipeline:
    """The probe before it is fitted: standardised tokens, then a (multinomial) logistic regression."""
    return make_pipeline(StandardScaler(), LogisticRegression(C=c, max_iter=MAX_ITER, random_state=seed))


@dataclass(frozen=True)
class Labelled:
    """The labelled patches, checked: parallel arrays, one entry per patch (duplicates merged)."""

    images: np.ndarray  # (n,) int image indices into the set
    patches: np.ndarray  # (n,) int row-major patch indices
    labels: np.ndarray  # (n,) int label indices into names
    names: tuple[str, ...]

    def __len__(self) -> int:
        return len(self.labels)


def _names(names: Sequence[str] | None, labels: Sequence) -> tuple[str, ...]:
    if names is None:
        used = [label for *_, label in labels if isinstance(label, str)]
        names = tuple(dict.fromkeys(used)) or DEFAULT_NAMES
        if len(names) == 1:
            names = names + tuple(name for name in DEFAULT_NAMES if name not in names)[:1]
    names = tuple(str(name) for name in names)
    if len(names) < 2:
        raise AnalysisError("A probe needs two labels at least (say 'object' and 'background'): add another label.")
    if len(names) > MAX_LABELS:
        raise AnalysisError(f"A probe takes at most {MAX_LABELS} labels, not {len(names)}: merge some of them.")
    if len(set(names)) != len(names):
        raise AnalysisError("Two labels have the same name: give each label its own.")
    return names


def check_labels(
    labels: Sequence, num_images: int, grid_size: tuple[int, int], names: Sequence[str] | None = None,
    images: Sequence | None = None,
) -> Labelled:
    """The labels (``(image, patch, label)`` each; module docstring) checked against a set of
    ``num_images`` images of ``grid_size`` patches, as arrays. Raises AnalysisError in a sentence."""
    labels = list(labels)
    names = _names(names, labels)
    if not labels:
        raise AnalysisError("No patch is labelled yet: click a few patches of each label first.")
    grid_h, grid_w = grid_size
    keys = None if images is None else {key: index for index, key in enumerate(images)}
    if keys is not None and len(keys) != num_images:
        raise AnalysisError(f"The set has {num_images} images but {len(images)} keys (or two images with one key).")
    found: dict[tuple[int, int], int] = {}
    missing: list = []  # the images of labelled patches that are not in the set
    for entry in labels:
        try:
            image, patch, label = entry
        except (TypeError, ValueError):
            raise AnalysisError(f"A label is (image, patch, label), not {entry!r}.") from None
        if keys is not None:
            if image not in keys:
                missing.append(image)
                continue
            image = keys[image]
        elif not (isinstance(image, (int, np.integer)) and 0 <= image < num_images):
            missing.append(image)
            continue
        if isinstance(patch, (tuple, list)):
            row, column = patch
            if not (0 <= row < grid_h and 0 <= column < grid_w):
                raise AnalysisError(f"Patch ({row}, {column}) is outside the {grid_h} x {grid_w} grid.")
            patch = row * grid_w + column
        if not 0 <= int(patch) < grid_h * grid_w:
            raise AnalysisError(f"Patch {patch} is outside the {grid_h} x {grid_w} grid.")
        if isinstance(label, str):
            if label not in names:
                raise AnalysisError(f"'{label}' is not one of the labels ({', '.join(names)}).")
            label = names.index(label)
        elif not 0 <= int(label) < len(names):
            raise AnalysisError(f"Label {label} is not one of the {len(names)} labels.")
        where = (int(image), int(patch))
        if where in found and found[where] != int(label):
            row, column = divmod(where[1], grid_w)
            raise AnalysisError(
                f"Patch ({row}, {column}) of image {where[0] + 1} is labelled both '{names[found[where]]}' "
                f"and '{names[int(label)]}': keep one."
            )
        found[where] = int(label)
    if missing:
        patches = "1 labelled patch is" if len(missing) == 1 else f"{len(missing)} labelled patches are"
        gone = len({repr(image) for image in missing})
        where = "an image" if gone == 1 else f"{gone} images"
        them = "it back, or clear its" if gone == 1 else "them back, or clear their"
        raise AnalysisError(f"{patches} on {where} no longer in the set: add {them} labels.")
    used = sorted(set(found.values()))
    if len(used) < 2:
        raise AnalysisError(
            f"Every labelled patch is '{names[used[0]]}': label a few patches "
            f"'{names[1] if used[0] == 0 else names[0]}' too, so that the probe has something to tell apart."
        )
    where = np.array(list(found), dtype=np.int64).reshape(-1, 2)
    return Labelled(where[:, 0], where[:, 1], np.array(list(found.values()), dtype=np.int64), names)


def held_out_splits(labels: np.ndarray, seed: int = 0) -> tuple[list[tuple[np.ndarray, np.ndarray]], str]:
    """The train / held-out index pairs over the labelled patches, and what they are in words: a
    stratified quarter held out once there are enough labels, else stratified folds in which each
    labelled patch is held out once; none when a label has a single patch."""
    count = len(labels)
    fewest = int(np.bincount(labels)[np.unique(labels)].min())
    if fewest < 2:
        return [], "No patch is held out: label at least two patches of each label to measure the probe's accuracy."
    indices = np.arange(count)
    if count >= SPLIT_AT and fewest >= SPLIT_EACH:
        train, test = train_test_split(
            indices, test_size=HELD_OUT_SHARE, stratify=labels, random_state=seed, shuffle=True
        )
        return [(np.sort(train), np.sort(test))], f"Held out {len(test)} of the {count} labelled patches."
    folds = min(FOLDS, fewest)
    splitter = StratifiedKFold(n_splits=folds, shuffle=True, random_state=seed)
    splits = list(splitter.split(indices, labels))
    return splits, (
        f"Few labels: each of the {count} labelled patches held out once, in {folds} folds "
        f"of about {count // folds} (the others fit the probe each time)."
    )


def _patch_tokens(tokens, num_prefix_tokens: int) -> np.ndarray:
    values = tokens.detach().to("cpu", torch.float64).numpy() if torch.is_tensor(tokens) else np.asarray(tokens, dtype=np.float64)
    if values.ndim != 3:
        raise AnalysisError(f"One layer's tokens must be (images, tokens, features), not {values.shape}.")
    return values[:, num_prefix_tokens:]


def _grid(grid_size: tuple[int, int] | None, num_patches: int) -> tuple[int, int]:
    if grid_size is None:
        side = int(round(num_patches**0.5))
        if side * side != num_patches:
            raise AnalysisError(f"{num_patches} patches are no square grid: give grid_size.")
        return side, side
    if grid_size[0] * grid_size[1] != num_patches:
        raise AnalysisError(f"The tokens have {num_patches} patches, not {grid_size[0]} x {grid_size[1]}.")
    return tuple(grid_size)


def _held_out_accuracy(samples: np.ndarray, labels: np.ndarray, splits, seed: int, c: float) -> float | None:
    if not splits:
        return None
    right = total = 0
    for train, test in splits:
        classifier = make_classifier(seed, c).fit(samples[train], labels[train])
        right += int((classifier.predict(samples[test]) == labels[test]).sum())
        total += len(test)
    return right / total


@dataclass(frozen=True)
class Probe:
    """A probe fitted on one layer's labelled tokens (:func:`fit_probe`)."""

    names: tuple[str, ...]  # the labels, in order
    segmentation: torch.Tensor  # (B, gh, gw) int64: each patch's label (an index into names)
    probabilities: torch.Tensor  # (B, gh, gw, len(names)) float32; a label never used gets 0
    accuracy: float | None  # on the held-out patches; None when none could be held out
    held_out: int  # how many labelled patches were held out in all (each once)
    folds: int  # 1 for a single split, k for k folds, 0 for none
    method: str  # the split in one sentence ("Held out 25 of the 100 labelled patches.")
    labelled: int  # labelled patches (duplicates merged)
    classifier: Pipeline  # fitted on every labelled patch: StandardScaler + LogisticRegression

    def foreground(self, label: str | int = 0) -> torch.Tensor:
        """(B, gh, gw) the probability of ``label`` (default the first, "object") at every patch."""
        index = self.names.index(label) if isinstance(label, str) else int(label)
        return self.probabilities[..., index]


def fit_probe(
    tokens, labels: Sequence, *, names: Sequence[str] | None = None, grid_size: tuple[int, int] | None = None,
    num_prefix_tokens: int = 0, images: Sequence | None = None, seed: int = 0, c: float = C,
) -> Probe:
    """A logistic regression on standardised tokens telling the labelled patches apart, and every
    patch of every image labelled by it. ``tokens``: one layer's (B, P, D) patch tokens, or (B, N,
    D) with ``num_prefix_tokens`` (a capture's ``tokens[:, layer]``); ``labels``, ``names``,
    ``images``: module docstring. Never changes what it is given."""
    values = _patch_tokens(tokens, num_prefix_tokens)  # (B, P, D)
    num_images, num_patches, dim = values.shape
    grid = _grid(grid_size, num_patches)
    checked = check_labels(labels, num_images, grid, names, images)
    samples = values[checked.images, checked.patches]  # (n, D)
    splits, method = held_out_splits(checked.labels, seed)
    accuracy = _held_out_accuracy(samples, checked.labels, splits, seed, c)
    classifier = make_classifier(seed, c).fit(samples, checked.labels)
    known = classifier.predict_proba(values.reshape(-1, dim))  # (B * P, labels used)
    probabilities = np.zeros((num_images * num_patches, len(checked.names)), dtype=np.float64)
    probabilities[:, classifier.classes_] = known
    probabilities = torch.from_numpy(probabilities).float().reshape(num_images, *grid, len(checked.names))
    return Probe(
        names=checked.names,
        segmentation=torch.from_numpy(classifier.classes_[known.argmax(-1)]).reshape(num_images, *grid),
        probabilities=probabilities, accuracy=accuracy, held_out=sum(len(test) for _, test in splits),
        folds=len(splits), method=method, labelled=len(checked), classifier=classifier,
    )


@dataclass(frozen=True)
class ProbeCurve:
    """The held-out accuracy of the same labels' probe at every layer (:func:`probe_layers`)."""

    layers: tuple[int, ...]  # the token layers (0: block 0's input, l: block l - 1's output)
    accuracies: tuple[float, ...]
    held_out: int
    method: str

    @property
    def best(self) -> int:
        """The layer whose probe does best (the first of a tie)."""
        return self.layers[int(np.argmax(self.accuracies))]


def probe_layers(
    tokens, labels: Sequence, *, layers: Sequence[int] | None = None, names: Sequence[str] | None = None,
    grid_size: tuple[int, int] | None = None, num_prefix_tokens: int = 0, images: Sequence | None = None,
    seed: int = 0, c: float = C,
) -> ProbeCurve:
    """The held-out accuracy of the labels' probe on each layer of ``tokens`` (B, L, N, D) (a
    capture's ``tokens``; ``layers``: which of them, default all), the same split at every layer.
    Raises AnalysisError when no patch can be held out."""
    if torch.is_tensor(tokens):
        if tokens.ndim != 4:
            raise AnalysisError(f"Every layer's tokens must be (images, layers, tokens, features), not {tuple(tokens.shape)}.")
        count = tokens.shape[1]
    else:
        count = len(tokens[0]) if np.ndim(tokens) == 4 else -1
        if count < 0:
            raise AnalysisError("Every layer's tokens must be (images, layers, tokens, features).")
    layers = tuple(range(count)) if layers is None else tuple(int(layer) for layer in layers)
    if not layers or not all(0 <= layer < count for layer in layers):
        raise AnalysisError(f"The layers must be in 0..{count - 1}.")
    first = _patch_tokens(tokens[:, layers[0]], num_prefix_tokens)
    grid = _grid(grid_size, first.shape[1])
    checked = check_labels(labels, first.shape[0], grid, names, images)
    splits, method = held_out_splits(checked.labels, seed)
    if not splits:
        raise AnalysisError("Label at least two patches of each label to compare the layers.")
    accuracies = []
    for layer in layers:
        samples = _patch_tokens(tokens[:, layer], num_prefix_tokens)[checked.images, checked.patches]
        accuracies.append(_held_out_accuracy(samples, checked.labels, splits, seed, c))
    return ProbeCurve(layers, tuple(accuracies), sum(len(test) for _, test in splits), method)
