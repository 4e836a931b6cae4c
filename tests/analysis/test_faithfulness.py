"""Deletion and insertion curves (vit_explorer.analysis.faithfulness).

The truth test runs on a model built so that its prediction depends on a few known patches only:
one layer, one head whose class-token query looks only at patches lit in the red channel (the
"object"), and a head that reads what the class token gathered. The attribution must find those
patches and its deletion curve fall first; dropping them must flip the prediction and dropping
every other patch must not. The other tests compare every number of the curves with the model run
by hand, one kept set at a time, for a class-token model, a headless one with registers and two
rotary ones, in both ways of removing a patch."""
import copy
import math
import re

import pytest
import torch

import vit_explorer as vx
from vit_explorer.analysis import AnalysisError
from vit_explorer.analysis import faithfulness as fa
from helpers import randomize, tiny_config
from rotary import ROTARY, rotary_model

KEY = [(1, 2), (3, 5), (6, 1), (7, 7)]  # (row, column) of the patches the prediction depends on
GRID = 8


def _unit_along(dim: int, channel: int) -> torch.Tensor:
    """LayerNorm's output for a token with only ``channel`` lit, as a unit vector."""
    centred = -torch.ones(dim) / dim
    centred[channel] += 1
    return centred / centred.norm()


def truth_model() -> vx.ViT:
    """Patch tokens: channel 0 the patch's mean red, channel 1 its mean green, no positions. The
    class token's query is one constant vector and the keys read how red a token is, so the class
    token attends to the red patches and nearly nothing else while there are any; the values carry
    the same redness into channel 0 of the class token, beside its constant channel 7; the head
    reads channel 0 after the final norm: class 0 with red patches present, class 1 without."""
    config = vx.ViTConfig(
        image_size=32, patch_size=4, embed_dim=8, depth=1, num_heads=1, num_classes=2,
        mean=(0.0,) * 3, std=(1.0,) * 3,
    )
    model = vx.ViT(config).eval()
    dim = config.embed_dim
    red = _unit_along(dim, 0)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.zero_()
        model.patch_embed.proj.weight[0, 0] = 1 / 16
        model.patch_embed.proj.weight[1, 1] = 1 / 16
        model.cls_token[0, 0, 7] = 1.0
        block = model.blocks[0]
        block.norm1.weight.fill_(1)
        block.norm2.weight.fill_(1)
        block.attn.qkv.bias[0] = 20.0  # every query: 20 along channel 0
        block.attn.qkv.weight[dim] = red  # key channel 0: how red the token is
        block.attn.qkv.weight[2 * dim] = red  # value channel 0: the same
        block.attn.proj.weight[0, 0] = 1.0
        model.norm.weight.fill_(1)
        model.head.weight[0, 0], model.head.weight[1, 0] = 2.0, -2.0
    return model


def truth_image() -> torch.Tensor:
    """Green everywhere with a little blue noise, the KEY patches red instead."""
    image = torch.zeros(1, 3, 32, 32)
    image[:, 1] = 1.0
    image[:, 2] = 0.1 * torch.rand(32, 32, generator=torch.Generator().manual_seed(0))
    for row, column in KEY:
        image[:, 0, row * 4:(row + 1) * 4, column * 4:(column + 1) * 4] = 1.0
        image[:, 1, row * 4:(row + 1) * 4, column * 4:(column + 1) * 4] = 0.0
    return image


def key_mask() -> torch.Tensor:
    mask = torch.zeros(GRID * GRID, dtype=torch.bool)
    mask[[row * GRID + column for row, column in KEY]] = True
    return mask


@pytest.fixture(scope="module")
def truth():
    model, x = truth_model(), truth_image()
    cap = vx.capture(model, x)
    maps = {
        "attribution": vx.analysis.attribution(model, x)[0],
        "rollout": vx.analysis.query_map(vx.analysis.attention_rollout(cap.attentions), cap.grid_size, 1)[0],
        "raw attention": vx.analysis.attention_map(cap, layer=0),
    }
    return model, x, cap, maps


def test_the_truth_model_depends_on_the_key_patches_only(truth):
    model, x, cap, maps = truth
    assert int(cap.logits.argmax()) == 0 and cap.logits.softmax(-1)[0, 0] > 0.95
    key = key_mask()
    # The attribution finds exactly the key patches.
    assert set(maps["attribution"].flatten().argsort(descending=True)[:len(KEY)].tolist()) == set(key.nonzero().flatten().tolist())
    for mode in fa.MODES:
        outputs = fa.kept_outputs(model, x, torch.stack([~key, key, torch.ones_like(key)]), mode)
        without_key, only_key, whole = outputs.argmax(-1).tolist()
        assert (without_key, only_key, whole) == (1, 0, 0), mode  # dropping the key flips it; the others don't
        assert torch.allclose(outputs[2], cap.logits[0], atol=1e-5)


