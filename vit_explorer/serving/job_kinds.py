"""What each kind of job computes (``KINDS``): its forward passes and memory, estimated from the
model's config and the job's settings before it is admitted, the computation a worker runs, and
how a server decodes the arrays the worker wrote.

    head sweep         every head knocked out alone (the Knock-out page, the Lesson)
    views              a model's capture of one image, its rollout, one layer's attention (Compare)
    rollout            one image's rollout at a fusion and discard (the Attention page)
    head statistics    one image's every head's distance and entropy (the Attention page)
    tokens             several images' tokens in one batch (Several images)
    head types         the head types over several images, and the tokens of those no page read
    register neurons   the register neurons over this image and the bundled photos (Registers)
    patch sizes        every patch size side by side, on the plan the server made (Patches)
    class embeddings   a CLIP or SigLIP model's ImageNet class embeddings, written beside it
                       (app/words.py: the prediction in words)
    faithfulness       the passes of one image's deletion / insertion curves (the Attention
                       page, the Lesson): the outputs on every set of kept patches, scored there
    patching           a clean and a corrupted picture: attribution patching of every site, or
                       exact patching of one (the Patching page)

A new kind is a compute and a decode function here and an entry in ``KINDS``; the board
(vit_explorer.serving.jobs) queues and runs it like the others.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..analysis import captured_head_statistics, streamed_rollout
from ..analysis.head_types import HeadTypes, classify_heads_from_tokens, held_floats
from ..analysis.image_set import NormOutliers
from ..analysis.faithfulness import BATCH_TOKENS, curve_rows, kept_outputs
from ..analysis.patching import (
    ATTRIBUTION_FORWARDS, PATCH_BATCH, SITES, attribution_patching, exact_cost, exact_patching, metric_from, paired_runs,
)
from ..analysis.patch_sizes import PlannedSize, held_out_accuracy, held_out_set, predictions
from ..analysis.test_time_registers import SEARCH_PASSES, RegisterNeurons, find_register_neurons
from ..model import cost
from ..model.ablation import SWEEP_BATCH, HeadSweep, head_sweep, sweep_cost
from ..model.capture import Capture, capture, layer_attentions
from ..model.vit import ViT
from ..text import load_image_text_model, zero_shot
from ..text.towers import TEXT_BATCH
from ..training.admission import inference_memory


@dataclass(frozen=True)
class Kind:
    """One kind of job: its cost in forward passes and memory, what its worker computes (arrays
    out, progress reported as a share), and the values those arrays stand for (a tuple: the
    asker keeps each under a key of its own)."""

    forwards: Callable[[object, dict], float]  # the model's config, the settings -> forward passes
    memory: Callable[[object, dict], int]  # the model's config, the settings -> peak bytes of the worker
    compute: Callable[[ViT, torch.Tensor, dict, Callable[[float], None]], dict[str, np.ndarray]]
    decode: Callable[[dict[str, np.ndarray]], tuple]


def _sweep(model: ViT, x: torch.Tensor, settings: dict, progress: Callable[[float], None]) -> dict:
    sweep = head_sweep(model, x, settings["mode"], progress=progress)
    return {
        "values": sweep.values.numpy(), "target": np.array(-1 if sweep.target is None else sweep.target),
        "mode": np.array(sweep.mode),
    }


def _decoded_sweep(arrays: dict) -> tuple[HeadSweep]:
    target = int(arrays["target"])
    return (HeadSweep(
        values=torch.from_numpy(arrays["values"]), target=None if target < 0 else target, mode=str(arrays["mode"]),
    ),)


CAPTURED_TENSORS = ("logits", "attentions", "tokens", "patches", "patch_embeddings")


def _every_layer(model: ViT, x: torch.Tensor, progress: Callable[[float], None]) -> tuple[Capture, Iterator[torch.Tensor]]:
    """The image ``x``'s capture (its tokens, no attention), then every layer's (1, H, N, N)
    attention computed again from them one at a time (as app.selection.Selection computes them
    where the capture kept none), the progress reported after the capture and each layer."""
    captured = _captured_tokens(model, x, progress)
    layer_done = _layer_progress(model, progress)

    def layers():
        for layer, attention in enumerate(layer_attentions(model, captured)):
            layer_done(layer)
            yield attention

    return captured, layers()


def _captured_tokens(model: ViT, x: torch.Tensor, progress: Callable[[float], None]) -> Capture:
    """The image ``x``'s capture (its tokens, no attention), the first of depth + 1 steps."""
    captured = capture(model, x, layers=())
    progress(1 / (model.config.depth + 1))
    return captured


