"""`vit-explorer inspect` against the capture it starts from, measured in the same run.

On a DINOv2-with-registers-shaped random model (ViT-S/14, 4 registers, depth 12) at its own
518 px (1,374 tokens), on the CPU, prints per round and as medians:
  capture       vx.capture(model, x): every layer's attention in float32 (the public default)
  inspect       the whole command: load, capture, analyses, figures and their export
  export        of which writing the figure files (PNG through Chromium, or HTML)
  ratio         (inspect - export) / capture                     (goal <= 3)
Rounds interleave the two so that load from other processes hits both alike. Works on an older
checkout too (PYTHONPATH=that checkout), without --tensors, to compare before and after.

    python -m bench.inspect [--rounds 3] [--tensors] [--format png|html]
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

import vit_explorer as vx
from vit_explorer import cli, figures

PHOTO = Path(__file__).resolve().parents[1] / "assets" / "samples" / "chelsea.png"
DINOV2_S_REG = dict(
    image_size=518, patch_size=14, embed_dim=384, depth=12, num_heads=6, reg_tokens=4, no_embed_class=True,
    init_values=1e-5, num_classes=0,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tensors", action="store_true", help="pass --tensors: write capture.npz too")
    parser.add_argument("--format", choices=("png", "html"), default="png")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = vx.ViT(vx.ViTConfig(**DINOV2_S_REG)).eval()
    x = vx.preprocess(vx.load_image(PHOTO), model.config)
    exported = []
    write = figures.write_figures

    def timed_write(*positional, **named):
        start = time.perf_counter()
        try:
            return write(*positional, **named)
        finally:
            exported.append(time.perf_counter() - start)

    figures.write_figures = timed_write
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        weights = Path(folder) / "dinov2_s14_reg4.safetensors"
        vx.save_model(model, weights)
        command = ["inspect", str(PHOTO), "--weights", str(weights), "--out", str(Path(folder) / "out"),
                   "--format", args.format, "--device", "cpu", *(["--tensors"] if args.tensors else [])]
        vx.capture(model, x)  # warm-up
        for round_ in range(args.rounds):
            start = time.perf_counter()
            vx.capture(model, x)
            capture = time.perf_counter() - start
            start = time.perf_counter()
            assert cli.main(command) == 0
            total = time.perf_counter() - start
            rows.append((capture, total, exported[-1]))
            print(f"round {round_}: capture {capture:.2f} s, inspect {total:.2f} s, export {exported[-1]:.2f} s,"
                  f" ratio {(total - exported[-1]) / capture:.2f}", flush=True)
    capture, total, export = (statistics.median(column) for column in zip(*rows))
    print(f"median: capture {capture:.2f} s, inspect {total:.2f} s (export {export:.2f} s);"
          f" inspect / capture {total / capture:.2f}, (inspect - export) / capture {(total - export) / capture:.2f}")


if __name__ == "__main__":
    main()
