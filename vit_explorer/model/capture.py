"""One forward pass of a ViT, dissected: :func:`capture` runs it under a recorder
(vit_explorer.model.recorder) and returns a :class:`Capture`; :func:`layer_internals` opens one layer
again from a capture's tokens. A knock-out (vit_explorer.model.ablation) or a test-time register
(vit_explorer.analysis.test_time_registers) may ride the same pass.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from einops import rearrange

from .ablation import KnockOut
from .internals import LayerInternals
from .recorder import Recorder, eval_mode, own_cpu_copy, recording, to_cpu
from .vit import ACTIVE_REGISTER, ViT


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
    num_prefix_tokens: int  # class token + register tokens (+ a test-time register)
    layers: tuple[int, ...]  # which encoder layers `attentions` holds, in order
    class_token: bool = True  # whether token 0 is a class token (registers alone are prefix too)
    # The index of the pass's test-time register (vit_explorer.analysis.test_time_registers), the last of
    # the prefix tokens; None for a pass without one.
    register_token: int | None = None
    # (B, nh, 1, gh * gw): the attention pool's probe query over the patch tokens (SigLIP's MAP
    # head); None for a model without one. It reads the final norm's output after the last block.
    pool_attentions: torch.Tensor | None = None
    # Every step of the one layer capture() was asked to open (internals=layer), else None.
    internals: LayerInternals | None = None

    @property
    def num_tokens(self) -> int:
        return self.tokens.shape[2]


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
    knock_out: KnockOut | None = None, intact: Capture | None = None, steering: Any = None,
) -> Capture:
    """Run ``model`` on normalized ``images`` (B, C, H, W) in eval mode without gradients.

    ``layers`` limits which layers' attention is kept (all by default) to save memory; tokens
    are always kept for every layer, so that :func:`layer_attention` gives any other layer's
    (``layers=()`` keeps none: what the app and ``inspect`` do at any size). The logits equal ``model(images)`` in eval mode up to
    float rounding (the captured layers run the explicit attention path). ``attention_dtype``
    torch.float16 keeps the attention in half the memory (about 3 significant digits, plenty
    to draw it; a ViT-B/16 at 785 tokens: 177 MB instead of 355 MB). ``internals`` (a layer
    index, negative from the end) also keeps that layer's every intermediate from this same pass
    as ``Capture.internals`` (vit_explorer.model.internals.LayerInternals; float32 whatever
    ``attention_dtype``). ``knock_out`` (a :class:`vit_explorer.model.ablation.KnockOut`) removes those
    heads and branches from this pass only: everything recorded is the ablated pass's. Under a
    test-time register (``TestTimeRegister.applied``, or ``test_time_registers.register_capture``)
    everything recorded is that pass's, its extra token among the prefix tokens
    (``Capture.register_token`` says which it is). ``steering`` (a
    :class:`vit_explorer.features.steering.Steering`) scales some sparse-autoencoder latents in the
    tokens leaving its layer, in this pass only; it composes with a knock-out.

    ``intact`` (with ``knock_out`` or ``steering``): the capture of the same model and images
    without them, with the same ``layers`` and ``attention_dtype``. The layers before the first one
    they change run exactly as in that pass, so they are not run again: the pass starts from its
    tokens entering that layer, and their tokens and attention are its (same numbers, fewer blocks).
    """
    config = model.config
    indices = _layer_indices(layers, config.depth)
    opened = None if internals is None else _layer_indices([internals], config.depth)[0]
    if images.ndim == 3:
        images = images.unsqueeze(0)
    parameter = next(model.parameters())
    images = images.to(parameter.device)
    start = _resume_layer(intact, knock_out, steering, indices, attention_dtype, images, opened)

    recorded = tuple(layer for layer in indices if layer >= start)
    recorder = Recorder(model, recorded, tokens=True, attention_dtype=attention_dtype, internals=opened)
    ablating = nullcontext() if knock_out is None else knock_out.applied(model)
    steered = nullcontext() if steering is None else steering.applied()
    with torch.no_grad(), eval_mode(model), recording(recorder), ablating, steered:
        if start == 0:
            logits = model(images)
        else:
            entering = intact.tokens[:, start].to(parameter.device, parameter.dtype)  # (B, N, D)
            logits = model.forward_head(model.forward_blocks(entering, start, grid_size=config.grid_size))

    attentions = recorder.stacked_attentions() if recorded else None
    tokens = torch.stack(recorder.token_states, dim=1)
    if start > 0:  # the earlier layers are the intact pass's
        earlier = len(indices) - len(recorded)
        if attentions is None:
            attentions = intact.attentions
        elif earlier:
            attentions = torch.cat([intact.attentions[:, :earlier], attentions], dim=1)
        tokens = torch.cat([intact.tokens[:, : start + 1], tokens], dim=1)
    batch, _, count, _ = tokens.shape
    if attentions is None:  # layers=(): tokens only; layer_attention computes a layer when asked
        attentions = torch.empty(batch, 0, config.num_heads, count, count, dtype=attention_dtype)
    patch = config.patch_size
    register = ACTIVE_REGISTER.get()
    return Capture(
        logits=to_cpu(logits),
        attentions=attentions,
        tokens=tokens,
        patches=intact.patches if start > 0 else rearrange(
            to_cpu(images), "b c (gh p1) (gw p2) -> b gh gw c p1 p2", p1=patch, p2=patch
        ),
        patch_embeddings=intact.patch_embeddings if start > 0 else recorder.patch_embedding_states[0],
        grid_size=config.grid_size,
        num_prefix_tokens=count - config.num_patches,  # the patches are last, whatever came before
        layers=indices,
        class_token=config.class_token,
        register_token=None if register is None else register.token(model),
        pool_attentions=recorder.pool_attention,
        internals=None if opened is None else LayerInternals.from_recorded(
            opened, model.blocks[opened], recorder.internal_states
        ),
    )


def _resume_layer(
    intact: Capture | None, knock_out: KnockOut | None, steering: Any, indices: tuple[int, ...],
    attention_dtype: torch.dtype, images: torch.Tensor, opened: int | None,
) -> int:
    """The layer a knocked-out or steered capture starts from given the ``intact`` capture (0: from
    the image): the first layer either changes (a steered layer's block runs, then is edited)."""
    knocking = knock_out is not None and not knock_out.is_empty
    if intact is None or not (knocking or steering is not None):
        return 0
    if intact.layers != indices or intact.attentions.dtype != attention_dtype:
        raise ValueError("the intact capture must record the same layers in the same dtype")
    if intact.tokens.shape[0] != images.shape[0] or intact.patches.shape[0] != images.shape[0]:
        raise ValueError("the intact capture must be of the same images")
    start = min(
        knock_out.first_layer() if knocking else intact.tokens.shape[1] - 1,
        steering.layer if steering is not None else intact.tokens.shape[1] - 1,
    )
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


def layer_attention(
    model: ViT, tokens: torch.Tensor, layer: int, grid_size: tuple[int, int] | None = None,
    dtype: torch.dtype = torch.float32, entropies: torch.Tensor | None = None,
) -> torch.Tensor:
    """(B, nh, N, N) encoder layer ``layer``'s attention from the ``tokens`` (B, N, D) entering it
    (a capture's ``tokens[:, layer]``), on the CPU in ``dtype``: that pass's weights, computed
    again from its tokens. Only the attention part of the block runs (norm1, q and k, rotated by
    the positions of ``grid_size``'s grid as in :func:`layer_internals`, the softmax): a fraction
    of a block, so that a capture need not hold every layer's (B, L, nh, N, N) to show any.

    A head at a time: the float32 scores and weights of one head are the only temporaries, so a
    float16 result costs little more than itself (6 heads at 2,309 tokens: 64 MB, not 192 MB).

    ``entropies``, a (B, nh) tensor, receives each head's entropy in nats averaged over its rows
    (analysis.head_entropies of the result), from the scores at hand: a fifth of the time of the
    weights' own ``-w log w``, the largest part of a pass over the layers that reads it."""
    index = _layer_indices([layer], model.config.depth)[0]
    block = model.blocks[index]
    attn = block.attn
    parameter = next(model.parameters())
    if tokens.ndim == 2:
        tokens = tokens.unsqueeze(0)
    tokens = tokens.to(parameter.device, parameter.dtype)
    rope = model.rope_tables(grid_size)
    batch, count, _ = tokens.shape
    weights = torch.empty(batch, attn.num_heads, count, count, dtype=dtype)
    mask = attn.window_mask(rope, count)  # (N, N) bool: window attention's, or None
    with torch.no_grad(), eval_mode(model):
        q, k, _ = attn._qkv(block.norm1(tokens)).unbind(0)  # (B, nh, N, hd) each
        q, k = attn.rotate(q, rope), attn.rotate(k, rope)
        for head in range(attn.num_heads):
            # As Attention.forward computes them: scale, then the softmax module.
            scores = (q[:, head] * attn.scale) @ k[:, head].transpose(-2, -1)  # (B, N, N)
            if mask is not None:
                scores = scores.masked_fill(~mask, float("-inf"))
            head_weights = attn.attend(scores)
            weights[:, head] = head_weights
            if entropies is not None:
                entropies[:, head] = _mean_row_entropy(scores, head_weights, mask)
    return weights


def _mean_row_entropy(scores: torch.Tensor, weights: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """(B,) the mean over rows of -sum w log w, where weights = softmax(scores) (B, N, N).
    log w = s - logsumexp(s), and the log-sum-exp is the largest score less the log of the largest
    weight: no logarithm or exponential of every weight (they cost more than the softmax)."""
    scores, weights = scores.float(), weights.float()  # a half-precision model's too: a sum of N terms
    log_sum_exp = scores.amax(dim=-1) - weights.amax(dim=-1).log()  # (B, N)
    if mask is not None:  # scores masked out (window attention's -inf) have weight 0: they add nothing, not 0 * -inf
        scores = scores.masked_fill(~mask, 0.0)
    expected_score = torch.einsum("bqk,bqk->bq", weights, scores)
    return (log_sum_exp - expected_score).mean(dim=-1)


def layer_attentions(
    model: ViT, captured: Capture, dtype: torch.dtype = torch.float32,
) -> Iterator[torch.Tensor]:
    """Every encoder layer's (B, nh, N, N) attention of ``captured`` in order, one at a time: the
    recorded one where the capture kept it, else :func:`layer_attention` from its tokens. What the
    analyses over all layers (analysis.streamed_*) read without holding (B, L, nh, N, N)."""
    for layer in range(captured.tokens.shape[1] - 1):
        if layer in captured.layers:
            yield captured.attentions[:, captured.layers.index(layer)].to(dtype)
        else:
            yield layer_attention(model, captured.tokens[:, layer], layer, captured.grid_size, dtype)


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
    mask = attn.window_mask(rope, x.shape[1])  # window attention's (N, N), or None: scores kept unmasked, as forward's
    attention = attn.attend(scores if mask is None else scores.masked_fill(~mask[picked], float("-inf")))
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
    if mask is not None:
        states["window"] = mask[picked]
    return {name: own_cpu_copy(tensor) for name, tensor in states.items()}
