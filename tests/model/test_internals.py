"""Inside a layer: the intermediates recorded by capture(internals=layer) and layer_internals
recompose the block exactly, match capture's attention, and exploring them changes nothing."""
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import vit_explorer as vx
from vit_explorer.model import internals as inside
from vit_explorer.model.capture import layer_internals

from helpers import randomize, tiny_config

FAMILIES = {
    "class token": dict(),
    "registers, distillation token, LayerScale": dict(reg_tokens=2, dist_token=True, init_values=0.1),
    "mean pool": dict(class_token=False, global_pool="mean"),
    "MAP head": dict(class_token=False, global_pool="map"),
}


def family_model(changes: dict) -> vx.ViT:
    return randomize(vx.ViT(tiny_config(depth=3, **changes)))


def images() -> torch.Tensor:
    return torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(3))


def own_block_output(model: vx.ViT, x: torch.Tensor, layer: int) -> torch.Tensor:
    """The block's output in a plain forward pass (the fused attention path, no recorder)."""
    outputs = []
    handle = model.blocks[layer].register_forward_hook(lambda module, args, output: outputs.append(output))
    try:
        with torch.no_grad():
            model(x)
    finally:
        handle.remove()
    return outputs[0]


def recompose(block, steps: inside.LayerInternals) -> torch.Tensor:
    """The block from its recorded steps and its weights, written out by hand for every token;
    each recorded step is checked against the one recomposed from the previous steps."""
    close = dict(atol=1e-5, rtol=1e-5)
    x = steps.input
    dim, heads, head_dim = x.shape[-1], steps.num_heads, steps.head_dim
    mean = x.mean(-1, keepdim=True)
    std = torch.sqrt(x.var(-1, unbiased=False, keepdim=True) + steps.norm_eps)
    normed = (x - mean) / std * block.norm1.weight + block.norm1.bias
    torch.testing.assert_close(steps.norm1, normed, **close)
    qkv = normed @ block.attn.qkv.weight.T + block.attn.qkv.bias  # (B, N, 3D)
    q, k, v = (part.unflatten(-1, (heads, head_dim)).transpose(1, 2) for part in qkv.split(dim, -1))
    for name, value in (("q", q), ("k", k), ("v", v)):
        torch.testing.assert_close(getattr(steps, name), value, **close)
    scores = q @ k.transpose(-2, -1) / math.sqrt(head_dim)
    torch.testing.assert_close(steps.scores, scores, **close)
    attention = scores.exp() / scores.exp().sum(-1, keepdim=True)
    torch.testing.assert_close(steps.attention, attention, **close)
    head_outputs = attention @ v  # (B, nh, N, hd): sum_j a_j v_j
    torch.testing.assert_close(steps.heads, head_outputs, **close)
    concatenated = head_outputs.transpose(1, 2).flatten(2)
    torch.testing.assert_close(steps.concatenated, concatenated, **close)
    projected = concatenated @ block.attn.proj.weight.T + block.attn.proj.bias
    torch.testing.assert_close(steps.attn_out, projected, **close)
    gamma1 = block.ls1.gamma if hasattr(block.ls1, "gamma") else 1.0
    middle = x + gamma1 * projected
    torch.testing.assert_close(steps.middle, middle, **close)
    torch.testing.assert_close(steps.attention_branch, gamma1 * projected, **close)
    normed2 = F.layer_norm(middle, (dim,), block.norm2.weight, block.norm2.bias, steps.norm_eps)
    torch.testing.assert_close(steps.norm2, normed2, **close)
    pre = normed2 @ block.mlp.fc1.weight.T + block.mlp.fc1.bias
    hidden = 0.5 * pre * (1 + torch.erf(pre / math.sqrt(2)))  # the exact GELU
    torch.testing.assert_close(steps.mlp_hidden, hidden, **close)
    mlp_out = hidden @ block.mlp.fc2.weight.T + block.mlp.fc2.bias
    torch.testing.assert_close(steps.mlp_out, mlp_out, **close)
    gamma2 = block.ls2.gamma if hasattr(block.ls2, "gamma") else 1.0
    output = middle + gamma2 * mlp_out
    torch.testing.assert_close(steps.output, output, **close)
    return output


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("layer", [0, 2])
def test_the_recorded_steps_recompose_the_models_own_next_layer_tokens(family, layer):
    model = family_model(FAMILIES[family])
    x = images()
    cap = vx.capture(model, x, internals=layer)
    steps = cap.internals
    assert steps.layer == layer and steps.num_tokens == model.config.num_tokens
    assert (steps.layer_scale1 is not None) == ("init_values" in FAMILIES[family])
    # The layer asked for, not another one's steps written over it.
    torch.testing.assert_close(steps.input, cap.tokens[:, layer], atol=0, rtol=0)
    with torch.no_grad():
        recomposed = recompose(model.blocks[layer], steps)
    torch.testing.assert_close(recomposed, own_block_output(model, x, layer), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(recomposed, cap.tokens[:, layer + 1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_one_block_from_the_captured_tokens_gives_the_same_pass(family):
    model = family_model(FAMILIES[family])
    x = images()
    cap = vx.capture(model, x, internals=-1)
    alone = layer_internals(model, cap.tokens[:, 2], 2)
    assert cap.internals.layer == alone.layer == 2
    for name in ("norm1", "q", "k", "v", "scores", "attention", "heads", "attn_out", "mlp_hidden", "output"):
        torch.testing.assert_close(getattr(alone, name), getattr(cap.internals, name), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(alone.output, cap.tokens[:, 3], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_steps_of_some_query_tokens_are_their_rows_of_the_whole_block(family):
    model = family_model(FAMILIES[family])
    cap = vx.capture(model, images())
    whole = layer_internals(model, cap.tokens[:, 1], 1)
    queries = [model.config.num_tokens - 1, 0, 5]
    some = layer_internals(model, cap.tokens[:, 1], 1, queries=queries)
    assert some.queries == tuple(queries) and some.num_tokens == whole.num_tokens
    assert (some.layer_scale1 is None) == (whole.layer_scale1 is None)
    for name in ("k", "v"):  # every token's: what the queries attend over
        torch.testing.assert_close(getattr(some, name), getattr(whole, name), atol=1e-6, rtol=1e-6)
    for name in ("input", "norm1", "attn_out", "middle", "norm2", "mlp_hidden", "mlp_out", "output",
                 "concatenated", "attention_branch", "mlp_branch"):
        torch.testing.assert_close(getattr(some, name), getattr(whole, name)[:, queries], atol=1e-6, rtol=1e-6)
    for name in ("q", "scores", "attention", "heads"):
        torch.testing.assert_close(getattr(some, name), getattr(whole, name)[:, :, queries], atol=1e-6, rtol=1e-6)
    for token in queries:
        assert some.row(token) == queries.index(token) and whole.row(token) == token
        np.testing.assert_allclose(inside.rescaled_attention(some, 2, token, 0.3),
                                   inside.rescaled_attention(whole, 2, token, 0.3), atol=1e-6)
        for mine, theirs in zip(inside.head_output_sources(some, 1, token), inside.head_output_sources(whole, 1, token)):
            assert mine["token"] == theirs["token"] and mine["share"] == pytest.approx(theirs["share"], abs=1e-6)
    with pytest.raises(ValueError, match="not token 1"):
        some.row(1)
    with pytest.raises(ValueError, match="queries must be some of the"):
        layer_internals(model, cap.tokens[:, 1], 1, queries=[model.config.num_tokens])


def test_the_softmax_row_is_captures_attention_for_every_head_and_query():
    model = family_model(FAMILIES["registers, distillation token, LayerScale"])
    x = images()
    cap = vx.capture(model, x)  # float32 attention of every layer, as a notebook gets it
    for layer in range(model.config.depth):
        steps = layer_internals(model, cap.tokens[:, layer], layer)
        torch.testing.assert_close(steps.attention, cap.attentions[:, layer], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(steps.attention.sum(-1), torch.ones(2, 4, steps.num_tokens))
    half = vx.capture(model, x, attention_dtype=torch.float16, internals=1)  # the app's capture
    assert half.internals.attention.dtype == torch.float32
    torch.testing.assert_close(half.internals.attention.half(), half.attentions[:, 1], atol=1e-3, rtol=0)


def test_a_capture_without_internals_keeps_none_and_its_numbers_are_unchanged():
    model = family_model({})
    x = images()
    plain, opened = vx.capture(model, x), vx.capture(model, x, internals=1)
    assert plain.internals is None
    torch.testing.assert_close(opened.logits, plain.logits, atol=0, rtol=0)
    torch.testing.assert_close(opened.tokens, plain.tokens, atol=0, rtol=0)
    with pytest.raises(ValueError, match="layers 0..2"):
        vx.capture(model, x, internals=3)


def test_the_scale_control_changes_nothing_but_its_own_softmax():
    model = family_model({})
    x = images()
    with torch.no_grad():
        before = model(x)
    weights = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    steps = vx.capture(model, x, internals=1).internals
    recorded = {name: getattr(steps, name).clone() for name in ("q", "k", "scores", "attention")}
    head, token = 2, 5
    own = inside.rescaled_attention(steps, head, token, steps.scale)
    torch.testing.assert_close(own, steps.attention[0, head, token], atol=1e-6, rtol=1e-6)
    sweep = inside.scale_sweep(steps, head, token, inside.SCALE_FACTORS)
    # A larger scale sharpens the softmax: lower entropy, a larger top weight.
    assert sweep["entropy"] == sorted(sweep["entropy"], reverse=True)
    assert sweep["largest weight"] == sorted(sweep["largest weight"])
    flat = inside.rescaled_attention(steps, head, token, 0.0)
    torch.testing.assert_close(flat, torch.full_like(flat, 1 / steps.num_tokens))
    with torch.no_grad():
        assert torch.equal(model(x), before)  # bitwise
    assert all(torch.equal(tensor, weights[name]) for name, tensor in model.state_dict().items())
    assert all(torch.equal(getattr(steps, name), value) for name, value in recorded.items())
    assert steps.scale == pytest.approx(1 / math.sqrt(steps.head_dim))


def test_head_output_sources_decompose_the_heads_output():
    steps = vx.capture(family_model({}), images(), internals=0).internals
    head, token = 1, 7
    sources = inside.head_output_sources(steps, head, token, top=steps.num_tokens)
    assert len(sources) == steps.num_tokens
    assert sum(source["share"] for source in sources) == pytest.approx(1.0, abs=1e-9)
    assert sum(source["weight"] for source in sources) == pytest.approx(1.0, abs=1e-5)
    shares = [source["share"] for source in sources]
    assert shares == sorted(shares, reverse=True)
    rebuilt = sum(source["weight"] * steps.v[0, head, source["token"]].double() for source in sources)
    torch.testing.assert_close(rebuilt.float(), steps.heads[0, head, token], atol=1e-5, rtol=1e-5)


def test_layer_norm_residual_and_mlp_summaries():
    steps = vx.capture(family_model({}), images(), internals=0).internals
    token = 3
    mean, std = inside.layer_norm_statistics(steps.input[0, token], steps.norm_eps)
    # With unit gain and zero shift LayerNorm would give exactly (x - mean) / std.
    assert mean == pytest.approx(float(steps.input[0, token].mean()), abs=1e-6)
    standardised = (steps.input[0, token].double() - mean) / std
    assert float(standardised.std(unbiased=False)) == pytest.approx(1.0, abs=1e-3)
    change = inside.residual_change(steps.input[0, token], steps.attention_branch[0, token], steps.middle[0, token])
    assert change["norm after"] == pytest.approx(float(steps.middle[0, token].norm()), rel=1e-6)
    assert -1.0 <= change["cosine before/after"] <= 1.0
    activity = inside.mlp_activity(steps.mlp_hidden[0, token])
    assert activity["units"] == steps.mlp_hidden.shape[-1]
    assert activity["firing"] + activity["near zero"] <= activity["units"]
    assert torch.all(activity["sorted"][:-1] >= activity["sorted"][1:])
    torch.testing.assert_close(steps.mlp_hidden[0, token][activity["units by activation"]].double(), activity["sorted"])
    assert activity["near zero"] == int((steps.mlp_hidden[0, token].abs() < inside.NEAR_ZERO).sum())


def test_the_figures_draw_the_recorded_numbers():
    from vit_explorer import figures

    model = family_model(FAMILIES["registers, distillation token, LayerScale"])
    cap = vx.capture(model, images()[:1], internals=1)
    steps, prefix = cap.internals, model.config.num_prefix_tokens
    labels = figures.token_labels(cap.num_tokens, prefix, class_token=True, dist_token=True)
    image = torch.rand(16, 16, 3)
    head, patch = 3, 5
    token = prefix + patch
    figs = {
        **figures.inside_layer_figures(image, steps, cap.grid_size, labels, head, token, patch, "GELU"),
        **figures.softmax_scale_figures(image, steps, cap.grid_size, labels, head, token, 2.0, patch),
    }
    assert all(fig.layout.title.text.strip() for fig in figs.values())
    attention = figs["attention"]
    (grid,) = [trace for trace in attention.data if trace.type == "heatmap"]
    (bars,) = [trace for trace in attention.data if trace.type == "bar"]
    row = steps.attention[0, head, token].numpy()
    np.testing.assert_allclose(np.asarray(grid.z).reshape(-1), row[prefix:])
    np.testing.assert_allclose(bars.y, row[:prefix])
    assert list(bars.x) == ["CLS", "DIST", "reg 1", "reg 2"]
    strips = figs["heads_projection"]
    assert len(strips.layout.shapes) == steps.num_heads - 1  # a line between heads
    np.testing.assert_allclose(np.asarray(strips.data[0].z)[1], steps.attn_out[0, token].numpy())
    with pytest.raises(ValueError, match="do not fit"):
        figures.token_values_on_grid(image, row[1:], cap.grid_size, prefix, labels[:prefix], "t", "attention")
