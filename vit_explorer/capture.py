"""Record what happens inside a ViT during one forward pass.

A Recorder (lucidrains' idea) receives the patch embedding, every block's input and output, the
softmax of the attention layers asked for and, for one layer asked, every step inside it
(vit_explorer.internals). It is found through a context variable rather
than hooks, so that one model object can be captured, attributed and run plainly from many
threads at once (the app serves a class from one copy of each model): each call records only its
own pass, and the model is never switched or hooked.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from einops import rearrange

from .internals import LayerInternals
from .model import ACTIVE_RECORDER, ViT

if TYPE_CHECKING:
    from .ablation import KnockOut


@dataclass
class Capture:
    """One forward pass, dissected. Tensors are on the CPU, float32 (the attentions: see below);
    N = prefix tokens + gh * gw."""

    logits: torch.Tensor  # (B, num_classes)
    # (B, len(layers), num_heads, N, N); rows sum to 1. float32 unless capture() was asked for
    # float16 (the app's: half the memory); the analyses accept either.
    attentions: torch.Tensor
    tokens: torch.Tensor  # (B, depth + 1, N, D): block 0 input, then each block's output
    patches: torch.Tensor  # (B, gh, gw, C, p, p) pixel patches of the model input
    patch_embeddings: torch.Tensor  # (B, gh * gw, D) before prefix tokens and positions
    grid_size: tuple[int, int]  # (gh, gw)
    num_prefix_tokens: int  # class token + register tokens
    layers: tuple[int, ...]  # which encoder layers `attentions` holds, in order
    class_token: bool = True  # whether token 0 is a class token (registers alone are prefix too)
    # (B, nh, 1, gh * gw): the attention pool's probe query over the patch tokens (SigLIP's MAP
    # head); None for a model without one. It reads the final norm's output after the last block.
    pool_attentions: torch.Tensor | None = None
    # Every step of the one layer capture() was asked to open (internals=layer), else None.
    internals: LayerInternals | None = None

    @property
    def num_tokens(self) -> int:
        return self.tokens.shape[2]


def _to_cpu(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to("cpu", torch.float32)


def _own_cpu_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU float32 copy that shares no storage (a view would keep its whole base alive)."""
    return tensor.detach().to("cpu", torch.float32, copy=True)


