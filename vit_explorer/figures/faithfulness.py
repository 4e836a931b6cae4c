"""Is this map true? The deletion and insertion curves of several maps of one image
(vit_explorer.analysis.faithfulness): the score as the patches each map ranks highest are removed
(or added to an empty image) first, one line per map, the random order dashed as the floor."""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import plotly.colors as plotly_colors
import plotly.graph_objects as go

from ._base import MARGIN, _float_array, _on_axes, _subplots, _title, figure

# Each map's colour, in the order given; the random order is grey and dashed.
MAP_COLOURS = plotly_colors.qualitative.Set1
RANDOM_COLOUR = "#9d9d9d"
# Each panel's title in two lines: on one, the two titles ran into each other at 900 px (inspect's PNG).
PANELS = {
    "deletion": ("Deletion: top patches removed first<br>(smaller area: truer)", "share of patches removed"),
    "insertion": ("Insertion: top patches kept alone<br>(larger area: truer)", "share of patches kept"),
}


def faithfulness_figure(
    fractions, curves: Mapping[str, object], names: Sequence[str], what: str, percent: bool,
    random_name: str = "random",
) -> go.Figure:
    """One panel per curve (``curves``: "deletion" / "insertion" -> (M, S + 1) scores, the maps in
    the order of ``names``) over ``fractions`` (S + 1,) of the patches removed or kept; ``what``
    the score is in words, ``percent`` whether it is a probability; the map named ``random_name``
    is the floor, drawn grey and dashed."""
    fractions = _float_array(fractions).reshape(-1)
    shown = [curve for curve in PANELS if curve in curves]
    if not shown or set(curves) - set(PANELS):
        raise ValueError(f"curves must be some of {tuple(PANELS)}, not {tuple(curves)}")
    values = {curve: _float_array(curves[curve]) for curve in shown}
    for curve, scores in values.items():
        if scores.shape != (len(names), len(fractions)):
            raise ValueError(f"the {curve} curves must be ({len(names)}, {len(fractions)}), not {scores.shape}")
    layout, cells = _subplots(1, len(shown), [PANELS[curve][0] for curve in shown], horizontal_spacing=0.12)
    # Up to three decimals, trailing zeros dropped: a random model's class near 1% read "1%, 1%, 1%"
    # down its axis at ".0%"; a trained one's still reads "50%".
    number = ".3~%" if percent else ".3f"
    traces = []
    colours = iter(MAP_COLOURS * (len(names) // len(MAP_COLOURS) + 1))
    styles = {
        name: dict(color=RANDOM_COLOUR, dash="dash", width=2) if name == random_name else dict(color=next(colours), width=2.5)
        for name in names
    }
    for column, curve in enumerate(shown, start=1):
        suffix = cells[1, column]
        verb = "removed" if curve == "deletion" else "kept"
        for index, name in enumerate(names):
            label = "a random order" if name == random_name else name
            traces.append(_on_axes(dict(
                type="scatter", x=fractions, y=values[curve][index], mode="lines+markers", name=label,
                legendgroup=label, showlegend=column == 1, line=styles[name], marker=dict(size=4),
                hovertemplate=f"{label}: %{{x:.0%}} of the patches {verb}, score %{{y:{number}}}<extra></extra>",
            ), suffix))
        layout[f"xaxis{suffix}"].update(title=dict(text=PANELS[curve][1]), tickformat=".0%", range=[0, 1])
        layout[f"yaxis{suffix}"].update(title=dict(text=_axis_text(what)), tickformat=number)
    layout.update(
        title=_title(f"Is this map true? {_score_text(what, percent)} as each map's top patches are {_done(shown)}"),
        margin={**MARGIN, "t": 110}, height=420, legend=dict(title=dict(text="map")), hovermode="closest",
    )
    return figure(traces, layout)


def _axis_text(what: str) -> str:
    """The score axis's title: "p('cat')" for a class's probability, else the words given."""
    return f"p({what})" if what.startswith("'") else ("cosine" if "cosine" in what else what)



def _score_text(what: str, percent: bool) -> str:
    """The score in a title: "The probability of 'cat'", "The embedding's cosine with the intact one"."""
    text = f"the probability of {what}" if percent and what.startswith("'") else what
    return text[0].upper() + text[1:]


def _done(shown: Sequence[str]) -> str:
    """What happens to the top patches, for the curves shown."""
    return {("deletion",): "removed", ("insertion",): "kept alone"}.get(tuple(shown), "removed, or kept alone")
