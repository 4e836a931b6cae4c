"""What kind of head each head is, over a set of images.

Where a head looks on one image says little about what it does; over several images its habits
show. Per layer and head, five measures, each averaged over the images:

- mean attention distance (ViT paper, Fig. 7: analysis.head_distances, pixels), and its
  ``reach``: that distance as a share of what uniform attention over the patches would give;
- entropy (analysis.head_entropies, nats), and its ``evenness``: a share of log N;
- the share of the patches' attention paid to the prefix tokens (class, distillation, registers);
- the share paid to the few high-norm patches (the artefacts registers absorb, Darcet et al.
  2023), found as image_set.norm_outliers finds them, on the tokens entering the layer;
- ``consistency``: how alike the head's patch-to-patch attention is from image to image.

From these, one label per head by rules with named thresholds, checked in the order of ``LABELS``
(the first that holds). Every layer's attention is read one at a time, and where it is computed from
tokens a few images at a time (at most ``CHUNK_BYTES`` of it): never (B, L, H, N, N), nor a large
model's layer for all the images at once.

Shapes: B images, L layers, H heads, N tokens (prefix first), P = gh * gw patches.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, fields

import numpy as np
import torch

from ..model.capture import Capture, capture, layer_attention, layer_attentions
from ..model.vit import ViT
from .checks import AnalysisError, full_precision
from .head_statistics import head_distances, head_entropies, patch_centres
from .image_set import norm_outliers, patch_features

# The labels in the order their rules are checked: a head takes the first whose rule holds.
LABELS = ("prefix sink", "outlier sink", "local", "global", "positional", "content")

PREFIX_SINK = 0.5  # share of the patches' attention on prefix tokens from which a head is a prefix sink
OUTLIER_SINK = 0.5  # share on the few high-norm patches from which a head is an outlier sink
LOCAL_REACH = 0.4  # reach up to which a head is local
GLOBAL_EVENNESS = 0.85  # evenness from which a head is global (spread over the image)
POSITIONAL = 0.8  # consistency across images from which a head is positional
OUTLIER_MADS = 6.0  # high norm: above the median + this many MADs (the Several images page's default k)
FEW_OUTLIERS = 0.1  # few: at most this share of all the images' patches, the highest norms
# The float32 attention of one layer computed from tokens at once: a ViT-B/16's four photos (7 MB)
# in one call, a model at 2,309 tokens an image at a time.
CHUNK_BYTES = 64 * 2**20


@dataclass(frozen=True)
class Thresholds:
    """The rules' numbers (defaults: the module's named constants)."""

    prefix_sink: float = PREFIX_SINK
    outlier_sink: float = OUTLIER_SINK
    local_reach: float = LOCAL_REACH
    global_evenness: float = GLOBAL_EVENNESS
    positional: float = POSITIONAL
    outlier_mads: float = OUTLIER_MADS
    few_outliers: float = FEW_OUTLIERS

    def rules(self) -> dict[str, str]:
        """label -> its rule in words, with the numbers, in the order the rules are checked."""
        return {
            "prefix sink": f"prefix share ≥ {self.prefix_sink:g}: the patches read mostly the class token or"
            " registers, not one another (an attention sink)",
            "outlier sink": f"outlier share ≥ {self.outlier_sink:g}: the patches read mostly a few high-norm"
            " artefact patches",
            "local": f"reach ≤ {self.local_reach:g}: attention stays near the query patch",
            "global": f"evenness ≥ {self.global_evenness:g}: attention spread almost evenly over the image",
            "positional": f"consistency ≥ {self.positional:g} (two images or more): the same pattern whatever"
            " the picture",
            "content": "none of the above: focused, beyond the neighbourhood, and moving with the picture",
        }


THRESHOLDS = Thresholds()


def definitions(thresholds: Thresholds = THRESHOLDS) -> dict[str, str]:
    """measure -> what it is, exactly (the page shows these beside the grid)."""
    return {
        "distance": "mean attention distance (ViT paper, Fig. 7): for each patch query, the sum over the"
        " patch keys of its weight times the distance between the two patch centres, in pixels of the"
        " model's input, averaged over the queries and the images; attention to prefix tokens counts"
        " as distance 0",
        "reach": "the distance divided by what uniform attention over the patches gives (the mean"
        " distance between two patches of the grid) and by the share of attention on patches: 0 is"
        " the query itself, 1 as far as attending everywhere alike",
        "entropy": "entropy in nats of each query's attention row (every token), averaged over the"
        " queries and the images; evenness: the entropy as a share of log N, a uniform row's",
        "prefix share": "the attention a patch query pays to the prefix tokens (class token,"
        " distillation token, registers) together, averaged over the patch queries and the images",
        "outlier share": "the attention a patch query pays to the few high-norm patches of its image,"
        " averaged likewise. High norm: the patch's token entering the layer has an L2 norm above the"
        f" median + {thresholds.outlier_mads:g} MADs of all the images' patch tokens entering it (the"
        " Several images page's rule); few: at most the"
        f" {thresholds.few_outliers:.0%} of all the images' patches with the highest norms",
        "consistency": "the Pearson correlation between two images' patch-to-patch attention (the"
        " P x P weights of patch queries on patch keys, flattened), averaged over every pair of"
        " images: 1 for the same pattern on every picture, near 0 for a pattern that follows the"
        " content; a map without any variation counts as 0; undefined for one image",
    }


# The measures of HeadTypes in the order tables list them: (field, column name).
MEASURES = (
    ("distance", "distance_px"), ("reach", "reach"), ("entropy", "entropy_nats"), ("evenness", "evenness"),
    ("prefix_share", "prefix_share"), ("outlier_share", "outlier_share"), ("consistency", "consistency"),
)


@dataclass(frozen=True)
class HeadTypes:
    """Every head's measures over a set of images, (L, H) float32 each, and its label."""

    distance: torch.Tensor  # pixels
    reach: torch.Tensor
    entropy: torch.Tensor  # nats
    evenness: torch.Tensor
    prefix_share: torch.Tensor
    outlier_share: torch.Tensor
    consistency: torch.Tensor  # NaN for one image
    outlier_counts: torch.Tensor  # (L,) the high-norm patches found among all the images' at each layer's input
    labels: tuple[tuple[str, ...], ...]  # [layer][head], one of LABELS
    thresholds: Thresholds
    images: int
    grid_size: tuple[int, int]
    patch_size: int
    num_prefix_tokens: int

    @property
    def definitions(self) -> dict[str, str]:
        return definitions(self.thresholds)

    @property
    def rules(self) -> dict[str, str]:
        return self.thresholds.rules()

    def counts(self) -> dict[str, int]:
        """label -> how many heads carry it (every label, in the order of LABELS)."""
        flat = [label for row in self.labels for label in row]
        return {label: flat.count(label) for label in LABELS}

    def rows(self) -> list[dict]:
        """One dict per head, layer by layer: layer, head, label and every measure."""
        return [
            {"layer": layer, "head": head, "label": self.labels[layer][head], **{
                column: _number(getattr(self, name)[layer, head]) for name, column in MEASURES
            }}
            for layer in range(len(self.labels)) for head in range(len(self.labels[0]))
        ]

    def to_dict(self) -> dict:
        """Everything as plain JSON values (NaN as None)."""
        return {
            "images": self.images, "grid_size": list(self.grid_size), "patch_size": self.patch_size,
            "num_prefix_tokens": self.num_prefix_tokens, "thresholds": asdict(self.thresholds),
            "precedence": list(LABELS), "rules": self.rules, "definitions": self.definitions,
            "outlier_counts": [int(count) for count in self.outlier_counts], "heads": self.rows(),
        }

    def to_arrays(self) -> dict[str, np.ndarray]:
        """The numbers as arrays (a job's result file), which :meth:`from_arrays` reads back."""
        return {
            **{name: getattr(self, name).numpy() for name, _ in MEASURES},
            "outlier_counts": self.outlier_counts.numpy(),
            "thresholds": np.array([getattr(self.thresholds, field.name) for field in fields(Thresholds)]),
            "shape": np.array([self.images, *self.grid_size, self.patch_size, self.num_prefix_tokens]),
        }

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray]) -> HeadTypes:
        thresholds = Thresholds(*(float(value) for value in arrays["thresholds"]))
        images, grid_h, grid_w, patch_size, prefix = (int(value) for value in arrays["shape"])
        measures = {name: torch.from_numpy(np.array(arrays[name])) for name, _ in MEASURES}
        return cls(
            **measures, outlier_counts=torch.from_numpy(np.array(arrays["outlier_counts"])),
            labels=label_heads(**{name: measures[name] for name in _RULE_INPUTS}, thresholds=thresholds),
            thresholds=thresholds, images=images, grid_size=(grid_h, grid_w), patch_size=patch_size,
            num_prefix_tokens=prefix,
        )


