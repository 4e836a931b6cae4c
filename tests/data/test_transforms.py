"""The publisher's input (data/transforms.py): from an image file, the explorer's prediction equals
the publisher's own pipeline (open_clip's create_model_and_transforms, timm's resolve_data_config +
create_transform, transformers' CLIPImageProcessor) on square, wide and tall photos; the whole
picture is one argument away; the transform survives our files; the catalogue's entries say what
timm's and open_clip's registries say."""
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import vit_explorer as vx
from vit_explorer.data.transforms import crops, placement, visible_box
from vit_explorer.text import load_image_text_model, zero_shot
from vit_explorer.weights import CheckpointError, catalogue

from textmodels import SMALL_CLIP, SMALL_SIGLIP_TEXT, open_clip, open_clip_folder

SAMPLE = Path(__file__).resolve().parents[2] / "assets" / "samples" / "chelsea.png"
# "offset": 39 px wide at 32 high, so a 32 px crop starts at 3.5, rounded by torchvision, truncated by transformers.
SIZES = {"square": (300, 300), "wide": (640, 200), "tall": (200, 640), "odd": (451, 300), "offset": (366, 300)}
LABELS = ["a cat", "a dog", "a rocket", "a blue circle"]
# A SigLIP-shaped pair open_clip itself builds (its own small ViT, a bidirectional text tower read
# at its last token, a logit bias: sigmoid scores), with SigLIP's preprocess_cfg.
SMALL_SIGLIP = {
    "embed_dim": 32, "custom_text": True, "init_logit_bias": -10,
    "vision_cfg": {"image_size": 32, "layers": 2, "width": 64, "patch_size": 8, "head_width": 32},
    "text_cfg": SMALL_SIGLIP_TEXT,
}
SIGLIP_PREPROCESS = {"mean": [0.5] * 3, "std": [0.5] * 3, "resize_mode": "squash", "interpolation": "bicubic"}


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("photos")
    picture = Image.open(SAMPLE).convert("RGB")
    paths = {}
    for name, size in SIZES.items():
        paths[name] = folder / f"{name}.png"
        picture.resize(size, Image.Resampling.BICUBIC).save(paths[name])
    return paths


def _open_clip_probabilities(folder: Path, paths: list[Path]) -> torch.Tensor:
    """(photos, labels) from open_clip's own pipeline from the files: its preprocess, encode_image, encode_text."""
    model, _, preprocess = open_clip.create_model_and_transforms(f"local-dir:{folder}")
    tokenizer = open_clip.get_tokenizer(f"local-dir:{folder}")
    with torch.no_grad():
        images = model.encode_image(torch.stack([preprocess(Image.open(path)) for path in paths]), normalize=True)
        text = model.encode_text(tokenizer(zero_shot.label_prompts(LABELS)), normalize=True)
        logits = model.logit_scale.exp() * images @ text.T
        if getattr(model, "logit_bias", None) is not None:
            return (logits + model.logit_bias).sigmoid()
        return logits.softmax(dim=-1)


def _our_probabilities(folder: Path, paths: list[Path], whole: bool = False) -> torch.Tensor:
    """(photos, labels) as the explorer scores each file (the CLI's and the app's path)."""
    model = load_image_text_model(folder)
    texts = model.embed_texts(zero_shot.label_prompts(LABELS))
    scores = []
    for path in paths:
        x = vx.preprocess(vx.load_image(path), model.image.config, whole=whole)
        captured = vx.capture(model.image, x, layers=())
        scores.append(zero_shot.predict(model, captured.logits, tuple(LABELS), texts).scores)
    return torch.stack(scores)


