"""How long the app makes a person wait with a real-size model, in forward passes of that model.

Drives the real app headless (streamlit's AppTest: the script's own time, not the browser's) with
a ViT-B/16-sized model (random weights, nothing downloaded) through the steps of a first visit,
and prints each step's seconds and its ratio to one plain forward pass of the patch-16 model,
measured in the same run, then whether the goals are met:

- the first view of any page after a new image or model: at most 8 forwards; the views a class
  pays for with its own photos tighter (issue 27): Patches' first view after a new image at most
  2, changing the patch size to 8 at most 5, Attention's first view at patch 8 at most 2;
- a rerun after moving any widget (same image and patch size): at most 1 forward at the native
  patch size, at most 2 at patch 8;
- switching between pages with nothing new: at most 0.5;
- Inside a layer: its first view at most 2 (a new image included), moving its layer, head or
  query at most 0.5, at patch 16 and at patch 8 alike.
- Several images: its first view, or a new set of images, at most 1.2 forwards per image (its
  rows give forwards per image); moving its widgets, at most 1 (all the images together).
- Compare: the first view of a new image with two ViT-B/16s side by side at most 2x one model's
  first view (the Attention page's, measured in the same round); moving its widgets at most 1.
- Knock-out (patch 16): a view of another knock-out at most 1.5; the sweep of all 144 heads at
  most 150 (it is batched from each layer's input: about 79 forwards' worth of work; on a
  real-size model a job in a worker process, timed from the click until it is drawn).
- Head types over the 4 bundled photos (issue 29): at most 6 forwards in all for the computation
  (vit_explorer.classify_heads: one batched pass of the 4 photos keeping their tokens, then every
  layer's attention again, an image at a time); on the page a job in a worker process (3 photos
  unread), timed from the click until drawn, which adds the worker's start and the model's load
  (at most 20); another head's maps on the 4 photos at most 1.
- Registers (patch 16; the model gets a register neuron planted, random weights having no
  outliers): the comparison on an image another page has captured at most 3 (the neuron search
  and the pass with the register, with their figures), another number of neurons at most 2 (one
  pass with the register and its figures); on a new image its capture comes first, as on any
  page (a first view: at most 8).
- Lesson: each step's first view with nothing computed (as for a class opening a teacher's link
  on a new picture: the capture included) at most 2 (issue 28); step 10's question shows at once
  and its sweep is asked for as a job, not computed in the view; an answer's reveal at most 1.5,
  as a knock-out view (steps 7 and 10 run the pass without a layer's MLP or the head that matters
  most, from that layer on: all of it when that head is in layer 0).

    python -m bench.app_latency            # ViT-B/16 at 224, 3 rounds on the CPU, then on CUDA if present
    python -m bench.app_latency --small    # a ViT-S/16-sized model, for a quick look
    python -m bench.app_latency --dinov3   # a DINOv3-shaped ViT-B/16: rotary positions, 4 registers
    python -m bench.app_latency --device cuda
    python -m bench.app_latency --pages knockout compare   # only those pages' steps (after loading)
    python -m bench.app_latency --pages heads --rounds 3   # the Head types steps alone
    python -m bench.app_latency --pages lesson --rounds 1  # the Lesson's ten steps and four answers
    python -m bench.app_latency --first-views  # every page's first view at patch 16 and 8, DINOv3 at 768 px
    python -m bench.app_latency --cost-model   # the cost model's ratios against measured passes

``--first-views`` (issue 36): each page's first view with nothing computed for the image (the
shared results emptied, the models kept) on a ViT-B/16 at patch 16 and at patch 8 (785 tokens)
and on a DINOv3-shaped ViT-S/16 at 768 px (2,309 tokens), in forwards of the model at its current
patch and input size (a plain pass measured just before each view, by the wall clock and by this
process's CPU time, which other sessions' load on a shared machine changes less); whether the view
stayed in the server or drew a job's button (or a switch to ask), the estimate app.costs made where
the page decided, and INLINE OVER for any view that stayed in the server above
app.costs.HEAVY_FORWARDS by its CPU time.
``--cost-model``: plain passes at 197, 785 and 2,309 tokens against the cost model's ratios
(vit_explorer.model.cost), and what its work on attention weights costs per weight, measured.

Each round starts a fresh app with empty caches; a step's ratio is the median over the rounds
(a single round on a shared 2-core machine can be off by half). The goals are the CPU's (a
laptop's); on a GPU the app runs where the server finds CUDA, and its table is printed too.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import streamlit as st
import torch
from streamlit.runtime.scriptrunner.script_cache import ScriptCache
from streamlit.testing.v1 import AppTest, app_test, local_script_runner

import vit_explorer as vx
from vit_explorer import analysis
from vit_explorer.analysis import head_types, test_time_registers
from vit_explorer.app import costs, images, memo, models, session, uploads
from vit_explorer.model import cost
from vit_explorer.model.capture import capture, layer_attention

APP = str(Path(__file__).resolve().parent.parent / "app.py")
# AppTest compiles app.py and the page again on every run (a new ScriptCache each time: 20-25 ms
# of parsing and Streamlit's AST rewriting per rerun); the server compiles each script once for
# all sessions. This process is the bench's own, so its runs share one cache, as the server's do.
_SCRIPTS = ScriptCache()
app_test.ScriptCache = local_script_runner.ScriptCache = lambda: _SCRIPTS
GOALS = {
    "first view": 8.0, "patches first view": 2.0, "patch size change": 5.0, "first view at patch 8": 2.0,
    "widget": 1.0, "widget at patch 8": 2.0, "page switch": 0.5,
    "inside first view": 2.0, "inside widget": 0.5, "several images per image": 1.2,
    "compare first view": 2.0,  # in one model's first views, not in forward passes
    "knock-out view": 1.5, "head sweep": 150.0, "lesson first view": 2.0, "lesson answer": 1.5,
    "head types": 6.0, "head types job": 20.0,
    "registers view": 3.0, "registers change": 2.0,
}
# --dinov3: what a DINOv3 ViT-B/16 changes (timm's vit_base_patch16_dinov3): no position embedding,
# rotary positions on the patch tokens' queries and keys, 4 registers, LayerScale.
DINOV3 = dict(reg_tokens=4, abs_pos_embed=False, rope_type="dinov3", init_values=1e-5, qkv_bias=False)
COMPARE = "views/compare.py"
INSIDE = "views/inside.py"
IMAGES = "views/images.py"
KNOCKOUT = "views/knockout.py"
HEADS = "views/head_types.py"
REGISTERS = "views/registers.py"
# The Registers steps' pictures: one the first steps capture, one no step has; the register neuron
# is planted on their plainest patches, and the search must find it from either.
REGISTER_IMAGES = ("photo:astronaut.png", "shapes:0")
LESSON = "views/lesson.py"


def forward_seconds(model: vx.ViT, rounds: int = 7) -> float:
    x = torch.randn(1, 3, *model.config.img_size, device=models.DEVICE)
    with torch.no_grad():
        model(x)  # warm-up
        times = []
        for _ in range(rounds):
            if models.DEVICE.type == "cuda":
                torch.cuda.synchronize()
            started = time.perf_counter()
            model(x)
            if models.DEVICE.type == "cuda":
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

    def time(self, name: str, kind: str, action, images: int = 1) -> None:
        """Time ``action``; ``images`` > 1 counts its forwards per image (one pass of each)."""
        reference = forward_seconds(self.model, rounds=3) * images
        started = time.perf_counter()
        action().run()
        seconds = time.perf_counter() - started
        if self.app.exception:
            raise RuntimeError(f"{name}: {self.app.exception[0].value}")
        self.rows.append((name, kind, seconds, reference))

    def time_call(self, name: str, kind: str, call) -> None:
        """Time ``call()``, something the app's package does, not a rerun of the app."""
        reference = forward_seconds(self.model, rounds=3)
        started = time.perf_counter()
        call()
        self.rows.append((name, kind, time.perf_counter() - started, reference))

    def time_against(self, name: str, kind: str, action, reference_step: str) -> None:
        """Time a step against an earlier step of this round instead of a plain forward pass."""
        started = time.perf_counter()
        action().run()
        seconds = time.perf_counter() - started
        if self.app.exception:
            raise RuntimeError(f"{name}: {self.app.exception[0].value}")
        reference = next(seconds for step, _, seconds, _ in self.rows if step == reference_step)
        self.rows.append((name, kind, seconds, reference))

    def page(self, path: str):
        return lambda: self.app.switch_page(path)

    def image(self, key: str):
        return lambda: self.app.selectbox(key="image_picker").set_value(key)


