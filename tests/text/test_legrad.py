"""LeGrad against its authors' code on the same random weights (a CLIP and a SigLIP tower), and on
a model whose answer is known (tests/planted_clip.py)."""
import math
import types
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from einops import rearrange
from timm.models.vision_transformer import VisionTransformer

import vit_explorer as vx
from vit_explorer.text import load_image_text_model
from vit_explorer.text.legrad import legrad

from planted_clip import iou_of_top_half, planted_clip, planted_image, planted_siglip, planted_texts
from textmodels import SMALL_CLIP, open_clip_folder, siglip_folder


# --- The authors' code: WalBouss/LeGrad, legrad/utils.py and legrad/wrapper.py (MIT licence),
# verbatim but for where they read a hooked module's attribute (a dict here) and their min_max
# and up-sampling, kept after the loops below. ---
def hooked_attention_forward(self, x, x_k, x_v, attn_mask=None, need_weights=False):
    L, N, C = x.shape
    q, k, v = F.linear(x, self.in_proj_weight, self.in_proj_bias).chunk(3, dim=-1)
    q = q.contiguous().view(L, N * self.num_heads, -1).transpose(0, 1)
    k = k.contiguous().view(L, N * self.num_heads, -1).transpose(0, 1)
    v = v.contiguous().view(L, N * self.num_heads, -1).transpose(0, 1)
    head_dim = q.shape[-1]
    scale = float(head_dim) ** -0.5
    q = q * scale
    attn = torch.bmm(q, k.transpose(-1, -2))
    attn = attn.softmax(dim=-1)
    self.attention_maps = attn  # Hook for attention maps
    x = torch.bmm(attn, v)
    x = x.transpose(0, 1).reshape(L, N, C)
    x = self.out_proj(x)
    return x


def hooked_resblock_forward(self, q_x):
    x = q_x + self.ls_1(hooked_attention_forward(self.attn, self.ln_1(q_x), None, None))
    self.feat_post_attn = x
    x = x + self.ls_2(self.mlp(self.ln_2(x)))
    self.feat_post_mlp = x
    return x


def hooked_resblock_timm_forward(self, x: torch.Tensor) -> torch.Tensor:
    x = x + self.drop_path1(self.ls1(self.attn(self.norm1(x))))
    self.feat_post_attn = x
    x = x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))
    self.feat_post_mlp = x
    return x


