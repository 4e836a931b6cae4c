"""Activation patching (analysis.patching): a model built to carry its class through one token,
one layer and one head is found there; exact patching against nnsight's interventions on timm's
ViT with the same weights; attribution patching against finite differences; path patching's
truth; each bad input a sentence."""
import threading

import pytest
import torch

import vit_explorer as vx
from vit_explorer.analysis import AnalysisError
from vit_explorer.analysis import patching

from helpers import randomize, timm_twin, tiny_config

CARRIER_TOKEN, CARRIER_LAYER, CARRIER_HEAD = 3, 1, 1
RELAY_TOKEN = 2  # the relay model's layer-0 head 0 moves the carrier's value here first


def truth_model(relay: bool = False, mlp: bool = False) -> vx.ViT:
    """Zero weights but for one path: the patch embedding puts channel 0's mean in dimension 0,
    positions are one-hot (dimensions 1..5), and head 1 of layer 1 attends from the class token to
    token 3 only and copies its dimension 0 into dimension 6, which the head reads as class 0 minus
    class 1. Head 0 of layer 1 averages every token's dimension 0 into dimension 7 (a bystander).
    ``relay``: head 0 of layer 0 first copies token 3's dimension 0 to token 2, which head 1 of
    layer 1 reads instead. ``mlp``: the head reads dimension 8, which only layer 2's MLP writes
    (from dimension 6)."""
    config = vx.ViTConfig(image_size=8, patch_size=4, num_classes=2, embed_dim=16, depth=3, num_heads=2)
    model = vx.ViT(config).eval()
    q, k, v, carrier = 0, 16, 32, 8 * CARRIER_HEAD  # qkv rows; head 1's first dimension
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            parameter.fill_(1.0 if "norm" in name and name.endswith("weight") else 0.0)
        model.patch_embed.proj.weight[0, 0] = 1 / 16
        for token in range(5):
            model.pos_embed[0, token, 1 + token] = 1.0
        attn = model.blocks[CARRIER_LAYER].attn
        source = RELAY_TOKEN if relay else CARRIER_TOKEN
        attn.qkv.weight[q + carrier, 1] = 3.0
        attn.qkv.weight[k + carrier, 1 + source] = 3.0
        attn.qkv.weight[v + carrier, 0] = 1.0
        attn.proj.weight[6, carrier] = 1.0
        attn.qkv.weight[v, 0] = 1.0  # the bystander: no query or key, so uniform
        attn.proj.weight[7, 0] = 0.2
        if relay:
            first = model.blocks[0].attn
            first.qkv.weight[q, 1 + RELAY_TOKEN] = 3.0
            first.qkv.weight[k, 1 + CARRIER_TOKEN] = 3.0
            first.qkv.weight[v, 0] = 1.0
            first.proj.weight[0, 0] = 1.0
        read = 6
        if mlp:
            model.blocks[2].mlp.fc1.weight[0, 6] = 1.0
            model.blocks[2].mlp.fc2.weight[8, 0] = 1.0
            read = 8
        model.head.weight[0, read], model.head.weight[1, read] = 1.0, -1.0
    return model


def pair(model, token: int = CARRIER_TOKEN):
    """A clean picture bright in ``token``'s patch (channel 0) and a corrupted one dark there."""
    clean = torch.zeros(1, 3, 8, 8)
    corrupted = clean.clone()
    row, column = divmod(token - 1, 2)
    clean[0, 0, 4 * row:4 * row + 4, 4 * column:4 * column + 4] = 3.0
    corrupted[0, 0, 4 * row:4 * row + 4, 4 * column:4 * column + 4] = -3.0
    return patching.paired_runs(model, clean, corrupted), patching.class_difference(0, 1, ["cat", "dog"])


