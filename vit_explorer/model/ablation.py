"""Knock heads and whole branches out of a ViT for one call, and the importance sweep.

A :class:`KnockOut` says which heads of which layers, and which layers' attention or MLP
branches, to remove, and how:

- ``"zero"``: the removed heads' outputs (the branch's inner activations: the concatenated heads
  entering ``attn.proj``, the hidden units entering ``mlp.fc2``) are set to 0, so a removed
  branch adds only its output bias;
- ``"mean"``: they are replaced by their mean over this image's tokens (per image of a batch), so
  a removed branch adds its own average output to every token and no token-specific information.

Either way a whole attention branch is exactly every one of its heads knocked out. The knock-out
is chosen per call, as the recorder is (:data:`vit_explorer.model.vit.ACTIVE_KNOCKOUT`): the
shared model is never hooked or switched, so concurrent sessions each get their own results.

    cap = vx.capture(model, x, knock_out=vx.KnockOut(heads={3: (0, 5)}, mlp=(7,), mode="mean"))
    sweep = vx.head_sweep(model, x)  # every head alone: (L, H) change of the prediction

Shapes: B images, L layers, H heads, N tokens, hd head dim.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .recorder import Recorder, eval_mode, recording
from .vit import ACTIVE_KNOCKOUT, ViT

MODES = ("zero", "mean")
# The sweep runs at most this many knocked-out copies of the image in one batch.
SWEEP_BATCH = 16


def _layers(layers: Iterable[int]) -> tuple[int, ...]:
    return tuple(sorted({int(layer) for layer in layers}))


@dataclass(frozen=True)
class KnockOut:
    """Which heads and branches one forward pass loses. ``heads`` maps layer -> head indices
    (stored as sorted ((layer, heads), ...) pairs, so that a knock-out can key a cache);
    ``attention`` and ``mlp`` list layers whose whole branch is removed; ``mode`` is "zero" or
    "mean" (see the module docstring). Layers and heads count from 0."""

    heads: Mapping[int, Iterable[int]] | tuple = ()
    attention: Iterable[int] = ()
    mlp: Iterable[int] = ()
    mode: str = "zero"

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"the knock-out mode must be one of {', '.join(MODES)}, not {self.mode!r}")
        pairs = self.heads.items() if isinstance(self.heads, Mapping) else self.heads
        chosen_heads = ((int(layer), _layers(chosen)) for layer, chosen in pairs)
        heads = tuple(sorted((layer, chosen) for layer, chosen in chosen_heads if chosen))
        object.__setattr__(self, "heads", heads)
        object.__setattr__(self, "attention", _layers(self.attention))
        object.__setattr__(self, "mlp", _layers(self.mlp))

    @property
    def is_empty(self) -> bool:
        return not (self.heads or self.attention or self.mlp)

    def problem(self, config) -> str | None:
        """Why this knock-out cannot run on a model of ``config``, in one sentence; None if it can."""
        depth, num_heads = config.depth, config.num_heads
        layers = [layer for layer, _ in self.heads] + list(self.attention) + list(self.mlp)
        missing = sorted({layer for layer in layers if not 0 <= layer < depth})
        if missing:
            return f"Layer {missing[0]} does not exist: this model has layers 0 to {depth - 1}."
        for layer, heads in self.heads:
            bad = [head for head in heads if not 0 <= head < num_heads]
            if bad:
                return f"Head {bad[0]} of layer {layer} does not exist: this model has heads 0 to {num_heads - 1}."
        if bool(self.head_mask(config).all()):
            return (
                "Knocking out every head of every layer leaves the tokens nothing to read from one"
                " another, so there is nothing left to compare: keep at least one head."
            )
        return None

    def head_mask(self, config) -> torch.Tensor:
        """(L, H) bool: True for every head this knock-out removes (a removed branch: all its heads)."""
        mask = torch.zeros(config.depth, config.num_heads, dtype=torch.bool)
        for layer, heads in self.heads:
            mask[layer, list(heads)] = True
        mask[list(self.attention)] = True
        return mask

    def mlp_mask(self, config) -> torch.Tensor:
        """(L,) bool: True for every layer whose MLP branch this knock-out removes."""
        mask = torch.zeros(config.depth, dtype=torch.bool)
        mask[list(self.mlp)] = True
        return mask

    def first_layer(self) -> int | None:
        """The first layer this knock-out changes (the layers before it run as if intact), or None."""
        layers = [layer for layer, _ in self.heads] + list(self.attention) + list(self.mlp)
        return min(layers, default=None)

    def describe(self) -> str:
        """One line for titles: what is knocked out and how."""
        if self.is_empty:
            return "nothing knocked out"
        parts = [f"layer {layer} head{'s' if len(heads) > 1 else ''} {', '.join(map(str, heads))}"
                 for layer, heads in self.heads]
        parts += [f"layer {layer} attention" for layer in self.attention]
        parts += [f"layer {layer} MLP" for layer in self.mlp]
        return f"{'; '.join(parts)} ({self.mode}-ablated)"

    @contextmanager
    def applied(self, model: ViT) -> Iterator[None]:
        """Forward passes of ``model`` in this context (thread) run with this knock-out."""
        problem = self.problem(model.config)
        if problem:
            raise ValueError(problem)
        config = model.config
        with knocking_out(model, self.head_mask(config)[None], self.mlp_mask(config)[None], self.mode):
            yield


class _PassKnockOut:
    """What the passes of one call knock out, per image: ``heads_off`` (B or 1, L, H) and
    ``mlp_off`` (B or 1, L), found by the model's modules through ``ACTIVE_KNOCKOUT``."""

    def __init__(self, model: ViT, heads_off: torch.Tensor, mlp_off: torch.Tensor, mode: str):
        device = next(model.parameters()).device
        self.mode = mode
        self.heads_off = heads_off.to(device)
        self.mlp_off = mlp_off.to(device)
        self._attention_layer = {block.attn: index for index, block in enumerate(model.blocks)}
        self._mlp_layer = {block.mlp: index for index, block in enumerate(model.blocks)}
        # Layers with nothing to do are skipped without touching the tensors (no device sync).
        self._attention_layers = set(heads_off.any(dim=(0, 2)).nonzero().flatten().tolist())
        self._mlp_layers = set(mlp_off.any(dim=0).nonzero().flatten().tolist())

    def _replace(self, values: torch.Tensor, off: torch.Tensor, token_dim: int) -> torch.Tensor:
        replacement = 0.0 if self.mode == "zero" else values.mean(dim=token_dim, keepdim=True)
        return torch.where(off, replacement, values)

    def heads(self, module: torch.nn.Module, heads: torch.Tensor) -> torch.Tensor:
        """(B, H, N, hd) head outputs with this pass's knocked-out heads of ``module`` replaced."""
        layer = self._attention_layer.get(module)
        if layer not in self._attention_layers:
            return heads
        return self._replace(heads, self.heads_off[:, layer, :, None, None], token_dim=2)

    def hidden(self, module: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """(B, N, hidden) MLP units, replaced where this pass knocks ``module``'s branch out."""
        layer = self._mlp_layer.get(module)
        if layer not in self._mlp_layers:
            return hidden
        return self._replace(hidden, self.mlp_off[:, layer, None, None], token_dim=1)


@contextmanager
def knocking_out(model: ViT, heads_off: torch.Tensor, mlp_off: torch.Tensor, mode: str = "zero"):
    """Knock heads (``heads_off`` (B or 1, L, H) bool) and MLP branches (``mlp_off`` (B or 1, L)
    bool) out of the passes of ``model`` run in this context, each image of the batch its own."""
    token = ACTIVE_KNOCKOUT.set(_PassKnockOut(model, heads_off, mlp_off, mode))
    try:
        yield
    finally:
        ACTIVE_KNOCKOUT.reset(token)


# --- the importance sweep -----------------------------------------------------------------------


@dataclass(frozen=True)
class HeadSweep:
    """The effect of knocking out each head alone on one image."""

    # (L, H): with a classifier, the change of the intact prediction's log-probability; headless,
    # the cosine similarity of the pooled feature to the intact one, minus 1. 0 = no effect.
    values: torch.Tensor
    target: int | None  # the class the intact model predicts (None for a headless model)
    mode: str

    @property
    def measure(self) -> str:
        return "change of log p" if self.target is not None else "cosine change"


def sweep_cost(config) -> float:
    """What :func:`head_sweep` costs in forward passes of the model: one intact pass, then per
    layer one knocked-out copy per head through that layer and those after it only (the layers
    before are the intact pass's), H (L + 1) / 2 passes in all, batched."""
    depth = config.depth
    return 1 + config.num_heads * sum(depth - layer for layer in range(depth)) / depth


def head_sweep(
    model: ViT, image: torch.Tensor, mode: str = "zero",
    progress: Callable[[float], None] | None = None, batch_size: int = SWEEP_BATCH,
) -> HeadSweep:
    """Knock each head of ``model`` out alone on one normalized image (1, C, H, W), in eval mode
    without gradients, and measure how the output moves (:class:`HeadSweep`).

    The tokens entering every layer come from one intact pass; the knocked-out copies of layer l
    start from its input, up to ``batch_size`` of them in one batch, each with its own head
    removed, so the layers before l are never run again. ``progress`` gets the share done (0..1)
    after each batch. An entry equals ``capture(model, image, knock_out=KnockOut(heads={l: (h,)},
    mode=mode))`` up to float rounding.
    """
    if mode not in MODES:
        raise ValueError(f"the knock-out mode must be one of {', '.join(MODES)}, not {mode!r}")
    if image.ndim == 3:
        image = image.unsqueeze(0)
    if image.shape[0] != 1:
        raise ValueError(f"the sweep takes one image, not a batch of {image.shape[0]}")
    config = model.config
    depth, num_heads = config.depth, config.num_heads
    parameter = next(model.parameters())
    classifier = config.num_classes > 0
    values = torch.zeros(depth, num_heads)
    total = sum(num_heads * (depth - layer) for layer in range(depth))
    done = 0
    with torch.no_grad(), eval_mode(model):
        recorder = Recorder(model, (), tokens=True)
        with recording(recorder):
            intact = model(image.to(parameter.device)).float()  # (1, classes or D)
        target = int(intact.argmax()) if classifier else None
        reference = intact.log_softmax(-1)[0, target] if classifier else intact
        for layer in range(depth):
            entering = recorder.token_states[layer].to(parameter.device, parameter.dtype)  # (1, N, D)
            for first in range(0, num_heads, batch_size):
                heads = torch.arange(first, min(first + batch_size, num_heads))
                heads_off = torch.zeros(len(heads), depth, num_heads, dtype=torch.bool)
                heads_off[torch.arange(len(heads)), layer, heads] = True
                tokens = entering.expand(len(heads), -1, -1)
                with knocking_out(model, heads_off, torch.zeros(len(heads), depth, dtype=torch.bool), mode):
                    out = model.forward_blocks(tokens, layer, grid_size=config.grid_size)
                    out = model.forward_head(out).float()  # (b, classes or D)
                if classifier:
                    change = out.log_softmax(-1)[:, target] - reference
                else:
                    change = F.cosine_similarity(out, reference, dim=-1) - 1
                values[layer, heads] = change.cpu()
                done += len(heads) * (depth - layer)
                if progress is not None:
                    progress(done / total)
    return HeadSweep(values=values, target=target, mode=mode)


def pooled_cosine(intact: torch.Tensor, knocked: torch.Tensor) -> float:
    """The cosine between two pooled features (D,): how a headless model's output turned."""
    return float(F.cosine_similarity(intact.float(), knocked.float(), dim=-1))
