"""Sparse autoencoders: what a dictionary costs, against the model's own forward pass measured in the
same run (ratios), and whole runs in seconds on this machine.

- capture: one layer's training tokens for a batch of images (features.tokens.layer_tokens) / the
  plain forward passes of the same images (goal <= 1.1);
- step: our SAE training step (TopK, AuxK, unit decoder rows) / a plain PyTorch TopK step of the same
  shape (encode, TopK, decode, MSE, Adam), interleaved on the same tokens (goal <= 1.0: as fast);
- page: a latent's gallery from the index (goal <= 0.2 s), a latent's map on a captured image and a
  steered pass resumed from the capture, in forwards of the model (goals 0 and <= 1);
- effects: the latents that matter for one image's prediction (features.effects: forward and
  backward from the dictionary's layer, the top latents removed in one batch), in forwards counted
  from the blocks run (a backward as two forwards) and in seconds against one plain forward of the
  same image, on the shipped model and a random ViT-B/16 with a random dictionary on layer 8
  (goal <= 3 forwards);
- the shipped model: a run over 50,000 tokens, in seconds (goal <= 120 s on the 2-core CPU);
- --vit-b16: a random ViT-B/16's layer 8 over --images images (16x width, k = 32) as one run, in
  minutes (goal <= 30 for 1,000 images on the 2-core CPU); long, so not by default.

    python -m bench.sae [--rounds 7]
    python -m bench.sae --effects      # the latent effects only
    python -m bench.sae --vit-b16 --images 1000
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import vit_explorer as vx
from vit_explorer.features import effects
from vit_explorer.features.index import load_index
from vit_explorer.features.sae import SAEConfig, SparseAutoencoder, load_sae, top_k
from vit_explorer.features.tokens import ImageSource, layer_tokens, model_input
from vit_explorer.features.train import SAETrainConfig, SAETrainer, initialise, train_sae
from vit_explorer.resources import shipped_weights

SHIPPED_SAE = shipped_weights().with_name("sae_shapes_layer2.safetensors")


def median_seconds(fn, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def interleaved(first, second, rounds: int) -> tuple[float, float]:
    """Median seconds of two functions timed alternately, so that load hits both alike."""
    a, b = [], []
    for _ in range(rounds):
        for fn, times in ((first, a), (second, b)):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    return statistics.median(a), statistics.median(b)


def vit_b16() -> vx.ViT:
    torch.manual_seed(0)
    return vx.ViT(vx.ViTConfig(image_size=224, patch_size=16, num_classes=1000, embed_dim=768, depth=12,
                               num_heads=12)).eval()


def capture_ratio(model: vx.ViT, layer: int, images: int, rounds: int) -> float:
    pictures = ImageSource("shapes", images, model.config.img_size).images(torch.arange(images))
    x = model_input(model, pictures)

    def forward():
        with torch.inference_mode():
            model(x)

    captured, plain = interleaved(lambda: layer_tokens(model, x, layer), forward, rounds)
    return captured / plain


def step_ratio(d_model: int, expansion: int, k: int, batch: int, rounds: int) -> float:
    torch.manual_seed(0)
    tokens = torch.randn(batch * 8, d_model)
    ours = SparseAutoencoder(SAEConfig(d_model, expansion * d_model, k))
    initialise(ours, tokens)
    trainer = SAETrainer(ours, 4e-4)
    reference = SparseAutoencoder(SAEConfig(d_model, expansion * d_model, k))
    optimizer = torch.optim.Adam(reference.parameters(), lr=4e-4)
    batches = tokens.split(batch)

    def our_step():
        for rows in batches:
            trainer.step(rows)

    def plain_step():  # the textbook TopK step: nothing for dead latents, no decoder normalisation
        for rows in batches:
            latents = top_k((rows - reference.b_dec) @ reference.W_enc + reference.b_enc, k)
            loss = F.mse_loss(latents @ reference.W_dec + reference.b_dec, rows)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()

    ours_seconds, plain_seconds = interleaved(our_step, plain_step, rounds)
    return ours_seconds / plain_seconds


def page_costs(rounds: int) -> tuple[float, float, float]:
    """(gallery seconds, latent map in forwards, steered pass in forwards) with the shipped model
    and its dictionary, the image captured first as a page's is."""
    model = vx.load_model(shipped_weights())
    sae, card = load_sae(SHIPPED_SAE, model)
    index = load_index(SHIPPED_SAE.with_suffix(".index.npz"))
    source = ImageSource.from_dict(card["images"])
    image, _ = vx.shapes_sample(4, model.config.img_size)
    x = vx.preprocess(image, model.config)
    intact = vx.capture(model, x)
    latent = int(index.frequency.argmax())
    layer = card["layer"]

    def gallery():
        top = index.top(latent)
        source.images(torch.tensor([image for image, _, _ in top]))

    def latent_map():
        with torch.no_grad():
            sae.encode(intact.tokens[0, layer + 1, intact.num_prefix_tokens:])[:, latent]

    def steered():
        vx.capture(model, x, layers=intact.layers, steering=vx.Steering(sae, layer, {latent: 0.0}), intact=intact)

    forward = median_seconds(lambda: vx.capture(model, x), rounds)
    return (median_seconds(gallery, rounds), median_seconds(latent_map, rounds) / forward,
            median_seconds(steered, rounds) / forward)