def test_exact_patching_finds_the_one_token_layer_and_head_that_carry_the_class():
    model = truth_model()
    runs, metric = pair(model)
    resid = patching.exact_patching(model, runs, metric, "resid")
    # Before the carrying layer the difference is in the carrier token, after it in the class token.
    expected = torch.zeros(3, 5)
    expected[:CARRIER_LAYER + 1, CARRIER_TOKEN] = 1.0
    expected[CARRIER_LAYER + 1:, 0] = 1.0
    torch.testing.assert_close(resid, expected, atol=1e-5, rtol=0)
    heads = patching.exact_patching(model, runs, metric, "head")
    assert heads[CARRIER_LAYER, CARRIER_HEAD] > 0.95
    others = heads.clone()
    others[CARRIER_LAYER, CARRIER_HEAD] = 0
    assert others.abs().max() < 0.05  # the bystander head moves the final norm a little, no more
    attn = patching.exact_patching(model, runs, metric, "attn")
    assert attn[CARRIER_LAYER, 0] == pytest.approx(1.0, abs=1e-5) and attn.flatten().topk(2).values[1].abs() < 1e-6
    assert patching.exact_patching(model, runs, metric, "mlp").abs().max() < 1e-6
    # Noising the class token after the carrying layer loses the whole difference.
    assert patching.exact_patching(model, runs, metric, "resid", "noising")[CARRIER_LAYER + 1, 0] == pytest.approx(0.0, abs=1e-5)


def test_attribution_patching_ranks_the_carriers_first():
    model = truth_model()
    runs, metric = pair(model)
    estimates = patching.attribution_patching(model, runs, metric)
    heads = estimates["head"].abs()
    assert divmod(int(heads.argmax()), 2) == (CARRIER_LAYER, CARRIER_HEAD)
    resid = estimates["resid"].abs()
    assert resid.argmax(dim=1).tolist() == [CARRIER_TOKEN] * (CARRIER_LAYER + 1) + [0] * (2 - CARRIER_LAYER)
    assert divmod(int(estimates["attn"].abs().argmax()), 5) == (CARRIER_LAYER, 0)


def test_path_patching_follows_the_head_through_the_head_or_the_mlp_that_reads_it():
    model = truth_model(relay=True)
    runs, metric = pair(model)
    relay = (0, 0)
    assert patching.exact_patching(model, runs, metric, "head")[relay] > 0.9
    assert patching.path_patching(model, runs, metric, relay, (CARRIER_LAYER, CARRIER_HEAD)) > 0.9
    assert abs(patching.path_patching(model, runs, metric, relay, (CARRIER_LAYER, 0))) < 0.05
    assert patching.path_patching(model, runs, metric, relay, None) == pytest.approx(0.0, abs=1e-6)  # no MLP reads it
    # The carrier's difference reaches the output through layer 2's MLP only, or directly only.
    through_mlp = truth_model(mlp=True)
    runs, metric = pair(through_mlp)
    assert patching.path_patching(through_mlp, runs, metric, (CARRIER_LAYER, CARRIER_HEAD), None) > 0.9
    model = truth_model()
    runs, metric = pair(model)
    assert patching.path_patching(model, runs, metric, (CARRIER_LAYER, CARRIER_HEAD), None) == pytest.approx(0.0, abs=1e-6)
    with pytest.raises(AnalysisError, match="later layer"):
        patching.path_patching(model, runs, metric, (1, 1), (0, 1))


def _site(block, site: str):
    return {"resid": lambda: block.input, "attn": lambda: block.attn.output, "mlp": lambda: block.mlp.output,
            "head": lambda: block.attn.proj.input}[site]()


def nnsight_clean(twin, clean, site: str):
    """The timm twin through nnsight, and every layer's ``site`` on ``clean`` (traced once)."""
    nnsight = pytest.importorskip("nnsight")
    model = nnsight.NNsight(twin)
    with model.trace(clean):
        saved = nnsight.save([_site(block, site) for block in model.blocks])
    return model, saved


def nnsight_patched(model, saved, corrupted, site: str, layer: int, unit: int, heads: int):
    """The twin's output on ``corrupted`` with one cell of ``site`` from the clean run's ``saved``."""
    with model.trace(corrupted):
        where = _site(model.blocks[layer], site)
        if site == "head":
            width = saved[layer].shape[-1] // heads
            where[:, :, unit * width:(unit + 1) * width] = saved[layer][:, :, unit * width:(unit + 1) * width]
        else:
            where[:, unit] = saved[layer][:, unit]
        out = model.output.save()
    return out.detach()


