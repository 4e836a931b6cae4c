"""Inference speed against timm's fused ViT, measured in the same run.

Prints, for ViT-B/16, ViT-Ti/16 and DINOv3 ViT-B/16 (rotary positions, registers, LayerScale) at
224 px (and, asked for with --model, the VLM towers SigLIP So400m/14 at 378 px and CLIP ViT-L/14
at 336), batch 1, on the CPU (or --device):
  forward ratio  = our plain forward / timm's forward          (goal <= 1.05)
  capture ratio  = vx.capture (every layer and head, float32) / timm's   (goal <= 1.15)
  view ratio     = the capture a page's view runs / timm's               (goal <= 1.15)
                   (app.selection: every layer's float16 attention where that is small,
                   models.KEEP_EVERY_LAYER_BYTES, else the tokens only)
Timings are interleaved round by round so that load from other processes hits all four alike;
the ratio of medians is reported.

    python -m bench.inference [--rounds 15] [--device cpu] [--model DINOv3-B/16 ...] [--threads 1 --clock cpu]
"""
from __future__ import annotations

import argparse
import statistics
import time

import timm
import torch

import vit_explorer as vx
from vit_explorer.app import models
from vit_explorer.weights.catalogue import CATALOGUE
from vit_explorer.model.vit import from_timm_eva

_PLAIN = dict(image_size=224, patch_size=16, num_classes=1000)
# name -> (timm model, its arguments, our config's fields); random weights, timm's copied into ours
MODELS = {
    "ViT-B/16": ("vit_base_patch16_224", {}, dict(_PLAIN, embed_dim=768, depth=12, num_heads=12)),
    "ViT-Ti/16": ("vit_tiny_patch16_224", {}, dict(_PLAIN, embed_dim=192, depth=12, num_heads=3)),
    # timm's Eva; ours as the catalogue builds it, pooled on the class token as timm is asked to
    "DINOv3-B/16": ("vit_base_patch16_dinov3", dict(global_pool="token"), CATALOGUE["dinov3_vitb16"].config),
    # VLM towers at their native sizes (So400m@384's conv reads 378 px of its 384)
    "So400m/14-378": ("vit_so400m_patch14_siglip_378", dict(num_classes=0), dict(
        image_size=378, patch_size=14, num_classes=0, embed_dim=1152, depth=27, num_heads=16, mlp_ratio=3.7362,
        class_token=False, global_pool="map",
    )),
    "CLIP-L/14-336": ("vit_large_patch14_clip_336", dict(num_classes=0), dict(
        image_size=336, patch_size=14, num_classes=0, embed_dim=1024, depth=24, num_heads=16, pre_norm=True,
        patch_bias=False, layer_norm_eps=1e-5,
    )),
}
# Measured unless asked for by name (--model): a So400m's three passes take a minute on 2 cores.
OPTIONAL = ("So400m/14-378", "CLIP-L/14-336")


def seconds(fn, device: torch.device, clock=time.perf_counter) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = clock()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return clock() - start


def bench(name: str, rounds: int, device: torch.device, clock=time.perf_counter) -> dict[str, float]:
    timm_name, timm_arguments, fields = MODELS[name]
    reference = timm.create_model(timm_name, pretrained=False, **timm_arguments).eval().to(device)
    ours = vx.ViT(vx.ViTConfig(**fields))
    ours.load_state_dict(from_timm_eva(reference.state_dict()))  # a plain ViT's names are unchanged
    ours.eval().to(device)
    x = torch.randn(1, 3, *vx.ViTConfig(**fields).img_size, device=device)

    def timm_forward():
        with torch.inference_mode():
            reference(x)

    def our_forward():
        with torch.inference_mode():
            ours(x)

    def our_capture():
        vx.capture(ours, x)

    kept = None if models.keeps_every_layer(ours.config) else ()

    def view_capture():  # as app.selection.Selection.capture runs it
        vx.capture(ours, x, layers=kept, attention_dtype=torch.float16)

    candidates = {"timm": timm_forward, "forward": our_forward, "capture": our_capture, "view": view_capture}
    for fn in candidates.values():  # warm-up: allocator, kernels, lazy init
        fn(), fn()
    times = {key: [] for key in candidates}
    for _ in range(rounds):
        for key, fn in candidates.items():
            times[key].append(seconds(fn, device, clock))
    return {key: statistics.median(values) for key, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", action="append", choices=list(MODELS), help="only these (default: all)")
    parser.add_argument("--threads", type=int, help="torch's CPU threads (default: torch's choice)")
    # On a machine shared with other work the wall clock of a few rounds swings by 2x (CLIP-L's
    # forward ratio 0.46x-1.48x within an hour under load 5-12): CPU seconds of one thread are
    # steadier, though not free of other processes (they share the caches and memory).
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="wall: elapsed seconds; cpu: this process's CPU seconds (with --threads 1)")
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    print(f"torch {torch.__version__}, timm {timm.__version__}, device {device}, "
          f"{torch.get_num_threads()} threads, batch 1, each model's size, median of {args.rounds} rounds, "
          f"{args.clock} clock")
    print(f"{'model':<14} {'timm ms':>8} {'ours ms':>8} {'capture ms':>10} {'view ms':>8} "
          f"{'forward ratio':>14} {'capture ratio':>14} {'view ratio':>11}")
    for name in args.model or [name for name in MODELS if name not in OPTIONAL]:
        t = bench(name, args.rounds, device, clock)
        print(f"{name:<14} {t['timm'] * 1e3:8.1f} {t['forward'] * 1e3:8.1f} {t['capture'] * 1e3:10.1f} "
              f"{t['view'] * 1e3:8.1f} {t['forward'] / t['timm']:13.3f}x {t['capture'] / t['timm']:13.3f}x "
              f"{t['view'] / t['timm']:10.3f}x")


if __name__ == "__main__":
    main()