PAGES = ("core", "heads", "images", "knockout", "registers", "compare", "lesson")  # --pages: core is Pipeline, Patches, Attention, Inside


def run(
    small: bool, device: torch.device, pages: Sequence[str] = PAGES, dinov3: bool = False,
) -> list[tuple[str, str, float, float]]:
    """One round on ``device``: (step, kind, seconds, seconds of one plain forward pass just
    before) per step, for the steps of ``pages`` (the first two Pipeline steps always: they load
    the model and an image). ``dinov3``: the model is DINOv3-shaped (DINOV3)."""
    models.DEVICE = device  # this process is the bench's own: the app reads its device from here
    size = dict(embed_dim=384, depth=12, num_heads=6) if small else dict(embed_dim=768, depth=12, num_heads=12)
    size.update(DINOV3 if dinov3 else {})
    torch.manual_seed(0)
    model = vx.ViT(vx.ViTConfig(image_size=224, patch_size=16, num_classes=1000, **size))
    if "registers" in pages:
        model = with_register_neuron(model)
    # Removed after the round: two ViT-B/16 checkpoints are 700 MB a round, which piled up in /tmp.
    with tempfile.TemporaryDirectory(prefix="vit_explorer_latency_") as temporary:
        return _round(model, Path(temporary), size, device, pages)


