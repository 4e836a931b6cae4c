"""The models every session shares: loaded and resized once into a byte-bounded cache, the
sizes they allow, the picker's options and titles, and whether a catalogue model can be had
(downloaded, or its host answers) and its download under a progress bar.

Model keys: ``"default"`` (the shipped shapes model), ``"pretrained:<name>"`` (a catalogue
entry, vit_explorer.weights.catalogue) and ``"file:<path>"`` (an uploaded checkpoint or a run trained in
the app).
"""
from __future__ import annotations

import os
import socket
import threading
import urllib.parse
from pathlib import Path

import streamlit as st
import torch

from ..model.config import NORMALIZATIONS
from ..model.vit import ViT
from ..serving.cache import ByteBoundedCache, nbytes
from ..training import train
from ..training.admission import admit_model
from ..weights import catalogue, from_naflex, from_open_clip, from_qwen_vl
from ..weights.footprint import Footprint, config_footprint, model_footprint, text_footprint
from ..weights import load_model, load_pretrained, resize_model
from ..weights.normalization import renormalized
from . import runs
from .memo import with_spinner

DEFAULT_MODEL = "default"
PRETRAINED_MODEL = "pretrained:vit_b_16"

# The most one view may hold at once for one image (view_bytes): under a third of the shared
# results cache (memo.CACHE_BYTES, 2 GB by default), so that three people at the bound fit in it
# together. Every catalogue model at its own size fits (DINOv2 ViT-S/14 with registers at 518 px,
# 1,374 tokens: 192 MiB), and DINOv3 ViT-S/16 at 768 px (2,309 tokens: 512 MiB); the same model
# at 832 px (2,709 tokens: 695 MiB) or a ViT-B/16 at 768 px (858 MiB) is refused. What a view
# costs in passes (the rollout's N x N products, N^3 a layer, among it) is app.costs' to count.
MAX_VIEW_BYTES = 640 * 2**20
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# Models loaded or resized for any session (a ViT-B/16 is 330 MB).
MODELS_BYTES = int(float(os.environ.get("VIT_EXPLORER_MODELS_MB") or 3072) * 2**20)
# What a page says in place of a view that needs class scores, for a model without a classifier.
NO_CLASSIFIER = (
    "{what} needs class scores, and this model has no classification head (num_classes=0):"
    " it outputs a feature vector, not classes."
)


def default_weights() -> Path:
    """The shipped shapes model, or the checkpoint that VIT_EXPLORER_DEFAULT_MODEL names: a file,
    or a folder (Hugging Face, open_clip: a CLIP or SigLIP with its words). An open_clip folder's
    weights file stands for its folder, where its config and tokenizer are."""
    path = Path(os.environ.get("VIT_EXPLORER_DEFAULT_MODEL") or train.DEFAULT_WEIGHTS)
    if path.name == from_open_clip.WEIGHTS_FILE and from_open_clip.is_folder(path.parent):
        return path.parent
    return path


@st.cache_resource
def shared_models() -> ByteBoundedCache:
    """Every session's models (each loaded once), bounded in bytes of parameters and buffers."""
    return ByteBoundedCache(MODELS_BYTES)


def base_model(model_key: str) -> ViT:
    """The model behind a key at its own patch size, in eval mode on the app's device."""
    def load() -> ViT:
        kind, _, reference = model_key.partition(":")
        admit(model_key)  # before anything of it is read
        if kind == DEFAULT_MODEL:
            weights = default_weights()
            if not weights.exists():
                raise FileNotFoundError(
                    "the default model (VIT_EXPLORER_DEFAULT_MODEL) is missing; train it with"
                    " `python -m vit_explorer train` or upload a checkpoint"
                )
            model = load_model(weights)
        elif kind == "pretrained":
            model = load_pretrained(reference)
        else:
            model = load_model(reference)
        return model.to(DEVICE).eval()

    return shared_models().get_or_compute(("base", model_key), lambda: with_spinner("Loading the model ...", load))


def footprint(model_key: str) -> Footprint | None:
    """The memory the model behind a key takes to load, from its files' headers (a catalogue
    entry's from its architecture, before any download); None where its loader refuses it."""
    kind, _, reference = model_key.partition(":")
    if kind == "pretrained":
        return config_footprint(catalogue.entry(reference).config_without_names()) if reference in catalogue.CATALOGUE else None
    return model_footprint(default_weights() if kind == DEFAULT_MODEL else reference)


