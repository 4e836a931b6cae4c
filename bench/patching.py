"""What activation patching costs, in forward passes of the model (one plain pass of one image,
batch 1, measured in the same run, interleaved round by round so that load hits both alike):

- the paired runs (clean and corrupted in one batch, every site kept): about 2;
- attribution patching of every layer x token (residual stream, attention and MLP outputs) and
  every layer x head, the paired runs given (the page has them): goal at most 3 (one forward and
  one backward of the patched run);
- exact patching of the residual stream per layer x token, in passes counted from the blocks it
  runs (analysis.patching.exact_passes, which a test checks against the blocks run: each patched
  pass runs from the patched layer on, a cell whose runs agree none): goal at most half the naive
  count (a whole pass per cell, L x N), for another picture (every cell differs) and for the
  page's painted region (a quarter of the patches: at layer 0 only those differ). Counted, not
  timed (the whole map is some 1,300 passes, minutes on a CPU); ``--time-exact`` also times it.

The model is a random ViT-B/16 (197 tokens); the pictures the bundled cat and coffee photos.

    python -m bench.patching [--rounds 5] [--device cpu] [--time-exact]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import vit_explorer as vx
from vit_explorer.analysis import patching
from vit_explorer.resources import app_root


def vit_b16(device: str) -> vx.ViT:
    torch.manual_seed(0)
    config = vx.ViTConfig(image_size=224, patch_size=16, embed_dim=768, depth=12, num_heads=12, num_classes=1000)
    return vx.ViT(config).eval().to(device)


def interleaved(work, reference, rounds: int) -> tuple[float, float]:
    """Median wall seconds of ``work`` and of ``reference``, timed alternately."""
    times = ([], [])
    for _ in range(rounds):
        for fn, index in ((reference, 1), (work, 0)):
            start = time.perf_counter()
            fn()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            times[index].append(time.perf_counter() - start)
    return statistics.median(times[0]), statistics.median(times[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--time-exact", action="store_true")
    args = parser.parse_args()
    model = vit_b16(args.device)
    config = model.config
    samples = app_root() / "assets" / "samples"
    clean, other = (vx.preprocess(vx.load_image(samples / name), config).to(args.device) for name in ("chelsea.png", "coffee.png"))
    grid = config.grid_size[0]
    painted = patching.painted(clean, (grid // 4, 3 * grid // 4, grid // 4, 3 * grid // 4), config.patch_size)
    metric = patching.class_difference(1, 2, [str(index) for index in range(config.num_classes)])

    def forward():
        with torch.no_grad():
            model(clean)

    with torch.no_grad():
        forward()  # warm-up
    runs = patching.paired_runs(model, clean, other)
    rows = []
    seconds, reference = interleaved(lambda: patching.paired_runs(model, clean, other), forward, args.rounds)
    rows.append(("paired runs (2 images, every site kept)", seconds / reference, "about 2"))
    seconds, reference = interleaved(lambda: patching.attribution_patching(model, runs, metric), forward, args.rounds)
    rows.append(("attribution patching, every site (runs given)", seconds / reference, "<= 3"))
    naive = config.depth * config.num_tokens
    for name, corrupted in (("another picture", other), ("painted quarter", painted)):
        passes = patching.exact_passes(model, patching.paired_runs(model, clean, corrupted), "resid")
        rows.append((f"exact residual stream, {name}: {passes:.0f} passes / naive {naive}", passes / naive, "<= 0.5"))
    print(f"ViT-B/16, {config.num_tokens} tokens, {args.device}, one forward {reference * 1e3:.0f} ms (median of {args.rounds})")
    for name, ratio, goal in rows:
        print(f"  {name:<60} {ratio:6.3f}   goal {goal}")
    if args.time_exact:
        start = time.perf_counter()
        patching.exact_outputs(model, runs, "resid")
        exact = time.perf_counter() - start
        print(f"  exact residual stream, another picture: {exact:.1f} s = {exact / reference:.0f} forwards"
              f" (naive {naive} forwards)")


if __name__ == "__main__":
    main()
