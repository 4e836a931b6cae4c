"""Analysis functions: hand-worked values on tiny inputs, reference implementations, invariants."""
import math

import pytest
import torch
from einops import rearrange

import vit_explorer as vx
from vit_explorer import analysis
from vit_explorer.analysis import AnalysisError
from vit_explorer.model.capture import Capture


def tiny_model(seed=0, **changes):
    settings = dict(
        image_size=(8, 12), patch_size=4, num_classes=5, embed_dim=16, depth=3, num_heads=2
    )
    settings.update(changes)
    torch.manual_seed(seed)
    model = vx.ViT(vx.ViTConfig(**settings))
    # The zero-initialised head would make every logit (and every gradient) zero.
    torch.nn.init.normal_(model.head.weight)
    with torch.no_grad():
        for token in (model.cls_token, model.reg_token):
            if token is not None:
                token.normal_()
    return model.eval()


def random_attentions(batch=2, layers=3, heads=2, tokens=7, seed=0):
    generator = torch.Generator().manual_seed(seed)
    scores = torch.randn(batch, layers, heads, tokens, tokens, generator=generator)
    return (3 * scores).softmax(dim=-1)


def fake_capture(attentions, grid_size, num_prefix_tokens, layers=None):
    batch, captured, _, tokens, _ = attentions.shape
    layers = tuple(range(captured)) if layers is None else tuple(layers)
    depth = max(layers) + 1
    return Capture(
        logits=torch.zeros(batch, 3),
        attentions=attentions,
        tokens=torch.zeros(batch, depth + 1, tokens, 4),
        patches=torch.zeros(batch, *grid_size, 3, 2, 2),
        patch_embeddings=torch.zeros(batch, tokens - num_prefix_tokens, 4),
        grid_size=grid_size,
        num_prefix_tokens=num_prefix_tokens,
        layers=layers,
    )


# --- attention rollout ---------------------------------------------------------------------


def test_rollout_one_layer_by_hand():
    attention = torch.tensor([[0.8, 0.2], [0.4, 0.6]])
    result = analysis.attention_rollout(attention[None, None, None])
    # 0.5 * A + 0.5 * I has rows summing to 1 already.
    assert torch.allclose(result[0], torch.tensor([[0.9, 0.1], [0.2, 0.8]]))


def test_rollout_multiplies_later_layers_on_the_left():
    first = torch.tensor([[0.8, 0.2], [0.4, 0.6]])
    second = torch.tensor([[0.5, 0.5], [0.0, 1.0]])
    attentions = torch.stack([first, second])[None, :, None]  # (1, 2, 1, 2, 2)
    # M1 = [[.9, .1], [.2, .8]], M2 = [[.75, .25], [0, 1]], R = M2 @ M1.
    expected = torch.tensor([[0.725, 0.275], [0.2, 0.8]])
    assert torch.allclose(analysis.attention_rollout(attentions)[0], expected)


def test_rollout_head_fusions_renormalise_rows():
    heads = torch.tensor([[[1.0, 0.0], [0.0, 1.0]], [[0.0, 1.0], [1.0, 0.0]]])[None, None]
    # max fuses to all ones: (0.5 * 1 + 0.5 * I) / 1.5 per row.
    maximum = analysis.attention_rollout(heads, head_fusion="max")[0]
    assert torch.allclose(maximum, torch.tensor([[2 / 3, 1 / 3], [1 / 3, 2 / 3]]))
    # min fuses to zeros: only the residual is left.
    assert torch.allclose(analysis.attention_rollout(heads, head_fusion="min")[0], torch.eye(2))
    # mean fuses to 0.5 everywhere: 0.25 + 0.5 on the diagonal.
    assert torch.allclose(analysis.attention_rollout(heads, head_fusion="mean")[0],
                          torch.tensor([[0.75, 0.25], [0.25, 0.75]]))


def test_rollout_discard_drops_smallest_weights_but_not_the_class_token_column():
    fused = torch.tensor([[0.01, 0.49, 0.50], [0.02, 0.90, 0.08], [0.05, 0.03, 0.92]])
    # 9 * 0.25 -> 2 weights dropped: the smallest outside column 0 are 0.03 and 0.08;
    # 0.01, 0.02 and 0.05 are smaller but are attention paid to the class token.
    result = analysis.attention_rollout(fused[None, None, None], discard_ratio=0.25)[0]
    kept = torch.tensor([[0.01, 0.49, 0.50], [0.02, 0.90, 0.00], [0.05, 0.00, 0.92]])
    mixed = 0.5 * kept + 0.5 * torch.eye(3)
    assert torch.allclose(result, mixed / mixed.sum(dim=-1, keepdim=True))


