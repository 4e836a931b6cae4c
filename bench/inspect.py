"""`vit-explorer inspect` against the capture it starts from, measured in the same run.

Two models on the CPU: a DINOv2-with-registers-shaped random model (ViT-S/14, 4 registers, depth
12) at its own 518 px (1,374 tokens), and the shipped shapes model. Per round and as medians:
  capture       vx.capture(model, x): every layer's attention in float32 (the public default)
  inspect       the whole command: load, capture, analyses, figures and their files (PNG through
                one Chromium, started at once in the background, or HTML)
  ratio         inspect / capture                                              (goal <= 5)
Rounds interleave the two so that load from other processes hits both alike. Works on an older
checkout too (PYTHONPATH=that checkout), without --tensors, to compare before and after.

    python -m bench.inspect [--rounds 3] [--tensors] [--format png|html]
"""
from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import tempfile
import time
from pathlib import Path

import torch

import vit_explorer as vx
from vit_explorer import cli

PHOTO = Path(__file__).resolve().parents[1] / "assets" / "samples" / "chelsea.png"
SHAPE = PHOTO  # the shipped model reads any picture at its 32 px
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
    shipped = Path(__file__).resolve().parents[1] / "weights" / "vit_shapes.safetensors"
    with tempfile.TemporaryDirectory() as folder:
        dinov2 = Path(folder) / "dinov2_s14_reg4.safetensors"
        vx.save_model(vx.ViT(vx.ViTConfig(**DINOV2_S_REG)).eval(), dinov2)
        for title, weights in (("DINOv2-reg ViT-S/14 at 518 px", dinov2), ("the shipped model", shipped)):
            model = vx.load_model(weights)
            image = SHAPE if weights == shipped else PHOTO
            x = vx.preprocess(vx.load_image(image), model.config)
            command = ["inspect", str(image), "--weights", str(weights), "--out", str(Path(folder) / "out"),
                       "--format", args.format, "--device", "cpu", *(["--tensors"] if args.tensors else [])]
            vx.capture(model, x)  # warm-up
            rows = []
            for round_ in range(args.rounds):
                start = time.perf_counter()
                vx.capture(model, x)
                capture = time.perf_counter() - start
                start = time.perf_counter()
                with contextlib.redirect_stdout(io.StringIO()):
                    assert cli.main(command) == 0
                total = time.perf_counter() - start
                rows.append((capture, total))
                print(f"{title}, round {round_}: capture {capture:.3f} s, inspect {total:.2f} s, ratio {total / capture:.1f}", flush=True)
            capture, total = (statistics.median(column) for column in zip(*rows))
            print(f"{title}, median: capture {capture:.3f} s, inspect {total:.2f} s; inspect / capture {total / capture:.1f}")


if __name__ == "__main__":
    main()
