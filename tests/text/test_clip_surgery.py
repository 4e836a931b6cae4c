"""CLIP Surgery against its authors' code on the same random weights, and on a model whose answer
is known (tests/planted_clip.py)."""
from collections import OrderedDict

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import vit_explorer as vx
from vit_explorer.text import load_image_text_model
from vit_explorer.text import clip_surgery

from planted_clip import iou_of_top_half, planted_clip, planted_image, planted_texts
from textmodels import SMALL_CLIP, open_clip_folder

SURGERY_CLIP = {**SMALL_CLIP, "vision_cfg": {**SMALL_CLIP["vision_cfg"], "layers": 6}}


# --- The authors' code: xmed-lab/CLIP_Surgery, clip/clip_surgery_model.py and clip/clip.py, verbatim
# but for the ResNet branches and the drawing (MIT licence). ---
class Attention(nn.Module):
    def __init__(self, out_dim, dim, num_heads=8, qkv_bias=False, qk_scale=None, attn_drop=0., proj_drop=0., settings=''):
        super().__init__()
        self.num_heads = num_heads
        head_dim = dim // num_heads
        self.scale = qk_scale or head_dim ** -0.5
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(out_dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)
        self.settings = settings

    def forward(self, x):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, C // self.num_heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        attn_ori = (q @ k.transpose(-2, -1)) * self.scale
        attn_ori = attn_ori.softmax(dim=-1)
        attn_ori = self.attn_drop(attn_ori)
        k = v
        q = k
        scale = self.scale
        attn = (q @ k.transpose(-2, -1)) * scale
        attn = (attn).softmax(dim=-1)
        attn = self.attn_drop(attn)
        x_ori = (attn_ori @ v).transpose(1, 2).reshape(B, N, C)
        x = (attn @ v).transpose(1, 2).reshape(B, N, C)  # clip_surgery
        x = self.proj_drop(self.proj(x))
        x_ori = self.proj_drop(self.proj(x_ori))
        return [x, x_ori]


class QuickGELU(nn.Module):
    def forward(self, x: torch.Tensor):
        return x * torch.sigmoid(1.702 * x)


class ResidualAttentionBlock(nn.Module):
    def __init__(self, d_model: int, n_head: int, attn_mask: torch.Tensor = None):
        super().__init__()
        self.attn = nn.MultiheadAttention(d_model, n_head)
        self.ln_1 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(OrderedDict([
            ("c_fc", nn.Linear(d_model, d_model * 4)),
            ("gelu", QuickGELU()),
            ("c_proj", nn.Linear(d_model * 4, d_model))
        ]))
        self.ln_2 = nn.LayerNorm(d_model)
        self.attn_mask = attn_mask

    def attention(self, x: torch.Tensor):
        self.attn_mask = self.attn_mask.to(dtype=x.dtype, device=x.device) if self.attn_mask is not None else None
        if isinstance(self.attn, Attention):
            x = x.transpose(0, 1)
            x, x_ori = self.attn(x)
            return [x.transpose(0, 1), x_ori.transpose(0, 1)]
        else:
            return self.attn(x, x, x, need_weights=False, attn_mask=self.attn_mask)[0]

    def forward(self, x):
        if isinstance(self.attn, Attention):
            if isinstance(x, list):
                x, x_ori = x
                x_res = self.attention(self.ln_1(x_ori))
                x_res, x_ori_res = x_res
                x_ori += x_ori_res
                x_ori = x_ori + self.mlp(self.ln_2(x_ori))
                x += x_res  # skip ffn for the new path
                return [x, x_ori]
            else:
                x_res = self.attention(self.ln_1(x))
                if isinstance(x_res, list):
                    x_res, x_ori_res = x_res
                    x_ori = x + x_ori_res
                    x_ori = x_ori + self.mlp(self.ln_2(x_ori))
                    x += x_res
                    return [x, x_ori]
        else:
            x = x + self.attention(self.ln_1(x))
            x = x + self.mlp(self.ln_2(x))
        return x


class Transformer(nn.Module):
    def __init__(self, width: int, layers: int, heads: int, attn_mask: torch.Tensor = None, need_weights: bool = False):
        super().__init__()
        self.width = width
        self.layers = layers
        self.resblocks = nn.Sequential(*[ResidualAttentionBlock(width, heads, attn_mask) for i in range(layers)])

    def forward(self, x: torch.Tensor):
        return self.resblocks(x)