def reference_discard(fused: torch.Tensor, ratio: float, protected: int) -> torch.Tensor:
    """The share's smallest weights outside the protected columns zeroed, ties in reading order:
    a stable sort of (weight, position), the long way round."""
    tokens = fused.shape[-1]
    flat = fused.flatten().tolist()
    candidates = [index for index in range(tokens * tokens) if index % tokens >= protected]
    count = min(int(tokens * tokens * ratio), len(candidates))
    dropped = sorted(candidates, key=lambda index: (flat[index], index))[:count]
    kept = fused.flatten().clone()
    kept[dropped] = 0.0
    return kept.reshape(tokens, tokens)


@pytest.mark.parametrize("ratio, protected", [(0.3, 1), (0.9, 1), (0.5, 5), (0.99, 3)])
def test_rollout_discard_drops_exactly_the_share_with_ties_in_reading_order(ratio, protected):
    """float16 attention ties often: weights equal to the largest one dropped go row by row, so
    that exactly the share goes, whichever device or implementation computes it."""
    torch.manual_seed(0)
    fused = (torch.rand(2, 12, 12) * 8).round() / 8  # nine values: every threshold is a tie
    discarded = analysis.rollout._discard_smallest(fused, ratio, protected)
    for image in range(2):
        expected = reference_discard(fused[image], ratio, protected)
        assert torch.equal(discarded[image], expected)
    assert torch.equal(discarded[..., :protected], fused[..., :protected])
    untied = torch.rand(1, 12, 12)  # no ties: exactly the weights topk picks as the smallest
    smallest = untied[..., protected:].flatten().topk(min(72, 12 * (12 - protected)), largest=False).values
    dropped = analysis.rollout._discard_smallest(untied, 0.5, protected)
    assert torch.equal(untied[dropped == 0].sort().values, smallest.sort().values)


def reference_rollout(attentions, head_fusion, start_layer=0):
    """Per image and layer, written the long way round."""
    results = []
    for image in attentions:
        rollout = torch.eye(image.shape[-1])
        for layer in image[start_layer:]:
            fused = {"mean": layer.mean(0), "max": layer.max(0).values,
                     "min": layer.min(0).values}[head_fusion]
            mixed = (fused + torch.eye(fused.shape[0])) / 2
            for row in range(mixed.shape[0]):
                mixed[row] = mixed[row] / mixed[row].sum()
            rollout = mixed @ rollout
        results.append(rollout)
    return torch.stack(results)


@pytest.mark.parametrize("head_fusion", ["mean", "max", "min"])
@pytest.mark.parametrize("start_layer", [0, 2])
def test_rollout_matches_reference_and_rows_sum_to_one(head_fusion, start_layer):
    attentions = random_attentions(batch=3, layers=4, heads=3, tokens=7)
    result = analysis.attention_rollout(attentions, head_fusion, start_layer=start_layer)
    assert result.shape == (3, 7, 7)
    assert torch.allclose(result, reference_rollout(attentions, head_fusion, start_layer), atol=1e-6)
    assert torch.allclose(result.sum(dim=-1), torch.ones(3, 7), atol=1e-5)
    discarded = analysis.attention_rollout(attentions, head_fusion, discard_ratio=0.9)
    assert torch.allclose(discarded.sum(dim=-1), torch.ones(3, 7), atol=1e-5)
    assert bool((discarded >= 0).all())


def test_rollout_discards_per_image():
    attentions = random_attentions(batch=2, layers=2, tokens=5)
    together = analysis.attention_rollout(attentions, discard_ratio=0.5)
    alone = torch.cat([analysis.attention_rollout(a[None], discard_ratio=0.5) for a in attentions])
    assert torch.allclose(together, alone)


def test_rollout_rejects_bad_options():
    attentions = random_attentions()
    with pytest.raises(AnalysisError, match="head_fusion"):
        analysis.attention_rollout(attentions, head_fusion="median")
    with pytest.raises(AnalysisError, match="discard_ratio"):
        analysis.attention_rollout(attentions, discard_ratio=1.0)
    with pytest.raises(AnalysisError, match="start_layer"):
        analysis.attention_rollout(attentions, start_layer=3)
    with pytest.raises(AnalysisError, match=r"\(B, L, H, N, N\)"):
        analysis.attention_rollout(attentions[0])


