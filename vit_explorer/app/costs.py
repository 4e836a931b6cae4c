"""What a view may cost, in one room: the passes timed on this server (``PassTimes``), what each
page's view computes unasked in passes of its model at its current patch and input size (the
cost model of vit_explorer.model.cost: a pass's linear part grows with the tokens, its attention
with their square, and work on the attention weights outside the pass, a rollout's N^3, several
images' batch, a second model are counted too), the rule that keeps a view in the server or makes
it a job (``is_heavy``), and the plan the Patches page's every-size comparison runs, counts, times
and summarises, once per model for everybody where it does not depend on the image.

The rule: a view stays in the server if it costs at most HEAVY_FORWARDS passes of its model at
its current sizes, or if it is quick anyway (its passes, in seconds from the pass timed on this
server, scaled by the cost model to the view's tokens and batch, or in multiply-adds before any
is timed, within QUICK_SECONDS or QUICK_COST: a tiny model's views); more is a job
(vit_explorer.app.jobs) or waits to be asked for.
"""
from __future__ import annotations

import json
import math
import threading
from collections.abc import Sequence
from dataclasses import replace

import streamlit as st
from PIL import Image

from ..analysis import patch_sizes
from ..analysis.faithfulness import planned_forwards
from ..analysis.patch_sizes import PlannedSize, Progress
from ..analysis.test_time_registers import SEARCH_PASSES
from ..data.datasets import SHAPE_CLASSES, ImageDataset
from ..data.images import preprocess
from ..model import cost
from ..model.ablation import sweep_cost
from ..model.vit import ViT
from ..training.admission import environment_number
from . import models
from .images import SHAPE_SAMPLES
from .memo import memo, shared_results

# Selection and ImageSet (app.selection, which imports this module to record its passes' times)
# are named in annotations only.

# Work a view does unasked: about 3 forward passes of a ViT-S/16 at 224, in multiply-adds (the
# estimate before any pass of the model has been timed) and in seconds (once one has:
# pass_times). QUICK_COST's 13e9 multiply-adds took 0.12 s on the 2-core machine: a ViT-S/16
# at 224 is 4.6e9 in 42 ms (a plain pass, median of 9, quiet, torch 2.14, 2026-11-25); a server
# with faster cores or a GPU then does more unasked, a slower one less.
# VIT_EXPLORER_QUICK_SECONDS sets the time (0: nothing once timed is quick).
QUICK_COST = 13e9
QUICK_SECONDS = environment_number("VIT_EXPLORER_QUICK_SECONDS", 0.12, float, minimum=0)
# A view whose work is at most this many passes of its model at its current patch and input size
# stays in the server, like any page's own capture; more is a job unless it is quick anyway.
HEAVY_FORWARDS = 3
# Held-out images per patch size on the Patches page: the shipped model's comparison at all its
# patch sizes then stays within QUICK_COST (and is computed once per model for everybody).
HELD_OUT_IMAGES = 128
# A class attribution (or a prompt's relevance): a forward and a backward pass, about 3 forwards.
ATTRIBUTION_FORWARDS = 3.0


def forward_cost(config, patch_size: int | None = None) -> float:
    """Multiply-adds of one image's forward pass (patch embedding and blocks: model.cost), to
    compare patch sizes and models."""
    tokens = models.token_count(config, patch_size or config.patch_size)
    return cost.forward_cost(config, tokens)


def pass_cost(config, patch_size: int | None = None, images: int = 1) -> float:
    """:func:`forward_cost` of a batch of ``images`` plus the operators' fixed overhead."""
    return cost.pass_cost(config, models.token_count(config, patch_size or config.patch_size), images)


# --- the passes timed on this server ----------------------------------------------------------


