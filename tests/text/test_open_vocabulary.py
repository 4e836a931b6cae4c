"""The open-vocabulary maps (text/open_vocabulary.py) against their authors' code on the same
random weights, a model whose answer is known (one text's score depends on a planted region
only: every method's map finds it), and what a call may not do (run the image tower, change the
shared model, take a method there is not).

The authors' last-block code is copied below as they wrote it (only ``self`` and imports
adapted); their CLIP is OpenAI's, whose layout open_clip's CLIP keeps (ln_1, attn.in_proj_weight,
attn.out_proj, mlp, ln_2, ln_post, proj), so it runs on the open_clip model whose weights our
loader reads.
"""
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import vit_explorer as vx
from vit_explorer.text import load_image_text_model
from vit_explorer.text import open_vocabulary
from vit_explorer.text.open_vocabulary import METHODS, OpenVocabularyError, patch_embeddings

# The methods that change the last block alone (CLIP Surgery and ProxyCLIP: tests/text/test_clip_surgery.py,
# test_proxyclip.py)
LAST_BLOCK = [method for method, entry in METHODS.items() if entry.from_tokens is not None]
from vit_explorer.text.towers import ImageTextModel

from helpers import counting_blocks
from helpers import randomize as helpers_randomize
from rotary import ROTARY, TINY, rotary_model
from textmodels import SMALL_CLIP, open_clip_folder


# --- wangf3014/SCLIP @ b56bd30, clip/model.py, VisionTransformer (custom_attn verbatim) ---------
class SCLIP:
    def custom_attn(self, attn_layer, x, return_attn=False, with_attn=False, csa=False):

        num_heads = attn_layer.num_heads
        _, bsz, embed_dim = x.size()
        head_dim = embed_dim // num_heads
        scale = head_dim ** -0.5

        q, k, v = F.linear(x, attn_layer.in_proj_weight, attn_layer.in_proj_bias).chunk(3, dim=-1)
        q = q.contiguous().view(-1, bsz * num_heads, head_dim).transpose(0, 1)
        k = k.contiguous().view(-1, bsz * num_heads, head_dim).transpose(0, 1)
        v = v.contiguous().view(-1, bsz * num_heads, head_dim).transpose(0, 1)

        if csa:
            q_attn = torch.bmm(q, q.transpose(1, 2)) * scale
            k_attn = torch.bmm(k, k.transpose(1, 2)) * scale
            attn_weights = F.softmax(q_attn, dim=-1) + F.softmax(k_attn, dim=-1)
        else:
            attn_weights = torch.bmm(q * scale, k.transpose(1, 2))
            attn_weights = F.softmax(attn_weights, dim=-1)

        if return_attn:
            return attn_weights

        attn_output = torch.bmm(attn_weights, v)
        attn_output = attn_output.transpose(0, 1).contiguous().view(-1, bsz, embed_dim)
        attn_output = attn_layer.out_proj(attn_output)

        if with_attn:
            return attn_output, attn_weights

        return attn_output

    def last_block(self, blk, x):  # VisionTransformer.forward, its last block (csa=True, as encode_image(csa=True))
        x = x + self.custom_attn(blk.attn, blk.ln_1(x), csa=True)
        x = x + blk.mlp(blk.ln_2(x))
        return x


# --- mc-lan/ClearCLIP @ ad68a40, open_clip/transformer.py, VisionTransformer (custom_attn verbatim) ---
class ClearCLIP:
    def custom_attn(self, attn_layer, x, model_type='ClearCLIP'):

        num_heads = attn_layer.num_heads
        _, bsz, embed_dim = x.size()
        head_dim = embed_dim // num_heads
        scale = head_dim ** -0.5

        q, k, v = F.linear(x, attn_layer.in_proj_weight, attn_layer.in_proj_bias).chunk(3, dim=-1)
        q = q.contiguous().view(-1, bsz * num_heads, head_dim).transpose(0, 1)
        k = k.contiguous().view(-1, bsz * num_heads, head_dim).transpose(0, 1)
        v = v.contiguous().view(-1, bsz * num_heads, head_dim).transpose(0, 1)

        if model_type == 'vanilla':
            qk_attn = torch.bmm(q, k.transpose(1, 2)) * scale
            attn_weights = F.softmax(qk_attn, dim=-1)
        elif model_type == 'MaskCLIP':
            mask = torch.empty(q.shape[1], q.shape[1], dtype=q.dtype).to(q.device)
            mask.fill_(float('-inf'))
            mask.fill_diagonal_(0)
            mask = mask.unsqueeze(0).repeat(q.shape[0], 1, 1)
            attn_weights = F.softmax(mask, dim=-1)
        elif model_type == 'SCLIP':
            qq_attn = torch.bmm(q, q.transpose(1, 2)) * scale
            kk_attn = torch.bmm(k, k.transpose(1, 2)) * scale
            attn_weights = F.softmax(qq_attn, dim=-1) + F.softmax(kk_attn, dim=-1)
        elif model_type == 'ClearCLIP':
            qq_attn = torch.bmm(q, q.transpose(1, 2)) * scale
            attn_weights = F.softmax(qq_attn, dim=-1)

        attn_output = torch.bmm(attn_weights, v)
        attn_output = attn_output.transpose(0, 1).contiguous().view(-1, bsz, embed_dim)
        attn_output = attn_layer.out_proj(attn_output)

        return attn_output

    def last_block(self, blk, x, model_type='ClearCLIP'):  # forward, last_n_layers=1, ignore_residual=True
        output = 0
        output += self.custom_attn(blk.attn, blk.ln_1(x), model_type=model_type)
        return output


