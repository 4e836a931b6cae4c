"""The inline-or-job estimate (app/costs.py over model/cost.py) at 197, 785 and 2,309 tokens: a
pass's linear part grows with the tokens and its attention with their square, a pass timed at one
size is scaled by that model to the others, and the views the old estimate kept in the server at
patch 8 on a ViT-B/16 (Head types, Compare, Several images) are jobs there, while they stay in the
server at patch 16. Ratios of the cost model only: whether it is within a loose factor of measured
passes is bench/app_latency.py --cost-model's question, never a timing here."""
import pytest

import vit_explorer as vx
from vit_explorer.app import costs
from vit_explorer.model import cost
from vit_explorer.serving.job_kinds import KINDS

BASE = dict(embed_dim=768, depth=12, num_heads=12, num_classes=1000)
VIT_B16 = vx.ViTConfig(image_size=224, patch_size=16, **BASE)  # 197 tokens
VIT_B8 = VIT_B16.replace(patch_size=8)  # 785 tokens: the same weights at patch 8
DINOV3_S16 = vx.ViTConfig(  # a DINOv3 ViT-S/16: rotary positions, 4 registers; at 768 px 2,309 tokens
    image_size=224, patch_size=16, embed_dim=384, depth=12, num_heads=6, num_classes=0, reg_tokens=4,
    abs_pos_embed=False, rope_type="dinov3", init_values=1e-5, qkv_bias=False,
)
DINOV3_768 = DINOV3_S16.replace(image_size=768)
PHOTOS = 4  # the bundled photos the Head types page reads


@pytest.fixture
def untimed(monkeypatch) -> costs.PassTimes:
    """No pass timed yet on this server: the estimate is multiply-adds (tests record their own)."""
    times = costs.PassTimes()
    monkeypatch.setattr(costs, "pass_times", lambda: times)
    return times


def linear_part(config) -> float:
    """The part of a pass that grows with the tokens (the patch embedding reads every pixel at any size)."""
    height, width = config.img_size
    return cost.linear_cost(config) - height * width * config.in_chans * config.embed_dim


def test_the_sizes_have_the_tokens_the_issue_measured():
    assert (VIT_B16.num_tokens, VIT_B8.num_tokens, DINOV3_768.num_tokens) == (197, 785, 2309)


@pytest.mark.parametrize("small, large", [(VIT_B16, VIT_B8), (DINOV3_S16, DINOV3_768)])
def test_a_pass_grows_with_the_tokens_and_its_attention_with_their_square(small, large):
    ratio = large.num_tokens / small.num_tokens
    assert linear_part(large) / linear_part(small) == pytest.approx(ratio)
    assert cost.attention_cost(large) / cost.attention_cost(small) == pytest.approx(ratio**2)
    # The whole pass: more than the tokens' ratio, by the attention's square.
    expected = (cost.linear_cost(large) + cost.attention_cost(large) + large.depth * cost.BLOCK_OVERHEAD) / (
        cost.linear_cost(small) + cost.attention_cost(small) + small.depth * cost.BLOCK_OVERHEAD
    )
    assert cost.pass_cost(large) / cost.pass_cost(small) == pytest.approx(expected)
    assert expected > ratio * 1.05


def test_at_2309_tokens_the_attention_is_half_of_a_pass_and_a_rollout_more_than_one():
    assert cost.attention_cost(DINOV3_768) / cost.forward_cost(DINOV3_768) == pytest.approx(0.5, abs=0.02)
    assert (DINOV3_768.depth - 1) * DINOV3_768.num_tokens**3 > cost.pass_cost(DINOV3_768)
    assert cost.attention_cost(VIT_B16) / cost.forward_cost(VIT_B16) < 0.05


def test_a_pass_timed_at_one_size_is_scaled_by_the_cost_model_to_the_others(untimed):
    untimed.record(VIT_B16, 0.128)  # the ViT-B/16 at 224 on the 2-core machine
    assert untimed.seconds(VIT_B16) == 0.128
    assert untimed.seconds(VIT_B8) / 0.128 == pytest.approx(cost.pass_cost(VIT_B8) / cost.pass_cost(VIT_B16))
    assert untimed.seconds(VIT_B8) / 0.128 > 785 / 197  # the tokens' ratio, and the attention's square on it
    untimed.record(DINOV3_S16, 0.042)
    assert untimed.seconds(DINOV3_768) / 0.042 == pytest.approx(cost.pass_cost(DINOV3_768) / cost.pass_cost(DINOV3_S16))
    # The nearest size timed is the one scaled: patch 8 timed too, patch 7 scales from it.
    untimed.record(VIT_B8, 0.5)
    patch_7 = VIT_B16.replace(patch_size=7)
    assert untimed.seconds(patch_7) == pytest.approx(0.5 * cost.pass_cost(patch_7) / cost.pass_cost(VIT_B8))
    # Another architecture is not scaled from these.
    assert untimed.seconds(VIT_B16.replace(depth=6)) is None