@pytest.mark.parametrize("site", list(patching.SITES))
def test_exact_patching_matches_nnsight_interventions_on_timm(site):
    config = tiny_config(image_size=8, depth=3, init_values=0.5)
    ours = randomize(vx.ViT(config))
    twin = timm_twin(config)
    twin.load_state_dict(ours.state_dict())
    generator = torch.Generator().manual_seed(1)
    clean, corrupted = torch.randn(2, 1, 3, 8, 8, generator=generator)
    runs = patching.paired_runs(ours, clean, corrupted)
    metric = patching.class_difference(1, 3, [str(c) for c in range(5)])
    mine = patching.exact_patching(ours, runs, metric, site)
    normalise = runs.normaliser(metric)
    traced, saved = nnsight_clean(twin, clean, site)
    for layer in range(config.depth):
        for unit in range(mine.shape[1]):
            out = nnsight_patched(traced, saved, corrupted, site, layer, unit, config.num_heads)
            assert float(mine[layer, unit]) == pytest.approx(float(normalise(metric.score(out))[0]), abs=1e-4), (layer, unit)


def test_attribution_patching_is_the_derivative_of_small_patches():
    config = tiny_config(depth=2)
    model = randomize(vx.ViT(config)).double()
    generator = torch.Generator().manual_seed(2)
    clean, corrupted = torch.randn(2, 1, 3, 16, 16, generator=generator, dtype=torch.float64)
    runs = patching.paired_runs(model, clean, corrupted)
    metric = patching.class_difference(0, 2, [str(c) for c in range(5)])
    normalise = runs.normaliser(metric)
    estimates = patching.attribution_patching(model, runs, metric)
    step = 1e-5
    for site, layer, unit in [("resid", 0, 5), ("resid", 1, 0), ("attn", 1, 7), ("mlp", 0, 2), ("head", 0, 3), ("head", 1, 1)]:
        values = runs.activations[(site, layer)]
        change = torch.zeros_like(values[:1])
        change[:, unit] = step * (values[0, unit] - values[1, unit])
        with torch.no_grad(), vx.model.patching.patching(vx.model.patching.Patch(model, add={(site, layer): change})):
            out = model(runs.images[1:])
        finite = (float(normalise(metric.score(out))[0]) - 0.0) / step
        assert float(estimates[site][layer, unit]) == pytest.approx(finite, abs=1e-3), (site, layer, unit)


def test_noising_estimates_start_from_the_clean_run():
    model = truth_model()
    runs, metric = pair(model)
    estimates = patching.attribution_patching(model, runs, metric, "noising")
    assert estimates["mlp"].eq(1.0).all()  # nothing to move: the clean run's value


def test_bad_inputs_are_one_sentence_each():
    model = truth_model()
    clean, _ = torch.zeros(2, 1, 3, 8, 8)
    with pytest.raises(AnalysisError, match="nothing to patch"):
        patching.paired_runs(model, clean, clean.clone())
    # A difference that the metric does not see: a channel the patch embedding does not read.
    corrupted = clean.clone()
    corrupted[:, 1] = 1.0
    runs = patching.paired_runs(model, clean, corrupted)
    with pytest.raises(AnalysisError, match="same value .* nothing to patch"):
        patching.exact_patching(model, runs, patching.class_difference(0, 1, ["cat", "dog"]), "resid")
    with pytest.raises(AnalysisError, match="no class 'bird'"):
        patching.named_difference("cat-bird", ["cat", "dog"])
    with pytest.raises(AnalysisError, match="no class 2"):
        patching.class_difference(0, 2, ["cat", "dog"])
    assert patching.named_difference("Sea-lion-dog", ["sea-lion", "dog"]).name == "logit 'sea-lion' - logit 'dog'"
    with pytest.raises(AnalysisError, match="covers the whole picture"):
        patching.painted(clean, (0, 2, 0, 2), 4)
    assert patching.painted(clean + 1, (0, 1, 1, 2), 4)[0, :, :4, 4:].eq(0).all()
    from PIL import Image
    note = patching.size_note(Image.new("RGB", (30, 20)), Image.new("RGB", (40, 40)), (8, 8))
    assert note.startswith("The corrupted picture is 40x40 pixels and the clean one 30x20") and "8x8" in note
    assert patching.size_note(Image.new("RGB", (30, 20)), Image.new("RGB", (30, 20)), (8, 8)) is None