def _number(value: torch.Tensor) -> float | None:
    value = float(value)
    return None if math.isnan(value) else value


_RULE_INPUTS = ("prefix_share", "outlier_share", "reach", "evenness", "consistency")


def label(prefix_share: float, outlier_share: float, reach: float, evenness: float, consistency: float,
          thresholds: Thresholds = THRESHOLDS) -> str:
    """One head's label: the first of LABELS whose rule holds (consistency NaN: never positional)."""
    if prefix_share >= thresholds.prefix_sink:
        return "prefix sink"
    if outlier_share >= thresholds.outlier_sink:
        return "outlier sink"
    if reach <= thresholds.local_reach:
        return "local"
    if evenness >= thresholds.global_evenness:
        return "global"
    if consistency >= thresholds.positional:  # False for NaN
        return "positional"
    return "content"


def label_heads(
    prefix_share: torch.Tensor, outlier_share: torch.Tensor, reach: torch.Tensor, evenness: torch.Tensor,
    consistency: torch.Tensor, thresholds: Thresholds = THRESHOLDS,
) -> tuple[tuple[str, ...], ...]:
    """(L, H) measures -> labels[layer][head] by :func:`label`."""
    values = zip(*(tensor.tolist() for tensor in (prefix_share, outlier_share, reach, evenness, consistency)))
    return tuple(tuple(label(*head, thresholds=thresholds) for head in zip(*layer)) for layer in values)


