"""Figure builders: each builds from small inputs, has a title, and carries the data it shows."""
import base64
import io
import json
import re

import numpy as np
import plotly.colors
import plotly.graph_objects as go
import pytest
import torch
from PIL import Image

from vit_explorer import figures

GRID = (2, 3)  # non-square on purpose
IMAGE = np.random.default_rng(0).integers(0, 256, size=(8, 12, 3), dtype=np.uint8)


def title_of(fig: go.Figure) -> str:
    assert isinstance(fig, go.Figure)
    go.Figure(fig.to_dict())  # raises on anything outside the plotly schema (figures are built unvalidated)
    assert fig.layout.title.text, "every figure says what it shows"
    return fig.layout.title.text


def _json(fig: go.Figure):
    """What the browser receives, as Python values (the same for any order of the keys)."""
    return json.loads(fig.to_json())


def traces(fig, kind):
    return [trace for trace in fig.data if trace.type == kind]


def pixels(image_trace) -> np.ndarray:
    """The (H, W, 3) pixels of an image trace's PNG source."""
    header, data = image_trace.source.split(",", 1)
    assert header == "data:image/png;base64"
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(data))).convert("RGB"))


def test_image_with_grid_draws_grid_lines_and_the_highlighted_patch():
    fig = figures.image_with_grid(IMAGE, GRID, highlight=(1, 2))
    assert "2 x 3" in title_of(fig) and "patch 5" in title_of(fig)
    assert np.array_equal(pixels(traces(fig, "image")[0]), IMAGE)
    lines = [s for s in fig.layout.shapes if s.type == "line"]
    assert len(lines) == (2 - 1) + (3 - 1)
    (rect,) = [s for s in fig.layout.shapes if s.type == "rect"]
    # Patch (1, 2) of 4-pixel patches spans pixels 8..11 x 4..7 (edges at -0.5).
    assert (rect.x0, rect.x1, rect.y0, rect.y1) == (7.5, 11.5, 3.5, 7.5)
    assert fig.layout.yaxis.scaleanchor == "x" and fig.layout.yaxis.autorange == "reversed"
    hover = traces(fig, "heatmap")[0]
    assert np.array_equal(hover.customdata[1, 2], [5, 1, 2])
    with pytest.raises(ValueError, match="outside the 2x3 grid"):
        figures.image_with_grid(IMAGE, GRID, highlight=6)


def test_float_images_are_converted_to_uint8():
    fig = figures.image_with_grid(IMAGE / 255.0, GRID)
    assert np.array_equal(pixels(traces(fig, "image")[0]), IMAGE)
    with pytest.raises(ValueError, match=r"\(H, W, 3\)"):
        figures.image_with_grid(np.zeros((8, 12, 4)), GRID)


def test_patch_sequence_lays_patches_out_in_token_order():
    patches = torch.rand(2, 3, 3, 4, 4)
    fig = figures.patch_sequence(patches, max_patches=5, per_row=4)
    assert "first 5 of 6" in title_of(fig)
    mosaic = pixels(traces(fig, "image")[0])
    gap = 1
    assert mosaic.shape == (2 * 4 + gap, 4 * 4 + 3 * gap, 3)
    # Token 4 = patch (1, 1) starts the second row of the mosaic.
    expected = np.round(patches[1, 1].permute(1, 2, 0).numpy() * 255).astype(np.uint8)
    assert np.array_equal(mosaic[5:9, 0:4], expected)
    slots = traces(fig, "heatmap")[0].z
    assert list(slots[0]) == [0, 1, 2, 3] and slots[1][0] == 4 and np.isnan(slots[1][1])


def test_token_pca_image_stretches_the_colours_over_the_image():
    colors = np.random.default_rng(1).random((2, 3, 3))
    fig = figures.token_pca_image(colors, IMAGE)
    title_of(fig)
    original, pca = traces(fig, "image")
    assert np.array_equal(pixels(original), IMAGE)
    assert np.array_equal(pixels(pca), np.round(colors * 255).astype(np.uint8))
    assert (pca.dx, pca.dy) == (4.0, 4.0)


def test_position_similarity_grid_tiles_each_patch_map():
    similarity = np.random.default_rng(2).uniform(-1, 1, size=(2, 3, 2, 3))
    fig = figures.position_similarity_grid(similarity)
    title_of(fig)
    mosaic = pixels(traces(fig, "image")[0])
    assert mosaic.shape == (2 * 2 + 1, 3 * 3 + 2, 3)
    # The tile of patch (1, 2) starts at row 1 * (2 + 1), column 2 * (3 + 1), coloured as a
    # heatmap from -1 to 1 would colour it; the gaps between tiles are white.
    expected = plotly.colors.sample_colorscale("RdBu_r", ((similarity[1, 2] + 1) / 2).ravel().tolist())
    expected = np.array([plotly.colors.unlabel_rgb(colour) for colour in expected]).reshape(2, 3, 3)
    assert np.abs(mosaic[3:5, 8:11].astype(int) - expected).max() <= 1
    assert (mosaic[2] == 255).all()
    # Hovering a tile names its patch; the transparent hover layer carries the colour bar.
    hover = traces(fig, "heatmap")[0]
    assert (hover.zmin, hover.zmax) == (-1, 1) and hover.showscale
    assert (hover.x0 + 2 * hover.dx, hover.y0 + 1 * hover.dy) == (9.0, 3.5)  # centre of tile (1, 2)
    assert list(hover.customdata[1, 2]) == [1, 2]


def test_the_position_similarity_title_fits_half_a_page():
    """The app draws this figure in one of two columns; a title line much past 40 characters
    (about 360 px at the title's font) was cut off there."""
    title = title_of(figures.position_similarity_grid(np.zeros((2, 3, 2, 3))))
    lines = [re.sub(r"<[^>]+>", "", line) for line in title.split("<br>")]
    assert lines[0] == "Position embedding similarity"
    assert max(len(line) for line in lines) <= 40, lines


