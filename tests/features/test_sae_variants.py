"""BatchTopK and Matryoshka dictionaries against their papers' definitions, and seed stability, on
planted data (tests/features/test_sae_truth.py: 48 directions of 32 dimensions, 3 per token)."""
import numpy as np
import pytest
import torch

from vit_explorer.features.sae import SAEConfig, SparseAutoencoder, explained_variance
from vit_explorer.features.stability import stability
from vit_explorer.features.train import SAETrainer, fit, initialise

from test_sae_truth import planted_tokens, recovered


def trained(config: SAEConfig, tokens: torch.Tensor, seed: int = 0, lr: float = 4e-3) -> SparseAutoencoder:
    torch.manual_seed(seed)
    sae = SparseAutoencoder(config)
    initialise(sae, tokens)
    order = torch.Generator().manual_seed(seed)
    fit(sae, (tokens[rows] for _ in range(10) for rows in torch.randperm(len(tokens), generator=order).split(256)),
        lr=lr, dead_after_tokens=len(tokens))
    return sae.eval()


@pytest.fixture(scope="module")
def planted():
    return planted_tokens(8192)


@pytest.fixture(scope="module")
def two_seeds(planted):
    tokens, _ = planted
    return [trained(SAEConfig(32, 96, 3), tokens, seed) for seed in (0, 1)]


def prefix_explained(sae: SparseAutoencoder, tokens: torch.Tensor, width: int) -> float:
    """The explained variance of latents 0..width-1 alone (the others set to 0)."""
    with torch.no_grad():
        latents = sae.encode(tokens)
        latents[:, width:] = 0
        return float(explained_variance(tokens, sae.decode(latents)))


def test_batchtopk_keeps_k_per_token_over_the_batch_and_recovers_the_directions(planted):
    tokens, directions = planted
    sae = SparseAutoencoder(SAEConfig(32, 96, 3, "batchtopk"))
    initialise(sae, tokens)
    trainer = SAETrainer(sae, lr=4e-3)
    batch = tokens[:64]
    with torch.no_grad():
        pre = sae.pre_activations(batch)  # (64, F)
        values, latents, rows = trainer._active(pre)
    # The batch's 3 x 64 largest pre-activations, however they fall on its tokens (Bussmann et al.)
    expected = pre.flatten().topk(3 * 64)
    assert sorted((rows * 96 + latents).tolist()) == sorted(expected.indices.tolist())
    assert torch.allclose(values.sort().values, expected.values.sort().values)
    per_token = torch.bincount(rows, minlength=64)
    assert per_token.sum() == 3 * 64 and per_token.min() < 3 < per_token.max()
    trainer.step(batch)
    assert sae.threshold == values.min()  # the first estimate of the inference threshold: the smallest kept
    sae = trained(SAEConfig(32, 192, 3, "batchtopk"), tokens)
    assert (recovered(sae, directions) >= 0.9).float().mean() >= 0.9
    with torch.no_grad():
        latents = sae.encode(tokens)  # at inference: every latent above the threshold
        assert torch.equal(latents > 0, sae.pre_activations(tokens) > sae.threshold)
        assert float(explained_variance(tokens, sae.decode(latents))) > 0.9
    per_token = (latents > 0).sum(-1).float()
    assert 2 <= per_token.mean() <= 4 and per_token.max() > 3  # k on average, more where a token needs it
    # A run ends by estimating the threshold again with the finished encoder: each batch's smallest kept, averaged.
    with torch.no_grad():
        sae.threshold.fill_(10.0)
        SAETrainer(sae, lr=4e-3).calibrate(tokens, 256, batches=8)
        pre = sae.pre_activations(tokens[: 8 * 256]).clamp(min=0)
        expected = torch.stack([batch.flatten().topk(3 * 256).values.min() for batch in pre.split(256)]).mean()
        assert torch.allclose(sae.threshold, expected)
        assert 2.7 <= (sae.encode(tokens) > 0).sum(-1).float().mean() <= 3.3


def test_matryoshka_prefixes_each_reconstruct_at_their_own_width(planted, two_seeds):
    tokens, directions = planted
    sae = trained(SAEConfig(32, 96, 3, "topk", (24, 48)), tokens)
    assert (recovered(sae, directions) >= 0.9).float().mean() >= 0.9
    nested = [prefix_explained(sae, tokens, width) for width in (24, 48, 96)]
    assert nested[0] < nested[1] < nested[2] and nested[2] > 0.9
    # A plain TopK dictionary's first latents are no dictionary alone; Matryoshka's are.
    plain = [prefix_explained(two_seeds[0], tokens, width) for width in (24, 48)]
    assert nested[0] > plain[0] + 0.2 and nested[1] > plain[1] + 0.1


def test_two_seeds_find_the_same_latents(planted, two_seeds):
    tokens, _ = planted
    first, second = two_seeds
    found = stability(first, second, tokens)
    assert found.used_share >= 0.9  # the latents that fire are found again by the other seed
    assert found.share == pytest.approx(float(np.mean(found.cosines >= 0.9)))
    assert stability(first, first).share == 1.0
    random = SparseAutoencoder(SAEConfig(32, 96, 3))
    assert stability(first, random, tokens).used_share < 0.1
