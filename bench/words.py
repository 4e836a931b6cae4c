"""Where each word is (vit_explorer.text.maps): a prompt's map against one forward of the image
tower, measured in the same run.

On random CLIP ViT-B/16- and SigLIP ViT-B/16-shaped models with both towers (the tests' own,
tests/textmodels.py: open_clip's models with random weights, written as their publishers write
them and read back with text.load_image_text_model), batch 1, 224 px, on the CPU; per model:
  forward       the image tower's plain forward (inference mode): the reference
  map           a prompt's dense similarity map on a captured image: the patches carried into the
                texts' space (patch_embeddings: the last block's value path for CLIP, the
                attention pool's for SigLIP) and their cosines with the prompt's embedding, given
  map + text    the same, embedding the prompt too (one pass of the text tower)
  another map   a further prompt on the same image: its cosines only (the app keeps the patches)
  relevance     the relevance map of the image-text cosine (one forward and backward pass)
  map METHOD    the map by each open-vocabulary method (text.open_vocabulary: SCLIP, ClearCLIP,
                NACLIP re-run the last block's arithmetic from the captured tokens), the prompt's
                embedding given
Rounds interleave all of them so that load from other processes hits each alike; the medians'
ratios to the forward are printed, and for each method the passes of the image tower
(ViT.forward_features) and the calls of Block.forward, counted (issue 44: at most 1 pass once
captured). Goals (issue 35): a prompt's map at most 1 forward warm, the relevance map at most 3.
On a loaded machine, --threads 1: with two threads, every small operation waits for whichever
thread the scheduler parked, which weighs on many small operations (the text tower, the backward
pass) far more than on the forward's large products, and the ratios drift.

    python -m bench.words [--rounds 7] [--model clip siglip] [--threads 1]
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

import vit_explorer as vx
from vit_explorer.text import load_image_text_model
from vit_explorer.model.vit import Block
from vit_explorer.text import open_vocabulary
from vit_explorer.text.maps import patch_embeddings, relevance, similarity_maps

MODELS = {"clip": "ViT-B-16", "siglip": "ViT-B-16-SigLIP"}
# The methods that change the last block alone; CLIP Surgery and ProxyCLIP: bench.word_methods.
LAST_BLOCK = [method for method, entry in open_vocabulary.METHODS.items() if entry.from_tokens is not None]
PROMPT = "a photo of a cat."
GOALS = {"map": 1.0, "map + text": 1.0, "another map": 1.0, "relevance": 3.0} | {
    f"map {method}": 1.0 for method in LAST_BLOCK
}


def model_folder(folder: Path, name: str) -> Path:
    """The tests' random open_clip model ``name`` (CLIP with OpenAI's QuickGELU) written to ``folder``."""
    import open_clip

    from tests.textmodels import open_clip_folder

    config = open_clip.get_model_config(MODELS[name])
    open_clip_folder(folder, config | {"quick_gelu": True} if name == "clip" else config)
    return folder


def counted(run) -> tuple[int, int]:
    """(passes of the image tower, blocks run) while ``run()`` runs: ViT.forward_features and
    Block.forward counted (the bench's own process: nothing else runs them meanwhile)."""
    passes, blocks = [], []
    original_features, original_block = vx.ViT.forward_features, Block.forward
    vx.ViT.forward_features = lambda self, *args, **kw: passes.append(1) or original_features(self, *args, **kw)
    Block.forward = lambda self, *args, **kw: blocks.append(1) or original_block(self, *args, **kw)
    try:
        run()
    finally:
        vx.ViT.forward_features, Block.forward = original_features, original_block
    return len(passes), len(blocks)


def measure(name: str, rounds: int) -> tuple[dict[str, float], dict[str, tuple[int, int]]]:
    with tempfile.TemporaryDirectory() as folder:
        model = load_image_text_model(model_folder(Path(folder) / name, name))
    image = model.image
    x = torch.randn(1, 3, *image.config.img_size, generator=torch.Generator().manual_seed(0))
    captured = vx.capture(image, x, layers=())  # the page's capture: every layer's tokens
    text = model.embed_texts([PROMPT])
    patches = patch_embeddings(model, captured)

    def forward():
        with torch.inference_mode():
            image(x)

    steps = {
        "forward": forward,
        "map": lambda: similarity_maps(patch_embeddings(model, captured), text, captured.grid_size),
        "map + text": lambda: similarity_maps(patch_embeddings(model, captured), model.embed_texts([PROMPT]), captured.grid_size),
        "another map": lambda: similarity_maps(patches, model.embed_texts([PROMPT]), captured.grid_size),
        "relevance": lambda: relevance(model, x, text[0]),
    } | {
        f"map {method}": lambda method=method: similarity_maps(
            open_vocabulary.patch_embeddings(model, captured, method), text, captured.grid_size,
        )
        for method in LAST_BLOCK
    }
    counts = {method: counted(steps[f"map {method}"]) for method in LAST_BLOCK}
    return medians(steps, rounds), counts


def medians(steps: dict, rounds: int) -> dict[str, float]:
    """Each step's median seconds over ``rounds``, after a warm-up, the steps interleaved round by
    round so that load from other processes hits all alike."""
    for step in steps.values():  # warm-up
        step()
    times = {step: [] for step in steps}
    for _ in range(rounds):
        for step, run in steps.items():
            start = time.perf_counter()
            run()
            times[step].append(time.perf_counter() - start)
    return {step: statistics.median(seconds) for step, seconds in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--model", nargs="+", choices=tuple(MODELS), default=list(MODELS))
    parser.add_argument("--threads", type=int, help="torch's intra-op threads (default: torch's own)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.rounds} rounds, medians")
    for name in args.model:
        medians, counts = measure(name, args.rounds)
        forward = medians["forward"]
        print(f"{MODELS[name]}: forward {1000 * forward:.1f} ms")
        for step, goal in GOALS.items():
            ratio = medians[step] / forward
            verdict = "ok" if ratio <= goal else "OVER"
            print(f"  {step:<14} {1000 * medians[step]:8.1f} ms  {ratio:5.2f} forwards  (goal <= {goal:g}: {verdict})")
        for method, (passes, blocks) in counts.items():
            verdict = "ok" if passes <= 1 else "OVER"
            print(f"  map {method:<10} counted: {passes} passes of the image tower, {blocks} Block.forward (goal <= 1 pass: {verdict})")


if __name__ == "__main__":
    main()
