"""Registers added at test time (Jiang, Dravid, Efros & Gandelsman 2025, "Vision Transformers Don't
Need Trained Registers"; code: github.com/nickjiang2378/test-time-registers).

Large ViTs reuse a few low-information patches as scratch space: their tokens get norms far above
the rest and draw attention (Darcet et al. 2023). Jiang et al. find that a few MLP units, the
"register neurons", write those outliers; moving their activation into one extra token appended
at test time, untrained and zero, takes the outliers out of the image:

- :func:`find_register_neurons`: the outlier patches of some images (image_set.norm_outliers, at
  a late layer), then every MLP unit scored by its mean absolute activation on them, kept only if
  it is sparse (below 0.5 on at least half of the tokens), averaged over the images with outliers,
  ranked over all layers; :meth:`RegisterNeurons.register` keeps the best ones of the layers up to
  where the outliers appear (their ``filter_layers`` and ``top_k``).
- :class:`TestTimeRegister`: for one call (the context variable ``model.ACTIVE_REGISTER``, as a
  knock-out rides a pass), one more token of zeros after the prefix tokens, without a position;
  in each layer with register neurons, their activation on the patches is set to 0 and the
  register's to the largest one (in magnitude) of the image's tokens. The shared model is never
  changed; other threads' passes see no register.
- :func:`plant_register_neuron`: a copy of a model with one register neuron made by hand (firing,
  say, on :func:`low_information_patches`), what tests and benchmarks check the two against
  (random and small models have no outliers).

    neurons = find_register_neurons(model, vx.capture(model, x))   # ranked (layer, unit, score)
    cap = register_capture(model, x, neurons.register(count=10))   # the pass with the register

Shapes: B images, L layers, N tokens, P = gh * gw patches, D features, U hidden units of an MLP.
"""
from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from einops import rearrange

from ..model.capture import Capture, capture
from ..model.recorder import eval_mode
from ..model.vit import ACTIVE_REGISTER, LayerScale, ViT
from .checks import AnalysisError
from .image_set import NormOutliers, norm_outliers

# The sparsity filter of their find_register_neurons (shared/algorithms.py, apply_sparsity_filter,
# as register_neurons.ipynb calls it): a unit counts only if its activation is below
# SPARSE_ACTIVATION on at least SPARSE_SHARE of the tokens.
SPARSE_ACTIVATION = 0.5
SPARSE_SHARE = 0.5
# Outliers "appear" after the first layer where at least this share of them already stand out.
APPEAR_SHARE = 0.5
# Their configs keep 10 neurons for CLIP ViT-B/16 (configs/openai_clip_base.yaml, top_k).
DEFAULT_COUNT = 10
# plant_register_neuron's smallest gap between the two groups along the unit's axis, as a share of
# all the tokens' spread along it (for 16 plain patches of two random pictures in a ViT-Ti: 0.33).
MIN_SEPARATION = 1e-4
# What the search of every layer costs per image beyond its capture, in forward passes (measured:
# the blocks again up to each MLP's activation, the attention and fc1 of a block but not its fc2).
SEARCH_PASSES = 0.8


def _pairs(neurons: Mapping[int, Iterable[int]] | Iterable) -> tuple[tuple[int, tuple[int, ...]], ...]:
    pairs = neurons.items() if isinstance(neurons, Mapping) else neurons
    chosen: dict[int, set[int]] = {}
    for layer, units in pairs:
        chosen.setdefault(int(layer), set()).update(int(unit) for unit in units)
    return tuple(sorted((layer, tuple(sorted(units))) for layer, units in chosen.items() if units))


