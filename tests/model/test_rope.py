"""Rotary positions (DINOv3, EVA-02) and Eva's attention and MLP variants: parity with timm's Eva
(final tokens and every layer's attention), and the invariants every view relies on."""
import math
import threading

import pytest
import torch

import vit_explorer as vx
from vit_explorer import analysis
from vit_explorer.model.capture import layer_internals
from vit_explorer.model.recorder import record_attention
from vit_explorer.model.vit import from_timm_eva, resample_patch_embed, resample_pos_embed
from vit_explorer.model.rope import RopeSpec, rope_angles, rope_tables

from rotary import ROTARY, SMALL, TINY, rotary_model, sizes, timm_attentions, timm_eva

DINOV3 = dict(
    patch_size=16, qkv_bias=False, init_values=1e-5, rope_type="dinov3", abs_pos_embed=False, reg_tokens=4,
    layer_norm_eps=1e-5, global_pool="mean", fc_norm=False,  # timm's default pooling for its DINOv3
)
EVA02 = dict(patch_size=14, mlp_ratio=4 * 2 / 3, swiglu_mlp=True, rope_type="cat", ref_feat_shape=(16, 16), global_pool="mean")
# timm model name, its overrides, our config: each a combination timm's DINOv3 and EVA-02 models use.
FAMILIES = {
    "DINOv3 S: class token, 4 registers, no qkv bias": ("vit_small_patch16_dinov3", {}, DINOV3),
    "DINOv3 S+: SwiGLU aligned to 8": (
        "vit_small_plus_patch16_dinov3", {}, dict(DINOV3, swiglu_mlp=True, swiglu_align_to=8),
    ),
    "DINOv3 qkvb: q and v biases": ("vit_small_patch16_dinov3_qkvb", {}, dict(DINOV3, qkv_bias=True)),
    "EVA-02 Ti: abs + rope, packed SwiGLU, q and v biases": ("eva02_tiny_patch14_224", {}, EVA02),
    "EVA-02 B: separate q/k/v, SwiGLU with its LayerNorm": (
        "eva02_base_patch14_224", {}, dict(EVA02, qkv_fused=False, scale_mlp=True),
    ),
    "EVA-02 B 448: rope rescaled to the 224 grid": (
        "eva02_base_patch14_448", {}, dict(EVA02, qkv_fused=False, scale_mlp=True),
    ),
    "EVA-02 CLIP: LayerNorm inside the attention, class token": (
        "eva02_base_patch16_clip_224", {}, dict(EVA02, patch_size=16, qkv_fused=False, scale_mlp=True,
                                                scale_attn_inner=True, global_pool="cls"),
    ),
}


