"""CLIP- and SigLIP-shaped models with both towers, for the tests: open_clip's own models with
random weights written as open_clip publishes them (open_clip_config.json, open_clip_model.
safetensors and, for SigLIP, a small SentencePiece-style tokenizer made here)."""
import json
import math
from pathlib import Path

import open_clip
import torch
from safetensors.torch import save_file

from vit_explorer.model.config import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD

CORPUS = [
    "a photo of a cat", "a photo of a dog", "a rocket in the sky", "a red square", "a blue circle",
    "the small triangle", "art of the bird", "a bad photo of the car", "itap of a tench", "a photo of a fish",
]
# A small ViT-B-16-like CLIP and SigLIP for the app's tests (the B/16 ones for parity).
SMALL_CLIP = {
    "embed_dim": 32, "quick_gelu": True,
    "vision_cfg": {"image_size": 32, "layers": 2, "width": 64, "patch_size": 8, "head_width": 32},
    "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 2},
}


def randomize(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Weights of a trained model's scale (0.02 matrices, norms near 1): a B/16's 12 layers stay
    finite, and no zero-initialised tensor hides an error."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            noise = torch.randn(parameter.shape, generator=generator)
            if name.endswith("logit_scale"):
                parameter.fill_(math.log(30.0))
            elif name.endswith("logit_bias"):
                parameter.fill_(-5.0)
            elif parameter.ndim == 1 and "norm" in name or name.split(".")[-2:-1] in (["ln_1"], ["ln_2"], ["ln_pre"], ["ln_post"], ["ln_final"]):
                parameter.copy_(1 + 0.1 * noise if name.endswith("weight") else 0.05 * noise)
            else:
                parameter.copy_(0.02 * noise if parameter.ndim > 1 else 0.05 * noise)
            if name.endswith(("class_embedding", "positional_embedding", "pos_embed", "latent")):
                parameter.mul_(10)
    return model.eval()


def make_tokenizer(folder: Path, vocab_size: int = 120) -> None:
    """A Unigram (SentencePiece's model) tokenizer trained on a few prompts, saved as the fast
    tokenizer a SigLIP folder ships: tokenizer.json and tokenizer_config.json."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.Unigram())
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    trainer = trainers.UnigramTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "</s>", "<unk>"], unk_token="<unk>")
    tokenizer.train_from_iterator(CORPUS * 20, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "pad_token": "<pad>", "eos_token": "</s>",
        "unk_token": "<unk>", "model_max_length": 64,
    }))


def open_clip_folder(folder: Path, model_cfg: dict | str, seed: int = 0, preprocess_cfg: dict | None = None):
    """open_clip's model of ``model_cfg`` (a config or the name of one of open_clip's) with random
    weights, written into ``folder`` as its publisher would; returns the open_clip model."""
    if isinstance(model_cfg, str):
        model_cfg = open_clip.get_model_config(model_cfg)
    model_cfg = json.loads(json.dumps(model_cfg))
    folder.mkdir(parents=True, exist_ok=True)
    if model_cfg["text_cfg"].get("hf_tokenizer_name"):
        make_tokenizer(folder)
    arguments = {key: value for key, value in model_cfg.items() if key != "custom_text"}
    with no_init_weights():  # randomize sets every parameter (torch's initialisers: seconds for a B/16)
        model = open_clip.CustomTextCLIP(**arguments) if model_cfg.get("custom_text") else open_clip.CLIP(**arguments)
    randomize(model, seed)
    state = {key: value.detach().clone().contiguous() for key, value in model.state_dict().items()}
    save_file(state, str(folder / "open_clip_model.safetensors"))
    preprocess_cfg = preprocess_cfg or {"mean": list(OPENAI_CLIP_MEAN), "std": list(OPENAI_CLIP_STD)}
    (folder / "open_clip_config.json").write_text(json.dumps({"model_cfg": model_cfg, "preprocess_cfg": preprocess_cfg}))
    return model


def open_clip_tokenizer(folder: Path):
    """open_clip's own tokenizer of a folder, as its users get it."""
    return open_clip.get_tokenizer(f"local-dir:{folder}")


SMALL_SIGLIP_TEXT = {
    "context_length": 16, "vocab_size": 120, "hf_tokenizer_name": "timm/ViT-B-16-SigLIP",
    "tokenizer_kwargs": {"clean": "canonicalize"}, "width": 32, "heads": 2, "layers": 2,
    "no_causal_mask": True, "proj_bias": True, "pool_type": "last", "norm_kwargs": {"eps": 1e-6},
}


