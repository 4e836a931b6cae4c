"""Heads in words: each head's write into the image embedding, exactly, and TextSpan's choice."""
import pytest
import torch

import vit_explorer as vx
from vit_explorer.analysis.checks import AnalysisError
from vit_explorer.text import load_image_text_model
from vit_explorer.text.heads import describable, describe_heads, head_contributions

from textmodels import SMALL_CLIP, open_clip_folder, siglip_folder


def test_the_heads_writes_and_the_rest_add_up_to_the_image_embedding(tmp_path):
    open_clip_folder(tmp_path / "clip", SMALL_CLIP)
    model = load_image_text_model(tmp_path / "clip")
    vit = model.image
    images = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    captured = vx.capture(vit, images)
    depth = vit.config.depth
    contributions = head_contributions(model, captured.tokens, captured.grid_size, list(range(depth)))  # (B, L, nh, E)
    assert contributions.shape == (3, depth, vit.config.num_heads, model.embed_dim)
    # Everything else written into the class token: the input, each attention's bias, each MLP.
    with torch.no_grad():
        rest = captured.tokens[:, 0, 0].clone()
        for layer, block in enumerate(vit.blocks):
            rest += block.attn.proj.bias
            middle = captured.tokens[:, layer + 1, 0] - captured.tokens[:, layer, 0]  # attention + MLP
            attention = block.attn(block.norm1(captured.tokens[:, layer]))[:, 0]
            rest += middle - attention
        final = captured.tokens[:, -1, 0]
        scale = (final.var(dim=-1, unbiased=False) + vit.norm.eps).rsqrt()
        centred = (rest - rest.mean(dim=-1, keepdim=True)) * scale[:, None] * vit.norm.weight
        total = contributions.sum(dim=(1, 2)) + model.project_image_linear(centred + vit.norm.bias)
    torch.testing.assert_close(total, model.project_image_linear(vit.norm(final)), atol=1e-5, rtol=1e-5)


def test_textspan_picks_the_description_a_head_varies_along():
    texts = torch.nn.functional.normalize(torch.randn(6, 16, generator=torch.Generator().manual_seed(1)), dim=-1)
    strength = torch.tensor([3.0, -1.0, 2.0, -4.0, 0.5])[:, None]
    head = strength * texts[4] + 0.2 * strength.flip(0) * texts[1]  # mostly description 4, some 1
    contributions = torch.stack([head, torch.zeros_like(head)], dim=1)  # a second head that writes nothing
    names = tuple(f"d{index}" for index in range(6))
    described = describe_heads(contributions, texts, names, count=2)
    assert [name for name, _ in described[0]] == ["d4", "d1"]
    assert described[0][0][1] > 0.9 and sum(share for _, share in described[0]) == pytest.approx(1.0, abs=1e-6)
    with pytest.raises(AnalysisError, match="at least two images"):
        describe_heads(contributions[:1], texts, names)


def test_a_model_that_pools_otherwise_is_a_sentence(tmp_path):
    model = load_image_text_model(siglip_folder(tmp_path / "siglip"))
    assert "attention pool" in describable(model)
    with pytest.raises(AnalysisError, match="pools its tokens another way"):
        captured = vx.capture(model.image, torch.zeros(1, 3, 32, 32))
        head_contributions(model, captured.tokens, captured.grid_size, [1])