def test_exact_patching_runs_each_cell_from_its_layer_on_and_skips_cells_that_agree(monkeypatch):
    model = randomize(vx.ViT(tiny_config(depth=3)))
    clean = torch.randn(1, 3, 16, 16, generator=torch.Generator().manual_seed(3))
    runs = patching.paired_runs(model, clean, patching.painted(clean, (0, 2, 0, 1), 4))  # 2 of 16 patches
    layer_of = {block: layer for layer, block in enumerate(model.blocks)}
    ran, rows = [], []  # (layer, images) of every whole block; images of every last block for the class token
    original, original_rows = vx.model.vit.Block.forward, vx.model.patching._last_block_rows
    monkeypatch.setattr(vx.model.vit.Block, "forward", lambda block, x, *args: ran.append((layer_of[block], x.shape[0])) or original(block, x, *args))
    monkeypatch.setattr(vx.model.patching, "_last_block_rows", lambda model, x, *args: rows.append(x.shape[0]) or original_rows(model, x, *args))
    patching.exact_outputs(model, runs, "resid", batch_size=8)
    # Layer 0: the two painted patches only; layers 1 and 2: all 17 tokens, in batches of 8, each
    # batch through the blocks from its layer on, the last for the class token's row only.
    assert [images for layer, images in ran if layer == 0] == [2]
    assert [images for layer, images in ran if layer == 1] == [2, 8, 8, 1]
    assert [images for layer, images in ran if layer == 2] == []
    assert rows == [2, 8, 8, 1, 8, 8, 1]
    counted = sum(images for _, images in ran) + vx.model.patching.ROWS_SHARE * sum(rows)
    assert counted / 3 == pytest.approx(patching.exact_passes(model, runs, "resid"))


@pytest.mark.parametrize("site", ["resid", "head"])
def test_a_mean_pooled_model_runs_its_last_block_whole_and_matches_nnsight(site):
    config = tiny_config(image_size=8, depth=2, class_token=False, global_pool="mean")
    ours = randomize(vx.ViT(config))
    twin = timm_twin(config)
    twin.load_state_dict(ours.state_dict())
    clean, corrupted = torch.randn(2, 1, 3, 8, 8, generator=torch.Generator().manual_seed(5))
    runs = patching.paired_runs(ours, clean, corrupted)
    metric = patching.class_difference(0, 4, [str(c) for c in range(5)])
    mine, normalise = patching.exact_patching(ours, runs, metric, site), runs.normaliser(metric)
    assert patching.exact_passes(ours, runs, site) == pytest.approx(mine.numel() * 1.5 / 2)  # whole blocks
    traced, saved = nnsight_clean(twin, clean, site)
    for layer in range(config.depth):
        for unit in range(mine.shape[1]):
            out = nnsight_patched(traced, saved, corrupted, site, layer, unit, config.num_heads)
            assert float(mine[layer, unit]) == pytest.approx(float(normalise(metric.score(out))[0]), abs=1e-4)


def test_a_patch_reaches_only_the_passes_of_its_own_call():
    model = randomize(vx.ViT(tiny_config()))
    x = torch.randn(1, 3, 16, 16, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        plain = model(x)
        everything = torch.ones(1, 17, dtype=torch.bool)
        other_thread = []
        with vx.model.patching.patching(vx.model.patching.Patch(model, replace={("resid", 1): (everything, torch.zeros(1, 17, 32))})):
            patched = model(x)
            thread = threading.Thread(target=lambda: other_thread.append(model(x)))
            thread.start()
            thread.join()
        after = model(x)
    assert not torch.allclose(patched, plain)
    torch.testing.assert_close(other_thread[0], plain)
    torch.testing.assert_close(after, plain)


@pytest.mark.parametrize("changes", [{}, dict(dist_token=True), dict(reg_tokens=2), dict(class_token=False, global_pool="mean")])
def test_the_rest_of_a_pass_from_any_layer_is_the_models_own(changes):
    model = randomize(vx.ViT(tiny_config(depth=3, **changes)))
    x = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        captured = vx.capture(model, x, layers=())
        for start in range(3):
            rest = vx.model.patching.rest_of_pass(model, captured.tokens[:, start], start)
            torch.testing.assert_close(rest, captured.logits, atol=1e-5, rtol=1e-5)
