"""The catalogue's entries: the well-known pretrained ViTs, each with its source, card, licence and
the architecture its file must fit (:class:`CatalogueEntry`, :data:`CATALOGUE`). Where an entry is
downloaded to and how is weights/catalogue.py's; what a download is checked against is
weights/entry_checks.py's."""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from ..model.config import IMAGENET_MEAN, IMAGENET_STD, OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, ViTConfig
from . import from_open_clip

_IMAGENET = dict(mean=IMAGENET_MEAN, std=IMAGENET_STD)
# The publishers' eval transforms (timm's pretrained_cfg, open_clip's preprocess_cfg; compared with
# them in tests/weights/test_transforms.py): the shorter side to input / crop_pct, the centre cropped.
_CROP_90 = dict(resize_mode="shortest", crop_pct=0.9, interpolation="bicubic")
_CROP_ALL = dict(resize_mode="shortest", crop_pct=1.0, interpolation="bicubic")
_VIT_S = dict(embed_dim=384, depth=12, num_heads=6)
_VIT_B = dict(embed_dim=768, depth=12, num_heads=12)
# timm's DINOv3 (Eva): rotary positions only, 4 registers, LayerScale, no qkv bias, eps 1e-5; the
# rotary periods rounded to bfloat16 as the original weights keep them (weights/from_eva.py).
_DINOV3 = dict(
    patch_size=16, num_classes=0, reg_tokens=4, init_values=1e-5, qkv_bias=False, layer_norm_eps=1e-5,
    rope_type="dinov3", abs_pos_embed=False, rope_periods_dtype="bfloat16", **_IMAGENET, **_CROP_ALL,
)
# SigLIP and SigLIP 2: big_vision trains with JAX's gelu, the tanh approximation (as transformers runs it).
_SIGLIP_B = dict(
    image_size=224, patch_size=16, num_classes=0, class_token=False, global_pool="map", act_layer="gelu_tanh", **_VIT_B,
    resize_mode="squash", interpolation="bicubic",  # open_clip's preprocess_cfg: the whole picture
)
DINOV3_LICENCE = "DINOv3 License (Meta), not Apache: github.com/facebookresearch/dinov3/blob/main/LICENSE.md"
QWEN_RESEARCH_LICENCE = (
    "Qwen RESEARCH LICENSE AGREEMENT (Alibaba Cloud; research and non-commercial use), not Apache:"
    " huggingface.co/Qwen/Qwen2.5-VL-3B-Instruct/blob/main/LICENSE"
)

# A timm repository's image tower.
TIMM_FILE = "model.safetensors"
VLM_CONFIG_FILE = "config.json"
# A SigLIP's Hugging Face tokenizer beside its open_clip files (open_clip writes them with
# save_pretrained); special_tokens_map.json is taken where the server has one.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
OPTIONAL_TOKENIZER_FILES = ("special_tokens_map.json",)


