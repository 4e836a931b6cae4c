"""Registers at test time (vit_explorer.analysis.test_time_registers), on a model built to have outliers.

Random weights have none, so the tiny model here gets a register neuron planted in layer 1: one
MLP unit that fires on the uniform-colour patches of the pictures and writes a large vector into
them, and, in the layers after it, a head that reads that vector (an attention sink, as trained
ViTs grow one on their outliers). The search must find that unit, and the register must take
both the norm and the attention away from those patches."""
import copy
import threading

import pytest
import torch

import vit_explorer as vx
from vit_explorer.analysis import test_time_registers as ttr
from vit_explorer.analysis import AnalysisError
from vit_explorer.analysis.image_set import norm_outliers
from helpers import randomize, tiny_config

LAYER, UNIT = 1, 7  # the planted register neuron
SINK_LAYERS, SINK_HEAD = (2, 3), 0
COLOUR = torch.tensor([1.5, -0.5, 0.8])  # the background's colour, normalized
GRID = 8


def picture(seed: int, background: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    """(1, 3, 32, 32) noise with ``background`` patches of one uniform colour, and those patches
    (1, 8, 8) bool."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 3, 32, 32, generator=generator)
    fire = torch.zeros(1, GRID * GRID, dtype=torch.bool)
    fire[0, torch.randperm(GRID * GRID, generator=generator)[:background]] = True
    for patch in fire[0].nonzero().flatten().tolist():
        row, col = divmod(patch, GRID)
        x[0, :, row * 4 : (row + 1) * 4, col * 4 : (col + 1) * 4] = COLOUR[:, None, None]
    return x, fire.reshape(1, GRID, GRID)


def plant_sinks(model: vx.ViT, images: torch.Tensor, fire: torch.Tensor) -> vx.ViT:
    """``model`` with head SINK_HEAD of SINK_LAYERS made to look at the planted outliers: its
    query is one constant direction, its key reads how far a token's normed state lies along the
    outliers' (their mean minus the other tokens', in the intact pass), scaled so that every
    outlier's score is 8 above every other token's."""
    captured = vx.capture(model, images)
    at = torch.zeros(captured.tokens.shape[0], captured.tokens.shape[2], dtype=torch.bool)
    at[:, 1:] = fire.flatten(1)
    dim, head_dim = model.config.embed_dim, model.config.head_dim
    rows = slice(SINK_HEAD * head_dim, (SINK_HEAD + 1) * head_dim)
    with torch.no_grad():
        for layer in SINK_LAYERS:
            block = model.blocks[layer]
            normed = block.norm1(captured.tokens[:, layer])
            axis = normed[at].mean(0) - normed[~at].mean(0)
            axis = axis / axis.norm()
            gap = float((normed[at] @ axis).min() - (normed[~at] @ axis).max())
            assert gap > 0
            weight, bias = block.attn.qkv.weight, block.attn.qkv.bias
            weight[rows] = 0.0
            bias[rows] = 0.0
            bias[SINK_HEAD * head_dim] = 4.0  # every query: along the first channel of the head
            weight[dim:][rows] = 0.0
            bias[dim:][rows] = 0.0
            weight[dim + SINK_HEAD * head_dim] = 8 / (4.0 * block.attn.scale * gap) * axis
    return model


@pytest.fixture(scope="module")
def planted():
    """The tiny model with the register neuron and the sinks, planted on one picture."""
    model = randomize(vx.ViT(tiny_config(image_size=32, depth=4)))
    x, fire = picture(1)
    model = ttr.plant_register_neuron(model, x, fire, LAYER, UNIT)
    return plant_sinks(model, x, fire).eval()


@pytest.fixture(scope="module")
def others():
    """Two pictures the neuron was not planted on, and their uniform patches."""
    (a, fire_a), (b, fire_b) = picture(2), picture(3, background=14)
    return torch.cat([a, b]), torch.cat([fire_a, fire_b])


def patch_norms(captured: vx.Capture) -> torch.Tensor:
    """(B, depth + 1, P) every patch token's norm."""
    return captured.tokens[:, :, captured.num_prefix_tokens :].norm(dim=-1)


