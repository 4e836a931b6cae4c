"""The Vision Transformer (Dosovitskiy et al. 2020), with timm's parameter names.

Reading order: patch embedding -> attention -> MLP -> block -> model. Shapes use
B batch, N tokens, D embed dim, nh heads, hd head dim, gh x gw the patch grid.
"""
from __future__ import annotations

import functools
import math
from contextvars import ContextVar
from typing import Any

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from .config import ViTConfig
from .packing import Packing
from .rope import RopeSpec, apply_rope, rope_angles, rope_tables
from .windows import GridTables, window_ids, window_mask

# The recorder of the forward pass running in this context (thread), if one asked: see
# vit_explorer.model.recorder. Capture and attribution choose the explicit attention path and collect
# tensors through it per call, so a model shared by many threads is never switched or hooked.
ACTIVE_RECORDER: ContextVar[Any] = ContextVar("vit_explorer_recorder", default=None)
# The knock-out of the forward pass running in this context, if one asked (see
# vit_explorer.model.ablation): which heads and branches each image of the batch loses, chosen per call
# in the same way, so one session's knock-out never reaches another's pass.
ACTIVE_KNOCKOUT: ContextVar[Any] = ContextVar("vit_explorer_knockout", default=None)
# The test-time register of the forward pass running in this context, if one asked (see
# vit_explorer.analysis.test_time_registers): one more token after the prefix tokens, and some MLP units'
# activations moved into it, for that pass only.
ACTIVE_REGISTER: ContextVar[Any] = ContextVar("vit_explorer_register", default=None)
# The steering of the forward pass running in this context, if one asked (see
# vit_explorer.features.steering): the tokens leaving one block edited (some sparse-autoencoder
# latents scaled) before the next block reads them, for that pass only.
ACTIVE_STEERING: ContextVar[Any] = ContextVar("vit_explorer_steering", default=None)
# The activation patch of the forward pass running in this context, if one asked (see
# vit_explorer.model.patching): some tokens' or heads' activations at some sites replaced by another
# run's, or recorded with their gradients, for that pass only.
ACTIVE_PATCH: ContextVar[Any] = ContextVar("vit_explorer_patch", default=None)


def active(variable: ContextVar[Any]) -> Any:
    """What ``variable`` holds for the pass running in this context. A compiled model (training's
    torch.compile) sees nothing there: recorders, knock-outs and test-time registers ride eager
    passes only, and torch 2.11's dynamo cannot trace ContextVar.get (a graph break in every block
    made a compiled ViT-Ti train at 0.43x timm's speed on an H100)."""
    return None if torch.compiler.is_compiling() else variable.get()


# --- FlexiViT resizing (Beyer et al. 2023): one set of weights at any patch size -----------------


def resize_matrix(old_size: tuple[int, int], new_size: tuple[int, int]) -> torch.Tensor:
    """(old_h*old_w, new_h*new_w) float64: row i is the bilinear resize of the i-th one-hot old patch."""
    basis = torch.eye(old_size[0] * old_size[1], dtype=torch.float64)
    basis = rearrange(basis, "n (h w) -> n 1 h w", h=old_size[0])
    resized = F.interpolate(basis, size=new_size, mode="bilinear", align_corners=False, antialias=True)
    return rearrange(resized, "n 1 h w -> n (h w)")


@functools.lru_cache(maxsize=64)
def pi_resize_operator(
    old_patch: int, new_patch: int, device: torch.device = torch.device("cpu"), dtype: torch.dtype = torch.float64
) -> torch.Tensor:
    """(new*new, old*old): pinv(B^T), the map PI-resize applies to flattened kernels.

    A pure function of the sizes, so it is computed once per (sizes, device, dtype) and shared:
    callers must never modify it in place.
    """
    if dtype != torch.float64 or torch.device(device).type != "cpu":
        return pi_resize_operator(old_patch, new_patch).to(device, dtype)
    resize_t = resize_matrix((old_patch, old_patch), (new_patch, new_patch))
    if new_patch > old_patch:
        # Enlarging loses nothing (B has full column rank), so pinv(B^T) = B (B^T B)^-1: a solve
        # with the (old^2, old^2) Gram matrix instead of an SVD of (old^2, new^2) (16 to 224 px:
        # 0.1 s instead of 2.3, the first time a page asks for that patch size).
        return torch.linalg.solve(resize_t @ resize_t.T, resize_t).T
    return torch.linalg.pinv(resize_t)


