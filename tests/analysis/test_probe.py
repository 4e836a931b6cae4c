"""A probe a person labels (vit_explorer.analysis.probe): the same numbers as scikit-learn used by
hand, a label direction planted in one layer found there, and bad labels answered in a sentence
with nothing the person labelled changed."""
import copy

import numpy as np
import pytest
import torch
from sklearn.linear_model import LogisticRegression
from sklearn.model_selection import StratifiedKFold, train_test_split
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

import vit_explorer as vx
from vit_explorer.analysis import AnalysisError
from vit_explorer.analysis import probe as pr


def _tokens(seed: int = 0, images: int = 3, patches: int = 16, dim: int = 12) -> torch.Tensor:
    """(B, 1 + P, D): a class token, then patches of which the first 6 lean along one direction."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randn(images, 1 + patches, dim, generator=generator)
    tokens[:, 1:7] += 1.5 * torch.randn(dim, generator=generator)
    return tokens


def _by_hand(tokens: torch.Tensor, labels: list, names: tuple[str, ...]):
    images = np.array([image for image, _, _ in labels])
    patches = np.array([patch for _, patch, _ in labels])
    y = np.array([names.index(label) for *_, label in labels])
    x = tokens[:, 1:].double().numpy()
    return x, x[images, patches], y


def _classifier():
    return make_pipeline(StandardScaler(), LogisticRegression(C=1.0, max_iter=1000, random_state=0))


def test_few_labels_equal_scikit_learn_by_hand_with_folds():
    tokens = _tokens()
    labels = [(image, patch, "object" if patch < 6 else "background") for image in range(2) for patch in range(0, 16, 3)]
    before = copy.deepcopy(labels), tokens.clone()
    probe = pr.fit_probe(tokens, labels, num_prefix_tokens=1)
    assert (labels, True) == (before[0], torch.equal(tokens, before[1]))  # nothing the person gave changed
    x, samples, y = _by_hand(tokens, labels, probe.names)
    fitted = _classifier().fit(samples, y)
    expected = fitted.predict_proba(x.reshape(-1, x.shape[-1])).reshape(3, 4, 4, 2)
    assert np.allclose(probe.probabilities.numpy(), expected, atol=1e-6)
    assert torch.equal(probe.segmentation, torch.from_numpy(expected.argmax(-1)))
    # Few labels: every labelled patch held out once, in stratified folds.
    folds = min(5, int(np.bincount(y).min()))
    right = 0
    for train, test in StratifiedKFold(folds, shuffle=True, random_state=0).split(samples, y):
        right += int((_classifier().fit(samples[train], y[train]).predict(samples[test]) == y[test]).sum())
    assert probe.accuracy == pytest.approx(right / len(y))
    assert (probe.held_out, probe.folds, probe.labelled) == (len(y), folds, len(y))
    assert f"each of the {len(y)} labelled patches held out once, in {folds} folds" in probe.method
    assert torch.equal(probe.foreground("object"), probe.probabilities[..., 0])


def test_many_labels_hold_a_quarter_out_and_equal_scikit_learn_by_hand():
    tokens = _tokens(seed=1, images=4)
    labels = [(image, patch, "object" if patch < 6 else "background") for image in range(4) for patch in range(16)]
    probe = pr.fit_probe(tokens, labels, num_prefix_tokens=1)
    _, samples, y = _by_hand(tokens, labels, probe.names)
    train, test = train_test_split(np.arange(len(y)), test_size=0.25, stratify=y, random_state=0, shuffle=True)
    expected = (_classifier().fit(samples[train], y[train]).predict(samples[test]) == y[test]).mean()
    assert probe.accuracy == pytest.approx(expected) and probe.accuracy > 0.9
    assert (probe.held_out, probe.folds) == (16, 1) and probe.method == "Held out 16 of the 64 labelled patches."


def test_keys_pairs_and_an_unused_label():
    tokens = _tokens()
    names = ("object", "background", "sky")
    keys = ["digest-a", "digest-b", "digest-c"]
    labels = [("digest-c", (0, patch), "object") for patch in range(3)] + [("digest-a", (3, 3), 1), ("digest-b", (0, 1), 0)]
    probe = pr.fit_probe(tokens, labels, names=names, images=keys, num_prefix_tokens=1, grid_size=(4, 4))
    assert probe.names == names and probe.probabilities.shape == (3, 4, 4, 3)
    assert bool((probe.probabilities[..., 2] == 0).all())  # never used: never predicted
    assert probe.accuracy is None and probe.held_out == 0 and "at least two patches of each label" in probe.method
    assert torch.allclose(probe.probabilities.sum(-1), torch.ones(3, 4, 4))


GRID = 8


def xor_model() -> vx.ViT:
    """A label no linear probe can read from the pixels, planted in layer 1. Patch tokens: channels
    0-1 +/- the patch's mean red, 2-3 +/- its mean green, 4-7 +/- two projections of its blue noise
    (every token's mean is 0, so LayerNorm only rescales it). Block 0 does nothing; block 1's MLP
    computes whether red and green have the same sign (|r + g| - |r - g|: an XOR, which no linear
    function of r and g is) and writes it along channels 6 - 7: the label direction."""
    config = vx.ViTConfig(
        image_size=32, patch_size=4, embed_dim=8, depth=2, num_heads=1, num_classes=2,
        mean=(0.0,) * 3, std=(1.0,) * 3,
    )
    model = vx.ViT(config).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.zero_()
        weight = model.patch_embed.proj.weight  # (D, C, p, p)
        weight[0, 0], weight[2, 1] = 1 / 16, 1 / 16
        weight[4, 2], weight[6, 2] = (torch.randn(2, 4, 4, generator=generator) / 4).unbind(0)
        weight[1::2] = -weight[0::2]
        for block in model.blocks:
            block.norm1.weight.fill_(1)
            block.norm2.weight.fill_(1)
        fc1, fc2 = model.blocks[1].mlp.fc1.weight, model.blocks[1].mlp.fc2.weight
        both, apart = torch.zeros(8), torch.zeros(8)
        both[0], both[2], apart[0], apart[2] = 4.0, 4.0, 4.0, -4.0
        fc1[0], fc1[1], fc1[2], fc1[3] = both, -both, apart, -apart  # GELU(z) + GELU(-z) ~ |z|
        direction = torch.zeros(8)
        direction[6], direction[7] = 10.0, -10.0
        fc2[:, 0], fc2[:, 1], fc2[:, 2], fc2[:, 3] = direction, direction, -direction, -direction
        model.norm.weight.fill_(1)
    return model


def xor_pictures(count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(count, 3, 32, 32): each patch red +/-1 and green +/-1 at random (a little noise on each
    pixel), blue noise; and each patch's label (count, 8, 8): 0 "same" where the signs agree."""
    generator = torch.Generator().manual_seed(7)
    signs = torch.randint(0, 2, (count, 2, GRID, GRID), generator=generator).float() * 2 - 1
    x = signs.repeat_interleave(4, -1).repeat_interleave(4, -2) + 0.3 * torch.randn(count, 2, 32, 32, generator=generator)
    x = torch.cat([x, torch.randn(count, 1, 32, 32, generator=generator)], dim=1)
    return x, (signs[:, 0] != signs[:, 1]).long()


def test_a_planted_label_direction_is_found_at_its_layer_only():
    x, truth = xor_pictures(5)
    model = xor_model()
    cap = vx.capture(model, x, layers=())
    generator = torch.Generator().manual_seed(0)
    names = ("same", "different")
    labels = []
    for image in range(3):  # a few clicks on three of the five images
        for label in (0, 1):
            where = (truth[image].flatten() == label).nonzero().flatten()
            labels += [(image, int(p), names[label]) for p in where[torch.randperm(len(where), generator=generator)[:8]]]
    planted = 2  # tokens[:, 2]: what block 1 wrote
    probe = pr.fit_probe(cap.tokens[:, planted], labels, names=names, num_prefix_tokens=1, grid_size=cap.grid_size)
    assert probe.accuracy >= 0.95
    # Every patch of the two images nobody labelled is segmented right too.
    assert (probe.segmentation[3:] == truth[3:]).float().mean() >= 0.95
    curve = pr.probe_layers(cap.tokens, labels, names=names, num_prefix_tokens=1, grid_size=cap.grid_size)
    assert curve.layers == (0, 1, 2) and curve.held_out == probe.held_out == 12 and curve.best == planted
    assert curve.accuracies[planted] == pytest.approx(probe.accuracy)
    assert max(curve.accuracies[:planted]) < 0.8  # before it, the XOR is in the tokens but no line finds it


@pytest.mark.parametrize("labels, kwargs, message", [
    ([], {}, "No patch is labelled yet"),
    ([(0, 1, "object")], {"names": ("object",)}, "needs two labels at least"),
    ([(0, 1, "object"), (1, 2, "object")], {}, "Every labelled patch is 'object': label a few patches 'background' too"),
    ([("a", 1, "object"), ("gone", 2, "background"), ("gone", 3, "background")], {"images": ["a", "b", "c"]},
     "2 labelled patches are on an image no longer in the set: add it back, or clear its labels"),
    ([("a", 1, "object"), ("gone", 2, "background"), ("old", 3, "background")], {"images": ["a", "b", "c"]},
     "2 labelled patches are on 2 images no longer in the set: add them back"),
    ([(0, 1, "object"), (5, 2, "background")], {}, "1 labelled patch is on an image no longer in the set"),
    ([(0, 1, "object"), (0, 1, "background")], {}, r"Patch \(0, 1\) of image 1 is labelled both 'object' and 'background'"),
    ([(0, 16, "object"), (0, 1, "background")], {}, "outside the 4 x 4 grid"),
    ([(0, 1, "cat"), (0, 2, "dog")], {"names": ("object", "background")}, "'cat' is not one of the labels"),
    ([(0, 1, 0), (0, 2, 1)], {"names": ("a", "b", "c", "d", "e")}, "at most 4 labels"),
])
def test_bad_labels_are_a_sentence_and_nothing_is_lost(labels, kwargs, message):
    tokens = _tokens()
    kept = copy.deepcopy(labels)
    with pytest.raises(AnalysisError, match=message):
        pr.fit_probe(tokens, labels, num_prefix_tokens=1, **kwargs)
    assert labels == kept


def test_the_layer_curve_needs_something_held_out():
    tokens = torch.stack([_tokens(), _tokens(seed=1)], dim=1)  # (B, 2, N, D)
    with pytest.raises(AnalysisError, match="at least two patches of each label"):
        pr.probe_layers(tokens, [(0, 1, "object"), (0, 9, "background"), (1, 9, "background")], num_prefix_tokens=1)
