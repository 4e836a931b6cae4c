"""A model's memory from its files' headers alone (weights/footprint.py) and the admission that
refuses one that would not fit before anything is allocated (training/admission.admit_model)."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import vit_explorer as vx
from vit_explorer.cli import main
from vit_explorer.resources import child_python_path
from vit_explorer.training import admission
from vit_explorer.weights import footprint as footprints
from vit_explorer.weights.footprint import Footprint, model_footprint

from test_catalogue import sparse_safetensors as sparse_file

ROOT = Path(__file__).resolve().parents[2]
# SigLIP So400m/14 at 378 px: timm's vit_so400m_patch14_siglip_378 (num_classes=0)
SO400M = vx.ViTConfig(
    image_size=378, patch_size=14, embed_dim=1152, depth=27, num_heads=16, mlp_ratio=4304 / 1152, num_classes=0,
    class_token=False, global_pool="map",
)


def sparse_safetensors(path: Path, config: vx.ViTConfig) -> int:
    """A safetensors file of ``config``'s float32 tensors whose data is a hole (nothing on disk,
    zeros if read), as a So400m's header would claim them; returns its parameters' count."""
    with torch.device("meta"):
        shapes = {key: tuple(value.shape) for key, value in vx.ViT(config).state_dict().items()}
    sparse_file(path, shapes)
    return sum(math.prod(shape) for shape in shapes.values())


def status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def test_a_so400m_is_refused_in_a_sentence_before_its_loader_runs(tmp_path, monkeypatch):
    path = tmp_path / "so400m.safetensors"
    parameters = sparse_safetensors(path, SO400M)
    assert parameters == 428_225_600  # timm's, counted on the meta device
    loaded = []
    monkeypatch.setattr(vx.weights, "load_model", lambda *args, **kwargs: loaded.append(args))
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM from here
    before = status("VmRSS")
    estimate = model_footprint(path)
    assert estimate.weights == 4 * parameters and estimate.converted == 0
    assert footprints.config_footprint(SO400M) == estimate  # a catalogue entry's, from its architecture
    with pytest.raises(vx.CheckpointError) as refused:
        admission.admit_model(estimate, models_bytes=2**30)
    assert str(refused.value) == (
        "this model holds 1.6 GB of weights in float32, more than the 1.0 GB this server keeps for its shared"
        " models; choose a smaller model, or raise VIT_EXPLORER_MODELS_MB where the machine has the memory"
    )
    monkeypatch.setattr(admission, "available_memory", lambda: 7 * 2**28)
    with pytest.raises(vx.CheckpointError, match=r"about 2\.0 GB of memory to load \(1\.6 GB of weights in float32\), more than the 1\.8 GB this machine"):
        admission.admit_model(estimate, models_bytes=8 * 2**30)
    assert loaded == [] and status("VmHWM") - before < 32 * 2**20  # the 1.6 GB were never touched
    admission.admit_model(Footprint(weights=100 * 2**20, converted=0), models_bytes=2**30)  # a small one is admitted


def test_the_cli_refuses_it_before_reading_it(tmp_path, monkeypatch, capsys):
    path = tmp_path / "so400m.safetensors"
    sparse_safetensors(path, SO400M)
    monkeypatch.setattr(admission, "available_memory", lambda: 2**30)
    monkeypatch.setattr(vx.weights, "load_model", lambda *args: pytest.fail("the loader ran"))
    assert main(["inspect", str(ROOT / "assets/samples/chelsea.png"), "--weights", str(path), "--out", str(tmp_path / "out"), "--format", "html"]) == 2
    error = capsys.readouterr().err
    assert error.startswith("error: the model of --weights would need about 2.0 GB of memory to load") and error.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_a_vlm_folder_is_sized_by_its_tower_alone(tmp_path):
    """Its language model's shard is no safetensors at all: never opened; bfloat16 is read as
    float32 one tensor at a time (half their bytes counted for what the allocator keeps)."""
    tower = {
        "model.vision_tower.embeddings.patch_embedding.weight": torch.zeros(64, 3, 8, 8, dtype=torch.bfloat16),
        "model.vision_tower.encoder.layers.0.mlp.fc1.weight": torch.zeros(128, 64, dtype=torch.bfloat16),
    }
    save_file(tower, tmp_path / "vision.safetensors")
    save_file({"model.vision_tower.post_layernorm.weight": torch.zeros(64)}, tmp_path / "more.safetensors")
    (tmp_path / "language.safetensors").write_bytes(b"not the language model")
    weight_map = {key: "vision.safetensors" for key in tower}
    weight_map.update({"model.vision_tower.post_layernorm.weight": "more.safetensors",
                       "model.language_model.embed_tokens.weight": "language.safetensors"})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    vision = dict(model_type="clip_vision_model", hidden_size=64, image_size=32, patch_size=8)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llava", "vision_config": vision}))
    assert model_footprint(tmp_path) == Footprint(weights=4 * (64 * 3 * 8 * 8 + 128 * 64 + 64), converted=(2 * (64 * 3 * 8 * 8 + 128 * 64)) // 2)
    weight_map["model.vision_tower.post_layernorm.weight"] = "../elsewhere.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(vx.CheckpointError, match="leads outside the model folder"):
        model_footprint(tmp_path)


def test_a_pytorch_file_is_sized_by_its_members_and_a_pickle_left_to_its_loader(tmp_path):
    tensors = {"weight": torch.zeros(1000, 100)}
    torch.save(tensors, tmp_path / "model.pth")
    sized = model_footprint(tmp_path / "model.pth")
    assert 400_000 <= sized.weights < 401_000 and sized.converted == 0  # the data member, its pickle
    (tmp_path / "old.pth").write_bytes(b"\x80\x02}q\x00.")
    assert model_footprint(tmp_path / "old.pth") is None and model_footprint(tmp_path / "missing") is None


MEASURE = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    import torch
    from vit_explorer.weights import load_model
    from vit_explorer.weights.footprint import model_footprint

    def status(field):
        return next(int(line.split()[1]) * 1024 for line in Path("/proc/self/status").read_text().splitlines()
                    if line.startswith(field + ":"))

    load_model(sys.argv[2])  # the loaders' imports, before the measure
    estimate = model_footprint(sys.argv[1]).peak
    before = status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    model = load_model(sys.argv[1])
    with torch.no_grad():  # every weight read once, as a first view does
        [parameter.float().sum() for parameter in model.parameters()]
    print(json.dumps([estimate, status("VmHWM") - before]))
""")


