"""python -m vit_explorer inspect: a ViT on one image, its attention figures, tensors and head types
written to a folder."""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def add_inspect(subparsers) -> None:
    from ..text.open_vocabulary import METHODS
    from ..training.train import DEFAULT_WEIGHTS

    parser = subparsers.add_parser(
        "inspect", help="write attention figures for an image",
        description="Run a ViT on one image and write its attention figures (PNG, or HTML when"
        " no Chrome/Chromium is found) to a folder, the captured tensors (capture.npz) when"
        " asked with --tensors, every head's type when asked with --head-types, for a CLIP or SigLIP"
        " folder the prediction in words and where each text is when asked with --text, and how true"
        " each map is (deletion and insertion curves) when asked with --faithfulness.",
    )
    parser.add_argument("image", help="image file (PNG, JPEG, WebP, ...)")
    parser.add_argument("--weights", default=str(DEFAULT_WEIGHTS),
                        help="checkpoint: ours, timm, torchvision, or a Hugging Face ViT folder"
                        " (default: the shipped shapes model)")
    parser.add_argument("--out", required=True, help="folder for the figures (and capture.npz)")
    parser.add_argument("--layer", type=int, default=-1,
                        help="layer whose heads are drawn (negative counts from the end; default -1)")
    parser.add_argument("--device", default="auto",
                        help="auto (CUDA when available), cpu, cuda, cuda:1, ...")
    parser.add_argument("--format", choices=("png", "html"), default="png",
                        help="figure files; png needs Chrome/Chromium and falls back to html")
    parser.add_argument("--head-fusion", choices=("mean", "max", "min"), default="mean",
                        help="how attention rollout fuses the heads of a layer")
    parser.add_argument("--discard-ratio", type=float, default=0.0,
                        help="share of the smallest attention weights rollout drops per layer")
    parser.add_argument("--mass", type=float, default=0.6,
                        help="share of each head's attention its mask keeps (DINO; default 0.6)")
    parser.add_argument("--head", type=int,
                        help="also write the 'Inside a layer' figures of --layer for this head (default 0"
                        " when --query is given)")
    parser.add_argument("--query",
                        help="the query token of those figures: cls (the class token) or a patch index,"
                        " row by row (default: cls, or the centre patch without a class token)")
    parser.add_argument("--tensors", nargs="?", const="", metavar="LAYERS",
                        help="also write capture.npz: logits, tokens, patches, rollout, ... and the"
                        " attention (float16) of --layer, of these layers (0,5,11) or of all")
    parser.add_argument("--whole-image", action="store_true",
                        help="read the whole picture squeezed to the model's input size, rather than as its"
                        " publisher evaluates it (timm's crop_pct, open_clip's preprocess_cfg, a Hugging Face"
                        " preprocessor_config.json: usually the shorter side resized and the centre cropped)")
    parser.add_argument("--head-types", nargs="*", metavar="MORE",
                        help="also write every head's type (local, global, positional, prefix or outlier"
                        " sink, content) over the image and these more images, if any (positional heads"
                        " need two or more): head_types.json, head_types.csv and the grid figure; the more"
                        " images cost one pass each, and every layer's attention is computed again")
    parser.add_argument("--text", nargs="*", metavar="TEXT",
                        help="for a CLIP or SigLIP model folder (open_clip's, both towers): the prediction in words"
                        " over these texts (each read as 'a photo of TEXT.'), each text's dense similarity map, the"
                        " relevance map of its score and each patch's best text (the best"
                        f" {MAX_MAPPED_TEXTS} texts' maps); --tensors adds their arrays")
    parser.add_argument("--method", choices=tuple(METHODS), default="maskclip",
                        help="with --text: how each text's dense similarity map reads the patches, each a change of"
                        " the last block re-run from the captured tokens: "
                        + "; ".join(f"{name}: {entry.description}" for name, entry in METHODS.items()) + " (default: maskclip)")
    parser.add_argument("--proxy", metavar="WEIGHTS", default=None,
                        help="with --method proxyclip: the model whose attention CLIP's last block borrows (a DINO:"
                        " a checkpoint or a catalogue name such as dino_vitb16), run on the same pixels")
    parser.add_argument("--faithfulness", nargs="?", const="drop", choices=("drop", "mean"), metavar="MODE",
                        help="also test every map written (the layer's attention, rollout, the attribution, the"
                        " sharpest head's mask, with --text the best text's relevance and similarity) by deletion"
                        " and insertion curves against a random order: faithfulness.png, faithfulness.csv (each"
                        " curve's area and scores) and a sentence in the summary; MODE: drop the patches' tokens"
                        " (default) or paint them with the image's mean. About 100 forward passes' worth of"
                        " tokens (a second on the shipped model, some ten on a ViT-B/16 on a CPU)")
    parser.add_argument("--patch", metavar="CORRUPTED",
                        help="also patch activations between IMAGE (clean) and this corrupted picture: the heat"
                        " maps per layer x token (residual stream, attention and MLP outputs) and per layer x head"
                        " (PNG) and patching.csv, from attribution patching (about 5 passes), with --exact also"
                        " from exact patching (a pass per cell from its layer on)")
    parser.add_argument("--metric",
                        help="with --patch: two classes as \"cat-dog\", the first's logit minus the second's"
                        " (default: the clean picture's prediction minus the corrupted one's; a headless model"
                        " always uses the cosine of the pooled feature to the clean picture's)")
    parser.add_argument("--direction", choices=("denoising", "noising"), default="denoising",
                        help="with --patch: clean into corrupted (default) or corrupted into clean")
    parser.add_argument("--exact", action="store_true", help="with --patch: exact patching of every cell too")
    parser.set_defaults(run=_run_inspect)


