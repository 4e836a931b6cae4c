"""A dictionary judged as the field judges it: NMSE, L0, dead and dense shares, and the spliced score
(the model run with the reconstruction in place of the layer's tokens) against a hand computation
with vx.capture and forward_blocks; a zero dictionary recovers 0% of the loss, the identity 100%."""
import pytest
import torch
import torch.nn.functional as F

import vit_explorer as vx
from vit_explorer.features.evaluation import DENSE_FREQUENCY, Evaluation, evaluate, reference
from vit_explorer.features.sae import SAEConfig, SparseAutoencoder
from vit_explorer.features.tokens import ImageSource, model_input
from vit_explorer.features.train import initialise

from helpers import randomize, tiny_config

IMAGES = 6


def dictionary(model: vx.ViT, tokens: torch.Tensor, seed: int = 0) -> SparseAutoencoder:
    torch.manual_seed(seed)
    sae = SparseAutoencoder(SAEConfig(model.config.embed_dim, 64, 4))
    initialise(sae, tokens)
    return sae.eval()


def identity(dim: int) -> SparseAutoencoder:
    """Latents +x_i and -x_i, k = dim: the positive one of each pair is kept, the decode is x."""
    sae = SparseAutoencoder(SAEConfig(dim, 2 * dim, dim))
    with torch.no_grad():
        basis = torch.cat([torch.eye(dim), -torch.eye(dim)])  # (2 D, D)
        sae.W_dec.copy_(basis)
        sae.W_enc.copy_(basis.T)
        sae.b_enc.zero_()
        sae.b_dec.zero_()
    return sae.eval()


def by_hand(model, sae, x, layer, prefix_tokens):
    """(clean logits, spliced, zero-ablated, read tokens, reconstruction) from capture and forward_blocks."""
    tokens = vx.capture(model, x, layers=()).tokens[:, layer + 1]  # (B, N, D) leaving the layer
    start = 0 if prefix_tokens else model.num_prefix_tokens
    read = tokens[:, start:]
    with torch.no_grad():
        reconstruction = sae(read)[0]

    def run(replacement):
        edited = torch.cat([tokens[:, :start], replacement], dim=1)
        with torch.no_grad():
            return model.forward_head(model.forward_blocks(edited, layer + 1))

    with torch.no_grad():
        clean = model(x)
    return clean, run(reconstruction), run(torch.zeros_like(read)), read, reconstruction


@pytest.mark.parametrize("layer, prefix_tokens, changes", [
    (1, False, {}), (2, True, dict(reg_tokens=1)), (0, False, dict(num_classes=0)),
])
def test_the_spliced_score_equals_a_hand_computation(layer, prefix_tokens, changes):
    model = randomize(vx.ViT(tiny_config(depth=3, **changes)))
    source = ImageSource("shapes", IMAGES, 16)
    x = model_input(model, source.images(torch.arange(IMAGES)))
    first = vx.capture(model, x, layers=()).tokens[:, layer + 1, 0 if prefix_tokens else model.num_prefix_tokens:]
    sae = dictionary(model, first.flatten(0, 1))
    result = evaluate(sae, model, source, layer, prefix_tokens, batch_size=4)  # two passes: sums across them

    clean, ours, zero, read, reconstruction = by_hand(model, sae, x, layer, prefix_tokens)
    tokens = read.flatten(0, 1)
    nmse = (tokens - reconstruction.flatten(0, 1)).pow(2).sum() / (tokens - tokens.mean(0)).pow(2).sum()
    active = sae.encode(tokens) > 0
    assert result.images == IMAGES and result.tokens == tokens.shape[0]
    assert result.nmse == pytest.approx(float(nmse), abs=1e-5)
    assert result.l0 == pytest.approx(float(active.sum(-1).float().mean()), abs=1e-5)
    assert result.dead_share == pytest.approx(float((active.sum(0) == 0).float().mean()))
    assert result.dense_share == pytest.approx(float((active.float().mean(0) > DENSE_FREQUENCY).float().mean()))
    if model.config.num_classes == 0:
        assert result.pooled_cosine == pytest.approx(float(F.cosine_similarity(ours, clean).mean()), abs=1e-5)
        assert result.loss_recovered is None
        return
    target = clean.argmax(-1, keepdim=True)
    loss = {name: float(-logits.log_softmax(-1).gather(-1, target).mean())
            for name, logits in (("clean", clean), ("sae", ours), ("zero", zero))}
    recovered = (loss["zero"] - loss["sae"]) / (loss["zero"] - loss["clean"])
    kl = F.kl_div(ours.log_softmax(-1), clean.log_softmax(-1), log_target=True, reduction="batchmean")
    assert result.loss_recovered == pytest.approx(recovered, abs=1e-5)
    assert result.kl == pytest.approx(float(kl), abs=1e-5)
    assert result.prediction_kept == pytest.approx(float((ours.argmax(-1, keepdim=True) == target).float().mean()))
    assert 0 < result.kl and 0 < result.loss_recovered < 1  # a random dictionary: not a trivial case
    # A shared reference (clean and zero-ablated outputs) gives the same numbers.
    compared = reference(model, source, layer, prefix_tokens, batch_size=4)
    assert evaluate(sae, model, source, layer, prefix_tokens, batch_size=4, compared=compared) == result
    assert Evaluation.from_card(result.to_card()) == result


def test_a_zero_dictionary_recovers_none_of_the_loss_and_the_identity_all():
    model = randomize(vx.ViT(tiny_config(depth=3)))
    source = ImageSource("shapes", IMAGES, 16)
    zero = SparseAutoencoder(SAEConfig(32, 64, 4)).eval()
    with torch.no_grad():
        zero.W_dec.zero_()  # every reconstruction is the bias, 0: zero-ablation itself
    nothing = evaluate(zero, model, source, 1, False)
    assert nothing.loss_recovered == pytest.approx(0.0, abs=1e-6)
    everything = evaluate(identity(32), model, source, 1, False)
    assert everything.loss_recovered == pytest.approx(1.0, abs=1e-5)
    assert everything.prediction_kept == 1.0 and everything.kl == pytest.approx(0.0, abs=1e-6)
    assert everything.nmse == pytest.approx(0.0, abs=1e-6) and everything.l0 == 32
    assert nothing.nmse > 0.99
