"""The model agrees with timm's VisionTransformer, and its two attention paths agree."""
import os
import subprocess
import sys

import pytest
import timm
import torch

import vit_explorer as vx

from helpers import VARIANTS, randomize, timm_twin, tiny_config


@pytest.mark.parametrize("changes", VARIANTS.values(), ids=VARIANTS.keys())
def test_matches_timm_with_the_same_weights(changes):
    config = tiny_config(**changes)
    model = randomize(vx.ViT(config))
    reference = timm_twin(config)
    reference.load_state_dict(model.state_dict(), strict=True)  # same parameter names
    x = torch.randn(3, 3, *config.img_size)
    with torch.no_grad():
        torch.testing.assert_close(model(x), reference(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("changes", VARIANTS.values(), ids=VARIANTS.keys())
def test_fused_and_explicit_attention_agree(changes):
    model = randomize(vx.ViT(tiny_config(**changes)))
    x = torch.randn(2, 3, *model.config.img_size)
    with torch.no_grad():
        fused = model(x)
        for block in model.blocks:
            block.attn.fused_attn = False
        explicit = model(x)
    torch.testing.assert_close(fused, explicit, rtol=1e-5, atol=1e-5)


def test_patch_embedding_is_a_linear_map_of_flattened_patches():
    model = randomize(vx.ViT(tiny_config()))
    x = torch.randn(2, 3, 16, 16)
    proj = model.patch_embed.proj
    patches = x.unfold(2, 4, 4).unfold(3, 4, 4)  # (B, C, gh, gw, p, p)
    flat = patches.permute(0, 2, 3, 1, 4, 5).reshape(2, 16, 3 * 4 * 4)  # (B, gh*gw, C*p*p)
    linear = flat @ proj.weight.reshape(32, -1).T + proj.bias
    with torch.no_grad():
        torch.testing.assert_close(model.patch_embed(x), linear, rtol=1e-5, atol=1e-5)


def test_wrong_input_size_is_a_clear_error():
    model = vx.ViT(tiny_config())
    with pytest.raises(ValueError, match="input is 20x16 pixels but the model expects 16x16"):
        model(torch.randn(1, 3, 20, 16))


def test_dropout_is_inactive_in_eval_and_active_in_train():
    model = randomize(vx.ViT(tiny_config(drop_rate=0.5, attn_drop_rate=0.5, drop_path_rate=0.5)))
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        torch.testing.assert_close(model(x), model(x))
        model.train()
        assert not torch.allclose(model(x), model(x))


def test_timm_named_model_loads_directly():
    reference = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=3)
    config = vx.ViTConfig(num_classes=3, embed_dim=192, depth=12, num_heads=3)
    vx.ViT(config).load_state_dict(reference.state_dict(), strict=True)


def test_config_json_round_trip():
    config = tiny_config(image_size=(16, 32), class_names=("a", "b", "c", "d", "e"), reg_tokens=1)
    again = vx.ViTConfig.from_json(config.to_json())
    assert again == config
    assert again.grid_size == (4, 8) and again.num_tokens == 2 + 32


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(image_size=18), "not divisible by patch size"),
        (dict(num_heads=5), "not divisible by num_heads"),
        (dict(global_pool="max"), "global_pool must be"),
        (dict(class_token=False), "needs class_token=True"),
        (dict(class_names=("a",)), "1 class names given for 5 classes"),
    ],
)
def test_bad_config_is_a_clear_error(changes, message):
    with pytest.raises(ValueError, match=message):
        tiny_config(**changes)


def test_unknown_config_field_is_named():
    with pytest.raises(ValueError, match="unknown ViTConfig fields: colour"):
        vx.ViTConfig.from_dict({"colour": "red"})


@pytest.mark.parametrize("changes", VARIANTS.values(), ids=VARIANTS.keys())
@pytest.mark.parametrize("patch_size", [2, 8])
def test_a_forward_at_another_patch_size_equals_the_resized_model(changes, patch_size):
    model = randomize(vx.ViT(tiny_config(**changes)))
    x = torch.randn(2, 3, *model.config.img_size)
    with torch.no_grad():
        flexible = model(x, patch_size=patch_size)
        resized = vx.resize_model(model, patch_size=patch_size)(x)
    torch.testing.assert_close(flexible, resized, rtol=1e-5, atol=1e-5)
    assert model.config.patch_size == 4 and model.patch_embed.proj.weight.shape[-1] == 4  # untouched


def test_gradients_reach_the_underlying_weights_through_the_resize():
    model = randomize(vx.ViT(tiny_config())).train()
    model(torch.randn(2, 3, 16, 16), patch_size=2).sum().backward()
    assert model.patch_embed.proj.weight.grad.abs().sum() > 0
    assert model.pos_embed.grad[0, 1:].abs().sum() > 0  # the grid part, resampled to 8 x 8


def test_a_patch_size_that_does_not_tile_the_input_says_so():
    model = vx.ViT(tiny_config())
    with pytest.raises(ValueError, match="patch size 3 does not tile 16x16 images"):
        model(torch.randn(1, 3, 16, 16), patch_size=3)


def test_the_pi_resize_operator_is_computed_once_per_pair_of_sizes():
    from vit_explorer.model.vit import pi_resize_operator

    first = pi_resize_operator(4, 8, torch.device("cpu"), torch.float32)
    assert pi_resize_operator(4, 8, torch.device("cpu"), torch.float32) is first
    assert first.shape == (64, 16)


@pytest.mark.parametrize("old, new", [(16, 224), (16, 56), (14, 32), (16, 8), (4, 3)])
def test_the_pi_resize_operator_is_the_pseudo_inverse(old, new):
    """Enlarging takes a solve with the Gram matrix instead of an SVD: still pinv(B^T)."""
    from vit_explorer.model.vit import pi_resize_operator, resize_matrix

    expected = torch.linalg.pinv(resize_matrix((old, old), (new, new)))
    torch.testing.assert_close(pi_resize_operator(old, new), expected, atol=1e-12, rtol=0)


def test_importing_the_package_makes_idle_openmp_threads_sleep_unless_told_otherwise():
    """A server's concurrent passes must not lose the cores to spinning OpenMP threads; the setting
    only works if it is made before torch loads, which importing vit_explorer first guarantees."""
    probe = "import os, vit_explorer, torch; print(os.environ['OMP_WAIT_POLICY'])"
    env = {key: value for key, value in os.environ.items() if key != "OMP_WAIT_POLICY"}
    default = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert default.stdout.strip() == "PASSIVE"
    chosen = subprocess.run(
        [sys.executable, "-c", probe], env={**env, "OMP_WAIT_POLICY": "ACTIVE"}, capture_output=True, text=True, check=True
    )
    assert chosen.stdout.strip() == "ACTIVE"


def test_a_compiled_model_is_one_graph():
    # torch.compile (training) must trace the whole model: a graph break per block made a compiled
    # ViT train at half timm's speed on torch 2.11, whose dynamo cannot trace ContextVar.get.
    model = vx.ViT(tiny_config(depth=2)).eval()
    x = torch.randn(2, 3, *model.config.img_size, generator=torch.Generator().manual_seed(0))
    explained = torch._dynamo.explain(model)(x)
    assert explained.graph_count == 1 and explained.graph_break_count == 0, explained.break_reasons
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(model, backend="eager")(x), model(x))