MAX_MAPPED_TEXTS = 12  # texts whose maps are drawn (each relevance map costs about three forward passes)


def _run_inspect(args: argparse.Namespace) -> int:
    texts = None if args.text is None else _inspect_texts(args.text, args.weights)  # refused before any load
    if args.method != "maskclip" and texts is None:
        raise ValueError(f"--method {args.method} chooses how the maps of --text are made: give --text too")
    if (args.method == "proxyclip") != (args.proxy is not None):
        raise ValueError("--method proxyclip and --proxy go together: ProxyCLIP borrows the proxy's attention")
    import torch

    writer = _png_writer(Path(args.out)) if args.format == "png" else None  # Chromium starts meanwhile
    threads = torch.get_num_threads()
    if writer is not None:
        # Chromium starts and renders throughout, on a core of its own: torch's threads sharing
        # the rest wait on each other less than a thread per core beside it (2 cores: the capture
        # and the pass over the layers 2-3x slower with two threads than with one).
        torch.set_num_threads(max(1, threads - 1))
    try:
        return _inspect(args, texts, writer)
    finally:
        torch.set_num_threads(threads)
        if writer is not None:
            writer.close_quietly()


def _inspect(args: argparse.Namespace, texts: list[str] | None, writer) -> int:
    """Load, capture the tokens (no layer's attention: each is computed from them as the figures
    need it), draw, and write the figures and, with --tensors, capture.npz."""
    import torch

    from ..analysis.head_types import classify_heads
    from ..data.images import load_image, preprocess
    from ..data.transforms import describe
    from ..model.capture import capture
    from ..training.admission import admit_model
    from ..weights import load_model, resize_model
    from ..weights.footprint import model_footprint
    from ..weights.from_naflex import sequence_size

    device = _inspect_device(args.device)
    admit_model(model_footprint(args.weights), device=device, what="the model of --weights")  # before it is read
    model = load_model(args.weights).to(device)
    picture = load_image(args.image)
    if model.config.max_patches is not None:  # NaFlexViT: the picture at its own aspect ratio, as timm's transform sizes it
        size = sequence_size(picture.height, picture.width, model.config.patch_size, model.config.max_patches)
        model = resize_model(model, image_size=size, share_weights=True).eval()
    config = model.config
    x = preprocess(picture, config, whole=args.whole_image)  # (1, C, H, W): the publisher's input unless --whole-image
    layer = args.layer + config.depth if args.layer < 0 else args.layer
    if not 0 <= layer < config.depth:
        raise ValueError(f"--layer {args.layer} does not exist; the model has layers 0..{config.depth - 1}")
    saved_layers = None if args.tensors is None else _tensor_layers(args.tensors, layer, config.depth)
    inside = _inside_choice(args, config) if args.head is not None or args.query is not None else None
    more = [preprocess(load_image(path), config, whole=args.whole_image) for path in args.head_types or ()]  # refused before any pass

    # The layer's internals, when asked for, come from this same pass.
    captured = capture(model, x, layers=(), internals=None if inside is None else layer)
    figs = _Figures(writer if args.format == "png" else None)
    # What needs no layer's attention is drawn first, so that Chromium renders it during the pass
    # over the layers.
    arrays = _draw_before_the_layers(figs, model, x, captured)
    streamed = _InspectedLayers.of(
        model, captured, args, keep={layer, *(saved_layers or ())}, whole_rollout=saved_layers is not None
    )
    summary, tested = _inspect_figures(figs, arrays, model, x, captured, streamed, layer, inside, args)
    summary = f"{summary}; the model read {describe(picture.size, config, args.whole_image)}"
    score = None
    if texts is not None:
        word_figures, word_arrays, said, word_maps, score = _inspect_words(model, args.weights, x, captured, texts, args.method, args.proxy)
        figs.update(word_figures)
        arrays.update(word_arrays)
        tested.update(word_maps)
        summary = f"{summary}; {said}"
    elif _has_text_tower(args.weights):
        summary = f"{summary}; this model has a text tower: --text \"a cat\" \"a dog\" predicts in words and maps each text"
    types = None
    if args.head_types is not None:
        types = classify_heads(model, [captured] + ([capture(model, torch.cat(more), layers=())] if more else []))
        figs["head_types"] = _head_types_figure(types)
        kinds = ", ".join(f"{number} {label}" for label, number in types.counts().items() if number)
        summary = f"{summary}; heads over {types.images} image{'s' if types.images > 1 else ''}: {kinds}"
    curves = None
    if args.faithfulness is not None:
        curves = _faithfulness(model, x, captured, tested, args.faithfulness, score)
        figs["faithfulness"] = _faithfulness_figure(curves)
        summary = f"{summary}; {_faithfulness_summary(curves)}"
    patched = None
    if args.patch is not None:
        patching_figures, patched, said = _inspect_patching(model, x, args)
        figs.update(patching_figures)
        summary = f"{summary}; {said}"
    written = _write_inspected(figs, Path(args.out), args.format, writer)
    if patched is not None:
        written.append(_write_patching(Path(args.out), patched))
    if curves is not None:
        written.append(_write_faithfulness(Path(args.out), curves))
    if types is not None:
        written += _write_head_types(Path(args.out), types)
    if saved_layers is not None:
        written.append(_write_tensors(Path(args.out), captured, streamed, saved_layers, arrays))
    print(f"{summary}; wrote {len(written)} files to {args.out}:")
    for path in written:
        print(f"  {path}")
    return 0