class VisionTransformer(nn.Module):
    def __init__(self, input_resolution: int, patch_size: int, width: int, layers: int, heads: int, output_dim: int):
        super().__init__()
        self.input_resolution = input_resolution
        self.output_dim = output_dim
        self.conv1 = nn.Conv2d(in_channels=3, out_channels=width, kernel_size=patch_size, stride=patch_size, bias=False)
        scale = width ** -0.5
        self.class_embedding = nn.Parameter(scale * torch.randn(width))
        self.positional_embedding = nn.Parameter(scale * torch.randn((input_resolution // patch_size) ** 2 + 1, width))
        self.ln_pre = nn.LayerNorm(width)
        self.transformer = Transformer(width, layers, heads, need_weights=True)
        self.attn = None
        self.embed_dim = width
        self.num_heads = heads
        self.ln_post = nn.LayerNorm(width)
        self.proj = nn.Parameter(scale * torch.randn(width, output_dim))

    @torch.no_grad()
    def forward(self, x: torch.Tensor):
        if self.attn == None:
            for i in range(1, 7):  # surgery 7, maskclip 2
                self.attn = Attention(self.embed_dim, self.embed_dim, self.num_heads, True)
                self.attn.qkv.weight.data = self.transformer.resblocks[-i].attn.in_proj_weight.clone()
                self.attn.qkv.bias.data = self.transformer.resblocks[-i].attn.in_proj_bias.clone()
                self.attn.proj.weight.data = self.transformer.resblocks[-i].attn.out_proj.weight.clone()
                self.attn.proj.bias.data = self.transformer.resblocks[-i].attn.out_proj.bias.clone()
                self.transformer.resblocks[-i].attn = self.attn
        x = self.conv1(x)
        x = x.reshape(x.shape[0], x.shape[1], -1)
        x = x.permute(0, 2, 1)
        x = torch.cat([self.class_embedding.to(x.dtype) + torch.zeros(x.shape[0], 1, x.shape[-1], dtype=x.dtype, device=x.device), x], dim=1)
        x = x + self.positional_embedding.to(x.dtype)
        x = self.ln_pre(x)
        x = x.permute(1, 0, 2)  # NLD -> LND
        x, x_ori = self.transformer(x)
        x[0, :, :] = x_ori[0, :, :]  # clip_surgery
        x = x.permute(1, 0, 2)  # LND -> NLD
        x = self.ln_post(x)
        x = x @ self.proj
        return x


def clip_feature_surgery(image_features, text_features, redundant_feats=None, t=2):
    if redundant_feats != None:
        similarity = image_features @ (text_features - redundant_feats).t()
    else:
        prob = image_features[:, :1, :] @ text_features.t()
        prob = (prob * 2).softmax(-1)
        w = prob / prob.mean(-1, keepdim=True)
        b, n_t, n_i, c = image_features.shape[0], text_features.shape[0], image_features.shape[1], image_features.shape[2]
        feats = image_features.reshape(b, n_i, 1, c) * text_features.reshape(1, 1, n_t, c)
        feats *= w.reshape(1, 1, n_t, 1)
        redundant_feats = feats.mean(2, keepdim=True)  # along cls dim
        feats = feats - redundant_feats
        similarity = feats.sum(-1)
    return similarity
# --- end of the authors' code ---


def _authors_features(open_clip_model, image: torch.Tensor) -> torch.Tensor:
    vision = SURGERY_CLIP["vision_cfg"]
    authors = VisionTransformer(
        vision["image_size"], vision["patch_size"], vision["width"], vision["layers"],
        vision["width"] // vision["head_width"], SURGERY_CLIP["embed_dim"],
    )
    authors.load_state_dict(open_clip_model.visual.state_dict())
    features = authors.eval()(image)
    return features / features.norm(dim=-1, keepdim=True)  # as their demo does


@pytest.fixture(scope="module")
def surgery_pair(tmp_path_factory):
    folder = tmp_path_factory.mktemp("surgery")
    theirs = open_clip_folder(folder, SURGERY_CLIP)
    return theirs, load_image_text_model(folder)


def test_the_surgery_maps_equal_the_authors(surgery_pair):
    theirs, ours = surgery_pair
    image = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    texts = F.normalize(torch.randn(3, SURGERY_CLIP["embed_dim"], generator=torch.Generator().manual_seed(2)), dim=-1)
    features = _authors_features(theirs, image)

    captured = vx.capture(ours.image, image)
    patches = clip_surgery.patch_embeddings(ours, captured)
    torch.testing.assert_close(patches, features[:, 1:], atol=1e-5, rtol=0)
    maps = clip_surgery.similarity_maps(ours.project_image(captured.logits), patches, texts, captured.grid_size)
    redundant = texts.mean(dim=0)  # any (E,) vector: their single-text form subtracts it as given
    one = clip_surgery.similarity_maps(ours.project_image(captured.logits), patches, texts[:1], captured.grid_size, redundant)
    for index in range(2):  # their surgery weighs the texts for one image at a time
        expected = clip_feature_surgery(features[index:index + 1], texts)[0, 1:].t().reshape(3, 4, 4)
        torch.testing.assert_close(maps[index], expected, atol=1e-4, rtol=0)
        expected = clip_feature_surgery(features[index:index + 1], texts[:1], redundant)[0, 1:].t().reshape(1, 4, 4)
        torch.testing.assert_close(one[index], expected, atol=1e-4, rtol=0)


def test_one_prompt_loses_the_empty_prompt_and_what_it_cannot_do_is_a_sentence(surgery_pair):
    _, ours = surgery_pair
    captured = vx.capture(ours.image, torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(3)))
    patches = clip_surgery.patch_embeddings(ours, captured)
    text = ours.embed_texts(["a photo of a cat."])
    empty = ours.embed_texts(["a photo of ."])[0]
    torch.testing.assert_close(
        clip_surgery.maps(ours, captured, text)[0, 0], (patches[0] @ (text[0] - empty)).reshape(4, 4), atol=1e-6, rtol=0,
    )
    with pytest.raises(ValueError, match="one prompt alone needs the empty prompt"):
        clip_surgery.similarity_maps(ours.project_image(captured.logits), patches, patches[0, :1], captured.grid_size)
    shallow = planted_clip(depth=2)
    with pytest.raises(ValueError, match="changes the last 6 blocks; this model has only 2"):
        clip_surgery.patch_embeddings(shallow, vx.capture(shallow.image, planted_image()))


def test_the_surgery_finds_the_planted_object():
    model, image = planted_clip(), planted_image()
    captured = vx.capture(model.image, image)
    patches = clip_surgery.patch_embeddings(model, captured)
    texts = planted_texts(model)
    maps = clip_surgery.similarity_maps(model.project_image(captured.logits), patches, texts, captured.grid_size)
    assert iou_of_top_half(maps[0, 0]) >= 0.9
