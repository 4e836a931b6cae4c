"""Command line: vit-explorer (or python -m vit_explorer) train | evaluate | inspect | sae | app | serve,
one module per command: each adds its parser and runs it."""
from __future__ import annotations

import argparse
import sys

from . import inspect, sae, serve, train


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="vit-explorer",
        description="Train, evaluate and inspect Vision Transformers, or start the explorer app"
        " (also runs as python -m vit_explorer).",
    )
    subparsers = parser.add_subparsers(dest="command", required=True)
    train.add_train(subparsers)
    train.add_evaluate(subparsers)
    inspect.add_inspect(subparsers)
    sae.add_sae(subparsers)
    serve.add_app(subparsers)
    serve.add_serve(subparsers)
    args, extra = parser.parse_known_args(argv)
    if extra and args.command != "app":
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.streamlit_args = extra
    try:
        return args.run(args)
    except (ValueError, OSError) as error:
        # Bad input (a missing file, an unreadable image or checkpoint) is one clear sentence.
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