class Recorder:
    """What the forward passes of one call record on one model, through ``ACTIVE_RECORDER``.

    The model reports to the recorder of the context it runs in, so passes of other threads on
    the same model object record nothing here, and nothing on the model is switched or hooked.
    ``attentions`` maps layer -> (B, nh, N, N); with ``keep_graph`` the tensors stay on the
    autograd graph (retaining their gradients), as gradient-weighted attribution needs, otherwise
    they are detached CPU copies in ``attention_dtype``. With ``tokens`` the patch embeddings and
    every block's input and output are kept as well, and the attention pool's probe attention (a
    model with a MAP head) as ``pool_attention``. With ``internals`` (a layer index) that one
    block's every intermediate is kept in ``internal_states`` (see vit_explorer.internals); the
    other layers keep none, so a ViT-B/16 at 785 tokens stores q, k, v of one layer only.
    """

    def __init__(
        self, model: ViT, layers: Iterable[int], keep_graph: bool = False, tokens: bool = False,
        attention_dtype: torch.dtype = torch.float32, internals: int | None = None,
    ):
        self.model = model
        self.keep_graph = keep_graph
        self.attention_dtype = attention_dtype
        self.record_tokens = tokens
        self._layer_of = {model.blocks[index].attn: index for index in layers}
        self._slot_of = {index: slot for slot, index in enumerate(sorted(self._layer_of.values()))}
        self._pool = model.attn_pool if tokens else None
        self.attentions: dict[int, torch.Tensor] = {}
        # Detached weights are written into one (B, layers, nh, N, N) tensor as each layer runs:
        # stacking per-layer copies afterwards cost a second copy of it all (355 MB for a ViT-B
        # at 785 tokens), slower than the attention itself. A new pass gets a new buffer.
        self._buffer: torch.Tensor | None = None
        self._filled: set[int] = set()
        self.pool_attention: torch.Tensor | None = None
        self.token_states: list[torch.Tensor] = []
        self.patch_embedding_states: list[torch.Tensor] = []
        block = None if internals is None else model.blocks[internals]
        self._internal_modules = set() if block is None else {block, block.attn, block.mlp}
        self.internal_states: dict[str, torch.Tensor] = {}

    def wants_attention(self, module: torch.nn.Module) -> bool:
        return (
            module in self._layer_of or module in self._internal_modules
            or (self._pool is not None and module is self._pool)
        )

    def internals(self, module: torch.nn.Module, **tensors: torch.Tensor) -> None:
        """Intermediates a block, its attention or its MLP computed; kept for the one block asked."""
        if module in self._internal_modules:
            self.internal_states.update({name: _own_cpu_copy(tensor) for name, tensor in tensors.items()})

    def attention(self, module: torch.nn.Module, weights: torch.Tensor) -> None:
        if self._pool is not None and module is self._pool:
            self.pool_attention = _to_cpu(weights)
            return
        index = self._layer_of.get(module)
        if index is None:
            return
        if self.keep_graph:
            if weights.requires_grad:
                weights.retain_grad()
            self.attentions[index] = weights
            return
        stored = self._slot(index, weights.shape)
        if stored.data_ptr() != weights.data_ptr():  # not written in place by attention_out
            stored.copy_(weights.detach())
        self._filled.add(self._slot_of[index])
        self.attentions[index] = stored

    def attention_out(self, module: torch.nn.Module, scores: torch.Tensor) -> torch.Tensor | None:
        """Where ``module``'s softmax may write its weights directly: their slot in this pass's
        buffer when they are to be kept detached and already have its dtype, on the CPU; else None."""
        index = self._layer_of.get(module)
        if self.keep_graph or index is None:
            return None
        if scores.dtype != self.attention_dtype or scores.device.type != "cpu":
            return None
        if scores.requires_grad and torch.is_grad_enabled():
            return None  # a softmax with out= cannot be differentiated
        return self._slot(index, scores.shape)

    def _slot(self, index: int, shape: torch.Size) -> torch.Tensor:
        """(B, nh, N, N) view of layer ``index`` in the buffer of the pass under way."""
        slot = self._slot_of[index]
        shape = (shape[0], len(self._slot_of), *shape[1:])
        if self._buffer is None or self._buffer.shape != shape or slot in self._filled:
            self._buffer = torch.empty(shape, dtype=self.attention_dtype)
            self._filled = set()
        return self._buffer[:, slot]

    def stacked_attentions(self) -> torch.Tensor:
        """(B, layers, nh, N, N): the last pass's weights of every recorded layer, in layer order."""
        if self.keep_graph or self._buffer is None or len(self._filled) != len(self._slot_of):
            raise RuntimeError("the forward pass did not record every layer it was asked for")
        return self._buffer

    def patch_embeddings(self, model: ViT, embeddings: torch.Tensor) -> None:
        if self.record_tokens and model is self.model:
            self.patch_embedding_states.append(_to_cpu(embeddings))

    def tokens(self, model: ViT, tokens: torch.Tensor) -> None:
        if self.record_tokens and model is self.model:
            self.token_states.append(_to_cpu(tokens))


@contextmanager
def recording(recorder: Recorder):
    """Make ``recorder`` the one that forward passes in this context (thread) report to."""
    token = ACTIVE_RECORDER.set(recorder)
    try:
        yield recorder
    finally:
        ACTIVE_RECORDER.reset(token)


@contextmanager
def record_attention(model: ViT, layers: Iterable[int], keep_graph: bool = False):
    """Collect the softmax outputs of the given layers in the forward passes inside.

    Yields a dict layer -> (B, nh, N, N) tensor filled during those passes (see :class:`Recorder`
    for ``keep_graph``). Only passes run by this thread record; the model is not changed.
    """
    with recording(Recorder(model, layers, keep_graph=keep_graph)) as recorder:
        yield recorder.attentions


@contextmanager
def eval_mode(model: torch.nn.Module):
    """Eval mode for the length of the block. A model already in eval mode (every shared one in
    the app) is not touched; one in training mode belongs to its trainer and is switched back."""
    if not model.training:
        yield model
        return
    model.eval()
    try:
        yield model
    finally:
        model.train()