class PassTimes:
    """The shortest forward pass seen of each model shape, in seconds: what decides which views
    are quick on this server (:func:`is_quick`). Keyed by the config at its patch and input size
    (a pass's time depends on the architecture and sizes, not on the weights: two checkpoints of
    one shape share it), at most ``size`` shapes, the least recently recorded forgotten first. A
    size not timed yet is estimated from the nearest size of the same architecture that was, scaled
    by the cost model (:meth:`seconds`).

    The shortest, not the latest: a pass timed while the class loads the cores takes twice as long,
    and views should not turn into jobs and back with the load of the moment; once a quiet pass
    has been seen, a view stays what it is. Every session records into it: changed under a lock."""

    def __init__(self, size: int = 256):
        self.size = size
        self._seconds: dict = {}  # shape -> seconds, in order of recording
        self._lock = threading.Lock()

    @staticmethod
    def _shape(config):
        return config.replace(image_size=config.img_size)  # 224 and (224, 224) are one size

    @staticmethod
    def _architecture(config) -> str:
        """The config without its patch and input size: the shapes a timed pass scales to."""
        fields = {name: value for name, value in config.to_dict().items() if name not in ("image_size", "patch_size")}
        return json.dumps(fields, sort_keys=True, default=str)

    def record(self, config, seconds: float) -> None:
        shape = self._shape(config)
        with self._lock:
            seconds = min(seconds, self._seconds.pop(shape, seconds))
            self._seconds[shape] = seconds
            while len(self._seconds) > self.size:
                del self._seconds[next(iter(self._seconds))]

    def measured(self, config) -> float | None:
        """The shortest pass of this very shape seen so far; None before any."""
        with self._lock:
            return self._seconds.get(self._shape(config))

    def seconds(self, config) -> float | None:
        """Seconds of a pass of ``config`` on this server: :meth:`measured`, else the pass timed at
        the size of the same architecture nearest in multiply-adds, times the cost model's ratio
        (model.cost.pass_cost: the linear part with the tokens, the attention with their square);
        None before any pass of this architecture was timed."""
        found = self.measured(config)
        if found is not None:
            return found
        architecture = self._architecture(config)
        with self._lock:
            timed = list(self._seconds.items())
        timed = [(shape, seconds) for shape, seconds in timed if self._architecture(shape) == architecture]
        if not timed:
            return None
        wanted = cost.pass_cost(config)
        shape, seconds = min(timed, key=lambda item: abs(math.log(cost.pass_cost(item[0]) / wanted)))
        return seconds * wanted / cost.pass_cost(shape)


@st.cache_resource
def pass_times() -> PassTimes:
    """The passes every session has timed (Selection's captures, the Patches page's comparison)."""
    return PassTimes()


# --- the rule ---------------------------------------------------------------------------------


def is_quick(config, forwards: float = 1.0, timed: bool = True) -> bool:
    """Whether ``forwards`` forward passes of this model (``config``: at its patch and input size)
    are cheap enough to run unasked: from a pass of it timed on this server (at this size, or at
    another scaled by the cost model: :meth:`PassTimes.seconds`), else (or with ``timed`` False:
    work whose passes are batches, which one image's pass does not time) from its multiply-adds."""
    seconds = pass_times().seconds(config) if timed else None
    if seconds is not None:
        return forwards * seconds <= QUICK_SECONDS
    return forwards * cost.forward_cost(config) <= QUICK_COST


def is_heavy(config, forwards: float, timed: bool = True) -> bool:
    """Whether work of ``forwards`` passes of the model at ``config``'s sizes is a job: more than
    HEAVY_FORWARDS, and not quick."""
    return forwards > HEAVY_FORWARDS and not is_quick(config, forwards, timed)


# --- what each page's view computes unasked, in passes of its model at its sizes -----------------
#
# Multiply-adds (model.cost) over one pass of the model at the view's patch and input size. A
# view counts what its first view computes from what nobody has computed yet: its capture unless
# a page made it, the images no page has read, the second model's view.


def forwards(config, macs: float) -> float:
    """``macs`` multiply-adds in passes of the model at ``config``'s patch and input size."""
    return macs / cost.pass_cost(config)


def capture_cost(config, images: int = 1) -> float:
    """A page's capture (Selection.capture): a recorded pass, every layer's weights kept where
    they are small (models.keeps_every_layer)."""
    return cost.capture_cost(config, images=images, kept=models.keeps_every_layer(config))