def _round(model: torch.nn.Module, folder: Path, size: dict, device: torch.device, pages: Sequence[str]
           ) -> list[tuple[str, str, float, float]]:
    weights = folder / "vit_b16_random.safetensors"
    vx.save_model(model, weights)
    os.environ["VIT_EXPLORER_DEFAULT_MODEL"] = str(weights)
    uploads.UPLOADS_DIR = folder / "uploads"
    model = model.to(models.DEVICE).eval()
    st.cache_data.clear()
    st.cache_resource.clear()

    app = AppTest.from_file(APP, default_timeout=600)
    steps = Steps(app, model)
    # Model load and the first image: counted as the first view of Pipeline.
    steps.time("Pipeline: first view (new model)", "first view", lambda: app)
    steps.time("Pipeline: first view after a new image", "first view", steps.image("photo:astronaut.png"))
    if "heads" in pages:  # first: the photos but the sidebar's are read by no page yet
        head_types_steps(app, steps, model)
    if "images" in pages:  # first: its photos are not yet captured by the core steps' pages
        image_set_steps(app, steps)
    if "core" in pages:
        core_steps(app, steps)
        patch_8_steps(app, steps)
    if "knockout" in pages:
        knockout_steps(app, steps)
    if "registers" in pages:
        registers_steps(app, steps)
    if "compare" in pages:
        compare(app, steps, folder, size)
    if "lesson" in pages:  # last: its sweep is a job, whose worker would share the cores with later steps
        lesson_steps(app, steps)
    return steps.rows


def core_steps(app: AppTest, steps: Steps) -> None:
    steps.time("Patches: first view", "patches first view", steps.page("views/patches.py"))
    steps.time("Attention: first view", "first view", steps.page("views/attention.py"))
    steps.time("Attention: move the layer slider", "widget", lambda: widget(app.slider, "Layer").set_value(3))
    steps.time("Attention: choose another head", "widget", lambda: widget(app.selectbox, "Head").set_value(2))
    steps.time("Attention: move the discard slider", "widget",
               lambda: widget(app.slider, "Discard the weakest share of weights").set_value(0.5))
    steps.time("Inside a layer: first view", "inside first view", steps.page(INSIDE))
    steps.time("Inside a layer: move the layer slider", "inside widget",
               lambda: widget(app.slider, "Layer").set_value(5))
    steps.time("Inside a layer: choose another head", "inside widget",
               lambda: widget(app.selectbox, "Head").set_value(4))
    steps.time("Inside a layer: choose another query", "inside widget",
               lambda: widget(app.selectbox, "Query token").set_value(100))
    steps.time("Inside a layer: a new image", "inside first view", steps.image("photo:chelsea.png"))
    steps.time("Attention: first view of that image", "first view", steps.page("views/attention.py"))
    steps.time("Attention: a new image", "first view", steps.image("photo:coffee.png"))
    # The image changed on Attention, so Pipeline draws its own figures of it for the first time.
    steps.time("Pipeline: first view of that image", "first view", steps.page("views/pipeline.py"))
    steps.time("Attention: back (nothing new)", "page switch", steps.page("views/attention.py"))
    steps.time("Pipeline: back (nothing new)", "page switch", steps.page("views/pipeline.py"))
    steps.time("Patches: first view after a new image", "patches first view", steps.page("views/patches.py"))
    steps.time("Patches: move the PCA slider", "widget",
               lambda: widget(app.slider, "Tokens after this many layers (0: the patch embeddings)").set_value(4))


def head_types_steps(app: AppTest, steps: Steps, model: vx.ViT) -> None:
    """Head types over the 4 bundled photos: the computation itself in the package, then the page,
    where the sidebar's photo (astronaut) is captured and the 3 others are read by the job."""
    config = model.config
    x = torch.cat([vx.preprocess(images.photo(name), config) for name in images.photo_names()]).to(models.DEVICE)
    steps.time_call("Head types: 4 photos in the package", "head types", lambda: vx.classify_heads(model, x))
    app.switch_page(HEADS).run()  # the button (untimed: nothing computed)
    steps.time("Head types: 4 photos on the page (a job, until drawn)", "head types job", lambda: Drawn(
        app, "Measure the heads", "Every head's type over 4 pictures"
    ))
    steps.time("Head types: another head's maps", "widget", lambda: widget(app.selectbox, "Head").set_value(5))
    steps.time("Head types: another layer's", "widget", lambda: widget(app.selectbox, "Layer").set_value(7))