# --- sinahmr/NACLIP @ 0cac3a6 (MIT licence), clip/model.py, VisionTransformer (verbatim) --------
class NACLIP:
    def __init__(self, gaussian_std):  # set_params('reduced', 'naclip', gaussian_std)
        self.arch, self.attn_strategy, self.gaussian_std = 'reduced', 'naclip', gaussian_std
        self.addition_cache = dict()

    @staticmethod
    def gaussian_window(dim1, dim2, std=1.):
        constant = 1 / (std * math.sqrt(2))
        ks = list()
        for dim in [dim1, dim2]:
            start = -(dim - 1) / 2.0
            k = torch.linspace(start=start * constant,
                               end=(start + (dim - 1)) * constant,
                               steps=dim,
                               dtype=torch.float)
            ks.append(k)
        dist_square_to_mu = (torch.stack(torch.meshgrid(*ks, indexing='ij')) ** 2).sum(0)
        return torch.exp(-dist_square_to_mu)

    @staticmethod
    def get_attention_addition(dim1, dim2, window, adjust_for_cls=True):
        m = torch.einsum('ij,kl->ijkl', torch.eye(dim1), torch.eye(dim2))
        m = m.permute((0, 3, 1, 2)).contiguous()  # m[ijkl] = 1 iff (i, j) == (k, l)
        out = F.conv2d(m.view(-1, dim1, dim2).unsqueeze(1), window.unsqueeze(0).unsqueeze(1), padding='same').squeeze(1)
        out = out.view(dim1 * dim2, dim1 * dim2)
        if adjust_for_cls:
            v_adjusted = torch.vstack([torch.zeros((1, dim1 * dim2)), out])
            out = torch.hstack([torch.zeros((dim1 * dim2 + 1, 1)), v_adjusted])
        return out

    def custom_attn(self, attn_layer, x, n_patches, return_attn=False, with_attn=False):
        num_heads = attn_layer.num_heads
        num_tokens, bsz, embed_dim = x.size()
        head_dim = embed_dim // num_heads
        scale = head_dim ** -0.5

        q, k, v = F.linear(x, attn_layer.in_proj_weight, attn_layer.in_proj_bias).chunk(3, dim=-1)
        q = q.contiguous().view(-1, bsz * num_heads, head_dim).transpose(0, 1)
        k = k.contiguous().view(-1, bsz * num_heads, head_dim).transpose(0, 1)
        v = v.contiguous().view(-1, bsz * num_heads, head_dim).transpose(0, 1)

        if self.attn_strategy in ['naclip', 'nonly']:
            addition = self.addition_cache.get(n_patches)
            if addition is None:
                window_size = [side * 2 - 1 for side in n_patches]
                window = NACLIP.gaussian_window(*window_size, std=self.gaussian_std)
                addition = NACLIP.get_attention_addition(*n_patches, window).unsqueeze(0).to(x.dtype).to(x.device)
                self.addition_cache[n_patches] = addition

            if self.attn_strategy == 'naclip':
                attn_weights = torch.bmm(k, k.transpose(1, 2)) * scale
                omega = addition
            elif self.attn_strategy == 'nonly':
                attn_weights = torch.zeros((num_heads, num_tokens, num_tokens)).to(x.dtype).to(x.device)
                omega = addition * (scale * torch.einsum('hop,hPO->hpP', q.norm(dim=2).unsqueeze(1), k.norm(dim=2).unsqueeze(2)).mean().item())
            else:
                raise NotImplemented

            attn_weights += omega
            attn_weights = F.softmax(attn_weights, dim=-1)

        elif self.attn_strategy == 'csa':
            q_attn = torch.bmm(q, q.transpose(1, 2)) * scale
            k_attn = torch.bmm(k, k.transpose(1, 2)) * scale
            attn_weights = F.softmax(q_attn, dim=-1) + F.softmax(k_attn, dim=-1)
        elif self.attn_strategy == 'vanilla':
            attn_weights = torch.bmm(q * scale, k.transpose(1, 2))
            attn_weights = F.softmax(attn_weights, dim=-1)
        elif self.attn_strategy == 'kk':
            attn_weights = torch.bmm(k * scale, k.transpose(1, 2))
            attn_weights = F.softmax(attn_weights, dim=-1)
        else:
            raise NotImplemented(f'attn_strategy {self.attn_strategy} is not implemented')

        if return_attn:
            return attn_weights

        attn_output = torch.bmm(attn_weights, v)
        attn_output = attn_output.transpose(0, 1).contiguous().view(-1, bsz, embed_dim)
        attn_output = attn_layer.out_proj(attn_output)

        if with_attn:
            return attn_output, attn_weights

        return attn_output

    def last_block(self, blk, x, n_patches):  # forward, arch == 'reduced'
        x = self.custom_attn(blk.attn, blk.ln_1(x), n_patches)
        return x