# --- attribution -------------------------------------------------------------------------


def manual_attention_gradients(model, x, target):
    """A plain re-implementation of the forward pass that keeps every layer's attention."""
    config = model.config
    tokens = rearrange(model.patch_embed.proj(x), "b d gh gw -> b (gh gw) d")
    prefix = [t.expand(x.shape[0], -1, -1) for t in (model.cls_token, model.reg_token)
              if t is not None]
    tokens = torch.cat(prefix + [tokens], dim=1) + model.pos_embed
    attentions = []
    for block in model.blocks:
        attn = block.attn
        q, k, v = rearrange(attn.qkv(block.norm1(tokens)), "b n (s h d) -> s b h n d", s=3,
                            h=config.num_heads)
        weights = ((q @ k.transpose(-2, -1)) * attn.scale).softmax(dim=-1)
        attentions.append(weights)
        mixed = rearrange(weights @ v, "b h n d -> b n (h d)")
        tokens = tokens + attn.proj(mixed)
        tokens = tokens + block.mlp(block.norm2(tokens))
    logits = model.forward_head(model.norm(tokens))
    chosen = logits[torch.arange(x.shape[0]), target].sum()
    return attentions, torch.autograd.grad(chosen, attentions)


def reference_attribution(model, x, target):
    config = model.config
    attentions, gradients = manual_attention_gradients(model, x, target)
    relevance = torch.eye(config.num_tokens).repeat(x.shape[0], 1, 1)
    for attention, gradient in zip(attentions, gradients):
        cam = (gradient * attention).clamp(min=0).mean(dim=1)
        relevance = relevance + torch.bmm(cam, relevance)
    prefix = config.num_prefix_tokens
    rows = relevance[:, 0] if config.class_token else relevance[:, prefix:].mean(dim=1)
    return rows[:, prefix:].reshape(x.shape[0], *config.grid_size).detach()


@pytest.mark.parametrize(
    "changes",
    [{}, {"reg_tokens": 2}, {"class_token": False, "global_pool": "mean", "reg_tokens": 1},
     {"class_token": False, "global_pool": "mean", "image_size": 12}],
)
def test_attribution_matches_a_plain_reimplementation(changes):
    model = tiny_model(**changes)
    x = torch.randn(2, 3, *model.config.img_size)
    target = torch.tensor([1, 3])
    result = analysis.attribution(model, x, target)
    assert result.shape == (2, *model.config.grid_size)
    assert torch.allclose(result, reference_attribution(model, x, target), atol=1e-5)
    assert bool((result >= 0).all()) and float(result.sum()) > 0


def test_attribution_defaults_to_the_predicted_class_and_depends_on_the_target():
    model = tiny_model()
    x = torch.randn(2, 3, 8, 12)
    predicted = model(x).argmax(dim=-1)
    assert torch.allclose(analysis.attribution(model, x), analysis.attribution(model, x, predicted))
    other = (predicted + 1) % 5
    assert not torch.allclose(analysis.attribution(model, x), analysis.attribution(model, x, other))
    # One target for the whole batch, and the batch is just the images side by side.
    batch = analysis.attribution(model, x, 2)
    alone = torch.cat([analysis.attribution(model, image[None], 2) for image in x])
    assert torch.allclose(batch, alone, atol=1e-6)


def test_attribution_leaves_the_model_as_it_was():
    model = tiny_model()
    model.train()
    model.blocks[1].requires_grad_(False)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    analysis.attribution(model, torch.randn(1, 3, 8, 12))
    assert model.training
    assert all(block.attn.fused_attn for block in model.blocks)
    for name, parameter in model.named_parameters():
        assert parameter.grad is None
        assert parameter.requires_grad == (not name.startswith("blocks.1."))
        assert torch.equal(parameter, before[name])


def test_attribution_works_for_a_frozen_model_under_no_grad():
    model = tiny_model().requires_grad_(False)
    x = torch.randn(1, 3, 8, 12)
    with torch.no_grad():
        result = analysis.attribution(model, x, 0)
    model.requires_grad_(True)
    assert torch.allclose(result, reference_attribution(model, x, torch.tensor([0])), atol=1e-5)


def test_attribution_rejects_bad_targets():
    model = tiny_model()
    with pytest.raises(AnalysisError, match=r"0\.\.4"):
        analysis.attribution(model, torch.randn(1, 3, 8, 12), 5)
    with pytest.raises(AnalysisError, match="3 targets for a batch of 2"):
        analysis.attribution(model, torch.randn(2, 3, 8, 12), [0, 1, 2])


