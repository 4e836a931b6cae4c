"""Figures that show their point (issue 47, item 6): attention in a colour that stands out from
the picture beneath it, a prefix token's bar on the colour bar's scale, and a top-k chart with
as many rows as it says."""
import json

import numpy as np

from vit_explorer import figures
from vit_explorer.figures._base import ATTENTION_SCALE, CONTRAST_SCALE


def picture(colour) -> np.ndarray:
    return np.full((32, 32, 3), colour, dtype=np.uint8)


def ring(background=(200, 170, 220), ring_colour=(100, 45, 60)) -> tuple[np.ndarray, np.ndarray]:
    """A dark red ring on a pale picture (the shapes' ring) and a map that attends to the ring."""
    image = picture(background)
    yy, xx = np.mgrid[:32, :32]
    on_ring = np.abs(np.hypot(yy - 15.5, xx - 15.5) - 10) < 4
    image[on_ring] = ring_colour
    return image, on_ring.reshape(8, 4, 8, 4).mean((1, 3))


def scales(fig) -> list:
    spec = json.loads(fig.to_json())
    found = [trace["colorscale"] for trace in spec["data"] if "colorscale" in trace]
    found += [spec["layout"]["coloraxis"]["colorscale"]] if "coloraxis" in spec["layout"] else []
    return found


def test_attention_over_a_red_or_dark_object_is_drawn_in_gold_and_over_a_pale_one_in_crimson():
    image, attended = ring()
    for fig in (figures.attention_overlay(image, attended), figures.attention_heads_grid(image, np.stack([attended] * 2))):
        assert scales(fig) and all(scale == CONTRAST_SCALE for scale in scales(fig))
    assert all(scale == CONTRAST_SCALE for scale in scales(figures.attention_overlay(picture((10, 10, 10)), attended)))
    pale = picture((200, 200, 200))
    assert all(scale == ATTENTION_SCALE for scale in scales(figures.attention_overlay(pale, attended)))
    # Intact and knocked out compare on one colour as on one scale.
    intact, knocked = figures.intact_and_knocked_heads(image, np.stack([attended] * 2), np.ones((2, 8, 8)), 3, "class token", "head 0")
    assert scales(intact)[-1] == scales(knocked)[-1] == CONTRAST_SCALE


def test_maps_over_several_pictures_choose_one_colour_for_all_of_them():
    """A head's map on several pictures, a patch's correspondences and a prompt over a set: gold
    where crimson would hide in the attended patches (the dark red ring twice), crimson over pale
    ones; one colour for every panel of one scale."""
    image, attended = ring()
    pale = picture((200, 200, 200))
    maps = np.stack([attended, attended])
    for images, expected in (([image, image], CONTRAST_SCALE), ([pale, pale], ATTENTION_SCALE)):
        drawn = (
            figures.head_maps_grid(images, maps, ["a", "b"], "head 0"),
            figures.correspondence_grid(images, 0.2 + 0.8 * maps, [0, 0], 0, 0, ["a", "b"], "tokens"),
            figures.prompt_over_images(images, maps, "a ring", ["a", "b"], "the value path"),
        )
        for fig in drawn:
            assert scales(fig) and all(scale == expected for scale in scales(fig))


def test_a_prefix_tokens_bar_shares_the_colour_bars_range():
    image, attended = ring()
    values = np.concatenate([[0.009], 0.05 * attended.reshape(-1) / attended.max()])
    fig = figures.token_values_on_grid(image, values, (8, 8), 1, ["CLS"], "Attention of CLS", "attention")
    spec = json.loads(fig.to_json())
    heatmap = next(trace for trace in spec["data"] if trace["type"] == "heatmap")
    assert spec["layout"]["yaxis2"]["range"] == [0.0, heatmap["zmax"]] and heatmap["zmax"] >= 0.05
    bar = next(trace for trace in spec["data"] if trace["type"] == "bar")
    assert bar["marker"]["color"] == heatmap["colorscale"][-1][1]  # the bar in the map's colour


def test_a_top_5_chart_with_two_classes_of_one_name_has_five_rows():
    names = ["tench", "missile", "goldfish", "missile", "shark", "ray"]
    probabilities = np.array([0.3, 0.25, 0.2, 0.15, 0.06, 0.04])
    for fig in (figures.topk_bar(probabilities, names), figures.zero_shot_bar(probabilities, names, "softmax"),
                figures.knockout_topk(probabilities, probabilities, names)):
        rows = json.loads(fig.to_json())["data"][0]["y"]
        assert len(rows) == len(set(rows)) == 5, rows
        assert "missile (#1)" in rows and "missile (#3)" in rows and "tench" in rows