def model_view_cost(config, captured: bool = False, statistics: bool = False) -> float:
    """One model's attention view of one image (the Attention page's, each side of Compare's):
    its capture unless made already, a layer's weights drawn, the rollout, and with
    ``statistics`` every head's distance and entropy; each layer's weights computed again from
    the tokens where the capture did not keep them."""
    kept = models.keeps_every_layer(config)
    macs = 0.0 if captured else capture_cost(config)
    macs += cost.rollout_cost(config, kept=kept)
    macs += cost.READ * cost.weights(config, layers=1) + (0.0 if kept else cost.attention_again_cost(config, layers=1))
    if statistics:
        macs += cost.layers_cost(config, kept=kept)
    return macs


def head_statistics_forwards(config) -> float:
    """Every head's distance and entropy on one captured image (Selection.head_statistics), in
    passes of its model: every layer's weights read, computed again from the tokens first where
    the capture does not keep them."""
    return forwards(config, cost.layers_cost(config, kept=models.keeps_every_layer(config)))


def attention_view_forwards(config, statistics: bool = False) -> float:
    """The Attention page's first view in passes of its model (:func:`model_view_cost`): with
    ``statistics``, all it draws unasked; without, what is left once every head's distance and
    entropy are a job. Where that is heavy too, the rollout is a job as well, and the capture and
    the layer drawn stay. Its capture is counted whoever made it: else the page's own would turn the
    job its first view offers into work in the server at the next widget moved."""
    return forwards(config, model_view_cost(config, statistics=statistics))


def reading_cost(config, unread: int, capture: bool = False) -> float:
    """Several images' tokens (ImageSet.image_tokens): the ``unread`` images no page has read in
    one batch, and the sidebar's capture if it is one of them and not made yet (``capture``)."""
    macs = cost.pass_cost(config, images=unread) if unread else 0.0
    return macs + (capture_cost(config) if capture else 0.0)


def image_set_forwards(config, unread: int, capture: bool = False, images: int = 3) -> float:
    """The Several images page's first view over ``images`` images: :func:`reading_cost`, then the
    set's principal components (three PCAs over every patch of every image, D^2 per patch each)."""
    patches = config.grid_size[0] * config.grid_size[1]
    return forwards(config, reading_cost(config, unread, capture) + 3 * images * patches * config.embed_dim**2)


def head_types_forwards(config, images: int, unread: int | None = None, capture: bool = False) -> float:
    """The Head types page's measures over ``images`` images, of which ``unread`` (default all)
    still need their pass (one batch) and ``capture`` the sidebar's capture: every layer's
    weights computed again from their tokens and measured (model.cost.head_types_cost). The
    "head types" job counts the same with every image unread (serving.job_kinds)."""
    unread = images if unread is None else unread
    return forwards(config, reading_cost(config, unread, capture) + cost.head_types_cost(config, images))


def compare_forwards(a_config, b_config, a_captured: bool = False, b_captured: bool = False) -> float:
    """The Compare page's first view in passes of model A (the sidebar's, at its sizes): each
    model's attention view (:func:`model_view_cost`), B's at its own patch and input size."""
    return forwards(a_config, model_view_cost(a_config, a_captured) + model_view_cost(b_config, b_captured))


def register_search_forwards(config, images: int) -> float:
    """The register neurons searched over ``images`` images (Registers, on the photos): their
    pass, then the blocks again up to each MLP (SEARCH_PASSES of a pass per image)."""
    return forwards(config, cost.pass_cost(config, images=images)) + images * SEARCH_PASSES


def dense_forwards(config, sizes: Sequence[tuple[int, int]]) -> float:
    """Pictures read at ``sizes`` (DINOv3's PCA at 768 px high, one pass each at its size) in
    passes of the model at its input size."""
    return sum(cost.pass_cost(config.replace(image_size=tuple(size))) for size in sizes) / cost.pass_cost(config)


def attribution_forwards(config) -> float:
    """A class attribution or a prompt's relevance: a forward and a backward pass."""
    return ATTRIBUTION_FORWARDS