@pytest.mark.parametrize("mode, seed", [("drop", 0), ("drop", 1), ("drop", 3), ("mean", 0), ("mean", 2)])
def test_the_attribution_falls_fastest_and_the_random_order_slowest(truth, mode, seed):
    model, x, cap, maps = truth
    result = fa.faithfulness_curves(model, x, maps, mode=mode, seed=seed)
    deletion, insertion = result.area("deletion"), result.area("insertion")
    names = list(result.names)
    attribution, random = names.index("attribution"), names.index(fa.RANDOM)
    assert float(deletion[attribution]) == pytest.approx(float(deletion.min()))
    assert float(deletion[random]) == pytest.approx(float(deletion.max()))
    assert deletion[attribution] < 0.2 < 0.5 < deletion[random]
    # Insertion: any one key patch brings the class back, so a random order that adds one early
    # rises as early; it never rises earlier than the attribution.
    assert float(insertion[attribution]) == pytest.approx(float(insertion.max()))
    assert result.curves["insertion"][attribution, 1] > 0.95 and float(insertion[random]) <= float(insertion[attribution]) + 1e-6
    # The curve falls at the step that removes the last key patch (6 of 64: the second step).
    curve = result.curves["deletion"][attribution]
    assert curve[0] > 0.95 and curve[1] > 0.95 and bool((curve[2:-1] < 0.2).all())
    assert result.best("deletion") in ("attribution", "rollout", "raw attention")
    assert result.intact == pytest.approx(float(cap.logits.softmax(-1)[0, 0]), abs=1e-6)
    sentence = result.reading()
    assert sentence.startswith("Removing the 9% of patches") and "drops 'class 0' from" in sentence
    assert "for a random order to" in sentence and sentence.endswith(".")


def _by_hand(model: vx.ViT, x: torch.Tensor, kept: torch.Tensor, mode: str) -> torch.Tensor:
    """The model's output for the image with only ``kept`` (P,) patches, run plainly, batch of one."""
    grid = model.grid_size()
    patch = model.config.patch_size
    with torch.no_grad():
        if mode == "mean" or (not bool(kept.any()) and fa._reads_patches(model)):
            painted = x.clone()
            mean = x.mean(dim=(-2, -1))[0]  # (C,)
            for index in (~kept).nonzero().flatten().tolist():
                row, column = divmod(index, grid[1])
                painted[0, :, row * patch:(row + 1) * patch, column * patch:(column + 1) * patch] = mean[:, None, None]
            return model(painted)[0]
        tokens = model.norm_pre(model._pos_embed(model.patch_embed(x)))  # (1, N, D)
        prefix = model.num_prefix_tokens
        index = kept.nonzero().flatten()
        tokens = torch.cat([tokens[:, :prefix], tokens[:, prefix:][:, index]], dim=1)
        tables = model.rope_tables(grid)
        rope = None if tables is None else (tables[0][index], tables[1][index])  # (K, hd) each
        for block in model.blocks:
            tokens = block(tokens, rope)
        return model.forward_head(model.norm(tokens))[0]


MODELS = {
    "class token": lambda: randomize(vx.ViT(tiny_config(image_size=(16, 20)))),
    "registers, headless": lambda: randomize(vx.ViT(tiny_config(reg_tokens=2, num_classes=0))),
    **{f"rotary {family}": (lambda family=family: rotary_model(family)) for family in ROTARY},
}


@pytest.mark.parametrize("mode", fa.MODES)
@pytest.mark.parametrize("name", list(MODELS))
def test_every_number_of_the_curves_is_the_model_run_by_hand(name, mode):
    model = MODELS[name]()
    before = copy.deepcopy(model.state_dict())
    grid = model.grid_size()
    x = torch.randn(1, 3, *model.config.img_size, generator=torch.Generator().manual_seed(1))
    generator = torch.Generator().manual_seed(2)
    maps = {"a": torch.rand(grid, generator=generator), "b": torch.rand(grid[0] * grid[1], generator=generator)}
    result = fa.faithfulness_curves(model, x, maps, steps=4, mode=mode)
    intact = model(x)[0].detach()
    if model.config.num_classes:
        target = int(intact.argmax())
        score = lambda out: float(out.softmax(-1)[target])  # noqa: E731
    else:
        score = lambda out: float(torch.nn.functional.cosine_similarity(out, intact, dim=0))  # noqa: E731
    num_patches = grid[0] * grid[1]
    assert result.counts.tolist() == [math.floor(step * num_patches / 4 + 0.5) for step in range(5)]
    for index, name_ in enumerate(result.names):
        relevance = maps[name_].flatten() if name_ in maps else None
        order = result.orders[index]
        if relevance is not None:
            assert order.tolist() == sorted(range(num_patches), key=lambda p: -float(relevance[p]))
        for step, count in enumerate(result.counts.tolist()):
            removed = torch.zeros(num_patches, dtype=torch.bool)
            removed[order[:count]] = True
            expected_deletion = score(_by_hand(model, x, ~removed, mode))
            expected_insertion = score(_by_hand(model, x, removed, mode))
            assert float(result.curves["deletion"][index, step]) == pytest.approx(expected_deletion, abs=1e-5)
            assert float(result.curves["insertion"][index, step]) == pytest.approx(expected_insertion, abs=1e-5)
    assert result.intact == pytest.approx(score(intact), abs=1e-5)
    # Nothing of the model changed; the curves cost what planned_forwards says.
    after = model.state_dict()
    assert all(torch.equal(before[key], after[key]) for key in before) and not model.training
    assert result.forwards == pytest.approx(fa.planned_forwards(model, len(maps), steps=4, mode=mode))


