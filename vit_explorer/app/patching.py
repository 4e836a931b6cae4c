"""Activation patching on the Patching page: the corrupted picture a session chose, the paired
runs, attribution patching of every site and exact patching of one (here when quick, else a
job), the patched run of one cell and path patching, each computed once for everybody."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..analysis import patching
from ..analysis.patching import PairedRuns
from ..model.capture import Capture, capture
from ..model.patching import Patch
from ..model.patching import patching as patched
from ..text.towers import check_labels
from ..text.zero_shot import score_difference
from . import costs, images, jobs, models, words
from .selection import Selection


@dataclass(frozen=True)
class Corruption:
    """The corrupted picture: another picture (``image_key``), or this one with the patch rows
    [r0, r1) x columns [c0, c1) painted in the mean colour (``cells``)."""

    image_key: str | None = None
    cells: tuple[int, int, int, int] | None = None

    @property
    def identity(self) -> str:
        """What it is, for keys and jobs."""
        return f"picture {self.image_key}" if self.image_key is not None else f"painted {self.cells}"


def corrupted_input(selection: Selection, corruption: Corruption) -> tuple[torch.Tensor, str | None]:
    """The corrupted picture as the model's input (1, C, H, W), and a sentence when the two
    pictures differ in size (each was resized on its own)."""
    if corruption.image_key is None:
        return patching.painted(selection.model_input(), corruption.cells, selection.patch_size), None
    _, picture = images.resolve_image(corruption.image_key, selection.config.img_size)
    note = patching.size_note(selection.image, picture, selection.config.img_size)
    return selection.preprocess(picture), note


def runs_bytes(config) -> int:
    """What :func:`runs` holds: both runs' activations at every site and layer, float32."""
    return 4 * 2 * len(patching.SITES) * config.depth * config.num_tokens * config.embed_dim


def size_problem(config) -> str | None:
    """Why this model cannot be patched at its current sizes in the server, in a sentence; None if it can."""
    held = runs_bytes(config)
    if held <= models.MAX_VIEW_BYTES:
        return None
    return (
        f"Patching keeps both pictures' activations at every layer, {held / 2**20:.0f} MB at these sizes, more than"
        f" the {models.MAX_VIEW_BYTES / 2**20:.0f} MB this app allows a view; choose a smaller input or a larger patch size."
    )


def runs(selection: Selection, corruption: Corruption) -> PairedRuns:
    """Both runs, every site's activations kept (one batched pass)."""
    return selection.memo("patching runs", corruption.identity, compute=lambda: patching.paired_runs(
        selection.model, selection.model_input(), corrupted_input(selection, corruption)[0],
    ), spinner="Running both pictures ...")


def metric(selection: Selection, spec: tuple, paired: PairedRuns) -> patching.Metric:
    """The metric ``spec`` names: analysis.patching.metric_from's, or ("words", first, second) for a
    model with a text tower (the two labels' scores, their embeddings made once for everybody)."""
    if spec[0] != "words":
        return patching.metric_from(spec, selection.class_names(), paired.outputs[0])
    labels = tuple(spec[1:])
    check_labels(list(labels))  # a LabelError, one sentence, before anything is embedded
    return score_difference(words.words_model(selection.model_key), words.label_embeddings(selection.model_key, labels), labels)


def _job(selection: Selection, corruption: Corruption, key: tuple, label: str, **settings):
    """The "patching" job of these settings, for the two pictures; its value once done, else None.
    A metric in words travels as the labels' embeddings and the folder the projection is read from."""
    if settings["metric"][0] == "words":
        settings.update(
            folder=str(words.text_folder(selection.model_key)),
            texts=words.label_embeddings(selection.model_key, tuple(settings["metric"][1:])).tolist(),
        )
    x = torch.cat([selection.model_input(), corrupted_input(selection, corruption)[0]])
    spec = jobs.job_spec(selection, "patching", f"{selection.image_key}\n{corruption.identity}", **settings)
    values = jobs.as_job(selection, spec, (key,), label, x=x)
    return None if values is None else values[0]


def attribution(selection: Selection, corruption: Corruption, spec: tuple, direction: str) -> dict[str, torch.Tensor] | None:
    """Attribution patching of every site: here when quick, else a job (None until it is done)."""
    key = (*selection.key, "patching attribution", corruption.identity, spec, direction)
    if costs.is_heavy(selection.config, forwards=patching.ATTRIBUTION_FORWARDS):
        return _job(selection, corruption, key, "Estimate every cell", metric=list(spec), direction=direction, site=None)
    paired = runs(selection, corruption)
    return selection.memo(*key[len(selection.key):], compute=lambda: patching.attribution_patching(
        selection.model, paired, metric(selection, spec, paired), direction,
    ))


def exact_forwards(selection: Selection, corruption: Corruption, site: str) -> float:
    """Exact patching's passes for these two pictures (cells that agree need none)."""
    return patching.exact_passes(selection.model, runs(selection, corruption), site)


def exact(selection: Selection, corruption: Corruption, spec: tuple, site: str, direction: str) -> torch.Tensor | None:
    """Exact patching of ``site``: here when quick, else a job (None until it is done)."""
    key = (*selection.key, "patching exact", corruption.identity, spec, site, direction)
    if costs.is_heavy(selection.config, forwards=exact_forwards(selection, corruption, site), timed=False):
        return _job(selection, corruption, key, "Patch every cell", metric=list(spec), direction=direction, site=site)
    paired = runs(selection, corruption)
    return selection.memo(*key[len(selection.key):], compute=lambda: patching.exact_patching(
        selection.model, paired, metric(selection, spec, paired), site, direction,
    ))


def patched_capture(selection: Selection, corruption: Corruption, site: str, layer: int, cell: int, direction: str) -> Capture:
    """The capture of the patched run with that one cell patched (the whole pass, every layer's
    attention kept for the maps), this call only."""
    paired = runs(selection, corruption)
    base, source = (1, 0) if direction == "denoising" else (0, 1)
    cells = selection.config.num_heads if site == "head" else paired.activations[("resid", 0)].shape[1]
    mask = torch.zeros(1, cells, dtype=torch.bool)
    mask[0, cell] = True
    values = paired.activations[(site, layer)][source:source + 1]

    def compute() -> Capture:
        with patched(Patch(selection.model, replace={(site, layer): (mask, values)})):
            return capture(selection.model, paired.images[base:base + 1], layers=(selection.config.depth - 1,))

    return selection.memo("patched capture", corruption.identity, site, layer, cell, direction, compute=compute)


def path(
    selection: Selection, corruption: Corruption, spec: tuple, sender: tuple[int, int], receiver: tuple[int, int] | None,
    direction: str,
) -> float:
    paired = runs(selection, corruption)
    return selection.memo("path patching", corruption.identity, spec, sender, receiver, direction, compute=lambda: (
        patching.path_patching(selection.model, paired, metric(selection, spec, paired), sender, receiver, direction)
    ))
