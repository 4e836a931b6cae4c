"""Command line: python -m vit_explorer train | evaluate | inspect."""
from __future__ import annotations

import argparse
import sys


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
    parser = subparsers.add_parser("inspect", help="write attention figures for an image")
    parser.set_defaults(run=_run_inspect)


def _run_inspect(args: argparse.Namespace) -> int:
    raise NotImplementedError


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
