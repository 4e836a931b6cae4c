"""Record what happens inside a ViT during one forward pass.

A Recorder (lucidrains' idea) receives the patch embedding, every block's input and output, the
softmax of the attention layers asked for and, for one layer asked, every step inside it
(vit_explorer.model.internals). It is found through a context variable rather
than hooks, so that one model object can be captured, attributed and run plainly from many
threads at once (the app serves a class from one copy of each model): each call records only its
own pass, and the model is never switched or hooked. capture, the analyses and the knock-out
sweep all record through it.
"""
from __future__ import annotations

from collections.abc import Iterable
from contextlib import contextmanager

import torch

from .vit import ACTIVE_RECORDER, ViT


def to_cpu(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to("cpu", torch.float32)


def own_cpu_copy(tensor: torch.Tensor) -> torch.Tensor:
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
    block's every intermediate is kept in ``internal_states`` (see vit_explorer.model.internals); the
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
        self._scratch: torch.Tensor | None = None  # see attention_out
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
            self.internal_states.update({name: own_cpu_copy(tensor) for name, tensor in tensors.items()})

    def attention(self, module: torch.nn.Module, weights: torch.Tensor) -> None:
        if self._pool is not None and module is self._pool:
            self.pool_attention = to_cpu(weights)
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
        if stored.data_ptr() != weights.data_ptr():  # not computed in its slot (attention_out)
            stored.copy_(weights.detach())
        self._filled.add(self._slot_of[index])
        self.attentions[index] = stored

    def attention_out(self, module: torch.nn.Module, shape: torch.Size, scaled_queries: torch.Tensor) -> torch.Tensor | None:
        """Where ``module`` may compute its (B, nh, N, N) scores (``shape``) and then its softmax in
        place, when the weights are to be kept detached on the CPU: their slot in this pass's buffer
        where they are kept in the model's dtype, else a scratch of this pass, reused by every layer
        (recorder.attention then converts it into the slot). None where the scores must survive the
        softmax (the layer whose internals are kept) or have a gradient: the module allocates them.

        A fresh (B, nh, N, N) tensor costs its page faults as it is first written (a So400m layer's
        is 34 MB, more than the C allocator reuses: new memory every layer). Scores and weights
        apart cost two per layer; here only the kept slot is new (a depth-4 So400m: 47k page faults
        a capture instead of 85k)."""
        index = self._layer_of.get(module)
        if self.keep_graph or index is None or module in self._internal_modules:
            return None
        if scaled_queries.device.type != "cpu":
            return None
        if scaled_queries.requires_grad and torch.is_grad_enabled():
            return None  # a softmax with out= cannot be differentiated
        if scaled_queries.dtype == self.attention_dtype:
            return self._slot(index, shape)
        scratch = self._scratch
        if scratch is None or scratch.shape != shape or scratch.dtype != scaled_queries.dtype:
            self._scratch = scratch = torch.empty(shape, dtype=scaled_queries.dtype)
        return scratch

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
            self.patch_embedding_states.append(to_cpu(embeddings))

    def tokens(self, model: ViT, tokens: torch.Tensor) -> None:
        if self.record_tokens and model is self.model:
            self.token_states.append(to_cpu(tokens))


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
