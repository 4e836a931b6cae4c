"""Latents that matter for a prediction (features.effects): on a planted model whose class rests on
one latent's direction that latent ranks first and removing it changes the prediction, the
first-order estimates agree in sign with real removals, and a real removal is exactly the steered
pass with that latent at 0."""
import pytest
import torch

import vit_explorer as vx
from vit_explorer.features.effects import EFFECT_FORWARDS, LabelScores, affordable_checks, latent_effects
from vit_explorer.features.sae import SAEConfig, SparseAutoencoder
from vit_explorer.features.steering import Steering

from helpers import counting_blocks, randomize, tiny_config

IMAGE = torch.randn(1, 3, 16, 16, generator=torch.Generator().manual_seed(1))


def orthonormal_sae(dim: int, first: torch.Tensor | None = None, width: int = 16, k: int = 8) -> SparseAutoencoder:
    """A dictionary of ``width`` orthonormal directions (encoding projects on them), ``first`` its latent 0."""
    generator = torch.Generator().manual_seed(0)
    columns = torch.randn(dim, width, generator=generator)
    if first is not None:
        columns[:, 0] = first
    basis = torch.linalg.qr(columns)[0].T  # (width, D)
    if first is not None:
        basis[0] = first  # QR may flip its sign
    sae = SparseAutoencoder(SAEConfig(dim, width, k))
    with torch.no_grad():
        sae.W_dec.copy_(basis)
        sae.W_enc.copy_(basis.T)
        sae.b_enc.zero_()
        sae.b_dec.zero_()
    return sae.eval()


def planted() -> tuple[vx.ViT, SparseAutoencoder]:
    """A mean-pooled ViT whose every patch carries a direction v (through its position embedding)
    that the head reads for class 0, and a dictionary whose latent 0 is v: class 0 (88% sure)
    rests on latent 0."""
    model = randomize(vx.ViT(tiny_config(class_token=False, global_pool="mean")))
    dim = model.config.embed_dim
    v = torch.randn(dim, generator=torch.Generator().manual_seed(2))
    v = (v - v.mean()) / (v - v.mean()).norm()  # centred: the final LayerNorm keeps it
    with torch.no_grad():
        model.pos_embed.add_(3 * v)
        model.head.weight[0] = 0.2 * dim**0.5 * v
        model.fc_norm.weight.fill_(1.0)
        model.fc_norm.bias.zero_()
    return model, orthonormal_sae(dim, v)


def test_the_planted_latent_ranks_first_and_estimates_agree_with_removals():
    model, sae = planted()
    intact = vx.capture(model, IMAGE)
    effects = latent_effects(model, sae, 0, intact.tokens[:, 1], checks=5)
    assert effects.target == int(intact.logits.argmax()) == 0
    assert effects.probability == pytest.approx(float(intact.logits.softmax(-1)[0, 0]), abs=1e-6)
    assert 0.6 < effects.probability < 0.95  # not saturated: the gradient is informative
    assert effects.order[0] == 0
    removed = vx.capture(model, IMAGE, steering=Steering(sae, 0, {0: 0.0}))
    assert int(removed.logits.argmax()) != 0  # removing it changes the prediction
    top = effects.top(5)
    assert set(effects.real) == set(top)
    for latent in top:
        assert effects.real[latent] != 0
        assert (effects.real[latent] > 0) == (float(effects.estimates[latent]) > 0), latent
    # The real removal is the steered pass's change of the predicted class's log-probability.
    change = removed.logits.log_softmax(-1)[0, 0] - intact.logits.log_softmax(-1)[0, 0]
    assert effects.real[0] == pytest.approx(float(change), abs=1e-5)
    assert effects.points(effects.real[0]) == pytest.approx(
        100 * float(removed.logits.softmax(-1)[0, 0] - intact.logits.softmax(-1)[0, 0]), abs=1e-3)
    assert (effects.estimates[effects.activations == 0] == 0).all()  # a latent that is not there has no effect


@pytest.mark.parametrize("changes, layer, prefix_tokens", [
    (dict(depth=3, reg_tokens=2), 1, False), (dict(depth=3, reg_tokens=2), 1, True), (dict(num_classes=0), 0, False),
])
def test_a_removal_is_the_steered_pass_and_only_the_blocks_above_run(monkeypatch, changes, layer, prefix_tokens):
    """The class token's model runs its last block for the class row only; a dictionary may read
    the prefix tokens too; a headless model is measured along its pooled output, and its cosine is
    the steered pass's."""
    model = randomize(vx.ViT(tiny_config(**changes)))
    sae = orthonormal_sae(model.config.embed_dim)
    intact = vx.capture(model, IMAGE)
    ran = counting_blocks(monkeypatch, model)
    effects = latent_effects(model, sae, layer, intact.tokens[:, layer + 1], prefix_tokens)
    assert set(ran) <= set(range(layer + 1, model.config.depth))  # the layers below come from the capture
    assert effects.forwards <= EFFECT_FORWARDS
    assert len(effects.real) == affordable_checks(model, layer) >= 1
    for latent, real in effects.real.items():
        steered = vx.capture(model, IMAGE, steering=Steering(sae, layer, {latent: 0.0}, prefix_tokens)).logits[0]
        if model.config.num_classes:
            expected = steered.log_softmax(-1)[effects.target] - intact.logits[0].log_softmax(-1)[effects.target]
        else:
            pooled = intact.logits[0]
            expected = steered @ pooled / pooled.pow(2).sum() - 1
            cosine = torch.nn.functional.cosine_similarity(steered, pooled, dim=0)
            assert effects.cosines[latent] == pytest.approx(float(cosine), abs=1e-5)
        assert real == pytest.approx(float(expected), abs=1e-5)


def test_a_headless_model_with_labels_is_measured_on_its_best_label_s_score():
    """CLIP's softmax over the labels and SigLIP's own sigmoid: a removal is the steered pass's change."""
    model = randomize(vx.ViT(tiny_config(num_classes=0)))
    sae = orthonormal_sae(model.config.embed_dim)
    texts = torch.nn.functional.normalize(torch.randn(3, 32, generator=torch.Generator().manual_seed(3)), dim=1)
    intact = vx.capture(model, IMAGE)
    def logits(pooled):
        return 10 * torch.nn.functional.normalize(pooled, dim=-1) @ texts.T

    for softmax in (True, False):
        labels = LabelScores(("a cat", "a dog", "a ring"), logits, softmax)
        effects = latent_effects(model, sae, 0, intact.tokens[:, 1], labels=labels)
        scores = labels.log_scores(intact.logits)[0]
        assert effects.target == int(scores.argmax()) and effects.label == labels.names[effects.target]
        assert effects.probability == pytest.approx(float(scores.max().exp()), abs=1e-6)
        for latent, real in effects.real.items():
            steered = vx.capture(model, IMAGE, steering=Steering(sae, 0, {latent: 0.0})).logits
            expected = labels.log_scores(steered)[0, effects.target] - scores[effects.target]
            assert real == pytest.approx(float(expected), abs=1e-5)
