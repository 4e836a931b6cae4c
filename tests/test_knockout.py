"""Knock-outs remove exactly what they say, per call, and the sweep agrees with them one by one."""
import base64
import io
import json
import os
import re
import signal
import time

import numpy as np
import pytest
import torch
from PIL import Image

import vit_explorer as vx

from helpers import VARIANTS, randomize, timm_twin, tiny_config

MODES = ("zero", "mean")


def peaked(model: vx.ViT) -> vx.ViT:
    """Random weights with larger queries and keys: attention far from uniform, whose heads' mean
    over the tokens (mean-ablation) is far from what they output."""
    randomize(model)
    with torch.no_grad():
        for block in model.blocks:
            block.attn.qkv.weight.mul_(4)
    return model


def removed_branch(output: torch.Tensor, bias: torch.Tensor, mode: str) -> torch.Tensor:
    """A branch taken out by hand: its output projection's bias alone (zero), or its output's
    mean over each image's tokens (mean)."""
    return bias.expand_as(output) if mode == "zero" else output.mean(dim=1, keepdim=True).expand_as(output)


def by_hand(model: vx.ViT, x: torch.Tensor, layer: int, branch: str, mode: str) -> torch.Tensor:
    """The logits with one layer's attention or MLP branch removed, block written out by hand."""
    with torch.no_grad():
        tokens = model.norm_pre(model._pos_embed(model.patch_embed(x)))
        for index, block in enumerate(model.blocks):
            attended = block.attn(block.norm1(tokens))
            if index == layer and branch == "attention":
                attended = removed_branch(attended, block.attn.proj.bias, mode)
            middle = tokens + block.ls1(attended)
            refined = block.mlp(block.norm2(middle))
            if index == layer and branch == "mlp":
                refined = removed_branch(refined, block.mlp.fc2.bias, mode)
            tokens = middle + block.ls2(refined)
        return model.forward_head(model.norm(tokens))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("changes", VARIANTS.values(), ids=VARIANTS.keys())