def _layer_progress(model: ViT, progress: Callable[[float], None]) -> Callable[[int], None]:
    """What reports a layer done, after the capture: the layer's step of depth + 1."""
    depth = model.config.depth
    return lambda layer: progress((layer + 2) / (depth + 1))


def _views(model: ViT, x: torch.Tensor, settings: dict, progress: Callable[[float], None]) -> dict:
    """What a page draws of one image (the Compare page's model B): the capture (tokens, no
    attention), the rollout through every layer at its default settings, and the attention of
    layer ``settings["layer"]`` in float16, as app.selection.Selection computes them."""
    captured, attentions = _every_layer(model, x, progress)
    drawn = {}

    def layers():
        for layer, attention in enumerate(attentions):
            if layer == settings["layer"]:
                drawn["attention"] = attention[0].to(torch.float16).numpy()
            yield attention

    rollout = streamed_rollout(layers(), num_prefix_tokens=captured.num_prefix_tokens)
    arrays = {f"capture.{name}": getattr(captured, name).numpy() for name in CAPTURED_TENSORS}
    if captured.pool_attentions is not None:
        arrays["capture.pool_attentions"] = captured.pool_attentions.numpy()
    return {
        **arrays, "capture.grid_size": np.array(captured.grid_size), "capture.layers": np.array(captured.layers, int),
        "capture.num_prefix_tokens": np.array(captured.num_prefix_tokens),
        "capture.class_token": np.array(captured.class_token), "rollout": rollout.cpu().numpy(), **drawn,
    }


def _decoded_views(arrays: dict) -> tuple[Capture, torch.Tensor, torch.Tensor]:
    """(the capture, the rollout (1, N, N), the drawn layer's attention (heads, N, N))."""
    pool = arrays.get("capture.pool_attentions")
    captured = Capture(
        **{name: torch.from_numpy(arrays[f"capture.{name}"]) for name in CAPTURED_TENSORS},
        grid_size=tuple(int(size) for size in arrays["capture.grid_size"]),
        num_prefix_tokens=int(arrays["capture.num_prefix_tokens"]),
        layers=tuple(int(layer) for layer in arrays["capture.layers"]),
        class_token=bool(arrays["capture.class_token"]), pool_attentions=None if pool is None else torch.from_numpy(pool),
    )
    return captured, torch.from_numpy(arrays["rollout"]), torch.from_numpy(arrays["attention"])


def _rollout(model: ViT, x: torch.Tensor, settings: dict, progress: Callable[[float], None]) -> dict:
    """The image ``x``'s rollout (1, N, N) at ``settings``' fusion and discard, as
    app.selection.Selection.rollout computes it."""
    captured, layers = _every_layer(model, x, progress)
    rollout = streamed_rollout(layers, settings["fusion"], settings["discard"], num_prefix_tokens=captured.num_prefix_tokens)
    return {"rollout": rollout.cpu().numpy()}


def _head_statistics(model: ViT, x: torch.Tensor, settings: dict, progress: Callable[[float], None]) -> dict:
    """The image ``x``'s (L, H) head distances and entropies, as
    app.selection.Selection.head_statistics computes them."""
    captured = _captured_tokens(model, x, progress)
    distances, entropies = captured_head_statistics(model, captured, on_layer=_layer_progress(model, progress))
    return {"distances": distances.cpu().numpy(), "entropies": entropies.cpu().numpy()}


