"""A probe a person labels, for the pages (vit_explorer.analysis.probe): the patches this person
clicked as "object", "background" or labels of their own (this session's, never lost on a rerun
or a bad fit), the probe fitted on one layer's tokens of the set (ImageSet.tokens: no forward
pass once the set is read) and its accuracy across the layers, both once for everybody through
``memo`` keyed by the set, the layer and the labels; and the probe's foreground, which DINOv3's
dense PCA uses instead of its border heuristic (the Several images page's set, and the Patches
page's picture alone).

Labels are kept per patch grid, as (image key, patch) -> label name: another set keeps them, a
label on an image no longer in the set (or with a name no longer one of the labels) is set aside,
said in a sentence and used again once the image (or the name) is back.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import streamlit as st
import torch
import torch.nn.functional as F

from ..analysis.checks import AnalysisError
from ..analysis.image_set import MAX_IMAGES
from ..analysis.probe import DEFAULT_NAMES, MAX_LABELS, Probe, ProbeCurve, fit_probe, probe_layers
from .images import resolve_image
from .selection import ImageSet, Selection

LABELS = "probe_labels"  # session state: {(gh, gw): {(image key, patch): label name}}
NAMES = "probe_names"  # session state: the label names, in order (the first is the foreground)
LAYER = "probe_layer"  # the probe page's layer widget (kept: session.keep)
CLICKS = "probe_clicks"  # session state: handled clicks, in the picker's key (a fresh chart each time)
FOREGROUND = 0.5  # a patch is the probe's foreground where the first label's probability is above this


def probe_set(selection: Selection, image_keys: list[str]) -> ImageSet:
    """The set of one to MAX_IMAGES images the probe reads (ImageSet.of takes two at least);
    ValueError with the sentence to show."""
    if not 1 <= len(image_keys) <= MAX_IMAGES:
        raise ValueError(f"Pick between 1 and {MAX_IMAGES} images ({len(image_keys)} chosen).")
    if len(image_keys) > 1:
        return ImageSet.of(selection, image_keys)
    try:
        key, image = resolve_image(image_keys[0], selection.config.img_size)
    except (ValueError, OSError) as error:
        raise ValueError(f"The image cannot be read: {error}.") from error
    return ImageSet(selection, (key,), (image,))


# --- the labels ---------------------------------------------------------------------------------


def names() -> tuple[str, ...]:
    """This session's label names (default "object", "background")."""
    return tuple(st.session_state.get(NAMES, DEFAULT_NAMES))


def read_names(text: str) -> tuple[str, ...]:
    """Two to MAX_LABELS label names typed comma-separated, each once; ValueError in a sentence."""
    typed = tuple(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))
    if len(typed) < 2:
        raise ValueError("A probe needs two labels at least, comma-separated (say 'object, background').")
    if len(typed) > MAX_LABELS:
        raise ValueError(f"A probe takes at most {MAX_LABELS} labels, not {len(typed)}: merge some of them.")
    if any(len(name) > 40 for name in typed):
        raise ValueError("A label is 40 characters at most.")
    return typed


def set_names(typed: tuple[str, ...]) -> None:
    st.session_state[NAMES] = typed


def labelled(grid_size: tuple[int, int]) -> dict[tuple[str, int], str]:
    """This session's labelled patches on grids of ``grid_size`` (the dict kept: change it through
    the functions here)."""
    return st.session_state.setdefault(LABELS, {}).setdefault(tuple(grid_size), {})


def click_key() -> str:
    """The picker's chart key now: a new one after every handled click, so that the next click on
    the same patch is a new selection (a chart keeps its selection, and clicking a selected point
    again would clear it instead)."""
    return f"probe_click_{st.session_state.get(CLICKS, 0)}"


def clicked(chart_key: str, image_key: str, grid_size: tuple[int, int], label: str):
    """The ``on_select`` callback of the picker drawn with ``key=chart_key`` on ``image_key``: the
    clicked patch gets ``label``, or loses it if it had it already."""
    def pick() -> None:
        points = st.session_state[chart_key].selection.points
        if points:  # the picker's labelled squares take no clicks: the point is one of every patch's markers
            toggle(image_key, int(points[0]["point_index"]), grid_size, label)
            st.session_state[CLICKS] = st.session_state.get(CLICKS, 0) + 1

    return pick


def toggle(image_key: str, patch: int, grid_size: tuple[int, int], label: str) -> None:
    """Label a patch ``label``; a patch that had that label already loses it."""
    kept = labelled(grid_size)
    if kept.get((image_key, patch)) == label:
        del kept[(image_key, patch)]
    else:
        kept[(image_key, patch)] = label


def clear(grid_size: tuple[int, int], image_key: str | None = None) -> None:
    """Forget the labels of one image (a callback), or of every image."""
    kept = labelled(grid_size)
    for where in [where for where in kept if image_key is None or where[0] == image_key]:
        del kept[where]


@dataclass(frozen=True)
class Labels:
    """The labels the probe of a set is fitted on, and those set aside, with why."""

    used: tuple[tuple[str, int, str], ...]  # (image key, patch, label name), in a fixed order
    aside: tuple[str, ...]  # a sentence per reason

    @property
    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.used).encode()).hexdigest()[:32]


