"""The app at high resolution: a DINOv2-with-registers-shaped model at its own 518 px (1,374
tokens) and a DINOv3-shaped one at 768 x 768 px (2,309 tokens) open on every page without an
error, and a view holds no more than the per-view bound (models.view_bytes) in the shared cache.
Shallow (depth 2), so that the test stays quick: the memory a view holds grows with the tokens."""
import pytest
import torch

import vit_explorer as vx
from vit_explorer.app import memo, models

from apptest import errors, open_app, tiny_default, widget  # noqa: F401

VIT_S = dict(embed_dim=384, depth=2, num_heads=6, num_classes=0)
SHAPED = {
    "DINOv2 ViT-S/14 with registers at 518 px": dict(
        image_size=518, patch_size=14, reg_tokens=4, no_embed_class=True, init_values=1e-5, **VIT_S,
    ),
    "DINOv3 ViT-S/16 at 768 px": dict(
        image_size=768, patch_size=16, reg_tokens=4, qkv_bias=False, init_values=1e-5, rope_type="dinov3",
        abs_pos_embed=False, layer_norm_eps=1e-5, **VIT_S,
    ),
}
TOKENS = {"DINOv2 ViT-S/14 with registers at 518 px": 1374, "DINOv3 ViT-S/16 at 768 px": 2309}
# Pages that hold two models' or two passes' views side by side.
PAIRS = {"views/compare.py", "views/knockout.py", "views/registers.py"}
PAGES = [
    "views/pipeline.py", "views/patches.py", "views/attention.py", "views/inside.py", "views/images.py",
    "views/knockout.py", "views/registers.py", "views/compare.py",
]


@pytest.fixture(params=list(SHAPED))
def shaped(request, tiny_default, monkeypatch):  # noqa: F811
    """The app's default model is that shape, random weights; its config."""
    torch.manual_seed(0)
    model = vx.ViT(vx.ViTConfig(**SHAPED[request.param])).eval()
    if model.pos_embed is None:  # handed to the app's model cache: reading a rotary file is the loader's part
        models.shared_models().get_or_compute(("base", models.DEFAULT_MODEL), lambda: model)
    else:
        vx.save_model(model, tiny_default)
    assert model.config.num_tokens == TOKENS[request.param]
    return model.config


def test_every_page_opens_at_high_resolution_within_the_view_bound(shaped):
    assert models.image_size_problem(shaped, shaped.img_size) is None
    bound = models.view_bytes(shaped)
    assert bound <= models.MAX_VIEW_BYTES
    held = {}
    for page in PAGES:
        memo.shared_results().clear()  # what this page's view holds, from nothing
        app = open_app(page)
        if page == "views/knockout.py":  # a knock-out, so that the knocked pass's layers are drawn too
            widget(app.multiselect, "Layer 0").set_value([1]).run()
            assert not app.exception
        assert errors(app) == [], (page, errors(app))
        assert not any("choose a smaller size" in error.value for error in app.sidebar.error)
        held[page] = memo.shared_results().total_bytes
        assert held[page] <= bound * (2 if page in PAIRS else 1), (page, held[page] / 2**20, bound / 2**20)
    print({page: f"{value / 2**20:.0f} MiB" for page, value in held.items()}, f"bound {bound / 2**20:.0f} MiB")


def test_a_size_past_the_view_bound_is_refused_in_one_sentence(shaped):
    app = open_app("views/attention.py")
    height, width = shaped.img_size
    taller = next(side for side in range(height, 4000, shaped.patch_size)
                  if models.image_size_problem(shaped, (side, width)) is not None)
    app.number_input(key="input_height").set_value(taller).run()
    (error,) = errors(app)
    assert error.count(". ") == 1  # the refusal, then which size is shown instead
    assert f"At {taller}x{width} px this model has" in error and "choose a smaller size" in error
    assert not app.exception