def _layers_memory(config, rollout: bool) -> int:
    """The capture's tokens kept and a layer's float32 attention, and with ``rollout`` its N x N
    matrices (app.models.view_bytes' count)."""
    tokens = config.num_tokens
    return inference_memory(config, 1, kept_floats=(
        (config.depth + 1) * tokens * config.embed_dim + config.num_heads * tokens**2 + (8 * tokens**2 if rollout else 0)
    ))


def _tokens(model: ViT, x: torch.Tensor, settings: dict, progress: Callable[[float], None]) -> dict:
    """Every block's tokens of the images ``x`` (B, C, H, W), in one pass (app.selection.ImageSet's)."""
    return {"tokens": capture(model, x, layers=()).tokens.numpy()}


def _decoded_tokens(arrays: dict) -> tuple[torch.Tensor, ...]:
    """(depth + 1, N, D) per image, each in storage of its own (kept apart)."""
    return tuple(torch.from_numpy(tokens.copy()) for tokens in arrays["tokens"])


def _head_types(model: ViT, x: torch.Tensor, settings: dict, progress: Callable[[float], None]) -> dict:
    """Every head's type over the images ``x`` (head_types.classify_heads_from_tokens after one
    pass that keeps their tokens), and the tokens of the images ``settings["kept"]`` (indices in
    ``x``), as app.selection.ImageSet keeps them."""
    config = model.config
    passes = cost.pass_cost(config, images=x.shape[0])
    total = passes + cost.head_types_cost(config, x.shape[0])  # in multiply-adds (model.cost)
    captured = capture(model, x, layers=())
    progress(passes / total)
    types = classify_heads_from_tokens(
        model, captured.tokens, progress=lambda share: progress((passes + share * (total - passes)) / total),
    )
    arrays = {f"types.{name}": values for name, values in types.to_arrays().items()}
    return {"tokens": captured.tokens[settings["kept"]].numpy(), **arrays}


def _decoded_head_types(arrays: dict) -> tuple:
    """(each kept image's tokens (depth + 1, N, D), ..., the head types)."""
    types = HeadTypes.from_arrays({
        name.removeprefix("types."): values for name, values in arrays.items() if name.startswith("types.")
    })
    return (*_decoded_tokens(arrays), types)


def _register_neurons(model: ViT, x: torch.Tensor, settings: dict, progress: Callable[[float], None]) -> dict:
    """The register neurons over the images ``x`` (B, C, H, W): their capture, then the search
    (test_time_registers.find_register_neurons), as app.selection.Selection.register_neurons."""
    neurons = find_register_neurons(model, x, settings["k"], settings["layer"], settings["last"], progress)
    found = neurons.outliers
    return {
        "scores": neurons.scores.numpy(), "norms": found.norms.numpy(), "outliers": found.outliers.numpy(),
        "statistics": np.array([found.threshold, found.median, found.mad]),
        "layers": np.array([neurons.layer, neurons.appears_at, neurons.images]),
    }


def _decoded_register_neurons(arrays: dict) -> tuple[RegisterNeurons]:
    threshold, median, mad = (float(value) for value in arrays["statistics"])
    layer, appears_at, images = (int(value) for value in arrays["layers"])
    outliers = NormOutliers(
        torch.from_numpy(arrays["norms"]), threshold, median, mad, torch.from_numpy(arrays["outliers"]),
    )
    return (RegisterNeurons(torch.from_numpy(arrays["scores"]), outliers, layer, appears_at, images),)


def _faithfulness(model: ViT, x: torch.Tensor, settings: dict, progress: Callable[[float], None]) -> dict:
    """The model's outputs on the image ``x`` (1, C, H, W) with each set of kept patches that the
    curves of ``settings["maps"]`` ((name, values) pairs, row-major over the patches) run
    (analysis.faithfulness.curve_rows, then kept_outputs: batched by token count). The server
    scores them (faithfulness_curves(outputs=...)), so a score in words needs no text tower here."""
    maps = {name: torch.tensor(values, dtype=torch.float64) for name, values in settings["maps"]}
    rows = curve_rows(model, maps, steps=settings["steps"], curves=settings["curves"])
    return {"outputs": kept_outputs(model, x, rows, settings["mode"], progress=progress).numpy()}


