"""Head types: the measures against independent computations, the labels on heads built to be of
each type (attention written by hand, and a model whose weights make them), the streamed path
against the full attention, and the figures."""
import json
import math

import numpy as np
import pytest
import torch

import vit_explorer as vx
from vit_explorer import analysis, figures
from vit_explorer.analysis import head_types as ht
from vit_explorer.analysis import image_set as sets
from vit_explorer.model import vit as model_module

GRID = (8, 8)
PATCH = 4
PREFIX = 1
PATCHES = GRID[0] * GRID[1]
TOKENS = PREFIX + PATCHES
IMAGES = 3
# The heads written by hand below, in order, and the label each must get.
BUILT = ("local", "positional", "prefix sink", "global", "content", "outlier sink")


def _rows(weights: torch.Tensor) -> torch.Tensor:
    return weights / weights.sum(dim=-1, keepdim=True)


def built_attention(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(IMAGES, 6, N, N) attention of the heads of BUILT, and the (IMAGES, P) outlier patches the
    outlier sink reads: every patch query's row written by hand (the class token's row uniform)."""
    generator = torch.Generator().manual_seed(seed)
    rows, cols = torch.meshgrid(torch.arange(GRID[0]), torch.arange(GRID[1]), indexing="ij")
    rows, cols = rows.flatten(), cols.flatten()
    near = ((rows[:, None] - rows[None]).abs() <= 1) & ((cols[:, None] - cols[None]).abs() <= 1)  # (P, P) 3 x 3
    attention = torch.full((IMAGES, len(BUILT), TOKENS, TOKENS), 1 / TOKENS)
    outliers = torch.zeros(IMAGES, PATCHES, dtype=torch.bool)
    corners = torch.tensor([0, GRID[1] - 1, PATCHES - GRID[1], PATCHES - 1])
    fixed = torch.rand(4, generator=generator) + 0.5
    for image in range(IMAGES):
        patch_rows = torch.zeros(len(BUILT), PATCHES, TOKENS)
        # local: the 3 x 3 neighbours, their weights changing with the image (content)
        patch_rows[0, :, PREFIX:] = near * torch.rand(PATCHES, PATCHES, generator=generator)
        # positional: the four corners with the same weights on every image, far from most queries
        patch_rows[1, :, PREFIX + corners] = fixed
        # prefix sink: 0.9 on the class token
        patch_rows[2, :, 0] = 0.9 * PATCHES
        patch_rows[2, :, PREFIX:] = 0.1
        # global: uniform
        patch_rows[3] = 1.0
        # content: three patches anywhere, other ones on every image
        chosen = torch.rand(PATCHES, PATCHES, generator=generator).topk(3, dim=-1).indices
        patch_rows[4, :, PREFIX:].scatter_(-1, chosen, 1.0)
        # outlier sink: 0.8 on this image's two outliers
        picked = torch.randperm(PATCHES, generator=generator)[:2]
        outliers[image, picked] = True
        patch_rows[5, :, PREFIX:] = 0.2 / PATCHES
        patch_rows[5, :, PREFIX + picked] += 0.4
        attention[image, :, PREFIX:] = _rows(patch_rows)
    return attention, outliers


def measured(attention: torch.Tensor, outliers: torch.Tensor | None) -> ht.HeadTypes:
    return ht.measure_heads([attention], GRID, PATCH, PREFIX, outliers[:, None] if outliers is not None else None)


def test_heads_written_to_be_of_each_type_get_their_label():
    attention, outliers = built_attention()
    types = measured(attention, outliers)
    assert types.labels == (BUILT,)
    assert types.counts() == {label: 1 for label in ht.LABELS}
    assert types.images == IMAGES and types.outlier_counts.tolist() == [2 * IMAGES]


def test_the_rules_go_in_order_and_positional_needs_two_images():
    thresholds = ht.Thresholds()
    everything = dict(prefix_share=0.9, outlier_share=0.9, reach=0.1, evenness=0.99, consistency=0.99)
    expected = list(ht.LABELS)
    # Each rule failed in turn, from the first: the next label takes over.
    failing = dict(prefix_share=0.1, outlier_share=0.1, reach=0.9, evenness=0.5, consistency=0.1)
    for name, label in zip(failing, expected):
        assert ht.label(**everything, thresholds=thresholds) == label
        everything[name] = failing[name]
    assert ht.label(**everything) == "content"
    assert ht.label(0.0, 0.0, 0.9, 0.5, math.nan) == "content"  # one image: never positional
    # Exactly at a threshold the rule holds.
    assert ht.label(ht.PREFIX_SINK, 0, 1, 0, 0) == "prefix sink"
    assert ht.label(0, 0, ht.LOCAL_REACH, 0, 0) == "local"


def test_the_measures_equal_an_independent_computation():
    attention, outliers = built_attention(seed=1)
    types = measured(attention, outliers)
    a = attention.numpy().astype(np.float64)
    patch_rows = a[:, :, PREFIX:]  # (B, H, P, N)
    on_patches = patch_rows[..., PREFIX:]
    # distance: analysis' own function over the same attention (ViT paper Fig. 7, pixels)
    np.testing.assert_allclose(
        types.distance[0], analysis.mean_attention_distance(attention[:, None], GRID, PATCH, PREFIX)[0], rtol=1e-5,
    )
    # entropy: -sum w log w per row, mean over every row and image
    with np.errstate(divide="ignore", invalid="ignore"):
        entropy = -np.nansum(a * np.log(a), axis=-1).mean(axis=(0, 2))
    np.testing.assert_allclose(types.entropy[0], entropy, rtol=1e-5)
    np.testing.assert_allclose(types.evenness[0], entropy / np.log(TOKENS), rtol=1e-5)
    np.testing.assert_allclose(types.prefix_share[0], patch_rows[..., :PREFIX].sum(-1).mean(axis=(0, 2)), rtol=1e-5, atol=1e-7)
    on_outliers = np.stack([on_patches[image][..., outliers[image].numpy()].sum(-1) for image in range(IMAGES)])
    np.testing.assert_allclose(types.outlier_share[0], on_outliers.mean(axis=(0, 2)), rtol=1e-5, atol=1e-7)
    # consistency: numpy's Pearson correlation of every pair of images' flattened P x P maps
    for head in range(len(BUILT)):
        maps = on_patches[:, head].reshape(IMAGES, -1)
        if (maps.std(axis=1) == 0).any():  # the uniform head: no pattern, 0 by definition
            assert types.consistency[0, head] == 0
            continue
        correlations = np.corrcoef(maps)[np.triu_indices(IMAGES, k=1)]
        np.testing.assert_allclose(types.consistency[0, head], correlations.mean(), rtol=1e-4, atol=1e-6)
    # reach: the distance over uniform attention's among the patches (the grid's mean pair distance)
    ys, xs = np.meshgrid(np.arange(GRID[0]), np.arange(GRID[1]), indexing="ij")
    centres = np.stack([ys.ravel(), xs.ravel()], -1) * PATCH + (PATCH - 1) / 2
    uniform = np.linalg.norm(centres[:, None] - centres[None], axis=-1).mean()
    np.testing.assert_allclose(
        types.reach[0], types.distance[0].numpy() / (uniform * (1 - types.prefix_share[0].numpy())), rtol=1e-5,
    )


def test_one_image_has_no_consistency_and_chunks_of_images_give_the_same_numbers():
    attention, outliers = built_attention(seed=2)
    whole = measured(attention, outliers)
    chunked = ht.measure_heads([[attention[:1], attention[1:]]], GRID, PATCH, PREFIX, outliers[:, None])
    for name, _ in ht.MEASURES:
        torch.testing.assert_close(getattr(chunked, name), getattr(whole, name), rtol=1e-5, atol=1e-6)
    alone = measured(attention[:1], outliers[:1])
    assert torch.isnan(alone.consistency).all() and "positional" not in alone.labels[0]
    with pytest.raises(analysis.AnalysisError, match="outliers are given for 3 images, the attention for 1"):
        measured(attention[:1], outliers)


def test_the_few_high_norm_patches_are_the_several_images_outliers_at_most_a_tenth_of_them():
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randn(2, 3, TOKENS, 16, generator=generator)  # (B, L, N, D) entering 3 layers
    tokens[0, 1, PREFIX + 5] *= 50  # one artefact in layer 1's input
    tokens[:, 2, PREFIX:PREFIX + 15] *= torch.linspace(20, 50, 15)[:, None]  # layer 2: 30 of 128: not few
    found = ht.outlier_patches(tokens, PREFIX)
    assert found.shape == (2, 3, PATCHES)
    for layer in range(3):
        rule = sets.norm_outliers(sets.patch_features(tokens[:, layer], PREFIX), ht.OUTLIER_MADS)
        assert not (found[:, layer] & ~rule.outliers).any()  # a subset of the page's rule
    assert found[:, 1].nonzero().tolist() == [[0, 5]]
    assert int(found[:, 2].sum()) == int(ht.FEW_OUTLIERS * 2 * PATCHES)  # the highest tenth only
    norms = rule.norms
    assert norms[found[:, 2]].min() >= norms[~found[:, 2]].max()


# --- a model whose weights make the types -------------------------------------------------------

# Dimensions of the tiny model's tokens: positions, a class-token marker, the content.
POSITION, MARKER, CONTENT = slice(0, 8), 8, slice(16, 24)


def built_model() -> vx.ViT:
    """One layer of four heads made by hand: head 0 scores keys by their offset from the query
    (local), head 1 by their offset from the top-left corner whatever the query (positional),
    head 2 the class token alone (prefix sink), head 3 by the patches' content (content).

    Each token's entries come in +/- pairs, so that its mean is 0, and the positions' part has the
    same length everywhere: norm1 only scales the tokens, by about the same for all (the content is
    small)."""
    config = vx.ViTConfig(image_size=32, patch_size=PATCH, num_classes=3, embed_dim=32, depth=1, num_heads=4)
    model = vx.ViT(config).eval()
    generator = torch.Generator().manual_seed(0)
    angle = math.pi / GRID[0]  # cos(angle * offset) falls all the way across the grid
    rows, cols = torch.meshgrid(torch.arange(GRID[0]), torch.arange(GRID[1]), indexing="ij")
    rows, cols = rows.flatten().float(), cols.flatten().float()
    waves = torch.stack([torch.cos(angle * rows), torch.sin(angle * rows), torch.cos(angle * cols), torch.sin(angle * cols)], -1)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.zero_()
        for norm in (model.blocks[0].norm1, model.blocks[0].norm2, model.norm):
            norm.weight.fill_(1.0)
        model.pos_embed[0, PREFIX:, POSITION] = torch.cat([waves, -waves], dim=-1)
        model.cls_token[0, 0, MARKER], model.cls_token[0, 0, MARKER + 1] = 1.0, -1.0
        content = torch.randn(8, 3 * PATCH * PATCH, generator=generator) * 0.02
        weight = model.patch_embed.proj.weight.view(32, -1)
        weight[CONTENT], weight[24:32] = content, -content
        qkv = model.blocks[0].attn.qkv
        q, k = qkv.weight[:32], qkv.weight[32:64]  # rows: head h owns h * 8 .. h * 8 + 7
        eye = torch.eye(4)
        q[0:4, 0:4], k[0:4, 0:4] = 10 * eye, eye  # head 0: the query's waves against the key's
        k[8:12, 0:4] = eye  # head 1: a fixed query, the top-left corner's waves
        qkv.bias[8:12] = 10 * 2.8 * waves[0]
        k[16, MARKER], qkv.bias[16] = 1.0, 10.0  # head 2: only the class token has the marker
        q[24:32, CONTENT] = 10 * torch.randn(8, 8, generator=generator)  # head 3: content against content
        k[24:32, CONTENT] = 10 * torch.randn(8, 8, generator=generator)
    return model


def test_heads_a_model_is_built_to_have_get_their_labels_end_to_end():
    model = built_model()
    x = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    types = ht.classify_heads(model, x)
    assert types.labels == (("local", "positional", "prefix sink", "content"),), (types.reach, types.consistency)
    assert types.consistency[0, 1] > 0.95 and types.consistency[0, 3] < 0.3  # by position / by content
    assert types.prefix_share[0, 2] > 0.99 and types.reach[0, 0] < 0.2


def test_the_streamed_path_reads_one_layer_of_a_few_images_at_a_time_and_equals_the_full_attention(monkeypatch):
    torch.manual_seed(0)
    model = vx.ViT(vx.ViTConfig(image_size=32, patch_size=4, num_classes=3, embed_dim=32, depth=3, num_heads=4, reg_tokens=2))
    model.eval()
    x = torch.randn(3, 3, 32, 32)
    full = vx.capture(model, x)  # every layer's (B, L, H, N, N) kept
    reference = ht.measure_heads(
        full.attentions.unbind(dim=1), full.grid_size, PATCH, full.num_prefix_tokens,
        ht.outlier_patches(full.tokens[:, :-1], full.num_prefix_tokens), depth=3,
    )
    computed, blocks = [], []
    layer_attention = ht.layer_attention
    monkeypatch.setattr(ht, "layer_attention", lambda model, tokens, *rest: computed.append(tokens.shape[0]) or layer_attention(model, tokens, *rest))
    block_forward = model_module.Block.forward
    monkeypatch.setattr(model_module.Block, "forward", lambda self, x, *args: blocks.append(x.shape[0]) or block_forward(self, x, *args))
    progress = []
    streamed = ht.classify_heads(model, x, progress=progress.append)
    assert blocks == [3] * 3  # one batched pass of the three images, tokens only
    assert computed == [3] * 3  # then each layer's attention, the three images' together (small)
    assert progress == pytest.approx([1 / 3, 2 / 3, 1])
    # Past CHUNK_BYTES of one layer's attention the images go fewer at a time.
    monkeypatch.setattr(ht, "CHUNK_BYTES", 2 * 4 * 4 * full.num_tokens**2)  # two images' 4 heads
    computed.clear()
    chunked = ht.classify_heads(model, x)
    assert computed == [2, 1] * 3
    for types in (streamed, chunked):
        for name, _ in ht.MEASURES:
            torch.testing.assert_close(getattr(types, name), getattr(reference, name), rtol=1e-4, atol=1e-5)
    # Captures that kept their attention, and a list of one-image captures, read alike.
    from_full = ht.classify_heads(model, full)
    listed = ht.classify_heads(model, [vx.capture(model, x[index:index + 1], layers=()) for index in range(3)])
    for types in (from_full, listed):
        for name, _ in ht.MEASURES:
            torch.testing.assert_close(getattr(types, name), getattr(reference, name), rtol=1e-4, atol=1e-5)
        assert types.labels == reference.labels


def test_captures_on_two_grids_are_refused_in_a_sentence():
    model = vx.ViT(vx.ViTConfig(image_size=32, patch_size=4, num_classes=3, embed_dim=32, depth=1, num_heads=2)).eval()
    wide = vx.resize_model(model, image_size=(32, 48))
    with pytest.raises(analysis.AnalysisError, match="must share one patch grid"):
        ht.classify_heads(model, [vx.capture(model, torch.randn(1, 3, 32, 32)), vx.capture(wide, torch.randn(1, 3, 32, 48))])


def test_the_numbers_go_to_json_and_arrays_and_back():
    attention, outliers = built_attention()
    types = measured(attention, outliers)
    plain = json.loads(json.dumps(types.to_dict()))
    assert plain["precedence"] == list(ht.LABELS) and plain["thresholds"]["prefix_sink"] == ht.PREFIX_SINK
    assert [row["label"] for row in plain["heads"]] == list(BUILT)
    assert plain["heads"][1]["distance_px"] == pytest.approx(float(types.distance[0, 1]))
    assert set(plain["definitions"]) == {"distance", "reach", "entropy", "prefix share", "outlier share", "consistency"}
    again = ht.HeadTypes.from_arrays(types.to_arrays())
    assert again.labels == types.labels and again.grid_size == GRID and again.images == IMAGES
    torch.testing.assert_close(again.consistency, types.consistency)
    one = measured(attention[:1], outliers[:1]).to_dict()
    assert all(row["consistency"] is None for row in one["heads"])  # NaN: undefined, as null


def test_the_grid_figure_colours_labels_and_hovers_every_number():
    attention, outliers = built_attention()
    types = measured(torch.cat([attention, attention]), torch.cat([outliers, outliers]))
    measures = {name: getattr(types, name) for name, _ in ht.MEASURES}
    fig = figures.head_types_grid(types.labels, measures, ht.LABELS, title="t", chosen=(0, 4))
    heatmap, cells = fig.data
    assert heatmap.z[0].tolist() == [ht.LABELS.index(label) for label in BUILT]
    assert list(heatmap.colorbar.ticktext) == list(ht.LABELS)
    # Each label's colour covers its own band of the stepped scale.
    for index, label in enumerate(ht.LABELS):
        colour = figures.LABEL_STYLES[label][0]
        assert [list(stop) for stop in heatmap.colorscale[2 * index:2 * index + 2]] == [[index / 6, colour], [(index + 1) / 6, colour]]
    assert [cells.x[4], cells.y[4]] == [4, 0]  # a clicked point's x is the head, its y the layer
    assert cells.customdata[4][0] == "content" and float(cells.customdata[4][1]) == pytest.approx(float(types.distance[0, 4]), rel=1e-2)
    (outline,) = fig.layout.shapes
    assert (outline.x0, outline.y0) == (3.5, -0.5)
    with pytest.raises(ValueError, match="every measure must be"):
        figures.head_types_grid(types.labels, {"distance": torch.zeros(2, 2)}, ht.LABELS)
    with pytest.raises(ValueError, match="labels must be"):
        figures.head_types_grid((("nonsense",),), {}, ht.LABELS)


def test_the_maps_figure_puts_each_images_map_on_one_scale():
    images = [np.zeros((32, 32, 3), np.uint8)] * 2
    maps = torch.zeros(2, 8, 8)
    maps[0, 0, 0], maps[1, 7, 7] = 0.5, 0.25
    fig = figures.head_maps_grid(images, maps, ["a", "b"], "one head", query_patch=9)
    heatmaps = [trace for trace in fig.data if trace.type == "heatmap"]
    assert [trace.zmax for trace in heatmaps] == [0.5, 0.5]
    assert len(fig.layout.shapes) == 4  # the query patch outlined on both pictures
    with pytest.raises(ValueError, match="one \\(gh, gw\\) map and one label per image"):
        figures.head_maps_grid(images, maps[:1], ["a", "b"], "t")
