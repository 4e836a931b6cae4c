"""python -m vit_explorer sae: train a sparse autoencoder on one layer's tokens over an image set, with
a progress bar; under torchrun data-parallel. Writes the dictionary (with its card) and the index
of each latent's top patches. ``--evaluate FILE`` measures a dictionary as the field does
(features.evaluation), ``--stability A B`` matches two dictionaries' latents (features.stability)."""
from __future__ import annotations

import argparse


def add_sae(subparsers) -> None:
    from ..features.sae import ACTIVATIONS
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
    parser.add_argument("--layer", type=int, help="the layer whose output tokens it reads (0-based); required to train")
    parser.add_argument("--dataset", default=defaults.dataset,
                        help="shapes, photos (the bundled photos), cifar10, mnist, fashionmnist, or folder:PATH")
    parser.add_argument("--images", type=int, help=f"images (default {defaults.images}; to evaluate,"
                        f" {defaults.evaluation_images})")
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
    parser.add_argument("--activation", choices=ACTIVATIONS, default=defaults.activation,
                        help="topk: k latents per token; batchtopk: k per token on average over a batch, a"
                        " threshold at inference (Bussmann et al. 2024)")
    parser.add_argument("--matryoshka", type=int, default=defaults.matryoshka, metavar="N",
                        help="N nested dictionaries (widths F/2^(N-1), ..., F/2, F), each trained to reconstruct"
                        " alone (Bussmann et al. 2025); default 1: none")
    parser.add_argument("--evaluate", metavar="FILE",
                        help="measure the dictionary FILE instead of training: NMSE, L0, dead and dense latents, and"
                        " the model with its reconstruction spliced in (--weights: its model, default the card's;"
                        " --images: how many held-out images)")
    parser.add_argument("--write-card", action="store_true",
                        help="with --evaluate: also write the numbers on the dictionary's card")
    parser.add_argument("--stability", nargs=2, metavar=("A", "B"),
                        help="the share of A's latents matched one to one (Hungarian) to one of B's at cosine >= 0.9")
    parser.set_defaults(run=run_sae)


def run_sae(args: argparse.Namespace) -> int:
    if args.evaluate is not None:
        return evaluate_sae(args)
    if args.stability is not None:
        return stability(args)
    if args.layer is None:
        raise ValueError("training a dictionary needs --layer (the layer whose tokens it reads)")
    return train(args)


def train(args: argparse.Namespace) -> int:
    import os
    import signal
    import threading

    from tqdm import tqdm

    from ..features.train import SAECaptureEvent, SAEDoneEvent, SAEStepEvent, SAETrainConfig, train_sae

    defaults = SAETrainConfig(weights="default", layer=0)

    config = SAETrainConfig(
        weights=args.weights, layer=args.layer, dataset=args.dataset, images=args.images or defaults.images,
        image_size=args.image_size, prefix_tokens=args.prefix_tokens, expansion=args.expansion, k=args.k,
        epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, seed=args.seed, device=args.device,
        out_dir=args.out, name=args.name, activation=args.activation, matryoshka=args.matryoshka,
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


def _model_and_images(path: str, args: argparse.Namespace):
    """(the model of the dictionary at ``path``, its card, the held-out images to measure it on):
    --weights, or the checkpoint its card names, refused in a sentence unless its digest is the card's."""
    from pathlib import Path

    from ..features.evaluation import held_out
    from ..features.sae import SAEError, read_card
    from ..features.tokens import ImageSource
    from ..features.train import SAETrainConfig, model_identity
    from ..weights import load_model, load_pretrained

    if not Path(path).exists():
        raise SAEError(f"there is no file {path}")
    _, card = read_card(path)
    if "images" not in card or "layer" not in card:
        raise SAEError("this SAE file's card lacks its layer or image set, which every run writes")
    named = card.get("model", {})
    weights = named["path"] if args.weights == "default" and "path" in named else args.weights
    config = SAETrainConfig(weights=weights, layer=card["layer"])
    if not config.weights_path.exists():
        raise SAEError(f"the model this dictionary was trained on ({named.get('name', '?')}) is not where its card"
                       " says: pass its checkpoint with --weights")
    if model_identity(config.weights_path)["digest"] != named.get("digest"):
        raise SAEError("this dictionary was trained on another model than --weights (their digests differ)")
    model = load_model(config.weights_path) if config.pretrained is None else load_pretrained(config.pretrained)
    trained_on = ImageSource.from_dict(card["images"])
    return model, card, trained_on, held_out(trained_on, args.images or config.evaluation_images)


def evaluate_sae(args: argparse.Namespace) -> int:
    """Print the dictionary's evaluation on held-out images (features.evaluation.held_out)."""
    from pathlib import Path

    from tqdm import tqdm

    from ..features.evaluation import evaluate, write_evaluation
    from ..features.sae import load_sae

    model, card, trained_on, source = _model_and_images(args.evaluate, args)
    sae, card = load_sae(args.evaluate, model)
    with tqdm(total=len(source), unit="image", desc="evaluate") as bar:
        result = evaluate(sae, model, source, card["layer"], bool(card.get("prefix_tokens", False)),
                          progress=lambda done, total: bar.update(done - bar.n))
    which = "held-out" if source.seed != trained_on.seed else "training"
    print(f"{Path(args.evaluate).name}, layer {card['layer']}, {len(source):,} {which} {source.dataset} images:"
          f" {result.summary()}")
    if args.write_card:
        write_evaluation(args.evaluate, result, source)
        print("written on its card")
    return 0


def stability(args: argparse.Namespace) -> int:
    """Print how many latents two dictionaries of one layer share (features.stability), and of the
    first one's firings on held-out tokens."""
    import numpy as np
    import torch

    from ..features.sae import SAEError, load_sae
    from ..features.stability import MATCHED
    from ..features.stability import stability as matched
    from ..features.tokens import source_tokens

    model, card, _, source = _model_and_images(args.stability[0], args)
    (first, _), (second, other) = (load_sae(path, model) for path in args.stability)
    if other.get("layer") != card["layer"] or other.get("model", {}).get("digest") != card["model"].get("digest"):
        raise SAEError("these dictionaries read different layers or models: their latents are not comparable")
    prefix_tokens = bool(card.get("prefix_tokens", False))
    tokens = source_tokens(model, source, torch.arange(len(source)), card["layer"], prefix_tokens, 64, "cpu")
    found = matched(first, second, tokens)
    print(f"stability: {100 * found.share:.1f}% of {len(found.cosines):,} latents have a partner at cosine >= {MATCHED}"
          f" (median matched cosine {float(np.median(found.cosines)):.3f}); they carry {100 * found.used_share:.1f}% of"
          f" the first one's firings on {len(source):,} held-out {source.dataset} images")
    return 0