def _faithfulness_memory(config, settings: dict) -> int:
    """One batched pass of at most BATCH_TOKENS tokens, and every row's output kept."""
    rows = BATCH_TOKENS // config.num_tokens + 1
    outputs = settings["rows"] * max(config.num_classes or config.embed_dim, 1)
    return inference_memory(config, rows, kept_floats=outputs)


ROW_FIELDS = ("patch size", "grid", "tokens", "forward ms", "prediction", "probability")


def _patch_sizes(model: ViT, x: torch.Tensor, settings: dict, progress: Callable[[float], None]) -> dict:
    """The Patches page's comparison of every patch size (vit_explorer.analysis.patch_sizes), on the plans the
    server made: the image's rows (``settings["forward_ms"]``: times measured before, as pairs), then
    the held-out batch's accuracy where ``settings["held_out"]`` names it (images, start)."""
    plan = [PlannedSize(*planned) for planned in settings["plan"]]
    forward_ms = None if settings["forward_ms"] is None else {int(p): ms for p, ms in settings["forward_ms"]}
    share = settings["image_share"]  # of the whole work, for one progress bar over both parts
    rows = predictions(model, x, plan, lambda done, text: progress(share * done), forward_ms)
    arrays = {f"rows.{name}": np.array([row[name] for row in rows]) for name in ROW_FIELDS if name in rows[0]}
    if settings["held_out"] is not None:
        held_out_plan = [PlannedSize(*planned) for planned in settings["held_out_plan"]]
        accuracy = held_out_accuracy(
            model, held_out_set(model.config, *settings["held_out"]), held_out_plan,
            lambda done, text: progress(share + (1 - share) * done),
        )
        arrays.update({"held_out.patch size": np.array(list(accuracy)), "held_out.accuracy": np.array(list(accuracy.values()))})
    return arrays


def _decoded_patch_sizes(arrays: dict) -> tuple:
    """(the rows as predictions() returns them,) and the held-out accuracy by patch size where computed."""
    kinds = {"patch size": int, "grid": str, "tokens": int, "forward ms": float, "prediction": str, "probability": float}
    names = [name for name in ROW_FIELDS if f"rows.{name}" in arrays]
    rows = [
        {name: kinds[name](arrays[f"rows.{name}"][index]) for name in names}
        for index in range(len(arrays["rows.patch size"]))
    ]
    if "held_out.accuracy" not in arrays:
        return (rows,)
    return rows, {int(p): float(a) for p, a in zip(arrays["held_out.patch size"], arrays["held_out.accuracy"])}


def _patch_sizes_memory(config, settings: dict) -> int:
    """The largest pass (the held-out batch, else the image, at the finest patch size) and the
    largest resampled patch kernel, in float32 and float64 while it is resampled."""
    finest = min(planned[0] for planned in settings["plan"])
    batch = settings["held_out"][0] if settings["held_out"] is not None else 1
    largest = max(planned[0] for planned in settings["plan"])
    kernel = 12 * config.in_chans * config.embed_dim * largest**2
    return inference_memory(config.replace(patch_size=finest), batch) + kernel


def _views_memory(config, settings: dict) -> int:
    """The capture's tokens kept, a layer's float32 attention and the drawn one's in float16, the
    rollout's N x N matrices (app.models.view_bytes' count)."""
    tokens = config.num_tokens
    return inference_memory(config, 1, kept_floats=(
        (config.depth + 1) * tokens * config.embed_dim + 2 * config.num_heads * tokens**2 + 8 * tokens**2
    ))


