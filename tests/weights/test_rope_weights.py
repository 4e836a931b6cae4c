"""Loading rotary-position ViTs: timm's Eva files (DINOv3, EVA-02), Meta's original DINOv3 layout and
Hugging Face DINOv3 folders, each built here with random weights, give the source's final tokens
and every layer's attention within 1e-4 at its own size and a non-square one; our format keeps
them; resize_model works on them."""
from __future__ import annotations

import re

import pytest
import torch
from safetensors.torch import save_file

import vit_explorer as vx
from vit_explorer.weights import from_eva

from helpers import randomize
from rotary import sizes, timm_attentions, timm_eva

# timm model name -> (its overrides, fields the loaded config must have)
FAMILIES = {
    "DINOv3 S": ("vit_small_patch16_dinov3", dict(rope_type="dinov3", reg_tokens=4, qkv_bias=False, layer_norm_eps=1e-5)),
    "DINOv3 S+ (SwiGLU)": ("vit_small_plus_patch16_dinov3", dict(swiglu_mlp=True, swiglu_align_to=8, mlp_hidden=256)),
    "DINOv3 S qkvb": ("vit_small_patch16_dinov3_qkvb", dict(qkv_bias=True, global_pool="cls")),
    "EVA-02 Ti (packed SwiGLU)": ("eva02_tiny_patch14_224", dict(rope_type="cat", swiglu_mlp=True, swiglu_align_to=0, global_pool="mean")),
    "EVA-02 B (q/k/v, scale_mlp)": ("eva02_base_patch14_224", dict(qkv_fused=False, scale_mlp=True, ref_feat_shape=(16, 16))),
    "EVA-02 B 448": ("eva02_base_patch14_448", dict(image_size=448, ref_feat_shape=(16, 16), layer_norm_eps=1e-6)),
    "EVA-02 CLIP B/16": ("eva02_base_patch16_clip_224", dict(scale_attn_inner=True, global_pool="cls")),
}
TOLERANCE = 1e-4


def reference(name: str, size: tuple[int, int]):
    """A random timm Eva of ``name``; DINOv3 pooled on its class token as upstream (and our loader)
    does, its periods rounded to bfloat16 as timm's model card does to match the original weights."""
    eva = timm_eva(name, dict(global_pool="token") if "dinov3" in name else {}, size)
    if "dinov3" in name:
        eva.rope.periods = eva.rope.periods.to(torch.bfloat16).to(torch.float32)
    return eva


def write(state: dict[str, torch.Tensor], path):
    state = {key: value.contiguous() for key, value in state.items()}
    save_file(state, path) if path.suffix == ".safetensors" else torch.save(state, path)
    return path


def images(size: tuple[int, int], seed: int = 1) -> torch.Tensor:
    return torch.randn(2, 3, *size, generator=torch.Generator().manual_seed(seed))


def errors(model: vx.ViT, tokens: torch.Tensor, attentions: list[torch.Tensor], x: torch.Tensor) -> tuple[float, float]:
    """(largest final-token error, largest attention error over every layer) of our capture."""
    cap = vx.capture(model, x)
    assert cap.tokens.shape[2] == tokens.shape[1] and len(attentions) == cap.attentions.shape[1]
    token_error = (model.norm(cap.tokens[:, -1]) - tokens).abs().max().item()
    attention_error = max((cap.attentions[:, layer] - found).abs().max().item() for layer, found in enumerate(attentions))
    return token_error, attention_error