def image_set_steps(app: AppTest, steps: Steps) -> None:
    """Several images: the sidebar's photo (Pipeline captured it) and two more in one batch, a
    fourth, then three that no page has captured."""
    steps.time("Several images: first view (3 photos)", "several images per image", steps.page(IMAGES), images=3)
    steps.time("Several images: move the threshold", "widget",
               lambda: widget(app.slider, "Foreground threshold (standard deviations)").set_value(0.5))
    steps.time("Several images: compare keys instead", "widget",
               lambda: app.radio(key="set_facet").set_value("keys"))
    steps.time("Several images: another layer", "widget", lambda: widget(app.slider, "Layer").set_value(8))
    steps.time("Several images: a fourth image", "several images per image",
               lambda: app.multiselect(key="image_set").select("photo:rocket.jpg"), images=4)
    steps.time("Several images: three new images (none captured)", "several images per image",
               lambda: new_set(app.multiselect(key="image_set"), ["shapes:0", "shapes:1", "shapes:5"]), images=3)


def new_set(picker, keys: list[str]):
    """The multiselect ``picker`` holding ``keys`` instead of what it holds (the Pipeline page's
    first view captured shapes:4, the default image, and image sets keep no capture for later steps)."""
    for key in list(picker.value):
        picker = picker.unselect(key)
    for key in keys:
        picker = picker.select(key)
    return picker


def patch_8_steps(app: AppTest, steps: Steps) -> None:
    app.switch_page("views/patches.py").run()  # back where the patch size is (untimed: nothing new)
    steps.time("Patches: change the patch size to 8", "patch size change",
               lambda: widget(app.select_slider, "Patch size").set_value(8))
    steps.time("Pipeline at patch 8: first view", "first view", steps.page("views/pipeline.py"))
    steps.time("Attention at patch 8: first view", "first view at patch 8", steps.page("views/attention.py"))
    steps.time("Attention at patch 8: move the layer slider", "widget at patch 8",
               lambda: widget(app.slider, "Layer").set_value(5))
    steps.time("Attention at patch 8: choose another head", "widget at patch 8",
               lambda: widget(app.selectbox, "Head").set_value(1))
    steps.time("Patches at patch 8: back (nothing new)", "page switch", steps.page("views/patches.py"))
    steps.time("Attention at patch 8: back (nothing new)", "page switch", steps.page("views/attention.py"))
    steps.time("Inside a layer at patch 8: first view", "inside first view", steps.page(INSIDE))
    steps.time("Inside a layer at patch 8: move the layer slider", "inside widget",
               lambda: widget(app.slider, "Layer").set_value(2))
    steps.time("Inside a layer at patch 8: choose another head", "inside widget",
               lambda: widget(app.selectbox, "Head").set_value(7))
    steps.time("Inside a layer at patch 8: choose another query", "inside widget",
               lambda: widget(app.selectbox, "Query token").set_value(400))
    # Not "nothing new": the layer, head and query are shared, and Inside a layer has just moved them.
    steps.time("Attention at patch 8: the layer, head and query Inside chose", "widget at patch 8",
               steps.page("views/attention.py"))


def knockout_steps(app: AppTest, steps: Steps) -> None:
    """Knock-out at the native patch size (untimed: back to patch 16, whose capture is cached)."""
    app.switch_page("views/patches.py").run()
    widget(app.select_slider, "Patch size").set_value(16).run()
    steps.time("Knock-out: first view", "first view", steps.page(KNOCKOUT))
    steps.time("Knock-out: knock out a head", "knock-out view",
               lambda: widget(app.multiselect, "Layer 5").set_value([3]))
    steps.time("Knock-out: switch to mean-ablation", "knock-out view",
               lambda: app.radio(key="knockout_mode").set_value("mean"))
    steps.time("Knock-out: remove an MLP branch too", "knock-out view",
               lambda: widget(app.multiselect, "Remove the MLP branch of layers").set_value([8]))
    steps.time("Knock-out: the sweep of every head (a job, until drawn)", "head sweep", lambda: Drawn(
        app, "Run the sweep", "Each head knocked out alone"
    ))