def test_colour_mapped_matches_plotly_colour_scales():
    values = np.array([[-0.5, 0.0], [0.25, np.nan]])
    colours = figures.colour_mapped(values, "Viridis", -0.5, 0.25)
    expected = plotly.colors.sample_colorscale("Viridis", [0.0, 0.5 / 0.75, 1.0])
    expected = [plotly.colors.unlabel_rgb(colour) for colour in expected]
    assert np.abs(colours[[0, 0, 1], [0, 1, 0]].astype(int) - np.array(expected)).max() <= 1
    assert list(colours[1, 1]) == [255, 255, 255]


def test_embedding_filters_figure_shows_every_filter():
    filters = np.random.default_rng(3).random((9, 4, 4, 3))
    fig = figures.embedding_filters_figure(filters, columns=7)
    assert "9" in title_of(fig)
    mosaic = pixels(traces(fig, "image")[0])
    assert mosaic.shape == (2 * 4 + 1, 7 * 4 + 6, 3)
    assert np.array_equal(mosaic[5:9, 5:9], np.round(filters[8] * 255).astype(np.uint8))


def test_attention_overlay_puts_one_cell_on_each_patch():
    attention_map = np.arange(6.0).reshape(GRID) / 15
    fig = figures.attention_overlay(IMAGE, attention_map, opacity=0.4, title="Rollout")
    assert title_of(fig) == "Rollout"
    heatmap = traces(fig, "heatmap")[0]
    assert np.array_equal(heatmap.z, attention_map)
    assert heatmap.opacity == 0.4
    # 12 x 8 pixels, 3 x 2 cells: centres of the first cell at (1.5, 1.5), then every 4 px.
    assert (heatmap.x0, heatmap.dx, heatmap.y0, heatmap.dy) == (1.5, 4.0, 1.5, 4.0)
    assert "patch %{customdata[0]}" in heatmap.hovertemplate and "%{z" in heatmap.hovertemplate
    with pytest.raises(ValueError, match=r"\(gh, gw\)"):
        figures.attention_overlay(IMAGE, attention_map.ravel())


def test_attention_heads_grid_has_a_panel_per_head_on_a_shared_scale():
    maps = np.random.default_rng(4).random((5, *GRID))
    fig = figures.attention_heads_grid(IMAGE, maps, opacity=0.5, layer=3)
    assert "layer 3" in title_of(fig)
    heatmaps = traces(fig, "heatmap")
    assert len(heatmaps) == 5 and len(traces(fig, "image")) == 5
    for head, heatmap in enumerate(heatmaps):
        assert np.array_equal(heatmap.z, maps[head])
        assert heatmap.coloraxis == "coloraxis"
    assert fig.layout.coloraxis.cmax == pytest.approx(maps.max())
    assert [a.text for a in fig.layout.annotations] == [f"head {h} (max {maps[h].max():.2g})" for h in range(5)]
    # Every panel keeps the image's aspect ratio.
    assert fig.layout.yaxis5.scaleanchor == "x5"


def alpha(colour: str) -> float:
    """The opacity of a plotly colour string: rgba(r,g,b,a) -> a; opaque otherwise."""
    match = re.fullmatch(r"rgba\(\s*\d+\s*,\s*\d+\s*,\s*\d+\s*,\s*([\d.]+)\s*\)", colour.replace(" ", ""))
    return float(match.group(1)) if match else 1.0


def assert_clear_at_zero(colorscale) -> None:
    """Zero attention leaves the image untouched and opacity grows with the value to (nearly)
    opaque: over a white object a light colour for high values read like low ones."""
    alphas = [alpha(colour) for _, colour in colorscale]
    assert alphas[0] == 0 and alphas[-1] >= 0.9
    assert alphas == sorted(alphas)


def query_rects(fig: go.Figure, axes: str = "") -> list[tuple[float, float, float, float]]:
    return sorted({
        (shape.x0, shape.x1, shape.y0, shape.y1) for shape in fig.layout.shapes
        if shape.type == "rect" and (shape.xref or "x") == f"x{axes}" and (shape.yref or "y") == f"y{axes}"
    })


def test_attention_overlays_start_clear_at_zero_and_outline_the_query():
    rollout = np.full(GRID, 0.0012)
    rollout[0, 0] = 0.071
    fig = figures.attention_overlay(IMAGE, rollout, title="Rollout", value_name="rollout", query_patch=4)
    heatmap = traces(fig, "heatmap")[0]
    assert_clear_at_zero(heatmap.colorscale)
    # The scale starts at 0, not at the smallest value: 0.0012 is nearly clear, not the bottom colour.
    assert heatmap.zmin == 0 and heatmap.zmax == pytest.approx(0.071)
    # Patch 4 is (row 1, col 1) of the 2 x 3 grid: pixels 4..7 both ways, edges at -0.5.
    assert query_rects(fig) == [(3.5, 7.5, 3.5, 7.5)]
    assert traces(figures.attention_overlay(IMAGE, rollout), "heatmap")[0].zmin == 0
    assert not figures.attention_overlay(IMAGE, rollout).layout.shapes  # no query patch: no outline


def test_attention_heads_share_one_scale_from_zero_or_each_have_their_own():
    maps = np.random.default_rng(4).random((5, *GRID)) * np.linspace(0.6, 1.0, 5)[:, None, None]
    shared = figures.attention_heads_grid(IMAGE, maps, layer=3)
    assert "one colour scale shared by all heads" in title_of(shared)
    assert shared.layout.coloraxis.cmin == 0 and shared.layout.coloraxis.cmax == pytest.approx(maps.max())
    assert_clear_at_zero(shared.layout.coloraxis.colorscale)
    assert "all heads" in shared.layout.coloraxis.colorbar.title.text
    per_head = figures.attention_heads_grid(IMAGE, maps, layer=3, scale="per head")
    assert "each head on its own scale" in title_of(per_head)
    for head, heatmap in enumerate(traces(per_head, "heatmap")):
        assert heatmap.coloraxis is None and heatmap.showscale is False
        assert heatmap.zmin == 0 and heatmap.zmax == pytest.approx(maps[head].max())
        assert_clear_at_zero(heatmap.colorscale)
    with pytest.raises(ValueError, match="scale must be one of"):
        figures.attention_heads_grid(IMAGE, maps, scale="log")


