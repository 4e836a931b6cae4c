"""Is this map true? What the faithfulness curves and the labelled probe cost, in forward passes of
the model (one plain pass of one image, batch 1, measured in the same run, interleaved round by
round so that load hits both alike):

- one map's 20-step deletion curve, tokens dropped, the intact pass given (the page has it from its
  capture): goal at most 10 forwards, batched (a pass with half the tokens costs about half);
- every map's curves together (the last layer's attention, rollout, the class attribution, a DINO
  head mask and the random floor): goal at most 50; deletion alone, and deletion and insertion;
- the same with patches painted the image's mean (the CNN-style comparison), one map's deletion;
- a pass on half the patch tokens, against the whole pass;
- a probe fitted on 5 images' tokens once captured (one layer, 40 labelled patches): goal at most 1;
  and the probe's accuracy across all 13 token layers.

Each row also gives what the run computed in tokens (``forwards``: rows x tokens / tokens of one
pass), which does not depend on the machine's load. The model is a random ViT-B/16 (``--dinov3``:
the DINOv3 ViT-B/16 shape, rotary positions and 4 registers); the image the bundled cat photo.

    python -m bench.faithfulness [--rounds 5] [--dinov3] [--device cpu]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import vit_explorer as vx
from vit_explorer.analysis import faithfulness as fa
from vit_explorer.analysis import probe as pr
from vit_explorer.resources import app_root


def vit_b16(dinov3: bool) -> vx.ViT:
    torch.manual_seed(0)
    extra = dict(
        rope_type="dinov3", abs_pos_embed=False, reg_tokens=4, init_values=1e-5, num_classes=0,
    ) if dinov3 else dict(num_classes=1000)
    config = vx.ViTConfig(image_size=224, patch_size=16, embed_dim=768, depth=12, num_heads=12, **extra)
    return vx.ViT(config).eval()


def interleaved(work, reference, rounds: int) -> tuple[float, float, float, float, float, float]:
    """Median wall seconds of ``work`` and of ``reference``, timed alternately, then the same in
    this process's CPU seconds (every thread's), then the fastest round of each (on a shared
    machine the least disturbed)."""
    wall, cpu = ([], []), ([], [])
    for _ in range(rounds):
        for fn, index in ((reference, 1), (work, 0)):
            start, start_cpu = time.perf_counter(), time.process_time()
            fn()
            wall[index].append(time.perf_counter() - start)
            cpu[index].append(time.process_time() - start_cpu)
    return (*map(statistics.median, wall), *map(statistics.median, cpu), *map(min, wall))


def the_maps(model: vx.ViT, x: torch.Tensor) -> tuple[dict[str, torch.Tensor], vx.Capture]:
    """The maps the Attention page draws for this image: what the curves rank."""
    cap = vx.capture(model, x)
    prefix, grid = cap.num_prefix_tokens, cap.grid_size
    class_token = model.config.class_token
    last = vx.analysis.attention_map(cap, layer=model.config.depth - 1, class_token=class_token)
    rollout = vx.analysis.query_map(
        vx.analysis.attention_rollout(cap.attentions, num_prefix_tokens=prefix), grid, prefix, class_token=class_token
    )[0]
    head = vx.analysis.attention_map(cap, layer=model.config.depth - 1, head=0, class_token=class_token)
    maps = {
        "raw attention": last,
        "rollout": rollout,
        "attribution": vx.analysis.attribution(model, x, score=None if model.config.num_classes else (
            lambda out: torch.nn.functional.cosine_similarity(out, cap.logits.to(out), dim=-1)))[0],
        "a DINO head mask": vx.analysis.attention_mask_by_mass(head).float(),
    }
    return maps, cap


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dinov3", action="store_true", help="the DINOv3 ViT-B/16 shape instead of a ViT-B/16")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = vit_b16(args.dinov3).to(args.device)
    photo = vx.load_image(app_root() / "assets" / "samples" / "chelsea.png")
    x = vx.preprocess(photo, model.config).to(args.device)
    maps, cap = the_maps(model, x)
    intact = cap.logits[0]
    one = {"rollout": maps["rollout"]}

    def sync():
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()

    def forward():
        with torch.inference_mode():
            model(x)
        sync()

    results = {}

    rows = []

    def row(label: str, goal: str, work, key: str):
        work_s, forward_s, work_cpu, forward_cpu, work_best, forward_best = interleaved(work, forward, args.rounds)
        forwards = results[key].forwards if key in results else float("nan")
        rows.append((label, work_s / forward_s, work_cpu / forward_cpu, work_best / forward_best, forwards, goal))
        print(f"{label}: {work_s / forward_s:.2f} forwards, CPU {work_cpu / forward_cpu:.2f}, "
              f"fastest {work_best / forward_best:.2f} ({work_s:.3f} s; "
              f"one forward {forward_s * 1000:.1f} ms, CPU {forward_cpu * 1000:.1f} ms; tokens run {forwards:.2f} passes)",
              flush=True)

    row("one map's 20-step deletion, dropped, intact given", "10",
        lambda: results.__setitem__("one", fa.faithfulness_curves(model, x, one, curves=("deletion",), random_order=False, intact=intact)),
        "one")
    row(f"every map's deletion curves ({len(maps)} maps + random), intact given", "50",
        lambda: results.__setitem__("del", fa.faithfulness_curves(model, x, maps, curves=("deletion",), intact=intact)),
        "del")
    row(f"every map's deletion and insertion ({len(maps)} maps + random), intact given", "50",
        lambda: results.__setitem__("all", fa.faithfulness_curves(model, x, maps, intact=intact)),
        "all")
    row("one map's 20-step deletion, painted with the mean, intact given", "-",
        lambda: results.__setitem__("mean", fa.faithfulness_curves(
            model, x, one, curves=("deletion",), random_order=False, intact=intact, mode="mean")),
        "mean")
    half = torch.zeros(1, cap.grid_size[0] * cap.grid_size[1], dtype=torch.bool)
    half[0, ::2] = True
    results["half"] = argparse.Namespace(forwards=float(fa.pass_tokens(model, half).sum()) / model.config.num_tokens)
    row("one pass on half the patch tokens", "0.5", lambda: (fa.kept_outputs(model, x, half), sync()), "half")
    print(results["all"].reading(), flush=True)
    print("deletion areas:", {k: round(v, 3) for k, v in results["all"].areas("deletion").items()})
    print("insertion areas:", {k: round(v, 3) for k, v in results["all"].areas("insertion").items()})

    # The probe: five images' tokens captured once, then only scikit-learn.
    photos = sorted((app_root() / "assets" / "samples").glob("*.[pj][np]g"))
    images = torch.cat([vx.preprocess(vx.load_image(path), model.config) for path in photos]
                       + [x.cpu().flip(-1)])[:5].to(args.device)
    tokens = vx.capture(model, images, layers=()).tokens  # (5, 13, N, D)
    prefix = model.num_prefix_tokens
    generator = torch.Generator().manual_seed(0)
    centre = [r * 14 + c for r in range(4, 10) for c in range(4, 10)]
    border = [p for p in range(196) if p not in centre]
    labels = []
    for image in range(5):  # 4 clicks of each label on each image: 40 labelled patches
        labels += [(image, centre[int(i)], "object") for i in torch.randperm(len(centre), generator=generator)[:4]]
        labels += [(image, border[int(i)], "background") for i in torch.randperm(len(border), generator=generator)[:4]]
    layer = min(8, model.config.depth)
    row("a probe on 5 images' tokens, one layer, 40 labels", "1",
        lambda: results.__setitem__("probe", pr.fit_probe(tokens[:, layer], labels, num_prefix_tokens=prefix, grid_size=(14, 14))),
        "-")
    row(f"the probe's accuracy across {model.config.depth + 1} token layers", "-",
        lambda: results.__setitem__("layers", pr.probe_layers(tokens, labels, num_prefix_tokens=prefix, grid_size=(14, 14))),
        "-")
    probe = results["probe"]
    print(f"probe: {probe.method} accuracy {probe.accuracy:.2f}; layers: "
          + ", ".join(f"{a:.2f}" for a in results["layers"].accuracies))
    print()
    print("| what | forwards (wall) | (CPU) | (fastest rounds) | (tokens run) | goal |")
    print("|---|---|---|---|---|---|")
    for label, ratio, cpu_ratio, best_ratio, forwards, goal in rows:
        tokens = "" if forwards != forwards else f"{forwards:.2f}"
        print(f"| {label} | {ratio:.2f} | {cpu_ratio:.2f} | {best_ratio:.2f} | {tokens} | {goal} |")


if __name__ == "__main__":
    main()
