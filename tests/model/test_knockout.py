"""Knock-outs remove exactly what they say, per call, and the sweep agrees with them one by one."""

import pytest
import torch

import vit_explorer as vx

from helpers import VARIANTS, counting_blocks, randomize, timm_twin, tiny_config

MODES = ("zero", "mean")


def peaked(model: vx.ViT) -> vx.ViT:
    """Random weights with larger queries and keys: attention far from uniform, whose heads' mean
    over the tokens (mean-ablation) is far from what they output."""
    randomize(model)
    with torch.no_grad():
        for block in model.blocks:
            block.attn.qkv.weight.mul_(4)
    return model


def removed_branch(output: torch.Tensor, bias: torch.Tensor, mode: str) -> torch.Tensor:
    """A branch taken out by hand: its output projection's bias alone (zero), or its output's
    mean over each image's tokens (mean)."""
    return bias.expand_as(output) if mode == "zero" else output.mean(dim=1, keepdim=True).expand_as(output)


def by_hand(model: vx.ViT, x: torch.Tensor, layer: int, branch: str, mode: str) -> torch.Tensor:
    """The logits with one layer's attention or MLP branch removed, block written out by hand."""
    with torch.no_grad():
        tokens = model.norm_pre(model._pos_embed(model.patch_embed(x)))
        for index, block in enumerate(model.blocks):
            attended = block.attn(block.norm1(tokens))
            if index == layer and branch == "attention":
                attended = removed_branch(attended, block.attn.proj.bias, mode)
            middle = tokens + block.ls1(attended)
            refined = block.mlp(block.norm2(middle))
            if index == layer and branch == "mlp":
                refined = removed_branch(refined, block.mlp.fc2.bias, mode)
            tokens = middle + block.ls2(refined)
        return model.forward_head(model.norm(tokens))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("changes", VARIANTS.values(), ids=VARIANTS.keys())