def test_uniform_attention_is_drawn_pale_and_flat_not_in_full_colour():
    """Every weight 1/6 over 6 patches: topping the scale at the largest value would paint the
    whole image in the top colour; the scale reaches 3x the uniform weight instead."""
    uniform = np.full((4, *GRID), 1 / 6)
    assert figures.attention_heads_grid(IMAGE, uniform).layout.coloraxis.cmax == pytest.approx(0.5)
    for heatmap in traces(figures.attention_heads_grid(IMAGE, uniform, scale="per head"), "heatmap"):
        assert heatmap.zmax == pytest.approx(0.5)
    rollout = traces(figures.attention_overlay(IMAGE, uniform[0], weights=True), "heatmap")[0]
    assert rollout.zmax == pytest.approx(0.5)
    # Relevance is not a share of anything: its scale tops at its largest value.
    assert traces(figures.attention_overlay(IMAGE, uniform[0]), "heatmap")[0].zmax == pytest.approx(1 / 6)
    matrix = traces(figures.attention_matrix(np.full((8, 8), 1 / 8), 1), "heatmap")[0]
    assert matrix.zmax == pytest.approx(3 / 8)


def test_the_query_patch_is_outlined_in_every_head_panel_and_mask():
    maps = np.random.default_rng(5).random((5, *GRID))
    for fig in (
        figures.attention_heads_grid(IMAGE, maps, layer=1, query="patch 5", query_patch=5),
        figures.attention_masks_grid(IMAGE, maps > 0.5, 0.6, layer=1, query="patch 5", query_patch=5),
    ):
        # Patch 5 is (row 1, col 2): pixels 8..11 across, 4..7 down; one outline on each panel's axes.
        for axes in ["", "2", "3", "4", "5"]:
            assert query_rects(fig, axes) == [(7.5, 11.5, 3.5, 7.5)], axes
    assert not figures.attention_heads_grid(IMAGE, maps, query="class token").layout.shapes
    with pytest.raises(ValueError, match="outside the 2x3 grid"):
        figures.attention_heads_grid(IMAGE, maps, query_patch=6)


def test_attention_matrix_is_large_starts_at_zero_and_outlines_the_query_row():
    attention = torch.softmax(torch.randn(8, 8), dim=-1)
    fig = figures.attention_matrix(attention, num_prefix_tokens=2, query_token=5)
    heatmap = traces(fig, "heatmap")[0]
    assert heatmap.zmin == 0
    assert fig.layout.height >= 700 and fig.layout.yaxis.scaleanchor == "x"  # square cells, readable
    (row,) = [shape for shape in fig.layout.shapes if shape.type == "rect"]
    assert (row.x0, row.x1, row.y0, row.y1) == (-0.5, 7.5, 4.5, 5.5)
    # In blocks of 3 patches, patch 4 (token 5) lies in the block of patches 3-5: drawn row 2.
    blocks = figures.attention_matrix(torch.softmax(torch.randn(10, 10), -1), 1, max_cells=5, query_token=5)
    (row,) = [shape for shape in blocks.layout.shapes if shape.type == "rect"]
    assert (row.y0, row.y1) == (1.5, 2.5) and list(traces(blocks, "heatmap")[0].y)[2] == "patches 3-5"
    assert figures.matrix_block(10, 1, max_cells=5) == 3 and figures.matrix_block(197, 1) == 1
    with pytest.raises(ValueError, match="not one of the 8 tokens"):
        figures.attention_matrix(attention, num_prefix_tokens=2, query_token=8)


def test_attention_matrix_labels_tokens():
    attention = torch.softmax(torch.randn(8, 8), dim=-1)
    fig = figures.attention_matrix(attention, num_prefix_tokens=2, title="Layer 0, head 1")
    assert title_of(fig) == "Layer 0, head 1"
    heatmap = traces(fig, "heatmap")[0]
    assert np.allclose(heatmap.z, attention.numpy())
    assert list(heatmap.x) == list(heatmap.y) == ["CLS", "reg 1"] + [f"patch {i}" for i in range(6)]
    assert len(fig.layout.shapes) == 2
    assert figures.token_labels(3, 1, class_token=False) == ["reg 1", "patch 0", "patch 1"]


def test_a_large_attention_matrix_is_drawn_in_blocks_of_their_largest_weight():
    attention = torch.softmax(torch.randn(1 + 9, 1 + 9, generator=torch.Generator().manual_seed(0)), dim=-1)
    fig = figures.attention_matrix(attention, num_prefix_tokens=1, max_cells=5)
    assert "blocks of 3 x 3" in title_of(fig)
    heatmap = traces(fig, "heatmap")[0]
    z = np.array(heatmap.z)
    assert z.shape == (4, 4)  # the class token, then patches 0-2, 3-5, 6-8
    assert list(heatmap.x) == ["CLS", "patches 0-2", "patches 3-5", "patches 6-8"]
    assert np.isclose(z[0, 0], attention[0, 0]) and np.isclose(z[0, 2], attention[0, 4:7].max())
    assert np.isclose(z[3, 1], attention[7:10, 1:4].max())
    uneven = figures.attention_matrix(attention[:9, :9], num_prefix_tokens=1, max_cells=5)
    assert list(traces(uneven, "heatmap")[0].x)[-1] == "patches 6-7"