@pytest.mark.parametrize("kind", ["clip", "siglip"])
def test_zero_shot_from_a_file_equals_open_clips_pipeline(tmp_path, photos, kind):
    folder = tmp_path / kind
    if kind == "clip":  # open_clip's default preprocess_cfg: the shorter side resized, the centre cropped
        open_clip_folder(folder, SMALL_CLIP)
    else:
        open_clip_folder(folder, SMALL_SIGLIP, preprocess_cfg=SIGLIP_PREPROCESS)
    paths = list(photos.values())
    expected = _open_clip_probabilities(folder, paths)
    torch.testing.assert_close(_our_probabilities(folder, paths), expected, atol=1e-4, rtol=0)
    if kind == "clip":  # the whole picture squeezed (what the explorer read before) fails the same check
        squeezed = _our_probabilities(folder, [photos["wide"]], whole=True)
        assert (squeezed[0] - expected[1]).abs().max() > 1e-4


def test_open_clips_padded_input_is_the_publishers(tmp_path, photos):
    """resize_mode "longest": the longer side fitted, the rest padded with fill_color."""
    folder = tmp_path / "clip"
    open_clip_folder(folder, SMALL_CLIP, preprocess_cfg={"resize_mode": "longest", "fill_color": 200})
    _, _, preprocess = open_clip.create_model_and_transforms(f"local-dir:{folder}")
    config = vx.load_model(folder).config
    for path in photos.values():
        torch.testing.assert_close(vx.preprocess(vx.load_image(path), config)[0], preprocess(Image.open(path)), atol=1e-6, rtol=0)


def test_an_open_clip_preprocess_cfg_we_do_not_reproduce_is_a_sentence(tmp_path):
    open_clip_folder(tmp_path, SMALL_CLIP)
    for preprocess_cfg, message in (
        ({"resize_mode": "zoom"}, "resize_mode must be shortest, squash or longest"),
        ({"interpolation": ["bicubic"]}, "interpolation must be bicubic or bilinear"),
        ({"resize_mode": "longest", "fill_color": 256}, "fill_color must be a whole number from 0 to 255"),
    ):
        (tmp_path / "open_clip_config.json").write_text(json.dumps({
            "model_cfg": SMALL_CLIP, "preprocess_cfg": preprocess_cfg,
        }))
        with pytest.raises(CheckpointError, match=message):
            vx.load_model(tmp_path)


def _timm_folder(folder: Path, crop_pct: float):
    import timm
    from timm.models import save_for_hf

    arguments = dict(img_size=64, patch_size=16, embed_dim=64, depth=2, num_heads=2, num_classes=10)
    torch.manual_seed(0)
    model = timm.create_model(
        "vit_tiny_patch16_224", pretrained_cfg_overlay=dict(crop_pct=crop_pct, interpolation="bicubic", input_size=(3, 64, 64)),
        **arguments,
    ).eval()
    save_for_hf(model, folder, model_args=arguments)
    return model


@pytest.mark.parametrize("crop_pct", [0.875, 0.9])
def test_a_timm_classifiers_top5_equals_timms_pipeline(tmp_path, photos, crop_pct):
    import timm.data

    reference = _timm_folder(tmp_path, crop_pct)
    transform = timm.data.create_transform(**timm.data.resolve_data_config(model=reference))
    ours = vx.load_model(tmp_path)
    assert (ours.config.resize_mode, ours.config.crop_pct) == ("shortest", crop_pct)
    for name in ("wide", "odd", "offset"):
        picture = Image.open(photos[name]).convert("RGB")
        with torch.no_grad():
            expected = reference(transform(picture)[None])[0]
        logits = vx.capture(ours, vx.preprocess(vx.load_image(photos[name]), ours.config), layers=()).logits[0]
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4, msg=name)
        assert logits.topk(5).indices.tolist() == expected.topk(5).indices.tolist()
        # Another input size, not square (the sidebar's): timm keeps the ratio, then crops.
        other = timm.data.create_transform(**{**timm.data.resolve_data_config(model=reference), "input_size": (3, 32, 48)})
        torch.testing.assert_close(
            vx.preprocess(vx.load_image(photos[name]), ours.config.replace(image_size=(32, 48)))[0], other(picture),
            atol=1e-5, rtol=0, msg=name,
        )


