"""The Features page's steering figures: the attention difference is steered minus intact on a
scale centred at 0, and the latents that matter carry their estimated and real changes."""
import json

import numpy as np
import torch

from vit_explorer import figures
from vit_explorer.features.effects import points_text, score_change


def spec(fig) -> dict:
    return json.loads(fig.to_json())


def test_the_attention_difference_is_steered_minus_intact_on_a_scale_centred_at_zero():
    generator = np.random.default_rng(0)
    image = generator.integers(0, 256, (32, 32, 3), dtype=np.uint8)
    intact = generator.random((4, 8, 8))
    steered = intact.copy()
    steered[2, 3, 5] += 0.25
    steered[0, 1, 1] -= 0.1
    fig = figures.attention_difference_grid(image, intact, steered, layer=3, query="class token", what="latent 7 x 0")
    drawn = spec(fig)
    heatmaps = [trace for trace in fig.data if trace.type == "heatmap"]
    np.testing.assert_allclose(np.stack([trace.z for trace in heatmaps]), steered - intact, atol=1e-12)
    axis = drawn["layout"]["coloraxis"]
    assert axis["cmin"] == -axis["cmax"] and axis["cmid"] == 0 and abs(axis["cmax"] - 0.25) < 1e-9
    titles = [annotation["text"] for annotation in drawn["layout"]["annotations"]]
    assert "head 2: +0.25 at most" in titles and "head 0: -0.1 at most" in titles
    assert axis["colorscale"][2] == [0.5, "rgba(247,247,247,0)"]  # unchanged patches show the picture
    assert "with latent 7 x 0, minus intact" in drawn["layout"]["title"]["text"]
    # Nothing changed: the grid is drawn, all white, not a division by zero.
    same = spec(figures.attention_difference_grid(image, intact, intact, layer=3, query="class token", what="x"))
    assert same["layout"]["coloraxis"]["cmax"] > 0


def test_the_latents_that_matter_show_estimated_and_real_changes():
    estimated, real = figures.latent_effect_bars([-12.5, 3.0, 0.01], [-20.0, 2.5, np.nan], [679, 12, 3], "pts",
                                                 "The latents that matter most", chosen=12).data
    assert list(estimated.customdata) == list(real.customdata) == [679, 12, 3]
    np.testing.assert_array_equal(estimated.x, [-12.5, 3.0, 0.01])
    np.testing.assert_array_equal(real.x, [-20.0, 2.5, np.nan])  # not measured: no bar
    assert "crimson" in estimated.y[1] and "crimson" not in estimated.y[0]


def test_a_change_keeps_enough_decimals_to_be_seen():
    assert points_text(-0.0123) == "-0.0123 pts"
    assert points_text(3.2e-6) == "+3.20e-06 pts"
    assert points_text(0.0) == "+0.0000 pts"
    assert points_text(-12.34567, "% of its length") == "-12.3457 % of its length"
    # A ring at 99.97% that loses 1.6e-4 of its probability: float32 probabilities would read 0 or 1e-4 off.
    before = torch.tensor([0.9997, 0.0002, 0.0001]).log()
    after = torch.tensor([0.99954, 0.00036, 0.0001]).log()
    target, probability, change = score_change(before, after)
    assert target == 0 and abs(probability - 0.9997) < 1e-6 and abs(change - (-0.016)) < 1e-4


def test_a_saturated_prediction_s_change_does_not_read_zero_in_the_top_k():
    intact = np.array([0.9997, 0.0002, 0.0001])
    steered = np.array([0.99966, 0.00024, 0.0001])
    fig = figures.knockout_topk(intact, steered, ["ring", "circle", "square"], what="latent 629 x 0", changed="steered")
    assert list(fig.data[1].text[:2]) == ["100.0% (-4.0e-03 pts)", "0.0% (+4.0e-03 pts)"]
    assert fig.data[1].text[2] == "0.0% (+0.00 pts)"
