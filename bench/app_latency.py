"""How long the app makes a person wait with a real-size model, in forward passes of that model.

Drives the real app headless (streamlit's AppTest: the script's own time, not the browser's) with
a ViT-B/16-sized model (random weights, nothing downloaded) through the steps of a first visit,
and prints each step's seconds and its ratio to one plain forward pass of the patch-16 model,
measured in the same run, then whether the goals are met:

- the first view of any page after a new image or model: at most 8 forwards;
- a rerun after moving any widget (same image and patch size): at most 1 forward at the native
  patch size, at most 2 at patch 8;
- switching between pages with nothing new: at most 0.5.

    python -m bench.app_latency            # ViT-B/16 at 224 (on CUDA when present)
    python -m bench.app_latency --small    # a ViT-S/16-sized model, for a quick look
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import streamlit as st
import torch
from streamlit.testing.v1 import AppTest

import vit_explorer as vx
from vit_explorer import ui

APP = str(Path(__file__).resolve().parent.parent / "app.py")
GOALS = {"first view": 8.0, "widget": 1.0, "widget at patch 8": 2.0, "page switch": 0.5}


def forward_seconds(model: vx.ViT, rounds: int = 7) -> float:
    x = torch.randn(1, 3, *model.config.img_size, device=ui.DEVICE)
    with torch.no_grad():
        model(x)  # warm-up
        times = []
        for _ in range(rounds):
            if ui.DEVICE.type == "cuda":
                torch.cuda.synchronize()
            started = time.perf_counter()
            model(x)
            if ui.DEVICE.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - started)
    return statistics.median(times)


def widget(widgets, label: str):
    return next(w for w in widgets if w.label == label)


class Steps:
    """Times AppTest reruns; keeps (step, kind, seconds, seconds of a plain forward) rows.

    The plain forward is measured again right before each step, so that the ratio holds even
    when something else on the machine slows both down for a while.
    """

    def __init__(self, app: AppTest, model: vx.ViT):
        self.app = app
        self.model = model
        self.rows: list[tuple[str, str, float, float]] = []

    def time(self, name: str, kind: str, action) -> None:
        reference = forward_seconds(self.model, rounds=3)
        started = time.perf_counter()
        action().run()
        seconds = time.perf_counter() - started
        if self.app.exception:
            raise RuntimeError(f"{name}: {self.app.exception[0].value}")
        self.rows.append((name, kind, seconds, reference))

    def page(self, path: str):
        return lambda: self.app.switch_page(path)

    def image(self, key: str):
        return lambda: self.app.selectbox(key="image_picker").set_value(key)


def run(small: bool) -> list[tuple[str, str, float, float]]:
    """(step, kind, seconds, seconds of one plain forward pass just before) for every step."""
    size = dict(embed_dim=384, depth=12, num_heads=6) if small else dict(embed_dim=768, depth=12, num_heads=12)
    torch.manual_seed(0)
    model = vx.ViT(vx.ViTConfig(image_size=224, patch_size=16, num_classes=1000, **size))
    folder = Path(tempfile.mkdtemp(prefix="vit_explorer_latency_"))
    weights = folder / "vit_b16_random.safetensors"
    vx.save_model(model, weights)
    os.environ["VIT_EXPLORER_DEFAULT_MODEL"] = str(weights)
    ui.UPLOADS_DIR = folder / "uploads"
    model = model.to(ui.DEVICE).eval()
    st.cache_data.clear()
    st.cache_resource.clear()

    app = AppTest.from_file(APP, default_timeout=600)
    steps = Steps(app, model)
    # Model load and the first image: counted as the first view of Pipeline.
    steps.time("Pipeline: first view (new model)", "first view", lambda: app)
    steps.time("Pipeline: first view after a new image", "first view", steps.image("photo:astronaut.png"))
    steps.time("Patches: first view", "first view", steps.page("views/patches.py"))
    steps.time("Attention: first view", "first view", steps.page("views/attention.py"))
    steps.time("Attention: move the layer slider", "widget", lambda: widget(app.slider, "Layer").set_value(3))
    steps.time("Attention: choose another head", "widget", lambda: widget(app.selectbox, "Head").set_value(2))
    steps.time("Attention: move the discard slider", "widget",
               lambda: widget(app.slider, "Discard the weakest share of weights").set_value(0.5))
    steps.time("Attention: a new image", "first view", steps.image("photo:coffee.png"))
    steps.time("Pipeline: back (nothing new)", "page switch", steps.page("views/pipeline.py"))
    steps.time("Attention: back (nothing new)", "page switch", steps.page("views/attention.py"))
    steps.time("Patches: first view after a new image", "first view", steps.page("views/patches.py"))
    steps.time("Patches: move the PCA slider", "widget",
               lambda: widget(app.slider, "Tokens after this many layers (0: the patch embeddings)").set_value(4))
    steps.time("Patches: change the patch size to 8", "first view",
               lambda: widget(app.select_slider, "Patch size").set_value(8))
    steps.time("Pipeline at patch 8: first view", "first view", steps.page("views/pipeline.py"))
    steps.time("Attention at patch 8: first view", "first view", steps.page("views/attention.py"))
    steps.time("Attention at patch 8: move the layer slider", "widget at patch 8",
               lambda: widget(app.slider, "Layer").set_value(5))
    steps.time("Attention at patch 8: choose another head", "widget at patch 8",
               lambda: widget(app.selectbox, "Head").set_value(1))
    steps.time("Patches at patch 8: back (nothing new)", "page switch", steps.page("views/patches.py"))
    steps.time("Attention at patch 8: back (nothing new)", "page switch", steps.page("views/attention.py"))
    return steps.rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="a ViT-S/16-sized model instead of ViT-B/16")
    args = parser.parse_args()
    rows = run(args.small)
    name = "ViT-S/16" if args.small else "ViT-B/16"
    median = statistics.median(reference for *_, reference in rows)
    print(f"{name} at 224 on {ui.DEVICE.type}: one plain forward pass = {median * 1000:.0f} ms (median)")
    print(f"{'step':<50} {'seconds':>8} {'forwards':>9}  goal")
    met = True
    for step, kind, seconds, reference in rows:
        ratio = seconds / reference
        ok = ratio <= GOALS[kind]
        met &= ok
        print(f"{step:<50} {seconds:8.2f} {ratio:9.2f}  <= {GOALS[kind]:g} {'ok' if ok else 'MISSED'}")
    print("all goals met" if met else "some goals missed")


if __name__ == "__main__":
    main()
