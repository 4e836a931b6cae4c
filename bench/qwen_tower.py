"""Qwen2.5-VL's windowed tower: our forward and capture against transformers' own tower.

A Qwen2.5-VL-3B-shaped tower (1280 wide, 16 heads, SwiGLU 3420, windows of 112 px, a
full-attention block every fourth, none in 2) of ``--depth`` blocks, random weights, saved as a whole VLM
folder with a tiny language model and loaded with ``vx.load_model``; transformers' tower
(``model.visual``, sdpa) runs on the same picture from its own patches. Our tokens stay row-major
and window attention is a masked full attention (the capture keeps every (N, N) map, zeros
outside the windows), so the masked layers cost N^2, not windows x window^2: the ratio grows
with the picture. Interleaved rounds, the ratio of medians, batch 1, float32 on the CPU.

    python -m bench.qwen_tower [--depth 2] [--sizes 448x448 672x448] [--rounds 3]
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from einops import rearrange


def make_folder(folder: Path, depth: int) -> torch.nn.Module:
    """Save the VLM folder; return transformers' tower of it."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(0)
    vision = dict(depth=depth, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=2048,
                  window_size=112, fullatt_block_indexes=list(range(3, depth, 4)), patch_size=14)
    text = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                vocab_size=1000, rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1e6})
    config = Qwen2_5_VLConfig(vision_config=vision, text_config=text, image_token_id=999, video_token_id=998,
                              vision_start_token_id=997)
    model = Qwen2_5_VLForConditionalGeneration(config).eval()
    model.save_pretrained(folder)
    return model.model.visual


def timed(function, rounds: list[float]) -> None:
    start = time.perf_counter()
    function()
    rounds.append((time.perf_counter() - start) * 1000)


def main() -> None:
    import vit_explorer as vx

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--sizes", nargs="+", default=["448x448", "672x448"])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    with tempfile.TemporaryDirectory(prefix="qwen_tower_") as temporary:
        folder = Path(temporary) / "qwen2_5_vl"
        theirs = make_folder(folder, args.depth)
        base = vx.load_model(folder)
        print(f"Qwen2.5-VL-3B-shaped tower, {args.depth} blocks; batch 1, float32, {torch.get_num_threads()} threads, medians of {args.rounds}")
        print("| input (h x w) | tokens | transformers | ours forward | ours capture | forward ratio | capture ratio |")
        print("|---|---|---|---|---|---|---|")
        for size in args.sizes:
            height, width = (int(side) for side in size.split("x"))
            ours = vx.resize_model(base, image_size=(height, width)).eval()
            x = torch.randn(1, 3, height, width, generator=torch.Generator().manual_seed(0))
            grid_h, grid_w = height // 14, width // 14
            # The processor's patches: 2 x 2 merge units, row-major, each (C, T=2, 14, 14).
            patches = rearrange(
                torch.stack([x[0], x[0]], 1), "c t (h m1 p1) (w m2 p2) -> (h w m1 m2) (c t p1 p2)", m1=2, m2=2, p1=14, p2=14
            )
            grid_thw = torch.tensor([[1, grid_h, grid_w]])
            timings = {"theirs": [], "forward": [], "capture": []}
            runs = {
                "theirs": lambda: theirs(patches, grid_thw=grid_thw),
                # Both ours end in the merger, as transformers' tower does.
                "forward": lambda: ours.merged(ours.forward_features(x)),
                "capture": lambda: ours.merged(vx.capture(ours, x).tokens[:, -1]),
            }
            for function in runs.values():  # warm-up
                function()
            for _ in range(args.rounds):
                for name, function in runs.items():
                    timed(function, timings[name])
            theirs_ms, forward_ms, capture_ms = (statistics.median(timings[name]) for name in runs)
            print(
                f"| {height}x{width} | {grid_h * grid_w} | {theirs_ms:.0f} ms | {forward_ms:.0f} ms | {capture_ms:.0f} ms"
                f" | {forward_ms / theirs_ms:.2f}x | {capture_ms / theirs_ms:.2f}x |"
            )


if __name__ == "__main__":
    main()
