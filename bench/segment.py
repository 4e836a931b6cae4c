"""Segmentation by words, measured: the mIoU of open-vocabulary methods on a labelled folder, side
by side, with the passes of the image tower each picture cost.

    python -m bench.segment --weights MODEL --folder images/ --masks masks/ --classes classes.txt \
        --method maskclip [--method naclip ...] [--whole] [--short-side 336] [--threshold 0.1] \
        [--area-threshold 0.1] [--logit-scale 40] [--pamr] [--templates openai|simple|plain] [--limit N]

MODEL is a CLIP or SigLIP folder (open_clip's or Hugging Face's). The classes file is the papers'
(configs/cls_voc21.txt of SCLIP and NACLIP): line i names class i, synonyms separated by commas;
masks are PNGs of class indices named as their pictures, 255 unlabelled (VOC's SegmentationClass).
The protocol is vit_explorer.text.segmentation's and is printed before the table: by default the
pictures' shorter side is brought to the model's input and read in windows half a window apart
(one pass for a square picture at the input's size); --short-side 336 is the papers' (SCLIP's
slide 224/112, with --area-threshold 0.1 --logit-scale 65 on VOC21), --whole --short-side 336 NACLIP's on VOC (the whole picture at its aspect ratio);
--threshold 0.1 is their background rule on VOC21 and Context60. Each name is embedded with
OpenAI's 80 ImageNet templates and averaged, as the papers do.

Passes are counted, not timed: the image tower's blocks run for a picture divided by its depth
(the goal: at most 3 a picture a method at 224 px). mIoU is mmseg's IoUMetric: intersections and
unions summed over the folder, a class absent from both truth and prediction left out.
"""
from __future__ import annotations

import argparse
import contextlib
import sys
from dataclasses import replace

import numpy as np
import torch
from tqdm import tqdm

from vit_explorer.analysis import segmentation as scores
from vit_explorer.data.labelled_folder import LabelledFolder, read_classes, read_labelled_folder
from vit_explorer.model.vit import Block
from vit_explorer.text import ImageTextModel, load_image_text_model
from vit_explorer.text import open_vocabulary
from vit_explorer.text import segmentation
from vit_explorer.text.segmentation import TEMPLATES, Protocol, Result, templates
from vit_explorer.text.zero_shot import class_embeddings
from vit_explorer.weights import catalogue, load_model, load_pretrained

@contextlib.contextmanager
def counted_blocks():
    """A counter of the transformer blocks run while inside, of any ViT (a picture's resized copy
    of the tower, a proxy's too), each image of a batch counted: a hook of this process only."""
    count = [0]

    def hook(module, args):
        if isinstance(module, Block):
            count[0] += args[0].shape[0]

    handle = torch.nn.modules.module.register_module_forward_pre_hook(hook)
    try:
        yield count
    finally:
        handle.remove()


def measure(model: ImageTextModel, folder: LabelledFolder, texts: torch.Tensor, protocols: list[Protocol],
            progress: bool = True, proxy=None) -> list[Result]:
    """text.segmentation.measure with a progress bar, each protocol's passes counted (the blocks
    run, a proxy's too, over the image tower's depth) rather than the windows planned."""
    depth = len(model.image.blocks)
    blocks = [0] * len(protocols)
    with tqdm(total=len(folder) * len(protocols), disable=not progress, unit="segmentation", file=sys.stderr) as bar, \
            counted_blocks() as ran:
        seen = [0]

        def step(number: int) -> None:
            blocks[number] += ran[0] - seen[0]
            seen[0] = ran[0]
            bar.update()

        results = segmentation.measure(model, folder, texts, protocols, proxy, step)
    return [replace(result, passes=count / depth / len(folder)) for result, count in zip(results, blocks)]


def table(results: list[Result], classes) -> str:
    """Per-class IoU (%) of each method side by side, then the mIoU and the passes a picture."""
    names = [names[0][:24] for names in classes.classes]
    width = max(12, *(len(result.protocol.method) + 2 for result in results))
    lines = ["class".ljust(26) + "".join(result.protocol.method.rjust(width) for result in results)]
    ious = [scores.iou_per_class(result.counts) for result in results]
    for index, name in enumerate(names):
        cells = ["-" if np.isnan(iou[index]) else f"{100 * iou[index]:.1f}" for iou in ious]
        lines.append(f"{index:>3} {name:<22}" + "".join(cell.rjust(width) for cell in cells))
    lines.append("mIoU".ljust(26) + "".join(f"{100 * result.mean_iou:.2f}".rjust(width) for result in results))
    lines.append("passes/picture".ljust(26) + "".join(f"{result.passes:.2f}".rjust(width) for result in results))
    return "\n".join(lines)


def arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.segment", description=__doc__.split("\n\n")[0])
    parser.add_argument("--weights", required=True, help="a CLIP or SigLIP folder (open_clip's or Hugging Face's)")
    parser.add_argument("--folder", required=True, help="the pictures")
    parser.add_argument("--masks", required=True, help="a PNG of class indices per picture, same name, 255 unlabelled")
    parser.add_argument("--classes", required=True, help="line i names class i, synonyms separated by commas")
    parser.add_argument("--method", action="append", choices=list(open_vocabulary.METHODS),
                        help="an open-vocabulary method; repeat for several (default: maskclip)")
    parser.add_argument("--proxy", default=None, help="ProxyCLIP's proxy: a checkpoint or a catalogue name (a DINO:"
                        " dino_vitb16, dinov2_vits14_reg, ...), run on the same pixels as the CLIP")
    parser.add_argument("--whole", action="store_true", help="one pass a picture instead of sliding windows: at its aspect"
                        " ratio with --short-side (NACLIP on VOC), else squeezed to the model's input")
    parser.add_argument("--short-side", type=int, default=None, help="the shorter side the picture is resized to (the papers:"
                        " 336; default the model's input)")
    parser.add_argument("--threshold", type=float, default=0.0, help="class 0 where the best class's probability is below this (the papers: 0.1 on VOC21)")
    parser.add_argument("--area-threshold", type=float, default=None, help="zero a class over at most this share of a"
                        " picture's foreground first (SCLIP on VOC21: 0.1)")
    parser.add_argument("--logit-scale", type=float, default=scores.LOGIT_SCALE)
    parser.add_argument("--pamr", action="store_true", help="refine with PAMR (10 steps, dilations 8 and 16)")
    parser.add_argument("--templates", choices=list(TEMPLATES), default="openai")
    parser.add_argument("--limit", type=int, default=None, help="only the first N pictures")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = arguments(argv)
    try:
        if args.short_side is not None and not 16 <= args.short_side <= 4096:
            raise ValueError(f"--short-side {args.short_side} is not between 16 and 4096 pixels")
        if not 0 <= args.threshold <= 1:
            raise ValueError(f"--threshold {args.threshold} is not a probability between 0 and 1")
        if args.area_threshold is not None and not 0 <= args.area_threshold < 1:
            raise ValueError(f"--area-threshold {args.area_threshold} is not a share between 0 and 1")
        classes = read_classes(args.classes)
        folder = read_labelled_folder(args.folder, args.masks, classes)
        if args.limit:
            folder = LabelledFolder(folder.images[:args.limit], folder.masks[:args.limit], folder.sizes[:args.limit], classes)
        methods = list(dict.fromkeys(args.method or ["maskclip"]))
        if any(open_vocabulary.METHODS[method].needs_proxy for method in methods) and args.proxy is None:
            raise ValueError("ProxyCLIP borrows another model's attention: name it with --proxy (a DINO)")
        model = load_image_text_model(args.weights)
        proxy = None
        if args.proxy is not None:
            proxy = (load_pretrained(args.proxy) if args.proxy in catalogue.CATALOGUE else load_model(args.proxy)).eval()
        protocols = [
            Protocol(method, slide=not args.whole, short_side=args.short_side, logit_scale=args.logit_scale,
                     threshold=args.threshold, area_threshold=args.area_threshold, pamr=args.pamr)
            for method in methods
        ]
        input_size = tuple(model.image.config.img_size)
        print(f"{len(folder)} pictures, {len(classes)} classes ({len(classes.names)} names), each name embedded with {TEMPLATES[args.templates]}")
        for protocol in protocols:
            print("protocol", protocol.describe(input_size))
        print("classes: " + "; ".join(f"{index} {', '.join(names)}" for index, names in enumerate(classes.classes)))
        texts = class_embeddings(model, classes.names, templates(args.templates))
        results = measure(model, folder, texts, protocols, proxy=proxy)
    except (ValueError, OSError) as error:  # every refusal of ours is a sentence (DatasetError, AnalysisError, ...)
        print(f"bench.segment: {error}", file=sys.stderr)
        return 2
    print(table(results, classes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