def _class_embeddings(model: ViT, x: torch.Tensor, settings: dict, progress: Callable[[float], None]) -> dict:
    """ImageNet's class embeddings of the open_clip folder ``settings["folder"]`` (its text tower
    beside ``model``, its image tower: text.zero_shot.class_embeddings, open_clip's templates),
    written to ``settings["path"]`` whole, where every server reads them from then on."""
    both = load_image_text_model(settings["folder"], image=model)
    both.text.to(next(model.parameters()).device)
    classes, templates = zero_shot.imagenet_classes(), zero_shot.imagenet_templates()
    embeddings = zero_shot.class_embeddings(both, classes, templates, lambda done, total: progress(done / total))
    zero_shot.save_class_embeddings(Path(settings["path"]), embeddings, classes, templates)
    return {"embeddings": embeddings.numpy()}


def _class_embeddings_memory(config, settings: dict) -> int:
    """The image tower, the folder's weights file read whole while the text tower is made from it,
    the text tower twice (built, then its weights loaded as float32), its tokenizer, one batch of
    prompts through a block (its q, k, v, MLP and scores) and the embeddings kept."""
    context, width, heads = settings["context_length"], settings["width"], settings["heads"]
    block = TEXT_BATCH * context * (12 * width + 2 * heads * context)
    return inference_memory(config, 1) + settings["file_bytes"] + 4 * settings["tokenizer_bytes"] + 4 * (
        2 * settings["text_parameters"] + block + settings["prompts"] * settings["embed_dim"]
    )


def _patching(model: ViT, x: torch.Tensor, settings: dict, progress: Callable[[float], None]) -> dict:
    """The clean and corrupted pictures ``x`` (2, C, H, W) patched (analysis.patching) with the
    metric ``settings["metric"]`` (analysis.patching.metric_from, or two labels' scores) in ``settings["direction"]``:
    exact patching of ``settings["site"]``, or with None attribution patching of every site."""
    runs = paired_runs(model, x[:1], x[1:])
    config = model.config
    names = config.class_names or [str(index) for index in range(config.num_classes)]
    spec = tuple(settings["metric"])
    if spec[0] == "words":  # the labels' embeddings given, the projection read from the folder
        both = load_image_text_model(settings["folder"], image=model)
        metric = zero_shot.score_difference(both, torch.tensor(settings["texts"]), spec[1:])
    else:
        metric = metric_from(spec, names, runs.outputs[0])
    if settings["site"] is None:
        estimates = attribution_patching(model, runs, metric, settings["direction"])
        progress(1.0)
        return {f"values.{site}": values.numpy() for site, values in estimates.items()}
    return {"values": exact_patching(model, runs, metric, settings["site"], settings["direction"], progress).numpy()}


def _decoded_patching(arrays: dict) -> tuple:
    """(the exact map (L, cells),) or (attribution's {site: (L, cells)},)."""
    if "values" in arrays:
        return (torch.from_numpy(arrays["values"]),)
    return ({site: torch.from_numpy(arrays[f"values.{site}"]) for site in SITES},)


def _patching_memory(config, settings: dict) -> int:
    """Both runs' activations at every site kept, and a batch of patched copies (attribution:
    one pass with its graph, counted as that batch)."""
    kept = 2 * len(SITES) * config.depth * config.num_tokens * config.embed_dim
    return inference_memory(config, PATCH_BATCH, kept_floats=kept)


def _passes(config, macs: float) -> float:
    """``macs`` multiply-adds in passes of the model at ``config``'s sizes (model.cost: what the
    server's views count, app.costs)."""
    return macs / cost.pass_cost(config)