@dataclass(frozen=True)
class TestTimeRegister:
    """One extra token and the register neurons whose activations move into it. ``neurons`` maps
    layer -> MLP units (stored as sorted ((layer, units), ...) pairs, so that a register can key a
    cache); without neurons the token is appended and nothing moves into it."""

    __test__ = False  # a class of the package, not a pytest test class

    neurons: Mapping[int, Iterable[int]] | tuple = ()

    def __post_init__(self):
        object.__setattr__(self, "neurons", _pairs(self.neurons))

    @property
    def count(self) -> int:
        return sum(len(units) for _, units in self.neurons)

    def problem(self, config) -> str | None:
        """Why this register cannot run on a model of ``config``, in one sentence; None if it can."""
        for layer, units in self.neurons:
            if not 0 <= layer < config.depth:
                return f"Layer {layer} does not exist: this model has layers 0 to {config.depth - 1}."
            bad = [unit for unit in units if not 0 <= unit < config.mlp_hidden]
            if bad:
                return f"Unit {bad[0]} of layer {layer} does not exist: its MLP has units 0 to {config.mlp_hidden - 1}."
        return None

    @contextmanager
    def applied(self, model: ViT) -> Iterator[None]:
        """Forward passes of ``model`` in this context (thread) run with this register."""
        problem = self.problem(model.config)
        if problem:
            raise ValueError(problem)
        token = ACTIVE_REGISTER.set(_PassRegister(model, self))
        try:
            yield
        finally:
            ACTIVE_REGISTER.reset(token)


