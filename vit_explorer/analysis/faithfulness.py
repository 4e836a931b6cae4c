"""Is this map true? Deletion and insertion curves of any number of maps of one image: the
perturbation test that interpretability answers "attention is not explanation" with (Petsiuk et al.
2018, RISE; Chefer, Gur & Wolf 2021 rank rollout, raw attention and their attribution this way).

Each map ranks the patches. **Deletion**: remove them in that order, a step of the patches at a
time (default 20 steps of 5 %), and follow the score; a map that found what the model uses makes
it fall fast (a small area under the curve). **Insertion**: start from an empty image and add the
patches in that order; a true map makes the score rise fast (a large area). A seeded random order
is the floor either way.

Two ways to remove a patch (``mode``):

- ``"drop"`` (the default): the patch's token is dropped from the sequence. A ViT runs on any
  subset of its patch tokens: the position embeddings are added first, so the kept patches keep
  their positions; the prefix tokens (class, registers) stay; a rotary model rotates each kept
  patch by its own rows of the grid's sin/cos tables (``ViT.forward_blocks(rope=...)``), and a
  window-attention model (Qwen2.5-VL) keeps each kept patch in its own window. No grey
  patch, no blur: nothing the model never saw in training. A pass with half the tokens costs
  about half. With no patch left, a model whose output reads the patches (mean or attention
  pooling, or no prefix token) gets the image painted with its mean instead (the empty image of
  ``"mean"``); a class-token model runs on its prefix tokens alone.
- ``"mean"``: the patch's pixels are replaced by the image's mean colour (per channel, of the
  normalized input), CNN-style; every pass is a whole one.

The score: ``score(outputs) -> (B,)`` when given (an image-text cosine, say), else the softmax
probability of the class predicted for the intact image (or ``target``), else, for a headless
model, the cosine of the pooled output with the intact one. Each distinct set of kept patches is
run once, and the sets are packed (vit_explorer.model.packing): every set's tokens go through
the per-token work of one pass together, the attention stays within each set, and the sets with
the same number of tokens (every map's, deletion's and insertion's alike) attend as one batch;
a pass holds at most :data:`BATCH_TOKENS` tokens. The model is never changed:
the pass is built from its own modules, per call.

    result = faithfulness_curves(model, x, {"rollout": r, "raw attention": a, "attribution": c})
    result.areas("deletion")     # {"rollout": 0.21, ..., "random": 0.55}
    result.reading()             # "Removing the 10% of patches ... drops 'cat' from 91% to 12%; ..."

Shapes: P = gh * gw patches, M maps, S steps; a map is (gh, gw) or (P,), higher = more relevant.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from ..model.packing import Packing
from ..model.recorder import eval_mode
from ..model.vit import ViT
from ..model.windows import GridTables
from .answers import numbers, percents
from .checks import AnalysisError
from .maps import attention_mask_by_mass

MODES = ("drop", "mean")
CURVES = ("deletion", "insertion")
RANDOM = "random"  # the name of the seeded random order in a result
DEFAULT_STEPS = 20
# The most tokens one pass holds (rows x tokens): a ViT-B/16's 20-step deletion curve of one map is
# 1,882 tokens, every map's deletion and insertion curves (4 maps and the random order) 18,812.
BATCH_TOKENS = 8192
MODE_SENTENCES = {
    "drop": "Patches are removed by dropping their tokens: the model runs on the other patches only.",
    "mean": "Patches are removed by painting them with the image's mean colour, as tests of CNNs do.",
}


def _flat_map(name: str, relevance, num_patches: int) -> torch.Tensor:
    values = relevance if torch.is_tensor(relevance) else torch.from_numpy(np.asarray(relevance, dtype=np.float64))
    values = values.detach().to("cpu", torch.float64).reshape(-1)
    if values.numel() != num_patches:
        raise AnalysisError(f"The map '{name}' has {values.numel()} values for {num_patches} patches.")
    if not bool(torch.isfinite(values).all()):
        raise AnalysisError(f"The map '{name}' has values that are not numbers.")
    return values


def patch_orders(maps: Mapping[str, object], num_patches: int, random_order: bool = True, seed: int = 0) -> tuple[tuple[str, ...], torch.Tensor]:
    """The maps' names (then :data:`RANDOM`) and (M, P) each one's patches, most relevant first
    (ties in reading order)."""
    names = [str(name) for name in maps]
    if RANDOM in names and random_order:
        raise AnalysisError(f"'{RANDOM}' names the random order: give the map another name.")
    orders = [
        torch.sort(_flat_map(name, relevance, num_patches), descending=True, stable=True).indices
        for name, relevance in zip(names, maps.values())
    ]
    if random_order:
        names.append(RANDOM)
        orders.append(torch.randperm(num_patches, generator=torch.Generator().manual_seed(seed)))
    if not orders:
        raise AnalysisError("No map to test: give at least one, or keep the random order.")
    return tuple(names), torch.stack(orders)


def sharpest_mask(head_maps: torch.Tensor, mass: float = 0.6) -> tuple[int, torch.Tensor]:
    """A DINO head mask as a map to test (Caron et al. 2021: the fewest patches that hold ``mass``
    of a head's attention): of the heads' maps (H, gh, gw), the head whose mask holds the fewest
    patches (the sharpest; the first of a tie), and its map (gh, gw): that head's attention on the
    mask's patches and 0 elsewhere, so that a curve takes the mask's patches first, strongest
    first, then the others in reading order (the mask ranks nothing outside it)."""
    head_maps = head_maps.float()
    masks = attention_mask_by_mass(head_maps, mass)  # (H, gh, gw)
    head = int(masks.flatten(1).sum(-1).argmin())
    return head, torch.where(masks[head], head_maps[head], torch.zeros_like(head_maps[head]))


def step_counts(num_patches: int, steps: int | None = None) -> torch.Tensor:
    """(S + 1,) how many patches are removed (deletion) or added (insertion) at each step: 0, then
    evenly to all of them, rounded half up. ``steps`` default: DEFAULT_STEPS, or one a patch on a
    smaller grid."""
    steps = min(DEFAULT_STEPS, num_patches) if steps is None else steps
    if steps < 1 or steps > num_patches:
        raise AnalysisError(f"The number of steps must be between 1 and {num_patches}, not {steps}.")
    return torch.tensor([math.floor(step * num_patches / steps + 0.5) for step in range(steps + 1)])


def kept_masks(orders: torch.Tensor, counts: torch.Tensor, curves: Sequence[str] = CURVES) -> torch.Tensor:
    """(len(curves), M, S + 1, P) bool: which patches each curve keeps at each step of each order."""
    ranks = torch.empty_like(orders)
    ranks.scatter_(1, orders, torch.arange(orders.shape[1]).expand_as(orders))  # (M, P) place in the order
    top = ranks[:, None, :] < counts[None, :, None]  # (M, S + 1, P): the first counts[s] of the order
    masks = []
    for curve in curves:
        if curve not in CURVES:
            raise AnalysisError(f"A curve is one of {', '.join(CURVES)}, not {curve!r}.")
        masks.append(~top if curve == "deletion" else top)
    return torch.stack(masks)


def _reads_patches(model: ViT) -> bool:
    """Whether the model's output needs at least one patch token (it pools them, or has no prefix)."""
    return model.config.global_pool in ("mean", "map") or model.num_prefix_tokens == 0


def pass_tokens(model: ViT, kept: torch.Tensor, mode: str = "drop") -> torch.Tensor:
    """(R,) how many tokens the pass of each row of ``kept`` (R, P) runs on."""
    prefix, patches = model.num_prefix_tokens, kept.shape[-1]
    if mode == "mean":
        return torch.full((kept.shape[0],), prefix + patches)
    counts = kept.sum(-1)
    empty_as_mean = (counts == 0) & _reads_patches(model)
    return torch.where(empty_as_mean, prefix + patches, prefix + counts)


def kept_outputs(
    model: ViT, x: torch.Tensor, kept: torch.Tensor, mode: str = "drop", *, patch_size: int | None = None,
    batch_tokens: int = BATCH_TOKENS, progress: Callable[[float], None] | None = None,
) -> torch.Tensor:
    """(R, out) the model's output (logits, or the pooled embedding of a headless model) for one
    image ``x`` (1, C, H, W) with only the patches ``kept`` (R, P) bool of each row, the others
    removed as ``mode`` says (module docstring). Rows of dropped patches run packed, at most
    ``batch_tokens`` tokens a pass; painted rows (whole sequences) batched; float32 on the CPU.
    The model is not changed.
    ``progress(share)``: after each batch, the share of the tokens run so far."""
    return _kept_outputs(model, x, kept, mode, patch_size, batch_tokens, progress)[0]


def _kept_outputs(
    model: ViT, x: torch.Tensor, kept: torch.Tensor, mode: str, patch_size: int | None, batch_tokens: int,
    progress: Callable[[float], None] | None = None,
) -> tuple[torch.Tensor, int, int]:
    """:func:`kept_outputs`, and the batched passes and the tokens it ran."""
    if mode not in MODES:
        raise AnalysisError(f"Patches are removed by one of {', '.join(MODES)}, not {mode!r}.")
    if x.ndim == 3:
        x = x[None]
    if x.shape[0] != 1:
        raise AnalysisError(f"Curves are computed for one image at a time, not {x.shape[0]}.")
    grid = model.grid_size(patch_size)
    num_patches = grid[0] * grid[1]
    kept = torch.as_tensor(kept, dtype=torch.bool).cpu()
    if kept.ndim != 2 or kept.shape[1] != num_patches:
        raise AnalysisError(f"kept must be (rows, {num_patches}), not {tuple(kept.shape)}.")
    parameter = next(model.parameters())
    prefix = model.num_prefix_tokens
    outputs: list[torch.Tensor | None] = [None] * kept.shape[0]
    passes = tokens_run = 0
    total = max(int(pass_tokens(model, kept, mode).sum()), 1) if progress is not None else 1

    def record(chunk: torch.Tensor, out: torch.Tensor, tokens: int) -> None:
        """One pass's outputs (len(chunk), out) of the rows ``chunk``, ``tokens`` tokens run."""
        nonlocal passes, tokens_run
        passes, tokens_run = passes + 1, tokens_run + tokens
        for row, value in zip(chunk.tolist(), out.float().cpu()):
            outputs[row] = value
        if progress is not None:
            progress(min(tokens_run / total, 1.0))

    with torch.no_grad(), eval_mode(model):
        x = x.to(parameter.device, parameter.dtype)
        embedded = model.patch_embed(x, patch_size)  # (1, P, D)
        counts = kept.sum(-1)
        painted = torch.ones_like(counts, dtype=torch.bool) if mode == "mean" else (counts == 0) & _reads_patches(model)
        if bool(painted.any()):
            # The image's mean colour, cut and embedded as every patch is: one (1, 1, D) embedding.
            mean_image = x.mean(dim=(-2, -1), keepdim=True).expand_as(x)
            mean_patch = model.patch_embed(mean_image, patch_size)[:, :1]  # (1, 1, D)
            for chunk in painted.nonzero().flatten().split(max(1, batch_tokens // (prefix + num_patches))):
                patches = torch.where(kept[chunk, :, None].to(embedded.device), embedded, mean_patch)  # (r, P, D)
                tokens = model.norm_pre(model._pos_embed(patches, patch_size))  # (r, N, D)
                record(chunk, model.forward_head(model.forward_blocks(tokens, grid_size=grid)), tokens.shape[:2].numel())
        if not bool(painted.all()):
            whole = model.norm_pre(model._pos_embed(embedded, patch_size))  # (1, N, D): positions added
            tables = model.rope_tables(grid)
            windows = getattr(tables, "windows", None)
            if windows is not None:  # window attention: each row alone, its kept patches in their own windows
                for row in (~painted).nonzero().flatten():
                    index = kept[row].nonzero()[:, 0].to(whole.device)
                    tokens = torch.cat([whole[:, :prefix], whole[:, prefix:][:, index]], dim=1)
                    rows = GridTables(*(None if table is None else table[index] for table in tables), windows[index])
                    out = model.forward_head(model.forward_blocks(tokens, grid_size=grid, rope=rows))
                    record(row[None], out, tokens.shape[1])
                return torch.stack(outputs), passes, tokens_run
            for chunk in _packed_chunks(counts, ~painted, prefix, batch_tokens):
                # One packed pass of the chunk's rows, a run per number of kept patches.
                runs, rows = [], []  # each run's tokens (r, prefix + K, D), and its rope rows (r, K, hd)
                lengths, sizes = torch.unique_consecutive(counts[chunk], return_counts=True)
                for count, members in zip(lengths.tolist(), chunk.split(sizes.tolist())):
                    index = kept[members].nonzero()[:, 1].reshape(len(members), count).to(whole.device)  # grid order
                    runs.append(torch.cat([whole[:, :prefix].expand(len(members), -1, -1), whole[0, prefix:][index]], dim=1))
                    if tables is not None:
                        rows.append((tables[0][index], tables[1][index]))
                packing = Packing.of(runs)
                rope = None if tables is None else packing.rope(prefix, rows)
                out = model.forward_blocks(packing.tokens, grid_size=grid, rope=rope, packing=packing)
                out = torch.cat([model.forward_head(tokens) for tokens in packing.unpack(out)])
                record(chunk, out, packing.tokens.shape[1])
    return torch.stack(outputs), passes, tokens_run


def _packed_chunks(counts: torch.Tensor, rows: torch.Tensor, prefix: int, batch_tokens: int) -> list[torch.Tensor]:
    """The ``rows`` (bool mask) to run, by their kept ``counts``, most tokens first, in chunks of
    at most ``batch_tokens`` tokens (a longer row alone): each chunk one packed pass."""
    order = rows.nonzero().flatten()
    order = order[torch.sort(counts[order], descending=True, stable=True).indices]
    chunks, start, used = [], 0, 0
    for place, row in enumerate(order.tolist()):
        length = prefix + int(counts[row])
        if used and used + length > batch_tokens:
            chunks.append(order[start:place])
            start, used = place, 0
        used += length
    return chunks + [order[start:]] if len(order) else chunks


def default_score(model: ViT, intact: torch.Tensor, target: int | None = None) -> tuple[Callable[[torch.Tensor], torch.Tensor], str, bool, int | None]:
    """The score of a model's outputs (B, out) -> (B,), what it is in words, whether it reads as a
    percentage, and the class it follows: a classifier's softmax probability of ``target`` (default:
    the intact image's predicted class), a headless model's cosine with its ``intact`` output."""
    intact = intact.reshape(-1).float()
    config = model.config
    if config.num_classes:
        target = int(intact.argmax()) if target is None else int(target)
        if not 0 <= target < config.num_classes:
            raise AnalysisError(f"The target class must be in 0..{config.num_classes - 1}, not {target}.")
        name = config.class_names[target] if config.class_names else f"class {target}"
        return (lambda outputs: outputs.float().softmax(-1)[:, target]), f"'{name}'", True, target
    if target is not None:
        raise AnalysisError("A model without a classifier has no target class: its score is the cosine with the intact embedding.")
    return (
        lambda outputs: F.cosine_similarity(outputs.float(), intact[None].to(outputs.device), dim=-1),
        "the embedding's cosine with the intact one", False, None,
    )


@dataclass(frozen=True)
class Faithfulness:
    """Every map's deletion and insertion curves of one image (:func:`faithfulness_curves`)."""

    names: tuple[str, ...]  # the maps in the order given, then RANDOM
    orders: torch.Tensor  # (M, P) each map's patches, most relevant first
    counts: torch.Tensor  # (S + 1,) patches removed (deletion) or added (insertion) at each step
    fractions: torch.Tensor  # (S + 1,) the same as a share of the patches, 0 to 1
    curves: dict[str, torch.Tensor]  # "deletion" / "insertion" -> (M, S + 1) scores
    intact: float  # the score of the whole image
    empty: float  # the score with every patch removed
    mode: str  # "drop" or "mean"
    what: str  # what the score is, in words: "'cat'", "the embedding's cosine with the intact one"
    percent: bool  # the score is a probability (read as a percentage)
    target: int | None  # the class followed, for a classifier's default score
    passes: int  # batched passes run
    forwards: float  # their tokens, in whole passes of the image (rows x tokens / N)

    def area(self, curve: str = "deletion") -> torch.Tensor:
        """(M,) the area under each map's curve: the trapezoid over the share removed (or added),
        0 to 1. Deletion: smaller is truer; insertion: larger is truer."""
        if curve not in self.curves:
            raise AnalysisError(f"There is no {curve} curve here; computed: {', '.join(self.curves)}.")
        scores = self.curves[curve].double()
        widths = self.fractions.double().diff()
        return ((scores[:, 1:] + scores[:, :-1]) / 2 * widths).sum(-1).float()

    def areas(self, curve: str = "deletion") -> dict[str, float]:
        """Each map's area under ``curve``, by name (the table the page shows)."""
        return dict(zip(self.names, self.area(curve).tolist()))

    def best(self, curve: str = "deletion") -> str:
        """The map the curve favours: the smallest deletion area, or the largest insertion area."""
        area = self.area(curve)
        return self.names[int(area.argmin() if curve == "deletion" else area.argmax())]

    def step_at(self, fraction: float) -> int:
        """The step that removes (or adds) the share of the patches nearest ``fraction`` (the first of two)."""
        return int((self.fractions.double() - fraction).abs().argmin())

    def reading(self, fraction: float = 0.1, curve: str = "deletion") -> str:
        """One sentence: what removing (or adding only) the ``fraction`` of the patches each map
        ranks highest does to the score, the map that moves it most first, e.g. "Removing the 10%
        of patches rollout ranks highest drops 'cat' from 91% to 12%; for raw attention to 64%,
        for a random order to 88%."."""
        step = self.step_at(fraction)
        values = self.curves[curve][:, step].tolist() if curve in self.curves else None
        if values is None:
            raise AnalysisError(f"There is no {curve} curve here; computed: {', '.join(self.curves)}.")
        start = self.intact if curve == "deletion" else self.empty
        order = sorted(range(len(self.names)), key=lambda index: values[index] * (1 if curve == "deletion" else -1))
        share = f"{float(self.fractions[step]):.0%}"
        first, rest = order[0], order[1:]

        def who(index: int) -> str:
            return "a random order" if self.names[index] == RANDOM else self.names[index]

        if self.names[first] == RANDOM:
            lead = f"{'Removing' if curve == 'deletion' else 'Keeping only'} a random {share} of the patches"
        else:
            lead = (
                f"{'Removing' if curve == 'deletion' else 'Keeping only'} the {share} of patches "
                f"{self.names[first]} ranks highest"
            )
        # Shown with the decimals that tell the values apart (a random ViT-B/16's 'class 782' went
        # "from 1% to 1%"): a change too small to show is said to leave the score where it was.
        shown = percents(start, *values) if self.percent else numbers(start, *values)
        start_shown, shown = shown[0], shown[1:]
        change = values[first] - start
        verb = "leaves" if shown[first] == start_shown else "drops" if change < 0 else "raises"
        moved = (
            f"{verb} {self.what} at {start_shown}" if verb == "leaves"
            else f"{verb} {self.what} from {start_shown} to {shown[first]}"
        )
        others = ", ".join(f"for {who(index)} to {shown[index]}" for index in rest)
        return f"{lead} {moved}" + (f"; {others}." if others else ".")


def planned_forwards(
    model: ViT, num_maps: int, steps: int | None = None, mode: str = "drop", curves: Sequence[str] = CURVES,
    random_order: bool = True, intact_given: bool = False, patch_size: int | None = None,
) -> float:
    """What :func:`faithfulness_curves` will cost, in whole forward passes of the image (tokens
    run / tokens of one pass), before it runs: for the app's costs and a job's admission. Each
    curve's steps between the two ends, one pass with no patch, and the intact one unless given."""
    grid = model.grid_size(patch_size)
    num_patches, prefix = grid[0] * grid[1], model.num_prefix_tokens
    inner = step_counts(num_patches, steps)[1:-1]
    kept = []
    for curve in dict.fromkeys(curves):
        kept.append(num_patches - inner if curve == "deletion" else inner)
    kept = torch.cat(kept).repeat(num_maps + int(random_order))
    rows = torch.arange(num_patches)[None] < kept[:, None]  # (R, P) with the right counts
    rows = torch.cat([rows, torch.zeros(1, num_patches, dtype=torch.bool)])
    tokens = int(pass_tokens(model, rows, mode).sum()) + (0 if intact_given else prefix + num_patches)
    return tokens / (prefix + num_patches)


def _plan(
    model: ViT, maps: Mapping[str, object], steps: int | None, curves: Sequence[str], random_order: bool, seed: int,
    patch_size: int | None,
):
    """(names, orders (M, P), counts (S + 1,), kept (C, M, S + 1, P), the distinct rows (U, P), each
    kept row's place among them, which of them keep every patch)."""
    grid = model.grid_size(patch_size)
    num_patches = grid[0] * grid[1]
    names, orders = patch_orders(maps, num_patches, random_order, seed)
    counts = step_counts(num_patches, steps)
    kept = kept_masks(orders, counts, curves)  # (C, M, S + 1, P)
    unique, inverse = kept.reshape(-1, num_patches).unique(dim=0, return_inverse=True)  # (U, P), (C*M*(S+1),)
    return names, orders, counts, kept, unique, inverse, unique.all(-1)


def curve_rows(
    model: ViT, maps: Mapping[str, object], *, steps: int | None = None, curves: Sequence[str] = CURVES,
    random_order: bool = True, seed: int = 0, patch_size: int | None = None,
) -> torch.Tensor:
    """(U, P) bool: the sets of kept patches :func:`faithfulness_curves` runs for these arguments
    (each distinct set once, the whole image aside), in its order. Their :func:`kept_outputs`
    computed elsewhere (a job beside a server) come back as its ``outputs``, and then it runs no
    pass at all."""
    curves = tuple(dict.fromkeys(curves))
    *_, unique, _, whole = _plan(model, maps, steps, curves, random_order, seed, patch_size)
    return unique[~whole]


def faithfulness_curves(
    model: ViT,
    x: torch.Tensor,
    maps: Mapping[str, object],
    *,
    steps: int | None = None,
    mode: str = "drop",
    curves: Sequence[str] = CURVES,
    target: int | None = None,
    score: Callable[[torch.Tensor], torch.Tensor] | None = None,
    what: str | None = None,
    percent: bool | None = None,
    random_order: bool = True,
    seed: int = 0,
    intact: torch.Tensor | None = None,
    patch_size: int | None = None,
    batch_tokens: int = BATCH_TOKENS,
    outputs: torch.Tensor | None = None,
    progress: Callable[[float], None] | None = None,
) -> Faithfulness:
    """Deletion and insertion curves of every map in ``maps`` (name -> (gh, gw) or (P,) relevance)
    for one image ``x`` (1, C, H, W), and of a random order (``seed``) unless ``random_order`` is
    False. ``steps`` steps of 1/steps of the patches each (default 20, fewer on a grid of fewer patches); ``mode`` "drop" or "mean" (module
    docstring); ``curves`` a subset of ("deletion", "insertion").

    The score: ``score`` (outputs (B, out) -> (B,), ``what`` it is in words, ``percent`` if it is
    a probability), else :func:`default_score` (``target``: the class to follow). ``intact``: the
    model's output for the whole image if the caller has it (``capture(...).logits[i]``), which
    saves that pass. ``patch_size``: the FlexiViT patch size of the call, as ``model(x,
    patch_size)``. Each distinct set of kept patches runs once; see :func:`kept_outputs`.
    ``outputs``: (U, out) the outputs of :func:`curve_rows`' rows for the same arguments, computed
    elsewhere (with ``intact``, nothing runs here). ``progress(share)``: after each batch.
    """
    grid = model.grid_size(patch_size)
    num_patches = grid[0] * grid[1]
    if mode not in MODES:
        raise AnalysisError(f"Patches are removed by one of {', '.join(MODES)}, not {mode!r}.")
    curves = tuple(dict.fromkeys(curves))
    if not curves:
        raise AnalysisError(f"Ask for at least one curve: {', '.join(CURVES)}.")
    if score is not None and target is not None:
        raise AnalysisError("Give either a score function or a target class, not both.")
    names, orders, counts, kept, unique, inverse, whole = _plan(model, maps, steps, curves, random_order, seed, patch_size)
    to_run = unique[~whole]
    if outputs is not None:
        outputs = torch.as_tensor(outputs).detach().float().cpu()
        if outputs.ndim != 2 or outputs.shape[0] != len(to_run):
            raise AnalysisError(
                f"The outputs given are for {outputs.shape[0] if outputs.ndim else 0} sets of patches, not the"
                f" {len(to_run)} these curves run."
            )
    if intact is None:
        intact_output, passes, tokens_run = _kept_outputs(
            model, x, torch.ones(1, num_patches, dtype=torch.bool), mode, patch_size, batch_tokens
        )
        intact_output = intact_output[0]
    else:
        intact_output = torch.as_tensor(intact).detach().float().cpu().reshape(-1)
        passes = tokens_run = 0
    if outputs is None and len(to_run):
        outputs, ran, ran_tokens = _kept_outputs(model, x, to_run, mode, patch_size, batch_tokens, progress)
        passes, tokens_run = passes + ran, tokens_run + ran_tokens
    if score is None:
        score_of, default_what, default_percent, target = default_score(model, intact_output, target)
    else:
        score_of, default_what, default_percent = score, "the score", False
    values = torch.empty(len(unique))
    values[whole] = score_of(intact_output[None]).float().cpu()
    if outputs is not None and len(to_run):
        values[~whole] = score_of(outputs).float().cpu().reshape(-1)
    scores = values[inverse].reshape(kept.shape[:3])  # (C, M, S + 1)
    intact_score = float(score_of(intact_output[None]).reshape(-1)[0])
    empty_score = float(values[~unique.any(-1)][0])  # every curve has a step with no patch
    return Faithfulness(
        names=names, orders=orders, counts=counts, fractions=counts.float() / num_patches,
        curves={curve: scores[index] for index, curve in enumerate(curves)},
        intact=intact_score, empty=empty_score, mode=mode,
        what=default_what if what is None else what, percent=default_percent if percent is None else percent,
        target=target, passes=passes, forwards=tokens_run / (model.num_prefix_tokens + num_patches),
    )
