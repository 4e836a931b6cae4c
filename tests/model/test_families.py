"""Model families beyond the plain ViT: DeiT's distillation token, CLIP's image tower (norm_pre,
no patch-embedding bias, quick GELU) and SigLIP's attention-pool head, each against timm built
with random weights and against transformers where it has the family."""
from __future__ import annotations

import pytest
import timm
import torch
from safetensors.torch import save_file

import vit_explorer as vx
from vit_explorer import analysis

from helpers import randomize

TINY = dict(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=2)
# timm name, its extra model arguments, what our loader must be told that weights cannot say
TIMM_FAMILIES = {
    "deit distilled": ("deit_small_distilled_patch16_224", dict(num_classes=5), {}),
    "deit distilled headless": ("deit_small_distilled_patch16_224", dict(num_classes=0), {}),
    "clip openai (quick gelu)": (
        "vit_base_patch16_clip_quickgelu_224", dict(num_classes=6),
        dict(act_layer="quick_gelu"),
    ),
    "clip headless": ("vit_base_patch16_clip_224", dict(num_classes=0), {}),
    "siglip map head": ("vit_base_patch16_siglip_224", dict(num_classes=0), {}),
    "siglip map head + classifier": ("vit_base_patch16_siglip_224", dict(num_classes=4), {}),
    "dinov2 registers": ("vit_small_patch14_reg4_dinov2", dict(num_classes=0), {}),
    "deit3": ("deit3_small_patch16_224", dict(num_classes=5), {}),
}


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


def _images(batch: int = 2, size: int = 32) -> torch.Tensor:
    return torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(1))


def timm_reference(name: str, **changes) -> torch.nn.Module:
    return randomize(timm.create_model(name, pretrained=False, **{**TINY, **changes}))


def load_from_timm(reference: torch.nn.Module, path, **known) -> vx.ViT:
    save_file({key: value.contiguous() for key, value in reference.state_dict().items()}, path)
    return vx.load_model(path, num_heads=2, **known)


