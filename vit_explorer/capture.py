"""Record what happens inside a ViT during one forward pass.

Hooks (lucidrains' Recorder idea) observe the patch embedding, every block's input and output,
and the softmax of the attention layers asked for; they are removed again, even on an exception.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import torch
from einops import rearrange

from .model import ViT


@dataclass
class Capture:
    """One forward pass, dissected. Tensors are float32 on the CPU; N = prefix tokens + gh * gw."""

    logits: torch.Tensor  # (B, num_classes)
    attentions: torch.Tensor  # (B, len(layers), num_heads, N, N); rows sum to 1
    tokens: torch.Tensor  # (B, depth + 1, N, D): block 0 input, then each block's output
    patches: torch.Tensor  # (B, gh, gw, C, p, p) pixel patches of the model input
    patch_embeddings: torch.Tensor  # (B, gh * gw, D) before prefix tokens and positions
    grid_size: tuple[int, int]  # (gh, gw)
    num_prefix_tokens: int  # class token + register tokens
    layers: tuple[int, ...]  # which encoder layers `attentions` holds, in order
    class_token: bool = True  # whether token 0 is a class token (registers alone are prefix too)

    @property
    def num_tokens(self) -> int:
        return self.tokens.shape[2]


def _to_cpu(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to("cpu", torch.float32)


@contextmanager
def record_attention(model: ViT, layers: Iterable[int], keep_graph: bool = False):
    """Switch the given layers to explicit attention and collect their softmax outputs.

    Yields a dict layer -> (B, nh, N, N) tensor filled during the forward passes inside. With
    ``keep_graph`` the tensors stay on the autograd graph (and retain their gradients), as
    gradient-weighted attribution needs; otherwise they are detached float32 CPU copies.
    """
    recorded: dict[int, torch.Tensor] = {}
    with ExitStack() as stack:
        for index in layers:
            attention = model.blocks[index].attn

            def save(module, inputs, output, index=index):
                if keep_graph:
                    output.retain_grad()
                    recorded[index] = output
                else:
                    recorded[index] = _to_cpu(output)

            stack.callback(setattr, attention, "fused_attn", attention.fused_attn)
            attention.fused_attn = False
            stack.callback(attention.attend.register_forward_hook(save).remove)
        yield recorded


def _layer_indices(layers: Sequence[int] | None, depth: int) -> tuple[int, ...]:
    if layers is None:
        return tuple(range(depth))
    # Negative indices count from the end, as in Python.
    indices = tuple(sorted({int(layer) + depth if layer < 0 else int(layer) for layer in layers}))
    bad = [layer for layer in indices if not 0 <= layer < depth]
    if bad:
        raise ValueError(f"layers {bad} do not exist; the model has layers 0..{depth - 1}")
    return indices


def capture(model: ViT, images: torch.Tensor, layers: Sequence[int] | None = None) -> Capture:
    """Run ``model`` on normalized ``images`` (B, C, H, W) in eval mode without gradients.

    ``layers`` limits which layers' attention is kept (all by default) to save memory; tokens
    are always kept for every layer. The logits equal ``model(images)`` in eval mode up to
    float rounding (the captured layers run the explicit attention path).
    """
    config = model.config
    indices = _layer_indices(layers, config.depth)
    if images.ndim == 3:
        images = images.unsqueeze(0)
    device = next(model.parameters()).device
    images = images.to(device)
    tokens: list[torch.Tensor] = []
    patch_embeddings: list[torch.Tensor] = []

    was_training = model.training
    with ExitStack() as stack, torch.no_grad():
        stack.callback(model.train, was_training)
        model.eval()
        attentions = stack.enter_context(record_attention(model, indices))
        hooks = [
            model.patch_embed.register_forward_hook(
                lambda module, inputs, output: patch_embeddings.append(_to_cpu(output))
            ),
            model.blocks[0].register_forward_pre_hook(
                lambda module, inputs: tokens.append(_to_cpu(inputs[0]))
            ),
        ] + [
            block.register_forward_hook(lambda module, inputs, output: tokens.append(_to_cpu(output)))
            for block in model.blocks
        ]
        for hook in hooks:
            stack.callback(hook.remove)
        logits = model(images)

    patch = config.patch_size
    return Capture(
        logits=_to_cpu(logits),
        attentions=torch.stack([attentions[i] for i in indices], dim=1),
        tokens=torch.stack(tokens, dim=1),
        patches=rearrange(
            _to_cpu(images), "b c (gh p1) (gw p2) -> b gh gw c p1 p2", p1=patch, p2=patch
        ),
        patch_embeddings=patch_embeddings[0],
        grid_size=config.grid_size,
        num_prefix_tokens=config.num_prefix_tokens,
        layers=indices,
        class_token=config.class_token,
    )