class _PassRegister:
    """What the passes of one call do, found by the model through ``ACTIVE_REGISTER``: the token
    appended to ``model``'s sequence (a model run alongside, such as a second one compared, gets
    none) and the units moved in its MLPs.

    Their recipe (shared/hook_fn.py, ``activate_on_registers`` with ``normal_values="zero"`` and
    ``scale=1``, hooked on each register layer's MLP activation): the register's activation of the
    layer's register neurons is the sign-max (the value largest in magnitude, sign kept) over every
    token and every one of those neurons together, one number per layer and image as theirs is,
    and the image's tokens get 0 there. Theirs zeroes every token but the class token and the
    registers, which for the models they ran (no trained registers) are the patches: here the
    patches, whatever prefix tokens a model has. The token is zeros added after the positions
    (their ``prepare_tokens_with_masks`` for DINOv2, ``extra_tokens`` for CLIP, appended before
    CLIP's ln_pre): it has no position, and it is not rotated (Attention.rotate rotates the patches
    only). They append it last; placed after the prefix tokens instead it is one more prefix token
    to every analysis, and attention, which ignores order, computes the same.
    """

    def __init__(self, model: ViT, register: TestTimeRegister):
        device = next(model.parameters()).device
        self.model = model
        self.index = model.num_prefix_tokens  # the register's place: right after the prefix tokens
        self._units = {
            model.blocks[layer].mlp: torch.tensor(units, device=device) for layer, units in register.neurons
        }

    def added_tokens(self, model: ViT) -> int:
        return int(model is self.model)

    def token(self, model: ViT) -> int | None:
        """The register's index among ``model``'s tokens in this pass; None if it has none."""
        return self.index if model is self.model else None

    def append(self, model: ViT, x: torch.Tensor) -> torch.Tensor:
        """(B, N, D) tokens with positions -> (B, N + 1, D), a token of zeros after the prefix tokens."""
        if model is not self.model:
            return x
        zeros = x.new_zeros(x.shape[0], 1, x.shape[2])
        return torch.cat([x[:, : self.index], zeros, x[:, self.index :]], dim=1)

    def hidden(self, module: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """(B, N, U) hidden units of ``module``: its register neurons' activations moved into the register."""
        units = self._units.get(module)
        if units is None:
            return hidden
        chosen = hidden[:, :, units]  # (B, N, u)
        top, bottom = chosen.amax(dim=(1, 2)), chosen.amin(dim=(1, 2))  # (B,) each
        peak = torch.where(top.abs() > bottom.abs(), top, bottom)  # their sign_max, per image
        moved = hidden.clone()
        moved[:, self.index + 1 :, units] = 0.0  # the patches
        moved[:, self.index, units] = peak[:, None].to(hidden.dtype)
        return moved


def register_capture(
    model: ViT, images: torch.Tensor, register: TestTimeRegister, layers: Sequence[int] | None = None,
    attention_dtype: torch.dtype = torch.float32,
) -> Capture:
    """:func:`vit_explorer.model.capture` of ``images`` with ``register`` in this pass: its token is the
    last prefix token (``Capture.register_token``, counted in ``num_prefix_tokens``), so that the
    analyses of a capture read it as they read a trained register."""
    with register.applied(model):
        return capture(model, images, layers=layers, attention_dtype=attention_dtype)


# --- finding the register neurons ----------------------------------------------------------------


@dataclass(frozen=True)
class RegisterNeurons:
    """Every MLP unit of a model scored as a register neuron over some images."""

    # (layers searched, U), layers 0 on: each unit's mean absolute activation on the outlier tokens
    # of an image, 0 for a unit that is not sparse on it, averaged over the images with outliers.
    scores: torch.Tensor
    outliers: NormOutliers  # the patch tokens' norms (B, P) after ``layer`` and which are outliers
    layer: int  # the layer after which the outliers were found
    appears_at: int  # the first layer after which most of those outliers stand out already
    images: int  # the images with outliers, whose scores are averaged

    def top(self, count: int, first: int = 0, last: int | None = None) -> list[tuple[int, int, float]]:
        """The ``count`` best (layer, unit, score) of the layers ``first`` to ``last`` (default: where
        the outliers appear; the layers searched at most), best first; units scoring 0 are never
        register neurons."""
        last = self.appears_at if last is None else last
        if last >= len(self.scores):
            raise ValueError(f"Layer {last} was not searched: search up to it (find_register_neurons(..., last={last})).")
        scores = self.scores[first : last + 1].flatten()
        values, indices = scores.topk(min(count, scores.numel()))
        units = self.scores.shape[1]
        return [
            (first + index // units, index % units, value)
            for value, index in zip(values.tolist(), indices.tolist()) if value > 0
        ]

    def register(self, count: int = DEFAULT_COUNT, first: int = 0, last: int | None = None) -> TestTimeRegister:
        """A register fed by :meth:`top` (their ``filter_layers``, then the ``top_k`` first)."""
        chosen: dict[int, list[int]] = {}
        for layer, unit, _ in self.top(count, first, last):
            chosen.setdefault(layer, []).append(unit)
        return TestTimeRegister(chosen)


def _mlp_input(model: ViT, tokens: torch.Tensor, layer: int, grid_size: tuple[int, int] | None) -> torch.Tensor:
    """(B, N, D) on the model's device: what ``layer``'s MLP reads (norm2 of the block's middle),
    from the (B, N, D) ``tokens`` entering the layer: the block's attention half run again."""
    block = model.blocks[layer]
    parameter = next(model.parameters())
    x = tokens.to(parameter.device, parameter.dtype)
    with eval_mode(model):
        middle = x + block.drop_path1(block.ls1(block.attn(block.norm1(x), model.rope_tables(grid_size))))
        return block.norm2(middle)


@torch.no_grad()
def mlp_activations(model: ViT, tokens: torch.Tensor, layer: int, grid_size: tuple[int, int] | None = None) -> torch.Tensor:
    """(B, N, U) float32 on the CPU: the hidden units of ``layer``'s MLP (what fc2 reads) on the
    (B, N, D) ``tokens`` entering the layer (a capture's ``tokens[:, layer]``): that block run again
    up to its MLP's activation, its pass's numbers. ``grid_size``: the tokens' grid, for rotary
    positions (default: the model's)."""
    with eval_mode(model):
        return model.blocks[layer].mlp.hidden(_mlp_input(model, tokens, layer, grid_size)).float().cpu()


def find_register_neurons(
    model: ViT, source: Capture | torch.Tensor, k: float = 6.0, layer: int = -1, last: int | None = None,
    progress: Callable[[float], None] | None = None,
) -> RegisterNeurons:
    """Score the MLP units of ``model`` as register neurons on ``source``: a capture of it (its
    tokens are reused: the blocks run again up to each MLP, at most SEARCH_PASSES of a pass per
    image) or normalized images (B, C, H, W), captured first. The units of layers 0 to ``last``
    are scored; by default up to the layer after which the outliers appear (units after it
    cannot have written them: their highest_layer, whose units only are kept, chosen here from
    the norms). ``progress`` gets the share of the layers searched after each one.

    Their find_register_neurons (shared/algorithms.py): the outliers are the patches whose token
    after ``layer`` (negative: from the end; theirs: the last layer for CLIP, the one before for
    DINOv2) has a high norm, by image_set.norm_outliers with ``k`` (theirs: a norm fixed per
    model, 30 for CLIP ViT-B/16); a unit scores its mean absolute activation on an image's
    outliers if it is sparse on that image (SPARSE_ACTIVATION, SPARSE_SHARE), else 0, and the
    scores are averaged over the images with outliers (those without are skipped). Raises
    AnalysisError when no image has an outlier, or for a capture that has a register already.
    """
    captured = source if isinstance(source, Capture) else capture(model, source, layers=())
    if captured.register_token is not None:
        raise AnalysisError("This pass has a test-time register already: search the pass without it.")
    depth = model.config.depth
    found_after = layer + depth if layer < 0 else layer
    if not 0 <= found_after < depth:
        raise AnalysisError(f"Layer {layer} does not exist: this model has layers 0 to {depth - 1}.")
    prefix = captured.num_prefix_tokens
    tokens = captured.tokens  # (B, L + 1, N, D)
    found = norm_outliers(tokens[:, found_after + 1, prefix:], k)
    outliers = found.outliers  # (B, P)
    with_outliers = outliers.any(dim=1)  # (B,)
    if not with_outliers.any():
        raise AnalysisError(
            f"No patch token stands out after layer {found_after} (none above {found.threshold:.3g}, the median norm"
            f" plus {k:g} MADs): there are no outliers for register neurons to have written."
        )
    appears_at = _first_standing_out(tokens[:, :, prefix:], outliers, k, found_after)
    last = appears_at if last is None else last
    if not 0 <= last < depth:
        raise AnalysisError(f"Layer {last} does not exist: this model has layers 0 to {depth - 1}.")
    at = [prefix + patches.nonzero().flatten() for patches in outliers[with_outliers]]  # each image's outlier tokens
    scores = []
    for index in range(last + 1):
        hidden = mlp_activations(model, tokens[with_outliers, index], index, captured.grid_size)  # (b, N, U)
        on_outliers = torch.stack([units[rows].abs().mean(dim=0) for units, rows in zip(hidden, at)])  # (b, U)
        sparse = (hidden < SPARSE_ACTIVATION).sum(dim=1) >= SPARSE_SHARE * hidden.shape[1]  # (b, U)
        scores.append((on_outliers * sparse).mean(dim=0))
        if progress is not None:
            progress((index + 1) / (last + 1))
    return RegisterNeurons(torch.stack(scores), found, found_after, appears_at, int(with_outliers.sum()))


def attention_drawn(
    attentions: Iterable[torch.Tensor], tokens: torch.Tensor, num_prefix_tokens: int, class_token: bool = True,
) -> torch.Tensor:
    """(L, B, M): in each layer's (B, H, N, N) attention, the share of the query's attention on each
    of M sets of tokens, ``tokens`` (M, N) bool, mean over heads; the query is the class token, or
    without one the mean of the patch queries (analysis.query_map's). How much the outliers draw,
    and the register."""
    shares = []
    for attention in attentions:
        rows = attention[:, :, 0] if class_token else attention[:, :, num_prefix_tokens:].float().mean(dim=2)  # (B, H, N)
        shares.append(torch.einsum("bhn,mn->bm", rows.float(), tokens.float()) / rows.shape[1])
    return torch.stack(shares)


def _first_standing_out(patches: torch.Tensor, outliers: torch.Tensor, k: float, last: int) -> int:
    """The first layer after which at least APPEAR_SHARE of ``outliers`` (B, P) are outliers by the
    same rule in that layer's own norms; ``patches``: (B, L + 1, P, D)."""
    for index in range(last + 1):
        standing = norm_outliers(patches[:, index + 1], k).outliers & outliers
        if standing.sum() >= APPEAR_SHARE * outliers.sum():
            return index
    return last


# --- a register neuron made by hand ---------------------------------------------------------------


def low_information_patches(images: torch.Tensor, patch_size: int, count: int) -> torch.Tensor:
    """(B, gh, gw) bool: the ``count`` patches of each of the (B, C, H, W) ``images`` whose pixels
    vary least (each channel's variance over the patch, summed): the kind of patch, a uniform
    colour, that trained ViTs turn into outliers."""
    patches = rearrange(images, "b c (gh p1) (gw p2) -> b gh gw c (p1 p2)", p1=patch_size, p2=patch_size)
    spread = patches.float().var(dim=-1).sum(dim=-1)  # (B, gh, gw)
    chosen = spread.flatten(1).topk(count, dim=1, largest=False).indices  # (B, count)
    low = torch.zeros_like(spread.flatten(1), dtype=torch.bool)
    low[torch.arange(len(chosen))[:, None], chosen] = True
    return low.reshape(spread.shape)


@torch.no_grad()
def plant_register_neuron(
    model: ViT, images: torch.Tensor, fire: torch.Tensor, layer: int, unit: int = 0, peak: float = 10.0,
    strength: float = 200.0, direction: torch.Tensor | None = None,
) -> ViT:
    """A copy of ``model`` (unchanged itself) in which unit ``unit`` of ``layer``'s MLP is a register
    neuron: it fires on the patches ``fire`` (B, gh, gw) bool of the normalized ``images`` (B, C,
    H, W) and writes a vector of norm about ``strength`` into them, as trained ViTs' neurons do on
    low-information patches. What the tests and benchmarks check the search and the register
    against: random and small models have no outliers.

    Its fc1 row reads the direction a logistic regression finds between the two groups in the
    MLP's input (the patches to fire on, every other token), scaled and offset so that the
    threshold lies halfway between them and the nearest token of either group is ``peak`` away
    from it; its fc2 column writes ``direction`` (default: the first feature axis) times
    ``strength / peak`` into the residual stream (through the block's LayerScale, if any). Raises
    ValueError when one unit cannot tell those patches from the other tokens, or for a gated
    (SwiGLU) MLP.
    """
    planted = copy.deepcopy(model)
    mlp = planted.blocks[layer].mlp
    if mlp.gated:
        raise ValueError("A register neuron is planted in a GELU MLP, not a gated one.")
    captured = capture(planted, images, layers=())
    inputs = _mlp_input(planted, captured.tokens[:, layer], layer, captured.grid_size).float().cpu()  # (B, N, D)
    at = torch.zeros(inputs.shape[:2], dtype=torch.bool)
    at[:, captured.num_prefix_tokens :] = fire.flatten(1).cpu()
    firing, others = inputs[at].double(), inputs[~at].double()
    axis = _separating_axis(firing, others)
    along_firing, along_others = firing @ axis, others @ axis
    low, high = float(along_firing.min()), float(along_others.max())
    spread = max(float(along_firing.max()), high) - min(low, float(along_others.min()))  # of every token
    # Tokens the same but for rounding (patches alike, no positions) are no two groups: a gap of a
    # few ulps would make a unit of enormous gain that fires on rounding noise.
    if low - high <= MIN_SEPARATION * spread:
        raise ValueError(f"One unit of layer {layer} cannot tell those patches from the other tokens.")
    gain = peak / ((low - high) / 2)
    if direction is None:
        direction = torch.zeros(planted.config.embed_dim)
        direction[0] = 1.0
    weight = mlp.fc1.weight
    weight[unit] = (gain * axis).to(weight)
    mlp.fc1.bias[unit] = -gain * (low + high) / 2
    column = direction / direction.norm() * strength / peak
    layer_scale = planted.blocks[layer].ls2
    if isinstance(layer_scale, LayerScale):  # the residual gets the branch times gamma: write through it
        column = column / layer_scale.gamma.to(column)
    mlp.fc2.weight[:, unit] = column.to(weight)
    return planted


def _separating_axis(firing: torch.Tensor, others: torch.Tensor, decay: float = 1e-4) -> torch.Tensor:
    """(D,) unit vector: the weights of a logistic regression of (n, D) ``firing`` against (m, D)
    ``others`` (the two groups weighted alike, a little L2 decay so that separable groups give a
    finite answer), fitted by L-BFGS."""
    samples = torch.cat([firing, others])
    labels = torch.cat([torch.ones(len(firing)), torch.zeros(len(others))]).to(samples)
    weights = torch.zeros(samples.shape[1], dtype=samples.dtype, requires_grad=True)
    bias = torch.zeros((), dtype=samples.dtype, requires_grad=True)
    optimizer = torch.optim.LBFGS([weights, bias], max_iter=500, line_search_fn="strong_wolfe")
    balance = torch.tensor(len(others) / len(firing), dtype=samples.dtype)

    def loss() -> torch.Tensor:
        optimizer.zero_grad()
        value = torch.nn.functional.binary_cross_entropy_with_logits(samples @ weights + bias, labels, pos_weight=balance)
        value = value + decay * weights.pow(2).sum()
        value.backward()
        return value

    with torch.enable_grad():
        optimizer.step(loss)
    return (weights / weights.norm()).detach()