@pytest.mark.parametrize("family", list(TIMM_FAMILIES))
def test_timm_parity(tmp_path, family):
    name, changes, known = TIMM_FAMILIES[family]
    reference = timm_reference(name, **changes)
    model = load_from_timm(reference, tmp_path / "timm.safetensors", **known)
    assert model.config.num_prefix_tokens == reference.num_prefix_tokens
    x = _images()
    torch.testing.assert_close(model.forward_features(x), reference.forward_features(x), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(model(x), reference(x), atol=1e-5, rtol=1e-5)
    # The capture path (explicit softmax everywhere) gives the same output.
    torch.testing.assert_close(vx.capture(model, x).logits, reference(x), atol=1e-5, rtol=1e-5)


def test_so400m_has_its_publishers_heads(tmp_path):
    """1152 channels in 16 heads of 72 (SigLIP So400m), which no tensor says: the shapes'
    convention of 64 channels a head would give 18 and load a model that is silently wrong."""
    reference = randomize(timm.create_model("vit_so400m_patch14_siglip_224", pretrained=False, img_size=28, depth=1))
    save_file({key: value.contiguous() for key, value in reference.state_dict().items()}, tmp_path / "so400m.safetensors")
    model = vx.load_model(tmp_path / "so400m.safetensors")
    assert model.config.num_heads == reference.blocks[0].attn.num_heads == 16
    x = _images(size=28)
    torch.testing.assert_close(model.forward_features(x), reference.forward_features(x), atol=1e-4, rtol=1e-5)


def test_perception_encoder_matches_timm(tmp_path):
    """Meta's PE core: rotary positions that no tensor records (patch indices from 1, width first,
    on its own grid) and an 8-head pool that reads the class token too, told from a class token
    beside an attention pool; read as a CLIP tower it loaded and differed from timm by 3e-3."""
    reference = timm_reference(
        "vit_pe_core_tiny_patch16_384", num_classes=5, ref_feat_shape=(4, 4), dynamic_img_size=True,
    )  # ref_feat_shape: every PE's own grid (24 x 24 at 384 px), here TINY's
    model = load_from_timm(reference, tmp_path / "pe.safetensors")
    assert model.config.rope_type == "cat" and model.config.attn_pool_num_heads == 8 and model.config.pool_include_prefix
    x = _images()
    torch.testing.assert_close(model.forward_features(x), reference.forward_features(x), atol=1e-5, rtol=1e-5)
    captured = vx.capture(model, x)
    # Its head is the projection into its text tower's space, not classes: left out, the output is
    # the pooled vector.
    assert model.config.num_classes == 0
    pooled = reference.forward_head(reference.forward_features(x), pre_logits=True)
    torch.testing.assert_close(captured.logits, pooled, atol=1e-5, rtol=1e-5)
    # The probe reads every token: its maps are over the patches, its query weighs every token.
    assert captured.pool_attentions.shape[-1] == captured.num_tokens
    assert analysis.pool_maps(captured).shape == (8, 4, 4)
    torch.testing.assert_close(analysis.map_query(captured).sum(dim=-1), torch.ones(2, 1))
    # At another size its positions are resampled and its rotation follows the grid, as timm's.
    larger = vx.load_model(tmp_path / "pe.safetensors", num_heads=2, image_size=(48, 32))
    wide = _images(size=48)[..., :32]
    torch.testing.assert_close(larger.forward_features(wide), reference.forward_features(wide), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["vit_pe_spatial_tiny_patch16_512", "vit_pe_lang_large_patch14_448"])
def test_perception_encoder_without_a_final_norm_matches_timm(tmp_path, name):
    """PE spatial and lang: no final norm, the patches' mean unnormed; lang with LayerScale (an
    Eva's gamma_1, read by the Eva reader)."""
    reference = timm_reference(name, ref_feat_shape=(4, 4), dynamic_img_size=True)
    model = load_from_timm(reference, tmp_path / "pe.safetensors")
    assert model.config.rope_type == "cat" and not model.config.final_norm and model.config.global_pool == "mean"
    x = _images()
    torch.testing.assert_close(model.forward_features(x), reference.forward_features(x), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(vx.capture(model, x).logits, reference(x), atol=1e-5, rtol=1e-5)


def test_internvit_matches_timm(tmp_path):
    """InternViT-300M (InternVL's tower in timm): LayerScale and no final norm."""
    reference = timm_reference("vit_intern300m_patch14_448", num_classes=0)
    model = load_from_timm(reference, tmp_path / "intern.safetensors")
    assert not model.config.final_norm and model.config.init_values is not None
    x = _images()
    torch.testing.assert_close(model.forward_features(x), reference.forward_features(x), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(vx.capture(model, x).logits, reference(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["vit_pe_spatial_gigantic_patch14_448", "vit_pe_core_gigantic_patch14_448"])
def test_a_gigantic_perception_encoder_is_refused(tmp_path, name):
    reference = timm.create_model(name, pretrained=False, depth=1, img_size=28)
    save_file({key: value.contiguous() for key, value in reference.state_dict().items()}, tmp_path / "g.safetensors")
    with pytest.raises(vx.CheckpointError, match="gigantic Perception Encoder"):
        vx.load_model(tmp_path / "g.safetensors")


def test_weights_reveal_the_architecture(tmp_path):
    deit = load_from_timm(timm_reference("deit_small_distilled_patch16_224", num_classes=5), tmp_path / "d.safetensors")
    assert deit.config.dist_token and deit.config.num_prefix_tokens == 2
    clip = load_from_timm(timm_reference("vit_base_patch16_clip_224", num_classes=0), tmp_path / "c.safetensors")
    assert clip.config.pre_norm and not clip.config.patch_bias and clip.config.num_classes == 0
    assert clip.config.layer_norm_eps == 1e-5  # as timm builds a CLIP tower; a plain ViT has 1e-6
    siglip = load_from_timm(timm_reference("vit_base_patch16_siglip_224", num_classes=0), tmp_path / "s.safetensors")
    assert siglip.config.global_pool == "map" and not siglip.config.class_token


def test_distilled_capture_keeps_two_prefix_tokens(tmp_path):
    model = load_from_timm(timm_reference("deit_small_distilled_patch16_224", num_classes=5), tmp_path / "d.safetensors")
    cap = vx.capture(model, _images(1))
    assert cap.num_prefix_tokens == 2 and cap.class_token
    assert cap.attentions.shape[-1] == 2 + 16
    # The class token's map is row 0 over the patches, after both prefix tokens.
    maps = analysis.head_maps(cap, -1, class_token=True)
    torch.testing.assert_close(maps.flatten(1), cap.attentions[0, -1, :, 0, 2:])
    relevance = analysis.attribution(model, _images(1))
    assert relevance.shape == (1, 4, 4)


def test_attention_pool_probe_is_captured(tmp_path):
    reference = timm_reference("vit_base_patch16_siglip_224", num_classes=0)
    model = load_from_timm(reference, tmp_path / "s.safetensors")
    x = _images()
    cap = vx.capture(model, x)
    assert cap.pool_attentions.shape == (2, 2, 1, 16)
    torch.testing.assert_close(cap.pool_attentions.sum(-1), torch.ones(2, 2, 1))
    # timm's own softmax of the probe against the final tokens' keys.
    pool = reference.attn_pool
    tokens = reference.forward_features(x)
    q = pool.q(pool.latent).reshape(1, 1, 2, 32).transpose(1, 2)
    k = pool.kv(tokens).reshape(2, 16, 2, 2, 32).permute(2, 0, 3, 1, 4)[0]
    expected = ((q * pool.scale) @ k.transpose(-2, -1)).softmax(-1)
    torch.testing.assert_close(cap.pool_attentions, expected, atol=1e-6, rtol=1e-5)
    # A model without a MAP head has none; capture never switches shared modules.
    plain = load_from_timm(timm_reference("vit_small_patch16_224", num_classes=0), tmp_path / "p.safetensors")
    assert vx.capture(plain, x).pool_attentions is None


def test_new_fields_round_trip_through_our_files(tmp_path):
    config = vx.ViTConfig(
        image_size=16, patch_size=4, num_classes=3, embed_dim=32, depth=1, num_heads=2,
        dist_token=True, pre_norm=True, patch_bias=False, act_layer="quick_gelu",
    )
    model = randomize(vx.ViT(config))
    vx.save_model(model, tmp_path / "m.safetensors")
    loaded = vx.load_model(tmp_path / "m.safetensors")
    assert loaded.config == config
    x = torch.randn(1, 3, 16, 16)
    torch.testing.assert_close(loaded(x), model(x))


@pytest.mark.parametrize("changes, message", [
    (dict(dist_token=True, class_token=False, global_pool="mean"), "dist_token=True needs"),
    (dict(act_layer="relu"), "act_layer must be one of"),
    (dict(global_pool="max"), "global_pool must be"),
])
def test_impossible_configs_say_why(changes, message):
    with pytest.raises(ValueError, match=message):
        vx.ViTConfig(**changes)


# ----------------------------------------------------------------------------- Hugging Face

HF_TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=32, patch_size=8)


def hf_reference(kind: str):
    import transformers as T

    if kind == "deit distilled":
        config = T.DeiTConfig(**HF_TINY, intermediate_size=128, num_labels=3)
        return T.DeiTForImageClassificationWithTeacher(config)
    if kind == "deit backbone":
        return T.DeiTModel(T.DeiTConfig(**HF_TINY, intermediate_size=128), add_pooling_layer=False)
    if kind == "dinov2":
        return T.Dinov2Model(T.Dinov2Config(**HF_TINY, mlp_ratio=2, layerscale_value=0.1))
    if kind == "dinov2 registers":
        config = T.Dinov2WithRegistersConfig(**HF_TINY, mlp_ratio=2, num_register_tokens=2)
        return T.Dinov2WithRegistersModel(config)
    if kind == "clip vision":
        return T.CLIPVisionModel(T.CLIPVisionConfig(**HF_TINY, intermediate_size=128))
    if kind == "siglip vision":
        return T.SiglipVisionModel(T.SiglipVisionConfig(**HF_TINY, intermediate_size=128))
    raise AssertionError(kind)


def hf_outputs(kind: str, reference, x: torch.Tensor) -> tuple[str, torch.Tensor]:
    """(which of our outputs to compare, the reference's): logits, normed tokens or pooled."""
    out = reference(pixel_values=x)
    if kind == "deit distilled":
        return "logits", out.logits
    if kind in ("clip vision", "siglip vision"):
        return "pooled", out.pooler_output
    return "features", out.last_hidden_state


@pytest.mark.parametrize(
    "kind", ["deit distilled", "deit backbone", "dinov2", "dinov2 registers", "clip vision", "siglip vision"]
)
def test_huggingface_parity(tmp_path, kind):
    reference = randomize(hf_reference(kind))
    reference.save_pretrained(tmp_path)
    model = vx.load_model(tmp_path)
    x = _images()
    what, expected = hf_outputs(kind, reference, x)
    if what == "features" and kind == "dinov2 registers":
        # Our layout puts the registers right after the class token, as transformers does.
        assert model.config.reg_tokens == 2 and model.config.no_embed_class
    ours = {"logits": model, "pooled": model, "features": model.forward_features}[what](x)
    if kind == "clip vision":
        ours = model.forward_features(x)[:, 0]  # the normed class token, as pooler_output
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)


def test_huggingface_clip_tower_of_the_whole_model(tmp_path):
    import transformers as T

    config = T.CLIPConfig(
        vision_config=dict(**HF_TINY, intermediate_size=128),
        text_config=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64),
        projection_dim=16,
    )
    reference = randomize(T.CLIPModel(config))
    reference.save_pretrained(tmp_path)
    model = vx.load_model(tmp_path)
    assert model.config.act_layer == "quick_gelu" and model.config.layer_norm_eps == 1e-5
    assert model.config.num_classes == 0  # the projection into the text space is no classifier
    x = _images()
    expected = reference.vision_model(pixel_values=x).pooler_output
    torch.testing.assert_close(model.forward_features(x)[:, 0], expected, atol=1e-5, rtol=1e-5)


def test_huggingface_siglip2_naflex_tower_at_its_grid(tmp_path):
    """SigLIP 2's NaFlex tower (flattened patches through a Linear, its positions resized to each
    image's grid) is our ViT at its own square grid: 16 positions, 4 x 4 patches of 8."""
    import transformers as T
    from transformers.models.siglip2.image_processing_siglip2 import convert_image_to_patches

    settings = {key: value for key, value in HF_TINY.items() if key != "image_size"}
    reference = randomize(T.Siglip2VisionModel(T.Siglip2VisionConfig(**settings, intermediate_size=128, num_patches=16)))
    reference.save_pretrained(tmp_path)
    model = vx.load_model(tmp_path)
    assert model.config.grid_size == (4, 4) and model.config.global_pool == "map"
    x = _images()
    patches = torch.stack([convert_image_to_patches(image, 8) for image in x])  # (B, 16, 8 * 8 * 3)
    expected = reference(
        pixel_values=patches, pixel_attention_mask=torch.ones(2, 16, dtype=torch.long),
        spatial_shapes=torch.tensor([[4, 4]] * 2),
    ).pooler_output
    torch.testing.assert_close(model(x), expected, atol=1e-5, rtol=1e-5)


def test_pool_rollout_through_identity_layers_is_the_probe_map(tmp_path):
    model = load_from_timm(timm_reference("vit_base_patch16_siglip_224", num_classes=0), tmp_path / "s.safetensors")
    cap = vx.capture(model, _images(1))
    identity = torch.eye(16)[None]
    rolled = analysis.pool_rollout_map(cap.pool_attentions, identity, cap.grid_size, 0)
    torch.testing.assert_close(rolled[0], analysis.pool_maps(cap).mean(0))


def test_masks_figure_darkens_the_dropped_patches():
    from vit_explorer import figures

    masks = torch.zeros(2, 2, 3, dtype=torch.bool)
    masks[0, 0, 0] = True
    fig = figures.attention_masks_grid(torch.zeros(16, 24, 3, dtype=torch.uint8), masks, 0.6, layer=3)
    assert fig.layout.title.text == "Patches holding 60% of the class token's attention in layer 3, per head"
    veils = [trace.z for trace in fig.data if trace.type == "heatmap"]
    assert veils[0][0][0] == 0.0 and veils[0][1][2] == 1.0 and veils[1].min() == 1.0


def test_aimv2_matches_timm(tmp_path):
    """Apple's AIMv2 as timm builds it: RMSNorm everywhere (eps 1e-5), a norm on the patch
    embeddings, SwiGLU without biases, an output projection without one, no class token, the
    patches averaged after the final norm; CLIP's mean and std, told by that structure."""
    reference = timm_reference("aimv2_large_patch14_224", num_classes=0, patch_size=8, mlp_ratio=2.75)
    for module in reference.modules():  # RMSNorm weights away from 1, so that a norm left out shows
        if isinstance(module, timm.layers.RmsNorm):
            module.weight.normal_(1.0, 0.3)
    model = load_from_timm(reference, tmp_path / "aimv2.safetensors")
    config = model.config
    assert (config.norm_layer, config.patch_norm, config.linear_bias, config.class_token, config.layer_norm_eps) == (
        "rmsnorm", True, False, False, 1e-5)
    assert config.normalization_source.startswith("structure: AIMv2")
    x = _images()
    captured = vx.capture(model, x)
    expected = [reference.norm_pre(reference._pos_embed(reference.patch_embed(x)))]
    for block in reference.blocks:
        expected.append(block(expected[-1]))
    # float32's own spread (tokens up to 4: 5e-5); in float64 the two agree to 1e-13
    torch.testing.assert_close(captured.tokens, torch.stack(expected, 1), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(captured.logits, reference(x), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(model.double()(x.double()), reference.double()(x.double()), atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("name", ["aimv2_large_patch14_224", "aimv2_huge_patch14_336", "aimv2_1b_patch14_224", "aimv2_3b_patch14_448"])
def test_aimv2_loads_at_full_size_with_its_publishers_heads(name):
    """Every AIMv2 tensor, as timm names them, is the shape our model infers for it, and the heads
    are 128 channels wide at every width, which no tensor says: 64 a head loaded AIMv2-L with 16
    heads instead of 8, and it differed from timm by 5e-2 without a word."""
    from vit_explorer.weights.infer import infer_config

    with torch.device("meta"):
        reference = timm.create_model(name, pretrained=False)
        state = reference.state_dict()
        config = infer_config(state, {}, {}, name)
        ours = vx.ViT(config)
    assert {key: value.shape for key, value in ours.state_dict().items()} == {key: value.shape for key, value in state.items()}
    assert config.num_heads == reference.blocks[0].attn.num_heads
    assert config.img_size == reference.patch_embed.img_size