def with_register_neuron(model: vx.ViT) -> vx.ViT:
    """``model`` with a register neuron in its middle layer that fires on the 8 plainest patches of
    each of REGISTER_IMAGES and writes a large vector there (test_time_registers.plant_register_neuron)."""
    config = model.config
    x = torch.cat([vx.preprocess(images.resolve_image(key, config.img_size)[1], config) for key in REGISTER_IMAGES])
    fire = test_time_registers.low_information_patches(x, config.patch_size, 8)
    return test_time_registers.plant_register_neuron(model.eval(), x, fire, config.depth // 2)


def registers_steps(app: AppTest, steps: Steps) -> None:
    """Registers at patch 16 (untimed: back to patch 16 and to the first picture, both captured)."""
    app.switch_page("views/patches.py").run()
    widget(app.select_slider, "Patch size").set_value(16).run()
    app.selectbox(key="image_picker").set_value(REGISTER_IMAGES[0]).run()
    steps.time("Registers: first view (image captured already)", "registers view", steps.page(REGISTERS))
    steps.time("Registers: fewer register neurons", "registers change",
               lambda: widget(app.slider, "Register neurons").set_value(5))
    steps.time("Registers: another layer's heads", "widget", lambda: widget(app.slider, "Layer").set_value(3))
    steps.time("Registers: a new image (its capture too)", "first view", steps.image(REGISTER_IMAGES[1]))


class Drawn:
    """The click on a job's button, then reruns (as the page's live fragment does) until a chart
    whose spec holds ``drawn`` is there: on a real-size model the job is computed beside the server."""

    def __init__(self, app: AppTest, button: str, drawn: str):
        self.app, self.button, self.drawn = app, button, drawn

    def run(self) -> AppTest:
        app = widget(self.app.button, self.button).click().run()
        deadline = time.monotonic() + 1200
        while not any(self.drawn in chart.proto.spec for chart in app.get("plotly_chart")):
            if app.exception or time.monotonic() > deadline:
                raise RuntimeError(f"{self.drawn!r} was not drawn: {[error.value for error in app.error]}")
            time.sleep(0.1)
            app.run()
        return app


def compare(app: AppTest, steps: Steps, folder: Path, size: dict) -> None:
    """The Compare page's steps: a new image with B a second ViT-B/16 (another random checkpoint,
    as if uploaded), then with B the same model at another patch size, against one model's new
    image on the Attention page."""
    app.switch_page("views/patches.py").run()
    widget(app.select_slider, "Patch size").set_value(16).run()
    one_model = "Attention: a new image (one model's first view)"
    app.switch_page("views/attention.py").run()
    steps.time(one_model, "first view", steps.image("shapes:3"))  # an image no step saw before
    torch.manual_seed(1)
    other = folder / "vit_b16_other.safetensors"
    vx.save_model(vx.ViT(vx.ViTConfig(image_size=224, patch_size=16, num_classes=1000, **size)), other)
    app.session_state["uploaded_models"] = {f"file:{other}": "Uploaded: another random ViT-B/16"}
    app.switch_page(COMPARE).run()
    app.selectbox(key="compare_model").set_value(f"file:{other}").run()
    steps.time_against("Compare: a new image (B: another ViT-B/16)", "compare first view",
                       steps.image("shapes:1"), one_model)
    steps.time("Compare: move the layer slider", "widget", lambda: widget(app.slider, "A's layer").set_value(4))
    steps.time("Compare: query an image point", "widget", lambda: widget(app.radio, "Query").set_value("image point"))
    app.selectbox(key="compare_model").set_value(session.SAME_MODEL).run()
    b_patch = widget(app.select_slider, "B's patch size").value
    steps.time_against(f"Compare: a new image (B: the same at patch {b_patch})", "compare first view",
                       steps.image("shapes:2"), one_model)


def lesson_steps(app: AppTest, steps: Steps) -> None:
    """Each step of the Lesson at the native patch size, with nothing computed before it (the
    shared results emptied, the model kept), then its four answers."""
    app.switch_page("views/patches.py").run()
    widget(app.select_slider, "Patch size").set_value(16).run()
    app.switch_page(LESSON).run()
    for number in range(1, 11):
        memo.shared_results().clear()
        steps.time(f"Lesson {number}: first view (nothing computed)", "lesson first view",
                   lambda number=number: app.selectbox(key="lesson_step_picker").set_value(number))
        if number == 4:
            steps.time("Lesson 4: answer (a patch)", "lesson answer",
                       lambda: app.selectbox(key="lesson_answer_patch").set_value(100))
        elif number == 5:
            steps.time("Lesson 5: answer (half the scale)", "lesson answer",
                       lambda: app.radio(key="lesson_answer_scale").set_value("flatter"))
        elif number == 7:
            steps.time("Lesson 7: answer (layer 6's MLP removed)", "lesson answer",
                       lambda: app.radio(key="lesson_answer_mlp").set_value("yes"))
    deadline = time.monotonic() + 1200
    while any("beside the server" in bar.proto.text for bar in app.get("progress")) or any(
        "Waiting for its turn" in info.value for info in app.info
    ):  # the sweep's job, queued or running
        if app.exception or time.monotonic() > deadline:
            raise RuntimeError(f"the lesson's sweep did not finish: {[error.value for error in app.error]}")
        time.sleep(1)
        app.run()
    steps.time("Lesson 10: answer, the sweep done (a head)", "lesson answer",
               lambda: app.selectbox(key="lesson_answer_head").set_value(40))


# --- every page's first view, in forwards of the model at its current sizes (--first-views) --------

VIEWS = (
    "views/pipeline.py", "views/patches.py", "views/attention.py", "views/inside.py", IMAGES, HEADS, KNOCKOUT,
    REGISTERS, COMPARE, LESSON, "views/features.py", "views/patching.py",
)
# What a page draws in place of work that is a job (a button) or waits to be asked for (a switch).
JOB_BUTTONS = (
    "Run model B", "Measure the heads", "Read the pictures", "Compare all", "Search the photos", "Run the sweep",
    "Roll the attention out", "Measure every head", "Estimate every cell", "Patch every cell",
)
ASKED_SWITCHES = ("Compute the attribution", "Read the picture", "Compute the relevance")
SETTINGS = {  # name -> (the model's size, its patch size in the app, its input size)
    "ViT-B/16 at patch 16": (dict(embed_dim=768, depth=12, num_heads=12), 16, 224),
    "ViT-B/16 at patch 8": (dict(embed_dim=768, depth=12, num_heads=12), 8, 224),
    "DINOv3-shaped ViT-S/16 at 768 px": (dict(embed_dim=384, depth=12, num_heads=6, num_classes=0, **DINOV3), 16, 768),
}


def first_views(settings: Sequence[str] = tuple(SETTINGS), pages: Sequence[str] = VIEWS) -> list[tuple]:
    """(setting, page, seconds, seconds of one plain pass of the model at its current sizes, the
    largest estimate app.costs.is_heavy saw, what the page deferred) per setting and page."""
    decided: list[float] = []
    original = costs.is_heavy

    def recording(config, forwards, timed=True):
        decided.append(forwards)
        return original(config, forwards, timed)

    costs.is_heavy = recording
    rows = []
    try:
        for name in settings:
            size, patch, image_size = SETTINGS[name]
            size = {"num_classes": 1000, **size}
            torch.manual_seed(0)
            model = vx.ViT(vx.ViTConfig(image_size=image_size, patch_size=16, **size))
            with tempfile.TemporaryDirectory(prefix="vit_explorer_first_views_") as temporary:
                app, current = _app_at(model, Path(temporary), patch)
                for page in pages:
                    memo.shared_results().clear()  # nothing computed for this image: a first view
                    reference, reference_cpu = _pass_seconds(current)
                    decided.clear()
                    started, started_cpu = time.perf_counter(), time.process_time()
                    app.switch_page(page).run()
                    seconds, cpu = time.perf_counter() - started, time.process_time() - started_cpu
                    if app.exception:
                        raise RuntimeError(f"{name}, {page}: {app.exception[0].value}")
                    deferred = [button.label for button in app.button if button.label.startswith(JOB_BUTTONS)]
                    deferred += [f"asked: {toggle.label}" for toggle in app.toggle if toggle.label.startswith(ASKED_SWITCHES)]
                    rows.append((name, page, seconds, reference, cpu / reference_cpu, max(decided, default=None), deferred))
                    print(_first_view_row(rows[-1]), flush=True)
    finally:
        costs.is_heavy = original
    return rows


def _app_at(model: vx.ViT, folder: Path, patch: int) -> tuple[AppTest, vx.ViT]:
    """A fresh app on ``model`` (random weights, saved as the default model) at ``patch``, on the
    sidebar's astronaut; the shared model at that patch size."""
    weights = folder / "random.safetensors"
    vx.save_model(model, weights)
    os.environ["VIT_EXPLORER_DEFAULT_MODEL"] = str(weights)
    uploads.UPLOADS_DIR = folder / "uploads"
    st.cache_data.clear()
    st.cache_resource.clear()
    app = AppTest.from_file(APP, default_timeout=1200).run()
    app.selectbox(key="image_picker").set_value("photo:astronaut.png").run()
    if patch != model.config.patch_size:
        app.switch_page("views/patches.py").run()
        widget(app.select_slider, "Patch size").set_value(patch).run()
    current = models.model_at(models.DEFAULT_MODEL, patch, model.config.img_size)
    return app, current


def _pass_seconds(model: vx.ViT, rounds: int = 3) -> tuple[float, float]:
    """(wall-clock, CPU) seconds of one plain pass of ``model``, the shortest of ``rounds`` each."""
    x = torch.randn(1, model.config.in_chans, *model.config.img_size, device=models.DEVICE)
    wall = cpu = float("inf")
    with torch.no_grad():
        model(x)  # warm-up
        for _ in range(rounds):
            started, started_cpu = time.perf_counter(), time.process_time()
            model(x)
            wall, cpu = min(wall, time.perf_counter() - started), min(cpu, time.process_time() - started_cpu)
    return wall, cpu


def _over(row: tuple) -> bool:
    """Whether a view stayed in the server above HEAVY_FORWARDS, by the CPU time this process spent
    on it (which other sessions' load on the machine changes less than the wall clock)."""
    return not row[6] and row[4] > costs.HEAVY_FORWARDS


def _first_view_row(row: tuple) -> str:
    name, page, seconds, reference, cpu_forwards, estimate, deferred = row
    said = "-" if estimate is None else f"{estimate:.2f}"
    where = "; ".join(deferred) if deferred else "in the server"
    return (f"{name:<34} {page.removeprefix('views/'):<15} {seconds:7.2f} {seconds / reference:9.2f} {cpu_forwards:9.2f}"
            f" {said:>9}  {where}{'  INLINE OVER ' + str(costs.HEAVY_FORWARDS) if _over(row) else ''}")


def report_first_views(rows: list[tuple]) -> bool:
    """The table (forwards: wall-clock and CPU seconds over a plain pass's measured just before);
    whether every view that stayed in the server took at most HEAVY_FORWARDS."""
    print(f"\n{'setting':<34} {'page':<15} {'seconds':>7} {'forwards':>9} {'CPU fwds':>9} {'estimate':>9}  where its work ran")
    for row in rows:
        print(_first_view_row(row))
    over = [row for row in rows if _over(row)]
    print(f"{len(over)} view(s) stayed in the server above {costs.HEAVY_FORWARDS} forwards" if over else
          f"every view that stayed in the server took at most {costs.HEAVY_FORWARDS} forwards")
    return not over


# --- the cost model against measured passes (--cost-model) -------------------------------------------


def cost_model(rounds: int = 5) -> None:
    """Plain passes of a ViT-B/16 at 197 and 785 tokens and of a DINOv3-shaped ViT-S/16 at 201 and
    2,309 tokens, interleaved, the shortest of ``rounds`` each: their ratios against the cost
    model's (model.cost.pass_cost); then what the work on attention weights outside a pass costs
    per weight, in multiply-add equivalents of that model's pass (model.cost's constants)."""
    torch.manual_seed(0)
    base = dict(embed_dim=768, depth=12, num_heads=12, num_classes=1000)
    small = dict(embed_dim=384, depth=12, num_heads=6, num_classes=0, **DINOV3)
    built = {
        "ViT-B/16 at 224 (197 tokens)": vx.ViT(vx.ViTConfig(image_size=224, patch_size=16, **base)),
        "ViT-B/16 at patch 8 (785 tokens)": vx.ViT(vx.ViTConfig(image_size=224, patch_size=8, **base)),
        "DINOv3-shaped ViT-S/16 at 224 (201 tokens)": vx.ViT(vx.ViTConfig(image_size=224, patch_size=16, **small)),
        "DINOv3-shaped ViT-S/16 at 768 (2,309 tokens)": vx.ViT(vx.ViTConfig(image_size=768, patch_size=16, **small)),
    }
    seconds = {name: float("inf") for name in built}
    with torch.no_grad():
        for _ in range(max(rounds, 1)):
            for name, model in built.items():
                seconds[name] = min(seconds[name], forward_seconds(model.eval(), rounds=1))
    names = list(built)
    print("passes: measured ratio / cost model ratio (the pass's multiply-adds: linear with the tokens, attention with their square)")
    for small_name, large_name in ((names[0], names[1]), (names[2], names[3])):
        measured = seconds[large_name] / seconds[small_name]
        model = cost.pass_cost(built[large_name].config) / cost.pass_cost(built[small_name].config)
        print(f"  {large_name} / {small_name}: measured {measured:.2f}, cost model {model:.2f}"
              f" ({seconds[large_name] * 1000:.0f} / {seconds[small_name] * 1000:.0f} ms; measured / model {measured / model:.2f})")
    print("work on attention weights, multiply-add equivalents per weight of that model's pass (model.cost's constant):")
    for name, model in built.items():
        _per_weight(name, model.eval(), seconds[name], rounds)


def _per_weight(name: str, model: vx.ViT, pass_seconds: float, rounds: int) -> None:
    config = model.config
    x = torch.randn(1, config.in_chans, *config.img_size, device=models.DEVICE)
    per_second = cost.pass_cost(config) / pass_seconds  # multiply-adds a second in this model's pass
    kept = models.keeps_every_layer(config)
    with torch.no_grad():
        captured = capture(model, x, layers=None if kept else (), attention_dtype=torch.float16)
        tokens = captured.tokens.expand(4, -1, -1, -1).contiguous()
        one_layer = layer_attention(model, tokens[:, 3], 3)  # (4, H, N, N)

        def best(work) -> float:
            work()
            return min(_timed(work) for _ in range(max(rounds, 1)))

        recorded = best(lambda: capture(model, x, layers=None, attention_dtype=torch.float16)) if kept else None
        again = best(lambda: layer_attention(model, tokens[:1, 3], 3))
        statistics = best(lambda: (analysis.head_distances(one_layer[:1], captured.grid_size, config.patch_size,
                                                          captured.num_prefix_tokens), analysis.head_entropies(one_layer[:1])))
        measured = best(lambda: head_types._layer_measures([one_layer], None, captured.grid_size, config.patch_size,
                                                           captured.num_prefix_tokens))
    layer = cost.weights(config, layers=1)
    dim, tokens_count = config.embed_dim, config.num_tokens
    figures = {
        "RECORDED": None if recorded is None else (recorded - pass_seconds) * per_second / cost.weights(config),
        "RECOMPUTED": (again * per_second - (3 * tokens_count * dim * dim + tokens_count**2 * dim)) / layer,
        "READ": statistics * per_second / layer,
        "MEASURED": measured * per_second / (4 * layer),
    }
    said = ", ".join(
        f"{key} {'-' if value is None else f'{value:.0f}'} ({getattr(cost, key)})" for key, value in figures.items()
    )
    print(f"  {name}: {said}")


def _timed(work) -> float:
    started = time.perf_counter()
    work()
    return time.perf_counter() - started


def report(name: str, device: torch.device, rounds: list[list[tuple[str, str, float, float]]]) -> bool:
    """Print each step's median seconds and ratio over the rounds; whether every goal was met."""
    median = statistics.median(
        reference for rows in rounds for _, kind, _, reference in rows if kind != "compare first view"
    )
    print(f"{name} at 224 on {device.type}: one plain forward pass = {median * 1000:.0f} ms (median)")
    print(f"{'step':<50} {'seconds':>8} {'forwards':>9} {'range':>11}  goal (medians of {len(rounds)} rounds)")
    met = True
    for steps in zip(*rounds):
        step, kind = steps[0][:2]
        ratios = [seconds / reference for _, _, seconds, reference in steps]
        ratio = statistics.median(ratios)
        seconds = statistics.median(seconds for _, _, seconds, _ in steps)
        ok = ratio <= GOALS[kind]
        met &= ok
        spread = f"{min(ratios):.2f}-{max(ratios):.2f}"
        unit = " one-model first views" if kind == "compare first view" else ""
        print(f"{step:<50} {seconds:8.2f} {ratio:9.2f} {spread:>11}  <= {GOALS[kind]:g}{unit} {'ok' if ok else 'MISSED'}")
    print("all goals met" if met else "some goals missed")
    return met


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="a ViT-S/16-sized model instead of ViT-B/16")
    parser.add_argument(
        "--dinov3", action="store_true",
        help="DINOv3-shaped: rotary positions and no position embedding, 4 registers, LayerScale",
    )
    parser.add_argument("--rounds", type=int, default=3, help="fresh runs of every step (default 3)")
    parser.add_argument(
        "--pages", nargs="+", choices=PAGES, default=PAGES,
        help="whose steps to time (default all): core (Pipeline, Patches, Attention, Inside a layer),"
        " heads (Head types), images (Several images), knockout, registers, compare, lesson",
    )
    parser.add_argument(
        "--device", choices=("all", "cpu", "cuda"), default="all",
        help="where the app runs the model (default: the CPU, then CUDA if present)",
    )
    parser.add_argument(
        "--first-views", action="store_true",
        help="every page's first view at patch 16 and 8 (ViT-B/16) and at 768 px (DINOv3-shaped ViT-S/16), on the CPU",
    )
    parser.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS), help="with --first-views")
    parser.add_argument("--cost-model", action="store_true", help="the cost model's ratios against measured passes")
    args = parser.parse_args()
    if args.cost_model:
        cost_model(args.rounds)
    if args.first_views:
        report_first_views(first_views(args.settings))
    if args.cost_model or args.first_views:
        return
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: this machine has no CUDA GPU")
    devices = ["cpu", "cuda"] if args.device == "all" else [args.device]
    name = ("DINOv3-shaped " if args.dinov3 else "") + ("ViT-S/16" if args.small else "ViT-B/16")
    for device in map(torch.device, devices):
        if device.type == "cuda" and not torch.cuda.is_available():
            print("No CUDA GPU here: the GPU figures need a machine with one.")
            continue
        report(name, device, [run(args.small, device, args.pages, args.dinov3) for _ in range(max(args.rounds, 1))])


if __name__ == "__main__":
    main()
