"""Activation patching: where the model holds what makes the clean picture's answer differ from
the corrupted one's.

Run a clean and a corrupted input (:func:`paired_runs`, one batched pass that keeps every site's
activations: vit_explorer.model.patching), copy one activation from one run into the other and
measure how much of a metric's difference comes back, normalised so that 0 is the corrupted run
and 1 the clean one. Denoising copies clean into corrupted (is this enough to restore the
answer?), noising corrupted into clean (is this needed for it?).

- :func:`exact_patching`: every (layer, token) of a site, or every (layer, head), each its own
  pass from the patched layer on (the layers below are the cached run's), the last block for the
  class token only where the head reads nothing else, in batches; a cell whose two activations
  are equal needs no pass (patching it changes nothing).
- :func:`attribution_patching`: the first-order estimate of every cell at once (Nanda 2023):
  (source - base) . d metric / d activation, one forward and one backward of the patched run.
- :func:`path_patching`: one head's effect through one later head only, or through the MLPs only.

Shapes: L layers, N tokens, H heads, D embed dim; a map is (L, N) or (L, H).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from PIL import Image

from ..model.patching import ROWS_SHARE, Patch, patching, pooled_rows, rest_of_pass
from ..model.recorder import eval_mode
from ..model.vit import ViT
from .checks import AnalysisError

# Per layer: what a cell is. "head" cells are heads, the others tokens.
SITES = {"resid": "residual stream", "attn": "attention output", "mlp": "MLP output", "head": "head output"}
DIRECTIONS = ("denoising", "noising")
# Patched copies run in one batch.
PATCH_BATCH = 16
# Attribution patching in forward passes: the paired runs (two images in one batch), then one
# forward and one backward (about two forwards' work) of the patched run.
ATTRIBUTION_FORWARDS = 5.0
# The normalised metric's difference below which two runs count as the same answer.
SAME_ANSWER = 1e-6


@dataclass(frozen=True)
class Metric:
    """What patching measures: ``score`` maps the model's outputs (B, classes or D) to (B,),
    differentiably; ``name`` says it in words ("logit 'cat' - logit 'dog'")."""

    name: str
    score: Callable[[torch.Tensor], torch.Tensor]


def class_difference(a: int, b: int, class_names: Sequence[str]) -> Metric:
    """The logit of class ``a`` minus that of class ``b``."""
    for index in (a, b):
        if not 0 <= index < len(class_names):
            raise AnalysisError(f"This model has no class {index}: its classes are 0 to {len(class_names) - 1}.")
    return Metric(f"logit {class_names[a]!r} - logit {class_names[b]!r}", lambda out: out[:, a] - out[:, b])


def named_difference(text: str, class_names: Sequence[str]) -> Metric:
    """``"cat-dog"``: the logit difference of the two classes named, split at the hyphen that
    leaves a class name on either side (class names may hold hyphens themselves)."""
    lowered = [name.lower() for name in class_names]
    parts = text.split("-")
    for cut in range(1, len(parts)):
        a, b = "-".join(parts[:cut]).strip().lower(), "-".join(parts[cut:]).strip().lower()
        if a in lowered and b in lowered:
            return class_difference(lowered.index(a), lowered.index(b), class_names)
    missing = next((name for name in (part.strip() for part in parts) if name.lower() not in lowered), text)
    raise AnalysisError(f"This model has no class {missing!r}: name two of its classes as \"first-second\".")


def pooled_cosine(reference: torch.Tensor) -> Metric:
    """A headless model's: the cosine of the pooled output to ``reference`` (D,), the clean run's."""
    reference = reference.detach().reshape(1, -1)
    return Metric("cosine to the clean picture's pooled feature", lambda out: F.cosine_similarity(
        out, reference.to(out.device, out.dtype), dim=-1,
    ))


def metric_from(spec: tuple, class_names: Sequence[str], clean_output: torch.Tensor) -> Metric:
    """The metric a plain tuple names (what a job's settings carry): ("classes", a, b), the logit
    difference, or ("cosine",), the pooled cosine to ``clean_output`` (D,)."""
    if spec[0] == "classes":
        return class_difference(int(spec[1]), int(spec[2]), class_names)
    if spec[0] == "cosine":
        return pooled_cosine(clean_output)
    raise AnalysisError(f"The metric must be a difference of two classes or the pooled cosine, not {spec[0]!r}.")


@dataclass(frozen=True)
class PairedRuns:
    """The clean (0) and corrupted (1) run: the inputs (2, C, H, W), the outputs (2, classes or D)
    and every site's activations, (site, layer) -> (2, ...) detached on the model's device."""

    images: torch.Tensor
    outputs: torch.Tensor
    activations: dict[tuple[str, int], torch.Tensor]
    grid_size: tuple[int, int]

    def normaliser(self, metric: Metric) -> Callable[[torch.Tensor], torch.Tensor]:
        """score -> (score - corrupted) / (clean - corrupted); an AnalysisError if the two runs
        give the metric the same value (there is nothing to patch)."""
        clean, corrupted = (float(value) for value in metric.score(self.outputs))
        if abs(clean - corrupted) <= SAME_ANSWER * max(1.0, abs(clean)):
            raise AnalysisError(
                f"The clean and corrupted pictures give the {metric.name} the same value ({clean:.4g}), so there is"
                " nothing to patch: corrupt the picture differently or choose another metric."
            )
        return lambda score: ((score.double().cpu() - corrupted) / (clean - corrupted)).to(score.dtype)


def paired_runs(model: ViT, clean: torch.Tensor, corrupted: torch.Tensor) -> PairedRuns:
    """One batched pass of the two normalized images (1, C, H, W each), every site recorded."""
    parameter = next(model.parameters())
    images = torch.cat([clean, corrupted]).to(parameter.device, parameter.dtype)
    if torch.equal(images[0], images[1]):
        raise AnalysisError(
            "The corrupted picture is the clean one, so there is nothing to patch: choose another picture or paint a region."
        )
    patch = Patch(model, record=SITES)
    with torch.no_grad(), eval_mode(model), patching(patch):
        outputs = model(images)
    activations = {key: value.detach() for key, value in patch.recorded.items()}
    return PairedRuns(images, outputs.detach(), activations, model.grid_size())


def _roles(direction: str) -> tuple[int, int]:
    """(the run patched, the run its activations come from)."""
    if direction not in DIRECTIONS:
        raise AnalysisError(f"The direction must be one of {', '.join(DIRECTIONS)}, not {direction!r}.")
    return (1, 0) if direction == "denoising" else (0, 1)


def _units(model: ViT, runs: PairedRuns, site: str) -> int:
    if site not in SITES:
        raise AnalysisError(f"The site must be one of {', '.join(SITES)}, not {site!r}.")
    return model.config.num_heads if site == "head" else runs.activations[("resid", 0)].shape[1]


def _changed(runs: PairedRuns, site: str, layer: int) -> torch.Tensor:
    """(units,) bool: the cells of ``site`` at ``layer`` whose two runs' activations differ."""
    values = runs.activations[(site, layer)]
    different = values[0] != values[1]  # (N, D) or (H, N, hd)
    return different.flatten(1).any(dim=1).cpu()


def exact_cost(config, site: str) -> float:
    """Exact patching of ``site`` in forward passes of the model: the paired runs (two), then per
    layer one pass per cell from that layer on, (L + 1) / 2 passes a cell in all (at most: cells
    whose runs agree need none)."""
    units = config.num_heads if site == "head" else config.num_tokens
    depth = config.depth
    return 2 + units * sum(depth - layer for layer in range(depth)) / depth


def exact_passes(model: ViT, runs: PairedRuns, site: str) -> float:
    """The passes :func:`exact_outputs` runs for these two runs, in whole passes of the model: each
    cell whose runs differ at layer L runs the blocks from L on, the last for the class token's
    row only where the head reads nothing else (model.patching.rest_of_pass)."""
    depth = model.config.depth
    last = 1.0 if pooled_rows(model) is None else ROWS_SHARE
    return sum(int(_changed(runs, site, layer).sum()) * (depth - layer - 1 + last) for layer in range(depth)) / depth


def exact_outputs(
    model: ViT, runs: PairedRuns, site: str, direction: str = "denoising",
    progress: Callable[[float], None] | None = None, batch_size: int = PATCH_BATCH,
) -> torch.Tensor:
    """(L, units, classes or D) the model's output with each cell of ``site`` patched alone, on
    the CPU (:func:`exact_patching` scores them). ``progress`` gets the share done after each batch."""
    base, source = _roles(direction)
    units = _units(model, runs, site)
    depth = model.config.depth
    output = runs.outputs[base].cpu()
    results = output.expand(depth, units, -1).clone()
    total = units * sum(depth - layer for layer in range(depth))
    done = 0
    with torch.no_grad(), eval_mode(model):
        for layer in range(depth):
            tokens = runs.activations[("resid", layer)][base:base + 1]  # (1, N, D)
            values = runs.activations[(site, layer)][source:source + 1]
            cells = _changed(runs, site, layer).nonzero().flatten().tolist()
            for first in range(0, len(cells), batch_size):
                chunk = cells[first:first + batch_size]
                mask = torch.zeros(len(chunk), units, dtype=torch.bool)
                mask[torch.arange(len(chunk)), chunk] = True
                with patching(Patch(model, replace={(site, layer): (mask, values)})):
                    results[layer, chunk] = rest_of_pass(model, tokens.expand(len(chunk), -1, -1), layer, runs.grid_size).cpu()
                done += len(chunk) * (depth - layer)
                if progress is not None:
                    progress(done / total)
            done += (units - len(cells)) * (depth - layer)
    if progress is not None:
        progress(1.0)
    return results


def exact_patching(
    model: ViT, runs: PairedRuns, metric: Metric, site: str, direction: str = "denoising",
    progress: Callable[[float], None] | None = None,
) -> torch.Tensor:
    """(L, units): the normalised metric with each cell of ``site`` patched alone."""
    normalise = runs.normaliser(metric)
    outputs = exact_outputs(model, runs, site, direction, progress)
    depth, units = outputs.shape[:2]
    return normalise(metric.score(outputs.flatten(0, 1))).reshape(depth, units)


def attribution_patching(model: ViT, runs: PairedRuns, metric: Metric, direction: str = "denoising") -> dict[str, torch.Tensor]:
    """Every site's (L, units) estimate at once: (source - base) . d metric / d activation at the
    patched run, summed over a token's D (a head's N x hd), normalised as :func:`exact_patching`
    (noising: 1 plus the estimated change). One forward and one backward of the patched run."""
    normalise = runs.normaliser(metric)
    base, source = _roles(direction)
    patch = Patch(model, record=SITES)
    with torch.enable_grad(), eval_mode(model), patching(patch):
        image = runs.images[base:base + 1].detach().requires_grad_(True)  # the graph, whatever the weights
        score = metric.score(model(image))[0]
        keys = list(patch.recorded)
        grads = torch.autograd.grad(score, [patch.recorded[key] for key in keys])
    depth = model.config.depth
    estimates = {site: [None] * depth for site in SITES}
    for (site, layer), grad in zip(keys, grads):
        values = runs.activations[(site, layer)]
        product = (values[source] - values[base]) * grad[0]
        estimates[site][layer] = product.sum(dim=(1, 2)) if site == "head" else product.sum(dim=1)
    start = float(metric.score(runs.outputs[base:base + 1])[0])
    return {site: normalise(start + torch.stack(rows).detach()) for site, rows in estimates.items()}


def path_patching(
    model: ViT, runs: PairedRuns, metric: Metric, sender: tuple[int, int], receiver: tuple[int, int] | None,
    direction: str = "denoising",
) -> float:
    """The normalised metric when head ``sender`` (layer, head) is patched along one path only:
    into head ``receiver`` (a later layer's), whose input alone gets the sender's change (the
    other heads and the residual stream keep the patched run's, the layers after it run on); or,
    with ``receiver`` None, into the MLPs only: every MLP from the sender's layer on reads the
    sender's change added to its input, which the residual stream itself does not carry."""
    base, source = _roles(direction)
    normalise = runs.normaliser(metric)
    config = model.config
    layer, head = sender
    if not (0 <= layer < config.depth and 0 <= head < config.num_heads):
        raise AnalysisError(f"Head {head} of layer {layer} does not exist in this model.")
    if receiver is not None and not (layer < receiver[0] < config.depth and 0 <= receiver[1] < config.num_heads):
        raise AnalysisError(
            f"The receiving head must be one of a later layer than the sender's ({layer}), up to layer {config.depth - 1}."
        )
    rope = model.rope_tables(runs.grid_size)
    with torch.no_grad(), eval_mode(model):
        # What the sender alone changes in its layer's attention output, as the residual gets it.
        mask = torch.zeros(1, config.num_heads, dtype=torch.bool)
        mask[0, head] = True
        sent = Patch(model, replace={("head", layer): (mask, runs.activations[("head", layer)][source:source + 1])},
                     record=("attn",))
        with patching(sent):
            model.blocks[layer](runs.activations[("resid", layer)][base:base + 1], rope)
        block = model.blocks[layer]
        change = block.ls1(sent.recorded[("attn", layer)] - runs.activations[("attn", layer)][base:base + 1])
        if receiver is None:
            patch = Patch(model, add={("mlp_in", later): change for later in range(layer, config.depth)})
            start = layer
        else:
            later, receiving = receiver
            received = Patch(model, record=("head",))
            with patching(received):
                model.blocks[later](runs.activations[("resid", later)][base:base + 1] + change, rope)
            mask = torch.zeros(1, config.num_heads, dtype=torch.bool)
            mask[0, receiving] = True
            patch = Patch(model, replace={("head", later): (mask, received.recorded[("head", later)])})
            start = later
        with patching(patch):
            out = model.forward_head(model.forward_blocks(
                runs.activations[("resid", start)][base:base + 1], start, grid_size=runs.grid_size,
            ))
    return float(normalise(metric.score(out))[0])


def agreement(exact: torch.Tensor, estimate: torch.Tensor) -> float:
    """The Pearson correlation of two maps' cells (1: attribution patching ranks as exact does);
    NaN where either is constant."""
    a, b = exact.flatten().double(), estimate.flatten().double()
    a, b = a - a.mean(), b - b.mean()
    denominator = float(a.norm() * b.norm())
    return float(a @ b) / denominator if denominator > 0 else float("nan")


def painted(image: torch.Tensor, cells: tuple[int, int, int, int], patch_size: int) -> torch.Tensor:
    """A normalized image (1, C, H, W) with the patch cells rows [r0, r1) x columns [c0, c1)
    painted in the training set's mean colour (0 once normalized): a corrupted picture that
    differs from the clean one there only."""
    r0, r1, c0, c1 = cells
    rows, columns = image.shape[-2] // patch_size, image.shape[-1] // patch_size
    if not (0 <= r0 < r1 <= rows and 0 <= c0 < c1 <= columns):
        raise AnalysisError(f"The painted region must lie on the {rows} x {columns} patch grid and cover at least one patch.")
    if (r1 - r0) * (c1 - c0) == rows * columns:
        raise AnalysisError(
            "The painted region covers the whole picture, so nothing of the clean picture is left to find: paint a smaller region."
        )
    out = image.clone()
    out[..., r0 * patch_size:r1 * patch_size, c0 * patch_size:c1 * patch_size] = 0.0
    return out


def size_note(clean: Image.Image, corrupted: Image.Image, image_size: tuple[int, int]) -> str | None:
    """A sentence when the two pictures differ in size (each is resized to the model's input on
    its own, so their patches may not show the same places); None when they match."""
    if clean.size == corrupted.size:
        return None
    height, width = image_size
    return (
        f"The corrupted picture is {corrupted.width}x{corrupted.height} pixels and the clean one"
        f" {clean.width}x{clean.height}: each was resized to the model's {width}x{height}, so a patch may not"
        " show the same place in both."
    )