def test_layer_head_figures_carry_the_values():
    values = np.arange(6.0).reshape(3, 2)
    heatmap_fig = figures.layer_head_heatmap(values, "Entropy per head", "nats", layers=[1, 4, 7])
    assert title_of(heatmap_fig) == "Entropy per head"
    heatmap = traces(heatmap_fig, "heatmap")[0]
    assert np.array_equal(heatmap.z, values) and list(heatmap.y) == [1, 4, 7]
    assert heatmap.colorbar.title.text == "nats"
    scatter_fig = figures.layer_head_scatter(values, "Mean attention distance", "pixels")
    title_of(scatter_fig)
    heads = [t for t in scatter_fig.data if t.name.startswith("head")]
    assert [list(t.y) for t in heads] == [[0, 2, 4], [1, 3, 5]]
    (mean,) = [t for t in scatter_fig.data if t.name == "mean over heads"]
    assert list(mean.y) == [0.5, 2.5, 4.5]
    with pytest.raises(ValueError, match="2 layer labels for 3 layers"):
        figures.layer_head_heatmap(values, "t", "c", layers=[0, 1])


def test_logit_lens_figure_shows_the_most_probable_classes():
    probs = torch.softmax(torch.randn(4, 12), dim=-1)
    names = [f"n{i}" for i in range(12)]
    fig = figures.logit_lens_figure(probs, names, max_classes=3)
    title_of(fig)
    heatmap = traces(fig, "heatmap")[0]
    best = torch.argsort(probs[-1], descending=True)[:3]
    assert list(heatmap.x) == [names[i] for i in best]
    assert np.allclose(heatmap.z, probs[:, best].numpy())
    assert list(heatmap.y) == ["embeddings", "after block 0", "after block 1", "after block 2"]


def test_topk_bar_orders_classes():
    probs = np.array([0.1, 0.6, 0.05, 0.25])
    fig = figures.topk_bar(probs, ["a", "b", "c", "d"], k=3)
    assert "Top-3" in title_of(fig)
    bar = traces(fig, "bar")[0]
    assert list(bar.y) == ["b", "d", "a"] and np.allclose(bar.x, [0.6, 0.25, 0.1])
    with pytest.raises(ValueError, match="3 class names for 4 classes"):
        figures.topk_bar(probs, ["a", "b", "c"])


def test_token_norms_figure_maps_patch_norms():
    norms = np.arange(8.0)
    fig = figures.token_norms_figure(norms, GRID, num_prefix_tokens=2, layer=5)
    assert "after block 5" in title_of(fig)
    heatmap = traces(fig, "heatmap")[0]
    assert np.array_equal(heatmap.z, np.arange(2.0, 8.0).reshape(GRID))
    bar = traces(fig, "bar")[0]
    assert np.array_equal(bar.y, norms) and list(bar.customdata[:3]) == ["CLS", "reg 1", "patch 0"]
    with pytest.raises(ValueError, match="7 norms"):
        figures.token_norms_figure(norms[:7], GRID, 2)
    assert fig.layout.bargap is None  # plotly's gaps between a few bars
    many = figures.token_norms_figure(np.ones(1 + 37 * 37), (37, 37), num_prefix_tokens=1)
    assert many.layout.bargap == 0 and traces(many, "bar")[0].marker.line.width == 0  # no haze of gaps


def test_training_curves_plot_steps_and_epochs():
    # As vit_explorer.training.train logs them: steps every so often (not at epoch ends), epochs from 1.
    steps = [dict(step=s, total_steps=6, epoch=(s - 1) // 3 + 1, loss=1.0 / s, accuracy=s / 4,
                  lr=0.1 * s, images_per_s=10.0) for s in (1, 2, 4, 5)]
    epochs = [dict(epoch=e, epochs=2, train_loss=0.5, train_accuracy=0.5, test_loss=0.9 - e / 10,
                   test_accuracy=0.2 + e / 10, seconds=1.0) for e in (1, 2)]
    fig = figures.training_curves({"steps": steps, "epochs": epochs})
    assert "step 5 of 6" in title_of(fig) and "40.0%" in title_of(fig)
    by_name = {(t.name, t.xaxis): t for t in fig.data}
    assert list(by_name["train (per step)", "x"].y) == [1.0, 0.5, 0.25, 0.2]
    assert list(by_name["learning rate", "x3"].y) == pytest.approx([0.1, 0.2, 0.4, 0.5])
    test_accuracy = by_name["test (per epoch)", "x2"]
    # Each epoch's test result sits where that epoch ended: steps 3 and 6.
    assert list(test_accuracy.x) == [3, 6] and list(test_accuracy.y) == pytest.approx([0.3, 0.4])


@pytest.mark.parametrize("history", [None, {}, {"steps": [], "epochs": []}])
def test_training_curves_of_an_empty_history_are_an_empty_valid_figure(history):
    fig = figures.training_curves(history)
    assert "nothing logged" in title_of(fig)
    assert all(len(trace.x or ()) == 0 for trace in fig.data)


def test_sae_curves_show_explained_variance_below_zero_and_end_on_the_held_out_number():
    # As features.train logs them: every few steps, the held-out tokens' number at each epoch's end.
    steps = [dict(step=s, total_steps=4, epoch=(s - 1) // 2 + 1, mse=1.0 / s, explained_variance=ev, l0=8.0,
                  dead_share=0.1, held_out_explained_variance=held)
             for s, ev, held in ((1, -3.36, None), (2, 0.5, 0.62), (3, 0.8, None), (4, 0.9, 0.93))]
    fig = figures.sae_curves({"steps": steps})
    assert "step 4 of 4, explains 93.0% of held-out tokens' variance" in title_of(fig)
    assert fig.layout.yaxis.range[0] <= -3.36 and fig.layout.yaxis.range[1] >= 1  # the start is on the axis
    held_out = [trace for trace in fig.data if trace.name == "held-out tokens (each pass's end)"][0]
    assert list(held_out.x) == [2, 4] and list(held_out.y) == [0.62, 0.93]
    before = figures.sae_curves({"steps": [{**step, "held_out_explained_variance": None} for step in steps[:1]]})
    assert "explains -336.0% of the last steps' training tokens" in title_of(before)


