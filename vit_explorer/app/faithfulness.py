"""Is this map true? for the pages (vit_explorer.analysis.faithfulness): the maps the Attention
page draws of the selection's image, named, and their deletion and insertion curves, computed
once for everybody through ``memo``, keyed by model, sizes, image, the maps' settings and the
removal mode; inline when quick, else a "faithfulness" job (serving.job_kinds) that runs the
passes beside the server and hands back the outputs, scored here.

The maps (:func:`page_maps`): the last layer's attention of what the prediction reads (the class
token, the attention pool's probe, else the mean of the patches), rollout as the page's settings
set it, the class attribution of the predicted class (where the page draws it: quick, or switched
on), the sharpest head's DINO mask at the page's share, and for a model with a text tower the top
label's relevance and dense similarity; the random order comes with the curves as their floor.
The score: the predicted class's probability; for a headless model the cosine of its embedding
with the intact one, or, with a text tower, the image's cosine with the top label's text.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import streamlit as st
import torch

from ..analysis import faithfulness as fa
from ..analysis import pool_maps, pool_rollout_map, query_map
from ..analysis.answers import numbers, percents
from ..text.maps import text_score
from . import costs, jobs, word_maps, words
from .memo import shared_results
from .selection import Selection

MODES = fa.MODES
CURVES = fa.CURVES
MODE_SENTENCES = fa.MODE_SENTENCES
MODE_NAMES = {"drop": "drop the tokens (no artefact)", "mean": "paint the image's mean (as for a CNN)"}
RANDOM = fa.RANDOM
READING_SHARE = 0.1  # the reading says what removing this share of the patches does


@dataclass(frozen=True)
class PageMaps:
    """The maps to test, in order (name -> (gh, gw)), what they depend on (``key``), the score if
    not the default one, and what was left out, one sentence each."""

    maps: dict[str, np.ndarray]
    key: tuple
    score: Callable[[torch.Tensor], torch.Tensor] | None = field(default=None, compare=False)
    what: str | None = None
    left_out: tuple[str, ...] = ()


def attribution_drawn(selection: Selection) -> bool:
    """Whether the Attention page draws the class attribution (or a label's relevance) now: quick
    for this model, or switched on by this person."""
    config = selection.config
    return costs.is_quick(config, forwards=costs.attribution_forwards(config)) or bool(st.session_state.get("attribution_on"))


def _top_label(selection: Selection) -> tuple[tuple[str, ...] | None, int, str, torch.Tensor] | None:
    """(the session's labels, the top one's index, its name, its text embedding) for a model with
    a text tower whose labels are there (typed, or ImageNet's already read); else None, silently."""
    if word_maps.model_for(selection) is None:
        return None
    labels = words.session_labels()
    if not words.embeddings_kept(selection.model_key, labels):
        return None
    said = words.prediction(selection)  # None too when this model cannot read the labels
    if said is None:
        return None
    texts = words.label_embeddings(selection.model_key, labels)
    if texts is None:
        return None
    top = int(said.scores.argmax())
    return labels, top, said.labels[top], texts[top]


def page_maps(
    selection: Selection, fusion: str = "mean", discard: float = 0.0, mass: float = 0.6, attribution: bool = True,
) -> PageMaps:
    """The maps the Attention page draws of this image, as its settings set them (rollout's
    ``fusion`` and ``discard``, the masks' ``mass``; ``attribution``: whether the attribution is
    drawn, so tested), each (gh, gw) float64; memoised for everybody by those settings."""
    config = selection.config
    captured = selection.capture()
    prefix, grid = captured.num_prefix_tokens, captured.grid_size
    in_words = _top_label(selection)
    has_classes = bool(config.num_classes)
    attribution = attribution and (has_classes or in_words is not None)
    words_key = None if in_words is None else (words.labels_id(in_words[0]), in_words[1])
    key = (fusion, float(discard), float(mass), attribution, words_key)

    def compute() -> dict[str, np.ndarray]:
        if captured.pool_attentions is not None:
            heads = pool_maps(captured)  # (H, gh, gw): the attention pool's probe
            rollout = pool_rollout_map(captured.pool_attentions, selection.rollout(fusion, discard), grid, prefix)[0]
            last = "the pool's attention"
        else:
            heads = query_map(selection.attention(config.depth - 1), grid, prefix, class_token=config.class_token)
            rollout = query_map(selection.rollout(fusion, discard)[0], grid, prefix, class_token=config.class_token)
            last = "last layer's attention"
        maps = {last: heads.float().mean(0), "rollout": rollout}
        if attribution and has_classes:
            maps["attribution"] = torch.as_tensor(selection.attribution(int(captured.logits[0].argmax())))
        elif attribution:
            labels, top, name, _ = in_words
            maps[f"relevance of '{name}'"] = torch.as_tensor(word_maps.relevance(selection, labels, top))
        head, mask = fa.sharpest_mask(heads, mass)
        maps[f"head {head}'s mask"] = mask
        if in_words is not None:
            labels, top, name, _ = in_words
            maps[f"similarity to '{name}'"] = torch.as_tensor(word_maps.label_similarity(selection, labels, top))
        return {name: values.double().reshape(grid).numpy() for name, values in maps.items()}

    maps = selection.memo("faithfulness maps", *key, compute=compute)
    left_out = []
    if not attribution and (has_classes or in_words is not None):
        left_out.append("The attribution is not tested: switch it on above, and its curves come with the others.")
    elif not attribution:
        left_out.append("This model has no classifier, so no class attribution to test.")
    if in_words is None:
        return PageMaps(maps, key, left_out=tuple(left_out))
    model = word_maps.model_for(selection)
    return PageMaps(
        maps, key, score=text_score(model, in_words[3]), what=f"the cosine with '{in_words[2]}'", left_out=tuple(left_out),
    )


def has_attribution(maps: PageMaps) -> bool:
    """Whether the class attribution (or a label's relevance) is among the maps tested."""
    return any(name == "attribution" or name.startswith("relevance of") for name in maps.maps)


def planned(selection: Selection, count: int, mode: str, curves: Sequence[str]) -> float:
    """The curves' cost in forward passes of the image (costs.faithfulness_forwards)."""
    return costs.faithfulness_forwards(selection.model, count, mode, curves)


def is_heavy(selection: Selection, count: int, mode: str, curves: Sequence[str]) -> bool:
    """Whether the curves of ``count`` maps are a job: costs.is_heavy of :func:`planned`, in
    multiply-adds (their passes are batches of fewer tokens, which one image's timed pass does not
    time: each batch's fixed costs would count once per row)."""
    return costs.is_heavy(selection.config, forwards=planned(selection, count, mode, curves), timed=False)


def curves(
    selection: Selection, maps: PageMaps, mode: str = "drop", curves: Sequence[str] = CURVES,
    label: str = "Test the maps", ask: bool = False,
) -> fa.Faithfulness | None:
    """Every map's curves (and the random order's) on this image, once for everybody: here when
    quick, else as a job whose button (``label``; ``ask``: asked at once) or progress is drawn in
    their place, and None until it is done."""
    curves = tuple(curve for curve in CURVES if curve in curves)
    key = ("faithfulness", *maps.key, mode, curves)
    found = shared_results().get((*selection.key, *key))
    if found is not None:  # computed already, here or from a job's outputs
        return found
    intact = selection.capture().logits[0]

    def compute(outputs: torch.Tensor | None = None) -> fa.Faithfulness:
        return fa.faithfulness_curves(
            selection.model, selection.model_input(), maps.maps, mode=mode, curves=curves, intact=intact,
            score=maps.score, what=maps.what, outputs=outputs,
        )

    if not is_heavy(selection, len(maps.maps), mode, curves):
        return selection.memo(*key, compute=compute, spinner="Removing the patches in each map's order ...")
    values = jobs.as_job(selection, jobs.job_spec(
        selection, "faithfulness", maps=[[name, values.reshape(-1).tolist()] for name, values in maps.maps.items()],
        steps=None, curves=list(curves), mode=mode, forwards=planned(selection, len(maps.maps), mode, curves),
        rows=len(fa.curve_rows(selection.model, maps.maps, curves=curves)),
    ), ((*selection.key, *key, "outputs"),), label, ask=ask)
    if values is None:
        return None
    return selection.memo(*key, compute=lambda: compute(values[0]))


def areas_table(result: fa.Faithfulness) -> list[dict]:
    """A row per map: its name and its area under each curve computed."""
    areas = {curve: result.areas(curve) for curve in result.curves}
    return [
        {"map": "a random order" if name == RANDOM else name,
         **{f"{curve} area": round(areas[curve][name], 4) for curve in areas}}
        for name in result.names
    ]


# Said wherever a map is measured against the random order: what the floor is, and is not.
RANDOM_FLOOR = (
    "The random order is one order drawn with a fixed seed, not an average of many: a map that beats it"
    " narrowly might not beat another."
)
# Keeping this share of the way from no patch to the whole image's score with a random tenth of the
# patches: the model answers from almost any few patches, and insertion cannot rank the maps.
KEPT_ANSWER = 0.5


def verdict(result: fa.Faithfulness) -> str:
    """Which map each curve favours, in a sentence (the random order named as such), and why
    insertion favours the random order when it does."""
    parts = []
    for curve, extreme in (("deletion", "smallest"), ("insertion", "largest")):
        if curve in result.curves:
            best = result.best(curve)
            parts.append(
                f"the {curve} curves favour a random order: no map beats chance" if best == RANDOM else
                f"the {curve} curves favour {best} (the {extreme} area)"
            )
    text = "; ".join(parts)
    return text[0].upper() + text[1:] + "." + (f" {why_chance(result)}" if why_chance(result) else "")


def why_chance(result: fa.Faithfulness) -> str | None:
    """Why the insertion curves favour the random order, where a few random patches already give
    the model its answer back (KEPT_ANSWER); None otherwise."""
    if "insertion" not in result.curves or result.best("insertion") != RANDOM:
        return None
    step = result.step_at(READING_SHARE)
    kept = float(result.curves["insertion"][result.names.index(RANDOM), step])
    span = result.intact - result.empty
    if span == 0 or (kept - result.empty) / span < KEPT_ANSWER:
        return None
    shown = percents(result.empty, kept, result.intact) if result.percent else numbers(result.empty, kept, result.intact)
    return (
        f"Why: keeping only a random {float(result.fractions[step]):.0%} of the patches already takes {result.what} from"
        f" {shown[0]} to {shown[1]} (the whole image: {shown[2]}): the model gives its answer from almost any few"
        " patches, so keeping a map's brightest first cannot do better."
    )


def reading(result: fa.Faithfulness) -> str:
    """The one-sentence reading of the first curve computed (deletion if there)."""
    return result.reading(READING_SHARE, next(iter(result.curves)))


def insertion_opinion(result: fa.Faithfulness) -> str:
    """What the insertion curves say beside the deletion curves' answer (both computed), in a
    sentence or two: they agree, they favour another map, or no map beats chance, and why."""
    deleted, inserted = result.best("deletion"), result.best("insertion")
    if inserted == RANDOM:
        return " ".join(filter(None, (
            "Keeping only the brightest patches (insertion) favours no map over a random order.", why_chance(result),
        )))
    if inserted == deleted:
        return f"Keeping only the brightest patches (insertion) agrees: {inserted} brings the score back fastest."
    return (
        f"Keeping only the brightest patches (insertion) tells another story: {inserted} brings the score back"
        f" fastest. The two tests ask different questions (what the model needs, what it can do with), and one"
        " image answers neither for good."
    )


def lesson_answer(result: fa.Faithfulness, guess: str) -> str:
    """The Lesson's answer to "which map makes the score fall fastest?": right or not, what the
    deletion curves read, the maps no better than chance, and what insertion says."""
    areas, best = result.areas("deletion"), result.best("deletion")
    if best == RANDOM:
        verdict = "No map beats a random order on this image: for this model, believe none of them"
    elif best == guess:
        verdict = f"Right: {guess} makes the score fall fastest"
    else:
        verdict = f"Not this time: {best} makes the score fall fastest, not {guess}"
    beaten = [name for name in result.names if name != RANDOM and areas[name] >= areas[RANDOM]]
    return (
        f"**{verdict}.** {reading(result)}"
        + (f" No better than chance: {', '.join(beaten)}." if beaten and best != RANDOM else "")
        + f" {insertion_opinion(result)}"
    )