KINDS = {
    "head sweep": Kind(
        forwards=lambda config, settings: sweep_cost(config),
        # SWEEP_BATCH copies of one layer's input at a time, the intact tokens of every layer kept.
        memory=lambda config, settings: inference_memory(
            config, SWEEP_BATCH, kept_floats=(config.depth + 1) * config.num_tokens * config.embed_dim,
        ),
        compute=_sweep, decode=_decoded_sweep,
    ),
    # The pass, then every layer's attention again for the rollout and its N x N products.
    "views": Kind(
        forwards=lambda config, settings: _passes(config, cost.pass_cost(config) + cost.rollout_cost(config, kept=False)),
        memory=_views_memory, compute=_views, decode=_decoded_views,
    ),
    # The pass, then every layer's attention again, fused and multiplied in (the Attention page's rollout).
    "rollout": Kind(
        forwards=lambda config, settings: _passes(config, cost.pass_cost(config) + cost.rollout_cost(config, kept=False)),
        memory=lambda config, settings: _layers_memory(config, rollout=True), compute=_rollout, decode=lambda arrays: (torch.from_numpy(arrays["rollout"]),),
    ),
    # The pass, then every layer's attention again, each read for its heads' distance and entropy.
    "head statistics": Kind(
        forwards=lambda config, settings: _passes(config, cost.pass_cost(config) + cost.layers_cost(config, kept=False)),
        memory=lambda config, settings: _layers_memory(config, rollout=False), compute=_head_statistics,
        decode=lambda arrays: ((torch.from_numpy(arrays["distances"]), torch.from_numpy(arrays["entropies"])),),
    ),
    # One pass of settings["images"] images, each one's tokens kept.
    "tokens": Kind(
        forwards=lambda config, settings: _passes(config, cost.pass_cost(config, images=settings["images"])),
        memory=lambda config, settings: inference_memory(
            config, settings["images"], kept_floats=settings["images"] * (config.depth + 1) * config.num_tokens * config.embed_dim,
        ),
        compute=_tokens, decode=_decoded_tokens,
    ),
    # One pass of settings["images"] images, then every layer's attention again and measured, a few
    # images at a time, their tokens kept meanwhile.
    "head types": Kind(
        forwards=lambda config, settings: _passes(config, cost.pass_cost(config, images=settings["images"]) + (
            cost.head_types_cost(config, settings["images"])
        )),
        memory=lambda config, settings: inference_memory(config, settings["images"], kept_floats=(
            settings["images"] * (config.depth + 1) * config.num_tokens * config.embed_dim
            + held_floats(config, settings["images"])
        )),
        compute=_head_types, decode=_decoded_head_types,
    ),
    # The pass of settings["images"] images, then the search over them; their tokens and one
    # layer's MLP activations kept.
    "register neurons": Kind(
        forwards=lambda config, settings: settings["images"] * (1 + SEARCH_PASSES),
        memory=lambda config, settings: inference_memory(config, settings["images"], kept_floats=settings["images"] * (
            (config.depth + 1) * config.num_tokens * config.embed_dim + config.num_tokens * config.mlp_hidden
        )),
        compute=_register_neurons, decode=_decoded_register_neurons,
    ),
    # Every patch size side by side (app.costs plans it and counts its forward passes).
    "patch sizes": Kind(
        forwards=lambda config, settings: settings["forwards"], memory=_patch_sizes_memory,
        compute=_patch_sizes, decode=_decoded_patch_sizes,
    ),
    # settings["prompts"] prompts through the text tower (app.words counts them in image passes).
    "class embeddings": Kind(
        forwards=lambda config, settings: settings["forwards"], memory=_class_embeddings_memory,
        compute=_class_embeddings, decode=lambda arrays: (torch.from_numpy(arrays["embeddings"]),),
    ),
    # The paired runs, then attribution (one forward, one backward) or every cell's pass of one site.
    "patching": Kind(
        forwards=lambda config, settings: (
            ATTRIBUTION_FORWARDS if settings["site"] is None else exact_cost(config, settings["site"])
        ),
        memory=_patching_memory, compute=_patching, decode=_decoded_patching,
    ),
    # The curves' passes (analysis.faithfulness.planned_forwards, counted by the server that asks).
    "faithfulness": Kind(
        forwards=lambda config, settings: settings["forwards"], memory=_faithfulness_memory,
        compute=_faithfulness, decode=lambda arrays: (torch.from_numpy(arrays["outputs"]),),
    ),
}