@dataclass(frozen=True)
class CatalogueEntry:
    """One pretrained model: where it lives, what it is, and the architecture its file must fit."""

    title: str  # short name for menus
    source: str  # "timm/<name>" (a Hugging Face Hub repository) or "torchvision:<name>"
    # The download's size. timm files: parameters x 4 bytes (fp32 safetensors), computed from the
    # architecture, the header's few kilobytes aside; open_clip's: both towers' (the weights file,
    # its config and tokenizer aside); torchvision: its weights' metadata.
    size_bytes: int
    trained_on: str
    attention: str  # what its attention is known to look like: the model card's second half
    config: dict = field(default_factory=dict)  # ViTConfig fields; the rest are the defaults
    imagenet_classes: bool = False  # its head scores the 1000 ImageNet-1k classes
    drop_keys: tuple[str, ...] = ()  # tensors of the file that are no part of our model
    licence: str = "Apache-2.0"  # the weights' licence, as their publisher gives it
    # Not an open-source licence: the app asks the person to accept it before downloading.
    terms_to_accept: bool = False
    eva_names: bool = False  # the file names its tensors as timm's Eva does (model.from_timm_eva)
    # A CLIP or SigLIP whose repository holds open_clip's files (both towers): open_clip's model
    # config of the two (the name of one of its configs, or the config itself), which the download
    # is checked against, whatever the downloaded open_clip_config.json says. None: timm's file of
    # the image tower alone. size_bytes is then both towers' weights.
    open_clip: str | dict | None = None
    tokenizer: bool = False  # its text tower reads the Hugging Face tokenizer of its repository
    # A vision-language model's repository (transformers' files) of which only the vision tower is
    # downloaded: its config (and preprocessor_config.json) and its tensors' byte ranges
    # (weights/range_downloads.py), kept as a VLM folder of one weights file that weights/from_vlm.py
    # (Qwen-VL's: from_qwen_vl.py) reads. size_bytes: the tower's.
    vlm: bool = False

    @property
    def card(self) -> str:
        return f"{self.title}: trained on {self.trained_on}. {self.attention} Licence: {self.licence}."

    @property
    def files(self) -> tuple[str, ...]:
        """The files of its Hub repository that a download brings, every one needed, the weights
        last (timm entries; torchvision's is its own)."""
        if self.vlm:
            return (VLM_CONFIG_FILE, TIMM_FILE)
        if self.open_clip is None:
            return (TIMM_FILE,)
        tokenizer = TOKENIZER_FILES if self.tokenizer else ()
        return (from_open_clip.CONFIG_FILE, *tokenizer, from_open_clip.WEIGHTS_FILE)

    def open_clip_config(self) -> dict:
        """open_clip's model config of both towers (importing open_clip, seconds: only to check or
        load a download)."""
        if isinstance(self.open_clip, dict):
            return json.loads(json.dumps(self.open_clip))
        import open_clip

        config = open_clip.get_model_config(self.open_clip)
        if config is None:
            raise KeyError(f"open_clip has no model config {self.open_clip!r}")
        return json.loads(json.dumps(config))

    def config_without_names(self) -> ViTConfig:
        return ViTConfig(**self.config)

    def vit_config(self) -> ViTConfig:
        class_names = imagenet_class_names() if self.imagenet_classes else None
        return ViTConfig(**self.config, class_names=class_names)


