"""ProxyCLIP against its authors' code on the same random weights (a DINO-shaped proxy on a finer
grid than the CLIP's), and on a model whose answer is known (tests/planted_clip.py)."""
import pytest
import torch
import torch.nn.functional as F

import vit_explorer as vx
from vit_explorer.text import load_image_text_model
from vit_explorer.text import proxyclip
from vit_explorer.text.maps import similarity_maps

from helpers import randomize, timm_twin
from planted_clip import iou_of_top_half, planted_clip, planted_image, planted_texts, planted_vit
from textmodels import SMALL_CLIP, open_clip_folder


# --- The authors' code: mc-lan/ProxyCLIP, open_clip/transformer.py (VisionTransformer.forward and
# custom_attn) and proxyclip_segmentor.py (the DINO branch of forward_feature), verbatim but for
# the stem, which is open_clip's at the trained size. ---
def custom_attn(attn_layer, x, ex_feats=None, beta=1.2, gamma=3.0, token_size=(16, 16)):
    num_heads = attn_layer.num_heads
    _, bsz, embed_dim = x.size()
    head_dim = embed_dim // num_heads
    q, k, v = F.linear(x, attn_layer.in_proj_weight, attn_layer.in_proj_bias).chunk(3, dim=-1)
    v = v.contiguous().view(-1, bsz * num_heads, head_dim).transpose(0, 1)
    B, C, H, W = ex_feats.shape
    q_k = F.normalize(ex_feats.flatten(2, 3), dim=1)
    similarity = torch.einsum("b c m, b c n -> b m n", q_k, q_k)
    similarity = (similarity - torch.mean(similarity) * beta) * gamma
    similarity[similarity < 0.0] = float('-inf')
    mask = similarity.to(q.dtype).unsqueeze(1).repeat(1, num_heads, 1, 1)
    mask = mask.reshape(bsz * num_heads, mask.shape[2], mask.shape[3])
    attn_weights = F.softmax(mask, dim=-1)
    v = v[:, 1:, :].reshape(bsz*num_heads, token_size[0], token_size[1], head_dim).permute(0, 3, 1, 2)
    v = F.interpolate(v, size=(H, W), mode='bilinear', align_corners=False)
    v = v.permute(0, 2, 3, 1).reshape(bsz*num_heads, H*W, head_dim)
    attn_output = torch.bmm(attn_weights, v)
    attn_output = attn_output.transpose(0, 1).contiguous().view(-1, bsz, embed_dim)
    attn_output = attn_layer.out_proj(attn_output)
    return attn_output


def encode_image(visual, x, ex_feats, beta=1.2, gamma=3.0):
    B, nc, w, h = x.shape
    x = visual.conv1(x).flatten(2).transpose(1, 2)
    x = torch.cat([visual.class_embedding.expand(x.shape[0], 1, -1), x], dim=1) + visual.positional_embedding
    x = visual.ln_pre(x)
    token_size = h // visual.patch_size[0], w // visual.patch_size[1]
    for blk in visual.transformer.resblocks[:-1]:
        x = blk(x)  # open_clip's blocks take (batch, tokens, width) today
    x = x.permute(1, 0, 2)  # NLD -> LND
    for blk in visual.transformer.resblocks[-1:]:
        x = custom_attn(blk.attn, blk.ln_1(x), ex_feats=ex_feats, beta=beta, gamma=gamma, token_size=token_size)
    x = x.permute(1, 0, 2)  # LND -> NLD
    x = visual.ln_post(x)
    x = x @ visual.proj
    return x


def dino_features(vfm, imgs_norm, patch_size):
    feat = vfm.forward_features(imgs_norm)  # DINO's get_intermediate_layers(x)[0]: the last tokens, normed
    nb_im = feat.shape[0]
    I, J = imgs_norm[0].shape[-2] // patch_size, imgs_norm[0].shape[-2] // patch_size
    return feat[:, 1:, :].reshape(nb_im, I, J, -1).permute(0, 3, 1, 2)
# --- end of the authors' code ---