def test_packed_passes_one_run_per_number_of_tokens_and_the_intact_pass_saved(monkeypatch):
    model = randomize(vx.ViT(tiny_config(image_size=32)))  # 64 patches
    x = torch.randn(1, 3, 32, 32)
    maps = {name: torch.rand(8, 8) for name in ("a", "b", "c")}
    packings = []
    original = vx.ViT.forward_blocks

    def counting(self, tokens, *args, **kwargs):
        packings.append(kwargs.get("packing"))
        return original(self, tokens, *args, **kwargs)

    monkeypatch.setattr(vx.ViT, "forward_blocks", counting)
    result = fa.faithfulness_curves(model, x, maps, intact=model(x)[0])
    packings = packings[1:]  # model(x) above
    assert len(packings) == result.passes == 1  # every set of kept patches in one packed pass
    runs = packings[0].runs
    sizes = [size for _, size in runs]
    assert sizes == sorted(set(sizes), reverse=True)  # one run for every number of tokens, longest first
    # 20 steps: 19 inner counts of each curve (deletion's and insertion's coincide where the counts do),
    # one pass with the class token alone; the intact pass was given.
    inner = set(fa.step_counts(64, 20)[1:-1].tolist())
    assert set(sizes) == {1 + count for count in inner | {64 - c for c in inner}} | {1}
    for rows, size in runs:  # every order's deletion and insertion rows that keep size - 1 patches
        kept = size - 1
        assert rows == (1 if kept == 0 else 4 * ((64 - kept) in inner) + 4 * (kept in inner))
    # In whole passes: about 9.5 per curve of each of the 4 orders.
    assert result.forwards == pytest.approx(fa.planned_forwards(model, 3, intact_given=True))
    assert 4 * 2 * 9 < result.forwards < 4 * 2 * 10
    # Chunked at fewer tokens a pass, the same curves.
    packings.clear()
    chunked = fa.faithfulness_curves(model, x, maps, intact=model(x)[0], batch_tokens=200)
    assert chunked.passes == len(packings) - 1 > 10
    for packing in packings[1:]:  # at most 200 tokens a pass, or one longer set alone
        assert sum(count * size for count, size in packing.runs) <= 200 or packing.runs == ((1, packing.runs[0][1]),)
    for curve in fa.CURVES:
        torch.testing.assert_close(chunked.curves[curve], result.curves[curve], atol=1e-6, rtol=0)


def test_a_caller_given_score_and_the_reading_of_a_headless_model():
    model = randomize(vx.ViT(tiny_config(num_classes=0, reg_tokens=1)))
    x = torch.randn(1, 3, 16, 16)
    maps = {"norm": torch.rand(4, 4)}
    result = fa.faithfulness_curves(model, x, maps, curves=("deletion",))
    assert set(result.curves) == {"deletion"} and result.intact == pytest.approx(1.0, abs=1e-6)
    # From 1 down, with the decimals that tell the two apart (or "leaves ... at" where none do).
    moved = re.search(r"the embedding's cosine with the intact one (from (1\.0+) to (\d\.\d+)|at 1\.0+);", result.reading())
    assert moved and (moved.group(2) is None or moved.group(2) != moved.group(3))
    text = torch.randn(model.config.embed_dim)
    own = fa.faithfulness_curves(
        model, x, maps, curves=("deletion",), what="the text 'a dog'",
        score=lambda out: torch.nn.functional.cosine_similarity(out, text[None], dim=-1),
    )
    with torch.no_grad():
        expected = float(torch.nn.functional.cosine_similarity(model(x)[0], text, dim=0))
    assert own.intact == pytest.approx(expected, abs=1e-5)
    assert "the text 'a dog'" in own.reading()