def test_accuracy_by_image_size_draws_a_line_per_model_in_pixel_order():
    series = {
        "run 1 (learned)": {(32, 32): 0.9, (64, 64): 0.3, (48, 48): 0.4},
        "run 2 (rotary)": {(32, 32): 0.95, (48, 48): 0.8},
    }
    fig = figures.accuracy_by_image_size_figure(series, trained_size=(32, 32))
    assert title_of(fig) == "Test accuracy at each input size (trained at 32x32)"
    learned, rotary = fig.data
    assert list(learned.x) == ["32x32 (trained)", "64x64", "48x48"] and list(learned.y) == [0.9, 0.3, 0.4]
    assert list(rotary.y) == [0.95, 0.8] and rotary.name == "run 2 (rotary)"
    assert list(fig.layout.xaxis.categoryarray) == ["32x32 (trained)", "48x48", "64x64"]


def test_write_figures_as_html_shares_one_plotly_js(tmp_path):
    figs = {"a": figures.topk_bar(np.array([0.2, 0.8])), "b": figures.training_curves(None)}
    paths = figures.write_figures(figs, tmp_path / "out", image_format="html")
    assert [p.name for p in paths] == ["a.html", "b.html"]
    assert all(p.read_text().count("plotly.min.js") == 1 for p in paths)
    assert (tmp_path / "out" / "plotly.min.js").is_file()


def _extent(trace: dict, width: int, height: int) -> tuple[float, float, float, float]:
    """Where an image trace of a width x height picture lies: its first and last pixels' edges."""
    dx, dy = trace.get("dx", 1.0), trace.get("dy", 1.0)
    x0, y0 = trace.get("x0", 0.0), trace.get("y0", 0.0)
    return (x0 - dx / 2, x0 + (width - 0.5) * dx, y0 - dy / 2, y0 + (height - 0.5) * dy)


@pytest.mark.parametrize("size, kind", [(14, "enlarged"), (1406, "reduced"), (500, "as it is")])
def test_a_static_image_has_the_browser_draw_each_picture_where_it_was(size, kind):
    from vit_explorer.figures.files import _drawn_images

    picture = np.random.default_rng(1).integers(0, 256, size=(size, size, 3), dtype=np.uint8)
    fig = figures.input_image(picture, "a picture")
    fig.update_traces(x0=3.0, dx=2.0, y0=-1.0, dy=2.0, selector=dict(type="image"))
    before = fig.to_dict()["data"][0]
    after = _drawn_images(fig.to_dict(), 900, 700)["data"][0]
    drawn = np.asarray(Image.open(io.BytesIO(base64.b64decode(after["source"].split(",", 1)[1]))).convert("RGB"))
    assert after["zsmooth"] == "fast"  # drawn by the browser, not repainted in JavaScript
    assert _extent(after, drawn.shape[1], drawn.shape[0]) == pytest.approx(_extent(before, size, size))
    if kind == "enlarged":  # each pixel a block of whole pixels: still sharp once drawn
        factor = drawn.shape[0] // size
        assert factor > 1 and np.array_equal(drawn, picture.repeat(factor, 0).repeat(factor, 1))
    elif kind == "reduced":  # to about what it can be drawn at in a 700 px high image
        assert drawn.shape[0] <= 700 and abs(drawn.astype(float).mean() - picture.mean()) < 2
    else:
        assert after["source"] == before["source"]


@pytest.mark.skipif(figures.find_browser() is None, reason="needs Chrome or Chromium")
def test_write_figures_as_png_with_a_picture_in_them(tmp_path):
    picture = np.random.default_rng(2).integers(0, 256, size=(14, 14, 3), dtype=np.uint8)
    paths = figures.write_figures({"picture": figures.input_image(picture, "a picture")}, tmp_path, image_format="png")
    assert [path.name for path in paths] == ["picture.png"]
    assert paths[0].read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


@pytest.mark.skipif(figures.find_browser() is None, reason="needs Chrome or Chromium")
def test_the_cartesian_plotly_draws_what_the_full_one_draws(tmp_path, monkeypatch):
    from vit_explorer.figures import files

    assert files.cartesian_plotly() == files.CARTESIAN_PLOTLY  # plotly.py ships the same plotly.js version
    rng = np.random.default_rng(3)
    picture = rng.integers(0, 256, size=(28, 28, 3), dtype=np.uint8)
    drawn = {  # an image, a heatmap, bars and a scatter, as the figures inspect writes
        "norms": figures.token_norms_figure(rng.random(17), (4, 4), 1),
        "overlay": figures.attention_overlay(picture, rng.random((4, 4)), title="a map"),
        "curves": figures.training_curves(None),
    }
    cartesian = figures.write_figures(drawn, tmp_path / "cartesian")
    monkeypatch.setattr(files, "cartesian_plotly", lambda: None)
    full = figures.write_figures(drawn, tmp_path / "full")
    for ours, theirs in zip(cartesian, full):
        assert np.array_equal(np.asarray(Image.open(ours)), np.asarray(Image.open(theirs))), ours.name


def test_the_cartesian_plotly_only_where_plotly_py_has_its_version(monkeypatch):
    import plotly.offline

    from vit_explorer.figures import files

    monkeypatch.setattr(plotly.offline, "get_plotlyjs_version", lambda: "4.0.0")
    assert files.cartesian_plotly() is None


@pytest.mark.skipif(figures.find_browser() is None, reason="needs Chrome or Chromium")
def test_png_writer_refuses_a_trace_the_cartesian_plotly_lacks(tmp_path):
    writer = figures.PngWriter(tmp_path)
    try:
        with pytest.raises(figures.FigureExportError, match="no scatter3d trace; write this figure with write_figures"):
            writer.write("cloud", go.Figure(go.Scatter3d(x=[0], y=[0], z=[0])))
    finally:
        writer.close_quietly()