def test_every_head_of_a_layer_is_that_layers_attention_branch_removed(changes, mode):
    model = peaked(vx.ViT(tiny_config(depth=3, **changes)))
    x = torch.randn(2, 3, *model.config.img_size)
    every_head = vx.capture(model, x, knock_out=vx.KnockOut(heads={1: range(4)}, mode=mode))
    branch = vx.capture(model, x, knock_out=vx.KnockOut(attention=[1], mode=mode))
    expected = by_hand(model, x, layer=1, branch="attention", mode=mode)
    torch.testing.assert_close(every_head.logits, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(branch.logits, expected, rtol=1e-5, atol=1e-5)
    intact = vx.capture(model, x)
    torch.testing.assert_close(every_head.tokens[:, :2], intact.tokens[:, :2])  # nothing before layer 1 moves
    assert (every_head.tokens[:, 2] - intact.tokens[:, 2]).abs().max() > 1e-2  # its output does


@pytest.mark.parametrize("mode", MODES)
def test_an_mlp_knock_out_removes_that_branch(mode):
    model = randomize(vx.ViT(tiny_config(depth=3, init_values=0.5)))
    x = torch.randn(2, 3, 16, 16)
    knocked = vx.capture(model, x, knock_out=vx.KnockOut(mlp=[2], mode=mode))
    torch.testing.assert_close(knocked.logits, by_hand(model, x, layer=2, branch="mlp", mode=mode), rtol=1e-5, atol=1e-5)


def test_mean_ablation_takes_each_images_own_mean():
    model = randomize(vx.ViT(tiny_config()))
    x = torch.randn(3, 3, 16, 16)
    knock_out = vx.KnockOut(heads={0: (1, 2)}, mlp=[1], mode="mean")
    batch = vx.capture(model, x, knock_out=knock_out)
    for index in range(3):
        alone = vx.capture(model, x[index : index + 1], knock_out=knock_out)
        torch.testing.assert_close(batch.logits[index : index + 1], alone.logits, rtol=1e-5, atol=1e-5)


def test_no_knock_out_is_the_plain_forward_bitwise():
    model = randomize(vx.ViT(tiny_config(reg_tokens=2)))
    x = torch.randn(2, 3, 16, 16)
    empty = vx.KnockOut(heads={0: ()}, mode="mean")
    assert empty.is_empty
    with torch.no_grad():
        plain = model(x)
        with empty.applied(model):
            assert torch.equal(model(x), plain)
    intact, knocked = vx.capture(model, x), vx.capture(model, x, knock_out=empty)
    assert torch.equal(knocked.logits, intact.logits) and torch.equal(knocked.attentions, intact.attentions)
    assert torch.equal(knocked.tokens, intact.tokens)


KNOCK_OUTS = [
    vx.KnockOut(heads={2: (1,)}), vx.KnockOut(heads={0: (0, 3)}, mode="mean"), vx.KnockOut(mlp=(3,), mode="mean"),
    vx.KnockOut(heads={3: (2,)}, attention=(1,), mlp=(2,)),
]


@pytest.mark.parametrize("changes", [{}, dict(reg_tokens=2, class_token=False, global_pool="map", num_classes=0)],
                         ids=["cls token", "registers, map head"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("layers", [None, [1, 3]])
def test_a_knock_out_resumed_from_the_intact_capture_is_the_same_capture(changes, dtype, layers, monkeypatch):
    model = peaked(vx.ViT(tiny_config(depth=4, **changes))).eval()
    x = torch.randn(2, 3, 16, 16)
    intact = vx.capture(model, x, layers=layers, attention_dtype=dtype)
    for knock_out in KNOCK_OUTS:
        whole = vx.capture(model, x, layers=layers, attention_dtype=dtype, knock_out=knock_out)
        ran = counting_blocks(monkeypatch, model)
        resumed = vx.capture(model, x, layers=layers, attention_dtype=dtype, knock_out=knock_out, intact=intact)
        monkeypatch.undo()
        assert ran == list(range(knock_out.first_layer(), 4))  # the layers before are the intact pass's
        for field in ("logits", "attentions", "tokens", "patches", "patch_embeddings"):
            assert torch.equal(getattr(resumed, field), getattr(whole, field)), field
        assert resumed.layers == whole.layers
        if whole.pool_attentions is not None:
            assert torch.equal(resumed.pool_attentions, whole.pool_attentions)


def test_an_intact_capture_of_something_else_is_refused():
    model = randomize(vx.ViT(tiny_config(depth=3)))
    x = torch.randn(1, 3, 16, 16)
    knock_out = vx.KnockOut(heads={1: (0,)})
    with pytest.raises(ValueError, match="same layers"):
        vx.capture(model, x, knock_out=knock_out, intact=vx.capture(model, x, layers=[-1]))
    with pytest.raises(ValueError, match="same images"):
        vx.capture(model, x, knock_out=knock_out, intact=vx.capture(model, torch.cat([x, x])))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("changes", [{}, dict(num_classes=0), dict(class_token=False, global_pool="mean")],
                         ids=["classifier", "headless", "mean pool"])
def test_a_sweep_entry_is_the_single_knock_out(changes, mode):
    model = peaked(vx.ViT(tiny_config(depth=3, **changes)))
    x = torch.randn(1, 3, 16, 16)
    shares = []
    sweep = vx.head_sweep(model, x, mode=mode, progress=shares.append, batch_size=3)  # heads split 3 + 1
    intact = vx.capture(model, x).logits
    assert sweep.values.shape == (3, 4) and sweep.mode == mode
    assert shares == sorted(shares) and shares[-1] == pytest.approx(1.0) and len(shares) == 6
    for layer in range(3):
        for head in range(4):
            knocked = vx.capture(model, x, knock_out=vx.KnockOut(heads={layer: (head,)}, mode=mode)).logits
            if model.config.num_classes:
                target = int(intact.argmax())
                assert sweep.target == target
                expected = knocked.log_softmax(-1)[0, target] - intact.log_softmax(-1)[0, target]
            else:
                assert sweep.target is None
                expected = torch.cosine_similarity(knocked, intact)[0] - 1
            torch.testing.assert_close(sweep.values[layer, head], expected, rtol=1e-4, atol=1e-5)
    assert sweep.values.abs().max() > 1e-4  # the knock-outs moved the output


def test_the_sweep_cost_counts_only_the_layers_from_the_knocked_one_on():
    vit_b = vx.ViTConfig(image_size=224, patch_size=16, embed_dim=768, depth=12, num_heads=12)
    assert vx.sweep_cost(vit_b) == pytest.approx(1 + 12 * 13 / 2)  # 79 forwards, not 144


@pytest.mark.parametrize("mode", MODES)
def test_a_knock_out_matches_the_same_knock_out_by_hand_on_timm(mode):
    """timm's VisionTransformer with the same weights, its head's slice of the input to
    ``attn.proj`` replaced by a forward pre-hook (ours never hooks)."""
    config = tiny_config(depth=3, reg_tokens=1)
    model = peaked(vx.ViT(config))
    reference = timm_twin(config)
    reference.load_state_dict(model.state_dict(), strict=True)
    knocked = {0: (2,), 2: (0, 3)}
    head_dim = config.embed_dim // config.num_heads

    def ablate(heads):
        def hook(module, inputs):
            (concatenated,) = inputs  # (B, N, H * hd)
            concatenated = concatenated.clone()
            for head in heads:
                part = concatenated[..., head * head_dim : (head + 1) * head_dim]
                part[...] = 0 if mode == "zero" else part.mean(dim=1, keepdim=True)
            return (concatenated,)
        return hook

    for layer, heads in knocked.items():
        reference.blocks[layer].attn.proj.register_forward_pre_hook(ablate(heads))
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        expected = reference(x)
    result = vx.capture(model, x, knock_out=vx.KnockOut(heads=knocked, mode=mode))
    torch.testing.assert_close(result.logits, expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(result.logits, vx.capture(model, x).logits, atol=1e-3)


def test_impossible_knock_outs_are_refused_in_a_sentence():
    model = randomize(vx.ViT(tiny_config()))  # 2 layers of 4 heads
    x = torch.randn(1, 3, 16, 16)
    cases = {
        vx.KnockOut(heads={5: (0,)}): "Layer 5 does not exist: this model has layers 0 to 1.",
        vx.KnockOut(mlp=[-1]): "Layer -1 does not exist: this model has layers 0 to 1.",
        vx.KnockOut(heads={1: (4,)}): "Head 4 of layer 1 does not exist: this model has heads 0 to 3.",
        vx.KnockOut(heads={0: range(4)}, attention=[1]): "Knocking out every head of every layer",
    }
    for knock_out, sentence in cases.items():
        assert knock_out.problem(model.config).startswith(sentence)
        with pytest.raises(ValueError, match=sentence[:30]):
            vx.capture(model, x, knock_out=knock_out)
    assert vx.KnockOut(heads={0: range(4)}, mlp=[0, 1]).problem(model.config) is None
    with pytest.raises(ValueError, match="mode must be one of zero, mean"):
        vx.KnockOut(mode="half")


def test_knock_outs_are_values_that_can_key_a_cache():
    first = vx.KnockOut(heads={3: [2, 0], 1: (1,)}, mlp=(4, 2))
    second = vx.KnockOut(heads=((1, [1]), (3, (0, 2)), (5, ())), mlp=[2, 4])
    assert first == second and hash(first) == hash(second) and first.first_layer() == 1
    assert first.describe() == "layer 1 head 1; layer 3 heads 0, 2; layer 2 MLP; layer 4 MLP (zero-ablated)"
