"""python -m vit_explorer train | evaluate: train a ViT (one process or under torchrun), test a checkpoint."""
from __future__ import annotations

import argparse
from pathlib import Path


def _patch_sizes(text: str) -> tuple[int, ...] | None:
    """--patch-sizes 4,8,16 -> (4, 8, 16); argparse shows a bad list as a usage error."""
    from ..model.config import parse_patch_sizes

    try:
        return parse_patch_sizes(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def add_train(subparsers) -> None:
    from ..model.config import POSITIONS, PRESETS, TrainConfig

    defaults = TrainConfig()
    parser = subparsers.add_parser(
        "train", help="train a ViT and write a checkpoint",
        description="Train a ViT and write DIR/<name>.safetensors with a .json history beside it."
        " Under `torchrun --nproc_per_node=N` it trains data-parallel. Ctrl-C stops after the"
        " current step and still writes the checkpoint (continue with --resume).",
    )
    parser.add_argument("--dataset", default=defaults.dataset,
                        help="shapes (built in), cifar10, mnist, fashionmnist, or folder:PATH"
                        " (a folder of class sub-folders); default shapes")
    parser.add_argument("--preset", default="tiny", choices=sorted(PRESETS), help="model size (default tiny)")
    for flag, help_text in (
        ("--patch-size", "patch size in pixels"), ("--embed-dim", "token width"),
        ("--depth", "number of blocks"), ("--heads", "attention heads"),
        ("--image-size", "image size (default: the dataset's)"),
    ):
        parser.add_argument(flag, type=int, help=f"{help_text}; overrides the preset")
    parser.add_argument("--mlp-ratio", type=float, help="MLP width / token width; overrides the preset")
    parser.add_argument("--patch-sizes", type=_patch_sizes, metavar="P,P,...",
                        help="FlexiViT: train each step at a patch size drawn from these (e.g. 4,8,16),"
                        " resizing the --patch-size weights on the fly, so that one model works at all")
    parser.add_argument("--positions", default=defaults.positions, choices=POSITIONS,
                        help="learned: position embeddings, resampled for another image size; rotary:"
                        " DINOv3's rotary positions, which follow any grid (default learned)")
    parser.add_argument("--epochs", type=int, default=defaults.epochs)
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size, help="per process")
    parser.add_argument("--lr", type=float, default=defaults.lr, help="peak learning rate")
    parser.add_argument("--weight-decay", type=float, default=defaults.weight_decay)
    parser.add_argument("--warmup-steps", type=int, default=defaults.warmup_steps)
    parser.add_argument("--label-smoothing", type=float, default=defaults.label_smoothing)
    parser.add_argument("--no-augment", action="store_true", help="no random crops and flips")
    parser.add_argument("--train-size", type=int, help="training images (default: shapes 16000, others all)")
    parser.add_argument("--test-size", type=int, help="test images (default: shapes 2000, others all)")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--device", default="auto", help="auto (cuda, then mps, then cpu), cpu, cuda, mps")
    parser.add_argument("--precision", default="auto", choices=("auto", "bf16", "fp32"),
                        help="auto: bf16 autocast on CUDA, fp32 elsewhere")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model")
    parser.add_argument("--data-root", help="where datasets are downloaded (default ~/.cache/vit_explorer/data)")
    parser.add_argument("--out", default=defaults.out_dir, help="folder for the checkpoint (default runs)")
    parser.add_argument("--name", help="checkpoint file name without extension (default vit_<dataset>)")
    parser.add_argument("--resume", action="store_true", help="continue the interrupted run in --out")
    parser.set_defaults(run=_run_train)


def _train_config(args: argparse.Namespace):
    from ..data.datasets import check_dataset_name, native_image_size
    from ..model.config import PRESETS, TrainConfig, ViTConfig
    from ..training.train import check_run_name

    check_dataset_name(args.dataset)
    if args.name:
        check_run_name(args.name)  # before any work: its files must stay in --out
    overrides = {
        field: value for field, value in (
            ("patch_size", args.patch_size), ("embed_dim", args.embed_dim), ("depth", args.depth),
            ("num_heads", args.heads), ("mlp_ratio", args.mlp_ratio),
        ) if value is not None
    }
    model = args.preset
    if overrides:
        # Classes and normalization are placeholders here; training takes them from the data.
        image_size = args.image_size or native_image_size(args.dataset)
        model = ViTConfig(image_size=image_size, **{**PRESETS[args.preset], **overrides})
    return TrainConfig(
        dataset=args.dataset, model=model, image_size=args.image_size, epochs=args.epochs,
        batch_size=args.batch_size, lr=args.lr, weight_decay=args.weight_decay,
        warmup_steps=args.warmup_steps, label_smoothing=args.label_smoothing, seed=args.seed,
        device=args.device, precision=args.precision, compile=args.compile,
        augment=not args.no_augment, data_root=args.data_root, out_dir=args.out, name=args.name,
        train_size=args.train_size, test_size=args.test_size, resume=args.resume,
        patch_sizes=args.patch_sizes, positions=args.positions,
    )