def hooked_attentional_pooler_timm_forward(self, x):
    B, N, C = x.shape
    if self.pos_embed is not None:
        x = x + self.pos_embed.unsqueeze(0).to(x.dtype)
    q_latent = self.latent.expand(B, -1, -1)
    q = self.q(q_latent).reshape(B, self.latent_len, self.num_heads, self.head_dim).transpose(1, 2)
    kv = self.kv(x).reshape(B, N, 2, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
    k, v = kv.unbind(0)
    q, k = self.q_norm(q), self.k_norm(k)
    q = q * self.scale
    attn = q @ k.transpose(-2, -1)
    attn = attn.softmax(dim=-1)
    x = attn @ v
    self.attn_probs = attn  # Hook to save attention map for explainability
    x = x.transpose(1, 2).reshape(B, self.latent_len, C)
    x = self.proj(x)
    x = self.proj_drop(x)
    x = x + self.mlp(self.norm(x))
    if self.pool == 'token':
        x = x[:, 0]
    elif self.pool == 'avg':
        x = x.mean(1)
    return x


def min_max(logits):
    B, num_prompt = logits.shape[:2]
    logits_min = logits.reshape(B, num_prompt, -1).min(dim=-1, keepdim=True)[0].unsqueeze(-1)
    logits_max = logits.reshape(B, num_prompt, -1).max(dim=-1, keepdim=True)[0].unsqueeze(-1)
    logits = (logits - logits_min) / (logits_max - logits_min)
    return logits


def compute_legrad_clip(visual, starting_depth, patch_size, text_embedding, image):
    num_prompts = text_embedding.shape[0]
    image = image.repeat(num_prompts, 1, 1, 1)
    # open_clip's stem (their vit_dynamic_size_forward at the trained size), then the blocks in
    # their layout (tokens, batch, width): open_clip's own before starting_depth, theirs after.
    x = visual.conv1(image).flatten(2).transpose(1, 2)
    x = torch.cat([visual.class_embedding.expand(x.shape[0], 1, -1), x], dim=1) + visual.positional_embedding
    x = visual.ln_pre(x)
    for block in visual.transformer.resblocks[:starting_depth]:
        x = block(x)
    x = x.permute(1, 0, 2)
    for block in visual.transformer.resblocks[starting_depth:]:
        x = hooked_resblock_forward(block, x)

    blocks_list = list(dict(visual.transformer.resblocks.named_children()).values())
    image_features_list = []
    for layer in range(starting_depth, len(visual.transformer.resblocks)):
        intermediate_feat = visual.transformer.resblocks[layer].feat_post_mlp  # [num_patch, batch, dim]
        intermediate_feat = visual.ln_post(intermediate_feat.mean(dim=0)) @ visual.proj
        intermediate_feat = F.normalize(intermediate_feat, dim=-1)
        image_features_list.append(intermediate_feat)
    num_tokens = blocks_list[-1].feat_post_mlp.shape[0] - 1
    w = h = int(math.sqrt(num_tokens))
    accum_expl_map = 0
    for layer, (blk, img_feat) in enumerate(zip(blocks_list[starting_depth:], image_features_list)):
        visual.zero_grad()
        sim = text_embedding @ img_feat.transpose(-1, -2)  # [1, 1]
        one_hot = F.one_hot(torch.arange(0, num_prompts)).float().requires_grad_(True).to(text_embedding.device)
        one_hot = torch.sum(one_hot * sim)
        attn_map = blocks_list[starting_depth + layer].attn.attention_maps  # [b, num_heads, N, N]
        grad = torch.autograd.grad(one_hot, [attn_map], retain_graph=True, create_graph=True)[0]
        grad = rearrange(grad, '(b h) n m -> b h n m', b=num_prompts)  # separate batch and attn heads
        grad = torch.clamp(grad, min=0.)
        image_relevance = grad.mean(dim=1).mean(dim=1)[:, 1:]  # average attn over [CLS] + patch tokens
        expl_map = rearrange(image_relevance, 'b (w h) -> 1 b w h', w=w, h=h)
        expl_map = F.interpolate(expl_map, scale_factor=patch_size, mode='bilinear')  # [B, 1, H, W]
        accum_expl_map += expl_map
    accum_expl_map = min_max(accum_expl_map)
    return accum_expl_map


def compute_legrad_siglip(trunk, starting_depth, patch_size, text_embedding, empty_embedding, image,
                          apply_correction=True, correction_threshold=0.8):
    blocks_list = list(dict(trunk.blocks.named_children()).values())
    for block in blocks_list[starting_depth:]:
        block.forward = types.MethodType(hooked_resblock_timm_forward, block)
    trunk.attn_pool.forward = types.MethodType(hooked_attentional_pooler_timm_forward, trunk.attn_pool)
    _ = trunk(image)
    image_features_list = []
    for blk in blocks_list[starting_depth:]:
        intermediate_feat = blk.feat_post_mlp
        image_features_list.append(intermediate_feat)
    num_tokens = blocks_list[-1].feat_post_mlp.shape[1]
    w = h = int(math.sqrt(num_tokens))
    if apply_correction:
        accum_expl_map_empty = 0
    accum_expl_map = 0
    for layer, (blk, img_feat) in enumerate(zip(blocks_list[starting_depth:], image_features_list)):
        trunk.zero_grad()
        pooled_feat = trunk.attn_pool(img_feat)
        pooled_feat = F.normalize(pooled_feat, dim=-1)
        sim = text_embedding @ pooled_feat.transpose(-1, -2)  # [num_mask, num_mask]
        one_hot = torch.sum(sim)
        grad = torch.autograd.grad(one_hot, [trunk.attn_pool.attn_probs], retain_graph=True, create_graph=True)[0]
        grad = torch.clamp(grad, min=0.)
        image_relevance = grad.mean(dim=1)[:, 0]  # average attn over [CLS] + patch tokens
        expl_map = rearrange(image_relevance, 'b (w h) -> b 1 w h', w=w, h=h)
        accum_expl_map += expl_map
        if apply_correction:
            sim_empty = pooled_feat @ empty_embedding
            one_hot_empty = torch.sum(sim_empty)
            grad_empty = torch.autograd.grad(one_hot_empty, [trunk.attn_pool.attn_probs], retain_graph=True, create_graph=True)[0]
            grad_empty = torch.clamp(grad_empty, min=0.)
            image_relevance_empty = grad_empty.mean(dim=1)[:, 0]  # average attn over heads + select query's row
            expl_map_empty = rearrange(image_relevance_empty, 'b (w h) -> b 1 w h', w=w, h=h)
            accum_expl_map_empty += expl_map_empty
    if apply_correction:
        heatmap_empty = min_max(accum_expl_map_empty)
        accum_expl_map[heatmap_empty > correction_threshold] = 0
    Res = min_max(accum_expl_map)
    Res = F.interpolate(Res, scale_factor=patch_size, mode='bilinear')  # [B, 1, H, W]
    return Res
# --- end of the authors' code ---


def _as_theirs(ours: torch.Tensor, patch_size: int, siglip: bool = False) -> torch.Tensor:
    """Our (B, gh, gw) sum over the layers, up-sampled and min-maxed as their maps are (SigLIP's
    in the other order)."""
    if siglip:
        return F.interpolate(min_max(ours[:, None]), scale_factor=patch_size, mode="bilinear")[:, 0]
    return min_max(F.interpolate(ours[:, None], scale_factor=patch_size, mode="bilinear"))[:, 0]


def test_clip_legrad_equals_the_authors(tmp_path):
    theirs = open_clip_folder(tmp_path, SMALL_CLIP)
    ours = load_image_text_model(tmp_path)
    image = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(4))
    texts = F.normalize(torch.randn(2, SMALL_CLIP["embed_dim"], generator=torch.Generator().manual_seed(5)), dim=-1)
    expected = compute_legrad_clip(theirs.visual, 0, 8, texts, image)[0].detach()  # (T, H, W)
    captured = vx.capture(ours.image, image)
    before = {name: (tensor.clone(), tensor.requires_grad) for name, tensor in ours.image.named_parameters()}
    for index, text in enumerate(texts):
        mapped = legrad(ours, captured, text)
        assert mapped.shape == (1, 4, 4)
        torch.testing.assert_close(_as_theirs(mapped, 8)[0], expected[index], atol=1e-4, rtol=0)
    for name, parameter in ours.image.named_parameters():  # the shared model as it was: no grads, no flags changed
        assert torch.equal(parameter, before[name][0]) and parameter.requires_grad == before[name][1] and parameter.grad is None


