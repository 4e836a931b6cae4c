"""Truths of the sparse autoencoder: training recovers planted directions, AuxK reaches only dead
latents, and steering a latent removes exactly its contribution inside the forward pass."""
import pytest
import torch
import torch.nn.functional as F

import vit_explorer as vx
from vit_explorer.features.sae import SAEConfig, SparseAutoencoder, explained_variance
from vit_explorer.features.steering import Steering
from vit_explorer.features.train import SAETrainer, fit, initialise

from helpers import randomize, tiny_config


def planted_tokens(count: int, dim: int = 32, directions: int = 48, active: int = 3, seed: int = 0):
    """(count, dim) tokens, each the sum of ``active`` of ``directions`` known unit directions with
    coefficients in [0.5, 1.5), plus a little noise; and the (directions, dim) directions."""
    generator = torch.Generator().manual_seed(seed)
    planted = F.normalize(torch.randn(directions, dim, generator=generator), dim=1)
    chosen = torch.rand(count, directions, generator=generator).argsort(dim=1)[:, :active]
    strengths = 0.5 + torch.rand(count, active, generator=generator)
    coefficients = torch.zeros(count, directions).scatter_(1, chosen, strengths)  # (count, directions)
    return coefficients @ planted + 0.01 * torch.randn(count, dim, generator=generator), planted


def recovered(sae: SparseAutoencoder, planted: torch.Tensor) -> torch.Tensor:
    """(directions,) each planted direction's best cosine with a decoder row."""
    return (planted @ F.normalize(sae.W_dec.detach(), dim=1).T).max(dim=1).values


@pytest.mark.parametrize("seed", [0, 1])
def test_training_recovers_planted_directions(seed):
    tokens, planted = planted_tokens(8192, seed=seed)
    torch.manual_seed(seed)
    sae = SparseAutoencoder(SAEConfig(d_model=32, width=192, k=3))
    initialise(sae, tokens)
    assert (recovered(sae, planted) >= 0.9).float().mean() < 0.1  # a random dictionary finds next to none
    order = torch.Generator().manual_seed(seed)
    epochs = (tokens[rows] for _ in range(10) for rows in torch.randperm(len(tokens), generator=order).split(256))
    fit(sae, epochs, lr=2e-3, dead_after_tokens=len(tokens))
    assert (recovered(sae, planted) >= 0.9).float().mean() >= 0.9
    with torch.no_grad():
        reconstruction, latents = sae(tokens)
    assert (latents > 0).sum(-1).float().mean() <= 3
    assert float(explained_variance(tokens, reconstruction)) > 0.9


def test_initialise_scales_the_tokens_and_centres_the_decoder():
    tokens = 7.0 * torch.randn(500, 16) + 3.0
    sae = SparseAutoencoder(SAEConfig(16, 32, 4))
    initialise(sae, tokens)
    scaled = tokens * sae.input_scale
    assert torch.allclose(scaled.pow(2).sum(-1).mean(), torch.tensor(16.0), rtol=1e-4)
    assert torch.allclose(sae.b_dec, scaled.mean(0), atol=1e-4)


def test_auxk_trains_dead_latents_only_while_they_are_dead():
    tokens, _ = planted_tokens(16, seed=3)
    changed = {}
    for dead in (True, False):  # every latent idle long enough to be dead, or none
        torch.manual_seed(0)
        sae = SparseAutoencoder(SAEConfig(32, 96, 3))
        initialise(sae, tokens)
        trainer = SAETrainer(sae, lr=1e-2, dead_after_tokens=1)
        trainer.since_fired.fill_(1 if dead else 0)
        idle = (sae.encode(tokens) > 0).sum(0) == 0  # latents that do not fire on these tokens
        before = sae.W_dec.detach().clone()
        trainer.step(tokens)
        changed[dead] = (sae.W_dec.detach() - before).norm(dim=1)[idle]
    assert idle.sum() > 40
    assert (changed[False] < 1e-6).all()  # no gradient reaches a latent that did not fire (renormalised) ...
    assert (changed[True] > 1e-3).float().mean() > 0.5  # ... unless it is dead: AuxK's

@pytest.mark.parametrize("prefix_tokens", [False, True])
def test_steering_a_latent_removes_exactly_its_contribution(prefix_tokens):
    model = randomize(vx.ViT(tiny_config(depth=3, reg_tokens=2)))
    layer, dim = 1, model.config.embed_dim
    # An SAE whose latents are 16 orthonormal directions: encoding is projecting, k = 4 of them.
    directions = torch.linalg.qr(torch.randn(dim, 16, generator=torch.Generator().manual_seed(0)))[0].T  # (16, D)
    sae = SparseAutoencoder(SAEConfig(dim, 16, 4))
    with torch.no_grad():
        sae.W_dec.copy_(directions)
        sae.W_enc.copy_(directions.T)
        sae.b_enc.zero_()
        sae.b_dec.zero_()
    x = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    intact = vx.capture(model, x, layers=())
    prefix = model.num_prefix_tokens
    read = intact.tokens[:, layer + 1] if prefix_tokens else intact.tokens[:, layer + 1, prefix:]  # (B, P, D)
    latents = sae.encode(read).detach()  # (B, P, F)
    chosen = int(latents.flatten(0, 1).gt(0).sum(0).argmax())  # the latent active on most tokens
    assert latents[..., chosen].gt(0).sum() > 5

    for factor in (0.0, 2.0):
        steered = vx.capture(model, x, layers=(), steering=Steering(sae, layer, {chosen: factor}, prefix_tokens))
        change = steered.tokens[:, layer + 1] - intact.tokens[:, layer + 1]  # (B, N, D)
        expected = (factor - 1) * latents[..., chosen, None] * directions[chosen]  # (B, P, D)
        if not prefix_tokens:
            assert change[:, :prefix].abs().max() == 0  # the prefix tokens are not read, not changed
            change = change[:, prefix:]
        assert torch.allclose(change, expected, atol=1e-5)
        assert torch.equal(steered.tokens[:, : layer + 1], intact.tokens[:, : layer + 1])  # earlier layers
        assert not torch.allclose(steered.tokens[:, layer + 2], intact.tokens[:, layer + 2])  # it propagates
        after = steered.tokens[:, layer + 1] if prefix_tokens else steered.tokens[:, layer + 1, prefix:]
        others = torch.arange(16) != chosen
        before = sae.pre_activations(read)[..., others]
        assert torch.allclose(sae.pre_activations(after)[..., others], before, atol=1e-5)
    unchanged = vx.capture(model, x, layers=(), steering=Steering(sae, layer, {chosen: 1.0}, prefix_tokens))
    assert torch.allclose(unchanged.tokens, intact.tokens, atol=1e-6)
