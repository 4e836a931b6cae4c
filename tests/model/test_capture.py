"""capture() records the forward pass faithfully and leaves the model as it found it."""
import pytest
import torch
from einops import rearrange

import vit_explorer as vx
from vit_explorer.model.recorder import record_attention

from helpers import VARIANTS, randomize, tiny_config


def explicit_attention(model: vx.ViT, tokens: torch.Tensor, layer: int) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) written out from a block's input, as the ViT paper defines it."""
    block = model.blocks[layer]
    qkv = block.attn.qkv(block.norm1(tokens))  # (B, N, 3D)
    q, k, _ = rearrange(qkv, "b n (qkv h d) -> qkv b h n d", qkv=3, h=model.config.num_heads)
    return torch.softmax(q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5, dim=-1)


@pytest.mark.parametrize("changes", VARIANTS.values(), ids=VARIANTS.keys())
@pytest.mark.parametrize("batch", [1, 3])
def test_capture_shapes_and_invariants(changes, batch):
    model = randomize(vx.ViT(tiny_config(**changes)))
    config = model.config
    x = torch.randn(batch, 3, *config.img_size)
    with torch.no_grad():
        logits = model(x)
    cap = vx.capture(model, x)

    gh, gw = config.grid_size
    n, p = config.num_tokens, config.patch_size
    torch.testing.assert_close(cap.logits, logits, rtol=1e-5, atol=1e-5)  # watching changes nothing
    assert cap.attentions.shape == (batch, config.depth, config.num_heads, n, n)
    assert cap.attentions.dtype == torch.float32 and cap.attentions.device.type == "cpu"
    torch.testing.assert_close(cap.attentions.sum(-1), torch.ones(batch, config.depth, config.num_heads, n))
    assert cap.tokens.shape == (batch, config.depth + 1, n, config.embed_dim)
    assert cap.patches.shape == (batch, gh, gw, 3, p, p)
    assert cap.patch_embeddings.shape == (batch, gh * gw, config.embed_dim)
    assert cap.grid_size == (gh, gw) and cap.num_prefix_tokens == config.num_prefix_tokens
    assert cap.class_token == config.class_token

    with torch.no_grad():
        # The recorded pieces fit together: patches -> embeddings, tokens -> attention -> logits.
        image = rearrange(cap.patches, "b gh gw c p1 p2 -> b c (gh p1) (gw p2)")
        torch.testing.assert_close(image, x)
        torch.testing.assert_close(cap.patch_embeddings, model.patch_embed(x))
        torch.testing.assert_close(cap.tokens[:, 0], model._pos_embed(model.patch_embed(x)))
        for layer in range(config.depth):
            torch.testing.assert_close(
                cap.attentions[:, layer], explicit_attention(model, cap.tokens[:, layer], layer)
            )
            torch.testing.assert_close(cap.tokens[:, layer + 1], model.blocks[layer](cap.tokens[:, layer]))
        final = model.forward_head(model.norm(cap.tokens[:, -1]))
        torch.testing.assert_close(final, logits)


def test_capture_of_some_layers_matches_the_full_capture():
    model = randomize(vx.ViT(tiny_config(depth=4)))
    x = torch.randn(2, 3, 16, 16)
    full = vx.capture(model, x)
    some = vx.capture(model, x, layers=[3, 1, -1])
    assert some.layers == (1, 3)
    torch.testing.assert_close(some.attentions, full.attentions[:, [1, 3]])
    torch.testing.assert_close(some.tokens, full.tokens)
    with pytest.raises(ValueError, match=r"layers \[7\] do not exist; the model has layers 0..3"):
        vx.capture(model, x, layers=[7])


def test_a_half_precision_capture_keeps_the_same_attention_in_half_the_memory():
    model = randomize(vx.ViT(tiny_config(depth=3)))
    x = torch.randn(2, 3, 16, 16)
    full = vx.capture(model, x)
    half = vx.capture(model, x, attention_dtype=torch.float16)
    assert half.attentions.dtype == torch.float16
    assert half.attentions.element_size() * 2 == full.attentions.element_size()
    # The same float32 weights rounded once: each layer's own, though they pass through one scratch.
    assert torch.equal(half.attentions, full.attentions.half())
    assert torch.equal(half.tokens, full.tokens) and torch.equal(half.logits, full.logits)


def test_recording_two_passes_keeps_each_pass_its_own_weights():
    """Detached weights go into one buffer per pass: a second pass must not overwrite the first's."""
    model = randomize(vx.ViT(tiny_config(depth=2)))
    first_input, second_input = torch.randn(2, 1, 3, 16, 16)
    with torch.no_grad(), record_attention(model, [0, 1]) as recorded:
        model(first_input)
        first = dict(recorded)
        model(second_input)
    assert not torch.equal(first[1], recorded[1])
    torch.testing.assert_close(first[1], vx.capture(model, first_input).attentions[:, 1])
    torch.testing.assert_close(recorded[1], vx.capture(model, second_input).attentions[:, 1])