def faithfulness_forwards(model: ViT, maps: int, mode: str, curves: Sequence[str]) -> float:
    """The deletion / insertion ``curves`` of ``maps`` maps and a random order on one image
    (analysis.faithfulness.planned_forwards: the tokens its batched passes run over a pass's; the
    intact pass is the page's capture). Its passes are batches of fewer tokens, which one image's
    timed pass does not time: decided in multiply-adds (``is_heavy(..., timed=False)``)."""
    return planned_forwards(model, maps, mode=mode, curves=curves, intact_given=True)


def sweep_forwards(config) -> float:
    """Every head knocked out alone (model.ablation.sweep_cost)."""
    return sweep_cost(config)


def unread_captures(image_set: ImageSet) -> tuple[int, bool]:
    """(the images of ``image_set`` no page has read, whether the sidebar's is one of the set and
    not captured yet): what reading the set would run."""
    selection = image_set.selection
    capture = selection.image_key in image_set.image_keys and selection.cached_capture() is None
    return len(image_set.unread()), capture


def set_forwards(image_set: ImageSet) -> float:
    """:func:`image_set_forwards` of ``image_set`` now."""
    unread, capture = unread_captures(image_set)
    return image_set_forwards(image_set.selection.config, unread, capture, len(image_set.image_keys))


def set_head_types_forwards(image_set: ImageSet) -> float:
    """:func:`head_types_forwards` of ``image_set`` now."""
    unread, capture = unread_captures(image_set)
    return head_types_forwards(image_set.selection.config, len(image_set.image_keys), unread, capture)


def selections_forwards(a: Selection, b: Selection) -> float:
    """:func:`compare_forwards` of two selections now (a capture a page made counts nothing)."""
    return compare_forwards(a.config, b.config, a.cached_capture() is not None, b.cached_capture() is not None)


# --- every patch size side by side ---------------------------------------------------------------

# Each patch size is timed once per model and input size (a pass's time does not depend on the
# image): a warm-up pass, then the median of TIMED_PASSES passes, or of one where a pass costs more
# than EXPENSIVE_PASS passes at the model's own patch size (three would make that size most of
# the wait, and one warm sample of it is long enough). Later images get one untimed pass per size.
TIMED_PASSES = 3
EXPENSIVE_PASS = 2.0


def comparison_plan(config, held_out: bool = False, timed: bool = True) -> list[PlannedSize]:
    """What the comparison runs at each patch size (and each size's cost: :func:`size_cost`).
    ``timed``: whether the forward times are measured now (nobody has for this model and size)."""
    native = pass_cost(config)
    plan = [
        PlannedSize(
            patch,
            0 if not timed else 1 if pass_cost(config, patch) > EXPENSIVE_PASS * native else TIMED_PASSES,
            HELD_OUT_IMAGES if held_out else 0,
        )
        for patch in models.patch_size_options(config)
    ]
    return [replace(planned, cost=size_cost(config, planned)) for planned in plan]


def resize_cost(config, patch_size: int) -> float:
    """Multiply-adds worth of resizing the model to ``patch_size``: the PI-resize operator (a
    pseudo-inverse, about 30 multiply-adds' time per new x old x old element) and its product
    with the kernel in float64 (about 6x a float32 multiply-add), as measured on a CPU."""
    if patch_size == config.patch_size:
        return 0.0
    new, old = patch_size**2, config.patch_size**2
    return 30 * new * old * old + 6 * new * old * config.in_chans * config.embed_dim


def size_cost(config, planned: PlannedSize) -> float:
    """Multiply-adds of one patch size's share of the comparison."""
    patch = planned.patch_size
    cost = resize_cost(config, patch) + (1 + planned.timed_passes) * pass_cost(config, patch)
    if planned.held_out_images:
        cost += pass_cost(config, patch, planned.held_out_images)
    return cost