@pytest.mark.parametrize("pretrained, message", [
    ({"crop_pct": 5}, "crop_pct must be a number between 0.25 and 1"),
    ({"crop_mode": ["center"]}, "crop_mode must be center, squash or border"),
    ({"interpolation": "random"}, "interpolation must be bicubic, bilinear or nearest"),
])
def test_a_timm_pretrained_cfg_we_do_not_reproduce_is_a_sentence(tmp_path, pretrained, message):
    _timm_folder(tmp_path, 0.9)
    config = json.loads((tmp_path / "config.json").read_text())
    config["pretrained_cfg"].update(pretrained)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=message):
        vx.load_model(tmp_path)


@pytest.mark.parametrize("processor, settings, mode", [
    ("CLIPImageProcessor", {"size": {"shortest_edge": 32}, "crop_size": {"height": 32, "width": 32}}, "shortest"),
    ("CLIPImageProcessor", {"size": {"shortest_edge": 36}, "crop_size": {"height": 32, "width": 32}}, "shortest"),
    ("SiglipImageProcessor", {"size": {"height": 32, "width": 32}}, "squash"),
    ("DeiTImageProcessor", {"size": {"height": 36, "width": 36}, "crop_size": {"height": 32, "width": 32}}, "squash"),
    ("DINOv3ViTImageProcessor", {"size": {"height": 32, "width": 32}}, "squash"),
])
def test_a_hugging_face_folder_equals_its_image_processor(tmp_path, photos, processor, settings, mode):
    import transformers

    from textmodels import HF_SMALL, hf_clip_folder

    hf_clip_folder(tmp_path, text=HF_SMALL, vision={**HF_SMALL, "patch_size": 8, "image_size": 32}, projection_dim=32,
                   tokenizer=False)
    reference = getattr(transformers, processor)(**settings)
    reference.save_pretrained(tmp_path)
    config = vx.load_model(tmp_path).config
    assert (config.resize_mode, config.transform_library.partition("-")[0]) == (mode, "transformers")
    for name, path in photos.items():
        expected = reference(images=Image.open(path), return_tensors="pt")["pixel_values"][0]
        torch.testing.assert_close(vx.preprocess(vx.load_image(path), config)[0], expected, atol=1e-5, rtol=0, msg=name)


def test_an_older_folders_feature_extractor_is_read_with_its_class_defaults(tmp_path, photos):
    """openai/clip-vit-base-patch32's kind: a CLIPFeatureExtractor, sizes as numbers, do_center_crop
    left to the class (True), the size the shorter side's (default_to_square False)."""
    from transformers import CLIPImageProcessor

    from textmodels import HF_SMALL, hf_clip_folder

    hf_clip_folder(tmp_path, text=HF_SMALL, vision={**HF_SMALL, "patch_size": 8, "image_size": 32}, projection_dim=32,
                   tokenizer=False)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({
        "feature_extractor_type": "CLIPFeatureExtractor", "size": 36, "crop_size": 32, "resample": 3,
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    }))
    config = vx.load_model(tmp_path).config
    reference = CLIPImageProcessor(size={"shortest_edge": 36}, crop_size={"height": 32, "width": 32},
                                   image_mean=[0.5] * 3, image_std=[0.5] * 3)
    for name, path in photos.items():
        expected = reference(images=Image.open(path), return_tensors="pt")["pixel_values"][0]
        torch.testing.assert_close(vx.preprocess(vx.load_image(path), config)[0], expected, atol=1e-5, rtol=0, msg=name)


