"""Every checkpoint's normalisation: the publisher's where it wrote one, else the structure's where
that is unambiguous, else assumed and said (ViTConfig.normalization_source)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from timm.models.vision_transformer import VisionTransformer

import vit_explorer as vx
from vit_explorer.model.config import NORMALIZATIONS
from vit_explorer.weights import CONFIG_KEY
from vit_explorer.weights.checks import safetensors_header
from vit_explorer.weights.normalization import renormalized

from helpers import randomize

IMAGENET, CLIP, HALF = NORMALIZATIONS["ImageNet"], NORMALIZATIONS["OpenAI CLIP"], NORMALIZATIONS["0.5 (Inception, SigLIP)"]
SMALL = dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=0)

# A lone timm file of each structure: (timm's arguments, the normalisation, where it comes from).
STRUCTURES = {
    "CLIP (pre-norm, no patch bias)": (dict(pre_norm=True), CLIP, "structure: CLIP"),
    "DINOv2 with registers": (
        dict(img_size=28, patch_size=14, reg_tokens=4, init_values=1e-5, no_embed_class=True), IMAGENET,
        "structure: DINOv2 with registers",
    ),
    "DINOv2 / DeiT III (LayerScale, class token)": (dict(init_values=1e-5), IMAGENET, "structure: LayerScale"),
    "DeiT distilled": (dict(num_classes=3), IMAGENET, "structure: DeiT"),
    "SigLIP (attention-pool head)": (dict(class_token=False, global_pool="map"), HALF, "structure: SigLIP"),
    "plain ViT (augreg, DeiT, DINO: ambiguous)": ({}, HALF, "assumed"),
    "registers and LayerScale of another shape": (dict(reg_tokens=2, init_values=1e-5), IMAGENET, "assumed"),
    "registers, no class token (timm's SBB)": (
        dict(class_token=False, reg_tokens=4, init_values=1e-5, no_embed_class=True, global_pool="avg"), HALF, "assumed",
    ),
}


def _timm_file(tmp_path, name: str = "model.safetensors", **changes) -> tuple:
    distilled = changes.pop("distilled", False)
    if distilled:
        from timm.models.deit import VisionTransformerDistilled as cls
    else:
        cls = VisionTransformer
    reference = randomize(cls(**{**SMALL, **changes}))
    path = tmp_path / name
    save_file({key: value.contiguous() for key, value in reference.state_dict().items()}, path)
    return path, reference


@pytest.mark.parametrize("structure", list(STRUCTURES))
def test_a_lone_timm_file_gets_the_normalisation_its_structure_tells_or_says_it_was_assumed(tmp_path, structure):
    changes, (mean, std), source = STRUCTURES[structure]
    path, _ = _timm_file(tmp_path, distilled=structure == "DeiT distilled", **changes)
    config = vx.load_model(path).config
    assert (config.mean, config.std) == (mean, std)
    assert config.normalization_source.startswith(source)
    assert config.normalization_assumed == (source == "assumed")


def test_the_callers_mean_and_std_are_given_and_a_project_file_keeps_where_its_came_from(tmp_path):
    path, _ = _timm_file(tmp_path)
    given = vx.load_model(path, mean=IMAGENET[0], std=IMAGENET[1]).config
    assert given.mean == IMAGENET[0] and given.normalization_source == "given"

    assumed = vx.load_model(path)
    vx.save_model(assumed, tmp_path / "ours.safetensors")
    assert vx.load_model(tmp_path / "ours.safetensors").config.normalization_source == "assumed"
    # A config given whole (training's, the files written before the field) keeps the file as it was.
    vx.save_model(vx.ViT(vx.ViTConfig(image_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=2)), tmp_path / "given.safetensors")
    header = json.loads(safetensors_header(tmp_path / "given.safetensors")[CONFIG_KEY])
    assert "normalization_source" not in header
    assert vx.load_model(tmp_path / "given.safetensors").config.normalization_source == "given"


def test_a_timm_hub_folders_pretrained_cfg_wins_over_the_structure(tmp_path):
    import timm
    from timm.models._hub import save_for_hf

    # A CLIP tower whose publisher normalised with 0.5 (as timm says of LAION's ViT-L/14).
    reference = randomize(timm.create_model("vit_base_patch16_clip_224", **SMALL))
    reference.pretrained_cfg = {**reference.pretrained_cfg, "mean": HALF[0], "std": HALF[1]}
    save_for_hf(reference, tmp_path / "folder")
    config = vx.load_model(tmp_path / "folder").config
    assert (config.mean, config.std) == HALF
    assert config.normalization_source == "publisher: timm's pretrained_cfg"


def _hf_folder(tmp_path, model_class: str = "ViTModel"):
    import transformers

    settings = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=32, patch_size=8)
    if model_class == "CLIPVisionModel":
        reference = transformers.CLIPVisionModel(transformers.CLIPVisionConfig(**settings))
    else:
        reference = transformers.ViTModel(transformers.ViTConfig(**settings))
    randomize(reference).save_pretrained(tmp_path)
    return tmp_path


def test_a_hugging_face_folder_reads_its_preprocessor_config(tmp_path):
    folder = _hf_folder(tmp_path)
    (folder / "preprocessor_config.json").write_text(json.dumps({"image_mean": list(CLIP[0]), "image_std": list(CLIP[1])}))
    config = vx.load_model(folder).config
    assert (config.mean, config.std) == CLIP
    assert config.normalization_source.startswith("publisher")


def test_a_hugging_face_folder_without_a_preprocessor_config_is_told_by_its_structure(tmp_path):
    assert vx.load_model(_hf_folder(tmp_path / "clip", "CLIPVisionModel")).config.normalization_name == "OpenAI CLIP"
    plain = vx.load_model(_hf_folder(tmp_path / "vit")).config
    assert plain.normalization_assumed and plain.normalization_name == "0.5 (Inception, SigLIP)"


def test_renormalized_shares_the_tensors_and_leaves_the_model_untouched(tmp_path):
    path, _ = _timm_file(tmp_path)
    model = vx.load_model(path)
    chosen = renormalized(model, *IMAGENET)
    assert chosen.config.normalization_name == "ImageNet" and chosen.config.normalization_source == "chosen"
    assert model.config.normalization_name == "0.5 (Inception, SigLIP)" and model.config.normalization_assumed
    assert all(
        ours.data_ptr() == theirs.data_ptr() for ours, theirs in zip(chosen.state_dict().values(), model.state_dict().values())
    )
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(chosen(x), model(x))
