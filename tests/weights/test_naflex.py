"""timm's NaFlexViT (naflexvit_*) saved as timm saves it, random weights: every layer's tokens and
the output as timm's NaFlexVit computes them at native aspect ratios (3 x 5 and 7 x 4 patch grids,
from a 6 x 6 position table: shrunk, grown, both), as an image and as NaFlex's patches with
patch_valid; a padded batch of two grids is each picture alone; the explorer's truths on a NaFlex
model; timm's NaFlex preprocessing; the variants we do not read, a sentence each."""
from __future__ import annotations

import json

import pytest
import timm
import torch
from safetensors.torch import save_file

import vit_explorer as vx
from vit_explorer import analysis
from vit_explorer.weights import from_naflex

from helpers import randomize

PATCH = 8
TINY = dict(embed_dim=64, depth=2, num_heads=2, patch_size=PATCH, pos_embed_grid_size=(6, 6))
GRIDS = [(3, 5), (7, 4)]
# timm name -> (number of classes, what our config must say of its positions and activation)
VARIANTS = {
    "naflexvit_base_patch16_gap": (5, ("bicubic", False, "gelu")),
    "naflexvit_base_patch16_par_gap": (0, ("bicubic", True, "gelu")),
    "naflexvit_base_patch16_parfac_gap": (0, ("bilinear_no_antialias", True, "gelu")),
    "naflexvit_base_patch16_map": (5, ("bicubic", False, "gelu")),
    "naflexvit_so150m2_patch16_reg1_gap": (0, ("bicubic", False, "gelu")),
    "naflexvit_so150m2_patch16_reg1_map": (0, ("bicubic", False, "gelu")),
    "naflexvit_base_patch16_siglip": (0, ("bilinear", False, "gelu_tanh")),
    "naflexvit_so400m_patch16_siglip": (0, ("bilinear", False, "gelu_tanh")),
}


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


def timm_naflex(name: str, num_classes: int = 0, **changes) -> torch.nn.Module:
    return randomize(timm.create_model(name, pretrained=False, num_classes=num_classes, **{**TINY, **changes}))


def saved(reference: torch.nn.Module, path) -> str:
    save_file({key: value.contiguous() for key, value in reference.state_dict().items()}, path)
    return path


def images(grid: tuple[int, int], batch: int = 2, seed: int = 1) -> torch.Tensor:
    return torch.randn(batch, 3, grid[0] * PATCH, grid[1] * PATCH, generator=torch.Generator().manual_seed(seed))


