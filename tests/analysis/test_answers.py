"""The Lesson's answers (vit_explorer.analysis.answers) against plain computations, and the attention of
one query through the layers (analysis.streamed_query_maps) against the capture's own."""
import math

import pytest
import torch

import vit_explorer as vx
from vit_explorer import analysis
from vit_explorer.analysis import answers
from vit_explorer.model.capture import layer_attentions

from helpers import randomize, tiny_config


def test_a_patchs_rank_counts_the_patches_ahead_of_it_and_says_ties():
    attention = torch.tensor([[0.1, 0.4, 0.1], [0.2, 0.1, 0.1]])  # (gh, gw)
    best = answers.patch_rank(attention, 1)
    assert (best.rank, best.total, best.tied, best.best, best.right) == (1, 6, 0, 1, True)
    middle = answers.patch_rank(attention, 3)
    assert (middle.rank, middle.value, middle.best_value) == (2, pytest.approx(0.2), pytest.approx(0.4))
    last = answers.patch_rank(attention, 0)
    assert (last.rank, last.tied) == (3, 3)  # behind 0.4 and 0.2, level with three more
    assert middle.close and not answers.patch_rank(torch.arange(100.0), 0).close
    assert last.undecided and not middle.undecided  # four of the six patches share 0.1
    with pytest.raises(ValueError, match="one of the 6 candidates"):
        answers.patch_rank(attention, 6)


def test_the_head_that_lowers_the_prediction_most_ranks_first():
    values = torch.tensor([[-0.1, 0.02], [-2.0, -0.5]])  # (L, H): the change of log p
    ranks = {(layer, head): answers.head_rank(values, layer, head).rank for layer in range(2) for head in range(2)}
    assert ranks == {(1, 0): 1, (1, 1): 2, (0, 0): 3, (0, 1): 4}
    assert answers.head_rank(values, 0, 0).best == 2  # layer 1, head 0, row-major
    with pytest.raises(ValueError, match="not one of the 2 x 2 heads"):
        answers.head_rank(values, 2, 0)


def test_the_softmax_at_half_the_scale_is_flatter_and_its_numbers_are_the_softmaxs():
    model = randomize(vx.ViT(tiny_config()))
    x = torch.randn(1, 3, 16, 16)
    steps = vx.layer_internals(model, vx.capture(model, x).tokens[:, 1], 1)
    verdict, numbers = answers.softmax_change(steps, head=2, token=0, factor=0.5)
    scores = steps.scores[0, 2, 0].double()  # scaled already
    expected = [torch.softmax(scores * factor, -1) for factor in (1.0, 0.5)]
    assert verdict == "flatter"
    assert numbers["entropy"] == pytest.approx([float(torch.special.entr(p).sum()) for p in expected], rel=1e-5)
    assert numbers["largest weight"] == pytest.approx([float(p.max()) for p in expected], rel=1e-5)
    assert answers.softmax_change(steps, head=2, token=0, factor=2.0)[0] == "sharper"


def test_equal_scores_stay_uniform_at_any_scale():
    model = randomize(vx.ViT(tiny_config()))
    with torch.no_grad():
        model.blocks[0].attn.qkv.weight[:32].zero_()  # q = its bias alone: the same score for every key
        model.blocks[0].attn.qkv.bias[:32].zero_()
    steps = vx.layer_internals(model, vx.capture(model, torch.randn(1, 3, 16, 16)).tokens[:, 0], 0)
    verdict, numbers = answers.softmax_change(steps, head=0, token=3, factor=0.5)
    assert verdict == "unchanged" and numbers["entropy"][0] == pytest.approx(math.log(17))


def test_the_answer_settles_where_the_final_top_class_stays_on_top():
    lens = torch.tensor([[0.9, 0.1], [0.2, 0.8], [0.6, 0.4], [0.3, 0.7], [0.1, 0.9]])
    assert answers.settled_from(lens) == 3
    assert answers.settled_from(torch.tensor([[0.1, 0.9], [0.2, 0.8]])) == 0
    assert answers.prediction_survives(torch.tensor([0.1, 0.9]), torch.tensor([0.4, 0.6]))
    assert not answers.prediction_survives(torch.tensor([0.1, 0.9]), torch.tensor([0.6, 0.4]))


def test_the_sharpest_head_has_the_least_entropy():
    rows = torch.tensor([[0.25, 0.25, 0.25, 0.25], [0.7, 0.1, 0.1, 0.1], [0.4, 0.4, 0.1, 0.1]])
    assert answers.sharpest_head(rows) == 1


@pytest.mark.parametrize("changes", [dict(), dict(reg_tokens=2), dict(class_token=False, global_pool="mean")])
def test_one_querys_attention_through_the_layers_is_each_layers_head_mean(changes):
    model = randomize(vx.ViT(tiny_config(depth=3, **changes)))
    captured = vx.capture(model, torch.randn(1, 3, 16, 16))
    prefix, grid = captured.num_prefix_tokens, captured.grid_size
    for query in (None, 5):
        maps = analysis.streamed_query_maps(
            layer_attentions(model, captured), grid, prefix, query, class_token=model.config.class_token
        )
        assert maps.shape == (1, 3, 4, 4)
        for layer in range(3):
            row = prefix + 5 if query is not None else 0
            attention = captured.attentions[0, layer]  # (H, N, N)
            expected = (attention[:, row, prefix:] if query is not None or model.config.class_token
                        else attention[:, prefix:, prefix:].mean(dim=1)).mean(dim=0).reshape(4, 4)
            torch.testing.assert_close(maps[0, layer], expected)


def test_a_verdict_and_the_numbers_are_said_plainly():
    attention = torch.tensor([0.3, 0.2, 0.15, 0.1, 0.08, 0.06, 0.05] + [0.0] * 93)
    assert [answers.patch_rank(attention, patch).verdict("patch") for patch in (0, 2, 6)] == [
        "Right", "Close", "Not this time"]
    assert answers.patch_rank(torch.full((8,), 0.125), 3).verdict("patch") == "No patch stands out"
    assert [answers.ordinal(n) for n in (1, 2, 3, 4, 11, 12, 13, 21, 22, 111, 123)] == [
        "1st", "2nd", "3rd", "4th", "11th", "12th", "13th", "21st", "22nd", "111th", "123rd"]
    assert answers.percents(0.5, 0.25) == ["50.0%", "25.0%"]
    assert answers.percents(0.9997, 0.99968) == ["99.970%", "99.968%"]  # told apart
    assert answers.percents(0.99996) == ["99.996%"] and answers.percents(1.0) == ["100.0%"]  # 100% only when it is
    assert answers.percents(0.00002, 0.0) == ["0.002%", "0.000%"]