def test_the_estimate_is_within_1_3x_of_the_measured_peak(tmp_path):
    """A float16 timm file of 41 MB in float32: its tensors as stored beside their float32
    copies, measured in a process of its own (VmHWM)."""
    config = vx.ViTConfig(image_size=64, patch_size=16, embed_dim=384, depth=6, num_heads=6, num_classes=0)
    torch.manual_seed(0)
    save_file({key: value.half() for key, value in vx.ViT(config).state_dict().items()}, tmp_path / "model.safetensors")
    vx.save_model(vx.ViT(config.replace(depth=1, embed_dim=32, num_heads=2)), tmp_path / "tiny.safetensors")
    script = tmp_path / "measure.py"
    script.write_text(MEASURE)
    result = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "model.safetensors"), str(tmp_path / "tiny.safetensors")],
        capture_output=True, text=True, cwd=ROOT, timeout=120, check=True,
        env={**os.environ, "PYTHONPATH": child_python_path()},
    )
    estimate, measured = json.loads(result.stdout.strip().splitlines()[-1])
    print(f"estimate {estimate / 2**20:.1f} MiB, measured {measured / 2**20:.1f} MiB")
    assert measured / 1.05 <= estimate <= 1.3 * measured, (estimate, measured)


def test_a_clip_folder_is_sized_as_its_two_towers(tmp_path):
    """A Hugging Face CLIP folder: the image tower (load_model) and the text tower
    (vit_explorer.text), each its own tensors, in float16 as converted."""
    from textmodels import hf_clip_folder

    small = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2}
    model = hf_clip_folder(tmp_path, text={**small, "vocab_size": 1000}, vision={**small, "image_size": 32, "patch_size": 8},
                           projection_dim=16, tokenizer=False)
    model.half().save_pretrained(str(tmp_path))
    state = model.state_dict()

    def counted(*prefixes):
        values = sum(value.numel() for key, value in state.items() if key.startswith(prefixes) and value.is_floating_point())
        return Footprint(weights=4 * values, converted=2 * values)

    assert model_footprint(tmp_path) == counted("vision_model.")
    assert footprints.text_footprint(tmp_path) == counted("text_model.", "text_projection")
    assert footprints.text_footprint(tmp_path / "model.safetensors") is None