def effect_costs(model: vx.ViT, sae: SparseAutoencoder, layer: int, x: torch.Tensor, rounds: int) -> tuple[float, float, int]:
    """(forwards counted, seconds / one plain forward, removals checked) of one image's latent
    effects from its capture, as the Features page computes them."""
    import vit_explorer.model.patching as patching

    tokens = vx.capture(model, x).tokens[:, layer + 1]
    blocks, depth = [0.0], model.config.depth
    block_forward, rows_forward = vx.model.vit.Block.forward, patching._last_block_rows

    def counted_block(block, x, *args, **kwargs):
        blocks[0] += x.shape[0]
        return block_forward(block, x, *args, **kwargs)

    def counted_rows(model, x, *args, **kwargs):
        blocks[0] += x.shape[0] * patching.ROWS_SHARE
        return rows_forward(model, x, *args, **kwargs)

    vx.model.vit.Block.forward, patching._last_block_rows = counted_block, counted_rows
    try:
        found = effects.latent_effects(model, sae, layer, tokens)
    finally:
        vx.model.vit.Block.forward, patching._last_block_rows = block_forward, rows_forward
    # The first pass (forward, then its backward: about two forwards more) and the batch of removals.
    checks = len(found.real)
    tail = blocks[0] / (1 + checks) / depth  # the blocks above the layer, per image: run once, then per removal
    counted = (1 + effects.BACKWARD_FORWARDS + checks) * tail

    def plain():
        with torch.inference_mode():
            model(x)

    ours, reference = interleaved(lambda: effects.latent_effects(model, sae, layer, tokens), plain, rounds)
    return counted, ours / reference, checks


def print_effect_costs(shipped: vx.ViT, big: vx.ViT, rounds: int) -> None:
    sae, card = load_sae(SHIPPED_SAE, shipped)
    image, _ = vx.shapes_sample(0, shipped.config.img_size)  # a circle, 61% sure: not saturated
    torch.manual_seed(0)
    random_sae = SparseAutoencoder(SAEConfig(768, 16 * 768, 32)).eval()
    for name, model, dictionary, layer, x in (
        ("shipped model, layer 2", shipped, sae, card["layer"], vx.preprocess(image, shipped.config)),
        ("ViT-B/16, layer 8, 12,288 latents", big, random_sae, 8, torch.randn(1, 3, 224, 224)),
    ):
        counted, ratio, checks = effect_costs(model, dictionary, layer, x, rounds)
        print(f"latent effects of one image, {name}: {counted:.2f} forwards counted ({checks} removals checked;"
              f" goal <= 3), {ratio:.2f}x the seconds of one plain forward")


def run_seconds(config: SAETrainConfig, model: vx.ViT | None = None) -> tuple[float, dict]:
    start = time.perf_counter()
    done = None
    for event in train_sae(config, model=model):
        done = event
    return time.perf_counter() - start, done.metrics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--vit-b16", action="store_true", help="also a ViT-B/16 layer as one run (long)")
    parser.add_argument("--images", type=int, default=1000, help="images of the ViT-B/16 run (default 1000)")
    parser.add_argument("--effects", action="store_true", help="only the latent effects' costs")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU")
    shipped = vx.load_model(shipped_weights())
    big = vit_b16()
    if args.effects:
        print_effect_costs(shipped, big, args.rounds)
        return
    for name, model, layer, images in (("shipped model", shipped, 2, 256), ("ViT-B/16", big, 8, 4)):
        ratio = capture_ratio(model, layer, images, args.rounds)
        print(f"capture of layer {layer}'s tokens / plain forwards, {name}: {ratio:.2f}  (goal <= 1.1)")
    for name, d_model, expansion, k in (("shipped model, 64 x 16, k 8", 64, 16, 8), ("ViT-B/16, 768 x 16, k 32", 768, 16, 32)):
        ratio = step_ratio(d_model, expansion, k, 1024, max(3, args.rounds // 2))
        print(f"our SAE step / a plain PyTorch TopK step, {name}: {ratio:.2f}  (goal <= 1.0)")
    gallery, latent_map, steered = page_costs(args.rounds)
    print(f"page, shipped model: a latent's gallery {gallery:.3f} s (goal <= 0.2), its map {latent_map:.2f} forwards"
          f" (goal 0: from the capture), a steered pass {steered:.2f} forwards (goal <= 1)")
    print_effect_costs(shipped, big, args.rounds)
    with tempfile.TemporaryDirectory() as folder:
        config = SAETrainConfig(weights=str(shipped_weights()), layer=2, images=782, expansion=16, k=8, epochs=1,
                                device="cpu", out_dir=folder)  # 782 x 64 = 50,048 tokens
        seconds, metrics = run_seconds(config)
        print(f"a run over 50,048 tokens of the shipped model, index included: {seconds:.1f} s (goal <= 120),"
              f" explained variance {metrics['explained_variance']:.3f}")
        if args.vit_b16:
            path = Path(folder) / "vit_b16.safetensors"
            vx.save_model(big, path)
            config = SAETrainConfig(weights=str(path), layer=8, images=args.images, expansion=16, k=32, epochs=1,
                                    device="cpu", out_dir=folder)
            seconds, metrics = run_seconds(config)
            print(f"a ViT-B/16 layer 8 over {args.images} images ({args.images * 196:,} tokens, 12,288 latents, k 32),"
                  f" index included: {seconds / 60:.1f} min (goal <= 30 for 1,000), explained variance"
                  f" {metrics['explained_variance']:.3f}")


if __name__ == "__main__":
    main()