def test_find_browser_honours_browser_path(monkeypatch, tmp_path):
    monkeypatch.setenv("BROWSER_PATH", str(tmp_path / "missing-chrome"))
    assert figures.find_browser() is None
    with pytest.raises(figures.FigureExportError, match="needs Chrome or Chromium"):
        figures.write_figures({"a": figures.training_curves(None)}, tmp_path, image_format="png")


def test_input_image_shows_the_image_with_its_aspect():
    fig = figures.input_image(IMAGE, "Model input: 12x8 pixels")
    assert title_of(fig) == "Model input: 12x8 pixels"
    assert np.array_equal(pixels(traces(fig, "image")[0]), IMAGE)
    assert fig.layout.yaxis.scaleanchor == "x"


def test_token_matrix_has_a_row_per_token():
    tokens = torch.randn(5, 4)
    fig = figures.token_matrix(tokens, 1, "Tokens entering layer 0")
    assert title_of(fig) == "Tokens entering layer 0: 5 x 4"
    heatmap = traces(fig, "heatmap")[0]
    assert np.allclose(heatmap.z, tokens.numpy())
    assert heatmap.zmin == -heatmap.zmax == pytest.approx(-float(tokens.abs().max()))
    cut = figures.token_matrix(torch.randn(300, 200), 1, "Big", max_tokens=256, max_dims=128)
    assert np.shape(traces(cut, "heatmap")[0].z) == (256, 128) and "first 256 x 128" in title_of(cut)
    assert list(heatmap.y) == ["CLS", "patch 0", "patch 1", "patch 2", "patch 3"]
    no_class = figures.token_matrix(tokens, 1, "t", class_token=False)
    assert traces(no_class, "heatmap")[0].y[0] == "reg 1"
    with pytest.raises(ValueError, match=r"\(N, D\)"):
        figures.token_matrix(tokens[0], 0, "t")


