"""Where each text is, tested on a model whose answer is known: one text's score depends on
planted patches only, and the maps must find them."""
import pytest
import torch
import torch.nn.functional as F

import vit_explorer as vx
from vit_explorer.text import load_image_text_model
from vit_explorer.text.maps import best_prompt, patch_embeddings, relevance, similarity_maps
from vit_explorer.text.towers import ImageTextModel

from textmodels import SMALL_CLIP, open_clip_folder, siglip_folder

PLANTED = [(0, 1), (2, 3), (3, 0)]  # (row, column) of the patches that carry the object


def _planted_model() -> ImageTextModel:
    """One layer, one head, no learned mixing: q = k = 0, so the class token averages every
    patch's value. A patch is 'object' (channel 0 lit) or 'background' (channel 1 lit), each
    embedded along its own axis; the image embedding is the pooled token itself. The text
    "object" is the object axis: the image's score for it rises with the object patches'
    share of the pool and with nothing else."""
    config = vx.ViTConfig(image_size=32, patch_size=8, embed_dim=8, depth=1, num_heads=1, num_classes=0, mean=(0.0,) * 3, std=(1.0,) * 3)
    model = vx.ViT(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.zero_()
        model.patch_embed.proj.weight[0, 0] = 1 / 64  # axis 0: the object channel's mean
        model.patch_embed.proj.weight[1, 1] = 1 / 64  # axis 1: the background channel's mean
        dim = config.embed_dim
        model.blocks[0].norm1.weight.fill_(1)
        model.blocks[0].attn.qkv.weight[2 * dim:].copy_(torch.eye(dim))  # v = the normed token
        model.blocks[0].attn.proj.weight.copy_(torch.eye(dim))
        model.norm.weight.fill_(1)
    return ImageTextModel(
        image=model, image_projection=torch.eye(config.embed_dim), text=None, tokenizer=None,
        context_length=0, scoring="softmax", logit_scale=1.0, logit_bias=0.0,
    )


def _planted_image() -> torch.Tensor:
    image = torch.zeros(1, 3, 32, 32)
    image[:, 1] = 1.0  # background everywhere
    for row, column in PLANTED:
        image[:, :, row * 8:(row + 1) * 8, column * 8:(column + 1) * 8] = 0
        image[:, 0, row * 8:(row + 1) * 8, column * 8:(column + 1) * 8] = 1.0
    return image


def _direction(model: ImageTextModel, image: torch.Tensor) -> torch.Tensor:
    """The unit 'object' text: where a lone object patch's token points after the final norm."""
    lone = torch.zeros_like(image)
    lone[:, 0] = 1.0
    return model.project_image(model.image(lone))[0]


def _ranked(values: torch.Tensor, count: int) -> set[tuple[int, int]]:
    flat = values.reshape(-1).argsort(descending=True)[:count]
    width = values.shape[-1]
    return {(int(index) // width, int(index) % width) for index in flat}


def test_relevance_ranks_the_planted_patches_first():
    model, image = _planted_model(), _planted_image()
    text = _direction(model, image)
    relevance_map = relevance(model, image, text)[0]
    assert _ranked(relevance_map, len(PLANTED)) == set(PLANTED)
    others = [relevance_map[row, column] for row in range(4) for column in range(4) if (row, column) not in PLANTED]
    assert max(others) < min(relevance_map[row, column] for row, column in PLANTED)


def test_dense_similarity_and_best_prompt_find_the_planted_patches():
    model, image = _planted_model(), _planted_image()
    captured = vx.capture(model.image, image)
    patches = patch_embeddings(model, captured)
    obj = _direction(model, image)
    lone = torch.zeros_like(image)
    lone[:, 1] = 1.0
    background = model.project_image(model.image(lone))[0]
    maps = similarity_maps(patches, torch.stack([obj, background]), captured.grid_size)
    assert _ranked(maps[0, 0], len(PLANTED)) == set(PLANTED)
    assert torch.allclose(maps[0, 0][tuple(zip(*PLANTED))], torch.ones(len(PLANTED)), atol=1e-5)
    expected = torch.ones(4, 4, dtype=torch.long)
    for row, column in PLANTED:
        expected[row, column] = 0
    assert torch.equal(best_prompt(maps)[0], expected)


def _attention_of_the_pool_on_one_patch(model: ImageTextModel, captured, patch: int) -> torch.Tensor:
    """What the pooled image embedding would be if the pool read ``patch`` alone: the model's own
    last block (CLIP) or attention pool (SigLIP) run with that patch's attention 1, everything
    else of the pool as it is, minus the residual and last MLP (MaskCLIP's reading)."""
    vit = model.image
    prefix = captured.num_prefix_tokens
    if vit.attn_pool is not None:
        tokens = vit.norm(captured.tokens[:, -1, prefix:])
        v = vit.attn_pool.kv(tokens).chunk(2, dim=-1)[1][:, patch]
        out = vit.attn_pool.proj(v)
        return model.project_image(out + vit.attn_pool.mlp(vit.attn_pool.norm(out)))
    block = vit.blocks[-1]
    entering = block.norm1(captured.tokens[:, -2])
    dim = vit.config.embed_dim
    v = F.linear(entering, block.attn.qkv.weight[2 * dim:], block.attn.qkv.bias[2 * dim:])[:, prefix + patch]
    return model.project_image(vit.norm(block.attn.proj(v)))


@pytest.mark.parametrize("shape", ["clip", "siglip"])
def test_patch_embeddings_follow_the_pools_value_path(tmp_path, shape):
    folder = siglip_folder(tmp_path / shape) if shape == "siglip" else tmp_path / shape
    if shape == "clip":
        open_clip_folder(folder, SMALL_CLIP)
    model = load_image_text_model(folder)
    image = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    captured = vx.capture(model.image, image)
    patches = patch_embeddings(model, captured)
    assert patches.shape == (1, 16, model.embed_dim)
    with torch.no_grad():
        for patch in (0, 7, 15):
            torch.testing.assert_close(patches[:, patch], _attention_of_the_pool_on_one_patch(model, captured, patch), atol=1e-5, rtol=0)