@pytest.mark.parametrize("settings, message", [
    ({"size": {"shortest_edge": 32}, "crop_size": {"height": 32, "width": 16}, "do_center_crop": True}, "do not make a square"),
    ({"size": {"height": 32, "width": 32}, "resample": 5}, "resample must be 0, 2 or 3"),
    ({"size": "large"}, "size must be a number of pixels"),
    ({"size": 32, "image_processor_type": "Siglip2ImageProcessor"}, "not one we reproduce"),
    ({"size": 32, "rescale_factor": 1.0}, "rescale_factor must be 1/255"),
    ({"size": {"shortest_edge": 16}, "crop_size": 32, "do_center_crop": True}, "must fit inside its size"),
    ({"size": {"shortest_edge": 10**12}, "crop_size": 32, "do_center_crop": True}, "must fit inside its size"),
    ({"size": 32, "image_processor_type": ["CLIPImageProcessor"]}, "not one we reproduce"),
    ({"size": 32, "resample": [3]}, "resample must be 0, 2 or 3"),
    ({"size": 32, "do_resize": "yes"}, "do_resize must be true or false"),
])
def test_an_image_processor_we_do_not_reproduce_is_a_sentence(tmp_path, settings, message):
    from textmodels import HF_SMALL, hf_clip_folder

    hf_clip_folder(tmp_path, text=HF_SMALL, vision={**HF_SMALL, "patch_size": 8, "image_size": 32}, projection_dim=32,
                   tokenizer=False)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"image_processor_type": "CLIPImageProcessor", **settings}))
    with pytest.raises(CheckpointError, match=message):
        vx.load_model(tmp_path)


def test_the_transform_survives_our_files_and_ours_stays_the_squash(tmp_path, photos):
    config = vx.ViTConfig(image_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=2, num_classes=3,
                          resize_mode="shortest", crop_pct=0.9, interpolation="bilinear")
    vx.save_model(vx.ViT(config), tmp_path / "cropped.safetensors")
    assert vx.load_model(tmp_path / "cropped.safetensors").config == config
    ours = config.replace(resize_mode="squash", crop_pct=1.0, interpolation="bicubic")
    vx.save_model(vx.ViT(ours), tmp_path / "ours.safetensors")
    header = json.loads(vx.weights.checks.safetensors_header(tmp_path / "ours.safetensors")[vx.weights.CONFIG_KEY])
    assert "resize_mode" not in header  # files as before: their older readers read them
    picture = vx.load_image(photos["wide"])
    assert crops(picture.size, config) and not crops(picture.size, ours)
    # The whole picture is today's squash (PIL's bicubic to the input size), whatever the model's crop.
    squeezed = np.asarray(picture.resize((32, 32), Image.Resampling.BICUBIC), dtype=np.float32) / 255
    for model_config in (ours, config.replace(interpolation="bicubic")):
        whole = vx.preprocess(picture, model_config, whole=model_config is not ours)[0]
        torch.testing.assert_close(whole, torch.from_numpy((squeezed - 0.5) / 0.5).permute(2, 0, 1))
    # The crop on the 640x200 picture: resized to 112x35 (the shorter side to floor(32 / 0.9)), the
    # input the 32x32 from (40, 2) on, i.e. x from 40 to 72 of 112, y from 2 to 34 of 35.
    box = visible_box(picture.size, config)
    assert box == pytest.approx((40 * 640 / 112, 2 * 200 / 35, 72 * 640 / 112, 34 * 200 / 35))
    assert visible_box(picture.size, config, whole=True) == (0, 0, 640, 200)