def resample_patch_embed(weight: torch.Tensor, new_patch: int) -> torch.Tensor:
    """FlexiViT's PI-resize of a (D, C, p, p) patch-embedding kernel; differentiable.

    With B the bilinear resize x -> B x of a patch, the new kernel w' solves B^T w' = w in the
    least-squares sense (w' = pinv(B^T) w), so <B x, w'> = <x, w>: an upsampled patch gets the
    very embedding the original patch got. Exact when upsampling, best possible when shrinking.
    Computed in the kernel's dtype, so that it can run on every training step.
    """
    operator = pi_resize_operator(weight.shape[-1], new_patch, weight.device, weight.dtype)
    kernels = rearrange(weight, "d c ph pw -> (d c) (ph pw)")
    # Multiplied in this order the result is laid out as the kernel is: a transposed one (strided
    # over hundreds of MB at a large patch) made every pass with it several times slower.
    resampled = kernels @ operator.T  # (D*C, new*new)
    return rearrange(resampled, "(d c) (ph pw) -> d c ph pw", ph=new_patch, c=weight.shape[1])


def resample_pos_embed(
    pos_embed: torch.Tensor,
    old_grid: tuple[int, int],
    new_grid: tuple[int, int],
    num_prefix_tokens: int,
    mode: str = "bicubic",
    ar_preserving: bool = False,
) -> torch.Tensor:
    """Resample (1, prefix + gh*gw, D) position embeddings to a new grid; differentiable. ``mode``
    one of config.POS_EMBED_INTERPOLATIONS: "bicubic" (timm's, antialiased), "bilinear_corners"
    (Qwen3-VL's: bilinear, align_corners), "bilinear" (antialiased) or "bilinear_no_antialias"
    (timm NaFlexViT's). ``ar_preserving`` (NaFlexViT's "par"): resampled to a square of the new
    grid's longer side, of which the top-left gh x gw is kept, as timm's NaFlexEmbeds does.

    The prefix tokens' embeddings are kept as they are; an unchanged grid returns the input.
    """
    if tuple(old_grid) == tuple(new_grid):
        return pos_embed
    prefix, grid = pos_embed[:, :num_prefix_tokens], pos_embed[:, num_prefix_tokens:]
    grid = rearrange(grid.float(), "1 (gh gw) d -> 1 d gh gw", gh=old_grid[0])
    size = (max(new_grid),) * 2 if ar_preserving else tuple(new_grid)
    if mode == "bilinear_corners":
        grid = F.interpolate(grid, size=size, mode="bilinear", align_corners=True)
    else:
        grid = F.interpolate(
            grid, size=size, mode="bicubic" if mode == "bicubic" else "bilinear", align_corners=False,
            antialias=mode != "bilinear_no_antialias",
        )
    grid = grid[:, :, : new_grid[0], : new_grid[1]]
    grid = rearrange(grid, "1 d gh gw -> 1 (gh gw) d").to(pos_embed.dtype)
    return torch.cat([prefix, grid], dim=1)