# --- the high-norm patches ------------------------------------------------------------------------


def outlier_patches(
    entering: torch.Tensor, num_prefix_tokens: int, thresholds: Thresholds = THRESHOLDS,
) -> torch.Tensor:
    """(B, L, P) bool: the few high-norm patches among the tokens ``entering`` each layer,
    (B, L, N, D) (a capture's ``tokens[:, :-1]``): norm above the median + ``outlier_mads`` MADs of
    all the images' patches at that layer (image_set.norm_outliers), and at most the
    ``few_outliers`` share of them with the highest norms."""
    masks = []
    for layer in range(entering.shape[1]):
        found = norm_outliers(patch_features(entering[:, layer], num_prefix_tokens), thresholds.outlier_mads)
        mask = found.outliers
        most = int(thresholds.few_outliers * mask.numel())
        if int(mask.sum()) > most:  # not few: the highest ones only
            highest = torch.zeros(mask.numel(), dtype=torch.bool)
            highest[found.norms.flatten().topk(most).indices] = True
            mask = mask & highest.reshape(mask.shape)
        masks.append(mask)
    return torch.stack(masks, dim=1)


# --- the measures, a layer at a time -------------------------------------------------------------


def measure_heads(
    layers: Iterable[torch.Tensor | Sequence[torch.Tensor]], grid_size: tuple[int, int], patch_size: int,
    num_prefix_tokens: int, outliers: torch.Tensor | None = None, thresholds: Thresholds = THRESHOLDS,
    progress: Callable[[float], None] | None = None, depth: int | None = None,
) -> HeadTypes:
    """:class:`HeadTypes` from every layer's attention in order, each given as one (B, H, N, N)
    tensor or as chunks of images in order ((b, H, N, N) each): only a chunk and one layer's sums
    are held. ``outliers`` (B, L, P) bool (:func:`outlier_patches`; None: no high-norm patch).
    ``progress`` gets the share of ``depth`` layers done."""
    centres = patch_centres(grid_size, patch_size)
    uniform = float(torch.cdist(centres, centres).mean())  # what uniform attention over the patches reaches
    per_layer, images = [], None
    for index, layer in enumerate(layers):
        chunks = [layer] if isinstance(layer, torch.Tensor) else list(layer)
        mask = None if outliers is None else outliers[:, index]
        measured, count = _layer_measures(chunks, mask, grid_size, patch_size, num_prefix_tokens)
        if images is not None and count != images:
            raise AnalysisError(f"layer {index} has {count} images' attention, layer 0 had {images}")
        images = count
        per_layer.append(measured)
        if progress is not None and depth:
            progress((index + 1) / depth)
    if not per_layer:
        raise AnalysisError("head types need the attention of at least one layer")
    stacked = {name: torch.stack([measured[name] for measured in per_layer]) for name in per_layer[0]}
    tokens = num_prefix_tokens + grid_size[0] * grid_size[1]
    patch_share = (1 - stacked["prefix_share"]).clamp(min=1e-6)
    reach = stacked["distance"] / (uniform * patch_share) if uniform > 0 else torch.zeros_like(patch_share)
    evenness = stacked["entropy"] / math.log(tokens) if tokens >= 2 else torch.zeros_like(reach)
    measures = dict(
        distance=stacked["distance"], reach=reach, entropy=stacked["entropy"], evenness=evenness,
        prefix_share=stacked["prefix_share"], outlier_share=stacked["outlier_share"],
        consistency=stacked["consistency"],
    )
    measures = {name: values.float() for name, values in measures.items()}
    counts = torch.zeros(len(per_layer), dtype=torch.long) if outliers is None else outliers.sum(dim=(0, 2))
    return HeadTypes(
        **measures, outlier_counts=counts,
        labels=label_heads(**{name: measures[name] for name in _RULE_INPUTS}, thresholds=thresholds),
        thresholds=thresholds, images=images, grid_size=tuple(grid_size), patch_size=patch_size,
        num_prefix_tokens=num_prefix_tokens,
    )