def test_the_catalogues_transforms_are_their_publishers():
    import timm
    import torchvision

    for name, entry in catalogue.CATALOGUE.items():
        config = entry.config_without_names()
        if entry.open_clip is not None:
            tag = {"clip_vitb16": "openai", "clip_vitl14_336": "openai", "pe_core_l14_336": "meta"}.get(name, "webli")
            expected = open_clip.get_pretrained_cfg(entry.open_clip, tag)
            assert (config.resize_mode, config.interpolation, config.crop_pct) == (
                expected.get("resize_mode", "shortest"), expected.get("interpolation", "bicubic"), 1.0), name
        elif entry.source.startswith("timm/"):
            expected = timm.models.get_pretrained_cfg(entry.source.removeprefix("timm/"))
            mode = {"center": "shortest", "squash": "squash", "border": "longest"}[expected.crop_mode or "center"]
            assert (config.resize_mode, config.interpolation, config.crop_pct) == (
                mode, expected.interpolation, expected.crop_pct), name
    from vit_explorer.weights.from_torchvision import _transform

    weights = torchvision.models.ViT_B_16_Weights.IMAGENET1K_V1
    assert _transform(weights.transforms()) == {"resize_mode": "shortest", "crop_pct": 224 / 256, "interpolation": "bilinear"}


def test_so400m_at_384_reads_the_top_left_378_as_timm_and_transformers_do(tmp_path, photos):
    """SigLIP So400m/14's native 384 px is 27 patches of 14 and 6 pixels no patch reads: timm's and
    transformers' convolutions drop them. Both publishers' pipelines from a file equal ours, every
    layer's tokens; the input was refused before ("expects 378")."""
    import timm.data
    from timm.models import save_for_hf
    from transformers import SiglipImageProcessor, SiglipVisionConfig, SiglipVisionModel

    torch.manual_seed(0)
    arguments = dict(img_size=384, embed_dim=32, depth=2, num_heads=2)
    reference = timm.create_model("vit_so400m_patch14_siglip_384", pretrained=False, **arguments).eval()
    save_for_hf(reference, tmp_path / "timm", model_args=arguments)
    ours = vx.load_model(tmp_path / "timm")
    assert (ours.config.image_size, ours.config.unread_margin, ours.config.grid_size) == (378, 6, (27, 27))
    transform = timm.data.create_transform(**timm.data.resolve_data_config(model=reference))
    picture = Image.open(photos["odd"]).convert("RGB")
    x = vx.preprocess(vx.load_image(photos["odd"]), ours.config)
    torch.testing.assert_close(x[0], transform(picture)[:, :378, :378], atol=1e-6, rtol=0)
    with torch.no_grad():
        expected = reference.forward_intermediates(transform(picture)[None], intermediates_only=True, output_fmt="NLC")
    tokens = vx.capture(ours, x, layers=()).tokens[0, 1:]
    torch.testing.assert_close(tokens, torch.cat(expected), atol=1e-4, rtol=1e-5)
    left, _, right, _ = visible_box(picture.size, ours.config)  # what is read, the margin left out
    assert right - left == pytest.approx(378 * 451 / placement(picture.size, ours.config).resized[0])
    assert "its top-left 378x378 px read" in vx.data.transforms.describe(picture.size, ours.config)
    vx.save_model(ours, tmp_path / "ours.safetensors")  # our files keep it
    assert vx.load_model(tmp_path / "ours.safetensors").config.unread_margin == 6
    # Another input size is read whole.
    assert vx.resize_model(ours, image_size=28).config.unread_margin == 0

    hf = SiglipVisionModel(SiglipVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=384, patch_size=14,
    )).eval()
    hf.save_pretrained(tmp_path / "hf")
    processor = SiglipImageProcessor(size={"height": 384, "width": 384}, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    processor.save_pretrained(tmp_path / "hf")
    ours = vx.load_model(tmp_path / "hf")
    x = vx.preprocess(vx.load_image(photos["odd"]), ours.config)
    with torch.no_grad():
        expected = hf(**processor(picture, return_tensors="pt"), output_hidden_states=True).hidden_states
    torch.testing.assert_close(vx.capture(ours, x, layers=()).tokens[0], torch.cat(expected), atol=1e-4, rtol=1e-5)


def test_an_unread_margin_is_less_than_a_patch():
    with pytest.raises(ValueError, match="unread_margin must be a whole number of pixels below the patch size"):
        vx.ViTConfig(image_size=28, patch_size=14, unread_margin=14)