def from_timm_eva(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state dict of timm's ``Eva`` (DINOv3, EVA-02) with this ViT's names, for a ViTConfig that
    mirrors the Eva's: LayerScale's ``gamma_1`` / ``gamma_2`` become ``ls1.gamma`` / ``ls2.gamma``,
    and a fused qkv's ``q_bias`` and ``v_bias`` one ``qkv.bias`` with the keys' zero bias between
    them (Eva keeps that one as a buffer it does not save). Every other name is already ours
    (``q_proj``/``k_proj``/``v_proj``, ``mlp.fc1_g``/``fc1_x``/``norm``, ``attn.norm``); timm's
    rotary buffers are not saved either, and would be dropped."""
    converted = {}
    for key, value in state.items():
        if key.startswith("rope.") or key.endswith(".k_bias"):
            continue
        if key.endswith(".attn.v_bias"):
            continue
        if key.endswith(".attn.q_bias"):
            v_bias = state[key.removesuffix("q_bias") + "v_bias"]
            key, value = key.removesuffix("q_bias") + "qkv.bias", torch.cat([value, torch.zeros_like(value), v_bias])
        elif key.endswith(".gamma_1") or key.endswith(".gamma_2"):
            key = f"{key[:-len('gamma_1')]}ls{key[-1]}.gamma"
        converted[key] = value
    return converted


# --- the model ----------------------------------------------------------------------------------


class PatchEmbed(nn.Module):
    """Cut the image into non-overlapping p x p patches and project each one to D dimensions.

    A Conv2d with kernel = stride = p is exactly the seeds' "flatten each patch, then nn.Linear":
    each output position sees one patch and nothing else, and the kernel is that linear map's
    weight reshaped to (D, C, p, p). The parameter is the conv's (timm's names and layout); the
    forward cuts and multiplies itself, because oneDNN's conv is 30x slower than that matmul for
    a large kernel (patch 224 of a ViT-B: 1.7 s against 0.06 s on a CPU core).
    ``patch_size`` runs this call at another patch size with the PI-resized kernel (FlexiViT),
    computed from the parameter on the fly, so gradients reach the kernel and nothing is changed.
    """

    def __init__(self, config: ViTConfig):
        super().__init__()
        self.img_size = config.img_size
        self.patch_size = config.patch_size
        self.proj = nn.Conv2d(
            config.in_chans, config.embed_dim, kernel_size=config.patch_size, stride=config.patch_size,
            bias=config.patch_bias,
        )
        self.norm = norm_layer(config, config.embed_dim) if config.patch_norm else nn.Identity()

    def forward(self, x: torch.Tensor, patch_size: int | None = None) -> torch.Tensor:
        height, width = self.img_size
        if tuple(x.shape[-2:]) != self.img_size:
            raise ValueError(
                f"input is {x.shape[-2]}x{x.shape[-1]} pixels but the model expects {height}x{width}"
            )
        weight = self.proj.weight
        if patch_size is None or patch_size == self.patch_size:
            patch_size = self.patch_size
        else:
            if patch_size < 1 or height % patch_size or width % patch_size:
                raise ValueError(f"patch size {patch_size} does not tile {height}x{width} images")
            weight = resample_patch_embed(weight, patch_size)
        patches = rearrange(x, "b c (gh ph) (gw pw) -> b (gh gw) (c ph pw)", ph=patch_size, pw=patch_size)
        return self.norm(F.linear(patches, weight.flatten(1), self.proj.bias))  # (B, gh*gw, D)


class Softmax(nn.Softmax):
    """``nn.Softmax`` that can write into a given tensor: a capture's recorder hands it the slot of
    its attention buffer, so the weights are stored without a second copy of them all."""

    def forward(self, input: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if out is None:
            return super().forward(input)
        return torch.softmax(input, self.dim, out=out)


def norm_layer(config: ViTConfig, dim: int) -> nn.Module:
    """The model's norm over ``dim`` numbers: timm's LayerNorm, or RMSNorm (Qwen-VL: no centring, no bias)."""
    if config.norm_layer == "rmsnorm":
        return nn.RMSNorm(dim, eps=config.layer_norm_eps)
    return nn.LayerNorm(dim, eps=config.layer_norm_eps)


class Attention(nn.Module):
    """Multi-head self-attention.

    Runs fused (``F.scaled_dot_product_attention``) unless ``fused_attn`` is off or the recorder
    of this call (:data:`ACTIVE_RECORDER`, set by :func:`vit_explorer.model.capture`) wants this
    layer: then the softmax is computed explicitly by ``self.attend``, its own module (so that a
    forward hook can observe it too), and the (B, nh, N, N) weights go to the recorder with their
    gradients; a recorder asking for this layer's internals also gets q, k, v, the scaled scores
    and the heads' outputs. The two paths agree to float rounding. A knock-out of this call
    (:data:`ACTIVE_KNOCKOUT`, vit_explorer.model.ablation) replaces some heads' outputs before ``proj``.

    A model with rotary positions (``config.rope_type``) rotates the patch tokens' queries and keys
    before either path (:func:`vit_explorer.model.rope.apply_rope`), with the sin/cos tables of this
    pass's grid given as ``rope``; the recorder then also gets them before the rotation. The
    patches are the last tokens, one per row of the tables; the tokens before them (the prefix
    tokens, and a test-time register when a pass has one) are not rotated.

    ``windowed`` (window attention, Qwen2.5-VL): each patch attends only within its window, the
    windows given with the tables (``rope.windows``, vit_explorer.model.windows); the weights
    outside it are exactly zero. The scores the recorder gets are the unmasked ones.
    """

    def __init__(self, config: ViTConfig, windowed: bool = False):
        super().__init__()
        dim = config.embed_dim
        self.num_heads = config.num_heads
        self.head_dim = config.head_dim
        self.scale = self.head_dim**-0.5
        self.fused_attn = True
        self.windowed = windowed
        spec = RopeSpec.of(config)
        self.rotary = spec is not None
        self.rotate_half = spec is not None and spec.rotate_half
        self.qkv_fused = config.qkv_fused
        if config.qkv_fused:
            self.qkv = nn.Linear(dim, dim * 3, bias=config.qkv_bias)
        else:  # EVA-02's separate projections; its keys never have a bias
            self.q_proj = nn.Linear(dim, dim, bias=config.qkv_bias)
            self.k_proj = nn.Linear(dim, dim, bias=False)
            self.v_proj = nn.Linear(dim, dim, bias=config.qkv_bias)
        self.attend = Softmax(dim=-1)
        self.attn_drop = nn.Dropout(config.attn_drop_rate)
        self.norm = nn.LayerNorm(dim, eps=config.layer_norm_eps) if config.scale_attn_inner else nn.Identity()
        self.proj = nn.Linear(dim, dim, bias=config.linear_bias)
        self.proj_drop = nn.Dropout(config.drop_rate)

    def _qkv(self, x: torch.Tensor) -> torch.Tensor:
        """(B, N, D) normed tokens -> (3, B, nh, N, hd): q, k, v before any rotation."""
        if self.qkv_fused:
            return rearrange(self.qkv(x), "b n (qkv nh hd) -> qkv b nh n hd", qkv=3, nh=self.num_heads)
        projections = torch.stack([self.q_proj(x), self.k_proj(x), self.v_proj(x)])  # (3, B, N, D)
        return rearrange(projections, "qkv b n (nh hd) -> qkv b nh n hd", nh=self.num_heads)

    def rotate(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """(B, nh, N, hd) queries or keys as the scores see them: the patch tokens rotated by their
        positions' angles (``rope``: this grid's sin/cos tables, ViT.rope_tables); unchanged
        without rotary positions."""
        if not self.rotary:
            return x
        if rope is None or rope[0] is None:
            raise ValueError(
                "this model rotates its patch tokens' queries and keys: pass rope=model.rope_tables(grid_size)"
            )
        return apply_rope(x, rope, self.rotate_half, x.shape[2] - rope[0].shape[-2])

    def keys(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """(B, N, D) normed tokens -> (B, nh, N, hd): this layer's keys as ``forward`` computes them
        (rotated, with rotary positions), without the attention itself."""
        return self.rotate(self._qkv(x)[1], rope)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None, packing: Packing | None = None
    ) -> torch.Tensor:
        q, k, v = self._qkv(x).unbind(0)  # (B, nh, N, hd) each
        unrotated = dict(q_unrotated=q, k_unrotated=k) if self.rotary else {}
        q, k = self.rotate(q, rope), self.rotate(k, rope)
        recorder = active(ACTIVE_RECORDER)
        dropout_p = self.attn_drop.p if self.training else 0.0
        mask = self.window_mask(rope, q.shape[2], packing)  # (N, N) bool or None
        if packing is not None:
            if recorder is not None:
                raise ValueError("a capture records whole sequences: run packed sequences without one")
            x = packing.attend(q, k, v, dropout_p)
        elif self.fused_attn and (recorder is None or not recorder.wants_attention(self)):
            x = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)
        else:
            # Scale before the softmax (scaling after it, as some tutorials do, is a bug).
            scaled = q * self.scale
            shape = (*q.shape[:-1], k.shape[2])  # (B, nh, N, N)
            out = None if recorder is None else recorder.attention_out(self, shape, scaled)
            if out is None:
                scores = scaled @ k.transpose(-2, -1)
                masked = scores if mask is None else scores.masked_fill(~mask, float("-inf"))
                attn = self.attend(masked)
            else:  # computed where the recorder wants them (no fresh (B, nh, N, N) temporary), softmax in place
                scores = torch.matmul(scaled, k.transpose(-2, -1), out=out)
                if mask is not None:
                    scores.masked_fill_(~mask, float("-inf"))
                attn = self.attend(scores, out=out)
            if recorder is not None:
                recorder.attention(self, attn)
            x = self.attn_drop(attn) @ v  # (B, nh, N, hd)
            if recorder is not None:
                window = {} if mask is None else {"window": mask}
                recorder.internals(self, q=q, k=k, v=v, scores=scores, attention=attn, heads=x, **unrotated, **window)
        knock_out = active(ACTIVE_KNOCKOUT)
        if knock_out is not None:
            x = knock_out.heads(self, x)  # the knocked-out heads' outputs, before the projection
        patch = active(ACTIVE_PATCH)
        if patch is not None:
            x = patch.edit(self, "head", x)  # some heads' outputs from another run, before the projection
        x = rearrange(x, "b nh n hd -> b n (nh hd)")
        return self.proj_drop(self.proj(self.norm(x)))

    def window_mask(self, rope, num_tokens: int, packing: Packing | None = None) -> torch.Tensor | None:
        """(N, N) bool: where each token may attend in this layer; None where everywhere."""
        if not self.windowed:
            return None
        windows = getattr(rope, "windows", None)
        if windows is None or packing is not None:
            raise ValueError(
                "this layer attends within windows of the patch grid: pass rope=model.rope_tables(grid_size)"
                " over whole grids (not some patches, nor packed sequences)"
            )
        return window_mask(windows, num_tokens)


class QuickGELU(nn.Module):
    """x * sigmoid(1.702 x): the sigmoid approximation of GELU that OpenAI's CLIP was trained with."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(1.702 * x)