def test_patch_size_tradeoff_shows_tokens_time_and_accuracy_side_by_side():
    rows = [
        {"patch size": patch, "grid": f"{32 // patch}x{32 // patch}", "tokens": 1 + (32 // patch) ** 2,
         "forward ms": 10.0 / patch, "prediction": "circle", "probability": 0.9, "held-out accuracy": 0.95}
        for patch in (2, 4, 8)
    ]
    fig = figures.patch_size_tradeoff(rows, current=4)
    tokens, times, probabilities, accuracy = fig.data
    assert list(tokens.y) == [257, 65, 17] and list(times.y) == [5.0, 2.5, 1.25]
    assert list(probabilities.text) == ["circle"] * 3 and list(accuracy.y) == [0.95] * 3
    assert list(tokens.marker.color).count("#e45756") == 1  # the current patch size
    # Without a held-out set there is no accuracy line.
    without = [{**row, "held-out accuracy": None} for row in rows]
    assert len(figures.patch_size_tradeoff(without, current=4).data) == 3


@pytest.mark.parametrize("rows, columns, options", [
    (3, 4, dict(titles=[f"head {h}" for h in range(10)], horizontal_spacing=0.02, vertical_spacing=0.06)),
    (1, 2, dict(titles=["input", "patch tokens"], horizontal_spacing=0.03)),
    (3, 2, dict(column_titles=["a", "b"], row_titles=["x", "y", "z"], horizontal_spacing=0.01, vertical_spacing=0.04)),
    (2, 3, dict(titles=["1", "2", "3", "all"], vertical_spacing=0.12, row_heights=[0.65, 0.35],
                specs=[[{}] * 3, [{"colspan": 3}, None, None]])),
])
def test_grids_built_in_one_go_have_make_subplots_own_layout_and_axes(rows, columns, options):
    from plotly.subplots import make_subplots

    from vit_explorer.figures._base import _subplots
    layout, cells = _subplots(rows, columns, **options)
    titles = options.pop("titles", None)
    reference = make_subplots(rows=rows, cols=columns, subplot_titles=titles, **options)
    assert go.Figure(layout=layout).to_dict() == go.Figure(layout=reference.layout).to_dict()
    for (row, col), suffix in cells.items():  # each cell's axes, as add_trace(row=, col=) places a trace
        placed = go.Figure(reference).add_trace(go.Scatter(x=[0]), row=row, col=col).data[-1]
        assert (placed.xaxis, placed.yaxis) == (f"x{suffix}", f"y{suffix}")


def test_the_grid_layouts_kept_for_reuse_are_bounded():
    from vit_explorer.figures._base import _subplots_json
    _subplots_json.cache_clear()
    for heads in range(1, 50):  # more grid shapes than are kept
        fig = figures.attention_heads_grid(IMAGE, np.random.default_rng(heads).random((heads, *GRID)), columns=7)
        assert len(traces(fig, "heatmap")) == heads and fig.layout.annotations[-1].text.startswith(f"head {heads - 1} ")
    assert _subplots_json.cache_info().currsize <= _subplots_json.cache_info().maxsize == 32


def test_a_pictures_encoding_is_reused_by_content_and_the_kept_ones_are_bounded():
    from vit_explorer.figures import _base
    first = _base.image_data_uri(IMAGE)
    assert _base.image_data_uri(IMAGE.copy()) == first  # the same picture, another array
    other = IMAGE.copy()
    other[0, 0, 0] ^= 1
    assert _base.image_data_uri(other) != first  # one value changed is another picture
    for seed in range(_base.URI_CACHE_SIZE + 5):
        _base.image_data_uri(np.full((2, 2, 3), seed, dtype=np.uint8))
    assert len(_base._URIS) == _base.URI_CACHE_SIZE


def _attention_matrix_the_old_way(attention, labels, value, tokens, cells, prefix, row, title):
    """attention_matrix as it was built before: a figure, then add_shape and update_* calls."""
    from vit_explorer.figures._base import MARGIN, VALUE_SCALE, _title, attention_top
    from vit_explorer.figures.attention import MATRIX_PIXELS, QUERY_COLOUR

    fig = go.Figure(go.Heatmap(
        z=attention.astype(np.float32), x=labels, y=labels, colorscale=VALUE_SCALE,
        zmin=0, zmax=attention_top(attention, 1 / tokens),
        hovertemplate=f"query %{{y}}<br>key %{{x}}<br>{value} %{{z:.4g}}<extra></extra>",
        colorbar=dict(title=value.replace(" ", "<br>")),
    ))
    if prefix:
        edge, line = prefix - 0.5, dict(color="white", width=1, dash="dot")
        fig.add_shape(type="line", x0=edge, x1=edge, y0=-0.5, y1=cells - 0.5, line=line)
        fig.add_shape(type="line", x0=-0.5, x1=cells - 0.5, y0=edge, y1=edge, line=line)
    if row is not None:
        fig.add_shape(type="rect", x0=-0.5, x1=cells - 0.5, y0=row - 0.5, y1=row + 0.5,
                      line=dict(color=QUERY_COLOUR, width=2))
    fig.update_xaxes(title="key token", constrain="domain", showgrid=False, type="category")
    fig.update_yaxes(title="query token", autorange="reversed", scaleanchor="x", constrain="domain",
                     showgrid=False, type="category")
    fig.update_layout(title=_title(title), margin=MARGIN, height=MATRIX_PIXELS)
    return fig


@pytest.mark.parametrize("tokens, prefix, query_token", [(17, 1, 0), (17, 1, 5), (16, 0, None), (20, 4, 2)])
def test_the_attention_matrix_built_in_one_go_is_the_figure_it_was(tokens, prefix, query_token):
    rng = np.random.default_rng(tokens)
    attention = rng.random((tokens, tokens))
    attention /= attention.sum(-1, keepdims=True)
    labels = figures.token_labels(tokens, prefix)
    new = figures.attention_matrix(attention, prefix, title="t", query_token=query_token)
    old = _attention_matrix_the_old_way(attention, labels, "attention", tokens, tokens, prefix, query_token, "t")
    assert _json(new) == _json(old)


def _token_matrix_the_old_way(shown, labels, limit, count, title):
    from vit_explorer.figures._base import MARGIN, SIMILARITY_SCALE, _title

    fig = go.Figure(go.Heatmap(
        z=shown, y=labels, colorscale=SIMILARITY_SCALE, zmin=-limit, zmax=limit,
        hovertemplate="%{y}, dimension %{x}<br>value %{z:.4g}<extra></extra>", colorbar=dict(title="value"),
    ))
    fig.update_xaxes(title="embedding dimension")
    fig.update_yaxes(title="token", autorange="reversed", type="category", showticklabels=count <= 40)
    fig.update_layout(title=_title(title), margin=MARGIN)
    return fig


def _topk_bar_the_old_way(probs, top, names):
    from vit_explorer.figures._base import MARGIN, _title

    fig = go.Figure(go.Bar(
        x=probs[top], y=[names[i] for i in top], orientation="h",
        text=[f"{100 * probs[i]:.1f}%" for i in top], textposition="auto",
        marker_color="#4c78a8", hovertemplate="%{y}: %{x:.4f}<extra></extra>",
    ))
    fig.update_xaxes(title="probability", range=[0, 1])
    fig.update_yaxes(autorange="reversed")
    fig.update_layout(title=_title(f"Top-{len(top)} predictions"), margin=MARGIN)
    return fig


@pytest.mark.parametrize("count", [5, 50])
def test_token_matrix_and_top5_built_in_one_go_are_the_figures_they_were(count):
    rng = np.random.default_rng(count)
    tokens = rng.standard_normal((count, 20))
    shown = tokens[:, :16]
    new = figures.token_matrix(tokens, 1, "Tokens", max_dims=16)
    old = _token_matrix_the_old_way(
        shown, figures.token_labels(count, 1), float(np.abs(shown).max()), count,
        f"Tokens: {count} x 20 (first {count} x 16 shown)",
    )
    assert _json(new) == _json(old)

    probs = rng.random(count)
    probs /= probs.sum()
    top = np.argsort(-probs, kind="stable")[:5]
    names = [f"class {index}" for index in range(count)]
    assert _json(figures.topk_bar(probs, names)) == _json(_topk_bar_the_old_way(probs, top, names))


def _layer_head_figures_the_old_way(values, probs, shown, names):
    from vit_explorer.figures._base import MARGIN, VALUE_SCALE, _title

    layers = list(range(values.shape[0]))
    heatmap = go.Figure(go.Heatmap(
        z=values, x=list(range(values.shape[1])), y=layers, colorscale=VALUE_SCALE,
        hovertemplate="layer %{y}, head %{x}<br>e %{z:.4g}<extra></extra>", colorbar=dict(title="e"),
    ))
    heatmap.update_xaxes(title="head", dtick=1)
    heatmap.update_yaxes(title="layer", autorange="reversed", type="category")
    heatmap.update_layout(title=_title("h"), margin=MARGIN)
    scatter = go.Figure()
    for head in range(values.shape[1]):
        scatter.add_trace(go.Scatter(
            x=layers, y=values[:, head], mode="markers", name=f"head {head}", marker=dict(size=8, opacity=0.8),
            hovertemplate=f"layer %{{x}}, head {head}<br>d %{{y:.4g}}<extra></extra>",
        ))
    scatter.add_trace(go.Scatter(
        x=layers, y=values.mean(axis=1), mode="lines", name="mean over heads", line=dict(color="black", width=2),
        hovertemplate="layer %{x}, mean<br>d %{y:.4g}<extra></extra>",
    ))
    scatter.update_xaxes(title="layer", tickvals=layers)
    scatter.update_yaxes(title="d", rangemode="tozero")
    scatter.update_layout(title=_title("s"), margin=MARGIN)
    rows = ["embeddings"] + [f"after block {block}" for block in range(probs.shape[0] - 1)]
    lens = go.Figure(go.Heatmap(
        z=probs[:, shown], x=[names[i] for i in shown], y=rows, colorscale=VALUE_SCALE, zmin=0, zmax=1,
        colorbar=dict(title="probability"), hovertemplate="%{y}<br>%{x}: %{z:.3f}<extra></extra>",
    ))
    lens.update_yaxes(autorange="reversed")
    lens.update_xaxes(title="class (most probable at the output first)")
    lens.update_layout(title=_title("Logit lens: the classifier head applied after every block"), margin=MARGIN)
    return heatmap, scatter, lens


def test_layer_head_figures_and_the_logit_lens_built_in_one_go_are_the_figures_they_were():
    rng = np.random.default_rng(7)
    values = rng.random((4, 3))
    probs = rng.random((5, 12))
    probs /= probs.sum(-1, keepdims=True)
    names = [f"class {index}" for index in range(12)]
    shown = np.argsort(-probs[-1], kind="stable")[:10]
    new = (figures.layer_head_heatmap(values, "h", "e"), figures.layer_head_scatter(values, "s", "d"),
           figures.logit_lens_figure(probs, names))
    old = _layer_head_figures_the_old_way(values, probs, shown, names)
    assert [_json(figure) for figure in new] == [_json(figure) for figure in old]


def _token_norms_the_old_way(norms, grid_size, prefix, labels, title):
    from plotly.subplots import make_subplots

    from vit_explorer.figures._base import MARGIN, VALUE_SCALE, _image_axis_layout, _patch_positions, _title

    fig = make_subplots(rows=1, cols=2, column_widths=[0.45, 0.55], horizontal_spacing=0.16,
                        subplot_titles=("patch tokens on the grid", "every token"))
    fig.add_trace(go.Heatmap(
        z=norms[prefix:].reshape(grid_size), colorscale=VALUE_SCALE, customdata=_patch_positions(grid_size),
        hovertemplate="patch %{customdata[0]} (row %{customdata[1]}, col %{customdata[2]})"
        "<br>norm %{z:.4g}<extra></extra>", colorbar=dict(title="norm", x=0.39, thickness=12),
    ), row=1, col=1)
    fig.add_trace(go.Bar(
        x=list(range(norms.shape[0])), y=norms, marker_color=["#e45756"] * prefix + ["#4c78a8"] * (norms.shape[0] - prefix),
        customdata=labels, hovertemplate="token %{x} (%{customdata})<br>norm %{y:.4g}<extra></extra>", showlegend=False,
    ), row=1, col=2)
    fig.update_layout(_image_axis_layout())
    fig.update_xaxes(title="token (prefix tokens in red)", row=1, col=2)
    fig.update_yaxes(title="L2 norm", row=1, col=2)
    fig.update_layout(title=_title(title), margin=MARGIN)
    return fig


@pytest.mark.parametrize("prefix, layer", [(1, 3), (0, None), (5, 0)])
def test_token_norms_built_in_one_go_are_the_figure_they_were(prefix, layer):
    norms = np.random.default_rng(prefix).random(prefix + 12)
    new = figures.token_norms_figure(norms, (3, 4), prefix, layer=layer)
    old = _token_norms_the_old_way(
        norms, (3, 4), prefix, figures.token_labels(prefix + 12, prefix),
        f"Token norms after block {layer}" if layer is not None else "Token norms",
    )
    assert _json(new) == _json(old)


def test_the_register_figures_show_their_numbers_on_one_scale():
    before = np.arange(6.0).reshape(GRID) + 1
    before[0, 2] = 60.0
    after = np.full(GRID, 3.0)
    outliers = before > 10
    fig = figures.register_norms_figure(before, after, outliers, 58.0, IMAGE.shape, layer=5)
    assert title_of(fig).startswith("Patch-token norms after layer 5") and title_of(fig).endswith("register's norm: 58")
    maps = [trace for trace in fig.data if trace.type == "heatmap"]
    assert [(m.zmin, m.zmax) for m in maps] == [(1.0, 60.0)] * 2  # one scale for both passes
    np.testing.assert_array_equal(maps[0].z, before)
    assert [list(t.customdata) for t in fig.data if t.type == "scatter"] == [[2], [2]]  # the outlier, in both
    with pytest.raises(ValueError, match="must be one"):
        figures.register_norms_figure(before, after[:1], outliers, 1.0, IMAGE.shape, layer=0)
    ranked = [(2, 7, 9.0), (1, 3, 2.0), (2, 4, 1.0)]
    fig = figures.register_neurons_figure([0.5, 2.0, 9.0], ranked, chosen=2, first=1, last=2, appears_at=2)
    layers, units = fig.data
    assert list(layers.marker.color) == ["#9aa5b1", "#e45756", "#e45756"]  # layer 0 is not searched
    assert list(units.y) == ["layer 2, unit 7", "layer 1, unit 3", "layer 2, unit 4"]
    assert list(units.marker.color) == ["#e45756", "#e45756", "#9aa5b1"]  # the two chosen
    lines = figures.attention_drawn_figure([0.5, 0.9], [0.1, 0.05], [0.0, 0.8], "class token")
    assert [trace.name for trace in lines.data] == [
        "on the outlier patches, without", "on the same patches, with the register", "on the register",
    ]
    assert list(lines.data[2].y) == [0.0, 0.8] and title_of(lines).startswith("The attention the outliers draw")
    norms = figures.norms_by_layer_figure([5, 50], [5, 6], [4, 4], [0, 49])
    assert len(norms.data) == 4 and title_of(norms).startswith("Token norms after each layer")