def _run_train(args: argparse.Namespace) -> int:
    import os
    import signal
    import threading

    from tqdm import tqdm

    from ..training.train import DoneEvent, EpochEvent, StepEvent, model_config, train

    config = _train_config(args)
    model_config(config)  # patch sizes that do not tile the images fail here, in one sentence
    show = int(os.environ.get("RANK", "0")) == 0  # under torchrun only rank 0 reports
    stop = threading.Event()
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is threading.main_thread():
        # The first Ctrl-C ends training after the current step, checkpoint included; a
        # second one interrupts at once.
        signal.signal(signal.SIGINT, lambda signum, frame: (stop.set(), signal.signal(signal.SIGINT, previous)))
    bar = None  # one progress bar per epoch; the first opens at the first reported step
    try:
        for event in train(config, stop=stop):
            if not show:
                continue
            if isinstance(event, StepEvent):
                steps_per_epoch = event.total_steps // config.epochs
                done = event.step - (event.epoch - 1) * steps_per_epoch
                if bar is None:
                    bar = tqdm(total=steps_per_epoch, initial=done, unit="step",
                               desc=f"epoch {event.epoch}/{config.epochs}")
                bar.update(done - bar.n)
                bar.set_postfix(loss=f"{event.loss:.3f}", acc=f"{event.accuracy:.3f}",
                                img_s=f"{event.images_per_s:.0f}")
            elif isinstance(event, EpochEvent):
                bar.close()
                bar = None
                if event.epoch < event.epochs:
                    bar = tqdm(total=steps_per_epoch, unit="step", desc=f"epoch {event.epoch + 1}/{event.epochs}")
                tqdm.write(
                    f"epoch {event.epoch}/{event.epochs}: train loss {event.train_loss:.4f},"
                    f" train accuracy {event.train_accuracy:.4f}, test loss {event.test_loss:.4f},"
                    f" test accuracy {event.test_accuracy:.4f} ({event.seconds:.1f} s)"
                )
            elif isinstance(event, DoneEvent):
                how = "stopped early" if event.stopped else "trained"
                tqdm.write(f"{how} in {event.seconds:.1f} s: test accuracy {event.test_accuracy:.4f},"
                      f" checkpoint {event.checkpoint}")
                for patch, accuracy in (event.test_accuracy_by_patch_size or {}).items():
                    tqdm.write(f"  at patch {patch}: test accuracy {accuracy:.4f}")
    finally:
        if bar is not None:
            bar.close()
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, previous)
    return 0


def add_evaluate(subparsers) -> None:
    parser = subparsers.add_parser(
        "evaluate", help="print a checkpoint's test accuracy",
        description="Evaluate a checkpoint on a dataset's test split; the last line is `accuracy: X`.",
    )
    parser.add_argument("--weights", required=True, help="checkpoint file (.safetensors)")
    parser.add_argument("--dataset", default="shapes",
                        help="shapes, cifar10, mnist, fashionmnist, or folder:PATH; default shapes")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, mps")
    parser.add_argument("--data-root", help="where datasets are downloaded (default ~/.cache/vit_explorer/data)")
    parser.add_argument("--test-size", type=int, help="evaluate on the first N test images (default all;"
                        " shapes: 2000 freshly rendered)")
    parser.add_argument("--batch-size", type=int, default=500)
    parser.add_argument("--patch-size", type=int,
                        help="evaluate at this patch size, the weights resized to it (FlexiViT PI-resize);"
                        " default the model's own")
    parser.add_argument("--image-size", type=int,
                        help="evaluate at this image size (learned position embeddings resampled, rotary"
                        " positions as they are; shapes renders its test images at that size, other datasets'"
                        " are resized); default the model's own")
    parser.set_defaults(run=_run_evaluate)


def _run_evaluate(args: argparse.Namespace) -> int:
    from ..training.evaluation import evaluate_checkpoint

    if args.batch_size < 1 or (args.test_size is not None and args.test_size < 1):
        raise ValueError("--batch-size and --test-size must be at least 1")
    for flag, value in (("--patch-size", args.patch_size), ("--image-size", args.image_size)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be at least 1, not {value}")
    accuracy, count, config = evaluate_checkpoint(
        args.weights, args.dataset, device=args.device, data_root=args.data_root,
        test_size=args.test_size, batch_size=args.batch_size, patch_size=args.patch_size,
        image_size=args.image_size,
    )
    (height, width), (grid_h, grid_w) = config.img_size, config.grid_size
    print(
        f"{Path(args.weights).name} at {height}x{width} px, patch {config.patch_size} ({grid_h}x{grid_w} grid),"
        f" on the {args.dataset} test split ({count} images)"
    )
    print(f"accuracy: {accuracy:.4f}")
    return 0