def siglip_folder(folder: Path, image_size: int = 32, patch_size: int = 8, seed: int = 0) -> Path:
    """A small SigLIP-shaped model (an attention-pool image tower as a timm trunk, a bidirectional
    text tower read at its last token, a SentencePiece-style tokenizer) as open_clip writes one."""
    import vit_explorer as vx

    folder.mkdir(parents=True, exist_ok=True)
    make_tokenizer(folder)
    image = randomize(vx.ViT(vx.ViTConfig(
        image_size=image_size, patch_size=patch_size, embed_dim=32, depth=2, num_heads=2, num_classes=0,
        class_token=False, global_pool="map", act_layer="gelu",
    )), seed)
    text = randomize(open_clip.model._build_text_tower(32, SMALL_SIGLIP_TEXT), seed + 1)
    state = {f"visual.trunk.{key}": value for key, value in image.state_dict().items()}
    state |= {f"text.{key}": value for key, value in text.state_dict().items()}
    state |= {"logit_scale": torch.tensor([math.log(10.0)]), "logit_bias": torch.tensor([-2.0])}
    save_file({key: value.detach().clone().contiguous() for key, value in state.items()}, str(folder / "open_clip_model.safetensors"))
    model_cfg = {
        "embed_dim": 32, "custom_text": True, "init_logit_bias": -10,
        "vision_cfg": {"image_size": image_size, "timm_model_name": "vit_base_patch16_siglip_224", "timm_pool": "map", "timm_proj": "none"},
        "text_cfg": SMALL_SIGLIP_TEXT,
    }
    (folder / "open_clip_config.json").write_text(json.dumps({
        # As the Hub's SigLIP folders say: the whole picture squashed (open_clip's default crops).
        "model_cfg": model_cfg, "preprocess_cfg": {"mean": [0.5] * 3, "std": [0.5] * 3, "resize_mode": "squash", "interpolation": "bicubic"},
    }))
    return folder


# Hugging Face transformers' CLIPModel and SiglipModel, ViT-B/16-shaped (the text towers too).
HF_B16_VISION = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
                 "patch_size": 16, "image_size": 224}
HF_SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2}


def no_init_weights():
    """transformers' own switch that skips its initialisation (seconds for a B/16)."""
    from transformers.initialization import no_init_weights

    return no_init_weights()


def clip_tokenizer_files(folder: Path) -> None:
    """transformers' CLIPTokenizer made from open_clip's byte-pair vocabulary (OpenAI's), saved
    as a CLIP folder ships it: tokenizer.json and tokenizer_config.json."""
    import transformers
    from open_clip.tokenizer import SimpleTokenizer

    bpe = SimpleTokenizer()
    special = {"<start_of_text>": "<|startoftext|>", "<end_of_text>": "<|endoftext|>"}
    vocab = {special.get(token, token): index for token, index in bpe.encoder.items()}
    merges = [pair for pair, _ in sorted(bpe.bpe_ranks.items(), key=lambda item: item[1])]
    transformers.CLIPTokenizer(vocab=vocab, merges=merges).save_pretrained(str(folder))


def hf_clip_folder(folder: Path, text: dict | None = None, vision: dict | None = None, projection_dim: int = 512,
                   seed: int = 0, tokenizer: bool = True):
    """transformers' CLIPModel (B/16 by default: text 512 wide, 12 layers) with random weights at a
    trained scale, saved with save_pretrained, CLIP's tokenizer beside it; returns the model."""
    import transformers

    text = {"hidden_size": 512, "intermediate_size": 2048, "num_hidden_layers": 12, "num_attention_heads": 8} | (text or {})
    config = transformers.CLIPConfig(text_config=text, vision_config=vision or HF_B16_VISION, projection_dim=projection_dim)
    with no_init_weights():  # randomize sets every parameter
        model = transformers.CLIPModel(config)
    randomize(model, seed)
    model.save_pretrained(str(folder))
    if tokenizer:
        clip_tokenizer_files(folder)
    return model