@pytest.mark.parametrize("suffix", [".safetensors", ".pth"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_timm_eva_file_gives_timms_tokens_and_attention(tmp_path, family, suffix):
    name, expected = FAMILIES[family]
    own, other = sizes(name)
    eva = reference(name, own)
    path = write(eva.state_dict(), tmp_path / f"{name}{suffix}")
    for size in (own, other):
        model = vx.load_model(path, num_heads=2, image_size=size)
        for field, value in expected.items():
            assert getattr(model.config, field) == (value if field != "image_size" else size), field
        x = images(size)
        with torch.no_grad():
            tokens = eva.forward_features(x)
            logits = eva.forward_head(tokens)
        token_error, attention_error = errors(model, tokens, timm_attentions(eva, x), x)
        assert token_error < TOLERANCE and attention_error < TOLERANCE, (size, token_error, attention_error)
        with torch.no_grad():
            assert (model(x) - logits).abs().max() < TOLERANCE


def test_float32_periods_give_timms_own_unrounded_numerics(tmp_path):
    eva = timm_eva("vit_small_patch16_dinov3", dict(global_pool="token"), (224, 224))
    path = write(eva.state_dict(), tmp_path / "dinov3.safetensors")
    x = images((224, 320))
    with torch.no_grad():
        tokens = eva.forward_features(x)
    exact = vx.load_model(path, num_heads=2, image_size=(224, 320), rope_periods_dtype="float32")
    rounded = vx.load_model(path, num_heads=2, image_size=(224, 320))
    assert max(errors(exact, tokens, timm_attentions(eva, x), x)) < TOLERANCE
    with torch.no_grad():
        assert (rounded.forward_features(x) - tokens).abs().max() > 1e-6  # the periods do matter


def meta_layout(state: dict[str, torch.Tensor], head_dim: int) -> dict[str, torch.Tensor]:
    """A timm DINOv3 state dict as Meta's original checkpoints name it: storage tokens, ls1.gamma,
    one qkv bias with a bias mask (the keys' part masked, holding anything), SwiGLU w1/w2/w3,
    the mask token, and the rotary periods stored in bfloat16."""
    swiglu = any(".mlp.fc1_g." in key for key in state)
    periods = 100.0 ** (2 * torch.arange(head_dim // 4, dtype=torch.float32) / (head_dim // 2))
    out = {"mask_token": torch.zeros_like(state["cls_token"]), "rope_embed.periods": periods.to(torch.bfloat16)}
    for key, value in state.items():
        if key.endswith("attn.v_bias"):
            continue
        if key.endswith("attn.q_bias"):
            base = key.removesuffix("q_bias")
            out[base + "qkv.bias"] = torch.cat([value, torch.full_like(value, 7.0), state[base + "v_bias"]])
            out[base + "qkv.bias_mask"] = torch.cat([torch.ones_like(value), torch.zeros_like(value), torch.ones_like(value)])
            continue
        key = key.replace("reg_token", "storage_tokens").replace("gamma_1", "ls1.gamma").replace("gamma_2", "ls2.gamma")
        if swiglu:
            key = key.replace("mlp.fc1_g.", "mlp.w1.").replace("mlp.fc1_x.", "mlp.w2.").replace("mlp.fc2.", "mlp.w3.")
        out[key] = value
    return out


@pytest.mark.parametrize("name", ["vit_small_patch16_dinov3_qkvb", "vit_small_plus_patch16_dinov3"])
def test_metas_original_dinov3_layout_loads_and_its_periods_give_the_heads(tmp_path, name):
    eva = reference(name, (224, 224))
    path = write(meta_layout(eva.state_dict(), head_dim=32), tmp_path / "dinov3_vits16_pretrain.pth")
    model = vx.load_model(path, image_size=(224, 320))  # no num_heads: the 8 periods say hd 32
    assert model.config.num_heads == 2 and model.config.rope_temperature == 100.0
    assert model.config.rope_periods_dtype == "bfloat16" and model.config.reg_tokens == 4
    x = images((224, 320))
    with torch.no_grad():
        tokens = eva.forward_features(x)
    assert max(errors(model, tokens, timm_attentions(eva, x), x)) < TOLERANCE


def test_periods_of_no_temperature_are_refused(tmp_path):
    state = meta_layout(reference("vit_small_patch16_dinov3", (224, 224)).state_dict(), head_dim=32)
    state["rope_embed.periods"] = torch.rand(8)
    with pytest.raises(vx.CheckpointError, match="rotary periods are not those of a DINOv3"):
        vx.load_model(write(state, tmp_path / "meta.pth"))


# ----------------------------------------------------------------------------- Hugging Face


def hf_dinov3(gated: bool):
    from transformers import DINOv3ViTConfig, DINOv3ViTModel

    config = DINOv3ViTConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128, num_register_tokens=4,
        use_gated_mlp=gated, hidden_act="silu" if gated else "gelu", key_bias=gated, proj_bias=not gated,
        attn_implementation="eager",
    )
    model = randomize(DINOv3ViTModel(config))
    with torch.no_grad():
        for layer in model.model.layer:  # peaked attention, so that a wrong rotation shows
            layer.attention.q_proj.weight.mul_(4)
    # The original periods, rounded to bfloat16 (transformers computes them in float32).
    rope = model.rope_embeddings
    rope.inv_freq = 1 / (1 / rope.inv_freq).to(torch.bfloat16).to(torch.float32)
    return model


@pytest.mark.parametrize("gated", [False, True], ids=["gelu MLP, no k bias", "gated MLP, k bias, no proj bias"])
def test_a_hugging_face_dinov3_folder_gives_its_tokens_and_attention(tmp_path, gated):
    reference_model = hf_dinov3(gated)
    reference_model.save_pretrained(tmp_path)
    for size in ((224, 224), (224, 320)):
        model = vx.load_model(tmp_path, image_size=size)
        assert model.config.swiglu_mlp == gated and model.config.rope_type == "dinov3"
        x = images(size)
        with torch.no_grad():
            out = reference_model(pixel_values=x, output_attentions=True)
        token_error, attention_error = errors(model, out.last_hidden_state, list(out.attentions), x)
        assert token_error < TOLERANCE and attention_error < TOLERANCE, (size, token_error, attention_error)
        with torch.no_grad():
            assert (model(x) - out.pooler_output).abs().max() < TOLERANCE  # the class token, as upstream


# ----------------------------------------------------------------------------- our format, resizing


@pytest.mark.parametrize("name", ["vit_small_plus_patch16_dinov3", "eva02_base_patch14_224", "eva02_base_patch16_clip_224"])
def test_our_format_round_trips_rotary_and_swiglu_models(tmp_path, name):
    eva = reference(name, (224, 224))
    model = vx.load_model(write(eva.state_dict(), tmp_path / "timm.safetensors"), num_heads=2)
    vx.save_model(model, tmp_path / "ours.safetensors")
    again = vx.load_model(tmp_path / "ours.safetensors")
    assert again.config == model.config
    x = images((224, 224))
    with torch.no_grad():
        torch.testing.assert_close(again(x), model(x), atol=0, rtol=0)


def test_resize_model_to_patch_8_is_the_forward_at_patch_8(tmp_path):
    eva = reference("vit_small_patch16_dinov3", (224, 224))
    path = write(eva.state_dict(), tmp_path / "dinov3.safetensors")
    model = vx.load_model(path, num_heads=2)
    x = images((224, 224))
    resized = vx.resize_model(model, patch_size=8)
    loaded = vx.load_model(path, num_heads=2, patch_size=8)
    with torch.no_grad():
        expected = model(x, patch_size=8)
        torch.testing.assert_close(resized(x), expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(loaded(x), expected, atol=1e-5, rtol=1e-5)
    assert resized.pos_embed is None and vx.capture(resized, x).grid_size == (28, 28)


def test_resize_model_resamples_eva02s_learned_positions_and_keeps_its_rotation(tmp_path):
    eva = reference("eva02_tiny_patch14_224", (224, 224))
    model = vx.load_model(write(eva.state_dict(), tmp_path / "eva02.safetensors"), num_heads=2)
    resized = vx.resize_model(model, image_size=(224, 322))
    x = images((224, 322))
    with torch.no_grad():  # timm's dynamic size resamples the positions the same way
        torch.testing.assert_close(resized.forward_features(x), eva.forward_features(x), atol=1e-4, rtol=1e-4)


def test_the_family_is_told_from_keys_and_name(tmp_path):
    eva = reference("eva02_base_patch14_224", (224, 224))
    assert from_eva.recognises(eva.state_dict())
    state = {key: value for key, value in eva.state_dict().items() if key != "pos_embed"}
    with pytest.raises(vx.CheckpointError, match=re.escape("neither learned position embeddings nor a DINOv3's registers")):
        vx.load_model(write(state, tmp_path / "eva.safetensors"))


def test_a_timm_hub_folder_names_its_architecture_heads_and_normalisation(tmp_path):
    import json

    from timm.models._hub import save_for_hf

    eva = reference("vit_small_plus_patch16_dinov3", (224, 224))
    save_for_hf(eva, tmp_path / "my_model")
    model = vx.load_model(tmp_path / "my_model", image_size=(224, 320))  # heads from model_args
    assert model.config.num_heads == 2 and model.config.mean == pytest.approx((0.485, 0.456, 0.406))
    x = images((224, 320))
    with torch.no_grad():
        tokens = eva.forward_features(x)
    assert max(errors(model, tokens, timm_attentions(eva, x), x)) < TOLERANCE
    config = json.loads((tmp_path / "my_model" / "config.json").read_text())
    config["model_args"]["depth"] = 100_000
    (tmp_path / "my_model" / "config.json").write_text(json.dumps(config))
    with pytest.raises(vx.CheckpointError, match="with depth 100000: its tensors have depth 2"):
        vx.load_model(tmp_path / "my_model")