def _proxy(patch_size: int = 4, image_size=32) -> vx.ViT:
    return randomize(vx.ViT(vx.ViTConfig(
        image_size=image_size, patch_size=patch_size, num_classes=0, embed_dim=24, depth=2, num_heads=2,
    )))


def test_proxy_attention_equals_the_authors(tmp_path):
    theirs = open_clip_folder(tmp_path, SMALL_CLIP)
    ours = load_image_text_model(tmp_path)
    proxy = _proxy()
    twin = timm_twin(proxy.config)
    twin.load_state_dict(proxy.state_dict())
    image = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        expected = F.normalize(encode_image(theirs.visual, image, dino_features(twin, image, 4)), dim=-1)

    borrowed = proxyclip.Proxy(proxy, vx.capture(proxy, image))
    patches = proxyclip.patch_embeddings(ours, vx.capture(ours.image, image), borrowed)
    assert borrowed.grid_size == (8, 8)
    torch.testing.assert_close(patches, expected, atol=1e-5, rtol=0)
    texts = F.normalize(torch.randn(2, SMALL_CLIP["embed_dim"], generator=torch.Generator().manual_seed(9)), dim=-1)
    torch.testing.assert_close(
        similarity_maps(patches, texts, borrowed.grid_size),
        (expected @ texts.t()).transpose(1, 2).reshape(1, 2, 8, 8), atol=1e-4, rtol=0,
    )


def test_what_proxyclip_cannot_do_is_refused_in_a_sentence():
    model = planted_clip()
    captured = vx.capture(model.image, planted_image())
    with pytest.raises(ValueError, match="choose a proxy model"):
        proxyclip.patch_embeddings(model, captured, None)
    wide = _proxy(image_size=(32, 64))
    with pytest.raises(ValueError, match=r"the proxy's patch grid \(8 x 16\) has another shape than CLIP's \(8 x 8\)"):
        proxyclip.patch_embeddings(model, captured, proxyclip.Proxy(wide, vx.capture(wide, torch.zeros(1, 3, 32, 64))))
    # A blank picture: the proxy's patches all alike, every similarity below beta times their mean.
    blank = torch.zeros_like(planted_image())
    blank[:, 1] = 1.0
    proxy = planted_vit(depth=1, patch_size=4, last_block=False)
    with pytest.raises(ValueError, match="masks every patch out"):
        proxyclip.patch_embeddings(model, vx.capture(model.image, blank), proxyclip.Proxy(proxy, vx.capture(proxy, blank)))


def test_the_proxy_attention_finds_the_planted_object():
    model, image = planted_clip(), planted_image()
    proxy = planted_vit(depth=1, patch_size=4, last_block=False)  # its features: each patch's own axis
    patches = proxyclip.patch_embeddings(model, vx.capture(model.image, image), proxyclip.Proxy(proxy, vx.capture(proxy, image)))
    maps = similarity_maps(patches, planted_texts(model), (16, 16))
    assert iou_of_top_half(maps[0, 0]) >= 0.9


def test_the_proxy_reads_the_same_pixels_normalised_as_it_was_trained():
    clip = vx.ViTConfig(image_size=32, patch_size=8, num_classes=0, embed_dim=8, depth=1, num_heads=1)
    dino = vx.ViTConfig(image_size=32, patch_size=4, num_classes=0, embed_dim=8, depth=1, num_heads=1,
                        mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225))
    assert clip.mean != dino.mean
    pixels = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(10))

    def normalised(config):
        return (pixels - torch.tensor(config.mean)[:, None, None]) / torch.tensor(config.std)[:, None, None]

    torch.testing.assert_close(proxyclip.proxy_input(normalised(clip), clip, dino), normalised(dino), atol=1e-6, rtol=0)
    larger = proxyclip.proxy_input(normalised(clip), clip, dino.replace(image_size=64))
    torch.testing.assert_close(larger, F.interpolate(normalised(dino), size=(64, 64), mode="bilinear"), atol=1e-6, rtol=0)