def hf_siglip_folder(folder: Path, text: dict | None = None, vision: dict | None = None, seed: int = 0,
                     version: int = 1):
    """transformers' SiglipModel (B/16 by default; ``version`` 2: Siglip2Model, NaFlex, its B/16
    at 256 patches) with random weights at a trained scale, saved with save_pretrained, a small
    SentencePiece-style tokenizer beside it; returns the model."""
    import transformers

    text = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12} | (text or {})
    if version == 2:
        vision = vision or {**HF_B16_VISION, "image_size": None, "num_patches": 256}
        vision = {key: value for key, value in vision.items() if key != "image_size"}
        config = transformers.Siglip2Config(text_config=text, vision_config=vision)
    else:
        config = transformers.SiglipConfig(text_config=text, vision_config=vision or HF_B16_VISION)
    with no_init_weights():  # randomize sets every parameter
        model = (transformers.Siglip2Model if version == 2 else transformers.SiglipModel)(config)
    randomize(model, seed)
    model.save_pretrained(str(folder))
    make_tokenizer(folder)
    return model


def planted_clip(image_size: int = 32, patch_size: int = 8):
    """A CLIP whose words see one thing: a patch is 'object' (channel 0 lit) or 'background'
    (channel 1 lit), each embedded along its own axis; one layer whose values are the normed
    tokens, no learned mixing, the image embedding the pooled token itself. Returns the model
    and the unit embeddings of the texts 'object' and 'background': where a lone object (or
    background) patch points, so that each patch's cosine with its own kind's text is 1."""
    import vit_explorer as vx
    from vit_explorer.text.towers import ImageTextModel

    config = vx.ViTConfig(image_size=image_size, patch_size=patch_size, embed_dim=8, depth=1, num_heads=1,
                          num_classes=0, mean=(0.0,) * 3, std=(1.0,) * 3)
    vit = vx.ViT(config).eval()
    with torch.no_grad():
        for parameter in vit.parameters():
            parameter.zero_()
        vit.patch_embed.proj.weight[0, 0] = 1 / patch_size**2  # axis 0: the object channel's mean
        vit.patch_embed.proj.weight[1, 1] = 1 / patch_size**2  # axis 1: the background channel's mean
        dim = config.embed_dim
        vit.blocks[0].norm1.weight.fill_(1)
        vit.blocks[0].attn.qkv.weight[2 * dim:].copy_(torch.eye(dim))  # v = the normed token
        vit.blocks[0].attn.proj.weight.copy_(torch.eye(dim))
        vit.norm.weight.fill_(1)
    model = ImageTextModel(
        image=vit, image_projection=torch.eye(dim), text=None, tokenizer=None,
        context_length=0, scoring="softmax", logit_scale=1.0, logit_bias=0.0,
    )
    texts = []
    with torch.no_grad():
        for channel in (0, 1):
            lone = torch.zeros(1, 3, image_size, image_size)
            lone[:, channel] = 1.0
            texts.append(model.project_image(vit(lone))[0])
    return model, texts[0], texts[1]


def planted_picture(height: int, width: int, object_box: tuple[int, int, int, int]):
    """An RGB PIL picture: green (background) everywhere, red (object) in ``object_box`` (top,
    bottom, left, right)."""
    import numpy as np
    from PIL import Image

    pixels = np.zeros((height, width, 3), dtype=np.uint8)
    pixels[..., 1] = 255
    top, bottom, left, right = object_box
    pixels[top:bottom, left:right] = (255, 0, 0)
    return Image.fromarray(pixels)


def labelled_folder(root: Path) -> tuple[Path, Path, Path]:
    """A labelled folder in ``root`` (images/, masks/, classes.txt) of three 32 x 32 planted
    pictures, full-width bands of object so that the up-sampled patch map changes class exactly on
    the band's edge: a (object rows 0-16, the truth claims 4 more), b (rows 8-24, 8-12 unlabelled),
    c (no object). Classes: background (two names), object, cat (nowhere)."""
    import numpy as np
    from PIL import Image

    images, masks = root / "images", root / "masks"
    images.mkdir(parents=True)
    masks.mkdir()
    a = np.zeros((32, 32), dtype=np.uint8)
    a[:20] = 1
    b = np.zeros((32, 32), dtype=np.uint8)
    b[8:24] = 1
    b[8:12] = 255  # unlabelled
    c = np.zeros((32, 32), dtype=np.uint8)
    for name, rows, truth in (("a", (0, 16), a), ("b", (8, 24), b), ("c", (0, 0), c)):
        planted_picture(32, 32, (*rows, 0, 32)).save(images / f"{name}.png")
        Image.fromarray(truth).save(masks / f"{name}.png")
    (root / "classes.txt").write_text("background, backdrop\nobject\ncat\n")
    return images, masks, root / "classes.txt"