def admit(model_key: str) -> None:
    """Refuse in a sentence (CheckpointError) a model that would not fit the shared models' budget,
    the machine's available memory or the GPU's, before anything of it is downloaded or allocated."""
    admit_model(footprint(model_key), MODELS_BYTES, DEVICE)


def admit_text(folder: Path, image: ViT) -> None:
    """Refuse in a sentence (CheckpointError), before it is read, the text tower of ``folder`` that
    would not fit beside its image tower ``image`` in the shared models' budget, the machine's
    memory or the GPU's (app.words keeps it in the shared models too)."""
    admit_model(text_footprint(folder), MODELS_BYTES, DEVICE, what="its text tower", beside=nbytes(image))


def memory_note(name: str) -> str:
    """What a catalogue model holds once loaded, for the sentences that say its download's size."""
    weights = config_footprint(catalogue.entry(name).config_without_names()).weights
    return f"about {weights / 1e6:,.0f} MB in memory once loaded"


def model_at(model_key: str, patch_size: int, image_size: tuple[int, int], normalization: str | None = None) -> ViT:
    """The model resized to ``patch_size`` (FlexiViT PI-resize) and ``image_size`` (position
    embeddings resampled); the base model itself at its own sizes. ``normalization``: a name of
    NORMALIZATIONS a person chose for a model whose own was assumed (:func:`normalization_choice`):
    the same model, its tensors shared, whose config says that mean and std."""
    if normalization is not None:
        resized = model_at(model_key, patch_size, image_size)
        mean, std = NORMALIZATIONS[normalization]
        chosen = shared_models().get_or_compute(
            ("normalized", model_key, patch_size, tuple(image_size), normalization),
            lambda: renormalized(resized, mean, std), size=lambda chosen: 0,  # the resized model's tensors
        )
        model_at(model_key, patch_size, image_size)  # touched last: kept while the copy lives
        return chosen
    model = base_model(model_key)
    image_size = tuple(image_size)
    if patch_size == model.config.patch_size and image_size == model.config.img_size:
        return model
    resized = shared_models().get_or_compute(
        ("resized", model_key, patch_size, image_size),
        lambda: with_spinner(
            "Resizing the model ...",
            lambda: resize_model(model, patch_size=patch_size, image_size=image_size, share_weights=True).eval(),
        ),
        size=lambda resized: _own_bytes(resized, model),
    )
    # The resized model holds the base model's storage, counted with the base: touched last, the
    # base is never the least recently used of the two, so it is not evicted while they live.
    base_model(model_key)
    return resized


def normalization_choice(config, chosen: str | None) -> str | None:
    """The normalisation a session reads a model with: ``chosen`` (a NORMALIZATIONS name) where the
    model's own was assumed and the person chose another, else None (the model's own)."""
    if not config.normalization_assumed or chosen not in NORMALIZATIONS or config.in_chans != 3:
        return None
    return None if chosen == config.normalization_name else chosen


def assumed_normalization(config) -> str | None:
    """The sidebar's sentence for a model whose normalisation nothing told; None for any other."""
    if not config.normalization_assumed:
        return None
    name = config.normalization_name or f"mean {config.mean}, std {config.std}"
    return f"Normalisation assumed: {name}, timm's default for a ViT of this shape; nothing in the checkpoint says which."


def _own_bytes(resized: ViT, base: ViT) -> int:
    """Bytes of the resampled tensors of a resized model: the rest is the base model's storage."""
    base_storage = {tensor.data_ptr() for tensor in base.state_dict().values()}
    return sum(nbytes(tensor) for tensor in resized.state_dict().values() if tensor.data_ptr() not in base_storage)