def patch_size_comparison_cost(config, held_out: bool = False, timed: bool = True) -> float:
    """What trying every patch size costs, in forward passes of the model at its own size, from
    the plan the comparison runs (:func:`comparison_plan`)."""
    return sum(planned.cost for planned in comparison_plan(config, held_out, timed)) / pass_cost(config)


def predictions_by_patch_size(
    model: ViT, image: Image.Image, progress: Progress | None = None, forward_ms: dict[int, float] | None = None,
    whole: bool = False,
) -> list[dict]:
    """:func:`vit_explorer.analysis.patch_sizes.predictions` of ``image`` on the comparison's plan: per
    allowed patch size, grid, tokens, the forward time (or ``forward_ms``'s, measured before for
    this model and input size: then each size runs once, untimed) and the top-1 prediction."""
    x = preprocess(image, model.config, whole=whole)  # as the page's selection reads it
    return patch_sizes.predictions(model, x, comparison_plan(model.config, timed=forward_ms is None), progress, forward_ms)


def has_held_out(config) -> bool:
    """Whether the Patches page can test the model on a held-out batch of its dataset: only the
    built-in shapes, which render offline in a blink (another dataset may need a download)."""
    return config.class_names == SHAPE_CLASSES


def held_out_set(config) -> ImageDataset:
    """A batch of the shapes test stream at the model's input size."""
    # Past the sample pictures of the sidebar, which come from the start of the same test stream.
    return patch_sizes.held_out_set(config, HELD_OUT_IMAGES, SHAPE_SAMPLES)


def held_out_accuracy_by_patch_size(
    model: ViT, dataset: ImageDataset, progress: Progress | None = None
) -> dict[int, float]:
    """Patch size -> accuracy of the model on ``dataset`` at each allowed size (one batch per size)."""
    return patch_sizes.held_out_accuracy(model, dataset, comparison_plan(model.config, held_out=True), progress)


def duration(seconds: float) -> str:
    """A wait in words: "12 s", "3 min"."""
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"


# Held-out accuracy this close to the best counts as holding up (128 images: a point is about one image).
HELD_OUT_MARGIN = 0.05


def patch_size_summary(rows: Sequence[dict], trained: int) -> str:
    """What the comparison table shows, in a sentence or two derived from its rows."""
    most = max(rows, key=lambda row: row["tokens"])
    fewest = min(rows, key=lambda row: row["tokens"])
    ratio = most["forward ms"] / fewest["forward ms"]
    sentences = [
        f"A pass at patch {most['patch size']} ({most['tokens']} tokens) took {ratio:.1f}x as long as"
        f" at patch {fewest['patch size']} ({fewest['tokens']} tokens)."
        if ratio >= 1.5 else
        f"A pass at patch {most['patch size']} ({most['tokens']} tokens) took about as long as at"
        f" patch {fewest['patch size']} ({fewest['tokens']} tokens): for this model the time went to"
        " fixed costs (or to other work on this server), not to the tokens."
    ]
    held_out = {row["patch size"]: row["held-out accuracy"] for row in rows if row.get("held-out accuracy") is not None}
    if held_out:
        best = max(held_out, key=held_out.get)
        close = [patch for patch, accuracy in held_out.items() if patch != best and accuracy >= held_out[best] - HELD_OUT_MARGIN]
        far = [patch for patch in held_out if patch != best and patch not in close]
        sentence = f"On the held-out images it does best at patch {best} ({held_out[best]:.0%}; trained at {trained})"
        if close:
            sentence += f", {_sizes(close)} stay within {HELD_OUT_MARGIN * 100:.0f} points of that"
        if far:
            sentence += f", and at {_sizes(far)} it falls to {_percentages(held_out[patch] for patch in sorted(far))}"
        sentences.append(sentence + ".")
    elif "prediction" in rows[0]:
        own = next((row["prediction"] for row in rows if row["patch size"] == trained), None)
        same = [row["patch size"] for row in rows if row["prediction"] == own and row["patch size"] != trained]
        if own is not None:
            sentences.append(
                f"On this image it predicts {own} at its trained patch size {trained}"
                + (f", and so it does at {_sizes(same)}." if same else ", and something else at every other size.")
            )
    return " ".join(sentences)


