"""Every page with a rotary model (AppTest): a DINOv3-shaped one (no position embedding, 4 registers)
and an EVA-02-shaped one (position embedding and rotations, SwiGLU with its LayerNorm), tiny and
random. The pages that teach positions show the rotations with the model's own numbers.

Uses test_app's fixture (tiny default model, private runs and uploads folders) and helpers."""
import base64
import json

import numpy as np
import pytest
import torch

import vit_explorer as vx
from apptest import errors, figure_titles, open_app, tiny_default, title_matching, widget  # noqa: F401

TINY = dict(image_size=64, patch_size=16, embed_dim=64, depth=2, num_heads=2, num_classes=0)
FLAVOURS = {
    "dinov3": dict(TINY, reg_tokens=4, abs_pos_embed=False, rope_type="dinov3", init_values=1e-5),
    "eva02": dict(TINY, rope_type="cat", swiglu_mlp=True, scale_mlp=True, qkv_fused=False, mlp_ratio=4 * 2 / 3,
                  num_classes=10),
}
PAGES = ["views/pipeline.py", "views/patches.py", "views/attention.py", "views/inside.py", "views/train.py",
         "views/images.py", "views/probe.py", "views/knockout.py", "views/registers.py", "views/compare.py"]


@pytest.fixture(params=list(FLAVOURS))
def flavour(request, tiny_default, monkeypatch):
    """The app's default model is a tiny random rotary model of this flavour."""
    torch.manual_seed(0)
    weights = tiny_default.parent / f"{request.param}.safetensors"
    vx.save_model(vx.ViT(vx.ViTConfig(**FLAVOURS[request.param])), weights)
    monkeypatch.setenv("VIT_EXPLORER_DEFAULT_MODEL", str(weights))
    return request.param


def chart(app, pattern: str) -> dict:
    title = title_matching(app, pattern)
    return next(spec for spec in (json.loads(c.proto.spec) for c in app.get("plotly_chart"))
                if spec["layout"]["title"]["text"] == title)


def z_values(trace: dict) -> np.ndarray:
    z = trace["z"]
    if isinstance(z, dict):  # plotly's typed-array encoding of a numpy array
        shape = [int(size) for size in str(z["shape"]).split(",")]
        z = np.frombuffer(base64.b64decode(z["bdata"]), dtype=z["dtype"]).reshape(shape)
    return np.asarray(z, dtype=np.float64)


def texts(app) -> str:
    return " ".join(str(element.value) for kind in ("markdown", "caption", "code") for element in app.get(kind))


def test_every_page_renders(flavour):
    app = open_app()
    for page in PAGES:
        app.switch_page(page).run()
        assert not app.exception, (page, app.exception)
        assert errors(app) == [], page
        assert all(title.strip() for title in figure_titles(app)), page


def test_pipeline_says_where_positions_enter_and_draws_the_angles(flavour):
    app = open_app("views/pipeline.py")
    steps = app.dataframe[0].value
    step_6 = [step for step in steps["step"] if step.startswith("6. ")]
    angles = chart(app, "^Each patch's rotation angle, for 8 of its 16 pairs")
    assert len(angles["data"]) == 8 and z_values(angles["data"][0]).shape == (4, 4)
    assert "SwiGLU MLP 64->2x170->64" in texts(app) if flavour == "eva02" else "GELU MLP 64->256->64" in texts(app)
    if flavour == "dinov3":
        assert step_6 == ["6. Positions: nothing added (rotations in attention)"]
        title_matching(app, "^Tokens entering layer 0: patch embeddings and prefix tokens, no positions added")
    else:  # EVA-02 has both
        assert step_6 == ["6. Add position embeddings"]
        assert "also rotates its queries and keys" in texts(app)


def test_inside_shows_q_and_k_rotated_and_the_offset_figure(flavour):
    app = open_app("views/inside.py")
    widget(app.selectbox, "Query token").set_value(5).run()  # patch (1, 1) of the 4 x 4 grid
    assert not app.exception
    title_matching(app, r"^Query q and key k of patch 5, layer 1, head 0, before and after the rotation")
    offsets = chart(app, r"^The same q and k of patch 5 \(layer 1, head 0\), the key at every patch")
    assert [a["text"] for a in offsets["layout"]["annotations"]] == [
        "query at row 1, col 1 (its own patch)", "query at row 3, col 3"]
    own, moved = (z_values(trace) for trace in offsets["data"])
    # Its own key at its own patch scores what the model scored; moved, the pattern moves along.
    scores = z_values(next(t for t in chart(app, "^Scores of patch 5")["data"] if t["type"] == "heatmap"))
    np.testing.assert_allclose(own[1, 1], scores[1, 1], rtol=1e-3, atol=1e-4)
    np.testing.assert_allclose(moved[2:, 2:], own[:2, :2], rtol=1e-4, atol=1e-5)
    if flavour == "eva02":
        assert any("SiLU" in latex.value for latex in app.main.get("latex"))
        title_matching(app, "after SwiGLU$")
    # A prefix token is not rotated: its strips still show, its content placed at the centre.
    widget(app.selectbox, "Query token").set_value(-1).run()
    assert not app.exception
    title_matching(app, r"before and after the rotation \(\d+ numbers each\): a prefix token is not rotated$")
    title_matching(app, r"^The same q and k of CLS \(layer 1, head 0\)")


def test_patches_says_the_rotations_follow_any_grid(flavour):
    app = open_app("views/patches.py")
    said = " ".join(element.value for element in app.markdown)
    assert "the rotary coordinates simply follow the new grid" in said
    if flavour == "dinov3":
        assert "(no position embedding to resample)" in said and "This model learned no position embeddings" in said
    else:
        assert "the position embeddings interpolated and the rotary coordinates" in said
        title_matching(app, "^Position embedding similarity")
    widget(app.select_slider, "Patch size").set_value(8).run()
    assert not app.exception and errors(app) == []
    app.switch_page("views/pipeline.py").run()
    assert z_values(chart(app, "^Each patch's rotation angle")["data"][0]).shape == (8, 8)