# --- end of the authors' code -------------------------------------------------------------------

IMAGE, PATCH = 48, 8  # a 6 x 6 grid: NACLIP's neighbourhood has room to matter


def _authors(visual: nn.Module, x: torch.Tensor, method: str, std: float = open_vocabulary.NACLIP_STD) -> torch.Tensor:
    """(B, gh * gw, E) the authors' dense features, unit length (as their segmentors normalise
    them), from open_clip's own pass up to the last block (their encode_image(return_all=True))."""
    grid = (x.shape[-2] // PATCH, x.shape[-1] // PATCH)
    tokens = visual._embeds(x)  # conv1, class embedding, positions, ln_pre: (B, N, D)
    blocks = visual.transformer.resblocks
    batch_first = getattr(visual.transformer, "batch_first", True)
    tokens = tokens if batch_first else tokens.transpose(0, 1)
    for blk in blocks[:-1]:
        tokens = blk(tokens)
    lnd = tokens.transpose(0, 1) if batch_first else tokens  # NLD -> LND, their layout
    if method == "sclip":
        out = SCLIP().last_block(blocks[-1], lnd)
    elif method == "clearclip":
        out = ClearCLIP().last_block(blocks[-1], lnd)
    else:
        out = NACLIP(std).last_block(blocks[-1], lnd, grid)
    out = out.permute(1, 0, 2)  # LND -> NLD
    features = visual.ln_post(out) @ visual.proj  # their return_all=True
    return F.normalize(features[:, 1:], dim=-1)


@pytest.fixture(scope="module")
def clip_pair(tmp_path_factory):
    """An OpenAI-layout CLIP (open_clip's) with random weights, its last block's queries and keys
    made sharp enough that q-k, q-q and k-k attention differ; and our model read from its folder."""
    folder = tmp_path_factory.mktemp("clip")
    config = SMALL_CLIP | {"vision_cfg": SMALL_CLIP["vision_cfg"] | {"image_size": IMAGE, "patch_size": PATCH}}
    reference = open_clip_folder(folder, config)
    with torch.no_grad():
        reference.visual.transformer.resblocks[-1].attn.in_proj_weight[:128].mul_(8)  # q and k of width 64
    from safetensors.torch import save_file
    save_file({key: value.contiguous() for key, value in reference.state_dict().items()}, str(folder / "open_clip_model.safetensors"))
    return reference.visual.eval(), load_image_text_model(folder)


@pytest.mark.parametrize("method, std", [("sclip", None), ("clearclip", None), ("naclip", 5.0), ("naclip", 1.0)])
def test_each_map_equals_its_authors_code_on_the_same_weights(clip_pair, method, std):
    visual, model = clip_pair
    x = torch.randn(2, 3, IMAGE, IMAGE, generator=torch.Generator().manual_seed(1))
    captured = vx.capture(model.image, x, layers=())
    with torch.no_grad():
        expected = _authors(visual, x, method, std or open_vocabulary.NACLIP_STD)
    options = {} if std is None else {"std": std}
    ours = METHODS[method].function(model, captured, **options) if options else patch_embeddings(model, captured, method)
    assert ours.shape == (2, (IMAGE // PATCH) ** 2, model.embed_dim)
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=0)
    # The test can fail: each method's map differs from MaskCLIP's and from the others' on these weights.
    assert (ours - patch_embeddings(model, captured, "maskclip")).abs().max() > 1e-2
    if method == "naclip":
        assert (ours - _authors(visual, x, "naclip", 50.0 if std == 1.0 else 1.0)).abs().max() > 1e-3


def test_a_map_runs_only_the_last_block_from_the_capture_and_changes_nothing(clip_pair, monkeypatch):
    _, model = clip_pair
    x = torch.randn(1, 3, IMAGE, IMAGE, generator=torch.Generator().manual_seed(2))
    captured = vx.capture(model.image, x, layers=())
    before = {name: value.clone() for name, value in model.image.state_dict().items()}
    ran = counting_blocks(monkeypatch, model.image)
    forwards = []
    handle = model.image.register_forward_hook(lambda *_: forwards.append(1))
    try:
        first = {method: patch_embeddings(model, captured, method) for method in LAST_BLOCK}
    finally:
        handle.remove()
    assert ran == [] and forwards == []  # no block's forward, no pass of the tower: the last block's arithmetic only
    assert all(torch.equal(value, before[name]) for name, value in model.image.state_dict().items())
    assert not model.image.training
    for method, embedded in first.items():  # and a second call, after the others, gives the same
        torch.testing.assert_close(patch_embeddings(model, captured, method), embedded, atol=0, rtol=0)
        torch.testing.assert_close(embedded.norm(dim=-1), torch.ones(embedded.shape[:2]), atol=1e-5, rtol=0)


def test_several_images_tokens_give_each_image_its_capture_map(clip_pair):
    _, model = clip_pair
    x = torch.randn(2, 3, IMAGE, IMAGE, generator=torch.Generator().manual_seed(4))
    captured = vx.capture(model.image, x, layers=())
    for method in LAST_BLOCK:
        single = patch_embeddings(model, vx.capture(model.image, x[1:], layers=()), method)
        together = open_vocabulary.last_block_embeddings(model, captured.tokens[:, -2:], captured.num_prefix_tokens, captured.grid_size, method)
        torch.testing.assert_close(together[1:], single, atol=1e-5, rtol=0)


def test_a_method_there_is_not_is_refused_in_a_sentence(clip_pair):
    _, model = clip_pair
    captured = vx.capture(model.image, torch.zeros(1, 3, IMAGE, IMAGE), layers=())
    with pytest.raises(OpenVocabularyError, match=r"^'gradcam' is not a map method; choose one of maskclip, sclip, clearclip, naclip, clip_surgery, proxyclip$"):
        patch_embeddings(model, captured, "gradcam")


# A model whose answer is known: 8 x 8 patches of 4 pixels, each 'object' (channel 0 lit) or
# 'background' (channel 1 lit); the planted object is a 3 x 4 rectangle.
GRID, SIDE = 8, 4
PLANTED = {(row, column) for row in range(2, 5) for column in range(3, 7)}


def _planted_model(pool: str) -> ImageTextModel:
    """One layer, one head. Each patch embeds along its own axis (object: 0, background: 1); its
    query and key are that axis, large, so that a patch's attention, whichever pair of q and k
    scores it, stays within its own kind; the value is the token. The class token (a zero token,
    whose query is zero) or the attention pool's probe (a zero latent) or the mean reads every
    patch alike, so the image's score for 'object' rises with the object's share and nothing else."""
    extra = {"cls": {}, "map": dict(class_token=False, global_pool="map"), "mean": dict(class_token=False, global_pool="mean")}[pool]
    config = vx.ViTConfig(
        image_size=GRID * SIDE, patch_size=SIDE, embed_dim=8, depth=1, num_heads=1, num_classes=0,
        mean=(0.0,) * 3, std=(1.0,) * 3, **extra,
    )
    model = vx.ViT(config).eval()
    dim = config.embed_dim
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.zero_()
        model.patch_embed.proj.weight[0, 0] = 1 / SIDE**2  # axis 0: the object channel's mean
        model.patch_embed.proj.weight[1, 1] = 1 / SIDE**2  # axis 1: the background channel's mean
        block = model.blocks[0]
        block.norm1.weight.fill_(1)
        sharp = 20 * torch.eye(dim)
        block.attn.qkv.weight.copy_(torch.cat([sharp, sharp, torch.eye(dim)]))  # q = k = 20 x the normed token, v = it
        block.attn.proj.weight.copy_(torch.eye(dim))
        block.norm2.weight.fill_(1)
        for norm in (model.norm, model.fc_norm):
            if isinstance(norm, nn.LayerNorm):
                norm.weight.fill_(1)
        if model.attn_pool is not None:
            pool = model.attn_pool
            pool.kv.weight[dim:].copy_(torch.eye(dim))  # the pool's values: the tokens; its keys zero
            pool.proj.weight.copy_(torch.eye(dim))
            pool.norm.weight.fill_(1)
    return ImageTextModel(
        image=model, image_projection=torch.eye(dim), text=None, tokenizer=None,
        context_length=0, scoring="softmax", logit_scale=1.0, logit_bias=0.0,
    )


def _planted_image(cells) -> torch.Tensor:
    image = torch.zeros(1, 3, GRID * SIDE, GRID * SIDE)
    image[:, 1] = 1.0
    for row, column in cells:
        image[:, :, row * SIDE:(row + 1) * SIDE, column * SIDE:(column + 1) * SIDE] = 0
        image[:, 0, row * SIDE:(row + 1) * SIDE, column * SIDE:(column + 1) * SIDE] = 1.0
    return image


@pytest.mark.parametrize("pool", ["cls", "map", "mean"])
def test_every_method_finds_the_planted_region(pool):
    model = _planted_model(pool)
    image = _planted_image(PLANTED)
    everywhere = {(row, column) for row in range(GRID) for column in range(GRID)}
    obj = model.project_image(model.image(_planted_image(everywhere)))[0]  # the text 'object'
    with torch.no_grad():  # the image's score depends on the planted region alone: a smaller object scores lower
        score = lambda cells: float(model.project_image(model.image(_planted_image(cells)))[0] @ obj)
        assert score(PLANTED) > score(set(list(PLANTED)[:6])) > score(set())
    captured = vx.capture(model.image, image, layers=())
    for method in LAST_BLOCK:
        similarity = (patch_embeddings(model, captured, method)[0] @ obj).reshape(GRID, GRID)
        found = similarity > (similarity.max() + similarity.min()) / 2
        planted = torch.zeros(GRID, GRID, dtype=torch.bool)
        planted[tuple(zip(*PLANTED))] = True
        iou = (found & planted).sum() / (found | planted).sum()
        assert iou >= 0.9, f"{method} ({pool}): IoU {iou:.2f}"


def _vanilla_weights(q, k, scale, num_prefix_tokens, grid_size):
    return (q @ k.transpose(-2, -1) * scale).softmax(-1)


OTHER_TOWERS = {
    "registers, layer scale, non-square": dict(reg_tokens=2, init_values=0.1),
    "attention pool (SigLIP's)": dict(class_token=False, global_pool="map"),
}


@pytest.mark.parametrize("family", [*OTHER_TOWERS, *ROTARY])
def test_the_changed_block_with_the_models_own_attention_is_the_models_last_block(family):
    """The path every method shares (q, k, v from the captured tokens, rotated as the tower rotates
    them, the heads' projection, LayerScale, residual and MLP, the tower's reading of a token)
    with softmax(q k^T) put back gives what the tower's own last block gave: any tower, not only
    the authors' OpenAI layout. An attention pool reads each token as MaskCLIP reads it."""
    if family in ROTARY:
        vit = rotary_model(family)
    else:
        vit = helpers_randomize(vx.ViT(vx.ViTConfig(**TINY, **OTHER_TOWERS[family])))
    projection = torch.randn(16, vit.config.embed_dim, generator=torch.Generator().manual_seed(5))
    model = ImageTextModel(
        image=vit, image_projection=projection, text=None, tokenizer=None, context_length=0, scoring="softmax",
        logit_scale=1.0, logit_bias=0.0,
    )
    captured = vx.capture(vit, torch.randn(2, 3, *vit.config.img_size, generator=torch.Generator().manual_seed(6)), layers=())
    vanilla, _ = open_vocabulary._changed_block(_vanilla_weights, keep_residual=True)
    expected = open_vocabulary._read_out(model, captured.tokens[:, -1, captured.num_prefix_tokens:])
    torch.testing.assert_close(vanilla(model, captured), expected, atol=1e-5, rtol=0)
    if vit.config.global_pool != "cls":  # MaskCLIP reads a pool's (or the mean's) tokens leaving the last block alike
        torch.testing.assert_close(patch_embeddings(model, captured, "maskclip"), expected, atol=1e-5, rtol=0)
    for method in LAST_BLOCK:  # and each method's own attention changes it
        if method == "maskclip" and vit.config.global_pool != "cls":
            continue
        assert (patch_embeddings(model, captured, method) - expected).abs().max() > 1e-3, method