def labels_for(image_set: ImageSet, label_names: tuple[str, ...]) -> Labels:
    """This session's labels of ``image_set``'s grid: those on its images with one of
    ``label_names``, and a sentence for those set aside (kept, not used)."""
    kept = labelled(image_set.selection.config.grid_size)
    present = set(image_set.image_keys)
    used, gone, renamed = [], [], []
    for (image_key, patch), label in sorted(kept.items()):
        if image_key not in present:
            gone.append(image_key)
        elif label not in label_names:
            renamed.append(label)
        else:
            used.append((image_key, patch, label))
    aside = []
    if gone:
        patches = "1 labelled patch is" if len(gone) == 1 else f"{len(gone)} labelled patches are"
        images = len(set(gone))
        where = "an image" if images == 1 else f"{images} images"
        aside.append(f"{patches} on {where} no longer in the set: kept aside, used again once {'it is' if images == 1 else 'they are'} back.")
    if renamed:
        patches = "1 labelled patch has" if len(renamed) == 1 else f"{len(renamed)} labelled patches have"
        which = ", ".join(f"'{name}'" for name in dict.fromkeys(renamed))
        aside.append(f"{patches} a label no longer among the labels ({which}): kept aside until you add it back.")
    return Labels(tuple(used), tuple(aside))


# --- the probe ------------------------------------------------------------------------------------


def fit(image_set: ImageSet, labels: Labels, label_names: tuple[str, ...], layer: int) -> Probe:
    """The probe on the tokens after ``layer`` blocks (0: the embeddings) of every image of the
    set, once for everybody; AnalysisError in a sentence for labels it cannot use."""
    config = image_set.selection.config
    return image_set.memo("probe", layer, labels.digest, label_names, compute=lambda: fit_probe(
        image_set.tokens(layer), labels.used, names=label_names, grid_size=config.grid_size,
        num_prefix_tokens=config.num_prefix_tokens, images=image_set.image_keys,
    ))


def layers(image_set: ImageSet, labels: Labels, label_names: tuple[str, ...]) -> ProbeCurve:
    """The probe's held-out accuracy on every layer's tokens, once for everybody; AnalysisError."""
    config = image_set.selection.config
    return image_set.memo("probe layers", labels.digest, label_names, compute=lambda: probe_layers(
        torch.stack(image_set.image_tokens()), labels.used, names=label_names, grid_size=config.grid_size,
        num_prefix_tokens=config.num_prefix_tokens, images=image_set.image_keys,
    ))


@dataclass(frozen=True)
class Current:
    """This session's probe of a set, the layer it reads and what it is keyed by."""

    probe: Probe
    layer: int
    key: tuple  # (layer, the labels' digest, the names): for results made from it


def current(image_set: ImageSet) -> Current | None:
    """This session's probe of ``image_set`` (the probe page's layer, else the best of the curve,
    else the last); None when there are no labels it can use. Nothing runs that the set has not
    read: the tokens must be there."""
    if not image_set.image_keys or image_set.unread():
        return None
    label_names = names()
    labels = labels_for(image_set, label_names)
    if not labels.used:
        return None
    depth = image_set.selection.config.depth
    layer = st.session_state.get(f"kept:{LAYER}")
    try:
        if layer is None or not 0 <= layer <= depth:
            try:
                layer = layers(image_set, labels, label_names).best
            except AnalysisError:
                layer = depth
        return Current(fit(image_set, labels, label_names, layer), layer, (layer, labels.digest, label_names))
    except AnalysisError:
        return None


def of_the_picture(selection: Selection) -> Current | None:
    """This session's probe of the sidebar's picture alone, on its own labels (the Patches page's
    DINOv3 PCA); None where it has none it can use."""
    return current(ImageSet(selection, (selection.image_key,), (selection.image,)))


def foreground_masks(found: Probe, grids: list[tuple[int, int]]) -> list[torch.Tensor]:
    """(gh, gw) bool per image: where the probe's first label is likelier than FOREGROUND, its
    probabilities (at the model's input grid) resampled bilinearly to each of ``grids`` (a
    picture read 768 px high)."""
    probabilities = found.foreground(0)  # (B, gh, gw)
    masks = []
    for values, grid in zip(probabilities, grids):
        if tuple(values.shape) != tuple(grid):
            values = F.interpolate(values[None, None].float(), size=tuple(grid), mode="bilinear", align_corners=False)[0, 0]
        masks.append(values > FOREGROUND)
    return masks


def counts(labels: Labels, label_names: tuple[str, ...]) -> str:
    """How many patches carry each label, in words ("4 'object', 6 'background'")."""
    number = {name: 0 for name in label_names}
    for *_, label in labels.used:
        number[label] += 1
    return ", ".join(f"{count} '{name}'" for name, count in number.items())


def per_image(labels: Labels, image_set: ImageSet, label_names: tuple[str, ...]) -> list[list[tuple[int, int]]]:
    """Per image of the set, its labelled (patch, label index) pairs (the figures' form)."""
    index = {key: position for position, key in enumerate(image_set.image_keys)}
    pairs: list[list[tuple[int, int]]] = [[] for _ in image_set.image_keys]
    for image_key, patch, label in labels.used:
        pairs[index[image_key]].append((patch, label_names.index(label)))
    return pairs

