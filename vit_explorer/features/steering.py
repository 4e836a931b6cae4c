"""Steering: some sparse-autoencoder latents scaled inside the forward pass, for one call.

The tokens leaving block ``layer`` are encoded by the SAE trained on them; each steered latent's
contribution (its activation times its direction) is scaled by its factor: 0 removes it, 2 doubles
it. Only that contribution changes: what the dictionary does not explain (the reconstruction
error) stays in the token, so scaling every latent by 1 changes nothing, and steering a latent to
0 removes exactly ``activation * direction`` from each token. The edit rides a context variable
(``model.vit.ACTIVE_STEERING``) set for that call only, as a knock-out does, so a shared model and
other sessions' passes never see it; ``capture(..., steering=...)`` composes it with a knock-out.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import torch

from ..model.vit import ACTIVE_REGISTER, ACTIVE_STEERING, ViT
from .sae import SAEError, SparseAutoencoder


@dataclass(frozen=True)
class Steering:
    """Scale the latents ``scales`` ({latent: factor}) of ``sae`` in the tokens leaving block
    ``layer``; the prefix tokens too when the SAE was trained on them (``prefix_tokens``)."""

    sae: SparseAutoencoder
    layer: int
    scales: Mapping[int, float] = field(default_factory=dict)
    prefix_tokens: bool = False

    def __post_init__(self) -> None:
        width = self.sae.config.width
        for latent, factor in self.scales.items():
            if not 0 <= latent < width:
                raise SAEError(f"latent {latent} does not exist; this dictionary has latents 0..{width - 1}")
            if not factor == factor or abs(factor) > 1e3:  # NaN or absurd
                raise SAEError(f"a latent's factor must be a number between -1000 and 1000, not {factor}")

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        """Steer the passes run inside this block, on this thread only."""
        token = ACTIVE_STEERING.set(self)
        try:
            yield
        finally:
            ACTIVE_STEERING.reset(token)

    def edit(self, model: ViT, tokens: torch.Tensor) -> torch.Tensor:
        """(B, N, D) tokens leaving the layer -> the same with the latents scaled."""
        if not self.scales:
            return tokens
        register = ACTIVE_REGISTER.get()
        prefix = 0 if self.prefix_tokens else model.num_prefix_tokens + (
            0 if register is None else register.added_tokens(model)
        )
        read = tokens[:, prefix:]
        device = self.sae.W_dec.device  # the shared dictionary is never moved: the tokens go to it
        latents = self.sae.encode(read.to(device, torch.float32))  # (B, P, F)
        chosen = torch.tensor(list(self.scales), device=device)
        factors = torch.tensor(list(self.scales.values()), device=device, dtype=torch.float32)
        change = ((factors - 1) * latents[..., chosen]) @ self.sae.directions()[chosen]  # (B, P, D)
        return torch.cat([tokens[:, :prefix], read + change.to(tokens.device, tokens.dtype)], dim=1)