@pytest.mark.parametrize("call, message", [
    (lambda m, x: fa.faithfulness_curves(m, x, {"a": torch.rand(3, 3)}), "has 9 values for 16 patches"),
    (lambda m, x: fa.faithfulness_curves(m, x, {"a": torch.full((4, 4), float("nan"))}), "not numbers"),
    (lambda m, x: fa.faithfulness_curves(m, x, {"a": torch.rand(4, 4)}, mode="blur"), "drop, mean"),
    (lambda m, x: fa.faithfulness_curves(m, x, {"a": torch.rand(4, 4)}, steps=0), "between 1 and 16"),
    (lambda m, x: fa.faithfulness_curves(m, x, {"a": torch.rand(4, 4)}, curves=("both",)), "deletion, insertion"),
    (lambda m, x: fa.faithfulness_curves(m, x, {"random": torch.rand(4, 4)}), "names the random order"),
    (lambda m, x: fa.faithfulness_curves(m, x, {"a": torch.rand(4, 4)}, target=9), "must be in 0..4"),
    (lambda m, x: fa.faithfulness_curves(m, torch.cat([x, x]), {"a": torch.rand(4, 4)}), "one image at a time"),
])
def test_bad_requests_are_a_sentence(call, message):
    model = randomize(vx.ViT(tiny_config()))
    with pytest.raises(AnalysisError, match=message):
        call(model, torch.randn(1, 3, 16, 16))


@pytest.mark.parametrize("family", [None, *ROTARY])
def test_outputs_computed_elsewhere_give_the_same_curves_without_a_pass(family, monkeypatch):
    """A job runs curve_rows' sets through kept_outputs (with progress); the curves from its outputs
    are those computed in one call, and no pass runs for them."""
    torch.manual_seed(0)
    model = rotary_model(family) if family else randomize(vx.ViT(tiny_config(num_classes=5))).eval()
    x = torch.randn(1, 3, *model.config.img_size)
    grid = model.grid_size()
    maps = {"a": torch.rand(grid), "b": torch.rand(grid)}
    shares = []
    rows = fa.curve_rows(model, maps, curves=("deletion",))
    outputs = fa.kept_outputs(model, x, rows, progress=shares.append)
    assert shares == sorted(shares) and shares[-1] == 1.0
    whole = fa.faithfulness_curves(model, x, maps, curves=("deletion",))
    intact = fa.kept_outputs(model, x, torch.ones(1, grid[0] * grid[1], dtype=torch.bool))[0]
    monkeypatch.setattr(model, "forward_blocks", lambda *args, **kwargs: pytest.fail("a pass ran"))
    given = fa.faithfulness_curves(model, x, maps, curves=("deletion",), outputs=outputs, intact=intact)
    torch.testing.assert_close(given.curves["deletion"], whole.curves["deletion"])
    assert given.passes == 0 and given.names == whole.names
    with pytest.raises(AnalysisError, match="sets of patches"):
        fa.faithfulness_curves(model, x, maps, outputs=outputs, intact=intact)  # insertion's rows missing


def test_the_sharpest_mask_is_the_head_with_the_fewest_patches_its_attention_inside_only():
    flat = torch.full((4, 4), 1 / 16)
    sharp = torch.zeros(4, 4)
    sharp[1, 2], sharp[3, 0], sharp[0, 0] = 0.7, 0.25, 0.05
    head, mask = fa.sharpest_mask(torch.stack([flat, sharp]), mass=0.9)
    assert head == 1
    expected = torch.zeros(4, 4)
    expected[1, 2], expected[3, 0] = 0.7, 0.25
    torch.testing.assert_close(mask, expected)


def test_the_reading_shows_the_decimals_that_tell_the_scores_apart():
    """A random ViT-B/16's class at 1%: the change is shown, not "from 1% to 1%"; one too small to
    show is said to leave the score where it was."""
    def result(scores, percent=True):
        fractions = torch.tensor([0.0, 0.1, 1.0])
        curves = {"deletion": torch.tensor([[scores[0], scores[1], 0.0], [scores[0], scores[2], 0.0]])}
        return fa.Faithfulness(
            names=("rollout", fa.RANDOM), orders=torch.zeros(2, 10, dtype=torch.long), counts=torch.tensor([0, 1, 10]),
            fractions=fractions, curves=curves, intact=scores[0], empty=0.0, mode="drop", what="'class 782'",
            percent=percent, target=782, passes=1, forwards=1.0,
        )

    assert result([0.0104, 0.0098, 0.0103]).reading() == (
        "Removing the 10% of patches rollout ranks highest drops 'class 782' from 1.04% to 0.98%;"
        " for a random order to 1.03%."
    )
    assert "leaves 'class 782' at 1.0000%;" in result([0.01, 0.01, 0.0103]).reading()  # float32 beside float64
    assert "from 1.000 to 0.998" in result([1.0, 0.998, 0.999], percent=False).reading()