def hook_count(model: torch.nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def attention_switches(model: vx.ViT) -> list[bool]:
    return [block.attn.fused_attn for block in model.blocks]


def test_capture_leaves_the_model_as_it_was_even_on_error():
    model = randomize(vx.ViT(tiny_config()))
    model.train()
    switches = attention_switches(model)
    vx.capture(model, torch.randn(1, 3, 16, 16))
    assert model.training and hook_count(model) == 0 and attention_switches(model) == switches
    with pytest.raises(ValueError, match="expects 16x16"):
        vx.capture(model, torch.randn(1, 3, 8, 8))
    assert model.training and hook_count(model) == 0 and attention_switches(model) == switches


def test_capture_accepts_a_single_unbatched_image():
    model = randomize(vx.ViT(tiny_config()))
    assert vx.capture(model, torch.randn(3, 16, 16)).logits.shape == (1, 5)


def test_recorded_attention_carries_gradients_and_drives_the_output():
    model = randomize(vx.ViT(tiny_config()))
    x = torch.randn(2, 3, 16, 16)
    with record_attention(model, [0, 1], keep_graph=True) as recorded:
        model(x)[:, 2].sum().backward()
    assert all(recorded[layer].grad is not None for layer in (0, 1))
    assert recorded[1].grad.abs().sum() > 0
    assert hook_count(model) == 0 and all(block.attn.fused_attn for block in model.blocks)


def test_one_model_serves_many_threads_at_once():
    """Captures, knock-outs, plain forwards and attributions from 8 threads on one shared model
    object each get exactly what they get alone, and the model is left untouched (the app's
    situation): one thread's knock-out never reaches another thread's pass."""
    import threading

    from vit_explorer.analysis import attribution

    model = randomize(vx.ViT(tiny_config(depth=3)))
    inputs = [torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    knock_outs = [
        vx.KnockOut(heads={0: (1,)}), vx.KnockOut(heads={1: (0, 3), 2: (2,)}, mode="mean"),
        vx.KnockOut(attention=[0], mlp=[2]), vx.KnockOut(mlp=[1], mode="mean"),
    ]
    alone = {}
    for i, x in enumerate(inputs):
        with torch.no_grad():
            alone["forward", i] = model(x)
        alone["capture", i] = vx.capture(model, x)
        alone["attribution", i] = attribution(model, x, target=i % 5)
        alone["knockout", i] = vx.capture(model, x, knock_out=knock_outs[i])
        alone["sweep", i] = vx.head_sweep(model, x[:1], mode=knock_outs[i].mode, batch_size=3)

    kinds = ("forward", "capture", "attribution", "knockout", "sweep")
    jobs = [(kind, i) for kind in kinds for i in range(len(inputs))]
    results, errors = {}, []
    barrier = threading.Barrier(8)

    def work(worker: int) -> None:
        try:
            barrier.wait()
            for round_ in range(8):
                kind, i = jobs[(worker * 5 + round_ * 7) % len(jobs)]
                x = inputs[i]
                if kind == "forward":
                    with torch.no_grad():
                        result = model(x)
                elif kind == "capture":
                    result = vx.capture(model, x)
                elif kind == "knockout":
                    result = vx.capture(model, x, knock_out=knock_outs[i])
                elif kind == "sweep":
                    result = vx.head_sweep(model, x[:1], mode=knock_outs[i].mode, batch_size=3)
                else:
                    result = attribution(model, x, target=i % 5)
                results.setdefault((kind, i), []).append(result)
        except Exception as error:  # noqa: BLE001 - reported below with its thread
            errors.append((worker, repr(error)))

    threads = [threading.Thread(target=work, args=(worker,)) for worker in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors, errors
    assert {kind for kind, _ in results} == set(kinds)
    for (kind, i), outcomes in results.items():
        for outcome in outcomes:
            if kind in ("capture", "knockout"):
                expected = alone[kind, i]
                torch.testing.assert_close(outcome.logits, expected.logits)
                torch.testing.assert_close(outcome.attentions, expected.attentions)
                torch.testing.assert_close(outcome.tokens, expected.tokens)
                torch.testing.assert_close(outcome.patch_embeddings, expected.patch_embeddings)
            elif kind == "sweep":
                torch.testing.assert_close(outcome.values, alone[kind, i].values)
            else:
                torch.testing.assert_close(outcome, alone[kind, i])
    assert hook_count(model) == 0 and all(attention_switches(model)) and not model.training
    assert all(parameter.grad is None for parameter in model.parameters())