def test_the_search_finds_the_planted_unit_on_pictures_it_was_not_planted_on(planted, others):
    x, fire = others
    found = ttr.find_register_neurons(planted, vx.capture(planted, x))
    assert torch.equal(found.outliers.outliers, fire.flatten(1))  # the outliers are the uniform patches
    assert found.layer == 3 and found.appears_at == LAYER and found.images == 2
    best, second = found.top(2)
    assert best[:2] == (LAYER, UNIT) and best[2] > 5 * second[2]
    # Their score, by hand: the unit's mean |activation| on each picture's outliers, averaged.
    hidden = torch.stack([
        ttr.mlp_activations(planted, vx.capture(planted, x[i : i + 1]).tokens[:, LAYER], LAYER)[0, 1:, UNIT]
        for i in range(2)
    ])  # (2, P)
    expected = torch.stack([hidden[i][fire[i].flatten()].abs().mean() for i in range(2)]).mean()
    assert best[2] == pytest.approx(float(expected), rel=1e-5)
    # Images instead of a capture: the same search.
    assert torch.allclose(ttr.find_register_neurons(planted, x).scores, found.scores)
    assert found.register(1) == ttr.TestTimeRegister({LAYER: [UNIT]})


def test_the_layers_searched_and_the_images_without_outliers(planted, others):
    x, fire = others
    plain = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(9))  # no uniform patch
    found = ttr.find_register_neurons(planted, torch.cat([x[:1], plain]))
    assert found.images == 1 and not found.outliers.outliers[1].any()
    alone = ttr.find_register_neurons(planted, x[:1])
    assert torch.allclose(found.scores, alone.scores)  # the image without outliers is skipped, as theirs
    assert found.scores.shape[0] == LAYER + 1  # by default, the layers up to where they appear
    with pytest.raises(ValueError, match="^Layer 3 was not searched"):
        found.top(5, first=2, last=3)
    deeper = ttr.find_register_neurons(planted, torch.cat([x[:1], plain]), last=3)
    assert torch.equal(deeper.scores[: LAYER + 1], found.scores)
    later = deeper.top(5, first=2, last=3)
    assert len(later) == 5 and all(layer in (2, 3) for layer, _, _ in later)


def test_a_model_without_outliers_says_so():
    model = randomize(vx.ViT(tiny_config(image_size=32, depth=4)))
    x, _ = picture(2)
    with pytest.raises(AnalysisError, match="^No patch token stands out after layer 3 .*no outliers for register"):
        ttr.find_register_neurons(model, x)


def test_the_register_takes_the_norm_away_from_the_outliers(planted, others):
    x, fire = others
    intact = vx.capture(planted, x)
    register = ttr.TestTimeRegister({LAYER: [UNIT]})
    moved = ttr.register_capture(planted, x, register)
    assert moved.register_token == 1 and moved.num_prefix_tokens == 2 and intact.num_prefix_tokens == 1
    assert moved.tokens.shape[2] == intact.tokens.shape[2] + 1
    before, after = patch_norms(intact), patch_norms(moved)  # (B, L + 1, P)
    at = fire.flatten(1)[:, None].expand_as(before)
    for layer in range(LAYER + 1, 5):
        others_before = before[:, layer][~at[:, layer]]
        assert before[:, layer][at[:, layer]].min() > 10 * others_before.max()  # outliers, intact
        # With the register, those patches are as any other: no norm beyond the others' largest.
        assert after[:, layer].max() < 1.2 * after[:, layer][~at[:, layer]].max()
        assert (moved.tokens[:, layer, 1].norm(dim=-1) > 150).all()  # the register holds the vector
    assert not has_outliers(moved)


def has_outliers(captured: vx.Capture) -> bool:
    """Whether a capture's patches have outliers after the last layer, by the search's rule."""
    return bool(norm_outliers(captured.tokens[:, -1, captured.num_prefix_tokens :], 6.0).outliers.any())


