"""Command line: python -m vit_explorer train | evaluate | inspect."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _add_train(subparsers) -> None:
    parser = subparsers.add_parser("train", help="train a ViT and write a checkpoint")
    parser.set_defaults(run=_run_train)


def _run_train(args: argparse.Namespace) -> int:
    raise NotImplementedError


def _add_evaluate(subparsers) -> None:
    parser = subparsers.add_parser("evaluate", help="print a checkpoint's test accuracy")
    parser.set_defaults(run=_run_evaluate)


def _run_evaluate(args: argparse.Namespace) -> int:
    raise NotImplementedError


def _add_inspect(subparsers) -> None:
    parser = subparsers.add_parser(
        "inspect", help="write attention figures for an image",
        description="Run a ViT on one image and write its attention figures (PNG, or HTML when"
        " no Chrome/Chromium is found) and the captured tensors (capture.npz) to a folder.",
    )
    parser.add_argument("image", help="image file (PNG, JPEG, WebP, ...)")
    parser.add_argument("--weights", required=True,
                        help="checkpoint: ours, timm, torchvision, or a Hugging Face ViT folder")
    parser.add_argument("--out", required=True, help="folder for the figures and capture.npz")
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
    parser.set_defaults(run=_run_inspect)


def _run_inspect(args: argparse.Namespace) -> int:
    import numpy as np
    import torch

    from . import analysis, figures
    from .capture import capture
    from .images import load_image, preprocess
    from .weights import load_model

    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    try:
        device = torch.device(device)
    except RuntimeError:
        raise ValueError(f"unknown device {args.device!r}; use auto, cpu or cuda") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but no CUDA GPU is available")
    model = load_model(args.weights).to(device)
    config = model.config
    x = preprocess(load_image(args.image), config)  # (1, C, H, W)
    layer = args.layer + config.depth if args.layer < 0 else args.layer
    if not 0 <= layer < config.depth:
        raise ValueError(f"--layer {args.layer} does not exist; the model has layers 0..{config.depth - 1}")

    captured = capture(model, x)
    prefix = captured.num_prefix_tokens
    rollout = analysis.attention_rollout(
        captured.attentions, args.head_fusion, args.discard_ratio, num_prefix_tokens=prefix
    )  # (1, N, N)
    rollout_map = analysis.query_map(rollout, captured.grid_size, prefix,
                                     class_token=config.class_token)[0]
    relevance = analysis.attribution(model, x)[0]  # (gh, gw) for the predicted class
    probabilities = captured.logits[0].softmax(dim=-1)
    class_names = list(config.class_names or [f"class {i}" for i in range(config.num_classes)])
    predicted = class_names[int(probabilities.argmax())]
    image = analysis.display_image(x, config)
    query = "class token" if config.class_token else "mean patch query"
    figs = {
        "input_grid": figures.image_with_grid(image, captured.grid_size),
        f"attention_heads_layer{layer}": figures.attention_heads_grid(
            image, analysis.head_maps(captured, layer, class_token=config.class_token),
            layer=layer, query=query,
        ),
        "attention_rollout": figures.attention_overlay(
            image, rollout_map, title=f"Attention rollout ({args.head_fusion} of heads, {query})",
            value_name="rollout",
        ),
        "attribution": figures.attention_overlay(
            image, relevance, title=f"Gradient-weighted attribution for '{predicted}'",
            value_name="relevance",
        ),
        "mean_attention_distance": figures.layer_head_scatter(
            analysis.mean_attention_distance(captured.attentions, captured.grid_size,
                                             config.patch_size, prefix),
            "Mean attention distance per head", "pixels",
        ),
        "attention_entropy": figures.layer_head_heatmap(
            analysis.attention_entropy(captured.attentions)[0], "Attention entropy per head",
            "nats",
        ),
        "position_similarity": figures.position_similarity_grid(
            analysis.position_embedding_similarity(model)
        ),
        "embedding_filters": figures.embedding_filters_figure(analysis.embedding_filters(model)),
        "token_pca": figures.token_pca_image(
            analysis.token_pca(captured.tokens[0, -1, prefix:], captured.grid_size), image
        ),
        "logit_lens": figures.logit_lens_figure(
            analysis.logit_lens(model, captured)[0].softmax(dim=-1), class_names
        ),
        "top5": figures.topk_bar(probabilities, class_names, k=5),
    }

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    image_format = args.format
    if image_format == "png" and figures.find_browser() is None:
        print("no Chrome/Chromium found (install chromium or set BROWSER_PATH);"
              " writing HTML figures instead", file=sys.stderr)
        image_format = "html"
    try:
        written = figures.write_figures(figs, out, image_format)
    except figures.FigureExportError as error:
        print(f"{error}; writing HTML figures instead", file=sys.stderr)
        written = figures.write_figures(figs, out, "html")
    npz = out / "capture.npz"
    np.savez_compressed(
        npz,
        logits=captured.logits.numpy(), attentions=captured.attentions.numpy(),
        tokens=captured.tokens.numpy(), patches=captured.patches.numpy(),
        patch_embeddings=captured.patch_embeddings.numpy(),
        grid_size=np.array(captured.grid_size), num_prefix_tokens=np.array(prefix),
        rollout=rollout.numpy(), attribution=relevance[None].numpy(),
    )
    top = analysis.top_k(captured.logits[0], class_names, k=1)[0]
    print(f"predicted {top[0]} ({top[1]:.1%}); wrote {len(written) + 1} files to {out}:")
    for path in [*written, npz]:
        print(f"  {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m vit_explorer", description="Train, evaluate and inspect Vision Transformers."
    )
    subparsers = parser.add_subparsers(dest="command", required=True)
    _add_train(subparsers)
    _add_evaluate(subparsers)
    _add_inspect(subparsers)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, OSError) as error:
        # Bad input (a missing file, an unreadable image or checkpoint) is one clear sentence.
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