def ours_from_timm(eva, config: dict, image_size: tuple[int, int], own_size: tuple[int, int]) -> vx.ViT:
    """Our ViT at ``image_size`` with the Eva's weights (its position embeddings resampled as timm's
    dynamic size does, when the size is not its own)."""
    model = vx.ViT(vx.ViTConfig(image_size=image_size, **SMALL, **config)).eval()
    state = from_timm_eva(eva.state_dict())
    if "pos_embed" in state:
        own_grid = tuple(side // model.config.patch_size for side in own_size)
        state["pos_embed"] = resample_pos_embed(state["pos_embed"], own_grid, model.config.grid_size, 1)
    model.load_state_dict(state, strict=True)
    return model


@pytest.mark.parametrize("family", list(FAMILIES))
def test_our_vit_with_timms_eva_weights_gives_timms_tokens_and_attention(family):
    name, overrides, config = FAMILIES[family]
    own, other = sizes(name)
    eva = timm_eva(name, overrides, own)
    for size in (own, other):
        ours = ours_from_timm(eva, config, size, own)
        x = torch.randn(2, 3, *size, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            expected = eva.forward_features(x)
        cap = vx.capture(ours, x)
        assert cap.tokens.shape[2] == expected.shape[1]
        with torch.no_grad():
            assert (ours.forward_features(x) - expected).abs().max() < 1e-4
        assert (ours.norm(cap.tokens[:, -1]) - expected).abs().max() < 1e-4
        for layer, attention in enumerate(timm_attentions(eva, x)):
            assert (cap.attentions[:, layer] - attention).abs().max() < 1e-4, (size, layer)


def test_bfloat16_periods_match_timm_with_its_periods_rounded_as_the_original_checkpoints():
    name, overrides, config = FAMILIES["DINOv3 S: class token, 4 registers, no qkv bias"]
    eva = timm_eva(name, overrides, (224, 224))
    x = torch.randn(1, 3, 224, 320, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        eva.rope.periods = eva.rope.periods.to(torch.bfloat16).to(torch.float32)  # timm's model card
        expected = eva.forward_features(x)
    rounded = ours_from_timm(eva, dict(config, rope_periods_dtype="bfloat16"), (224, 320), (224, 224))
    exact = ours_from_timm(eva, config, (224, 320), (224, 224))
    timm_tables = eva.rope.get_embed((14, 20))  # (P, 2 hd): sin, then cos
    assert (torch.cat(rounded.rope_tables((14, 20)), -1) - timm_tables).abs().max() < 1e-6
    assert (torch.cat(exact.rope_tables((14, 20)), -1) - timm_tables).abs().max() > 1e-3
    with torch.no_grad():
        assert (rounded.forward_features(x) - expected).abs().max() < 1e-5


def test_from_timm_eva_gives_our_names_and_the_keys_zero_bias():
    eva = timm_eva("vit_small_patch16_dinov3_qkvb", {}, (224, 224))
    state = from_timm_eva(eva.state_dict())
    assert not any("gamma_" in key or "q_bias" in key or key.startswith("rope.") for key in state)
    bias = state["blocks.0.attn.qkv.bias"].chunk(3)
    assert torch.equal(bias[0], eva.blocks[0].attn.q_bias) and not bias[1].any()
    assert torch.equal(state["blocks.1.ls2.gamma"], eva.blocks[1].gamma_2)


# --- invariants on small rotary models ----------------------------------------------------------


def images(count: int = 2) -> torch.Tensor:
    return torch.randn(count, 3, 16, 32, generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("family", list(ROTARY))
def test_capture_of_a_rotary_model_keeps_the_logits_and_rows_sum_to_one(family):
    model = rotary_model(family)
    x = images()
    cap = vx.capture(model, x)
    with torch.no_grad():
        torch.testing.assert_close(cap.logits, model(x), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cap.attentions.sum(-1), torch.ones(cap.attentions.shape[:-1]), atol=1e-5, rtol=0)
    assert cap.grid_size == (4, 8) and cap.num_tokens == model.config.num_tokens


@pytest.mark.parametrize("family", list(ROTARY))
def test_another_patch_size_rotates_on_its_own_grid(family):
    model = rotary_model(family)
    x = images()
    # The same model built at patch 8: the PI-resized kernel and the positions at the new grid.
    config = model.config.replace(patch_size=8)
    state = model.state_dict()
    state["patch_embed.proj.weight"] = resample_patch_embed(state["patch_embed.proj.weight"].double(), 8).float()
    if "pos_embed" in state:
        state["pos_embed"] = resample_pos_embed(state["pos_embed"], model.config.grid_size, config.grid_size, 1)
    at_eight = vx.ViT(config).eval()
    at_eight.load_state_dict(state)
    with torch.no_grad(), record_attention(model, range(3)) as recorded:
        flexi = model(x, patch_size=8)
    with torch.no_grad():
        torch.testing.assert_close(flexi, model(x, patch_size=8), atol=1e-5, rtol=1e-5)  # fused = explicit
    cap = vx.capture(at_eight, x)
    torch.testing.assert_close(flexi, cap.logits, atol=1e-4, rtol=1e-4)
    assert recorded[0].shape[-1] == model.config.num_prefix_tokens + 2 * 4
    torch.testing.assert_close(recorded[1], cap.attentions[:, 1], atol=1e-5, rtol=1e-5)


def rotated_by_hand(x: torch.Tensor, angles: torch.Tensor, rotate_half: bool, prefix: int) -> torch.Tensor:
    """(B, nh, N, hd) with each patch's channel pairs turned by its angles (P, hd/2), written out:
    pair i is (i, i + hd/2) in the rotate-half layout, (2i, 2i + 1) in the interleaved one."""
    half = x.shape[-1] // 2
    out = x.clone()
    for pair in range(half):
        a, b = (pair, pair + half) if rotate_half else (2 * pair, 2 * pair + 1)
        cos, sin = angles[:, pair].cos(), angles[:, pair].sin()
        first, second = x[:, :, prefix:, a], x[:, :, prefix:, b]
        out[:, :, prefix:, a] = first * cos - second * sin
        out[:, :, prefix:, b] = second * cos + first * sin
    return out


@pytest.mark.parametrize("family", list(ROTARY))
def test_the_recorded_steps_of_a_rotary_layer_recompose_its_next_tokens(family):
    model = rotary_model(family)
    x = images()
    cap = vx.capture(model, x, internals=1)
    steps, block = cap.internals, model.blocks[1]
    prefix = model.config.num_prefix_tokens
    angles = model.rope_angles(cap.grid_size)
    assert angles.shape == (32, model.config.head_dim // 2)
    close = dict(atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        q, k, v = block.attn._qkv(block.norm1(steps.input)).unbind(0)
        torch.testing.assert_close(steps.q_unrotated, q, **close)
        torch.testing.assert_close(steps.k_unrotated, k, **close)
        for turned, unturned in ((steps.q, q), (steps.k, k)):
            torch.testing.assert_close(turned, rotated_by_hand(unturned, angles, block.attn.rotate_half, prefix), **close)
            torch.testing.assert_close(turned[:, :, :prefix], unturned[:, :, :prefix], atol=0, rtol=0)
        scores = steps.q @ steps.k.transpose(-2, -1) / math.sqrt(steps.head_dim)
        torch.testing.assert_close(steps.scores, scores, **close)
        torch.testing.assert_close(steps.attention, scores.softmax(-1), **close)
        torch.testing.assert_close(steps.heads, steps.attention @ v, **close)
        attn_out = block.attn.proj(steps.concatenated)
        torch.testing.assert_close(steps.attn_out, attn_out, **close)
        middle = steps.input + block.ls1(attn_out)
        mlp_out = block.mlp.fc2(steps.mlp_hidden)
        torch.testing.assert_close(steps.mlp_hidden, block.mlp.hidden(block.norm2(middle)), **close)
        torch.testing.assert_close(steps.output, middle + block.ls2(mlp_out), **close)
    torch.testing.assert_close(steps.output, cap.tokens[:, 2], **close)
    # Re-running that block alone, and one query's rows, give the same steps.
    alone = layer_internals(model, cap.tokens[:, 1], 1, grid_size=cap.grid_size)
    one = layer_internals(model, cap.tokens[:, 1], 1, queries=[prefix + 5], grid_size=cap.grid_size)
    for name in ("q", "k", "q_unrotated", "k_unrotated", "scores", "attention", "mlp_hidden", "output"):
        torch.testing.assert_close(getattr(alone, name), getattr(steps, name), atol=1e-6, rtol=1e-6)
        full = getattr(steps, name)
        row = full if name in ("k", "k_unrotated") else full[..., [prefix + 5], :] if full.dim() == 4 else full[:, [prefix + 5]]
        torch.testing.assert_close(getattr(one, name), row, **close)


def test_a_rotary_block_without_its_tables_says_so():
    model = rotary_model("DINOv3: registers, SwiGLU, LayerScale")
    with pytest.raises(ValueError, match="rope_tables"):
        model.blocks[0](torch.zeros(1, model.config.num_tokens, 32))


@pytest.mark.parametrize("family", list(ROTARY))
def test_knock_outs_the_head_sweep_rollout_and_attribution_run_on_a_rotary_model(family):
    model = rotary_model(family)
    x = images(1)
    intact = vx.capture(model, x)
    knock_out = vx.KnockOut(heads={1: (0,)})
    whole = vx.capture(model, x, knock_out=knock_out)
    resumed = vx.capture(model, x, knock_out=knock_out, intact=intact)
    torch.testing.assert_close(resumed.logits, whole.logits, atol=1e-5, rtol=1e-5)
    sweep = vx.head_sweep(model, x)
    expected = whole.logits.log_softmax(-1)[0, sweep.target] - intact.logits.log_softmax(-1)[0, sweep.target]
    torch.testing.assert_close(sweep.values[1, 0], expected, atol=1e-4, rtol=1e-4)
    rollout = analysis.attention_rollout(intact.attentions, num_prefix_tokens=intact.num_prefix_tokens)
    torch.testing.assert_close(rollout.sum(-1), torch.ones(rollout.shape[:-1]), atol=1e-4, rtol=0)
    relevance = analysis.attribution(model, x)
    assert relevance.shape == (1, 4, 8) and torch.isfinite(relevance).all()
    assert all(block.attn.fused_attn for block in model.blocks)


def test_one_rotary_model_serves_two_threads_at_two_grids_as_alone():
    model = rotary_model("DINOv3: registers, SwiGLU, LayerScale")
    x = images()
    alone = {}
    for patch in (4, 8):
        with torch.no_grad(), record_attention(model, [2]) as recorded:
            alone[patch] = (model(x, patch_size=patch), recorded[2].clone())
    failures = []

    def run(patch: int) -> None:
        for _ in range(20):
            with torch.no_grad(), record_attention(model, [2]) as recorded:
                logits = model(x, patch_size=patch)
            if not (torch.allclose(logits, alone[patch][0], atol=1e-6) and torch.allclose(recorded[2], alone[patch][1], atol=1e-6)):
                failures.append(patch)

    threads = [threading.Thread(target=run, args=(patch,)) for patch in (4, 8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures


def test_the_tables_are_computed_once_per_grid_and_device():
    spec = RopeSpec.of(vx.ViTConfig(**TINY, **ROTARY["DINOv3: registers, SwiGLU, LayerScale"]))
    assert rope_tables(spec, (4, 8)) is rope_tables(spec, (4, 8))
    sin, cos = rope_tables(spec, (4, 8))
    torch.testing.assert_close(sin**2 + cos**2, torch.ones(32, 16))


def test_dinov3_angles_span_the_same_range_at_any_grid():
    config = vx.ViTConfig(**TINY, rope_type="dinov3", abs_pos_embed=False)
    small, large = rope_angles(config, (2, 2)), rope_angles(config, (8, 8))
    # Patch centres at -1 + 1/g ... 1 - 1/g: the largest period's angle (pi * coordinate) by hand.
    assert math.isclose(float(small[0, 0]), 2 * math.pi * -0.5, rel_tol=1e-6)
    assert math.isclose(float(large[0, 0]), 2 * math.pi * -0.875, rel_tol=1e-6)
    assert rope_angles(vx.ViTConfig(**TINY)) is None


@pytest.mark.parametrize("family", list(ROTARY))
def test_a_rotary_config_survives_the_json_round_trip(family):
    config = vx.ViTConfig(**TINY, **ROTARY[family], rope_periods_dtype="bfloat16")
    assert vx.ViTConfig.from_json(config.to_json()) == config


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (dict(rope_type="alibi"), "rope_type must be None or one of"),
        (dict(rope_type="dinov3", embed_dim=24, num_heads=4), "divisible by 4"),
        (dict(ref_feat_shape=(16, 16)), "needs rope_type='cat'"),
        (dict(rope_type="cat", rope_grid_indexing="yx"), "rope_grid_indexing must be"),
        (dict(rope_type="dinov3", rope_periods_dtype="float16"), "rope_periods_dtype must be one of"),
        (dict(rope_type="dinov3", rope_temperature=0), "rope_temperature must be a positive number"),
        (dict(swiglu_align_to=-8), "swiglu_align_to must be a whole number"),
        (dict(qkv_fused="no"), "qkv_fused must be true or false"),
    ],
)
def test_a_bad_rotary_or_mlp_setting_is_one_sentence(changes, message):
    with pytest.raises(ValueError, match=message):
        vx.ViTConfig(**{**TINY, **changes})