def test_every_head_of_a_layer_is_that_layers_attention_branch_removed(changes, mode):
    model = peaked(vx.ViT(tiny_config(depth=3, **changes)))
    x = torch.randn(2, 3, *model.config.img_size)
    every_head = vx.capture(model, x, knock_out=vx.KnockOut(heads={1: range(4)}, mode=mode))
    branch = vx.capture(model, x, knock_out=vx.KnockOut(attention=[1], mode=mode))
    expected = by_hand(model, x, layer=1, branch="attention", mode=mode)
    torch.testing.assert_close(every_head.logits, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(branch.logits, expected, rtol=1e-5, atol=1e-5)
    intact = vx.capture(model, x)
    torch.testing.assert_close(every_head.tokens[:, :2], intact.tokens[:, :2])  # nothing before layer 1 moves
    assert (every_head.tokens[:, 2] - intact.tokens[:, 2]).abs().max() > 1e-2  # its output does


@pytest.mark.parametrize("mode", MODES)
def test_an_mlp_knock_out_removes_that_branch(mode):
    model = randomize(vx.ViT(tiny_config(depth=3, init_values=0.5)))
    x = torch.randn(2, 3, 16, 16)
    knocked = vx.capture(model, x, knock_out=vx.KnockOut(mlp=[2], mode=mode))
    torch.testing.assert_close(knocked.logits, by_hand(model, x, layer=2, branch="mlp", mode=mode), rtol=1e-5, atol=1e-5)


def test_mean_ablation_takes_each_images_own_mean():
    model = randomize(vx.ViT(tiny_config()))
    x = torch.randn(3, 3, 16, 16)
    knock_out = vx.KnockOut(heads={0: (1, 2)}, mlp=[1], mode="mean")
    batch = vx.capture(model, x, knock_out=knock_out)
    for index in range(3):
        alone = vx.capture(model, x[index : index + 1], knock_out=knock_out)
        torch.testing.assert_close(batch.logits[index : index + 1], alone.logits, rtol=1e-5, atol=1e-5)


def test_no_knock_out_is_the_plain_forward_bitwise():
    model = randomize(vx.ViT(tiny_config(reg_tokens=2)))
    x = torch.randn(2, 3, 16, 16)
    empty = vx.KnockOut(heads={0: ()}, mode="mean")
    assert empty.is_empty
    with torch.no_grad():
        plain = model(x)
        with empty.applied(model):
            assert torch.equal(model(x), plain)
    intact, knocked = vx.capture(model, x), vx.capture(model, x, knock_out=empty)
    assert torch.equal(knocked.logits, intact.logits) and torch.equal(knocked.attentions, intact.attentions)
    assert torch.equal(knocked.tokens, intact.tokens)


def counting_blocks(monkeypatch, model: vx.ViT) -> list[int]:
    """The layers of ``model`` whose block runs from now on (Block.forward, counted)."""
    ran = []
    original = vx.model.Block.forward
    layer_of = {id(block): layer for layer, block in enumerate(model.blocks)}

    def counting(block, x, rope=None):
        ran.append(layer_of[id(block)])
        return original(block, x, rope)

    monkeypatch.setattr(vx.model.Block, "forward", counting)
    return ran


KNOCK_OUTS = [
    vx.KnockOut(heads={2: (1,)}), vx.KnockOut(heads={0: (0, 3)}, mode="mean"), vx.KnockOut(mlp=(3,), mode="mean"),
    vx.KnockOut(heads={3: (2,)}, attention=(1,), mlp=(2,)),
]


@pytest.mark.parametrize("changes", [{}, dict(reg_tokens=2, class_token=False, global_pool="map", num_classes=0)],
                         ids=["cls token", "registers, map head"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("layers", [None, [1, 3]])
def test_a_knock_out_resumed_from_the_intact_capture_is_the_same_capture(changes, dtype, layers, monkeypatch):
    model = peaked(vx.ViT(tiny_config(depth=4, **changes))).eval()
    x = torch.randn(2, 3, 16, 16)
    intact = vx.capture(model, x, layers=layers, attention_dtype=dtype)
    for knock_out in KNOCK_OUTS:
        whole = vx.capture(model, x, layers=layers, attention_dtype=dtype, knock_out=knock_out)
        ran = counting_blocks(monkeypatch, model)
        resumed = vx.capture(model, x, layers=layers, attention_dtype=dtype, knock_out=knock_out, intact=intact)
        monkeypatch.undo()
        assert ran == list(range(knock_out.first_layer(), 4))  # the layers before are the intact pass's
        for field in ("logits", "attentions", "tokens", "patches", "patch_embeddings"):
            assert torch.equal(getattr(resumed, field), getattr(whole, field)), field
        assert resumed.layers == whole.layers
        if whole.pool_attentions is not None:
            assert torch.equal(resumed.pool_attentions, whole.pool_attentions)


def test_an_intact_capture_of_something_else_is_refused():
    model = randomize(vx.ViT(tiny_config(depth=3)))
    x = torch.randn(1, 3, 16, 16)
    knock_out = vx.KnockOut(heads={1: (0,)})
    with pytest.raises(ValueError, match="same layers"):
        vx.capture(model, x, knock_out=knock_out, intact=vx.capture(model, x, layers=[-1]))
    with pytest.raises(ValueError, match="same images"):
        vx.capture(model, x, knock_out=knock_out, intact=vx.capture(model, torch.cat([x, x])))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("changes", [{}, dict(num_classes=0), dict(class_token=False, global_pool="mean")],
                         ids=["classifier", "headless", "mean pool"])
def test_a_sweep_entry_is_the_single_knock_out(changes, mode):
    model = peaked(vx.ViT(tiny_config(depth=3, **changes)))
    x = torch.randn(1, 3, 16, 16)
    shares = []
    sweep = vx.head_sweep(model, x, mode=mode, progress=shares.append, batch_size=3)  # heads split 3 + 1
    intact = vx.capture(model, x).logits
    assert sweep.values.shape == (3, 4) and sweep.mode == mode
    assert shares == sorted(shares) and shares[-1] == pytest.approx(1.0) and len(shares) == 6
    for layer in range(3):
        for head in range(4):
            knocked = vx.capture(model, x, knock_out=vx.KnockOut(heads={layer: (head,)}, mode=mode)).logits
            if model.config.num_classes:
                target = int(intact.argmax())
                assert sweep.target == target
                expected = knocked.log_softmax(-1)[0, target] - intact.log_softmax(-1)[0, target]
            else:
                assert sweep.target is None
                expected = torch.cosine_similarity(knocked, intact)[0] - 1
            torch.testing.assert_close(sweep.values[layer, head], expected, rtol=1e-4, atol=1e-5)
    assert sweep.values.abs().max() > 1e-4  # the knock-outs moved the output


def test_the_sweep_cost_counts_only_the_layers_from_the_knocked_one_on():
    vit_b = vx.ViTConfig(image_size=224, patch_size=16, embed_dim=768, depth=12, num_heads=12)
    assert vx.sweep_cost(vit_b) == pytest.approx(1 + 12 * 13 / 2)  # 79 forwards, not 144


@pytest.mark.parametrize("mode", MODES)
def test_a_knock_out_matches_the_same_knock_out_by_hand_on_timm(mode):
    """timm's VisionTransformer with the same weights, its head's slice of the input to
    ``attn.proj`` replaced by a forward pre-hook (ours never hooks)."""
    config = tiny_config(depth=3, reg_tokens=1)
    model = peaked(vx.ViT(config))
    reference = timm_twin(config)
    reference.load_state_dict(model.state_dict(), strict=True)
    knocked = {0: (2,), 2: (0, 3)}
    head_dim = config.embed_dim // config.num_heads

    def ablate(heads):
        def hook(module, inputs):
            (concatenated,) = inputs  # (B, N, H * hd)
            concatenated = concatenated.clone()
            for head in heads:
                part = concatenated[..., head * head_dim : (head + 1) * head_dim]
                part[...] = 0 if mode == "zero" else part.mean(dim=1, keepdim=True)
            return (concatenated,)
        return hook

    for layer, heads in knocked.items():
        reference.blocks[layer].attn.proj.register_forward_pre_hook(ablate(heads))
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        expected = reference(x)
    result = vx.capture(model, x, knock_out=vx.KnockOut(heads=knocked, mode=mode))
    torch.testing.assert_close(result.logits, expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(result.logits, vx.capture(model, x).logits, atol=1e-3)


def test_impossible_knock_outs_are_refused_in_a_sentence():
    model = randomize(vx.ViT(tiny_config()))  # 2 layers of 4 heads
    x = torch.randn(1, 3, 16, 16)
    cases = {
        vx.KnockOut(heads={5: (0,)}): "Layer 5 does not exist: this model has layers 0 to 1.",
        vx.KnockOut(mlp=[-1]): "Layer -1 does not exist: this model has layers 0 to 1.",
        vx.KnockOut(heads={1: (4,)}): "Head 4 of layer 1 does not exist: this model has heads 0 to 3.",
        vx.KnockOut(heads={0: range(4)}, attention=[1]): "Knocking out every head of every layer",
    }
    for knock_out, sentence in cases.items():
        assert knock_out.problem(model.config).startswith(sentence)
        with pytest.raises(ValueError, match=sentence[:30]):
            vx.capture(model, x, knock_out=knock_out)
    assert vx.KnockOut(heads={0: range(4)}, mlp=[0, 1]).problem(model.config) is None
    with pytest.raises(ValueError, match="mode must be one of zero, mean"):
        vx.KnockOut(mode="half")


def test_knock_outs_are_values_that_can_key_a_cache():
    first = vx.KnockOut(heads={3: [2, 0], 1: (1,)}, mlp=(4, 2))
    second = vx.KnockOut(heads=((1, [1]), (3, (0, 2)), (5, ())), mlp=[2, 4])
    assert first == second and hash(first) == hash(second) and first.first_layer() == 1
    assert first.describe() == "layer 1 head 1; layer 3 heads 0, 2; layer 2 MLP; layer 4 MLP (zero-ablated)"


# --- the page ------------------------------------------------------------------------------------

from vit_explorer.app import costs, jobs, models, selection  # noqa: E402

from test_app import errors, figure_titles, open_app, tiny_default, tiny_model, title_matching, widget  # noqa: E402,F401

PAGE = "views/knockout.py"


def decoded(values) -> np.ndarray:
    """A figure's numbers, plain or in plotly's typed-array encoding of a numpy array."""
    if isinstance(values, dict):
        return np.frombuffer(base64.b64decode(values["bdata"]), dtype=values["dtype"])
    return np.asarray(values)


def charts(app) -> dict[str, list[dict]]:
    """The page's charts: title -> traces (their JSON)."""
    specs = [json.loads(chart.proto.spec) for chart in app.get("plotly_chart")]
    return {spec["layout"]["title"]["text"]: spec["data"] for spec in specs}


def assert_same_charts(shown: dict[str, list[dict]], expected: dict[str, list[dict]]) -> None:
    """Charts (title -> traces, their JSON) that show the same: numbers within what summing in
    another order (a job's worker) moves, pictures within one level, the rest equal."""
    assert shown.keys() == expected.keys()
    for title, traces in shown.items():
        for trace, reference in zip(traces, expected[title], strict=True):
            assert trace.keys() == reference.keys()
            for name, value in reference.items():
                if isinstance(value, dict) and "bdata" in value:
                    np.testing.assert_allclose(decoded(trace[name]), decoded(value), rtol=1e-3, atol=1e-6)
                elif name == "source":  # a PNG
                    np.testing.assert_allclose(pixels(trace[name]), pixels(value), atol=1)
                else:
                    assert trace[name] == value, (title, name)


def pixels(source: str) -> np.ndarray:
    """A data-URL PNG's pixels."""
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(source.partition(",")[2])))).astype(int)


def choose(app, label: str, values) -> None:
    widget(app.multiselect, label).set_value(values).run()
    assert not app.exception, app.exception


def test_the_page_shows_the_knock_out_against_the_intact_model():
    app = open_app(PAGE)
    assert errors(app) == [] and app.title[0].value == "Knock-out"
    assert title_matching(app, "^Each head knocked out alone \\(zero\\): change of log p of '\\w+'; outlined")  # tiny: sweep unasked
    assert all(w.help for w in [*app.multiselect, *app.radio, *app.button])  # every control says what it does
    choose(app, "Layer 1", [0, 2])
    assert errors(app) == []
    titles = figure_titles(app)
    assert all(title.strip() for title in titles) and len(titles) == 6
    what = re.escape("layer 1 heads 0, 2 (zero-ablated)")
    title_matching(app, f"^Top-5 with {what}, against the intact model$")
    title_matching(app, f"^With {what}: attention of the class token in layer 2")
    title_matching(app, "^Intact: rollout to the class token$")
    # The bars are the model's own, with and without the heads, computed here by hand.
    model = models.base_model(models.DEFAULT_MODEL)
    x = vx.preprocess(vx.shapes_sample(4, 32)[0], model.config)
    knocked = vx.capture(model, x, knock_out=vx.KnockOut(heads={1: (0, 2)})).logits[0].softmax(-1)
    spec = next(chart for chart in app.get("plotly_chart") if "Top-5" in chart.proto.spec).proto.spec
    bars = json.loads(spec)["data"][1]
    shown = [vx.SHAPE_CLASSES.index(name) for name in bars["y"]]
    assert shown == knocked.argsort(descending=True)[:5].tolist()
    np.testing.assert_allclose(decoded(bars["x"]), knocked[shown].numpy(), rtol=1e-3)


def test_a_view_costs_one_knocked_out_pass_and_its_widgets_reuse_it(monkeypatch):
    captures, sweeps = [], []

    def counting_capture(*args, **kwargs):
        captures.append(kwargs.get("knock_out"))
        return vx.capture(*args, **kwargs)

    def counting_sweep(*args, **kwargs):
        sweeps.append(args[2])
        return vx.head_sweep(*args, **kwargs)

    monkeypatch.setattr(selection, "capture", counting_capture)
    monkeypatch.setattr(selection, "head_sweep", counting_sweep)
    app = open_app(PAGE)
    assert (captures, sweeps) == ([None], ["zero"])
    choose(app, "Layer 2", [3])
    assert captures == [None, vx.KnockOut(heads={2: (3,)})]
    widget(app.slider, "Layer").set_value(0).run()
    choose(app, "Remove the MLP branch of layers", [0])
    assert len(captures) == 3 and sweeps == ["zero"]  # the slider drew what was there
    app.radio(key="knockout_mode").set_value("mean").run()
    assert captures[-1] == vx.KnockOut(heads={2: (3,)}, mlp=[0], mode="mean") and sweeps == ["zero", "mean"]
    app.switch_page("views/attention.py").run()
    app.switch_page(PAGE).run()
    assert not app.exception and len(captures) == 4 and len(sweeps) == 2  # kept, and shared


def test_a_knock_out_view_runs_only_the_layers_from_the_knocked_out_one_on(monkeypatch):
    app = open_app(PAGE)
    ran = counting_blocks(monkeypatch, models.base_model(models.DEFAULT_MODEL))
    choose(app, "Layer 2", [3])
    assert ran == [2, 3]  # the intact capture is the page's first view's; layers 0 and 1 are its
    widget(app.slider, "Layer").set_value(0).run()
    choose(app, "Layer 2", [])
    assert not app.exception and ran == [2, 3]  # drawn from what was there


def run_until(app, done, timeout: float = 120) -> None:
    """Rerun the page (as its live fragment would) until ``done(app)``."""
    deadline = time.monotonic() + timeout
    while not done(app):
        assert time.monotonic() < deadline, [element.value for element in app.markdown]
        time.sleep(0.5)
        app.run()
        assert not app.exception, app.exception


def sweep_shown(app) -> bool:
    return any(title.startswith("Each head knocked out alone") for title in figure_titles(app))


def test_a_sweep_that_is_not_quick_is_a_job_that_a_second_person_joins(monkeypatch):
    monkeypatch.setattr(costs, "QUICK_COST", 1.0)  # the tiny model's sweep as a ViT-B's would be
    computed = []
    monkeypatch.setattr(selection, "head_sweep", lambda *args, **kwargs: computed.append(args))
    ann = open_app(PAGE)
    assert not sweep_shown(ann) and errors(ann) == []
    widget(ann.button, "Run the sweep").click().run()
    assert ann.get("progress") or any("Waiting for its turn" in info.value for info in ann.info)
    bob = open_app(PAGE)  # the same model, image and mode: he sees it going and asks for it too
    assert [button.label for button in bob.button if "sweep" in button.label or "too" in button.label] == ["Ask for it too"]
    widget(bob.button, "Ask for it too").click().run()
    widget(ann.button, "Cancel").click().run()  # Ann withdraws: Bob still wants it, so it goes on
    run_until(bob, sweep_shown)
    ann.run()
    assert sweep_shown(ann) and computed == []  # shared through the cache, computed beside the server
    assert len(list(jobs.job_board().folder.glob("*/record.json"))) == 1  # one job for both
    # The job's sweep is the one the server would have computed.
    model = models.base_model(models.DEFAULT_MODEL)
    x = vx.preprocess(vx.shapes_sample(4, 32)[0], model.config)
    spec = json.loads(next(chart for chart in ann.get("plotly_chart") if "Each head" in chart.proto.spec).proto.spec)
    np.testing.assert_allclose(
        decoded(spec["data"][0]["z"]).reshape(4, 4), vx.head_sweep(model, x).values.numpy(), rtol=1e-4, atol=1e-5,
    )


def test_a_sweep_job_whose_worker_is_killed_says_so_in_a_sentence(monkeypatch):
    monkeypatch.setattr(costs, "QUICK_COST", 1.0)
    app = open_app(PAGE)
    widget(app.button, "Run the sweep").click().run()
    (record,) = jobs.job_board().folder.glob("*/record.json")
    os.kill(json.loads(record.read_text())["pid"], signal.SIGKILL)
    run_until(app, lambda app: errors(app))
    assert errors(app) == [
        "The computation's process ended before it finished (it was stopped from outside or ran out of"
        " memory); run it again."
    ]
    widget(app.button, "Run the sweep").click().run()  # asked again: it runs this time
    run_until(app, sweep_shown)
    assert errors(app) == []


def test_knocking_out_every_head_is_refused_in_a_sentence():
    app = open_app(PAGE)
    choose(app, "Remove the attention branch of layers", [0, 1, 2])
    choose(app, "Layer 3", [0, 1, 2, 3])
    assert errors(app) == [
        "Knocking out every head of every layer leaves the tokens nothing to read from one another, so"
        " there is nothing left to compare: keep at least one head."
    ]
    assert not app.exception
    app.button[0].click().run()  # Clear
    assert errors(app) == [] and all(not w.value for w in app.multiselect)


def test_a_headless_model_compares_its_pooled_features(tmp_path):
    path = tmp_path / "headless.safetensors"
    model = tiny_model(class_token=False, global_pool="map", num_classes=0, class_names=None).eval()
    vx.save_model(model, path)
    app = open_app(PAGE)
    app.file_uploader(key="checkpoint_upload").set_value((path.name, path.read_bytes(), "application/octet-stream")).run()
    assert not app.exception and errors(app) == []
    title_matching(app, "^Each head knocked out alone \\(zero\\): cosine change; outlined: knocked out above$")
    choose(app, "Layer 0", [1])
    assert errors(app) == []
    (metric,) = app.metric
    assert metric.label == "Cosine between the pooled features, intact and knocked out"
    x = vx.preprocess(vx.shapes_sample(4, 32)[0], model.config)
    knocked = vx.capture(model, x, knock_out=vx.KnockOut(heads={0: (1,)})).logits
    assert metric.value == f"{float(torch.cosine_similarity(knocked, vx.capture(model, x).logits)):.6f}"
    title_matching(app, "^With layer 0 head 1 \\(zero-ablated\\): rollout to the mean over the patch queries$")


def test_a_sweep_cell_reports_its_layer_and_head_when_clicked():
    values = torch.arange(12.0).reshape(3, 4) - 6
    knocked = torch.zeros(3, 4, dtype=torch.bool)
    knocked[2, 1] = True
    fig = vx.figures.head_sweep_grid(values, "change of log p", knocked=knocked, title="t")
    (cells,) = [trace for trace in fig.data if trace.type == "scatter"]
    for x, y, value in zip(cells.x, cells.y, cells.customdata):
        assert value == values[y, x]  # a clicked point's x is the head, its y the layer
    (outline,) = fig.layout.shapes
    assert (outline.x0, outline.y0) == (0.5, 1.5)


def test_clicking_a_sweep_cell_in_chromium_knocks_that_head_out(tmp_path):
    """Plotly selections cannot be played in AppTest: the click goes through a real browser."""
    sync_api = pytest.importorskip("playwright.sync_api")
    from bench.browser import CHROMIUM, CHROMIUM_LAUNCH, STATUS_WIDGET, serve_app

    if CHROMIUM is None:
        pytest.skip("no system Chromium (apt-get install chromium)")
    weights = tmp_path / "tiny.safetensors"
    vx.save_model(tiny_model(), weights)  # 4 layers of 4 heads: its sweep runs unasked
    env = {"VIT_EXPLORER_DEFAULT_MODEL": str(weights), "VIT_EXPLORER_RUNS_DIR": str(tmp_path / "runs")}
    with serve_app(env, log=tmp_path / "streamlit.log") as url, sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(**CHROMIUM_LAUNCH)
        page = browser.new_page(viewport={"width": 1400, "height": 2400})
        page.set_default_timeout(120_000)
        page.goto(f"{url}/knockout")
        page.get_by_role("heading", name="Knock-out", level=1).wait_for()
        grid = page.locator(".st-key-knockout_sweep_click .nsewdrag").first
        grid.wait_for()
        page.locator(STATUS_WIDGET).wait_for(state="hidden")
        box = grid.bounding_box()
        # The cell of layer 2, head 3: the axes run from -0.5 to 3.5 both ways, layer 0 on top.
        page.mouse.click(box["x"] + box["width"] * 3.5 / 4, box["y"] + box["height"] * 2.5 / 4)
        sync_api.expect(page.get_by_text("Top-5 with layer 2 head 3 (zero-ablated)")).to_be_visible(timeout=120_000)
        page.screenshot(path=tmp_path / "knockout_clicked.png", full_page=True)
        browser.close()
