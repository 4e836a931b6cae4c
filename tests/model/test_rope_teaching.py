"""What the pages teach rotary positions with: each pair's axis and period, one query's scores
against a key content at every patch (they depend only on the offset, and are the model's own for
the real contents), and the two figures built from them (validated: tests/conftest.py)."""
import math

import numpy as np
import pytest
import torch

import vit_explorer as vx
from vit_explorer import figures
from vit_explorer.model.rope import RopeSpec, angle_pairs, angles, farthest_corner, offset_scores

SMALL = dict(embed_dim=64, depth=2, num_heads=2, num_classes=0)
DINOV3 = dict(patch_size=16, init_values=1e-5, rope_type="dinov3", abs_pos_embed=False, reg_tokens=4)
EVA02 = dict(patch_size=14, mlp_ratio=4 * 2 / 3, swiglu_mlp=True, scale_mlp=True, qkv_fused=False, rope_type="cat")
FLAVOURS = {
    "dinov3": dict(DINOV3, image_size=(64, 96)),
    "dinov3 xy": dict(DINOV3, image_size=(64, 96), rope_grid_indexing="xy"),
    "eva02": dict(EVA02, image_size=(56, 84)),
    "eva02 rescaled to a reference grid": dict(EVA02, image_size=(56, 84), ref_feat_shape=(16, 16)),
}


def model_of(flavour: str) -> vx.ViT:
    torch.manual_seed(0)
    return vx.ViT(vx.ViTConfig(**SMALL, **FLAVOURS[flavour])).eval()


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_the_score_depends_only_on_the_offset(flavour):
    """score(q at p, k at p + d) is the same for every p: the maps of two query positions agree
    wherever they share an offset."""
    config = model_of(flavour).config
    spec, (grid_h, grid_w) = RopeSpec.of(config), config.grid_size
    torch.manual_seed(1)
    q, k = torch.randn(config.head_dim), torch.randn(config.head_dim)
    maps = {p: offset_scores(spec, q, k, (grid_h, grid_w), p).reshape(grid_h, grid_w) for p in range(grid_h * grid_w)}
    reference = maps[0]  # the query at (0, 0): every offset (dr, dc) with dr, dc >= 0
    assert not torch.allclose(reference, reference.flatten()[0].expand_as(reference))  # positions do matter
    for position, scores in maps.items():
        row, col = divmod(position, grid_w)
        torch.testing.assert_close(scores[row:, col:], reference[: grid_h - row, : grid_w - col], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("flavour", ["dinov3", "eva02"])
def test_with_the_real_contents_they_are_the_model_s_own_scores(flavour):
    model = model_of(flavour)
    config, grid = model.config, model.config.grid_size
    x = torch.randn(1, 3, *config.img_size)
    steps = vx.capture(model, x, internals=1).internals
    prefix, patches = config.num_prefix_tokens, grid[0] * grid[1]
    for head in range(config.num_heads):
        for query in (0, patches // 2, patches - 1):
            q = steps.q_unrotated[0, head, prefix + query]
            own = steps.scores[0, head, prefix + query, prefix:]  # (P,) against every patch's real key
            for key in (0, 3, patches - 1):
                k = steps.k_unrotated[0, head, prefix + key]
                scores = offset_scores(model.rope_spec, q, k, grid, query, steps.scale)
                torch.testing.assert_close(scores[key], own[key], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_each_pair_turns_with_one_axis_at_its_period(flavour):
    config = model_of(flavour).config
    spec, (grid_h, grid_w) = RopeSpec.of(config), config.grid_size
    turned = angles(spec, (grid_h, grid_w)).reshape(grid_h, grid_w, -1)
    pairs = angle_pairs(spec, (grid_h, grid_w))
    assert [pair.axis for pair in pairs] == ["row"] * 4 + ["column"] * 4
    for axis in ("row", "column"):
        periods = [pair.period for pair in pairs if pair.axis == axis]
        assert periods == sorted(periods, reverse=True) and len(set(periods)) == 4  # slowest first
    down, right = turned[1, 0] - turned[0, 0], turned[0, 1] - turned[0, 0]  # one patch down, one across
    for pair in pairs:
        along, across = (down, right) if pair.axis == "row" else (right, down)
        assert across[pair.index] == 0  # it does not turn with the other axis
        assert math.isclose(2 * math.pi / abs(float(along[pair.index])), pair.period, rel_tol=1e-5)
        first, second = pair.channels
        assert second == (first + config.head_dim // 2 if config.rope_type == "dinov3" else first + 1)


def test_the_figures_draw_every_pair_and_both_query_positions():
    config = model_of("dinov3").config
    spec, grid = RopeSpec.of(config), config.grid_size
    pairs = angle_pairs(spec, grid)
    angle_figure = figures.rotation_angles_figure(angles(spec, grid), grid, pairs, "Rotation angles")
    assert len(angle_figure.data) == 8 and all(trace.z.shape == grid for trace in angle_figure.data)
    assert float(np.max([trace.z.max() for trace in angle_figure.data])) < 360
    assert "turn down" in angle_figure.layout.annotations[0].text
    assert "turn across" in angle_figure.layout.annotations[4].text

    q, k = torch.randn(config.head_dim), torch.randn(config.head_dim)
    maps = torch.stack([offset_scores(spec, q, k, grid, position) for position in (5, 0)])
    offset_figure = figures.offset_scores_figure(maps, [5, 0], grid, "Offsets", own_position=5)
    assert [trace.z.shape for trace in offset_figure.data] == [grid, grid]
    assert [annotation.text for annotation in offset_figure.layout.annotations] == [
        "query at row 0, col 5 (its own patch)", "query at row 0, col 0"]
    assert len(offset_figure.layout.shapes) == 4  # each query outlined (black edge, cyan line)
    with pytest.raises(ValueError):
        figures.offset_scores_figure(maps, [5], grid, "Offsets")


@pytest.mark.parametrize("grid, position, corner", [
    ((4, 6), 0, 23), ((4, 6), 23, 0), ((4, 6), 2, 23), ((4, 6), 3, 18), ((5, 5), 12, 0), ((1, 1), 0, 0),
])
def test_a_query_moves_to_the_corner_farthest_from_it(grid, position, corner):
    assert farthest_corner(position, grid) == corner
