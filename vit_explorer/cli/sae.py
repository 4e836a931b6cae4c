"""python -m vit_explorer sae: train a sparse autoencoder on one layer's tokens over an image set, with
a progress bar; under torchrun data-parallel. Writes the dictionary (with its card) and the index
of each latent's top patches."""
from __future__ import annotations

import argparse


def add_sae(subparsers) -> None:
    from ..features.train import SAETrainConfig

    defaults = SAETrainConfig(weights="default", layer=0)
    parser = subparsers.add_parser(
        "sae", help="train a sparse autoencoder on one layer's tokens",
        description="Train a TopK sparse autoencoder on the tokens leaving one layer of a ViT over an"
        " image set, and write OUT/<name>.safetensors (the dictionary and its card: model, layer, images,"
        " settings, final metrics) and OUT/<name>.index.npz (each latent's top-activating patches)."
        " Under `torchrun --nproc_per_node=N` each process captures its share of the images."
        " Ctrl-C stops after the current step and still writes both files.",
    )
    parser.add_argument("--weights", default="default",
                        help="checkpoint: ours, timm, torchvision or a Hugging Face folder, or pretrained:NAME (a"
                        " catalogue model, downloaded once); default: the shipped shapes model")
    parser.add_argument("--layer", type=int, required=True, help="the layer whose output tokens it reads (0-based)")
    parser.add_argument("--dataset", default=defaults.dataset,
                        help="shapes, photos (the bundled photos), cifar10, mnist, fashionmnist, or folder:PATH")
    parser.add_argument("--images", type=int, default=defaults.images, help=f"images (default {defaults.images})")
    parser.add_argument("--image-size", type=int, help="image side in pixels (default: the model's)")
    parser.add_argument("--prefix-tokens", action="store_true", help="read the class token and registers too")
    parser.add_argument("--expansion", type=int, default=defaults.expansion,
                        help=f"latents per token dimension (default {defaults.expansion})")
    parser.add_argument("--k", type=int, default=defaults.k, help=f"active latents per token (default {defaults.k})")
    parser.add_argument("--epochs", type=int, default=defaults.epochs)
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size, help="tokens per step")
    parser.add_argument("--lr", type=float, default=defaults.lr)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--device", default="auto", help="auto (cuda, then mps, then cpu), cpu, cuda, mps")
    parser.add_argument("--out", default=defaults.out_dir, help="folder for the files (default runs)")
    parser.add_argument("--name", help="file name without extension (default sae_<model>_layer<L>)")
    parser.set_defaults(run=run_sae)


def run_sae(args: argparse.Namespace) -> int:
    import os
    import signal
    import threading

    from tqdm import tqdm

    from ..features.train import SAECaptureEvent, SAEDoneEvent, SAEStepEvent, SAETrainConfig, train_sae

    config = SAETrainConfig(
        weights=args.weights, layer=args.layer, dataset=args.dataset, images=args.images,
        image_size=args.image_size, prefix_tokens=args.prefix_tokens, expansion=args.expansion, k=args.k,
        epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, seed=args.seed, device=args.device,
        out_dir=args.out, name=args.name,
    )
    show = int(os.environ.get("RANK", "0")) == 0  # under torchrun only rank 0 reports
    stop = threading.Event()
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is threading.main_thread():
        # The first Ctrl-C ends training after the current step, files included; a second interrupts.
        signal.signal(signal.SIGINT, lambda signum, frame: (stop.set(), signal.signal(signal.SIGINT, previous)))
    bar = None
    try:
        for event in train_sae(config, stop=stop):
            if not show:
                continue
            if isinstance(event, SAECaptureEvent):  # before the first step: the images whose tokens are read
                if bar is None:
                    bar = tqdm(total=event.total_images, unit="image", desc=f"capturing layer {config.layer}")
                bar.update(event.images - bar.n)
            elif isinstance(event, SAEStepEvent):
                if bar is not None and bar.unit == "image":
                    bar.close()
                    bar = None
                if bar is None:
                    bar = tqdm(total=event.total_steps, unit="step", desc="sae")
                bar.update(event.step - bar.n)
                bar.set_postfix(ev=f"{event.explained_variance:.3f}", l0=f"{event.l0:.1f}",
                                dead=f"{event.dead_share:.1%}")
            elif isinstance(event, SAEDoneEvent):
                if bar is not None:
                    bar.close()
                    bar = None
                metrics = event.metrics
                tqdm.write(
                    f"trained in {event.seconds:.1f} s: explained variance (held-out, {metrics['held_out_tokens']:,}"
                    f" tokens) {metrics['explained_variance']:.3f}, L0 {metrics['l0']:.1f},"
                    f" dead latents {metrics['dead_share']:.1%};"
                    f" dictionary {event.path}, index {event.index_path}"
                )
    finally:
        if bar is not None:
            bar.close()
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, previous)
    return 0
