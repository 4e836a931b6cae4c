"""CLIP Surgery, ProxyCLIP and LeGrad (vit_explorer.text.clip_surgery, .proxyclip, .legrad) on a
captured image against one forward of the image tower, measured in the same run.

On the random CLIP ViT-B/16- and SigLIP ViT-B/16-shaped models of bench.words (the tests' own),
batch 1, 224 px, on the CPU; per model:
  forward         the image tower's plain forward (inference mode): the reference
  surgery         CLIP Surgery's v-v path over the last 6 blocks from the capture's tokens, and
                  its feature surgery against 21 prompts' embeddings (given)
  proxyclip       ProxyCLIP with a DINO ViT-S/16-shaped proxy already captured on the picture
  proxy capture   that capture (the proxy's one forward, which the page makes once per picture)
  legrad          LeGrad of one prompt: the last two blocks (SigLIP: its pool) forward and backward
Rounds interleave them; the medians' ratios to the forward are printed. Goals (issue 44): a
method's map once the image is captured at most 1 forward; LeGrad at most a forward and a
backward (3 forwards, bench.words' relevance goal).

    python -m bench.word_methods [--rounds 5] [--model clip siglip] [--threads 1]
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

import vit_explorer as vx
from bench.words import MODELS, medians, model_folder
from vit_explorer.text import clip_surgery, load_image_text_model, proxyclip
from vit_explorer.text.legrad import legrad

GOALS = {"surgery": 1.0, "proxyclip": 1.0, "proxy capture": 1.0, "legrad": 3.0}
PROMPTS = 21  # VOC's classes with the background


def measure(name: str, rounds: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as folder:
        model = load_image_text_model(model_folder(Path(folder) / name, name))
    image = model.image
    x = torch.randn(1, 3, *image.config.img_size, generator=torch.Generator().manual_seed(0))
    captured = vx.capture(image, x, layers=())  # the page's capture: every layer's tokens
    texts = F.normalize(torch.randn(PROMPTS, model.embed_dim, generator=torch.Generator().manual_seed(1)), dim=-1)
    proxy = vx.ViT(vx.ViTConfig(image_size=224, patch_size=16, embed_dim=384, depth=12, num_heads=6, num_classes=0)).eval()
    borrowed = proxyclip.Proxy(proxy, vx.capture(proxy, x, layers=()))

    def forward():
        with torch.inference_mode():
            image(x)

    steps = {"forward": forward, "legrad": lambda: legrad(model, captured, texts[0], empty=texts[1])}
    if name == "clip":  # CLIP Surgery and ProxyCLIP are the authors' for CLIP's class-token towers only
        steps |= {
            "surgery": lambda: clip_surgery.maps(model, captured, texts),
            "proxyclip": lambda: proxyclip.patch_embeddings(model, captured, borrowed) @ texts.t(),
            "proxy capture": lambda: vx.capture(proxy, x, layers=()),
        }
    return medians(steps, rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--model", nargs="+", choices=tuple(MODELS), default=list(MODELS))
    parser.add_argument("--threads", type=int, help="torch's intra-op threads (default: torch's own)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.rounds} rounds, medians")
    for name in args.model:
        medians = measure(name, args.rounds)
        forward = medians["forward"]
        print(f"{MODELS[name]}: forward {1000 * forward:.1f} ms")
        for step, goal in GOALS.items():
            if step in medians:
                ratio = medians[step] / forward
                verdict = "ok" if ratio <= goal else "OVER"
                print(f"  {step:<14} {1000 * medians[step]:8.1f} ms  {ratio:5.2f} forwards  (goal <= {goal:g}: {verdict})")


if __name__ == "__main__":
    main()