def naflex_input(pictures: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """timm's NaFlex batch of (3, H, W) pictures of any grids: patches, coordinates, patch_valid, padded."""
    from timm.data.naflex_transforms import patchify_image

    patches, coords, valid = zip(*(patchify_image(picture, (PATCH, PATCH)) for picture in pictures))
    length = max(len(p) for p in patches)
    pad = lambda t: torch.cat([t, t.new_zeros(length - len(t), *t.shape[1:])])  # noqa: E731
    return dict(
        patches=torch.stack([pad(p) for p in patches]), patch_coord=torch.stack([pad(c) for c in coords]),
        patch_valid=torch.stack([pad(v) for v in valid]),
    )


def timm_tokens(reference, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """(B, depth + 1, N, D): the tokens entering the first block, then leaving each, in NaFlex mode."""
    embedded = reference._forward_embeds(batch["patches"], batch["patch_coord"], batch["patch_valid"], None)
    tokens = [embedded["patches"]]
    for block in reference.blocks:
        tokens.append(block(tokens[-1], attn_mask=embedded["attn_mask"]))
    return torch.stack(tokens, 1)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_naflexvit_matches_timm_at_its_aspect_ratios(tmp_path, name):
    num_classes, (interpolation, ar_preserving, act) = VARIANTS[name]
    reference = timm_naflex(name, num_classes)
    # Told by the structure under any name (SigLIP 2's too); aspect-preserving positions by the name only.
    path = saved(reference, tmp_path / (f"{name}.safetensors" if "_par_" in name else "model.safetensors"))
    for grid in GRIDS:
        model = vx.load_model(path, num_heads=2, image_size=(grid[0] * PATCH, grid[1] * PATCH))
        config = model.config
        assert (config.pos_embed_interpolation, config.pos_embed_ar_preserving, config.act_layer) == (interpolation, ar_preserving, act)
        assert config.num_prefix_tokens == reference.num_prefix_tokens and config.max_patches == 576
        x = images(grid)
        captured = vx.capture(model, x)
        batch = naflex_input(list(x))
        torch.testing.assert_close(captured.tokens, timm_tokens(reference, batch), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(captured.logits, reference(batch), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(captured.logits, reference(x), atol=1e-4, rtol=1e-4)  # timm's image path
    assert vx.load_model(path, num_heads=2).config.grid_size == (6, 6)  # its own: the table's grid


def test_a_padded_batch_of_two_grids_is_each_picture_alone(tmp_path):
    """timm batches pictures of different grids padded, patch_valid masking the padding out of every
    attention and the pool: each real patch's tokens and each output are the picture's alone, which
    is how the explorer reads several NaFlex pictures (one pass each, at its own grid)."""
    reference = timm_naflex("naflexvit_base_patch16_map", 5)  # a register and a probe that reads the patches
    path = saved(reference, tmp_path / "map.safetensors")
    pictures = [images(grid, batch=1, seed=index)[0] for index, grid in enumerate(GRIDS)]
    batch = naflex_input(pictures)
    assert not batch["patch_valid"].all()
    expected_tokens, expected = timm_tokens(reference, batch), reference(batch)
    for index, picture in enumerate(pictures):
        model = vx.load_model(path, num_heads=2, image_size=tuple(picture.shape[1:]))
        alone = vx.capture(model, picture[None])
        tokens = alone.num_tokens
        torch.testing.assert_close(alone.tokens[0], expected_tokens[index, :, :tokens], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(alone.logits[0], expected[index], atol=1e-4, rtol=1e-4)


def test_the_full_size_configs_are_inferred_on_the_meta_device():
    """NaFlexViT-B/16 and SigLIP 2's So400m/16 NaFlex at full size: every tensor timm saves is the
    shape our model infers for it (16 heads of 72 for the So400m, which no tensor says)."""
    from vit_explorer.weights.infer import infer_config

    for name, expected in [
        ("naflexvit_base_patch16_gap", (768, 12, 12, 3072, (256, 256), 4)),
        ("naflexvit_so400m_patch16_siglip", (1152, 27, 16, 4304, (256, 256), 0)),
    ]:
        with torch.device("meta"):
            state = timm.create_model(name, pretrained=False).state_dict()
            converted, known = from_naflex.convert(state, name)
            config = infer_config(converted, known, {}, name)
            ours = vx.ViT(config)
        assert {key: value.shape for key, value in ours.state_dict().items()} == {key: value.shape for key, value in converted.items()}
        assert (config.embed_dim, config.depth, config.num_heads, config.mlp_hidden, config.img_size, config.reg_tokens) == expected


def test_naflex_truths(tmp_path):
    """The explorer's own truths on a NaFlex model at a 3 x 5 grid: capture changes nothing,
    attention rows sum to 1, a knock-out resumed from the intact pass is the whole pass, rollout and
    the probe's maps are over the picture's grid."""
    reference = timm_naflex("naflexvit_base_patch16_map", 5)
    model = vx.load_model(saved(reference, tmp_path / "map.safetensors"), num_heads=2, image_size=(24, 40))
    x = images((3, 5))
    intact = vx.capture(model, x)
    torch.testing.assert_close(intact.logits, model(x), atol=1e-5, rtol=1e-5)
    assert intact.grid_size == (3, 5) and intact.num_prefix_tokens == 1
    attentions = intact.attentions
    torch.testing.assert_close(attentions.sum(-1), torch.ones(attentions.shape[:-1]), atol=1e-5, rtol=0)
    knock_out = vx.KnockOut(heads={1: (0,)}, mlp=(1,))
    whole = vx.capture(model, x, knock_out=knock_out)
    resumed = vx.capture(model, x, knock_out=knock_out, intact=intact)
    torch.testing.assert_close(resumed.tokens, whole.tokens, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(whole.logits, intact.logits)
    vx.save_model(model, tmp_path / "ours.safetensors")  # our own file keeps the NaFlex settings
    reloaded = vx.load_model(tmp_path / "ours.safetensors")
    assert reloaded.config == model.config and reloaded.config.max_patches == 576
    torch.testing.assert_close(vx.capture(reloaded, x).tokens, intact.tokens, atol=0, rtol=0)
    rollout = analysis.attention_rollout(attentions, num_prefix_tokens=1)
    torch.testing.assert_close(rollout.sum(-1), torch.ones(rollout.shape[:-1]), atol=1e-4, rtol=0)
    assert analysis.pool_maps(intact).shape == (2, 3, 5)  # the probe (register excluded, as timm's) over the grid
    assert intact.pool_attentions.shape[-1] == 15


def test_sequence_size_is_timms():
    from timm.data.naflex_transforms import get_image_size_for_seq

    for height, width in [(300, 451), (451, 300), (16, 16), (1000, 37), (37, 1000), (224, 224), (5, 7), (4000, 3000)]:
        for patch, max_patches in [(16, 576), (16, 256), (14, 729), (8, 1024)]:
            expected = get_image_size_for_seq((height, width), patch, max_patches)[1]
            assert from_naflex.sequence_size(height, width, patch, max_patches) == expected


def test_our_preprocessing_is_timms_naflex_transform(tmp_path):
    """A non-square photo read as timm's eval transform reads it for a NaFlexViT (naflex=True: resized
    to at most max_seq_len patches, its aspect kept, bicubic; then its patches)."""
    from einops import rearrange
    from PIL import Image
    from timm.data import create_transform

    picture = Image.fromarray((torch.rand(300, 451, 3, generator=torch.Generator().manual_seed(2)) * 255).to(torch.uint8).numpy())
    config = vx.load_model(saved(timm_naflex("naflexvit_base_patch16_gap"), tmp_path / "gap.safetensors"), num_heads=2).config
    size = from_naflex.sequence_size(300, 451, PATCH, 64)
    transform = create_transform(
        input_size=(3, 48, 48), naflex=True, patch_size=PATCH, max_seq_len=64, patchify=True,
        interpolation="bicubic", mean=config.mean, std=config.std,
    )
    expected = transform(picture)
    grid_h, grid_w = (expected["patch_coord"].amax(0) + 1).tolist()
    assert size == (grid_h * PATCH, grid_w * PATCH) == (48, 80)
    ours = vx.preprocess(picture, config.replace(image_size=size))
    patches = rearrange(ours[0], "c (h p1) (w p2) -> (h w) (p1 p2 c)", p1=PATCH, p2=PATCH)
    torch.testing.assert_close(patches, expected["patches"], atol=1e-6, rtol=0)


def test_naflex_variants_we_do_not_read_are_a_sentence(tmp_path):
    def refusal(reference, file="naflex.safetensors") -> str:
        with pytest.raises(vx.CheckpointError) as refused:
            vx.load_model(saved(reference, tmp_path / file), num_heads=2)
        assert str(tmp_path) not in str(refused.value) and "\n" not in str(refused.value)
        return str(refused.value)

    radio = timm.create_model("naflexvit_base_patch16_radio_v3", pretrained=False, depth=1, embed_dim=64, num_heads=2, pos_embed_grid_size=(8, 8))
    assert "class token" in refusal(radio)
    rotary = timm.create_model("naflexvit_base_patch16_gap", pretrained=False, depth=1, embed_dim=64, num_heads=2, pos_embed="none", rope_type="axial")
    assert "without learned positions" in refusal(rotary)
    normed = timm.create_model("naflexvit_base_patch16_gap", pretrained=False, depth=1, embed_dim=64, num_heads=2, qk_norm=True)
    assert "does not fit our ViT" in refusal(normed)
    # A timm folder whose model_args ask for what we have not compared: refused; its architecture's name says "par".
    reference = timm_naflex("naflexvit_base_patch16_par_gap", depth=1)
    folder = tmp_path / "folder"
    folder.mkdir()
    saved(reference, folder / "model.safetensors")
    config = {
        "architecture": "naflexvit_base_patch16_par_gap", "num_classes": 0, "model_args": {"num_heads": 2, "depth": 1},
        "pretrained_cfg": {**reference.pretrained_cfg, "input_size": [3, 384, 384], "crop_pct": 1.0, "mean": [0.5] * 3, "std": [0.5] * 3},
    }
    (folder / "config.json").write_text(json.dumps(config))
    read = vx.load_model(folder).config  # its grid is its table's (384 px is timm's eval, any aspect within 576 patches)
    assert read.pos_embed_ar_preserving and read.grid_size == (6, 6) and read.resize_mode == "squash"
    for changes, refused in [
        ({"pos_embed_use_grid_sample": True}, "pos_embed_use_grid_sample, a setting we have not compared"),
        ({"pos_embed_interp_mode": "nearest"}, "pos_embed_interp_mode must be one of bicubic, bilinear"),
        ({"global_pool": "max"}, "global_pool, a setting"),
    ]:
        (folder / "config.json").write_text(json.dumps({**config, "model_args": {**config["model_args"], **changes}}))
        with pytest.raises(vx.CheckpointError, match=refused):
            vx.load_model(folder)


def test_inspect_reads_a_naflex_picture_at_its_own_aspect_ratio(tmp_path, monkeypatch, capsys):
    """python -m vit_explorer inspect sizes the picture as timm's NaFlex transform does: chelsea's
    451 x 300 px in at most 24 patches of 8 -> 48 x 32 px, 6 x 4 patches; its output is timm's."""
    import numpy as np
    from PIL import Image

    from vit_explorer import cli, figures

    monkeypatch.setattr(figures, "find_browser", lambda: None)
    monkeypatch.setattr(from_naflex, "DEFAULT_MAX_PATCHES", 24)
    reference = timm_naflex("naflexvit_base_patch16_gap", 5, depth=1, num_heads=1)  # 64 channels a head: no file says its heads
    path = saved(reference, tmp_path / "gap.safetensors")
    photo = tmp_path / "wide.png"
    Image.fromarray((torch.rand(300, 451, 3, generator=torch.Generator().manual_seed(3)) * 255).to(torch.uint8).numpy()).save(photo)
    out = tmp_path / "out"
    assert cli.main(["inspect", str(photo), "--weights", str(path), "--out", str(out), "--format", "html", "--tensors"]) == 0
    assert "the whole picture squeezed to 48x32 px" in capsys.readouterr().out
    config = vx.load_model(path).config.replace(image_size=(32, 48))
    x = vx.preprocess(Image.open(photo).convert("RGB"), config)
    with np.load(out / "capture.npz") as data:
        np.testing.assert_allclose(data["logits"], reference(x).numpy(), atol=1e-4, rtol=1e-4)


def test_transformers_siglip2_naflex_tower_at_its_aspect_ratios(tmp_path):
    """transformers' SigLIP 2 NaFlex tower resizes its 4 x 4 grid of positions to each picture's
    bilinearly (antialiased); it was read bicubic and differed off its square grid. Its processor's
    size rule (max_num_patches) is timm's."""
    import transformers as T
    from transformers.models.siglip2.image_processing_siglip2 import convert_image_to_patches, get_image_size_for_max_num_patches

    settings = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, patch_size=PATCH, intermediate_size=128, num_patches=16)
    reference = randomize(T.Siglip2VisionModel(T.Siglip2VisionConfig(**settings)))
    reference.save_pretrained(tmp_path)
    for grid in GRIDS:
        model = vx.load_model(tmp_path, image_size=(grid[0] * PATCH, grid[1] * PATCH))
        assert model.config.pos_embed_interpolation == "bilinear"
        x = images(grid)
        patches = torch.stack([convert_image_to_patches(image, PATCH) for image in x])
        expected = reference(
            pixel_values=patches, pixel_attention_mask=torch.ones(2, grid[0] * grid[1], dtype=torch.long),
            spatial_shapes=torch.tensor([grid] * 2), output_hidden_states=True,
        )
        captured = vx.capture(model, x)
        torch.testing.assert_close(captured.tokens, torch.stack(expected.hidden_states, 1), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(captured.logits, expected.pooler_output, atol=1e-4, rtol=1e-4)
    for height, width in [(300, 451), (1000, 37), (16, 16)]:
        assert from_naflex.sequence_size(height, width, 16, 256) == get_image_size_for_max_num_patches(height, width, 16, 256)


def test_transformers_siglip2_processor_is_read_at_its_aspect_ratio(tmp_path):
    """A SigLIP 2 NaFlex folder's Siglip2ImageProcessor (max_num_patches, bilinear): a wide photo read
    at the size it chooses, as the processor's patches, and the tower's output on them."""
    import transformers as T
    from einops import rearrange
    from PIL import Image

    settings = dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=2, patch_size=PATCH, intermediate_size=128, num_patches=16)
    reference = randomize(T.Siglip2VisionModel(T.Siglip2VisionConfig(**settings)))
    reference.save_pretrained(tmp_path)
    processor = T.Siglip2ImageProcessor(patch_size=PATCH, max_num_patches=24)
    processor.save_pretrained(tmp_path)
    config = vx.load_model(tmp_path).config
    assert (config.max_patches, config.interpolation, config.transform_library) == (24, "bilinear", "transformers")
    picture = Image.fromarray((torch.rand(300, 451, 3, generator=torch.Generator().manual_seed(4)) * 255).to(torch.uint8).numpy())
    prepared = processor(images=picture, return_tensors="pt")
    size = from_naflex.sequence_size(300, 451, PATCH, 24)
    assert size == (32, 48) and prepared["spatial_shapes"].tolist() == [[4, 6]]
    model = vx.load_model(tmp_path, image_size=size)
    x = vx.preprocess(picture, model.config)
    patches = rearrange(x[0], "c (h p1) (w p2) -> (h w) (p1 p2 c)", p1=PATCH, p2=PATCH)
    torch.testing.assert_close(patches, prepared["pixel_values"][0, :24], atol=1e-5, rtol=0)
    expected = reference(**prepared).pooler_output
    torch.testing.assert_close(model(x), expected, atol=1e-4, rtol=1e-4)