def _sizes(patches: Sequence[int]) -> str:
    patches = sorted(patches)
    if len(patches) == 1:
        return f"patch {patches[0]}"
    return f"patches {', '.join(map(str, patches[:-1]))} and {patches[-1]}"


def _percentages(values) -> str:
    values = [f"{value:.0%}" for value in values]
    return values[0] if len(values) == 1 else f"{', '.join(values[:-1])} and {values[-1]}"


# --- the comparison for the selected model and image ----------------------------------------


def comparison_cost(selection: Selection) -> float:
    """What ``compare_patch_sizes`` would compute now, in forward passes (the forward times and
    the held-out accuracy are per model, so they count only until somebody has computed them)."""
    config = selection.base_model.config
    held_out = has_held_out(config) and held_out_key(selection) not in shared_results()
    return patch_size_comparison_cost(config, held_out=held_out, timed=forward_ms_key(selection) not in shared_results())


def forward_seconds(selection: Selection) -> float:
    """Seconds of one forward pass of this image at the model's own patch size, once per model
    and input size for everybody: the pass that captured this image at that size, whichever page
    made it (recording makes it a few percent slower than a plain pass: the wait said errs long),
    else the median of TIMED_PASSES timed now (one sample on a busy server can be several times
    off; the page's capture has just warmed the model up). Passes of its own made a real-size
    model's first Patches view cost four passes where it draws one."""
    model = selection.base_model
    native = replace(selection, patch_size=model.config.patch_size, model=model)
    key = (selection.model_key, selection.config.img_size, "forward seconds")
    return memo(key, lambda: native.capture_seconds() or patch_sizes.median_forward(
        model, selection.model_input(), TIMED_PASSES, warm_up=False
    )[1] / 1000)


def held_out_key(selection: Selection) -> tuple:
    return (selection.model_id, "held-out accuracy by patch size")


def forward_ms_key(selection: Selection) -> tuple:
    return (selection.model_key, selection.config.img_size, "forward ms by patch size")


def rows_key(selection: Selection) -> tuple:
    return (selection.model_id, selection.config.img_size, selection.image_key, "predictions by patch size")


def compare_patch_sizes(selection: Selection, run: bool = True) -> list[dict] | None:
    """Per allowed patch size: tokens, forward time and (with classes) the top-1 prediction of
    the selected image, and the accuracy on a held-out batch ("held-out accuracy") where the
    model's dataset has one. Runs under a progress bar.

    With ``run=False`` only what somebody already computed for this model and image (here or in
    a job: :func:`patch_size_job`), or None.
    """
    key = rows_key(selection)
    if not run and key not in shared_results():
        return None
    model = selection.base_model
    config = model.config
    held_out = has_held_out(config)
    forward_ms = shared_results().get(forward_ms_key(selection))  # None: nobody has timed them yet
    # One bar over both parts, each advancing by its share of the plan's cost.
    image_share = patch_size_comparison_cost(config, timed=forward_ms is None) / max(comparison_cost(selection), 1e-9)
    slot = st.empty()

    def report(start: float, share: float) -> Progress:
        return lambda done, text: slot.progress(min(start + share * done, 1.0), text=text)

    rows = memo(key, lambda: predictions_by_patch_size(
        model, selection.image, report(0.0, image_share), forward_ms, selection.whole,
    ))
    if forward_ms is None:  # these rows timed every size: the times of later images
        memo(forward_ms_key(selection), lambda: {row["patch size"]: row["forward ms"] for row in rows})
        for row in rows:  # plain passes at every size: what is quick at each (is_quick)
            pass_times().record(config.replace(patch_size=row["patch size"]), row["forward ms"] / 1000)
    if held_out:
        accuracy = memo(held_out_key(selection), lambda: held_out_accuracy_by_patch_size(
            model, held_out_set(config), report(image_share, 1 - image_share)
        ))
        rows = [{**row, "held-out accuracy": accuracy[row["patch size"]]} for row in rows]
    slot.empty()
    return rows