# --- maps over the grid ----------------------------------------------------------------------


def test_query_maps_by_hand():
    # One prefix token and a 2x3 grid: N = 7; entry [q, k] = 10 * q + k.
    matrix = torch.arange(7.0)[None, :] + 10 * torch.arange(7.0)[:, None]
    cls_row = analysis.query_map(matrix, (2, 3), 1)
    assert torch.equal(cls_row, torch.tensor([[1.0, 2, 3], [4, 5, 6]]))
    # Patch (1, 0) is patch index 3, token 4.
    assert torch.equal(analysis.query_map(matrix, (2, 3), 1, (1, 0)), cls_row + 40)
    assert torch.equal(analysis.query_map(matrix, (2, 3), 1, 3), cls_row + 40)
    # A register without a class token: the mean of the patch rows (tokens 1..6, mean 35).
    assert torch.equal(analysis.query_map(matrix, (2, 3), 1, class_token=False), cls_row + 35)
    # No prefix token at all.
    plain = analysis.query_map(matrix[1:, 1:], (2, 3), 0)
    assert torch.equal(plain, cls_row + 35)
    with pytest.raises(AnalysisError, match="outside the 2x3 grid"):
        analysis.query_map(matrix, (2, 3), 1, (2, 0))
    with pytest.raises(AnalysisError, match="0..5"):
        analysis.query_map(matrix, (2, 3), 1, 6)
    with pytest.raises(AnalysisError, match="3x3 grid"):
        analysis.query_map(matrix, (3, 3), 1)


def test_attention_map_and_head_maps_pick_layer_head_and_image():
    attentions = random_attentions(batch=2, layers=2, heads=3, tokens=7)
    capture = fake_capture(attentions, (2, 3), 1, layers=(1, 4))
    maps = analysis.head_maps(capture, 4, image=1)
    assert maps.shape == (3, 2, 3)
    assert torch.equal(maps[2], rearrange(attentions[1, 1, 2, 0, 1:], "(h w) -> h w", h=2))
    assert torch.equal(analysis.attention_map(capture, -1, head=2, image=1), maps[2])
    assert torch.allclose(analysis.attention_map(capture, 4, image=1), maps.mean(dim=0))
    assert analysis.attention_map(capture, 1, 0, query=(1, 1)).shape == (2, 3)
    with pytest.raises(AnalysisError, match=r"layer 2 was not captured; captured layers: \[1, 4\]"):
        analysis.attention_map(capture, 2, 0)
    with pytest.raises(AnalysisError, match="layers 0..4"):
        analysis.attention_map(capture, 7, 0)
    with pytest.raises(AnalysisError, match="head must be in 0..2"):
        analysis.attention_map(capture, 4, 3)
    with pytest.raises(AnalysisError, match="batch of 2"):
        analysis.head_maps(capture, 4, image=2)


def test_attention_maps_from_a_real_capture_sum_to_the_patch_share():
    model = tiny_model(reg_tokens=2)
    capture = vx.capture(model, torch.randn(1, 3, 8, 12))
    head = analysis.attention_map(capture, 0, 1)
    prefix_share = capture.attentions[0, 0, 1, 0, :3].sum()
    assert torch.allclose(head.sum() + prefix_share, torch.tensor(1.0), atol=1e-5)


def test_attention_mask_by_mass_by_hand():
    attn_map = torch.tensor([[0.5, 0.1], [0.3, 0.1]])
    expected = torch.tensor([[True, False], [True, False]])
    assert torch.equal(analysis.attention_mask_by_mass(attn_map, 0.6), expected)
    assert torch.equal(analysis.attention_mask_by_mass(10 * attn_map, 0.6), expected)
    # 0.5 alone holds exactly half.
    assert torch.equal(analysis.attention_mask_by_mass(attn_map, 0.5),
                       torch.tensor([[True, False], [False, False]]))
    assert bool(analysis.attention_mask_by_mass(attn_map, 1.0).all())
    assert not bool(analysis.attention_mask_by_mass(torch.zeros(2, 2)).any())
    with pytest.raises(AnalysisError, match="mass"):
        analysis.attention_mask_by_mass(attn_map, 0.0)
    with pytest.raises(AnalysisError, match="non-negative"):
        analysis.attention_mask_by_mass(-attn_map)


