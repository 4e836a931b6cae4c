"""Attention computed a layer at a time from a capture's tokens (what the app and inspect keep
instead of every layer's (B, L, H, N, N)), and the analyses over all layers streamed from it:
both equal what the full capture gives."""
import pytest
import torch

import vit_explorer as vx
from vit_explorer import analysis
from vit_explorer.model.capture import layer_attention, layer_attentions

from helpers import VARIANTS, randomize, tiny_config
from rotary import ROTARY, TINY, rotary_model

MODELS = {
    **{name: dict(changes) for name, changes in VARIANTS.items() if name in ("cls token", "registers", "mean pool, no class token")},
    **{f"rotary {name}": None for name in ROTARY},
}


def model_and_images(name: str) -> tuple[vx.ViT, torch.Tensor]:
    if name.startswith("rotary "):
        model = rotary_model(name.removeprefix("rotary "))
    else:
        model = randomize(vx.ViT(tiny_config(**MODELS[name])))
        with torch.no_grad():
            for block in model.blocks:  # peaked attention, so that a wrong layer or row shows
                block.attn.qkv.weight.mul_(4)
    height, width = model.config.img_size
    x = torch.randn(2, 3, height, width, generator=torch.Generator().manual_seed(1))
    return model, x


@pytest.mark.parametrize("name", list(MODELS))
def test_a_layer_computed_from_the_tokens_equals_the_full_capture(name):
    model, x = model_and_images(name)
    full = vx.capture(model, x)
    tokens_only = vx.capture(model, x, layers=())
    assert tokens_only.attentions.shape == (2, 0, *full.attentions.shape[2:])
    # The fused path of the layers not recorded rounds differently, no more.
    torch.testing.assert_close(tokens_only.tokens, full.tokens, rtol=1e-5, atol=1e-5)
    for layer in range(model.config.depth):
        computed = layer_attention(model, full.tokens[:, layer], layer, full.grid_size)
        assert computed.dtype == torch.float32
        torch.testing.assert_close(computed, full.attentions[:, layer], rtol=0, atol=1e-6)
        half = layer_attention(model, tokens_only.tokens[:, layer], layer, tokens_only.grid_size, torch.float16)
        assert half.dtype == torch.float16
        assert (half.float() - full.attentions[:, layer]).abs().max() < 1e-3
    streamed = list(layer_attentions(model, tokens_only))
    torch.testing.assert_close(torch.stack(streamed, dim=1), full.attentions, rtol=0, atol=1e-5)


@pytest.mark.parametrize("sharpness", [1.0, 50.0])  # as the model has it, and near one-hot rows
@pytest.mark.parametrize("name", ["registers", f"rotary {next(iter(ROTARY))}"])
def test_a_layer_s_entropies_from_its_scores_equal_those_of_its_weights(name, sharpness):
    model, x = model_and_images(name)
    captured = vx.capture(model, x, layers=())
    with torch.no_grad():
        for block in model.blocks:
            block.attn.scale *= sharpness
    for layer in range(model.config.depth):
        entropies = torch.full((2, model.config.num_heads), float("nan"))
        attention = layer_attention(model, captured.tokens[:, layer], layer, captured.grid_size, entropies=entropies)
        torch.testing.assert_close(entropies, analysis.head_entropies(attention), rtol=0, atol=1e-5)
    assert 0 < entropies.min() and (sharpness == 1.0) == (entropies.min() > 0.5)


def test_layer_attentions_takes_the_layers_a_capture_kept_and_computes_the_rest():
    model, x = model_and_images("cls token")
    full = vx.capture(model, x)
    some = vx.capture(model, x, layers=[1])
    assert some.layers == (1,)
    streamed = list(layer_attentions(model, some, torch.float16))
    assert [attention.dtype for attention in streamed] == [torch.float16] * model.config.depth
    assert torch.equal(streamed[1], some.attentions[:, 0].half())
    assert all((attention.float() - full.attentions[:, layer]).abs().max() < 1e-3 for layer, attention in enumerate(streamed))


@pytest.mark.parametrize("family", list(ROTARY))
def test_a_rotary_layer_rotates_on_the_grid_it_is_given(family):
    model = randomize(vx.ViT(vx.ViTConfig(**{**TINY, "image_size": (32, 32)}, **ROTARY[family])))
    x = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    full = vx.capture(model, x)
    assert full.grid_size == (8, 8)
    computed = layer_attention(model, full.tokens[:, 1], 1, full.grid_size)
    torch.testing.assert_close(computed, full.attentions[:, 1], rtol=0, atol=1e-6)
    elsewhere = layer_attention(model, full.tokens[:, 1], 1, (4, 16))  # the same tokens placed on another grid
    assert (elsewhere - full.attentions[:, 1]).abs().max() > 1e-3


