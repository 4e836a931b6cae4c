"""python -m vit_explorer inspect reads the picture as the model's publisher does (here timm's
crop_pct: the shorter side resized, the centre cropped), and --whole-image squeezes all of it."""
from pathlib import Path

import numpy as np
import torch

import vit_explorer as vx
from vit_explorer import cli, figures

PHOTO = Path(__file__).resolve().parents[2] / "assets" / "samples" / "chelsea.png"


def test_inspect_reads_the_publishers_crop_and_the_whole_image_when_asked(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(figures, "find_browser", lambda: None)  # HTML: the same numbers, quicker
    torch.manual_seed(0)
    model = vx.ViT(vx.ViTConfig(image_size=32, patch_size=8, num_classes=4, embed_dim=32, depth=2, num_heads=2,
                                resize_mode="shortest", crop_pct=0.875))
    torch.nn.init.normal_(model.head.weight)
    vx.save_model(model, tmp_path / "cropped.safetensors")
    picture = vx.load_image(PHOTO)
    for whole, said in ((False, "the model read the picture resized to 54x36 px, its centre 32x32 px kept"),
                        (True, "the model read the whole picture squeezed to 32x32 px")):
        out = tmp_path / f"out{whole}"
        arguments = ["inspect", str(PHOTO), "--weights", str(tmp_path / "cropped.safetensors"), "--out", str(out),
                     "--format", "html", "--tensors", *(["--whole-image"] if whole else [])]
        assert cli.main(arguments) == 0
        assert said in capsys.readouterr().out
        expected = vx.capture(model, vx.preprocess(picture, model.config, whole=whole), layers=()).logits
        with np.load(out / "capture.npz") as data:
            np.testing.assert_allclose(data["logits"], expected.numpy(), atol=1e-5, rtol=1e-5)