def _layer_measures(
    chunks: list[torch.Tensor], outliers: torch.Tensor | None, grid_size: tuple[int, int], patch_size: int,
    prefix: int,
) -> tuple[dict[str, torch.Tensor], int]:
    """One layer's (H,) measures from its attention in chunks of images, and the images' count."""
    patches = grid_size[0] * grid_size[1]
    sums: dict[str, torch.Tensor] = {}
    # Consistency: with z_b each image's map centred and scaled to unit length, the mean of the
    # pairwise correlations z_b . z_c (b != c) is (|sum z|^2 - sum |z|^2) / (B (B - 1)): one
    # running sum of the maps, never every image's map at once.
    together = squares = None
    seen = 0
    for chunk in chunks:
        if chunk.ndim != 4 or chunk.shape[-1] != prefix + patches or chunk.shape[-2] != chunk.shape[-1]:
            raise AnalysisError(
                f"a layer's attention must be (B, H, N, N) over {prefix} prefix tokens and a"
                f" {grid_size[0]}x{grid_size[1]} grid, not {tuple(chunk.shape)}"
            )
        count = chunk.shape[0]
        weights = full_precision(chunk).float()
        rows = weights[:, :, prefix:]  # (b, H, P, N): the patch queries
        on_patches = rows[..., prefix:]  # (b, H, P, P)
        mask = None if outliers is None else outliers[seen:seen + count]
        measured = {
            "distance": head_distances(chunk, grid_size, patch_size, prefix) * count,
            "entropy": head_entropies(chunk).sum(dim=0),
            "prefix_share": rows[..., :prefix].sum(dim=-1).mean(dim=-1).sum(dim=0),
            "outlier_share": torch.einsum("bhqk,bk->h", on_patches, mask.float()) / patches
            if mask is not None and mask.any() else torch.zeros(weights.shape[1]),
        }
        for name, value in measured.items():
            sums[name] = sums[name] + value if name in sums else value
        maps = on_patches.reshape(count, weights.shape[1], -1)  # (b, H, P*P)
        centred = maps - maps.mean(dim=-1, keepdim=True)
        lengths = torch.linalg.vector_norm(centred, dim=-1, keepdim=True)
        # A map without variation (uniform) has none to correlate: rounding left in its centred
        # weights is not a pattern, and it counts as 0.
        varied = lengths > 1e-5 * torch.linalg.vector_norm(maps, dim=-1, keepdim=True)
        unit = centred * (varied / lengths.clamp(min=torch.finfo(lengths.dtype).tiny))
        together = unit.sum(dim=0) if together is None else together + unit.sum(dim=0)
        squares = varied.sum(dim=(0, 2)) if squares is None else squares + varied.sum(dim=(0, 2))
        seen += count
    if not seen:
        raise AnalysisError("a layer's attention holds no image")
    if outliers is not None and outliers.shape[0] != seen:
        raise AnalysisError(f"outliers are given for {outliers.shape[0]} images, the attention for {seen}")
    measures = {name: value / seen for name, value in sums.items()}
    pairs = seen * (seen - 1)
    measures["consistency"] = (
        (together.pow(2).sum(dim=-1) - squares) / pairs if pairs else torch.full(squares.shape, math.nan)
    )
    return measures, seen