def test_the_attention_the_outliers_drew_moves_to_the_register(planted, others):
    x, fire = others
    intact = vx.capture(planted, x)
    moved = ttr.register_capture(planted, x, ttr.TestTimeRegister({LAYER: [UNIT]}))
    at = fire.flatten(1)
    for layer in SINK_LAYERS:
        drawn = intact.attentions[:, layer, SINK_HEAD, 0, 1:]  # (B, P) the class token's row
        after = moved.attentions[:, layer, SINK_HEAD, 0]  # (B, N + 1)
        on_outliers = (drawn * at).sum(-1)
        assert (on_outliers > 0.9).all()  # the sink head looks at the outliers, intact
        assert ((after[:, 2:] * at).sum(-1) < 0.05).all()  # not any more
        torch.testing.assert_close(after[:, 1], on_outliers, atol=0.05, rtol=0)  # the register took it
    # The other heads' attention barely moves.
    other = [head for head in range(4) if head != SINK_HEAD]
    assert (moved.attentions[:, 2:, other, 0, 1] < 0.1).all()


def their_register_pass(model: vx.ViT, x: torch.Tensor, neurons: dict[int, list[int]]) -> torch.Tensor:
    """Their recipe as their code runs it: a copy of the model hooked on each register layer's MLP
    activation (shared/hook_fn.py activate_on_registers, zero, scale 1) and a token of zeros
    appended last after the positions (their prepare_tokens_with_masks), for each image; with
    rotary positions, the register turned by angle 0 (the tables' last row: sin 0, cos 1).
    The tokens leaving the last block, (B, N + 1, D), the register last."""
    copied = copy.deepcopy(model)

    def activate_on_registers(units, module, inputs, output):
        chosen = output[0, :, units]
        top, bottom = chosen.max(), chosen.min()
        output[0, -1:, units] = top if abs(top) > abs(bottom) else bottom
        output[0, copied.num_prefix_tokens : -1, units] = 0

    for layer, units in neurons.items():
        copied.blocks[layer].mlp.act.register_forward_hook(
            lambda module, inputs, output, units=units: activate_on_registers(units, module, inputs, output)
        )
    rope = copied.rope_tables()
    if rope is not None:
        sin, cos = rope
        rope = (torch.cat([sin, torch.zeros_like(sin[:1])]), torch.cat([cos, torch.ones_like(cos[:1])]))
    outputs = []
    with torch.no_grad():
        for image in x:
            tokens = copied._pos_embed(copied.patch_embed(image[None]))
            tokens = copied.norm_pre(torch.cat([tokens, torch.zeros_like(tokens[:, :1])], dim=1))
            for block in copied.blocks:
                tokens = block(tokens, rope)
            outputs.append(tokens[0])
    return torch.stack(outputs)


@pytest.mark.parametrize("changes", [
    {}, dict(class_token=False, global_pool="mean"), dict(reg_tokens=2, no_embed_class=True),
    dict(abs_pos_embed=False, rope_type="dinov3", reg_tokens=1), dict(pre_norm=True, act_layer="quick_gelu"),
])
def test_the_register_pass_is_their_recipe_by_hand(changes):
    """Several neurons over two layers (the sign-max taken over all of a layer's neurons), on learned
    or rotary positions, with or without prefix tokens: the same numbers as their hooks."""
    model = randomize(vx.ViT(tiny_config(image_size=32, depth=3, **changes)))
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(4))
    neurons = {0: [3, 17, 40], 2: [5]}
    moved = ttr.register_capture(model, x, ttr.TestTimeRegister(neurons))
    theirs = their_register_pass(model, x, neurons)
    prefix = model.config.num_prefix_tokens
    ours = moved.tokens[:, -1]
    torch.testing.assert_close(ours[:, prefix], theirs[:, -1])  # the register
    torch.testing.assert_close(torch.cat([ours[:, :prefix], ours[:, prefix + 1 :]], dim=1), theirs[:, :-1])
    with torch.no_grad():
        pooled = model.forward_head(model.norm(theirs[:, :-1]))  # the head never reads the register
    torch.testing.assert_close(moved.logits, pooled)