def _inspect_device(name: str):
    import torch

    device = ("cuda" if torch.cuda.is_available() else "cpu") if name == "auto" else name
    try:
        device = torch.device(device)
    except RuntimeError:
        raise ValueError(f"unknown device {name!r}; use auto, cpu or cuda") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but no CUDA GPU is available")
    return device


def _tensor_layers(text: str, layer: int, depth: int) -> tuple[int, ...]:
    """The layers whose attention capture.npz keeps: --layer's (no value), all, or a list."""
    if text == "":
        return (layer,)
    if text.lower() == "all":
        return tuple(range(depth))
    try:
        chosen = {int(part) + depth if int(part) < 0 else int(part) for part in text.split(",")}
    except ValueError:
        chosen = {-1}
    if not all(0 <= index < depth for index in chosen):
        raise ValueError(f"--tensors {text} is not all or a list of layers 0..{depth - 1} like 0,5")
    return tuple(sorted(chosen))


@dataclass
class _InspectedLayers:
    """What inspect reads of every layer's attention, from one pass over the layers (each computed
    from the captured tokens and dropped once read): the rollout's map of the query drawn,
    distance and entropy per head, and the attention (float16) of the layers ``kept`` (the one
    drawn, those written)."""

    rollout_map: Any  # (gh, gw)
    rollout: Any  # (1, N, N) the whole rollout, for capture.npz only (--tensors); else None
    distance: Any  # (L, H) pixels
    entropy: Any  # (L, H) nats
    kept: dict  # layer -> (1, H, N, N) float16

    @classmethod
    def of(cls, model, captured, args: argparse.Namespace, keep: set[int], whole_rollout: bool) -> _InspectedLayers:
        import torch

        from .. import analysis
        from ..model.capture import layer_attention

        distances, entropies, kept = [], [], {}
        config = model.config
        prefix, (grid_h, grid_w) = captured.num_prefix_tokens, captured.grid_size

        def layers():
            # inspect captures no layer's attention (layers=()): each is computed again here, its
            # heads' entropies from the same scores.
            for index in range(config.depth):
                entropies.append(torch.empty(1, config.num_heads))
                attention = layer_attention(  # (1, H, N, N)
                    model, captured.tokens[:, index], index, captured.grid_size, entropies=entropies[-1],
                )
                distances.append(analysis.head_distances(attention, captured.grid_size, config.patch_size, prefix))
                if index in keep:
                    kept[index] = attention.half()
                yield attention

        query = analysis.map_query(captured, class_token=config.class_token)  # (1, 1, N)
        fusion = dict(head_fusion=args.head_fusion, discard_ratio=args.discard_ratio, num_prefix_tokens=prefix)
        rollout = analysis.streamed_rollout(layers(), **fusion) if whole_rollout else None
        # Without --tensors the row alone: L N^2 instead of the N^3 product (at 518 px as much as the pass).
        row = query @ rollout if whole_rollout else analysis.rollout_rows(layers(), query, **fusion)  # (1, 1, N)
        rollout_map = row[0, 0, prefix:].reshape(grid_h, grid_w)
        return cls(rollout_map, rollout, torch.stack(distances), torch.cat(entropies), kept)