def test_the_views_counted_as_at_most_3_forwards_at_patch_8_are_jobs(untimed):
    """Head types over the photos (the sidebar's captured, or every one read already: the
    attention again and its measures grow with the square of the tokens), Several images' first
    set (the sidebar's and two more), Compare with model B at its default patch 7 (1,025 tokens,
    every layer's attention computed again for the rollout)."""
    config = VIT_B8
    views = {
        "head types, 3 photos unread": costs.head_types_forwards(config, PHOTOS, unread=PHOTOS - 1),
        "head types, every photo read": costs.head_types_forwards(config, PHOTOS, unread=0),
        "several images, the sidebar's not captured": costs.image_set_forwards(config, unread=2, capture=True),
        "compare, B at patch 7": costs.compare_forwards(config, VIT_B16.replace(patch_size=7)),
    }
    for view, forwards in views.items():
        assert forwards > costs.HEAVY_FORWARDS, view
        assert costs.is_heavy(config, forwards), view
    untimed.record(VIT_B16, 0.128)  # timed at patch 16: patch 8's pass scaled from it, not quick either
    assert all(costs.is_heavy(config, forwards) for forwards in views.values())


def test_the_same_views_at_patch_16_stay_in_the_server(untimed):
    config = VIT_B16
    views = {
        "head types, every photo read": costs.head_types_forwards(config, PHOTOS, unread=0),
        "several images, the sidebar's captured": costs.image_set_forwards(config, unread=2),
        "compare, B at patch 14": costs.compare_forwards(config, VIT_B16.replace(patch_size=14)),
    }
    for view, forwards in views.items():
        assert forwards <= costs.HEAVY_FORWARDS and not costs.is_heavy(config, forwards), view
    # Three photos no page has read are more than 3 passes on any model: quick only on a small one.
    assert costs.is_heavy(config, costs.head_types_forwards(config, PHOTOS, unread=PHOTOS - 1))
    tiny = vx.ViTConfig(image_size=32, patch_size=4, embed_dim=32, depth=4, num_heads=4, num_classes=10)
    assert not costs.is_heavy(tiny, costs.head_types_forwards(tiny, PHOTOS))


@pytest.mark.parametrize("config", [VIT_B16, VIT_B8, DINOV3_768])
def test_a_job_counts_what_the_view_it_replaces_counts(config):
    assert KINDS["head types"].forwards(config, {"images": PHOTOS}) == pytest.approx(
        costs.head_types_forwards(config, PHOTOS)
    )
    assert KINDS["tokens"].forwards(config, {"images": 2}) == pytest.approx(
        costs.forwards(config, costs.reading_cost(config, unread=2))
    )
    # Compare's model B alone, as the job computes it: no layer kept, every layer again for the rollout.
    b_view = cost.pass_cost(config) + cost.rollout_cost(config, kept=False)
    assert KINDS["views"].forwards(config, {"layer": 0}) == pytest.approx(costs.forwards(config, b_view))


def test_the_attention_pages_measures_and_rollout_are_jobs_at_768_px_only(untimed):
    """Its view with every head's distance and entropy stays in the server on a ViT-B/16 at patch 16
    and 8; on a DINOv3-shaped ViT-S/16 at 768 px it is heavy, and still heavy without them (the
    rollout), so both are jobs and what stays, the capture and the layer drawn, is within 3 passes;
    each job counts its own pass and what it takes from the view."""
    for config in (VIT_B16, VIT_B8):
        assert not costs.is_heavy(config, costs.attention_view_forwards(config, statistics=True))
    config = DINOV3_768
    with_statistics = costs.attention_view_forwards(config, statistics=True)
    with_rollout = costs.attention_view_forwards(config)
    assert costs.is_heavy(config, with_statistics) and costs.is_heavy(config, with_rollout)
    rollout = costs.forwards(config, cost.rollout_cost(config, kept=False))  # no layer kept at 2,309 tokens
    assert with_rollout - rollout <= costs.HEAVY_FORWARDS
    assert KINDS["rollout"].forwards(config, {}) == pytest.approx(1 + rollout)
    assert KINDS["head statistics"].forwards(config, {}) == pytest.approx(1 + with_statistics - with_rollout)


def test_what_a_view_computes_beside_its_passes_grows_faster_than_the_pass():
    """Per image, the head types' measures and a rollout's products are a larger share of a pass
    at 785 tokens than at 197, and larger still at 2,309."""
    shares = [
        costs.head_types_forwards(config, 1, unread=0) for config in (VIT_B16, VIT_B8)
    ]
    assert shares[0] < shares[1]
    rollouts = [costs.forwards(config, cost.rollout_cost(config)) for config in (VIT_B16, VIT_B8, DINOV3_768)]
    assert rollouts == sorted(rollouts) and rollouts[-1] > 1
