"""Inside one encoder layer: every intermediate of a recorded pass, and what each step does.

A :class:`LayerInternals` holds what one block computed for every token in one forward pass: the
LayerNorms, each head's queries, keys and values, the scaled scores and their softmax, the heads'
outputs, the output projection, the MLP's hidden units and both residual adds. It comes from the
per-call recorder of :mod:`vit_explorer.model.recorder`, in the same pass as the rest of a capture
(``capture(model, x, internals=layer)``) or by running that one block again on a capture's tokens
(``layer_internals(model, cap.tokens[:, layer], layer)``: 1/depth of a forward pass; with
``queries=[token]``, one token's steps for a fifth of that). The
functions below are the small analyses the "Inside a layer" page shows for one token and head;
none of them touches the model.

Shapes: B images, N tokens, D embed dim, nh heads, hd head dim, hidden = D * mlp_ratio; R rows:
the N tokens, or the query tokens a :class:`LayerInternals` was made for (its ``queries``).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

# What the MLP page calls a silent hidden unit: |activation| below this after the nonlinearity.
NEAR_ZERO = 0.05
# The scale control's choices, as multiples of the model's own 1/sqrt(hd).
SCALE_FACTORS = (1 / 8, 1 / 4, 1 / 2, 1.0, 2.0, 4.0, 8.0)
# The curve of entropy and largest weight against the scale: a quarter octave apart over that range.
SWEEP_FACTORS = tuple(2 ** (step / 4) for step in range(-12, 13))
# How the page and its formulas name each MLP nonlinearity (ViTConfig.act_layer).
ACTIVATION_NAMES = {"gelu": "GELU", "gelu_tanh": "GELU (tanh)", "quick_gelu": "QuickGELU"}


def activation_name(config) -> str:
    """How the page and its formulas name a model's MLP nonlinearity: a SwiGLU gate or act_layer's."""
    return "SwiGLU" if config.swiglu_mlp else ACTIVATION_NAMES[config.act_layer]


@dataclass(frozen=True)
class LayerInternals:
    """One encoder layer of one forward pass, step by step (float32 on the CPU). Every field
    holds R rows, one per token, but k and v, which hold all N tokens: a token's numbers are at
    ``row(token)``."""

    layer: int
    scale: float  # the softmax scale the model uses, 1 / sqrt(hd)
    norm_eps: float  # the LayerNorms' epsilon
    input: torch.Tensor  # (B, R, D) tokens entering the layer
    norm1: torch.Tensor  # (B, R, D) LayerNorm before attention
    q: torch.Tensor  # (B, nh, R, hd) as the scores use them (rotated, with rotary positions)
    k: torch.Tensor  # (B, nh, N, hd) likewise
    v: torch.Tensor  # (B, nh, N, hd)
    scores: torch.Tensor  # (B, nh, R, N) (q * scale) @ k^T, before the softmax
    attention: torch.Tensor  # (B, nh, R, N) softmax of the scores; rows sum to 1
    heads: torch.Tensor  # (B, nh, R, hd) attention @ v, each head's output
    attn_out: torch.Tensor  # (B, R, D) output projection of the concatenated heads
    middle: torch.Tensor  # (B, R, D) after the first residual add
    norm2: torch.Tensor  # (B, R, D) LayerNorm before the MLP
    # (B, R, hidden) the MLP's hidden units fc2 reads: after the nonlinearity (SwiGLU: the gated
    # product; with scale_mlp, then its LayerNorm)
    mlp_hidden: torch.Tensor
    mlp_out: torch.Tensor  # (B, R, D) second MLP layer
    output: torch.Tensor  # (B, R, D) tokens leaving the layer
    layer_scale1: torch.Tensor | None = None  # (D,) LayerScale of the attention branch, if any
    layer_scale2: torch.Tensor | None = None  # (D,) LayerScale of the MLP branch, if any
    queries: tuple[int, ...] | None = None  # the tokens of the R rows, in order; None: all N
    # With rotary positions (ViTConfig.rope_type): q and k before the rotation, as the projection
    # gives them (the prefix tokens' equal q's and k's); None for a model without.
    q_unrotated: torch.Tensor | None = None  # (B, nh, R, hd)
    k_unrotated: torch.Tensor | None = None  # (B, nh, N, hd)
    # With window attention in this layer: (R, N) bool, the keys each row may attend to (the
    # scores above are unmasked; the attention is zero elsewhere); None: every key.
    window: torch.Tensor | None = None

    def row(self, token: int) -> int:
        """Where ``token``'s numbers are in the fields of R rows."""
        if self.queries is None:
            return token
        if token not in self.queries:
            raise ValueError(f"these internals hold tokens {list(self.queries)}, not token {token}")
        return self.queries.index(token)

    @property
    def num_heads(self) -> int:
        return self.q.shape[1]

    @property
    def head_dim(self) -> int:
        return self.q.shape[-1]

    @property
    def num_tokens(self) -> int:
        """N, the tokens of the layer (every one a key)."""
        return self.k.shape[2]

    @property
    def concatenated(self) -> torch.Tensor:
        """(B, R, D): the heads' outputs side by side, what the output projection reads (after the
        attention's own LayerNorm in a model with scale_attn_inner, EVA-02 CLIP)."""
        batch, heads, tokens, head_dim = self.heads.shape
        return self.heads.transpose(1, 2).reshape(batch, tokens, heads * head_dim)

    @property
    def attention_branch(self) -> torch.Tensor:
        """(B, R, D): what the attention adds to the residual stream (LayerScale applied)."""
        return self.attn_out if self.layer_scale1 is None else self.attn_out * self.layer_scale1

    @property
    def mlp_branch(self) -> torch.Tensor:
        """(B, R, D): what the MLP adds to the residual stream (LayerScale applied)."""
        return self.mlp_out if self.layer_scale2 is None else self.mlp_out * self.layer_scale2

    @classmethod
    def from_recorded(
        cls, layer: int, block: torch.nn.Module, states: dict[str, torch.Tensor], queries: tuple[int, ...] | None = None,
    ) -> LayerInternals:
        """Assemble what a recorder collected from ``block`` (model.blocks[layer]), for ``queries``."""
        def gamma(layer_scale: torch.nn.Module) -> torch.Tensor | None:
            weight = getattr(layer_scale, "gamma", None)
            return None if weight is None else weight.detach().to("cpu", torch.float32, copy=True)

        missing = {field for field in cls.__dataclass_fields__ if field not in states} - {
            "layer", "scale", "norm_eps", "layer_scale1", "layer_scale2", "queries", "q_unrotated", "k_unrotated", "window"
        }
        if block.attn.rotary:
            missing |= {"q_unrotated", "k_unrotated"} - set(states)
        if missing:
            raise RuntimeError(f"the forward pass did not record layer {layer}'s {sorted(missing)}")
        return cls(
            layer=layer, scale=float(block.attn.scale), norm_eps=float(block.norm1.eps),
            layer_scale1=gamma(block.ls1), layer_scale2=gamma(block.ls2), queries=queries,
            **{name: states[name] for name in cls.__dataclass_fields__ if name in states and name != "window"},
            window=None if "window" not in states else states["window"] != 0,  # recorded as float32, as every state
        )