def activation(name: str) -> nn.Module:
    """The MLP activation that ViTConfig.act_layer names (the exact GELU unless told otherwise)."""
    if name == "quick_gelu":
        return QuickGELU()
    return nn.GELU(approximate="tanh" if name == "gelu_tanh" else "none")


class Mlp(nn.Module):
    """fc1 -> activation -> fc2, timm's Mlp; or a SiLU-gated unit (SwiGLU, Shazeer 2020) with
    timm's parameters: packed (GluMlp: fc1 holds the gate, then the value) or split (SwiGLU:
    fc1_g, fc1_x) when the config asks for scale_mlp or an aligned width, as timm's Eva builds
    them. scale_mlp adds a LayerNorm on the hidden units before fc2 (EVA-02).

    A knock-out replaces, a test-time register moves, and a recorder asking for this layer's
    internals gets, the hidden units fc2 reads (:meth:`hidden`)."""

    def __init__(self, config: ViTConfig):
        super().__init__()
        dim, hidden = config.embed_dim, config.mlp_hidden
        self.gated = config.swiglu_mlp
        self.packed = self.gated and not (config.scale_mlp or config.swiglu_align_to)
        bias = config.linear_bias
        if not self.gated:
            self.fc1 = nn.Linear(dim, hidden, bias=bias)
            self.act = activation(config.act_layer)
        elif not self.packed:
            self.fc1_g = nn.Linear(dim, hidden, bias=bias)
            self.fc1_x = nn.Linear(dim, hidden, bias=bias)
            self.act = nn.SiLU()
        else:
            self.fc1 = nn.Linear(dim, 2 * hidden, bias=bias)
            self.act = nn.SiLU()
        self.drop1 = nn.Dropout(config.drop_rate)
        self.norm = nn.LayerNorm(hidden, eps=config.layer_norm_eps) if config.scale_mlp else nn.Identity()
        self.fc2 = nn.Linear(hidden, dim, bias=bias)
        self.drop2 = nn.Dropout(config.drop_rate)

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        """(B, N, D) -> (B, N, hidden): the units fc2 reads (after the activation or the gate, and
        the hidden LayerNorm if any)."""
        if not self.gated:
            units = self.act(self.fc1(x))
        elif self.packed:
            gate, value = self.fc1(x).chunk(2, dim=-1)  # (B, N, hidden) each
            units = self.act(gate) * value
        else:
            units = self.act(self.fc1_g(x)) * self.fc1_x(x)
        return self.norm(self.drop1(units))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.hidden(x)  # (B, N, hidden)
        knock_out = active(ACTIVE_KNOCKOUT)
        if knock_out is not None:
            hidden = knock_out.hidden(self, hidden)  # a knocked-out branch's units, before fc2
        register = active(ACTIVE_REGISTER)
        if register is not None:
            hidden = register.hidden(self, hidden)  # register neurons' activations moved into the register
        recorder = active(ACTIVE_RECORDER)
        if recorder is not None:
            recorder.internals(self, mlp_hidden=hidden)
        return self.drop2(self.fc2(hidden))


