"""Packed sequences: several token sequences of different lengths run as one pass.

A pass over a batch of one short sequence costs more than its share of the tokens (a small matrix
multiplies less efficiently, and every one of the pass's operations has a fixed part); the
faithfulness curves run dozens of them, each image's patches less some. Packed, every token of
every sequence goes through the per-token work (norms, projections, MLP) as one (1, T, D) tensor,
and only the attention is kept inside each sequence: consecutive sequences of equal length are
one batched attention call. The result is the same as running each sequence alone, to float
rounding.

    packed = Packing.of([tokens_a, tokens_b, ...])        # (n_i, N_i, D) each: n_i sequences of N_i
    out = model.forward_blocks(packed.tokens, rope=packed.rope(prefix, rows), packing=packed)
    per_run = packed.unpack(out)                          # [(n_i, N_i, D), ...]
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Packing:
    """``runs``: (count, length) of each run of sequences of one length, in the order packed."""

    runs: tuple[tuple[int, int], ...]
    tokens: torch.Tensor  # (1, T, D) every sequence's tokens, one after the other

    @classmethod
    def of(cls, runs: Sequence[torch.Tensor]) -> Packing:
        """Pack runs of sequences, each (count, length, D)."""
        if not runs:
            raise ValueError("Packing needs at least one sequence.")
        shapes = tuple((int(run.shape[0]), int(run.shape[1])) for run in runs)
        return cls(shapes, torch.cat([run.reshape(-1, run.shape[-1]) for run in runs])[None])

    def unpack(self, x: torch.Tensor) -> list[torch.Tensor]:
        """(1, T, ...) packed tokens -> each run's (count, length, ...)."""
        sizes = [count * length for count, length in self.runs]
        return [
            part.reshape(count, length, *part.shape[2:])
            for part, (count, length) in zip(x.split(sizes, dim=1), self.runs)
        ]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0) -> torch.Tensor:
        """(1, nh, T, hd) packed queries, keys, values -> (1, nh, T, hd): each sequence's tokens
        attend to its own tokens only."""
        heads = q.shape[1]
        out = []
        for qs, ks, vs in zip(*(self.unpack(t.transpose(1, 2)) for t in (q, k, v))):  # (n, N, nh, hd) each
            attended = F.scaled_dot_product_attention(
                qs.transpose(1, 2), ks.transpose(1, 2), vs.transpose(1, 2), dropout_p=dropout_p
            )  # (n, nh, N, hd)
            out.append(attended.transpose(1, 2).reshape(1, -1, heads, q.shape[-1]))
        return torch.cat(out, dim=1).transpose(1, 2)

    def rope(
        self, num_prefix_tokens: int, rows: Sequence[tuple[torch.Tensor, torch.Tensor]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotary (sin, cos) tables for the packed tokens, (T, hd) each: each run's patches' own
        rows (``rows``: (count, K, hd) sin and cos per run), and no turn (sin 0, cos 1, which
        leaves a token exactly as it is) for each sequence's ``num_prefix_tokens`` first tokens."""
        sins, coses = [], []
        for (count, _), (sin, cos) in zip(self.runs, rows):
            still = sin.new_zeros(count, num_prefix_tokens, sin.shape[-1])
            sins.append(torch.cat([still, sin], dim=1).reshape(-1, sin.shape[-1]))
            coses.append(torch.cat([still + 1, cos], dim=1).reshape(-1, cos.shape[-1]))
        return torch.cat(sins), torch.cat(coses)