def test_siglip_legrad_with_its_correction_equals_the_authors(tmp_path):
    ours = load_image_text_model(siglip_folder(tmp_path))
    config = ours.image.config
    trunk = VisionTransformer(
        img_size=32, patch_size=8, embed_dim=config.embed_dim, depth=config.depth, num_heads=config.num_heads,
        num_classes=0, class_token=False, global_pool="map",
    ).eval()
    trunk.load_state_dict(ours.image.state_dict())
    image = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(6))
    # A text whose gradient is positive somewhere on both images (random weights make many
    # all-negative), and an empty prompt whose map the correction cuts on both.
    text, empty = (F.normalize(torch.randn(config.embed_dim, generator=torch.Generator().manual_seed(seed)), dim=0) for seed in (3, 1))
    expected = compute_legrad_siglip(trunk, 0, 8, text[None], empty[:, None], image)[:, 0].detach()
    uncorrected = compute_legrad_siglip(trunk, 0, 8, text[None], empty[:, None], image, apply_correction=False)[:, 0].detach()
    assert ((expected - uncorrected).abs().amax(dim=(1, 2)) > 0.01).all()
    mapped = legrad(ours, vx.capture(ours.image, image), text, empty=empty)
    assert mapped.shape == (2, 4, 4)
    torch.testing.assert_close(_as_theirs(mapped, 8, siglip=True), expected, atol=1e-4, rtol=0)


def test_legrad_finds_the_planted_object_and_refuses_a_mean_pool():
    model, image = planted_clip(), planted_image()
    mapped = legrad(model, vx.capture(model.image, image), planted_texts(model)[0])
    assert iou_of_top_half(mapped[0]) >= 0.9
    siglip = planted_siglip()
    obj, background = planted_texts(siglip)
    mapped = legrad(siglip, vx.capture(siglip.image, image), obj, empty=background)  # the correction cuts the background
    assert iou_of_top_half(mapped[0]) >= 0.9
    mean_pool = vx.ViT(vx.ViTConfig(
        image_size=16, patch_size=8, embed_dim=8, depth=1, num_heads=1, num_classes=0, class_token=False, global_pool="mean",
    )).eval()
    with pytest.raises(ValueError, match="this model averages its patches"):
        legrad(replace(model, image=mean_pool), vx.capture(mean_pool, image[:, :, :16, :16]), planted_texts(model)[0])