def _draw_before_the_layers(figs: _Figures, model, x, captured) -> dict:
    """The figures of the model and the captured tokens, which need no layer's attention: the
    largest (the position embeddings' similarity, a PNG of (gh*gw)^2 values) first; the arrays
    capture.npz would add (the tokens' norms)."""
    from .. import analysis, figures

    config = model.config
    prefix = captured.num_prefix_tokens
    image = analysis.display_image(x, config)
    if model.pos_embed is not None:  # rotary positions have no embeddings to compare
        figs["position_similarity"] = figures.position_similarity_grid(analysis.position_embedding_similarity(model))
    figs["input_grid"] = figures.image_with_grid(image, captured.grid_size)
    figs["embedding_filters"] = figures.embedding_filters_figure(analysis.embedding_filters(model))
    figs["token_pca"] = figures.token_pca_image(analysis.token_pca(captured.tokens[0, -1, prefix:], captured.grid_size), image)
    norms = analysis.token_norms(captured.tokens[0])  # (L+1, N)
    for block in sorted({config.depth // 2 - 1, config.depth - 1}):
        figs[f"token_norms_layer{block}"] = figures.token_norms_figure(
            norms[block + 1], captured.grid_size, prefix, layer=block,
            class_token=config.class_token, dist_token=config.dist_token,
        )
    return dict(token_norms=norms[None].numpy())


def _inspect_figures(figs: _Figures, arrays: dict, model, x, captured, streamed: _InspectedLayers, layer: int, inside, args: argparse.Namespace):
    """The figures of the layers' attention and the prediction, added to ``figs``, and the arrays
    capture.npz would add to ``arrays``; (the line to print, the maps written by name for --faithfulness: the
    layer's attention (the heads' mean), rollout, the attribution and the sharpest head's mask)."""
    from .. import analysis, figures
    from ..model.internals import activation_name

    config = model.config
    prefix = captured.num_prefix_tokens
    image = analysis.display_image(x, config)
    if captured.pool_attentions is not None:
        # The attention pool's probe reads for the head, as a class token would.
        query, where, name = "attention-pool probe", "the pooling head", "attention_pool_probe"
        maps = analysis.pool_maps(captured)
    else:
        query, where, name = ("class token" if config.class_token else "mean patch query"), layer, f"attention_heads_layer{layer}"
        maps = analysis.query_map(streamed.kept[layer][0], captured.grid_size, prefix, class_token=config.class_token)
    rollout_map = streamed.rollout_map
    figs.update({
        name: figures.attention_heads_grid(image, maps, layer=where, query=query),
        "attention_masks": figures.attention_masks_grid(
            image, analysis.attention_mask_by_mass(maps, args.mass), args.mass, layer=where, query=query,
        ),
        "attention_rollout": figures.attention_overlay(
            image, rollout_map, title=f"Attention rollout ({args.head_fusion} of heads, {query})", value_name="rollout",
        ),
        "mean_attention_distance": figures.layer_head_scatter(streamed.distance, "Mean attention distance per head", "pixels"),
        "attention_entropy": figures.layer_head_heatmap(streamed.entropy, "Attention entropy per head", "nats"),
    })
    from ..analysis.faithfulness import sharpest_mask

    last = "the pool's attention" if captured.pool_attentions is not None else (
        "last layer's attention" if layer == config.depth - 1 else f"layer {layer}'s attention"
    )
    head, mask = sharpest_mask(maps, args.mass)
    tested = {last: maps.float().mean(0), "rollout": rollout_map, f"head {head}'s mask": mask}
    if inside is not None:
        head, token, query_patch = inside
        labels = figures.token_labels(captured.num_tokens, prefix, config.class_token, config.dist_token)
        steps = captured.internals
        inside_figures = {
            **figures.inside_layer_figures(image, steps, captured.grid_size, labels, head, token, query_patch,
                                           activation_name(config)),
            **figures.softmax_scale_figures(image, steps, captured.grid_size, labels, head, token, 1.0, query_patch),
        }
        figs.update({f"inside_layer{layer}_{name}": figure for name, figure in inside_figures.items()})
    if not config.num_classes:
        summary = ("no classifier (num_classes=0), so no prediction, attribution or logit lens;"
                   f" features of {config.embed_dim} dimensions")
        return summary, tested
    relevance = analysis.attribution(model, x)[0]  # (gh, gw) for the predicted class
    tested = {**dict(list(tested.items())[:2]), "attribution": relevance, **dict(list(tested.items())[2:])}
    probabilities = captured.logits[0].softmax(dim=-1)
    class_names = list(config.class_names or [f"class {i}" for i in range(config.num_classes)])
    predicted = class_names[int(probabilities.argmax())]
    figs.update({
        "attribution": figures.attention_overlay(
            image, relevance, title=f"Gradient-weighted attribution for '{predicted}'", value_name="relevance",
        ),
        "logit_lens": figures.logit_lens_figure(analysis.logit_lens(model, captured)[0].softmax(dim=-1), class_names),
        "top5": figures.topk_bar(probabilities, class_names, k=5),
    })
    arrays["attribution"] = relevance[None].numpy()
    top = analysis.top_k(captured.logits[0], class_names, k=1)[0]
    return f"predicted {top[0]} ({top[1]:.1%})", tested


def _has_text_tower(weights: str) -> bool:
    from ..text import is_image_text_folder

    return is_image_text_folder(weights)


def _inspect_texts(given: list[str], weights: str) -> list[str]:
    """The texts of --text, each stripped and kept once, checked (one sentence for none, too many
    or too long), for a model folder that has a text tower (else one sentence)."""
    from ..text.towers import LABEL_TEMPLATE, check_labels

    texts = list(dict.fromkeys(text.strip() for text in given if text.strip()))
    check_labels(texts, LABEL_TEMPLATE)  # each is embedded as a label is
    if not _has_text_tower(weights):
        raise ValueError(
            f"--text needs a model with a text tower (a CLIP or SigLIP folder as open_clip writes it, with"
            f" open_clip_config.json beside its weights); {Path(weights).name} is an image model only"
        )
    return texts


def _inspect_words(model, folder: str, x, captured, texts: list[str], method: str = "maskclip", proxy: str | None = None):
    """(figures, arrays for capture.npz, the line to print, the best text's relevance and
    similarity maps by name, and its score for --faithfulness: the image's cosine with it) of the
    texts: the prediction over them, each one's dense similarity map (by ``method``,
    text.open_vocabulary), the relevance of its score (the best MAX_MAPPED_TEXTS) and each patch's
    best text; ``proxy``: ProxyCLIP's proxy (a checkpoint or a catalogue name)."""
    import numpy as np

    from .. import analysis, figures
    from ..model.capture import capture
    from ..text import load_image_text_model
    from ..text import maps, open_vocabulary, proxyclip, zero_shot
    from ..weights import catalogue, load_model, load_pretrained

    both = load_image_text_model(folder, image=model)
    embedded = both.embed_texts(zero_shot.label_prompts(texts))  # (T, E)
    predicted = zero_shot.predict(both, captured.logits, tuple(texts), embedded)
    borrowed = None
    if proxy is not None:
        proxy_model = (load_pretrained(proxy) if proxy in catalogue.CATALOGUE else load_model(proxy)).to(x.device).eval()
        pixels = proxyclip.proxy_input(x, model.config, proxy_model.config)
        borrowed = proxyclip.Proxy(proxy_model, capture(proxy_model, pixels, layers=()))
    similarities = open_vocabulary.similarity_maps(both, captured, embedded, method, borrowed)[0]
    mapped = predicted.scores.argsort(descending=True)[:MAX_MAPPED_TEXTS].tolist()  # the best first
    names = [texts[index] for index in mapped]
    relevances = {index: maps.relevance(both, x, embedded[index])[0] for index in mapped}  # (gh, gw) each
    image = analysis.display_image(x, model.config)
    how = open_vocabulary.how(both, method)
    figs = {
        "words_top5": figures.zero_shot_bar(predicted.scores, texts, predicted.scoring, k=5),
        "words_similarity": figures.similarity_grid(image, similarities[mapped], names, how),
        **{f"words_relevance_{index + 1}": figures.relevance_overlay(image, relevances[index], texts[index])
           for index in mapped},
    }
    if len(mapped) > 1:
        figs["words_best_text"] = figures.best_prompt_map(image, similarities[mapped], names, how=how)
    arrays = dict(
        text_scores=predicted.scores.numpy(), text_similarity=similarities.numpy(),
        text_relevance=np.stack([relevances[index].numpy() for index in mapped]), text_mapped=np.array(mapped),
    )
    (best, score), = predicted.top(1)
    shown = "" if len(mapped) == len(texts) else f", maps of the best {len(mapped)}"
    label = open_vocabulary.METHODS[method].label
    shown += "" if method == "maskclip" else f", maps by {label}"
    top = mapped[0]
    by = "" if method == "maskclip" else f" ({label})"
    tested = {f"relevance of '{texts[top]}'": relevances[top], f"similarity to '{texts[top]}'{by}": similarities[top]}
    scored = (maps.text_score(both, embedded[top]), f"the cosine with '{texts[top]}'")
    return figs, arrays, f"in words ({predicted.scoring} over {len(texts)} texts{shown}): {best} ({score:.1%})", tested, scored


def _faithfulness(model, x, captured, tested: dict, mode: str, score):
    """Every map's deletion and insertion curves (analysis.faithfulness), the intact pass the
    capture's; ``score``: (the score function, what it is in words) for a text, else the default."""
    from ..analysis.faithfulness import faithfulness_curves

    function, what = score if score is not None else (None, None)
    return faithfulness_curves(model, x, tested, mode=mode, intact=captured.logits[0], score=function, what=what)


def _faithfulness_figure(curves):
    from .. import figures

    return figures.faithfulness_figure(curves.fractions, curves.curves, curves.names, curves.what, curves.percent)


def _faithfulness_summary(curves) -> str:
    """Which map each curve favours, and what removing a tenth of the patches does, in a line."""
    best = {curve: curves.best(curve) for curve in curves.curves}
    favour = ", ".join(f"{curve} favours {'a random order' if name == 'random' else name}" for curve, name in best.items())
    return f"faithfulness ({curves.mode}): {favour}; {curves.reading(0.1).rstrip('.')}"


def _write_faithfulness(out: Path, curves) -> Path:
    """faithfulness.csv: a row per curve and map, its area and its score at each share of the
    patches removed (deletion) or kept (insertion)."""
    import csv

    path = out / "faithfulness.csv"
    fractions = [f"{value:.4f}" for value in curves.fractions.tolist()]
    with open(path, "w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(["curve", "map", "area", *fractions])
        for curve, scores in curves.curves.items():
            for name, area, values in zip(curves.names, curves.area(curve).tolist(), scores.tolist()):
                writer.writerow([curve, name, f"{area:.6f}", *(f"{value:.6f}" for value in values)])
    return path


def _inspect_patching(model, x, args: argparse.Namespace) -> tuple[dict, dict, str]:
    """Activation patching between the image and ``args.patch`` (analysis.patching): the heat maps
    by file name, the maps by (method, site) and a line for the summary."""
    from .. import figures
    from ..analysis import AnalysisError, patching
    from ..data.images import load_image, preprocess

    config = model.config
    names = list(config.class_names or [f"class {index}" for index in range(config.num_classes)])
    if args.metric and not config.num_classes:
        raise AnalysisError("This model has no classes, so its metric is the pooled cosine: leave out --metric.")
    metric = patching.named_difference(args.metric, names) if args.metric else None
    clean, corrupted = load_image(args.image), load_image(args.patch)
    runs = patching.paired_runs(model, x, preprocess(corrupted, config, whole=args.whole_image))
    note = patching.size_note(clean, corrupted, config.img_size)
    if note:
        print(note, file=sys.stderr)
    if not config.num_classes:
        metric = patching.pooled_cosine(runs.outputs[0])
    elif metric is None:
        first, second = runs.outputs[0].topk(min(2, config.num_classes)).indices.tolist() + [0] * (2 - min(2, config.num_classes))
        corrupted_top = int(runs.outputs[1].argmax())
        metric = patching.class_difference(first, corrupted_top if corrupted_top != first else second, names)
    maps = {("attribution", site): values for site, values in patching.attribution_patching(model, runs, metric, args.direction).items()}
    if args.exact:
        for site in patching.SITES:
            maps[("exact", site)] = patching.exact_patching(model, runs, metric, site, args.direction)
    tokens = runs.activations[("resid", 0)].shape[1]
    figs = {}
    for (method, site), values in maps.items():
        cell = "head" if site == "head" else "token"
        figs[f"patching_{method}_{site}"] = figures.patching_heatmap(
            values, cell, f"{method.capitalize()}: {patching.SITES[site]} per layer x {cell} ({args.direction}, {metric.name})",
            None if site == "head" else [str(token) for token in range(tokens)],
        )
        if method == "exact":
            figs[f"patching_agreement_{site}"] = figures.patching_agreement(
                values, maps[("attribution", site)], patching.SITES[site], patching.agreement(values, maps[("attribution", site)]),
            )
    method = "exact" if args.exact else "attribution"
    untouched = 0.0 if args.direction == "denoising" else 1.0
    heads = maps[(method, "head")]
    layer, head = divmod(int((heads - untouched).abs().argmax()), config.num_heads)
    said = f"patching ({metric.name}, {args.direction}, {method}): the largest head is head {head} of layer {layer}"
    if args.exact:
        correlation = patching.agreement(maps[("exact", "resid")], maps[("attribution", "resid")])
        said = f"{said}; attribution against exact on the residual stream: correlation {correlation:.2f}"
    return figs, maps, said


def _write_patching(out: Path, maps: dict) -> Path:
    """patching.csv: a row per method, site, layer and cell (token or head), its normalised value."""
    import csv

    path = out / "patching.csv"
    with open(path, "w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(["method", "site", "layer", "cell", "value"])
        for (method, site), values in maps.items():
            for layer, row in enumerate(values.tolist()):
                writer.writerows([method, site, layer, cell, f"{value:.6f}"] for cell, value in enumerate(row))
    return path


def _png_writer(out: Path):
    """Chromium started now for the PNG files, while the model loads and the figures are drawn;
    None without a browser (the figures are then written as HTML)."""
    from .. import figures

    if figures.find_browser() is None:
        return None
    try:
        return figures.PngWriter(out)
    except figures.FigureExportError:
        return None


class _Figures(dict):
    """The figures by file name; each is handed to the PNG ``writer`` (when there is one) as soon
    as it is drawn, so that Chromium renders while the rest is computed."""

    def __init__(self, writer):
        super().__init__()
        self.writer = writer

    def __setitem__(self, name: str, fig) -> None:
        super().__setitem__(name, fig)
        if self.writer is not None:
            self.writer.write(name, fig)

    def update(self, figs: dict) -> None:
        for name, fig in figs.items():
            self[name] = fig


def _write_inspected(figs: _Figures, out: Path, image_format: str, writer) -> list[Path]:
    """The figures written to ``out`` as PNG (handed to ``writer``, started earlier, as they were
    drawn), or as HTML without a browser or when export fails."""
    from .. import figures

    out.mkdir(parents=True, exist_ok=True)
    if image_format == "png" and writer is None:
        print("no Chrome/Chromium found (install chromium or set BROWSER_PATH);"
              " writing HTML figures instead", file=sys.stderr)
        image_format = "html"
    if image_format != "png":
        return list(figures.write_figures(figs, out, image_format))
    try:
        return writer.close()
    except figures.FigureExportError as error:
        print(f"{error}; writing HTML figures instead", file=sys.stderr)
        return list(figures.write_figures(figs, out, "html"))


def _head_types_figure(types):
    from .. import figures
    from ..analysis.head_types import LABELS, MEASURES

    return figures.head_types_grid(
        types.labels, {column: getattr(types, name) for name, column in MEASURES}, LABELS,
        title=f"Every head's type over {types.images} image{'s' if types.images > 1 else ''}"
        " (rules and measures: head_types.json)",
    )


def _write_head_types(out: Path, types) -> list[Path]:
    """head_types.json (numbers, labels, the rules with their thresholds, the definitions) and
    head_types.csv (a row per head)."""
    import csv
    import json

    written = [out / "head_types.json", out / "head_types.csv"]
    written[0].write_text(json.dumps(types.to_dict(), indent=1))
    rows = types.rows()
    with open(written[1], "w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return written


def _write_tensors(out: Path, captured, streamed: _InspectedLayers, layers: tuple[int, ...], arrays: dict) -> Path:
    """capture.npz: the capture's tensors, the rollout, and the attention of ``layers`` only, in
    float16 (1, len(layers), H, N, N), uncompressed: float weights hardly compress, and zlib took
    most of inspect's time (29 s of 48 for every layer of a DINOv2 at 518 px)."""
    import numpy as np
    import torch

    if captured.pool_attentions is not None:
        arrays["pool_attentions"] = captured.pool_attentions.numpy()
    npz = out / "capture.npz"
    np.savez(
        npz, logits=captured.logits.numpy(), tokens=captured.tokens.numpy(), patches=captured.patches.numpy(),
        patch_embeddings=captured.patch_embeddings.numpy(), grid_size=np.array(captured.grid_size),
        num_prefix_tokens=np.array(captured.num_prefix_tokens), rollout=streamed.rollout.numpy(),
        attentions=torch.stack([streamed.kept[layer] for layer in layers], dim=1).numpy(),
        attention_layers=np.array(layers), **arrays,
    )
    return npz


def _inside_choice(args: argparse.Namespace, config) -> tuple[int, int, int | None]:
    """(head, token index, query patch or None) from --head and --query, or a one-sentence error."""
    head = 0 if args.head is None else args.head
    if not 0 <= head < config.num_heads:
        raise ValueError(f"--head {args.head} does not exist; the model has heads 0..{config.num_heads - 1}")
    grid_h, grid_w = config.grid_size
    query = args.query
    if query is None:
        query = "cls" if config.class_token else str((grid_h // 2) * grid_w + grid_w // 2)
    if query.lower() in ("cls", "class"):
        if not config.class_token:
            raise ValueError("--query cls: this model has no class token; give a patch index")
        return head, 0, None
    if not query.isdigit() or int(query) >= grid_h * grid_w:
        raise ValueError(
            f"--query {args.query} is neither cls nor a patch index 0..{grid_h * grid_w - 1}"
            f" ({grid_h}x{grid_w} grid, row by row)"
        )
    return head, config.num_prefix_tokens + int(query), int(query)