def test_attention_mask_is_the_smallest_set_holding_the_mass():
    maps = torch.rand(4, 3, 5, generator=torch.Generator().manual_seed(1))
    masks = analysis.attention_mask_by_mass(maps, 0.7)
    for attn_map, mask in zip(maps, masks):
        share = attn_map / attn_map.sum()
        assert float(share[mask].sum()) >= 0.7
        smallest_kept = share[mask].min()
        assert float(share[mask].sum() - smallest_kept) < 0.7
        assert float(share[~mask].max()) <= float(smallest_kept)


# --- statistics per layer and head -------------------------------------------------------


def test_mean_attention_distance_by_hand():
    # A 1x2 grid of 4-pixel patches (centres 4 px apart) and a class token.
    attention = torch.tensor([[1.0, 0.0, 0.0], [0.5, 0.25, 0.25], [0.0, 1.0, 0.0]])
    # Patch 0: 0.25 * 4 = 1 (the class token's 0.5 is not renormalised away); patch 1: 4.
    distance = analysis.mean_attention_distance(attention[None, None, None], (1, 2), 4, 1)
    assert torch.allclose(distance, torch.tensor([[2.5]]))


def test_mean_attention_distance_uniform_on_a_non_square_grid():
    grid_h, grid_w, patch = 2, 3, 5
    centres = [(r, c) for r in range(grid_h) for c in range(grid_w)]
    expected = sum(
        patch * math.hypot(r1 - r2, c1 - c2) for r1, c1 in centres for r2, c2 in centres
    ) / len(centres) ** 2
    uniform = torch.full((2, 1, 1, 6, 6), 1 / 6)
    distance = analysis.mean_attention_distance(uniform, (grid_h, grid_w), patch, 0)
    assert torch.allclose(distance, torch.tensor([[expected]]))
    identity = torch.eye(6).expand(2, 3, 2, 6, 6)
    assert torch.equal(analysis.mean_attention_distance(identity, (2, 3), 5, 0), torch.zeros(3, 2))


def test_mean_attention_distance_averages_the_batch_and_scales_with_patch_size():
    attentions = random_attentions(batch=3, layers=2, heads=2, tokens=7)
    distance = analysis.mean_attention_distance(attentions, (2, 3), 4, 1)
    assert distance.shape == (2, 2)
    per_image = torch.stack([analysis.mean_attention_distance(a[None], (2, 3), 4, 1)
                             for a in attentions])
    assert torch.allclose(distance, per_image.mean(dim=0))
    assert torch.allclose(analysis.mean_attention_distance(attentions, (2, 3), 8, 1), 2 * distance)
    with pytest.raises(AnalysisError, match="3x3 grid"):
        analysis.mean_attention_distance(attentions, (3, 3), 4, 1)


def test_attention_entropy_by_hand():
    rows = torch.tensor([[0.5, 0.5, 0.0], [1.0, 0.0, 0.0], [1 / 3, 1 / 3, 1 / 3]])
    entropy = analysis.attention_entropy(rows[None, None, None])
    assert entropy.shape == (1, 1, 1)
    assert torch.allclose(entropy, torch.tensor((math.log(2) + 0 + math.log(3)) / 3))
    attentions = random_attentions(batch=2, layers=3, heads=4, tokens=6)
    entropy = analysis.attention_entropy(attentions)
    assert entropy.shape == (2, 3, 4)
    assert bool((entropy >= 0).all()) and bool((entropy <= math.log(6) + 1e-6).all())


# --- tokens through the depth ----------------------------------------------------------------


@pytest.mark.parametrize("changes", [{}, {"class_token": False, "global_pool": "mean"}])
def test_logit_lens_ends_at_the_logits(changes):
    model = tiny_model(**changes).train()
    x = torch.randn(2, 3, 8, 12)
    capture = vx.capture(model, x)
    lens = analysis.logit_lens(model, capture)
    assert lens.shape == (2, 4, 5)
    assert torch.allclose(lens[:, -1], capture.logits, atol=1e-5)
    with torch.no_grad():
        first = model.forward_head(model.norm(capture.tokens[:, 0]))
    assert torch.allclose(lens[:, 0], first, atol=1e-5)
    assert model.training


def test_position_embedding_similarity_by_hand():
    model = tiny_model(image_size=(4, 8), embed_dim=4, num_heads=1)  # a 1x2 grid
    with torch.no_grad():
        model.pos_embed.copy_(torch.tensor([[[9.0, -9, 9, 1], [1, 0, 0, 0], [1, 1, 0, 0]]]))
    similarity = analysis.position_embedding_similarity(model)
    assert similarity.shape == (1, 2, 1, 2)
    diagonal_free = 1 / math.sqrt(2)
    assert torch.allclose(similarity[0, :, 0, :], torch.tensor([[1.0, diagonal_free],
                                                                [diagonal_free, 1.0]]))