def _layer_indices(layers: Sequence[int] | None, depth: int) -> tuple[int, ...]:
    if layers is None:
        return tuple(range(depth))
    # Negative indices count from the end, as in Python.
    indices = tuple(sorted({int(layer) + depth if layer < 0 else int(layer) for layer in layers}))
    bad = [layer for layer in indices if not 0 <= layer < depth]
    if bad:
        raise ValueError(f"layers {bad} do not exist; the model has layers 0..{depth - 1}")
    return indices


def capture(
    model: ViT, images: torch.Tensor, layers: Sequence[int] | None = None,
    attention_dtype: torch.dtype = torch.float32, internals: int | None = None,
    knock_out: KnockOut | None = None, intact: Capture | None = None,
) -> Capture:
    """Run ``model`` on normalized ``images`` (B, C, H, W) in eval mode without gradients.

    ``layers`` limits which layers' attention is kept (all by default) to save memory; tokens
    are always kept for every layer. The logits equal ``model(images)`` in eval mode up to
    float rounding (the captured layers run the explicit attention path). ``attention_dtype``
    torch.float16 keeps the attention in half the memory (about 3 significant digits, plenty
    to draw it; a ViT-B/16 at 785 tokens: 177 MB instead of 355 MB). ``internals`` (a layer
    index, negative from the end) also keeps that layer's every intermediate from this same pass
    as ``Capture.internals`` (vit_explorer.internals.LayerInternals; float32 whatever
    ``attention_dtype``). ``knock_out`` (a :class:`vit_explorer.ablation.KnockOut`) removes those
    heads and branches from this pass only: everything recorded is the ablated pass's.

    ``intact`` (with ``knock_out``): the capture of the same model and images without it, with the
    same ``layers`` and ``attention_dtype``. The layers before the first one the knock-out changes
    run exactly as in that pass, so they are not run again: the pass starts from its tokens
    entering that layer, and their tokens and attention are its (same numbers, fewer blocks).
    """
    config = model.config
    indices = _layer_indices(layers, config.depth)
    opened = None if internals is None else _layer_indices([internals], config.depth)[0]
    if images.ndim == 3:
        images = images.unsqueeze(0)
    parameter = next(model.parameters())
    images = images.to(parameter.device)
    start = _resume_layer(intact, knock_out, indices, attention_dtype, images, opened)

    recorded = tuple(layer for layer in indices if layer >= start)
    recorder = Recorder(model, recorded, tokens=True, attention_dtype=attention_dtype, internals=opened)
    ablating = nullcontext() if knock_out is None else knock_out.applied(model)
    with torch.no_grad(), eval_mode(model), recording(recorder), ablating:
        if start == 0:
            logits = model(images)
        else:
            entering = intact.tokens[:, start].to(parameter.device, parameter.dtype)  # (B, N, D)
            logits = model.forward_head(model.forward_blocks(entering, start, grid_size=config.grid_size))

    attentions = recorder.stacked_attentions() if recorded or start == 0 else None
    tokens = torch.stack(recorder.token_states, dim=1)
    if start > 0:  # the earlier layers are the intact pass's
        earlier = len(indices) - len(recorded)
        if attentions is None:
            attentions = intact.attentions
        elif earlier:
            attentions = torch.cat([intact.attentions[:, :earlier], attentions], dim=1)
        tokens = torch.cat([intact.tokens[:, : start + 1], tokens], dim=1)
    patch = config.patch_size
    return Capture(
        logits=_to_cpu(logits),
        attentions=attentions,
        tokens=tokens,
        patches=intact.patches if start > 0 else rearrange(
            _to_cpu(images), "b c (gh p1) (gw p2) -> b gh gw c p1 p2", p1=patch, p2=patch
        ),
        patch_embeddings=intact.patch_embeddings if start > 0 else recorder.patch_embedding_states[0],
        grid_size=config.grid_size,
        num_prefix_tokens=config.num_prefix_tokens,
        layers=indices,
        class_token=config.class_token,
        pool_attentions=recorder.pool_attention,
        internals=None if opened is None else LayerInternals.from_recorded(
            opened, model.blocks[opened], recorder.internal_states
        ),
    )