CATALOGUE: dict[str, CatalogueEntry] = {
    "vit_b_16": CatalogueEntry(
        "ImageNet ViT-B/16 (torchvision)", "torchvision:vit_b_16", 346_328_924,
        "ImageNet-1k, supervised (torchvision's recipe)",
        "Supervised ViTs attend diffusely: the class token spreads over the object and background"
        " alike, and rollout is needed to see the object.",
        imagenet_classes=True, licence="BSD-3-Clause (torchvision)",
    ),
    "dino_vits16": CatalogueEntry(
        "DINO ViT-S/16", "timm/vit_small_patch16_224.dino", 86_662_656,
        "ImageNet-1k images without labels (DINO self-distillation)",
        "Its class token finds the object without ever seeing a label: last-layer heads segment"
        " the foreground, some heads one part each.",
        config=dict(image_size=224, patch_size=16, num_classes=0, **_VIT_S, **_IMAGENET, **_CROP_90),
    ),
    "dino_vits8": CatalogueEntry(
        "DINO ViT-S/8", "timm/vit_small_patch8_224.dino", 86_681_088,
        "ImageNet-1k images without labels (DINO self-distillation)",
        "The sharpest DINO maps (784 patches): the class token's heads trace object outlines.",
        config=dict(image_size=224, patch_size=8, num_classes=0, **_VIT_S, **_IMAGENET, **_CROP_90),
    ),
    "dino_vitb16": CatalogueEntry(
        "DINO ViT-B/16", "timm/vit_base_patch16_224.dino", 343_194_624,
        "ImageNet-1k images without labels (DINO self-distillation)",
        "Like DINO ViT-S/16 with twice the heads: the class token segments the object.",
        config=dict(image_size=224, patch_size=16, num_classes=0, **_VIT_B, **_IMAGENET, **_CROP_90),
    ),
    "dinov2_vits14_reg": CatalogueEntry(
        "DINOv2 ViT-S/14 with registers", "timm/vit_small_patch14_reg4_dinov2.lvd142m", 88_229_376,
        "LVD-142M, 142 million curated images without labels (DINOv2), at 518x518",
        "Clean, object-centred maps and token PCA that parts objects; the 4 registers take the"
        " high-norm artifact tokens that DINOv2 without registers puts on background patches.",
        config=dict(
            image_size=518, patch_size=14, num_classes=0, reg_tokens=4, no_embed_class=True,
            init_values=1e-5, **_VIT_S, **_IMAGENET, **_CROP_ALL,
        ),
    ),
    "deit_s": CatalogueEntry(
        "DeiT-S", "timm/deit_small_patch16_224.fb_in1k", 88_202_656,
        "ImageNet-1k, supervised with strong augmentation (DeiT)",
        "Supervised: the class token's attention covers the object but leaks onto context that"
        " predicts the class.",
        config=dict(image_size=224, patch_size=16, num_classes=1000, **_VIT_S, **_IMAGENET, **_CROP_90),
        imagenet_classes=True,
    ),
    "deit3_s": CatalogueEntry(
        "DeiT III-S", "timm/deit3_small_patch16_224.fb_in1k", 88_237_984,
        "ImageNet-1k, supervised (DeiT III recipe, LayerScale)",
        "Supervised and long-trained: sharper than DeiT, with high-norm artifact tokens in late"
        " layers that grab attention.",
        config=dict(
            image_size=224, patch_size=16, num_classes=1000, no_embed_class=True, init_values=1e-6,
            **_VIT_S, **_IMAGENET, **_CROP_90,
        ),
        imagenet_classes=True,
    ),
    "augreg_vitb16": CatalogueEntry(
        "AugReg ViT-B/16 (21k -> 1k)", "timm/vit_base_patch16_224.augreg2_in21k_ft_in1k", 346_270_624,
        "ImageNet-21k, then fine-tuned on ImageNet-1k (AugReg, supervised)",
        "The original ViT recipe: early heads mix local and global, the class token's maps are"
        " diffuse; rollout shows the object.",
        config=dict(image_size=224, patch_size=16, num_classes=1000, **_VIT_B, **_CROP_90),
        imagenet_classes=True,
    ),
    # CLIP and SigLIP: open_clip's files of the repositories open_clip itself loads them from
    # (open_clip/pretrained.py), both towers; the pages explore the image tower, headless (no
    # classes: the projection into the text space is the words' own, vit_explorer.text).
    "clip_vitb16": CatalogueEntry(
        "CLIP ViT-B/16 (OpenAI)", "timm/vit_base_patch16_clip_224.openai", 598_482_948,
        "400 million image-text pairs from the web (OpenAI CLIP, contrastive)",
        "Its text tower comes with it (no classes: texts score the image). Its attention is known"
        " to be noisy, with a few background tokens that everyone reads.",
        config=dict(
            image_size=224, patch_size=16, num_classes=0, pre_norm=True, patch_bias=False,
            act_layer="quick_gelu", layer_norm_eps=1e-5, mean=OPENAI_CLIP_MEAN,
            std=OPENAI_CLIP_STD, **_VIT_B, **_CROP_ALL,
        ),
        open_clip="ViT-B-16-quickgelu",  # ViT-B-16 as OpenAI trained it, with QuickGELU
    ),
    "clip_vitl14_336": CatalogueEntry(
        "CLIP ViT-L/14-336 (OpenAI)", "timm/vit_large_patch14_clip_336.openai", 1_711_776_772,
        "400 million image-text pairs from the web (OpenAI CLIP, contrastive), its last epoch at 336x336",
        "Its text tower comes with it (no classes: texts score the image). The tower LLaVA-1.5 reads"
        " (576 patches); CLIP's attention: noisy, with a few background tokens that everyone reads.",
        config=dict(
            image_size=336, patch_size=14, num_classes=0, pre_norm=True, patch_bias=False,
            act_layer="quick_gelu", layer_norm_eps=1e-5, mean=OPENAI_CLIP_MEAN, std=OPENAI_CLIP_STD,
            embed_dim=1024, depth=24, num_heads=16, **_CROP_ALL,
        ),
        open_clip="ViT-L-14-336-quickgelu",
    ),
    "pe_core_l14_336": CatalogueEntry(
        "Perception Encoder core L/14-336 (Meta)", "timm/PE-Core-L-14-336", 2_684_555_268,
        "5.4 billion curated web image-text pairs (MetaCLIP's recipe), then videos with generated captions"
        " (Meta's Perception Encoder, contrastive)",
        "Its text tower comes with it (softmax scores, as CLIP's). Rotary positions beside learned"
        " ones, and an attention pool whose probe reads the class token with the patches: its"
        " attention is shown where a class token's would be.",
        config=dict(
            image_size=336, patch_size=14, num_classes=0, pre_norm=True, patch_bias=False, layer_norm_eps=1e-5,
            global_pool="map", attn_pool_num_heads=8, pool_include_prefix=True, rope_type="cat",
            rope_grid_indexing="xy", ref_feat_shape=(24, 24), rope_grid_offset=1.0, embed_dim=1024, depth=24,
            num_heads=16, mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5), resize_mode="squash", interpolation="bilinear",
        ),
        open_clip="PE-Core-L-14-336",
    ),
    "siglip_vitb16": CatalogueEntry(
        "SigLIP ViT-B/16", "timm/ViT-B-16-SigLIP", 812_623_880,
        "WebLI image-text pairs (Google SigLIP, sigmoid contrastive loss)",
        "Its text tower comes with it. No class token: an attention-pool head's probe query"
        " gathers the image, and its attention is shown where a class token's would be.",
        config=_SIGLIP_B, open_clip="ViT-B-16-SigLIP", tokenizer=True,
    ),
    "siglip2_vitb16": CatalogueEntry(
        "SigLIP 2 ViT-B/16", "timm/ViT-B-16-SigLIP2", 1_500_751_880,
        "WebLI image-text pairs (Google SigLIP 2: sigmoid loss, captioning, self-distillation and"
        " masked prediction)",
        "Its text tower comes with it (Gemma's 256,000-token vocabulary, most of the download)."
        " SigLIP's architecture (an attention-pool probe, no class token), trained also for dense"
        " features: its patch tokens and maps are cleaner than SigLIP's.",
        config=_SIGLIP_B, open_clip="ViT-B-16-SigLIP2", tokenizer=True,
    ),
    "siglip_so400m14_384": CatalogueEntry(
        "SigLIP So400m/14-384", "timm/ViT-SO400M-14-SigLIP-384", 3_511_841_992,
        "WebLI image-text pairs (Google SigLIP, sigmoid contrastive loss; the shape-optimised 400M tower)",
        "Its text tower comes with it. The tower PaliGemma and many VLMs are built on: no class token,"
        " an attention-pool probe gathers the image (shown where a class token's would be). Its 384 px"
        " input is 27 patches of 14 a side: the last 6 rows and columns of pixels are never read.",
        config=dict(
            # As open_clip runs it (timm's trunk: exact GELU); 4304 hidden units (timm's 3.7362 x 1152).
            image_size=378, unread_margin=6, patch_size=14, num_classes=0, class_token=False, global_pool="map",
            act_layer="gelu", embed_dim=1152, depth=27, num_heads=16, mlp_ratio=4304 / 1152,
            resize_mode="squash", interpolation="bicubic",
        ),
        open_clip="ViT-SO400M-14-SigLIP-384", tokenizer=True,
    ),
    # Only the vision tower of the 7B VLM's three shards is downloaded (its tensors' byte ranges).
    "llava15_7b_tower": CatalogueEntry(
        "LLaVA-1.5 7B's vision tower (CLIP ViT-L/14-336)", "llava-hf/llava-1.5-7b-hf", 607_014_912,
        "OpenAI CLIP's 400 million image-text pairs; LLaVA-1.5 kept it frozen while it trained its"
        " projector and Vicuna-7B on 1.2 million image-instruction pairs",
        "What LLaVA-1.5 sees: its language model reads the penultimate layer's 576 patch tokens, the"
        " class token dropped (marked on every page). CLIP's attention: noisy, with a few background"
        " tokens that everyone reads.",
        config=dict(
            image_size=336, patch_size=14, num_classes=0, pre_norm=True, patch_bias=False, act_layer="quick_gelu",
            layer_norm_eps=1e-5, mean=OPENAI_CLIP_MEAN, std=OPENAI_CLIP_STD, embed_dim=1024, depth=24, num_heads=16,
            language_model_layer=23, language_model_drops_class_token=True,
            # its preprocessor_config.json's CLIPImageProcessor: the shorter side to 336, the centre kept
            resize_mode="shortest", transform_library="transformers",
        ),
        licence="MIT (OpenAI's CLIP tower; the repository's language model, under the Llama 2 licence, is not downloaded)",
        vlm=True,
    ),
    # Qwen2.5-VL-3B's windowed tower and its merger (transformers' Qwen2_5_VLVisionConfig at the
    # published 3B values, out_hidden_size its language model's width), read as its whole folder is
    # (weights/from_qwen_vl.py) with the repository's preprocessor_config.json: its pixel budget.
    # size_bytes: the tower's bfloat16 parameters (668,684,288, counted on the meta device).
    "qwen25_vl_3b_tower": CatalogueEntry(
        "Qwen2.5-VL 3B's vision tower (window attention, 2x2 merger)", "Qwen/Qwen2.5-VL-3B-Instruct", 1_337_368_576,
        "Qwen2.5-VL's pre-training data (image-text pairs, documents, OCR, grounding and video), with its"
        " language model, each picture at its own resolution",
        "What Qwen2.5-VL-3B sees: its language model reads the patch merger's output, each 2 x 2 of"
        " patches one token of 2048 numbers, (H/28) x (W/28) tokens (marked on every page). No class"
        " token, 2D rotary positions; windows of 8 x 8 patches (112 px) except in blocks 7, 15, 23 and"
        " 31, which attend everywhere; a picture is resized to multiples of 28 within its pixel budget.",
        config=dict(
            image_size=(448, 448), patch_size=14, num_classes=0, embed_dim=1280, depth=32, num_heads=16,
            mlp_ratio=3420 / 1280, swiglu_mlp=True, swiglu_align_to=4, norm_layer="rmsnorm", global_pool="mean",
            class_token=False, fc_norm=False, final_norm=False, patch_bias=False, abs_pos_embed=False, rope_type="axial",
            rope_temperature=10000.0, attn_window=8, full_attention_blocks=(7, 15, 23, 31), spatial_merge_size=2,
            merger_dim=2048, language_model_layer=32, pixel_budget=(56 * 56, 16384 * 28 * 28), mean=OPENAI_CLIP_MEAN,
            std=OPENAI_CLIP_STD, normalization_source="publisher: preprocessor_config.json",
        ),
        licence=QWEN_RESEARCH_LICENCE, terms_to_accept=True, vlm=True,
    ),
    "dinov3_vits16": CatalogueEntry(
        "DINOv3 ViT-S/16", "timm/vit_small_patch16_dinov3.lvd1689m", 86_347_776,
        "LVD-1689M, 1.7 billion curated web images without labels (DINOv3, distilled from its 7B)",
        "Dense features kept sharp to the last layer: token PCA and patch similarity part objects; 4"
        " registers take the high-norm tokens, and rotary positions make any image size native.",
        config=dict(image_size=224, **_VIT_S, **_DINOV3), licence=DINOV3_LICENCE, terms_to_accept=True, eva_names=True,
    ),
    "dinov3_vitb16": CatalogueEntry(
        "DINOv3 ViT-B/16", "timm/vit_base_patch16_dinov3.lvd1689m", 342_564_864,
        "LVD-1689M, 1.7 billion curated web images without labels (DINOv3, distilled from its 7B)",
        "Like DINOv3 ViT-S/16 with twice the heads: clean, object-centred maps at any image size.",
        config=dict(image_size=224, **_VIT_B, **_DINOV3), licence=DINOV3_LICENCE, terms_to_accept=True, eva_names=True,
    ),
}



def imagenet_class_names() -> tuple[str, ...]:
    """The 1000 ImageNet-1k class names in the usual index order (shipped with torchvision)."""
    import torchvision.models

    return tuple(torchvision.models.ViT_B_16_Weights.IMAGENET1K_V1.meta["categories"])


def entry(name: str) -> CatalogueEntry:
    if name not in CATALOGUE:
        raise KeyError(name)
    return CATALOGUE[name]