def token_count(config, patch_size: int, image_size: tuple[int, int] | None = None) -> int:
    """Tokens the model has at ``patch_size`` on an input of ``image_size`` (its own by default)."""
    height, width = image_size or config.img_size
    return config.num_prefix_tokens + (height // patch_size) * (width // patch_size)


# Every layer's float16 attention is kept from the capture's own pass while it is at most this
# (a ViT-B/16: 11 MB at patch 16, 177 MB at patch 8): its views then read it instead of computing
# every layer again from the tokens for each analysis (a knock-out view took twice as long, the
# Attention page at patch 8 four times). Past it (DINOv2 at 518 px: 272 MB), only the tokens.
KEEP_EVERY_LAYER_BYTES = 256 * 2**20


def every_layer_bytes(config, tokens: int | None = None) -> int:
    """Bytes of every layer's (heads, N, N) attention of one image in float16."""
    tokens = config.num_tokens if tokens is None else tokens
    return config.depth * config.num_heads * tokens**2 * 2


def keeps_every_layer(config) -> bool:
    """Whether a page's capture of one image keeps every layer's attention (KEEP_EVERY_LAYER_BYTES)."""
    return every_layer_bytes(config) <= KEEP_EVERY_LAYER_BYTES


def view_bytes(config, tokens: int | None = None) -> int:
    """Bytes one view holds at its peak for one image of ``tokens`` tokens (the model's own by
    default): the capture's tokens (depth + 1, N, D) float32 (and every layer's float16 attention
    where that is small, KEEP_EVERY_LAYER_BYTES), the layer it draws (heads, N, N) in float16 (Selection.attention), one layer in
    float32 while an analysis over all layers computes it (capture.layer_attentions), and the
    rollout's N x N float32 matrices (its product, the next factor, the identity, the fused heads,
    and the discarding's ranking, indices and mask: eight at most); plus, as the allocator keeps
    it, one layer's float32 scores of the capture's own pass (the CPU's fused attention makes them).
    Measured at depth 12: the peak memory a DINOv3 ViT-S/16 view at 768 px adds is 486 MiB."""
    tokens = config.num_tokens if tokens is None else tokens
    captured = (config.depth + 1) * tokens * config.embed_dim * 4
    kept = every_layer_bytes(config, tokens)
    captured += kept if kept <= KEEP_EVERY_LAYER_BYTES else 0  # Selection.capture keeps them then
    return captured + config.num_heads * tokens**2 * (2 + 4 + 4) + 8 * tokens**2 * 4


def image_size_problem(config, image_size: tuple[int, int]) -> str | None:
    """Why the model (at its own patch size) cannot be explored at ``image_size``; None if it can.
    Checked before anything is computed, as admission checks a training run."""
    height, width = image_size
    patch = config.patch_size
    if height < patch or width < patch or height % patch or width % patch:
        return f"The input size must be a multiple of the patch size ({patch} px) on both sides."
    merged = patch * config.spatial_merge_size
    if config.merger_dim and (height % merged or width % merged):
        return f"The input size must be a multiple of {merged} px on both sides: the patch merger joins {config.spatial_merge_size} x {config.spatial_merge_size} patches."
    tokens = token_count(config, patch, image_size)
    if view_bytes(config, tokens) > MAX_VIEW_BYTES:
        return (
            f"At {height}x{width} px this model has {tokens} tokens and one view of it would hold"
            f" {view_bytes(config, tokens) / 2**20:.0f} MB, more than the {MAX_VIEW_BYTES / 2**20:.0f} MB"
            " this app allows; choose a smaller size."
        )
    return None


def patch_size_options(config) -> list[int]:
    """Patch sizes that tile the model's input exactly and keep a view within MAX_VIEW_BYTES; a
    model with window attention or a patch merger (Qwen-VL) only its own: its windows and merger
    count patches, and another size was never compared with its reference."""
    if config.attn_window or config.merger_dim:
        return [config.patch_size]
    height, width = config.img_size
    options = []
    for patch in range(2, min(height, width) + 1):
        if height % patch or width % patch:
            continue
        if view_bytes(config, token_count(config, patch)) <= MAX_VIEW_BYTES:
            options.append(patch)
    return sorted(set(options) | {config.patch_size})


def parameter_count(model: ViT) -> int:
    return sum(parameter.numel() for parameter in model.parameters())


def describe(config) -> str:
    """One line that says what a ViT is: input, grid, width, depth, heads and tokens."""
    height, width = config.img_size
    grid_h, grid_w = config.grid_size
    prefix = []
    if config.class_token:
        prefix.append("class token")
    if config.reg_tokens:
        prefix.append(f"{config.reg_tokens} registers")
    return (
        f"{height}x{width} px input, patch {config.patch_size} -> {grid_h}x{grid_w} grid,"
        f" dim {config.embed_dim}, {config.depth} layers x {config.num_heads} heads,"
        f" {' + '.join(prefix) or 'no class token'} ({config.num_tokens} tokens),"
        f" {config.num_classes} classes"
    )


def pooled_output(config) -> str:
    """What the model keeps of its tokens at the end, for a sentence ("The model keeps one vector, ...")."""
    if config.dist_token:
        return (
            "the average of the class and distillation tokens' outputs" if config.num_classes == 0
            else "the class and distillation tokens' outputs, each through its own head (the two"
            " scores are averaged)"
        )
    return {
        "cls": "the class token's output",
        "mean": "the mean of the patch tokens",
        "map": "what a learned probe query gathers from the patch tokens by attention (an attention-pool"
        " head; the Attention page shows where it reads)",
    }[config.global_pool]


def follows_picture(config) -> bool:
    """Whether the model's own preprocessing sizes its input from each picture (Qwen-VL, NaFlexViT)."""
    return config.pixel_budget is not None or config.max_patches is not None


def picture_input_size(config, picture_size: tuple[int, int]) -> tuple[int, int] | None:
    """(height, width) a model's own preprocessing resizes a picture of ``picture_size`` (width,
    height, as PIL gives it) to, the aspect ratio kept: Qwen-VL's, multiples of patch x merge
    within its pixel budget; NaFlexViT's, multiples of the patch with at most max_patches patches
    (timm's ResizeToSequence); None for a model with one input size (or a picture it refuses)."""
    width, height = picture_size
    try:
        if config.max_patches is not None:
            return from_naflex.sequence_size(height, width, config.patch_size, config.max_patches)
        if config.pixel_budget is not None:
            return from_qwen_vl.smart_resize(height, width, config.patch_size * config.spatial_merge_size, *config.pixel_budget)
    except ValueError:  # Qwen: more than 200 times longer than wide; NaFlex: no scale fits
        return None
    return None


def preprocessing_note(config) -> str | None:
    """How the model's own preprocessing sizes a picture, for the sidebar; None for one input size."""
    if config.max_patches is not None:
        return (
            f"NaFlex preprocessing (SigLIP 2's, timm's NaFlexViT): each picture is resized ({config.interpolation}), its aspect ratio kept, to"
            f" multiples of {config.patch_size} px on both sides with at most {config.max_patches:,} patches,"
            " then normalised; a size typed here replaces it."
        )
    if config.pixel_budget is None:
        return None
    low, high = config.pixel_budget
    return (
        f"Qwen-VL's preprocessing: each picture is resized (bicubic) to multiples of"
        f" {config.patch_size * config.spatial_merge_size} px on both sides, its aspect ratio kept, within"
        f" {low:,} to {high:,} pixels, then normalised; a size typed here replaces it."
    )


def query_window(config, layer: int, query: int | None, grid_size: tuple[int, int]) -> tuple[int, int, int, int] | None:
    """(top, left, bottom, right), inclusive: the window of patches patch ``query`` (row-major)
    attends within in ``layer``; None for no patch, a full-attention layer or a model without windows."""
    window = config.attn_window
    if not window or query is None or layer in config.full_attention_blocks:
        return None
    row, col = divmod(query, grid_size[1])
    top, left = row // window * window, col // window * window
    return top, left, min(top + window, grid_size[0]) - 1, min(left + window, grid_size[1]) - 1


def window_note(config, layer: int, query: int | None, grid_size: tuple[int, int]) -> str | None:
    """For a model with window attention: whether ``layer`` attends within windows, and the
    window of patch ``query`` (row-major; None: no patch) whose outside its map leaves at zero;
    None for a model without windows."""
    window = config.attn_window
    if not window:
        return None
    full = ", ".join(str(block) for block in config.full_attention_blocks) or "none"
    side = f"{window} x {window} patches ({window * config.patch_size} px a side)"
    if layer in config.full_attention_blocks:
        return f"Layer {layer} attends to the whole picture: it is one of this model's full-attention layers ({full}); the others attend within windows of {side}."
    where = ""
    if query is not None:
        top, left, bottom, right = query_window(config, layer, query, grid_size)
        where = (
            f" Patch {query}'s window is rows {top}-{bottom}, columns {left}-{right} (dashed): its map is"
            " exactly zero outside it."
        )
    return (
        f"Layer {layer} attends within windows of {side}, tiled from the top-left corner: a patch reads only"
        f" the patches of its own window.{where} Full-attention layers: {full}."
    )


def language_model_reads(config, grid_size: tuple[int, int]) -> tuple[str, str] | None:
    """(a sentence, the shapes) of what a VLM's language model reads of its vision tower at this
    grid; None for a model that is no VLM's tower."""
    layer = config.language_model_layer
    if layer is None:
        return None
    block = min(layer, config.depth) - 1  # layers counted from 0, as the Attention page's slider does
    which = (
        "the last layer's output through the final norm" if layer > config.depth
        else "the last layer's output" if layer == config.depth
        else ("the penultimate layer's output" if layer == config.depth - 1 else f"layer {block}'s output")
        + f" (layer {block} on the Attention page)"
    )
    patches = grid_size[0] * grid_size[1]
    if config.merger_dim:  # Qwen-VL: the patch merger's tokens
        merge = config.spatial_merge_size
        merged_h, merged_w = grid_size[0] // merge, grid_size[1] // merge
        sentence = (
            f"This is the vision tower of a vision-language model: its language model reads {which} through"
            f" its patch merger, which normalises each token (RMSNorm), joins every {merge} x {merge} square of"
            f" neighbouring patches into one vector of {merge**2} x {config.embed_dim} numbers and maps it with"
            f" an MLP to the language model's {config.merger_dim}: {merged_h} x {merged_w} = {merged_h * merged_w:,}"
            " image tokens, which stand beside the words of the prompt."
            + (
                f" DeepStack: the outputs of layers {', '.join(str(layer) for layer in config.deepstack_layers)} go"
                " through mergers of their own too, and the language model adds those tokens into its first"
                f" {len(config.deepstack_layers)} layers." if config.deepstack_layers else ""
            )
            + " Nothing here is a prediction: the tower describes, the language model answers."
        )
        shapes = (
            f"({patches}, {config.embed_dim}) -> join {merge}x{merge} -> ({merged_h * merged_w}, {merge**2 * config.embed_dim})"
            f" -> merger MLP -> ({merged_h * merged_w}, {config.merger_dim}) -> the language model"
            + (f"; layers {', '.join(str(layer) for layer in config.deepstack_layers)} likewise (DeepStack)"
               if config.deepstack_layers else "")
        )
        return sentence, shapes
    dropped = config.language_model_drops_class_token and config.class_token
    tokens = patches + (0 if dropped else config.num_prefix_tokens)
    pooling, shuffle = config.language_model_pooling, config.language_model_shuffle
    sentence = (
        f"This is the vision tower of a vision-language model: its language model reads {which}"
        + (", without the class token" if dropped else "") + f", {tokens:,} image tokens of {config.embed_dim} numbers"
        + (f", which its projector averages {pooling} x {pooling} at a time into {tokens // pooling**2:,}" if pooling > 1 else "")
        + (f", which its projector joins {shuffle} x {shuffle} at a time (pixel shuffle) into {tokens // shuffle**2:,} of"
           f" {shuffle**2 * config.embed_dim:,} numbers" if shuffle > 1 else "")
        + ", and its projector maps each into the language model's own embedding space, where they stand"
        " beside the words of the prompt. Nothing here is a prediction: the tower describes, the language model answers."
    )
    shapes = (
        f"({patches + config.num_prefix_tokens}, {config.embed_dim})"
        + (f" -> drop the class token -> ({tokens}, {config.embed_dim})" if dropped else "")
        + (f" -> pool {pooling}x{pooling} -> ({tokens // pooling**2}, {config.embed_dim})" if pooling > 1 else "")
        + (f" -> join {shuffle}x{shuffle} -> ({tokens // shuffle**2}, {shuffle**2 * config.embed_dim})" if shuffle > 1 else "")
        + " -> projector -> the language model"
    )
    return sentence, shapes


def language_model_layer_note(config, layer: int) -> str | None:
    """A VLM tower's note beside a layer picker (layers counted from 0): which layer's output the
    language model reads, and whether it is this one; None for a model that is no VLM's tower."""
    if config.language_model_layer is None:
        return None
    read = min(config.language_model_layer, config.depth) - 1
    after_norm = (
        " through the final norm" if config.language_model_layer > config.depth
        else " through its patch merger" if config.merger_dim else ""
    )
    if layer == read:
        return f"This layer's output is what the language model reads{after_norm}."
    return f"The language model reads layer {read}'s output{after_norm}, {'after' if layer < read else 'before'} this one."


# Model labels longer than this are cut in the sidebar's picker (and in its open list): a name is
# shortened in the middle (its start and end tell checkpoints apart), the whole label shown below.
MAX_LABEL = 34


def model_options(whole: bool = False) -> dict[str, str]:
    """Model key -> label: the shipped model, the catalogue (downloaded or not), finished runs
    and uploads; names cut to fit the picker unless ``whole``."""
    weights = default_weights().resolve()
    shipped = weights == train.DEFAULT_WEIGHTS.resolve()
    # A server started with VIT_EXPLORER_DEFAULT_MODEL says which checkpoint it opens with.
    options = {DEFAULT_MODEL: "Shipped shapes ViT (offline)" if shipped else f"Default: {weights.stem}"}
    for name, entry in catalogue.CATALOGUE.items():
        # The state first: a long title may be cut, what selecting it costs never is.
        where = "Downloaded" if catalogue.is_downloaded(name) else f"{entry.size_bytes / 1e6:.0f} MB download"
        options[f"pretrained:{name}"] = f"{where}: {entry.title}"
    for run_id, run in runs.training_runs().items():
        if run.checkpoint is not None:
            options[f"file:{run.checkpoint}"] = f"Trained here: {run_id}"
    options.update(st.session_state["uploaded_models"])
    return options if whole else {key: _fit(label) for key, label in options.items()}


def model_title(model_key: str) -> str:
    """A catalogue model's title ("DINO ViT-S/16")."""
    return catalogue.entry(model_key.removeprefix("pretrained:")).title


def _fit(label: str) -> str:
    """A "Kind: name" label within MAX_LABEL characters, the name cut in the middle if need be."""
    if len(label) <= MAX_LABEL:
        return label
    kind, _, name = label.rpartition(": ")
    if name.endswith(")") and " (" in name:  # "ImageNet ViT-B/16 (torchvision)": the aside goes first
        return _fit(f"{kind}: {name.rpartition(' (')[0]}" if kind else name.rpartition(" (")[0])
    room = MAX_LABEL - len(kind) - 2 if kind else MAX_LABEL
    head = (room - 1) // 2
    shortened = f"{name[:head]}…{name[len(name) - (room - 1 - head):]}"
    return f"{kind}: {shortened}" if kind else shortened


def request_model(model_key: str) -> None:
    """Ask for a model; the app loads it at the start of the next run (see apply_requested_model)."""
    st.session_state["requested_model"] = model_key


def apply_requested_model() -> str | None:
    """Load the requested model and select it; on failure keep the current one and say why. A
    catalogue model whose licence must be accepted first waits as ``licence_to_accept``."""
    requested = st.session_state.pop("requested_model", None)
    if requested is None or requested == st.session_state["model_key"]:
        return None
    if licence_to_accept(requested) is not None:
        st.session_state["licence_to_accept"] = requested
        st.session_state["model_picker"] = st.session_state["model_key"]
        return None
    error = select_model(requested)
    st.session_state["model_picker"] = st.session_state["model_key"]
    return error


def licence_to_accept(model_key: str) -> str | None:
    """The sentence to accept before ``model_key`` downloads, or None: only a catalogue model not
    downloaded yet whose licence is not open source, and not yet accepted in this session."""
    kind, _, name = model_key.partition(":")
    if kind != "pretrained" or name not in catalogue.CATALOGUE or catalogue.is_downloaded(name):
        return None
    entry = catalogue.entry(name)
    if not entry.terms_to_accept or name in st.session_state.setdefault("accepted_licences", set()):
        return None
    return (
        f"{entry.title}'s weights are published under the {entry.licence}. Downloading them"
        f" ({entry.size_bytes / 1e6:.0f} MB; {memory_note(name)}) means accepting its terms."
    )


def accept_licence(model_key: str) -> None:
    """The person accepted the licence of a catalogue model: download and select it."""
    st.session_state.setdefault("accepted_licences", set()).add(model_key.removeprefix("pretrained:"))
    st.session_state.pop("licence_to_accept", None)
    request_model(model_key)


def select_model(model_key: str) -> str | None:
    """Load ``model_key`` and make it the current model; None on success, else the reason."""
    kind, _, name = model_key.partition(":")
    try:
        if kind == "pretrained" and name in catalogue.CATALOGUE:
            download_with_progress(name)
        base_model(model_key)
    except (ValueError, OSError) as error:
        return f"Could not load that model: {error}"
    state = st.session_state
    state["model_key"] = model_key
    # Layer, head, query and patch size belong to the previous model: forget the kept values
    # and the widgets' own state, so that the widgets start from the new model's defaults.
    for key in [str(key) for key in state if str(key).startswith("kept:")]:
        del state[key]
        state.pop(key.removeprefix("kept:"), None)
    return None


def model_cards() -> str:
    """The catalogue's model cards as a Markdown list: what each was trained on, how it attends."""
    return "\n".join(f"- **{entry.title}**: {entry.card.removeprefix(entry.title + ': ')}" for entry in catalogue.CATALOGUE.values())


def model_card(model_key: str) -> str | None:
    kind, _, name = model_key.partition(":")
    return catalogue.CATALOGUE[name].card if kind == "pretrained" and name in catalogue.CATALOGUE else None


def download_with_progress(name: str) -> None:
    """Download a catalogue entry (if not cached yet) under a progress bar, once it is admitted
    (CheckpointError: it would not fit, said before anything is fetched)."""
    if catalogue.is_downloaded(name):
        return
    admit(f"pretrained:{name}")
    entry = catalogue.entry(name)
    label = (
        f"Downloading {entry.title} ({entry.size_bytes / 1e6:.0f} MB; {memory_note(name)}) from {catalogue.url(name)};"
        f" licence: {entry.licence}"
    )
    bar = st.progress(0.0, text=label)

    def report(done: int, total: int | None) -> None:
        bar.progress(min(done / (total or entry.size_bytes), 1.0), text=label)

    try:
        catalogue.download(name, report)
    finally:
        bar.empty()


# Whether the catalogue's hosts answer: checked at most once a minute per host, each check
# within a second and a half (name lookup included), so that no page waits on a dead network.
REACHABLE_SECONDS = 60
REACHABLE_TIMEOUT = 1.5
# Said in place of the catalogue's models where none can be had.
CATALOGUE_OFFLINE = (
    "The pretrained models are not available offline: none is downloaded and this server cannot"
    f" reach their publishers (a local mirror can be set with {catalogue.HUB_URL_VARIABLE} or"
    f" {catalogue.TORCHVISION_URL_VARIABLE})."
)


def obtainable(model_key: str) -> bool:
    """Whether a catalogue model can be had now: downloaded, or its download host answers."""
    name = model_key.removeprefix("pretrained:")
    if catalogue.is_downloaded(name):
        return True
    address = urllib.parse.urlsplit(catalogue.url(name))
    return host_reachable(address.hostname, address.port or (443 if address.scheme == "https" else 80))


@st.cache_data(ttl=REACHABLE_SECONDS, max_entries=16, show_spinner=False)
def host_reachable(host: str, port: int) -> bool:
    """Whether a TCP connection to ``host:port`` opens within REACHABLE_TIMEOUT seconds."""
    opened = threading.Event()

    def connect() -> None:
        try:
            with socket.create_connection((host, port), timeout=REACHABLE_TIMEOUT):
                opened.set()
        except OSError:
            pass

    # In a thread of its own: a name lookup without a network can hang far longer than the timeout.
    threading.Thread(target=connect, daemon=True).start()
    return opened.wait(REACHABLE_TIMEOUT)


def undownloaded_entry(model_key: str) -> tuple[str, catalogue.CatalogueEntry] | None:
    """(name, entry) of the catalogue model a key names if it is not downloaded yet, else None:
    loading it would download it, which waits to be asked for."""
    kind, _, name = model_key.partition(":")
    if kind == "pretrained" and name in catalogue.CATALOGUE and not catalogue.is_downloaded(name):
        return name, catalogue.CATALOGUE[name]
    return None