class LayerScale(nn.Module):
    """Per-channel learned scale of a residual branch (CaiT, DeiT III, DINOv2)."""

    def __init__(self, dim: int, init_values: float):
        super().__init__()
        # torch.full, not init_values * torch.ones: on the meta device (checkpoints are built there)
        # the product goes through torch's decompositions, whose first use imports ~1 s of modules.
        self.gamma = nn.Parameter(torch.full((dim,), float(init_values)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gamma


class DropPath(nn.Module):
    """Stochastic depth: drop a sample's whole residual branch with probability ``drop_prob``."""

    def __init__(self, drop_prob: float):
        super().__init__()
        self.drop_prob = drop_prob

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.drop_prob == 0.0:
            return x
        keep = 1.0 - self.drop_prob
        mask = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(keep)
        return x * mask / keep


class Block(nn.Module):
    """Pre-norm transformer encoder block: x + Attn(LN(x)), then x + MLP(LN(x))."""

    def __init__(self, config: ViTConfig, drop_path: float = 0.0, windowed: bool = False):
        super().__init__()
        dim = config.embed_dim
        layer_scale = (
            (lambda: LayerScale(dim, config.init_values))
            if config.init_values is not None
            else nn.Identity
        )
        self.norm1 = norm_layer(config, dim)
        self.attn = Attention(config, windowed)
        self.ls1 = layer_scale()
        self.drop_path1 = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.norm2 = norm_layer(config, dim)
        self.mlp = Mlp(config)
        self.ls2 = layer_scale()
        self.drop_path2 = DropPath(drop_path) if drop_path > 0 else nn.Identity()

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None, packing: Packing | None = None
    ) -> torch.Tensor:
        # Step by step, so that a recorder asking for this layer's internals (vit_explorer.model.internals)
        # gets every intermediate of this very pass; the arithmetic is the one-line block's.
        # ``rope``: the grid's rotary tables, for a model with rotary positions (ViT.rope_tables).
        # ``packing``: x holds several sequences one after the other (vit_explorer.model.packing).
        patch = active(ACTIVE_PATCH)
        if patch is not None:  # the tokens entering this block, its branches' outputs: from another run
            x = patch.edit(self, "resid", x)
        normed = self.norm1(x)
        attended = self.attn(normed, rope, packing)
        if patch is not None:
            attended = patch.edit(self, "attn", attended)
        middle = x + self.drop_path1(self.ls1(attended))
        normed_middle = self.norm2(middle if patch is None else patch.edit(self, "mlp_in", middle))
        mlp_out = self.mlp(normed_middle)
        if patch is not None:
            mlp_out = patch.edit(self, "mlp", mlp_out)
        out = middle + self.drop_path2(self.ls2(mlp_out))
        recorder = active(ACTIVE_RECORDER)
        if recorder is not None:
            recorder.internals(
                self, input=x, norm1=normed, attn_out=attended, middle=middle, norm2=normed_middle,
                mlp_out=mlp_out, output=out,
            )
        return out


class AttentionPool(nn.Module):
    """Multihead attention pooling (MAP, SigLIP; timm's AttentionPoolLatent): a learned probe
    query attends over the patch tokens, then a residual MLP refines what it gathered.

    The probe's softmax goes to the active recorder like a block's, so capture can show where the
    pooled representation reads from, as the class token's attention does for a class-token model.
    """

    def __init__(self, config: ViTConfig):
        super().__init__()
        dim = config.embed_dim
        self.num_heads = config.attn_pool_num_heads or config.num_heads
        self.scale = (dim // self.num_heads) ** -0.5
        self.latent = nn.Parameter(torch.zeros(1, 1, dim))  # the probe query
        # Biased whatever the blocks' qkv (timm's AttentionPoolLatent, transformers' MultiheadAttention):
        # NaFlexViT So150M2's blocks have none, its pool has them.
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, dim * 2)
        self.proj = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim, eps=config.layer_norm_eps)
        self.mlp = Mlp(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = rearrange(self.q(self.latent), "1 q (nh hd) -> 1 nh q hd", nh=self.num_heads)
        kv = rearrange(self.kv(x), "b n (kv nh hd) -> kv b nh n hd", kv=2, nh=self.num_heads)
        k, v = kv.unbind(0)  # (B, nh, N, hd) each
        recorder = active(ACTIVE_RECORDER)
        if recorder is None or not recorder.wants_attention(self):
            x = F.scaled_dot_product_attention(q.expand(x.shape[0], -1, -1, -1), k, v)
        else:
            attn = ((q * self.scale) @ k.transpose(-2, -1)).softmax(dim=-1)  # (B, nh, 1, N)
            recorder.attention(self, attn)
            x = attn @ v  # (B, nh, 1, hd)
        x = self.proj(rearrange(x, "b nh q hd -> b q (nh hd)"))
        x = x + self.mlp(self.norm(x))
        return x[:, 0]  # (B, D)


class PatchMerger(nn.Module):
    """Qwen-VL's patch merger (transformers' Qwen2_5_VLPatchMerger, its names): each m x m square of
    neighbouring patch tokens (m = spatial_merge_size) is normed (ln_q), its m^2 tokens joined
    row by row into one vector of m^2 D numbers, and an MLP (Linear, GELU, Linear) maps that to
    the merger_dim numbers of one token of the language model. ``postshuffle``: the norm comes
    after the join, over the m^2 D numbers (Qwen3-VL's DeepStack mergers)."""

    def __init__(self, config: ViTConfig, postshuffle: bool = False):
        super().__init__()
        self.merge = config.spatial_merge_size
        joined = config.embed_dim * self.merge**2
        self.postshuffle = postshuffle
        self.ln_q = norm_layer(config, joined if postshuffle else config.embed_dim)
        self.mlp = nn.Sequential(nn.Linear(joined, joined), nn.GELU(), nn.Linear(joined, config.merger_dim))

    def forward(self, x: torch.Tensor, grid_size: tuple[int, int]) -> torch.Tensor:
        """(B, gh * gw, D) patch tokens, row-major -> (B, gh/m * gw/m, merger_dim)."""
        grid_h, grid_w = grid_size
        if grid_h % self.merge or grid_w % self.merge:
            raise ValueError(f"a {grid_h}x{grid_w} grid of patches cannot be merged {self.merge} x {self.merge}")
        joined = rearrange(
            x if self.postshuffle else self.ln_q(x), "b (h m1 w m2) d -> b (h w) (m1 m2 d)",
            h=grid_h // self.merge, m1=self.merge, m2=self.merge,
        )
        return self.mlp(self.ln_q(joined) if self.postshuffle else joined)


class ViT(nn.Module):
    """Vision Transformer. ``model(x)`` takes (B, C, H, W) normalized images, returns logits."""

    def __init__(self, config: ViTConfig):
        super().__init__()
        self.config = config
        dim = config.embed_dim
        self.num_prefix_tokens = config.num_prefix_tokens
        self.patch_embed = PatchEmbed(config)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim)) if config.class_token else None
        self.dist_token = nn.Parameter(torch.zeros(1, 1, dim)) if config.dist_token else None
        self.reg_token = (
            nn.Parameter(torch.zeros(1, config.reg_tokens, dim)) if config.reg_tokens else None
        )
        embed_len = config.num_patches + (0 if config.no_embed_class else self.num_prefix_tokens)
        self.pos_embed = nn.Parameter(torch.zeros(1, embed_len, dim)) if config.abs_pos_embed else None
        # Rotary positions have no parameters: their sin/cos tables are computed per grid (rope.py).
        self.rope_spec = RopeSpec.of(config)
        self.pos_drop = nn.Dropout(config.drop_rate)
        self.norm_pre = norm_layer(config, dim) if config.pre_norm else nn.Identity()
        # Stochastic depth grows linearly with depth (plain floats: the model can be built on "meta").
        drop_paths = [config.drop_path_rate * i / max(config.depth - 1, 1) for i in range(config.depth)]
        windowed = [bool(config.attn_window) and i not in config.full_attention_blocks for i in range(config.depth)]
        self.blocks = nn.Sequential(*(Block(config, rate, window) for rate, window in zip(drop_paths, windowed)))
        use_fc_norm = config.use_fc_norm
        final_norm = config.final_norm and not use_fc_norm
        self.norm = norm_layer(config, dim) if final_norm else nn.Identity()
        self.attn_pool = AttentionPool(config) if config.global_pool == "map" else None
        self.fc_norm = norm_layer(config, dim) if use_fc_norm else nn.Identity()
        self.head_drop = nn.Dropout(config.drop_rate)
        self.head = nn.Linear(dim, config.num_classes) if config.num_classes else nn.Identity()
        # DeiT's distillation head reads the distillation token; in eval both heads are averaged.
        self.head_dist = (
            nn.Linear(dim, config.num_classes) if config.dist_token and config.num_classes else None
        )
        self.merger = PatchMerger(config) if config.merger_dim else None
        self.deepstack_merger_list = (
            nn.ModuleList(PatchMerger(config, postshuffle=True) for _ in config.deepstack_layers)
            if config.deepstack_layers else None
        )
        self._init_weights()

    def _init_weights(self) -> None:
        if self.patch_embed.proj.weight.is_meta:
            # Built on "meta" to adopt a checkpoint's tensors: nothing to fill, and init ops on
            # meta tensors import torch._dynamo (3 s on the first model a process loads).
            return
        if self.pos_embed is not None:
            nn.init.trunc_normal_(self.pos_embed, std=0.02)
        for token in (self.cls_token, self.dist_token, self.reg_token):
            if token is not None:
                nn.init.normal_(token, std=1e-6)
        if self.attn_pool is not None:
            nn.init.trunc_normal_(self.attn_pool.latent, std=self.config.embed_dim**-0.5)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.trunc_normal_(module.weight, std=0.02)
                nn.init.zeros_(module.bias) if module.bias is not None else None
        # The head keeps the small normal init above rather than timm's zeros: a zero head passes
        # no gradient back to the blocks on the first step, and slowed early learning measurably
        # (shapes, tiny preset: 71% vs 77% test accuracy after 1,000 steps).

    def grid_size(self, patch_size: int | None = None) -> tuple[int, int]:
        """The patch grid of this model's input at ``patch_size`` (default: its own)."""
        height, width = self.config.img_size
        patch = patch_size or self.config.patch_size
        return (height // patch, width // patch)

    def rope_tables(self, grid_size: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The rotary (sin, cos) tables of a ``grid_size`` grid (default: the config's) on this model's
        device, each (gh * gw, hd), shared and cached (vit_explorer.model.rope); with window
        attention, also each patch's window (a GridTables' ``windows``); None with neither."""
        window = self.config.attn_window
        if self.rope_spec is None and not window:
            return None
        device = self.patch_embed.proj.weight.device
        grid_size = tuple(grid_size or self.config.grid_size)
        sin, cos = (None, None) if self.rope_spec is None else rope_tables(self.rope_spec, grid_size, device)
        if not window:
            return sin, cos
        return GridTables(sin, cos, window_ids(grid_size, window).to(device))

    def rope_angles(self, grid_size: tuple[int, int] | None = None) -> torch.Tensor | None:
        """(gh * gw, hd/2) each patch's rotation angles in radians (vit_explorer.model.rope.rope_angles)."""
        return rope_angles(self.config, grid_size)

    def _pos_embed(self, x: torch.Tensor, patch_size: int | None = None) -> torch.Tensor:
        """Add position embeddings (if the model has them) and prepend [class, distillation,
        register tokens] to (B, gh*gw, D).

        At another patch size the grid part of the position embeddings is resampled to the new
        grid for this call (bicubic, differentiable), as FlexiViT does.
        """
        prefix = [
            token.expand(x.shape[0], -1, -1)
            for token in (self.cls_token, self.dist_token, self.reg_token)
            if token is not None
        ]
        if self.pos_embed is not None and self.config.no_embed_class:
            x = x + resample_pos_embed(
                self.pos_embed, self.config.grid_size, self.grid_size(patch_size), 0, self.config.pos_embed_interpolation,
                self.config.pos_embed_ar_preserving,
            )
        x = torch.cat(prefix + [x], dim=1) if prefix else x
        if self.pos_embed is not None and not self.config.no_embed_class:
            x = x + resample_pos_embed(
                self.pos_embed, self.config.grid_size, self.grid_size(patch_size), self.num_prefix_tokens,
                self.config.pos_embed_interpolation, self.config.pos_embed_ar_preserving,
            )
        return self.pos_drop(x)  # (B, N, D)

    def forward_features(self, x: torch.Tensor, patch_size: int | None = None) -> torch.Tensor:
        """(B, C, H, W) -> (B, N, D) tokens after the final norm; ``patch_size`` runs this call at
        another patch size (FlexiViT: resized kernel and position embeddings, model unchanged)."""
        recorder = active(ACTIVE_RECORDER)
        x = self.patch_embed(x, patch_size)  # (B, gh*gw, D)
        if recorder is not None:
            recorder.patch_embeddings(self, x)
        x = self._pos_embed(x, patch_size)  # (B, N, D)
        register = active(ACTIVE_REGISTER)
        if register is not None:  # a test-time register: one more prefix token, without a position
            x = register.append(self, x)
        x = self.norm_pre(x)
        if recorder is not None:
            recorder.tokens(self, x)
        return self.forward_blocks(x, grid_size=self.grid_size(patch_size))

    def forward_blocks(
        self, x: torch.Tensor, start: int = 0, grid_size: tuple[int, int] | None = None,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None, packing: Packing | None = None,
    ) -> torch.Tensor:
        """(B, N, D) tokens entering block ``start`` -> tokens after the final norm: the rest of
        the pass from there, so that a knock-out or a sweep starting at layer ``start`` reuses the
        earlier layers' tokens of an intact pass instead of running them again. ``grid_size``: the
        patch grid the tokens come from (default: the config's), which rotary positions need.
        ``rope``: the rotary (sin, cos) rows of the patch tokens in ``x`` instead of the whole
        grid's, for a pass over some of the patches only (vit_explorer.analysis.faithfulness drops
        patch tokens): (K, hd) each, or (B, 1, K, hd) with each image's own patches. ``packing``:
        ``x`` (1, T, D) is several sequences packed (vit_explorer.model.packing), ``rope`` then
        its (T, hd) tables."""
        recorder = active(ACTIVE_RECORDER)
        steering = active(ACTIVE_STEERING)
        rope = self.rope_tables(grid_size) if rope is None else rope
        for layer, block in enumerate(self.blocks[start:], start):
            x = block(x, rope, packing)
            if steering is not None and steering.layer == layer:
                x = steering.edit(self, x)
            if recorder is not None:
                recorder.tokens(self, x)
        return self.norm(x)

    def pool(self, x: torch.Tensor) -> torch.Tensor:
        """(B, N, D) tokens -> (B, D): the class token, the mean of the patch tokens, or what the
        attention pool's probe gathers from them (never a test-time register's token)."""
        register = active(ACTIVE_REGISTER)
        prefix = self.num_prefix_tokens + (0 if register is None else register.added_tokens(self))
        if self.attn_pool is not None:
            tokens = x[:, prefix:]
            if self.config.pool_include_prefix:  # the Perception Encoder's probe reads its class token too
                tokens = torch.cat([x[:, : self.num_prefix_tokens], tokens], dim=1)
            return self.attn_pool(tokens)
        if self.config.global_pool == "mean":
            return x[:, prefix:].mean(dim=1)
        return x[:, 0]

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        if self.config.dist_token:
            # DeiT: the class and distillation tokens each have a head; eval averages the two.
            x, x_dist = self.head_drop(x[:, 0]), self.head_drop(x[:, 1])
            if pre_logits or self.head_dist is None:
                return (x + x_dist) / 2
            return (self.head(x) + self.head_dist(x_dist)) / 2
        x = self.head_drop(self.fc_norm(self.pool(x)))
        return x if pre_logits else self.head(x)

    def forward(self, x: torch.Tensor, patch_size: int | None = None) -> torch.Tensor:
        return self.forward_head(self.forward_features(x, patch_size))

    def merged(self, x: torch.Tensor, grid_size: tuple[int, int] | None = None) -> torch.Tensor:
        """(B, N, D) tokens after the last block -> (B, gh/m * gw/m, merger_dim): what a Qwen-VL
        language model reads of them (PatchMerger), row-major over the merged grid."""
        if self.merger is None:
            raise ValueError("this model has no patch merger (only Qwen-VL's towers do)")
        return self.merger(x[:, x.shape[1] - math.prod(grid_size or self.config.grid_size):], grid_size or self.config.grid_size)

    def deepstack(self, tokens: torch.Tensor, grid_size: tuple[int, int] | None = None) -> list[torch.Tensor]:
        """A capture's tokens (B, depth + 1, N, D) -> Qwen3-VL's DeepStack features, one (B, gh/m *
        gw/m, merger_dim) per layer of config.deepstack_layers: that block's output through its own merger."""
        grid_size = grid_size or self.config.grid_size
        return [
            merger(tokens[:, layer + 1, tokens.shape[2] - math.prod(grid_size):], grid_size)
            for layer, merger in zip(self.config.deepstack_layers, self.deepstack_merger_list or ())
        ]