@pytest.mark.parametrize("changes", [{"reg_tokens": 2}, {"no_embed_class": True, "reg_tokens": 1}])
def test_position_embedding_similarity_drops_prefix_tokens(changes):
    model = tiny_model(**changes)
    similarity = analysis.position_embedding_similarity(model)
    assert similarity.shape == (2, 3, 2, 3)
    flat = rearrange(similarity, "a b c d -> (a b) (c d)")
    assert torch.allclose(flat.diagonal(), torch.ones(6), atol=1e-6)
    assert torch.allclose(flat, flat.T, atol=1e-6)
    patches = model.pos_embed[0, -6:].detach()
    assert torch.allclose(flat[0, 5], torch.cosine_similarity(patches[0], patches[5], dim=0),
                          atol=1e-6)


def test_embedding_filters_recover_the_principal_directions():
    model = tiny_model(embed_dim=4, num_heads=1, image_size=(4, 4), patch_size=2)
    generator = torch.Generator().manual_seed(0)
    u, v = torch.linalg.qr(torch.randn(12, 2, generator=generator)).Q.T
    with torch.no_grad():
        kernels = torch.stack([3 * u, -3 * u, v, -v])
        model.patch_embed.proj.weight.copy_(rearrange(kernels, "d (c p q) -> d c p q", c=3, p=2))
    filters = analysis.embedding_filters(model, k=28)
    assert filters.shape == (4, 2, 2, 3)  # capped at D = 4
    assert float(filters.min()) >= 0 and float(filters.max()) <= 1
    for index, direction in enumerate([u, v]):
        direction = direction * torch.sign(direction[direction.abs().argmax()])
        image = rearrange(direction, "(c p q) -> p q c", c=3, p=2)
        expected = (image - image.min()) / (image.max() - image.min())
        assert torch.allclose(filters[index], expected, atol=1e-5)
    with pytest.raises(AnalysisError, match="k must be"):
        analysis.embedding_filters(model, k=0)


@pytest.mark.parametrize("patch_size", [8, 16, 2])
def test_embedding_filters_at_another_patch_size_are_the_resized_models(patch_size):
    """From the kernels at their own size (an enlarged patch: the Gram matrix in the resize's
    metric), the filters of the model PI-resized to that patch size."""
    model = tiny_model(embed_dim=24, num_heads=2, image_size=(16, 16), patch_size=4)
    generator = torch.Generator().manual_seed(0)
    u = torch.linalg.qr(torch.randn(24, 24, generator=generator)).Q
    v = torch.linalg.qr(torch.randn(48, 24, generator=generator)).Q
    with torch.no_grad():  # kernels whose spread falls off, so that each axis is well defined
        kernels = u @ torch.diag(torch.logspace(1, -1, 24)) @ v.T
        model.patch_embed.proj.weight.copy_(rearrange(kernels, "d (c p q) -> d c p q", c=3, p=4))
    resized = vx.resize_model(model, patch_size=patch_size)
    expected = analysis.embedding_filters(resized, k=6)
    torch.testing.assert_close(analysis.embedding_filters(model, k=6, patch_size=patch_size), expected, atol=1e-4, rtol=0)


def test_token_pca_colours_tokens_along_their_main_direction():
    direction = torch.tensor([0.0, 2.0, -1.0, 0.5])
    direction = direction / direction.norm()
    positions = torch.tensor([0.0, 1.0, 3.0, -2.0, 5.0, 4.0])
    tokens = positions[:, None] * direction + torch.tensor([1.0, 1.0, 1.0, 1.0])
    colours = analysis.token_pca(tokens, (2, 3), k=3)
    assert colours.shape == (2, 3, 3)
    expected = (positions - positions.min()) / (positions.max() - positions.min())
    assert torch.allclose(colours[..., 0], expected.reshape(2, 3), atol=1e-5)
    # Tokens on a line have no second or third component: mid-grey.
    assert torch.allclose(colours[..., 1:], torch.full((2, 3, 2), 0.5))


