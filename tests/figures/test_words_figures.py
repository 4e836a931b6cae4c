"""The figures of words over the image (figures/words.py): each builds validated (the suite sets
VIT_EXPLORER_CHECK_FIGURES=1, so the unvalidated build is compared with plotly's), says what it
shows, and carries the numbers it was given."""
import numpy as np
import plotly.graph_objects as go
import pytest

from vit_explorer import figures

from test_figures import pixels, title_of, traces

IMAGE = np.random.default_rng(0).integers(0, 256, size=(8, 12, 3), dtype=np.uint8)
PROMPTS = ["a cat", "a dog", "a rocket"]
MAPS = np.random.default_rng(1).normal(0.1, 0.05, size=(3, 2, 3))  # (T, gh, gw): a non-square grid


def test_similarity_grid_has_a_panel_per_prompt_on_one_scale_or_each_its_own():
    shared = figures.similarity_grid(IMAGE, MAPS, PROMPTS, "MaskCLIP's value path", columns=2)
    assert "MaskCLIP's value path" in title_of(shared) and "one colour scale" in title_of(shared)
    cells = traces(shared, "heatmap")
    assert len(cells) == 3 and len(traces(shared, "image")) == 3
    for values, cell in zip(MAPS, cells):
        np.testing.assert_allclose(np.asarray(cell.z), values)
        assert cell.coloraxis == "coloraxis"
    assert shared.layout.coloraxis.cmin == pytest.approx(MAPS.min()) and shared.layout.coloraxis.cmax == pytest.approx(MAPS.max())
    titles = [annotation.text for annotation in shared.layout.annotations]
    assert [title.split(" (")[0] for title in titles] == PROMPTS
    own = figures.similarity_grid(IMAGE, MAPS, PROMPTS, "x", scale="per prompt")
    for values, cell in zip(MAPS, traces(own, "heatmap")):
        assert (cell.zmin, cell.zmax) == pytest.approx((values.min(), values.max()))
    with pytest.raises(ValueError, match="one \\(gh, gw\\) map per prompt"):
        figures.similarity_grid(IMAGE, MAPS[:2], PROMPTS, "x")
    with pytest.raises(ValueError, match="scale"):
        figures.similarity_grid(IMAGE, MAPS, PROMPTS, "x", scale="loud")


def test_equal_cosines_still_make_a_scale():
    fig = figures.similarity_grid(IMAGE, np.zeros((1, 2, 3)), ["a cat"], "x")
    assert fig.layout.coloraxis.cmin < fig.layout.coloraxis.cmax


def test_best_prompt_map_colours_each_patch_by_its_best_prompt_with_a_legend():
    fig = figures.best_prompt_map(IMAGE, MAPS, PROMPTS)
    assert "most like" in title_of(fig)
    (cells,) = traces(fig, "heatmap")
    best = MAPS.argmax(axis=0)
    assert np.array_equal(np.asarray(cells.z), best)
    assert (cells.zmin, cells.zmax) == (-0.5, 2.5)
    # Each prompt's band of the colour scale holds one colour, and the legend names it.
    keys = [trace for trace in traces(fig, "scatter") if trace.showlegend]
    assert [key.name.split(" (")[0] for key in keys] == PROMPTS
    for index, key in enumerate(keys):
        start, end = cells.colorscale[2 * index], cells.colorscale[2 * index + 1]
        assert (start[0], end[0]) == pytest.approx((index / 3, (index + 1) / 3))
        assert start[1] == end[1] == key.marker.color
        assert f"({int((best == index).sum())} patches)" in key.name
    assert cells.customdata[1][2][3] == PROMPTS[best[1, 2]]
    assert float(cells.customdata[1][2][4]) == pytest.approx(MAPS[:, 1, 2].max())
    assert np.array_equal(pixels(traces(fig, "image")[0]), IMAGE)
    with pytest.raises(ValueError, match="told apart"):
        figures.best_prompt_map(IMAGE, np.zeros((40, 2, 3)), [f"p{i}" for i in range(40)])


def test_relevance_overlay_names_the_prompt():
    relevance = np.abs(MAPS[0])
    fig = figures.relevance_overlay(IMAGE, relevance, "a rocket")
    assert "'a rocket'" in title_of(fig)
    np.testing.assert_allclose(np.asarray(traces(fig, "heatmap")[0].z), relevance)


def test_one_prompt_over_several_images_shares_one_scale():
    fig = figures.prompt_over_images([IMAGE, IMAGE[::-1]], MAPS[:2], "a cat", ["1. cat", "2. dog"], "the pool's value path")
    assert "'a cat'" in title_of(fig)
    cells = traces(fig, "heatmap")
    assert len(cells) == 2 and {(cell.zmin, cell.zmax) for cell in cells} == {(MAPS[:2].min(), MAPS[:2].max())}
    with pytest.raises(ValueError, match="one \\(gh, gw\\) map and one label per image"):
        figures.prompt_over_images([IMAGE], MAPS[:2], "a cat", ["1"], "x")


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
def test_zero_shot_bar_orders_the_labels_and_says_how_they_were_scored(scoring):
    fig = figures.zero_shot_bar([0.2, 0.7, 0.1], PROMPTS, scoring, k=2)
    assert scoring in title_of(fig) and "Top-2" in title_of(fig)
    (bar,) = traces(fig, "bar")
    assert list(bar.y) == ["a dog", "a cat"] and list(bar.x) == [0.7, 0.2]
    with pytest.raises(ValueError, match="scoring"):
        figures.zero_shot_bar([1.0], ["a"], "argmax")


def test_long_prompts_are_shortened_in_titles_and_legends():
    prompt = "a photo of " + "a very " * 20 + "long cat"
    fig = figures.best_prompt_map(IMAGE, MAPS[:1], [prompt])
    assert isinstance(fig, go.Figure)
    (key,) = [trace for trace in traces(fig, "scatter") if trace.showlegend]
    assert len(key.name.split(" (")[0]) <= 40 and key.name.endswith("patches)")


def test_segmentation_map_colours_each_pixels_class_as_its_prompt_and_leaves_the_background_clear():
    labels = np.zeros(IMAGE.shape[:2], dtype=np.uint8)
    labels[:4, :6], labels[4:, 6:] = 1, 3
    fig = figures.segmentation_map(IMAGE, labels, ["background", *PROMPTS], opacity=1.0)
    assert "labelled by the prompt" in title_of(fig)
    shown = pixels(traces(fig, "image")[0])
    assert np.array_equal(shown[labels == 0], IMAGE[labels == 0])
    keys = [trace for trace in traces(fig, "scatter") if trace.showlegend]
    assert [key.name.split(" (")[0] for key in keys] == ["background", *PROMPTS]
    assert "(25% of the pixels)" in keys[3].name and "(0% of the pixels)" in keys[2].name
    # At full opacity a class's pixels are its prompt's colour of the best-prompt map.
    for index in (1, 3):
        red, green, blue = (int(part) for part in figures.words.PROMPT_COLOURS[index - 1][4:-1].split(","))
        assert (shown[labels == index] == (red, green, blue)).all()
    with pytest.raises(ValueError, match="one class a pixel"):
        figures.segmentation_map(IMAGE, labels[:4], ["background", *PROMPTS])
