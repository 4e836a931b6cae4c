"""Open-vocabulary maps: the training-free methods that read where each text is from a CLIP's
(or SigLIP's) image tower by changing its last block, for this call only.

:data:`METHODS` names each (its label, what it changes, its paper) and the function that computes
it; :func:`patch_embeddings` gives (B, gh * gw, E) unit patch embeddings in the texts' space,
whose cosines with text embeddings are the maps (text.maps.similarity_maps).

- ``maskclip`` (Zhou et al. 2022): the last block's value path (text.maps.patch_embeddings).
- ``sclip`` (Wang et al. 2024): correlative self-attention: softmax(q q^T) + softmax(k k^T)
  instead of softmax(q k^T), the block's residual and MLP kept.
- ``clearclip`` (Lan et al. 2024): q-q attention, the block's residual and MLP left out.
- ``naclip`` (Hajimiri et al. 2025): k-k attention plus a Gaussian kernel over the patch grid
  (std :data:`NACLIP_STD` patches; prefix tokens get none), residual and MLP left out.
- ``clip_surgery`` (Li et al. 2025, text.clip_surgery): v-v attention over the last 6 blocks, and
  the maps' feature surgery against the prompts together (its :attr:`Method.maps`).
- ``proxyclip`` (Lan et al. 2024, text.proxyclip): the last block attending with a proxy model's
  patch similarities (a DINO captured on the same pixels), the maps on the proxy's grid.

Each re-runs the last block (CLIP Surgery: its v-v path over the last six) from the captured
tokens entering it: no pass of the image tower, nothing of the shared model changed (its modules are called, never altered). The authors
change CLIP's last block and read every token through what reads the class token (ln_post, the
projection). The same change applies to any tower, since every tower's last block has the same
self-attention; what follows it is the tower's own reading of one token: the final norm and the
projection for a class-token tower, the final norm and fc_norm for a mean-pooled one (the mean
reads every patch alike), and for SigLIP's attention pool the pool's value path, output
projection and residual MLP (the pool read as if it attended to that token alone, as MaskCLIP
reads it). A rotary tower's queries and keys are rotated as its attention rotates them.
The authors' own pre- and post-processing (sliding windows, logit scale, PAMR) is not part of a
map; tests/text/test_open_vocabulary.py compares each with their code on the same weights.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from einops import rearrange

from ..model.capture import Capture
from . import clip_surgery, maps, proxyclip
from .towers import ImageTextModel

# NACLIP's Gaussian neighbourhood, in patches: the authors' default (naclip.py, gaussian_std=5).
NACLIP_STD = 5.0


class OpenVocabularyError(ValueError):
    """A map method that cannot be computed as asked; the message is one sentence."""


@dataclass(frozen=True)
class Method:
    """One way of reading the patches into the texts' space. ``function(model, captured, proxy)``
    -> (B, gh * gw, E) unit embeddings; ``from_tokens(model, tokens, num_prefix_tokens,
    grid_size)`` the same from the (B, 2, N, D) tokens entering and leaving the last block alone
    (several images read together), None for a method that needs more than those."""

    label: str  # its name in titles and captions
    short: str  # what it changes, in a title's few words
    description: str  # what it changes, and whose it is, in a caption's sentence
    function: Callable[..., torch.Tensor]
    from_tokens: Callable[..., torch.Tensor] | None = None
    reads_out: bool = False  # the tokens it gives are read as the tower reads one token (_read_out)
    # ``maps(model, captured, texts, proxy)`` -> (B, T, gh, gw): a method whose maps are not the
    # patches' cosines with each text alone (CLIP Surgery's depend on every prompt); None: cosines.
    maps: Callable[..., torch.Tensor] | None = None
    needs_proxy: bool = False  # it borrows another model's attention (ProxyCLIP)


@torch.no_grad()
def last_block_embeddings(
    model: ImageTextModel, tokens: torch.Tensor, num_prefix_tokens: int, grid_size: tuple[int, int], method: str,
) -> torch.Tensor:
    """:func:`patch_embeddings` of ``method`` from the (B, 2, N, D) tokens entering and leaving the
    last block (a capture's last two, or several images' read together)."""
    entry = method_entry(method)
    if entry.from_tokens is None:
        raise OpenVocabularyError(f"{entry.label} needs each picture itself, not only the tokens the set has read")
    return entry.from_tokens(model, tokens, num_prefix_tokens, grid_size)


def patch_embeddings(model: ImageTextModel, captured: Capture, method: str = "maskclip", proxy=None) -> torch.Tensor:
    """(B, gh * gw, E) unit embeddings of the captured patches in the texts' space, as ``method``
    (a key of :data:`METHODS`) reads them; ``proxy``: the model whose attention a method borrows
    (ProxyCLIP's), read by those methods only."""
    return method_entry(method).function(model, captured, proxy)


def similarity_maps(
    model: ImageTextModel, captured: Capture, texts: torch.Tensor, method: str = "maskclip", proxy=None,
) -> torch.Tensor:
    """(B, T, gh, gw) each of the (T, E) unit ``texts``' map over the captured patches as ``method``
    makes it (on the proxy's grid for ProxyCLIP); a method that cannot be computed here is an
    OpenVocabularyError sentence."""
    entry = method_entry(method)
    try:
        if entry.maps is not None:
            return entry.maps(model, captured, texts, proxy)
        return maps.similarity_maps(entry.function(model, captured, proxy), texts, captured.grid_size)
    except OpenVocabularyError:
        raise
    except ValueError as error:  # the CLIP Surgery and ProxyCLIP modules' refusals
        raise OpenVocabularyError(str(error)) from None


def method_entry(method: str) -> Method:
    """The entry of ``method``, or one sentence naming the methods there are."""
    entry = METHODS.get(method)
    if entry is None:
        raise OpenVocabularyError(f"{str(method)[:40]!r} is not a map method; choose one of {', '.join(METHODS)}")
    return entry


def how(model: ImageTextModel, method: str, detail: bool = False) -> str:
    """How ``method`` carries the patches into the texts' space, in a few words (a title's), or
    with ``detail`` step by step (a caption's)."""
    entry = method_entry(method)
    if method == "maskclip":
        if detail:
            return (f"every patch goes along {maps.dense_path(model, detail=True)}: the path the model's pooling would"
                    " take if it read that patch alone (MaskCLIP, Zhou et al., ECCV 2022)")
        path = maps.dense_path(model)
        return path if "MaskCLIP" in path else f"MaskCLIP: {path}"
    if not detail:
        return f"{entry.label}: {entry.short}"
    if not entry.reads_out:
        return f"{entry.label}: {entry.description}"
    return (f"the last block is run again from the captured tokens as {entry.label} changes it ({entry.description}),"
            f" and every patch it gives goes through {_reading(model)}, as the pooling reads one token")


def _reading(model: ImageTextModel) -> str:
    """What :func:`_read_out` does for this tower, in words."""
    vit = model.image
    if vit.attn_pool is not None:
        return "the final norm, the attention pool's value and output projections and its MLP"
    if vit.config.global_pool == "cls":
        return "the final norm and the projection"
    return "the norm after the mean pool and the projection"


def _maskclip_tokens(model, tokens, num_prefix_tokens, grid_size):
    return maps.last_block_embeddings(model, tokens, num_prefix_tokens)


def _attention(model: ImageTextModel, entering: torch.Tensor, grid_size: tuple[int, int], weights) -> torch.Tensor:
    """The last block's attention branch on ``entering`` (B, N, D) with its softmax(q k^T) replaced
    by ``weights(q, k, scale)`` -> (B, heads, N, N): the branch's (B, N, D) output, before the residual."""
    vit = model.image
    attn = vit.blocks[-1].attn
    q, k, v = attn._qkv(vit.blocks[-1].norm1(entering)).unbind(0)  # (B, nh, N, hd) each
    rope = vit.rope_tables(grid_size)
    q, k = attn.rotate(q, rope), attn.rotate(k, rope)
    # A head at a time: one (B, 1, N, N) weight matrix held (two for SCLIP), not every head's.
    heads = torch.cat([
        weights(q[:, head:head + 1].float(), k[:, head:head + 1].float(), attn.scale).to(v.dtype) @ v[:, head:head + 1]
        for head in range(v.shape[1])
    ], dim=1)  # (B, nh, N, hd)
    return vit.blocks[-1].ls1(attn.proj(attn.norm(rearrange(heads, "b nh n hd -> b n (nh hd)"))))


def _read_out(model: ImageTextModel, tokens: torch.Tensor) -> torch.Tensor:
    """(B, P, D) patch tokens leaving the (changed) last block -> (B, P, E) unit embeddings: each
    read as the tower's pooling reads one token (see the module's docstring)."""
    vit = model.image
    normed = vit.norm(tokens)
    if vit.attn_pool is not None:
        pool = vit.attn_pool
        out = pool.proj(pool.kv(normed).chunk(2, dim=-1)[1])  # (B, P, D): each token's value, projected
        pooled = out + pool.mlp(pool.norm(out))
    else:
        pooled = vit.fc_norm(normed)
    return model.project_image(pooled).cpu()


def _changed_block(weights, keep_residual: bool):
    """A method that re-runs the last block with ``weights`` for its attention; ``keep_residual``:
    the block's residual and MLP kept (SCLIP), else its attention branch alone (ClearCLIP, NACLIP)."""

    @torch.no_grad()
    def from_tokens(model, tokens, num_prefix_tokens, grid_size, **options):
        device = next(model.image.parameters()).device
        block = model.image.blocks[-1]
        entering = tokens[:, -2].to(device)  # (B, N, D): the last block's input
        out = _attention(model, entering, grid_size, lambda q, k, scale: weights(q, k, scale, num_prefix_tokens, grid_size, **options))
        if keep_residual:
            middle = entering + out
            out = middle + block.ls2(block.mlp(block.norm2(middle)))
        return _read_out(model, out[:, num_prefix_tokens:])

    def function(model, captured, proxy=None, **options):
        return from_tokens(model, captured.tokens[:, -2:], captured.num_prefix_tokens, captured.grid_size, **options)

    return function, from_tokens


def _sclip_weights(q, k, scale, num_prefix_tokens, grid_size):
    return (q @ q.transpose(-2, -1) * scale).softmax(-1) + (k @ k.transpose(-2, -1) * scale).softmax(-1)


def _clearclip_weights(q, k, scale, num_prefix_tokens, grid_size):
    return (q @ q.transpose(-2, -1) * scale).softmax(-1)


def neighbourhood(grid_size: tuple[int, int], num_prefix_tokens: int, std: float = NACLIP_STD) -> torch.Tensor:
    """(N, N) NACLIP's addition to the attention logits: exp(-d^2 / 2 std^2) for patches d apart
    on the grid (their Gaussian window convolved over the grid is exactly this), 0 for prefix tokens."""
    rows, columns = torch.meshgrid(torch.arange(grid_size[0]), torch.arange(grid_size[1]), indexing="ij")
    places = torch.stack([rows.reshape(-1), columns.reshape(-1)], dim=-1).float()  # (P, 2)
    squared = ((places[:, None] - places[None]) ** 2).sum(-1)  # (P, P)
    return torch.nn.functional.pad(torch.exp(-squared / (2 * std**2)), (num_prefix_tokens, 0, num_prefix_tokens, 0))


def _naclip_weights(q, k, scale, num_prefix_tokens, grid_size, std: float = NACLIP_STD):
    omega = neighbourhood(grid_size, num_prefix_tokens, std).to(k.device)
    return (k @ k.transpose(-2, -1) * scale + omega).softmax(-1)


sclip, _sclip_tokens = _changed_block(_sclip_weights, keep_residual=True)
clearclip, _clearclip_tokens = _changed_block(_clearclip_weights, keep_residual=False)
naclip, _naclip_tokens = _changed_block(_naclip_weights, keep_residual=False)

def _surgery_maps(model, captured, texts, proxy=None):
    return clip_surgery.maps(model, captured, texts)


def _proxy_maps(model, captured, texts, proxy=None):
    return maps.similarity_maps(proxyclip.patch_embeddings(model, captured, proxy), texts, proxy.grid_size)


# name -> Method
METHODS: dict[str, Method] = {
    "maskclip": Method(
        "MaskCLIP", "the last block's value path",
        "the last block's value path, without its attention, residual and MLP (Zhou et al., ECCV 2022)",
        lambda model, captured, proxy=None: maps.patch_embeddings(model, captured), _maskclip_tokens,
    ),
    "sclip": Method(
        "SCLIP", "correlative self-attention",
        "the last block with correlative self-attention, softmax(q q^T) + softmax(k k^T) (Wang et al., ECCV 2024)",
        sclip, _sclip_tokens, reads_out=True,
    ),
    "clearclip": Method(
        "ClearCLIP", "q-q attention, no residual",
        "the last block's q-q attention alone, without its residual and MLP (Lan et al., ECCV 2024)",
        clearclip, _clearclip_tokens, reads_out=True,
    ),
    "naclip": Method(
        "NACLIP", "k-k attention in a neighbourhood",
        f"the last block's k-k attention plus a Gaussian neighbourhood (std {NACLIP_STD:g} patches), without its"
        " residual and MLP (Hajimiri et al., WACV 2025)",
        naclip, _naclip_tokens, reads_out=True,
    ),
    "clip_surgery": Method(
        "CLIP Surgery", "v-v attention, the prompts' shared feature removed",
        f"v-v attention over the last {clip_surgery.SURGERY_BLOCKS} blocks, then what the prompts share subtracted from"
        " each (feature surgery; CLIP's class-token towers) (Li et al., Pattern Recognition 2025)",
        lambda model, captured, proxy=None: clip_surgery.patch_embeddings(model, captured), maps=_surgery_maps,
    ),
    "proxyclip": Method(
        "ProxyCLIP", "a proxy's attention in the last block",
        "the last block attending with a proxy model's (a DINO's) patch similarities instead of its own, on the"
        " proxy's grid (CLIP's class-token towers) (Lan et al., ECCV 2024)",
        lambda model, captured, proxy=None: proxyclip.patch_embeddings(model, captured, proxy), maps=_proxy_maps,
        needs_proxy=True,
    ),
}