def test_token_pca_fits_one_pca_for_the_batch():
    tokens = torch.randn(2, 6, 8, generator=torch.Generator().manual_seed(0))
    batched = analysis.token_pca(tokens, (2, 3))
    assert batched.shape == (2, 2, 3, 3)
    stacked = analysis.token_pca(rearrange(tokens, "b p d -> (b p) d"), (4, 3))
    assert torch.allclose(batched, rearrange(stacked, "(b h) w k -> b h w k", b=2), atol=1e-5)
    assert float(batched.min()) == 0.0 and float(batched.max()) == 1.0
    with pytest.raises(AnalysisError, match="2x2 grid"):
        analysis.token_pca(tokens, (2, 2))
    with pytest.raises(AnalysisError, match="k must be in 1..8"):
        analysis.token_pca(tokens, (2, 3), k=9)


def test_randomized_principal_axes_are_the_full_svds():
    # 300 samples whose spread falls off along 64 features, as tokens' does: the leading axes agree.
    generator = torch.Generator().manual_seed(0)
    samples = torch.randn(300, 64, generator=generator) * torch.logspace(1, -1, 64)
    randomized = analysis.tokens.principal_axes(samples, 3, randomized=True)
    torch.testing.assert_close(randomized, analysis.tokens.principal_axes(samples, 3), atol=1e-4, rtol=0)
    # Samples on a plane: the third axis is zero, not rounding noise.
    plane = torch.randn(300, 2, generator=generator) @ torch.randn(2, 64, generator=generator)
    axes = analysis.tokens.principal_axes(plane, 3, randomized=True)
    assert axes[:2].norm(dim=1).allclose(torch.ones(2)) and torch.equal(axes[2], torch.zeros(64))


def test_principal_axes_of_fewer_samples_than_features_are_the_full_svds():
    """The patch-embedding kernels at a large patch size: the Gram matrix's axes, the SVD's, and
    zero past the samples' rank."""
    generator = torch.Generator().manual_seed(0)
    samples = torch.randn(40, 500, generator=generator) * torch.logspace(1, -1, 500)
    centred = samples - samples.mean(dim=0)
    vh = torch.linalg.svd(centred, full_matrices=False).Vh[:5]
    expected = vh * torch.where(vh.gather(1, vh.abs().argmax(dim=1, keepdim=True)) < 0, -1.0, 1.0)
    torch.testing.assert_close(analysis.tokens.principal_axes(samples, 5), expected, atol=1e-5, rtol=0)
    plane = torch.randn(40, 2, generator=generator) @ torch.randn(2, 500, generator=generator)
    axes = analysis.tokens.principal_axes(plane, 3)
    assert axes[:2].norm(dim=1).allclose(torch.ones(2)) and torch.equal(axes[2], torch.zeros(500))


def test_token_norms_and_top_k_by_hand():
    assert torch.equal(analysis.token_norms(torch.tensor([[3.0, 4.0], [0.0, 0.0]])),
                       torch.tensor([5.0, 0.0]))
    logits = torch.tensor([0.5, 0.3, 0.2]).log()
    ranked = analysis.top_k(logits, ["cat", "dog", "bird"], k=2)
    assert [name for name, _ in ranked] == ["cat", "dog"]
    assert [p for _, p in ranked] == pytest.approx([0.5, 0.3])
    batch = analysis.top_k(torch.stack([logits, logits.flip(0)]), k=5)
    assert [name for name, _ in batch[1]] == ["class 2", "class 1", "class 0"]
    with pytest.raises(AnalysisError, match="2 class names for 3 classes"):
        analysis.top_k(logits, ["cat", "dog"])


def test_denormalize_and_display_image_invert_preprocess():
    config = vx.ViTConfig(image_size=(4, 6), patch_size=2, mean=(0.5, 0.4, 0.3), std=(0.2, 0.25, 0.5))
    pixels = torch.randint(0, 256, (4, 6, 3), dtype=torch.uint8)
    from PIL import Image

    x = vx.preprocess(Image.fromarray(pixels.numpy()), config)
    assert (analysis.display_image(x, config) == pixels.numpy()).all()
    assert torch.allclose(analysis.denormalize(x, config)[0], pixels.permute(2, 0, 1) / 255, atol=1e-6)
    patches = rearrange(x, "b c (gh p) (gw q) -> b gh gw c p q", p=2, q=2)
    assert torch.allclose(
        analysis.denormalize(patches, config)[0, 1, 2], pixels[2:4, 4:6].permute(2, 0, 1) / 255,
        atol=1e-6,
    )
    with pytest.raises(AnalysisError, match="batch of 2"):
        analysis.display_image(torch.cat([x, x]), config)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_model_gives_the_cpu_results():
    model = tiny_model(reg_tokens=1)
    x = torch.randn(2, 3, 8, 12)
    expected_attribution = analysis.attribution(model, x, 1)
    expected_lens = analysis.logit_lens(model, vx.capture(model, x))
    model.cuda()
    assert torch.allclose(analysis.attribution(model, x, 1), expected_attribution, atol=1e-4)
    capture = vx.capture(model, x)
    assert torch.allclose(analysis.logit_lens(model, capture), expected_lens, atol=1e-4)
    rollout = analysis.attention_rollout(capture.attentions.cuda(), discard_ratio=0.5)
    assert rollout.is_cuda and torch.allclose(rollout.sum(-1), torch.ones(2, 8, device="cuda"))
    distance = analysis.mean_attention_distance(capture.attentions.cuda(), (2, 3), 4, 2)
    assert torch.allclose(distance.cpu(), analysis.mean_attention_distance(capture.attentions, (2, 3), 4, 2))