def _resume_layer(
    intact: Capture | None, knock_out: KnockOut | None, indices: tuple[int, ...],
    attention_dtype: torch.dtype, images: torch.Tensor, opened: int | None,
) -> int:
    """The layer a knocked-out capture starts from given the ``intact`` capture (0: from the image)."""
    if intact is None or knock_out is None or knock_out.is_empty:
        return 0
    if intact.layers != indices or intact.attentions.dtype != attention_dtype:
        raise ValueError("the intact capture must record the same layers in the same dtype")
    if intact.tokens.shape[0] != images.shape[0] or intact.patches.shape[0] != images.shape[0]:
        raise ValueError("the intact capture must be of the same images")
    start = knock_out.first_layer()
    return start if opened is None else min(start, opened)


def layer_internals(
    model: ViT, tokens: torch.Tensor, layer: int, queries: Sequence[int] | None = None,
    grid_size: tuple[int, int] | None = None,
) -> LayerInternals:
    """Every step of encoder layer ``layer`` on its input ``tokens`` (B, N, D), in eval mode
    without gradients: that block alone runs under a recorder, as in :func:`capture`.
    ``grid_size``: the patch grid the tokens come from (default: the model's own, a capture's
    ``grid_size``), which places the patches for rotary positions.

    With a capture's ``tokens[:, layer]`` it gives that pass's numbers (the output is its
    ``tokens[:, layer + 1]``) for 1/depth of a forward pass, so that opening another layer of
    an image already captured costs one block, not the whole model.

    ``queries`` (token indices): the steps of those tokens only. Every field then holds their rows
    (``LayerInternals.row``) but k and v, which hold every token's (what a query attends over), so
    the cost is this layer's q, k, v projection (a fifth of a block): what one token's view needs.
    """
    index = _layer_indices([layer], model.config.depth)[0]
    block = model.blocks[index]
    parameter = next(model.parameters())
    if tokens.ndim == 2:
        tokens = tokens.unsqueeze(0)
    tokens = tokens.to(parameter.device, parameter.dtype)
    rope = model.rope_tables(grid_size)
    if queries is not None:
        queries = tuple(int(token) for token in queries)
        if not queries or not all(0 <= token < tokens.shape[1] for token in queries):
            raise ValueError(f"queries must be some of the {tokens.shape[1]} tokens, not {queries}")
        with torch.no_grad(), eval_mode(model):
            states = _block_rows(block, tokens, queries, rope)
        return LayerInternals.from_recorded(index, block, states, queries)
    recorder = Recorder(model, (), internals=index)
    with torch.no_grad(), eval_mode(model), recording(recorder):
        block(tokens, rope)
    return LayerInternals.from_recorded(index, block, recorder.internal_states)


def _block_rows(
    block: torch.nn.Module, x: torch.Tensor, rows: Sequence[int], rope: tuple[torch.Tensor, torch.Tensor] | None,
) -> dict[str, torch.Tensor]:
    """``Block.forward`` step by step for the tokens ``rows`` of x (B, N, D) only, with the
    block's own modules; every token still gives its key and value."""
    attn, mlp = block.attn, block.mlp
    picked = torch.as_tensor(rows, device=x.device)
    normed = block.norm1(x)
    q_unrotated, k_unrotated, v = attn._qkv(normed).unbind(0)  # (B, nh, N, hd) each
    # Every query is rotated, then the rows picked: a row's angles are those of its own position.
    q, k = attn.rotate(q_unrotated, rope)[:, :, picked], attn.rotate(k_unrotated, rope)
    scores = (q * attn.scale) @ k.transpose(-2, -1)  # (B, nh, rows, N)
    attention = attn.attend(scores)
    heads = attention @ v
    attended = attn.proj(attn.norm(rearrange(heads, "b nh n hd -> b n (nh hd)")))
    entering = x[:, picked]
    middle = entering + block.ls1(attended)
    normed_middle = block.norm2(middle)
    hidden = mlp.hidden(normed_middle)
    mlp_out = mlp.fc2(hidden)
    states = dict(
        input=entering, norm1=normed[:, picked], q=q, k=k, v=v, scores=scores, attention=attention, heads=heads,
        attn_out=attended, middle=middle, norm2=normed_middle, mlp_hidden=hidden, mlp_out=mlp_out,
        output=middle + block.ls2(mlp_out),
    )
    if attn.rotary:
        states.update(q_unrotated=q_unrotated[:, :, picked], k_unrotated=k_unrotated)
    return {name: _own_cpu_copy(tensor) for name, tensor in states.items()}
