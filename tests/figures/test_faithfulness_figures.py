"""The figures of issue 37 (figures/faithfulness.py, figures/probe.py): each builds validated (the
suite sets VIT_EXPLORER_CHECK_FIGURES=1), says what it shows, and carries the numbers it was given."""
import numpy as np
import pytest

from vit_explorer import figures

from test_figures import title_of, traces

IMAGE = np.random.default_rng(0).integers(0, 256, size=(8, 12, 3), dtype=np.uint8)  # a 2 x 3 grid of 4 px patches
FRACTIONS = np.linspace(0, 1, 7)
NAMES = ("rollout", "attribution", "random")
CURVES = {
    "deletion": np.random.default_rng(1).uniform(size=(3, 7)),
    "insertion": np.random.default_rng(2).uniform(size=(3, 7)),
}


def test_the_curves_a_panel_per_curve_a_line_per_map_the_random_order_dashed():
    fig = figures.faithfulness_figure(FRACTIONS, CURVES, NAMES, "'cat'", True)
    assert title_of(fig).startswith("Is this map true? The probability of 'cat'") and title_of(fig).endswith("kept alone")
    lines = traces(fig, "scatter")
    assert len(lines) == 6
    for line, (curve, index) in zip(lines, [(c, i) for c in CURVES for i in range(3)]):
        np.testing.assert_allclose(np.asarray(line.y), CURVES[curve][index])
        np.testing.assert_allclose(np.asarray(line.x), FRACTIONS)
    assert [line.name for line in lines[:3]] == ["rollout", "attribution", "a random order"]
    assert lines[2].line.dash == "dash" and lines[0].line.dash is None
    assert [line.showlegend for line in lines] == [True] * 3 + [False] * 3
    assert fig.layout.yaxis.tickformat == ".3~%"  # a score near 1% keeps its decimals on the axis
    one = figures.faithfulness_figure(FRACTIONS, {"deletion": CURVES["deletion"]}, NAMES, "the cosine with 'a cat'", False)
    assert title_of(one) == "Is this map true? The cosine with 'a cat' as each map's top patches are removed"
    assert one.layout.yaxis.tickformat == ".3f" and len(traces(one, "scatter")) == 3
    with pytest.raises(ValueError, match="must be"):
        figures.faithfulness_figure(FRACTIONS, {"deletion": CURVES["deletion"][:2]}, NAMES, "x", False)


def test_the_probe_picker_shows_each_label_and_reports_a_click_as_the_patch():
    fig = figures.probe_picker(IMAGE, (2, 3), [(0, 0), (4, 1), (5, 1)], ("object", "background"), 1)
    scatter = traces(fig, "scatter")
    assert [trace.name for trace in scatter[:2]] == ["object (1)", "background (2)"]
    np.testing.assert_allclose(scatter[1].x, [5.5, 9.5])  # patches 4 and 5: columns 1 and 2, 4 px wide
    clicks = scatter[-1]
    assert len(clicks.x) == 6 and [int(row[0]) for row in clicks.customdata] == list(range(6))
    assert "label it 'background'" in clicks.hovertemplate and fig.layout.clickmode == "event+select"
    with pytest.raises(ValueError, match="labels"):
        figures.probe_picker(IMAGE, (2, 3), [], ("a", "b", "c", "d", "e"), 0)


def test_the_segmentation_colours_every_patch_by_its_label_and_outlines_the_clicks():
    segmentation = np.array([[[0, 1, 1], [0, 0, 2]], [[2, 2, 2], [1, 1, 0]]])
    fig = figures.probe_segmentation_grid(
        [IMAGE, IMAGE], segmentation, ("object", "background", "sky"), ["1. a", "2. b"], "The probe", [[(0, 0)], []],
    )
    cells = traces(fig, "heatmap")
    for cell, expected in zip(cells, segmentation):
        np.testing.assert_array_equal(np.asarray(cell.z), expected)
        assert (cell.zmin, cell.zmax) == (-0.5, 2.5)
    legend = [trace.name for trace in traces(fig, "scatter") if trace.showlegend]
    assert legend == ["object", "background", "sky"] and title_of(fig) == "The probe"


def test_the_layer_curve_marks_the_best_and_the_shown_layer():
    fig = figures.probe_layers_figure([0, 1, 2, 3], [0.5, 0.9, 0.75, 0.8], chosen=3)
    line, shown, best = traces(fig, "scatter")
    np.testing.assert_allclose(line.y, [0.5, 0.9, 0.75, 0.8])
    assert (shown.name, best.name) == ("shown: 3", "best: 1") and list(best.y) == [0.9]
