"""A NaFlexViT in the app: its file as timm saves it uploaded through the sidebar, a non-square picture
read at its own aspect ratio as timm's NaFlex transform sizes it, the pages that read it render, and
the Several images page reads pictures of different grids each at its own."""
import io

import numpy as np
import timm
import torch
from PIL import Image
from safetensors.torch import save_file

from apptest import errors, open_app, uploader
from helpers import randomize
from vit_explorer.weights import from_naflex


def test_a_naflex_model_reads_a_wide_picture_at_its_own_aspect_ratio(tmp_path, monkeypatch):
    monkeypatch.setattr(from_naflex, "DEFAULT_MAX_PATCHES", 24)  # a small sequence: a quick test
    reference = randomize(timm.create_model(
        "naflexvit_base_patch16_map", pretrained=False, num_classes=0, embed_dim=32, depth=2, num_heads=2,
        patch_size=8, pos_embed_grid_size=(4, 4),
    ))
    weights = tmp_path / "naflexvit_base_patch16_map.safetensors"
    save_file({key: value.contiguous() for key, value in reference.state_dict().items()}, weights)
    app = open_app("views/pipeline.py")
    uploader(app, "checkpoint_upload").set_value((weights.name, weights.read_bytes(), "application/octet-stream")).run()
    assert not app.exception and errors(app) == []
    picture = io.BytesIO()
    Image.fromarray((np.random.RandomState(0).rand(300, 451, 3) * 255).astype("uint8")).save(picture, "PNG")
    app.file_uploader(key="image_upload").set_value(("wide.png", picture.getvalue(), "image/png")).run()
    assert not app.exception and errors(app) == []
    # timm's ResizeToSequence: 451 x 300 px in at most 24 patches of 8 -> 32 x 48 px, a 4 x 6 grid.
    assert from_naflex.sequence_size(300, 451, 8, 24) == (32, 48)
    assert any("NaFlex preprocessing" in caption.value and "resized (bicubic)" in caption.value and "This picture: 32x48 px" in caption.value for caption in app.caption)
    assert any("4x6 grid" in caption.value for caption in app.caption)
    for page in ("views/attention.py", "views/patches.py", "views/images.py"):
        app.switch_page(page).run()
        assert not app.exception and errors(app) == [], page
    # Several images: the wide upload (4 x 6 patches) and a square photo (4 x 4) each read alone at its own grid.
    upload = app.multiselect(key="image_set").value[0]  # the sidebar's picture first
    assert upload.startswith("upload:")
    app.multiselect(key="image_set").set_value([upload, "photo:astronaut.png"]).run()
    assert "each picture as the model's preprocessing sizes it (its own grid)" in app.radio(key="dense_resolution").options
    app.radio(key="dense_resolution").set_value("own").run()
    assert not app.exception and errors(app) == []
    assert any("of the 40 patches are foreground" in caption.value for caption in app.caption)