def test_without_a_register_a_capture_is_the_plain_capture_and_the_model_is_unchanged(planted, others):
    x, _ = others
    state = {name: tensor.clone() for name, tensor in planted.state_dict().items()}
    plain = vx.capture(planted, x)
    ttr.register_capture(planted, x, ttr.TestTimeRegister({LAYER: [UNIT]}))
    again = vx.capture(planted, x)
    assert again.register_token is None and again.num_prefix_tokens == planted.config.num_prefix_tokens
    for name in ("logits", "attentions", "tokens", "patch_embeddings"):
        assert torch.equal(getattr(again, name), getattr(plain, name)), name
    with torch.no_grad():
        torch.testing.assert_close(planted(x), plain.logits)
    assert all(torch.equal(tensor, state[name]) for name, tensor in planted.state_dict().items())
    # Another model run while a register is applied to this one gets none.
    other = randomize(vx.ViT(tiny_config(image_size=32, depth=4)))
    with ttr.TestTimeRegister({LAYER: [UNIT]}).applied(planted):
        inside = vx.capture(other, x)
    assert inside.register_token is None and torch.equal(inside.tokens, vx.capture(other, x).tokens)


def test_two_threads_at_once_each_get_their_own_pass(planted, others):
    x, _ = others
    register = ttr.TestTimeRegister({LAYER: [UNIT]})
    expected = {"plain": vx.capture(planted, x).tokens, "register": ttr.register_capture(planted, x, register).tokens}
    barrier, results, failures = threading.Barrier(2), {"plain": [], "register": []}, []

    def work(kind: str) -> None:
        try:
            barrier.wait()
            for _ in range(8):
                captured = ttr.register_capture(planted, x, register) if kind == "register" else vx.capture(planted, x)
                results[kind].append(captured.tokens)
        except Exception as error:  # noqa: BLE001 - reported below
            failures.append(error)

    threads = [threading.Thread(target=work, args=(kind,)) for kind in results]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []
    for kind, tokens in results.items():
        assert len(tokens) == 8 and all(torch.allclose(t, expected[kind], atol=1e-5) for t in tokens), kind


def test_impossible_registers_are_refused_in_a_sentence(planted, others):
    config = planted.config
    assert ttr.TestTimeRegister({7: [0]}).problem(config) == "Layer 7 does not exist: this model has layers 0 to 3."
    assert ttr.TestTimeRegister({1: [0, 500]}).problem(config) == (
        f"Unit 500 of layer 1 does not exist: its MLP has units 0 to {config.mlp_hidden - 1}."
    )
    with pytest.raises(ValueError, match="^Layer 7 does not exist"):
        ttr.register_capture(planted, others[0], ttr.TestTimeRegister({7: [0]}))
    moved = ttr.register_capture(planted, others[0][:1], ttr.TestTimeRegister({LAYER: [UNIT]}))
    with pytest.raises(AnalysisError, match="^This pass has a test-time register already"):
        ttr.find_register_neurons(planted, moved)


def test_registers_are_values_that_can_key_a_cache():
    a = ttr.TestTimeRegister({2: [5, 1, 5], 0: (3,)})
    assert a == ttr.TestTimeRegister(((0, [3]), (2, [1, 5]))) and hash(a) == hash(ttr.TestTimeRegister({0: [3], 2: [1, 5]}))
    assert a.neurons == ((0, (3,)), (2, (1, 5))) and a.count == 3


def test_low_information_patches_are_the_uniform_ones():
    x, fire = picture(5, background=6)
    assert torch.equal(ttr.low_information_patches(x, 4, 6), fire)


def test_a_neuron_that_cannot_be_planted_is_refused_in_a_sentence():
    gated = vx.ViT(tiny_config(image_size=32, swiglu_mlp=True)).eval()
    x, fire = picture(1)
    with pytest.raises(ValueError, match="^A register neuron is planted in a GELU MLP"):
        ttr.plant_register_neuron(gated, x, fire, 0)
    # Without positions two patches alike are the same token in every layer: no unit tells them apart.
    model = randomize(vx.ViT(tiny_config(image_size=32, abs_pos_embed=False)))
    x = torch.randn(1, 3, 32, 32)
    x[..., :4, :8] = COLOUR[:, None, None]  # patches (0, 0) and (0, 1)
    first = torch.zeros(1, GRID, GRID, dtype=torch.bool)
    first[0, 0, 0] = True
    with pytest.raises(ValueError, match="^One unit of layer 0 cannot tell those patches from the other tokens"):
        ttr.plant_register_neuron(model, x, first, 0)