def test_the_analyses_read_a_half_precision_capture_as_they_read_a_full_one():
    model = tiny_model(depth=3)
    x = torch.randn(1, 3, 8, 12)
    full = vx.capture(model, x)
    half = vx.capture(model, x, attention_dtype=torch.float16)
    close = dict(atol=2e-3, rtol=2e-3)
    for query in (None, 2):
        maps = analysis.head_maps(half, 1, query)
        assert maps.dtype == torch.float32
        torch.testing.assert_close(maps, analysis.head_maps(full, 1, query), **close)
    torch.testing.assert_close(
        analysis.attention_rollout(half.attentions, num_prefix_tokens=1),
        analysis.attention_rollout(full.attentions, num_prefix_tokens=1), **close,
    )
    torch.testing.assert_close(
        analysis.attention_entropy(half.attentions), analysis.attention_entropy(full.attentions), **close
    )
    torch.testing.assert_close(
        analysis.mean_attention_distance(half.attentions, half.grid_size, 4, 1),
        analysis.mean_attention_distance(full.attentions, full.grid_size, 4, 1), **close,
    )


def test_attention_evenness_by_hand_and_the_near_uniform_threshold():
    uniform = torch.full((3, 4, 4), 0.25)
    assert analysis.attention_evenness(uniform) == pytest.approx(1.0)
    one_hot = torch.eye(4).expand(3, 4, 4)
    assert analysis.attention_evenness(one_hot) == pytest.approx(0.0)
    # Rows (1/2, 1/2, 0, 0) and one-hot: mean entropy log(2) / 2 over log 4 = 1/4.
    rows = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0]], dtype=torch.float16)
    assert analysis.attention_evenness(rows) == pytest.approx(0.25)
    assert analysis.attention_evenness(torch.ones(2, 1)) == 0.0  # one key: nothing to spread over
    assert analysis.near_uniform(analysis.attention_evenness(uniform))
    assert not analysis.near_uniform(0.94) and analysis.near_uniform(0.95)
    # A randomly initialised model attends almost uniformly.
    capture = vx.capture(vx.ViT(vx.ViTConfig(image_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=4)),
                         torch.randn(1, 3, 16, 16))
    assert analysis.near_uniform(analysis.attention_evenness(capture.attentions[0]))


@pytest.mark.parametrize("classes, top, guess", [
    (1000, 0.006, True),  # a random ViT-B/16 on ImageNet's classes: "class 970 with probability 0.6%"
    (1000, 0.02, False),
    (6, 0.177, True),  # a random shapes model: 1/6 is 16.7%
    (6, 0.605, False),  # the shipped shapes model on its first sample, which it gets right
    (10, 0.19, True),
    (10, 0.21, False),  # twice chance for 10 classes
    (1, 1.0, False),
])
def test_near_chance_is_within_a_factor_of_chance_that_grows_with_the_classes(classes, top, guess):
    rest = (1 - top) / max(classes - 1, 1)
    probabilities = torch.tensor([top] + [rest] * (classes - 1))
    assert analysis.near_chance(probabilities) is guess


def test_attention_evenness_in_chunks_equals_the_whole_at_once():
    rows = torch.softmax(torch.randn(70, 2**16, generator=torch.Generator().manual_seed(0)) * 3, dim=-1)
    entropy = -(rows * rows.clamp_min(torch.finfo(torch.float32).tiny).log()).sum(dim=-1)
    expected = float(entropy.mean()) / math.log(2**16)  # 64 rows a chunk: two chunks
    assert analysis.attention_evenness(rows) == pytest.approx(expected, rel=1e-5)