# --- from a model ---------------------------------------------------------------------------------


def classify_heads(
    model: ViT, source: torch.Tensor | Capture | Sequence[Capture], thresholds: Thresholds = THRESHOLDS,
    progress: Callable[[float], None] | None = None,
) -> HeadTypes:
    """Every head's measures and label over a set of images: ``source`` is the normalised images
    (B, C, H, W), read in one pass that keeps their tokens only, or captures of the model (one or
    a list, each of one image or a batch, on one grid), whose recorded attention is read where
    they kept it and computed from their tokens elsewhere, a layer at a time."""
    if isinstance(source, torch.Tensor):
        source = capture(model, source, layers=())
    captures = [source] if isinstance(source, Capture) else list(source)
    if not captures:
        raise AnalysisError("head types need at least one image")
    if len({captured.grid_size for captured in captures}) > 1:
        raise AnalysisError("the captures must share one patch grid (the same input size and patch size)")
    first = captures[0]
    if all(not captured.layers for captured in captures):  # tokens only: every layer from them
        tokens = torch.cat([captured.tokens for captured in captures])
        return classify_heads_from_tokens(model, tokens, first.grid_size, thresholds, progress)
    layers = zip(*(layer_attentions(model, captured) for captured in captures))  # per layer, a chunk per capture
    tokens = torch.cat([captured.tokens[:, :-1] for captured in captures])
    return measure_heads(
        layers, first.grid_size, model.config.patch_size, first.num_prefix_tokens,
        outlier_patches(tokens, first.num_prefix_tokens, thresholds), thresholds, progress, model.config.depth,
    )


def classify_heads_from_tokens(
    model: ViT, tokens: torch.Tensor, grid_size: tuple[int, int] | None = None, thresholds: Thresholds = THRESHOLDS,
    progress: Callable[[float], None] | None = None,
) -> HeadTypes:
    """:func:`classify_heads` from every block's tokens of a set of images (B, L + 1, N, D) (a capture's
    ``tokens``, or several images' stacked), on ``grid_size`` (default: the model's grid): each
    layer's attention computed from the tokens entering it (capture.layer_attention), as many
    images at a time as hold at most ``CHUNK_BYTES`` of it (one at the least)."""
    config = model.config
    grid_size = config.grid_size if grid_size is None else tuple(grid_size)
    depth = tokens.shape[1] - 1
    together = max(1, CHUNK_BYTES // (4 * config.num_heads * tokens.shape[2] ** 2))

    def layers():
        for layer in range(depth):
            yield (
                layer_attention(model, tokens[start:start + together, layer], layer, grid_size)
                for start in range(0, tokens.shape[0], together)
            )

    return measure_heads(
        layers(), grid_size, config.patch_size, config.num_prefix_tokens,
        outlier_patches(tokens[:, :-1], config.num_prefix_tokens, thresholds), thresholds, progress, depth,
    )


def held_floats(config, images: int) -> int:
    """Floats :func:`classify_heads_from_tokens` holds at its peak beside the tokens: a chunk of
    images' layer attention with its copies (float32 weights, patch maps, centred, unit) and the
    running sum of the maps."""
    layer = config.num_heads * config.num_tokens**2  # one image's
    together = min(images, max(1, CHUNK_BYTES // (4 * layer)))
    return 5 * together * layer + layer