def layer_norm_statistics(vector: torch.Tensor, eps: float) -> tuple[float, float]:
    """(mean, standard deviation) that LayerNorm uses for one token (D,): it subtracts the mean
    and divides by sqrt(variance + eps), the variance taken over the D numbers (biased)."""
    vector = vector.double()
    return float(vector.mean()), math.sqrt(float(vector.var(unbiased=False)) + eps)


def rms_statistics(vector: torch.Tensor, eps: float) -> float:
    """The root mean square sqrt(mean(x^2) + eps) that RMSNorm divides one token (D,) by."""
    return math.sqrt(float(vector.double().pow(2).mean()) + eps)


def softmax_statistics(row: torch.Tensor) -> tuple[float, float]:
    """(entropy in nats, largest weight) of one attention row (N,) that sums to 1."""
    row = row.double()
    entropy = -(row * torch.log(row.clamp_min(1e-300))).sum()
    return float(entropy), float(row.max())


def rescaled_attention(internals: LayerInternals, head: int, token: int, scale: float, image: int = 0) -> torch.Tensor:
    """(N,): the attention row of ``token`` in ``head`` had the model used ``scale`` instead of
    1/sqrt(hd), computed as the model does it ((q * scale) @ k^T, then the softmax), from this
    pass's q and k. Nothing is changed; at the model's own scale it is the recorded row."""
    query = internals.q[image, head, internals.row(token)]  # (hd,)
    scores = (query * scale) @ internals.k[image, head].T
    if internals.window is not None:  # window attention: the keys outside the row's window stay at zero
        scores = scores.masked_fill(~internals.window[internals.row(token)], float("-inf"))
    return torch.softmax(scores, dim=-1)


def scale_sweep(
    internals: LayerInternals, head: int, token: int, factors: Sequence[float], image: int = 0
) -> dict[str, list[float]]:
    """Entropy and largest weight of the row at each multiple of the model's scale."""
    stats = [
        softmax_statistics(rescaled_attention(internals, head, token, internals.scale * factor, image))
        for factor in factors
    ]
    return {
        "factor": [float(factor) for factor in factors],
        "entropy": [entropy for entropy, _ in stats],
        "largest weight": [largest for _, largest in stats],
    }


def head_output_sources(
    internals: LayerInternals, head: int, token: int, top: int = 8, image: int = 0
) -> list[dict]:
    """Where one head's output for ``token`` comes from: out = sum_j a_j v_j. For the ``top``
    keys j with the largest share: the weight a_j and the share of out that a_j v_j carries,
    its projection on out, (a_j v_j . out) / |out|^2 (the shares of all keys sum to 1; a key
    whose value points away from out has a negative share)."""
    weights = internals.attention[image, head, internals.row(token)].double()  # (N,)
    contributions = weights[:, None] * internals.v[image, head].double()  # (N, hd)
    output = contributions.sum(dim=0)
    shares = contributions @ output / output.dot(output).clamp_min(1e-300)
    order = shares.argsort(descending=True)[:top]
    return [{"token": int(j), "weight": float(weights[j]), "share": float(shares[j])} for j in order]


def residual_change(before: torch.Tensor, branch: torch.Tensor, after: torch.Tensor) -> dict[str, float]:
    """How much a residual add moved one token: the norms of the token before, of what the
    branch added and of the sum, and the cosine between before and after (1: same direction)."""
    before, branch, after = before.double(), branch.double(), after.double()
    return {
        "norm before": float(before.norm()),
        "norm added": float(branch.norm()),
        "norm after": float(after.norm()),
        "cosine before/after": float(torch.nn.functional.cosine_similarity(before, after, dim=0)),
    }


def mlp_activity(hidden: torch.Tensor, near_zero: float = NEAR_ZERO) -> dict:
    """One token's hidden units after the nonlinearity (hidden,): sorted from the largest (with
    their unit indices), how many fire (at least ``near_zero``) and how many are near zero
    (|h| < ``near_zero``)."""
    values = hidden.double()
    ordered = values.sort(descending=True)
    return {
        "sorted": ordered.values,
        "units by activation": ordered.indices,
        "firing": int((values >= near_zero).sum()),
        "near zero": int((values.abs() < near_zero).sum()),
        "units": values.numel(),
    }
