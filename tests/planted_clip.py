"""A CLIP-shaped model whose answer is known, for the open-vocabulary maps: an image of 8 x 8
patches, each 'object' (channel 0 lit) or 'background' (channel 1 lit), embedded along its own
axis; every block but the last adds nothing, the last one's class token averages every token's
value (q = k = 0) and the image embedding is the pooled token itself. The text 'object' is where
a lone object patch points: the image's score for it depends on the planted patches only."""
import torch
import torch.nn.functional as F

import vit_explorer as vx
from vit_explorer.text.towers import ImageTextModel

GRID = 8
PATCH = 8
# (row, column) of the patches that carry the object: a 3 x 3 square and one more below it.
PLANTED = [(row, column) for row in range(2, 5) for column in range(1, 4)] + [(5, 2)]


def planted_mask(grid: int = GRID) -> torch.Tensor:
    """(grid, grid) bool: the planted patches, on a grid ``grid // GRID`` times finer."""
    mask = torch.zeros(GRID, GRID, dtype=torch.bool)
    for row, column in PLANTED:
        mask[row, column] = True
    repeat = grid // GRID
    return mask.repeat_interleave(repeat, 0).repeat_interleave(repeat, 1)


def planted_vit(depth: int = 6, patch_size: int = PATCH, last_block: bool = True, **config) -> vx.ViT:
    """The image tower (or, ``last_block`` False, one whose blocks all add nothing: a proxy whose
    features are the patches' own axes)."""
    config = vx.ViTConfig(
        image_size=GRID * PATCH, patch_size=patch_size, embed_dim=8, depth=depth, num_heads=1, num_classes=0,
        mean=(0.0,) * 3, std=(1.0,) * 3, **config,
    )
    model = vx.ViT(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.zero_()
        model.patch_embed.proj.weight[0, 0] = 1 / patch_size**2  # axis 0: the object channel's mean
        model.patch_embed.proj.weight[1, 1] = 1 / patch_size**2  # axis 1: the background channel's mean
        for block in model.blocks:
            block.norm1.weight.fill_(1)
            block.norm2.weight.fill_(1)
        if last_block:
            dim = config.embed_dim
            model.blocks[-1].attn.qkv.weight[2 * dim:].copy_(torch.eye(dim))  # v = the normed token
            model.blocks[-1].attn.proj.weight.copy_(torch.eye(dim))
        model.norm.weight.fill_(1)
    return model


def planted_clip(depth: int = 6) -> ImageTextModel:
    model = planted_vit(depth)
    return ImageTextModel(
        image=model, image_projection=torch.eye(model.config.embed_dim), text=None, tokenizer=None,
        context_length=0, scoring="softmax", logit_scale=1.0, logit_bias=0.0,
    )


def planted_siglip() -> ImageTextModel:
    """SigLIP's shape: no class token, blocks that add nothing, an attention pool whose probe
    reads every patch alike (q = k = 0) and carries each patch's token as it is (v, proj: the
    identity; no MLP); the image embedding is the pooled token."""
    model = planted_vit(depth=2, last_block=False, class_token=False, global_pool="map")
    pool, dim = model.attn_pool, model.config.embed_dim
    with torch.no_grad():
        pool.kv.weight[dim:].copy_(torch.eye(dim))
        pool.proj.weight.copy_(torch.eye(dim))
        pool.norm.weight.fill_(1)
    return ImageTextModel(
        image=model, image_projection=None, text=None, tokenizer=None,
        context_length=0, scoring="sigmoid", logit_scale=1.0, logit_bias=0.0,
    )


def planted_image() -> torch.Tensor:
    image = torch.zeros(1, 3, GRID * PATCH, GRID * PATCH)
    mask = planted_mask(GRID * PATCH)
    image[0, 0] = mask.float()
    image[0, 1] = (~mask).float()
    return image


def planted_texts(model: ImageTextModel) -> torch.Tensor:
    """(2, E) unit texts 'object' and 'background': where an image of that patch alone points."""
    texts = []
    for channel in (0, 1):
        lone = torch.zeros(1, 3, GRID * PATCH, GRID * PATCH)
        lone[:, channel] = 1.0
        with torch.no_grad():
            texts.append(model.project_image(model.image(lone))[0])
    return F.normalize(torch.stack(texts), dim=-1)


def iou_of_top_half(values: torch.Tensor) -> float:
    """The map (gh, gw) thresholded halfway between its lowest and highest value, against the
    planted patches (on the map's grid): intersection over union."""
    found = values >= (values.min() + values.max()) / 2
    truth = planted_mask(values.shape[-1])
    return float((found & truth).sum() / (found | truth).sum())