def test_knocked_out_tokens_give_the_knocked_out_capture_attention():
    model, x = model_and_images("registers")
    knock_out = vx.KnockOut(heads={0: (1,)}, mlp=(0,))
    knocked = vx.capture(model, x, knock_out=knock_out)
    intact = vx.capture(model, x, layers=())
    tokens_only = vx.capture(model, x, layers=(), knock_out=knock_out, intact=intact)
    torch.testing.assert_close(tokens_only.tokens, knocked.tokens, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.stack(list(layer_attentions(model, tokens_only)), dim=1), knocked.attentions,
                               rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("fusion, discard", [("mean", 0.0), ("max", 0.5), ("min", 0.2)])
def test_streamed_rollout_equals_rollout_of_the_whole_capture(name, fusion, discard):
    model, x = model_and_images(name)
    full = vx.capture(model, x)
    prefix = full.num_prefix_tokens
    expected = analysis.attention_rollout(full.attentions, fusion, discard, num_prefix_tokens=prefix)
    streamed = analysis.streamed_rollout(
        layer_attentions(model, vx.capture(model, x, layers=())), fusion, discard, num_prefix_tokens=prefix,
    )
    torch.testing.assert_close(streamed, expected, rtol=0, atol=1e-5)
    # Rows of it (the class token's, the patch queries' mean, any weights) carried from the last layer down.
    tokens = expected.shape[-1]
    queries = torch.zeros(x.shape[0], 3, tokens)
    queries[:, 0, 0] = 1.0
    queries[:, 1, prefix:] = 1.0 / (tokens - prefix)
    queries[:, 2] = torch.rand(x.shape[0], tokens, generator=torch.Generator().manual_seed(0))
    rows = analysis.rollout_rows(
        layer_attentions(model, vx.capture(model, x, layers=())), queries, fusion, discard, num_prefix_tokens=prefix,
    )
    torch.testing.assert_close(rows, queries @ expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("changes", [{}, dict(class_token=False, global_pool="mean"), dict(reg_tokens=2),
                                     dict(reg_tokens=2, class_token=False, global_pool="map")])
def test_the_map_query_reads_the_row_the_maps_read(changes):
    """map_query(c) @ matrix: the class token's row, the patch queries' mean, or the attention
    pool's probe over the patches, as query_map and pool_rollout_map read them."""
    model = randomize(vx.ViT(tiny_config(**changes)))
    captured = vx.capture(model, torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(0)))
    prefix, grid = captured.num_prefix_tokens, captured.grid_size
    rollout = analysis.attention_rollout(captured.attentions, num_prefix_tokens=prefix)
    rows = analysis.map_query(captured, class_token=model.config.class_token) @ rollout  # (2, 1, N)
    if captured.pool_attentions is not None:
        expected = analysis.pool_rollout_map(captured.pool_attentions, rollout, grid, prefix)
    else:
        expected = analysis.query_map(rollout, grid, prefix, class_token=model.config.class_token)
    torch.testing.assert_close(rows[:, 0, prefix:].reshape(2, *grid), expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize("name", list(MODELS))
def test_distance_and_entropy_a_layer_at_a_time_equal_the_whole_capture(name):
    model, x = model_and_images(name)
    full = vx.capture(model, x)
    config = model.config
    distance = analysis.mean_attention_distance(full.attentions, full.grid_size, config.patch_size, full.num_prefix_tokens)
    entropy = analysis.attention_entropy(full.attentions)  # (B, L, H)
    layers = list(layer_attentions(model, vx.capture(model, x, layers=())))
    streamed_distance = torch.stack([
        analysis.head_distances(attention, full.grid_size, config.patch_size, full.num_prefix_tokens) for attention in layers
    ])
    streamed_entropy = torch.stack([analysis.head_entropies(attention) for attention in layers], dim=1)
    torch.testing.assert_close(streamed_distance, distance, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(streamed_entropy, entropy, rtol=1e-5, atol=1e-5)
    # What the app reads: the layers a capture kept as they are, the others computed again.
    for kept in ((), (1,)):
        done = []
        distances, entropies = analysis.captured_head_statistics(model, vx.capture(model, x, layers=kept), done.append)
        assert done == list(range(config.depth))
        torch.testing.assert_close(distances, distance, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(entropies, entropy[0], rtol=1e-5, atol=1e-5)
    assert analysis.entropy_evenness(entropy[0], full.num_tokens) == pytest.approx(
        analysis.attention_evenness(full.attentions[0]), rel=1e-5,
    )


def test_streamed_rollout_refuses_before_computing_anything():
    computed = []

    def layers():
        computed.append(1)
        yield torch.full((1, 2, 3, 3), 1 / 3)

    with pytest.raises(analysis.AnalysisError, match="head_fusion"):
        analysis.streamed_rollout(layers(), "median")
    with pytest.raises(analysis.AnalysisError, match="discard_ratio"):
        analysis.streamed_rollout(layers(), discard_ratio=1.0)
    with pytest.raises(analysis.AnalysisError, match="head_fusion"):
        analysis.rollout_rows(layers(), torch.ones(1, 1, 3), "median")
    assert computed == []
    with pytest.raises(analysis.AnalysisError, match="at least one layer"):
        analysis.streamed_rollout(iter(()))
