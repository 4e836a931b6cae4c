"""What computing with a model costs, in multiply-adds: pure functions of the config, the tokens
and the batch, which decide what a page computes in the server and what is a job
(vit_explorer.app.costs), and what a job says it costs (vit_explorer.serving.job_kinds).

A pass of ``images`` images of N tokens through L blocks of width D:

    linear     every pixel into every channel once, then per token and block the q, k, v and
               output projections and the MLP's matrices: proportional to N
    attention  per block the scores q k^T and their product with v, 2 N^2 D: proportional to N^2
    overhead   the operators' fixed cost per block (most of a tiny model's pass)

so a ViT-B/16 at patch 8 (785 tokens) costs 4.4 of its passes at patch 16 (197 tokens), not the
4.0 of its tokens. Work outside the fused pass writes or reads attention weights one by one (a
layer's (H, N, N)), which costs far more per weight than a multiply-add of a matrix product:
those are counted in multiply-add equivalents per weight (``RECORDED``, ``RECOMPUTED``, ``READ``,
``MEASURED``), measured on the 2-core CPU against the same model's pass (bench/app_latency.py
--cost-model prints them again). At 2,309 tokens (a DINOv3 ViT-S/16 at 768 px) the attention is
half of a pass and the N^3 products of a rollout 1.4 passes. Measured passes grow a little slower
than their multiply-adds (785 / 197 tokens: 3.5x against 4.4x; 2,309 / 201: 15.7x against
20.9x; one run on a shared machine): a pass scaled from a smaller size errs long.
"""
from __future__ import annotations

# The operators' fixed cost per block, in multiply-adds (about 0.1 ms a block on a CPU).
BLOCK_OVERHEAD = 3e6
# Multiply-add equivalents per attention weight (float32, 2 threads), in multiply-adds of the same
# model's pass: bench/app_latency.py --cost-model on the 2-core CPU (2026-11-27, shared with other
# sessions' tests, load 1-5) gave 175, 100-170, 140-225 and 570-670 for these at 785 and 2,309
# tokens (ViT-B/16 at patch 8, DINOv3-shaped ViT-S/16 at 768 px), less at 197. Rounded up: an
# estimate that errs makes a job of a view that could have stayed, not the reverse.
RECORDED = 175  # the capture keeping a layer's weights: written by the recorder, copied to float16
RECOMPUTED = 200  # a layer's weights again from its tokens (capture.layer_attention): scores written, softmax, copy
READ = 200  # an analysis reading a layer's weights once: distance and entropy, a rollout's fusion and mixing
MEASURED = 600  # the head types' measures of a layer's weights (analysis.head_types: seven of them)


def tokens_of(config, tokens: int | None = None) -> int:
    """``tokens``, or the model's own at its patch and input size."""
    return config.num_tokens if tokens is None else tokens


def linear_cost(config, tokens: int | None = None, images: int = 1) -> float:
    """Multiply-adds of a pass that grow with the tokens: the patch embedding (every pixel into
    every channel, at any patch size) and per token the attention's projections and the MLP's
    matrices (three with a SwiGLU gate)."""
    tokens = tokens_of(config, tokens)
    dim = config.embed_dim
    height, width = config.img_size
    per_token = 4 * dim * dim + config.mlp_matrices * dim * config.mlp_hidden
    return images * (height * width * config.in_chans * dim + config.depth * tokens * per_token)


def attention_cost(config, tokens: int | None = None, images: int = 1) -> float:
    """Multiply-adds of a pass that grow with the square of the tokens: q k^T and the weights
    times v in every block."""
    tokens = tokens_of(config, tokens)
    return images * config.depth * 2 * tokens * tokens * config.embed_dim


def forward_cost(config, tokens: int | None = None, images: int = 1) -> float:
    """Multiply-adds of a pass of ``images`` images: :func:`linear_cost` + :func:`attention_cost`."""
    return linear_cost(config, tokens, images) + attention_cost(config, tokens, images)


def pass_cost(config, tokens: int | None = None, images: int = 1) -> float:
    """:func:`forward_cost` plus the operators' fixed overhead (once per batch)."""
    return forward_cost(config, tokens, images) + config.depth * BLOCK_OVERHEAD


def weights(config, tokens: int | None = None, images: int = 1, layers: int | None = None) -> int:
    """Attention weights of ``layers`` layers (all by default): H N^2 each, per image."""
    tokens = tokens_of(config, tokens)
    return images * (config.depth if layers is None else layers) * config.num_heads * tokens * tokens


def capture_cost(config, tokens: int | None = None, images: int = 1, kept: bool = True) -> float:
    """A recorded pass (model.capture): the pass, and ``kept``, every layer's weights written
    and copied (without, the pass runs fused and keeps the tokens only)."""
    return pass_cost(config, tokens, images) + (RECORDED * weights(config, tokens, images) if kept else 0.0)


def attention_again_cost(config, tokens: int | None = None, images: int = 1, layers: int | None = None) -> float:
    """``layers`` layers' weights computed again from the tokens entering them
    (capture.layer_attention): the norm and q, k, v projections, q k^T, and each weight written."""
    tokens = tokens_of(config, tokens)
    count = config.depth if layers is None else layers
    dim = config.embed_dim
    products = images * count * (3 * tokens * dim * dim + tokens * tokens * dim)
    return products + RECOMPUTED * weights(config, tokens, images, count)


def layers_cost(config, tokens: int | None = None, images: int = 1, kept: bool = True, per_weight: float = READ) -> float:
    """Every layer's weights read by an analysis (``per_weight`` each), computed again from the
    tokens first unless the capture ``kept`` them (capture.layer_attentions)."""
    read = per_weight * weights(config, tokens, images)
    return read if kept else read + attention_again_cost(config, tokens, images)


def rollout_cost(config, tokens: int | None = None, kept: bool = True) -> float:
    """A rollout (analysis.streamed_rollout): each layer's weights read, fused and mixed, then
    an N x N product per layer after the first, N^3 each."""
    tokens = tokens_of(config, tokens)
    return layers_cost(config, tokens, kept=kept) + (config.depth - 1) * tokens**3


def head_types_cost(config, images: int, tokens: int | None = None) -> float:
    """The head types over ``images`` images from their tokens (analysis.head_types.
    classify_heads_from_tokens): every layer's weights again, then measured."""
    return layers_cost(config, tokens, images, kept=False, per_weight=MEASURED)
