"""python -m vit_explorer train / evaluate, on one process and data-parallel under torchrun."""
import os
import socket
import subprocess
import sys

import pytest
import torch

import vit_explorer as vx
from vit_explorer.cli import main
from vit_explorer.resources import child_python_path
from vit_explorer.training.train import load_history

TINY = ["--no-augment", "--image-size", "16", "--embed-dim", "32", "--depth", "2", "--heads", "4",
        "--train-size", "64", "--test-size", "40", "--batch-size", "16", "--device", "cpu"]


def test_train_then_evaluate(tmp_path, capsys):
    assert main(["train", "--epochs", "2", "--out", str(tmp_path), *TINY]) == 0
    output = capsys.readouterr()
    checkpoint = tmp_path / "vit_shapes.safetensors"
    assert checkpoint.is_file() and (tmp_path / "vit_shapes.json").is_file()
    assert "epoch 2/2: train loss" in output.out
    summary = output.out.strip().splitlines()[-1]
    accuracy = load_history(checkpoint)["test_accuracy"]
    assert summary == f"trained in {summary.split()[2]} s: test accuracy {accuracy:.4f}, checkpoint {checkpoint}"
    model = vx.load_model(checkpoint)
    assert model.config.embed_dim == 32 and model.config.image_size == 16

    assert main(["evaluate", "--weights", str(checkpoint), "--test-size", "40", "--device", "cpu"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    # The same 40 test images as at the end of training, so the same accuracy.
    assert last == f"accuracy: {accuracy:.4f}"


@pytest.mark.parametrize("arguments, message", [
    (["train", "--dataset", "imagenet"], "error: unknown dataset 'imagenet'; choose one of shapes"),
    (["train", "--dataset", "folder:/no/such/folder", "--epochs", "1"], "error: image folder /no/such/folder does not exist"),
    (["train", "--epochs", "0"], "error: epochs must be at least 1, not 0"),
    (["train", "--patch-size", "5"], "error: image size 32x32 is not divisible by patch size 5"),
    (["train", "--lr", "-1"], "error: lr must be positive, not -1.0"),
    (["train", "--patch-sizes", "4,5,8"],
     "error: patch size 5 does not tile 32x32 images; FlexiViT patch sizes must divide the image size"),
    (["evaluate", "--weights", str(vx.training.train.DEFAULT_WEIGHTS), "--patch-size", "5"],
     "error: image size 32x32 is not divisible by patch size 5"),
    (["evaluate", "--weights", "/no/such.safetensors"], "error: "),
])
def test_bad_input_is_one_line_and_exit_code_2(arguments, message, capsys, tmp_path):
    assert main([*arguments, "--device", "cpu"] + (["--out", str(tmp_path)] if arguments[0] == "train" else [])) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith(message) and len(error.splitlines()) == 1


@pytest.mark.parametrize("name", ["../../x", "absolute", "runs/x", "..", ".", "a\\b", "x\0"])
def test_a_run_name_that_is_not_a_plain_file_name_is_refused(name, tmp_path, capsys):
    out = tmp_path / "a" / "b"
    if name == "absolute":
        name = str(tmp_path / "x")
    assert main(["train", "--name", name, "--out", str(out), *TINY, "--epochs", "1"]) == 2
    error = capsys.readouterr().err.strip()
    assert error == (
        f"error: the run name {name!r} must be a plain file name, without /, \\ or .."
        " (its files go in the output folder)"
    )
    assert list(tmp_path.rglob("*")) == []  # nothing written, inside --out or beside it
    # The library refuses it too, before any path is made from it.
    with pytest.raises(vx.training.train.TrainingError, match="must be a plain file name"):
        vx.training.train.checkpoint_paths(vx.TrainConfig(out_dir=str(out), name=name))


def test_a_plain_run_name_names_the_checkpoint(tmp_path):
    paths = vx.training.train.checkpoint_paths(vx.TrainConfig(out_dir=str(tmp_path), name="..my run.v2"))
    assert paths["checkpoint"] == tmp_path / "..my run.v2.safetensors"


def test_patch_sizes_are_parsed_and_a_bad_list_is_refused(capsys):
    from vit_explorer.cli.train import _patch_sizes

    assert _patch_sizes("4,8,16") == (4, 8, 16) and _patch_sizes("8, 4,") == (8, 4) and _patch_sizes(" ") is None
    with pytest.raises(SystemExit):
        main(["train", "--patch-sizes", "4,eight"])
    assert "'4,eight' is not a list of patch sizes" in capsys.readouterr().err


def test_flexivit_training_then_evaluate_at_any_patch_size(tmp_path, capsys):
    assert main(["train", "--epochs", "1", "--out", str(tmp_path), *TINY, "--patch-sizes", "2,8"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-2].startswith("  at patch 2: test accuracy") and lines[-1].startswith("  at patch 8: test accuracy")
    checkpoint = tmp_path / "vit_shapes.safetensors"
    by_size = load_history(checkpoint)["test_accuracy_by_patch_size"]
    for patch in (2, 8):  # the same 40 test images as at the end of training
        assert main(["evaluate", "--weights", str(checkpoint), "--test-size", "40", "--device", "cpu",
                     "--patch-size", str(patch)]) == 0
        first, last = capsys.readouterr().out.strip().splitlines()[-2:]
        assert f"patch {patch} ({16 // patch}x{16 // patch} grid)" in first
        assert last == f"accuracy: {by_size[str(patch)]:.4f}"
    # Another image size too: the position embeddings are resampled to the larger grid.
    assert main(["evaluate", "--weights", str(checkpoint), "--test-size", "40", "--device", "cpu",
                 "--image-size", "32"]) == 0
    first, last = capsys.readouterr().out.strip().splitlines()[-2:]
    assert "at 32x32 px, patch 8 (4x4 grid)" in first and last.startswith("accuracy: ")


def test_rotary_positions_train_and_evaluate_at_another_image_size(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["train", "--positions", "sincos"])
    assert "invalid choice: 'sincos'" in capsys.readouterr().err
    assert main(["train", "--epochs", "1", "--out", str(tmp_path), *TINY, "--positions", "rotary"]) == 0
    checkpoint = tmp_path / "vit_shapes.safetensors"
    assert load_history(checkpoint)["train_config"]["positions"] == "rotary"
    capsys.readouterr()
    code = main(["evaluate", "--weights", str(checkpoint), "--test-size", "40", "--device", "cpu", "--image-size", "32"])
    output = capsys.readouterr()
    first, last = output.out.strip().splitlines()[-2:]
    assert code == 0 and "at 32x32 px, patch 8 (4x4 grid)" in first and last.startswith("accuracy: ")


def test_evaluate_refuses_a_model_for_other_classes(tmp_path, capsys, monkeypatch):
    model = vx.ViT(vx.ViTConfig(image_size=16, patch_size=4, num_classes=3, embed_dim=32, depth=1, num_heads=4))
    vx.save_model(model, tmp_path / "three.safetensors")
    assert main(["evaluate", "--weights", str(tmp_path / "three.safetensors"), "--device", "cpu"]) == 2
    assert "the model knows 3 classes, but shapes has circle" in capsys.readouterr().err


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("flexi", [[], ["--patch-sizes", "2,4,8"]], ids=["plain", "flexivit"])
def test_data_parallel_under_torchrun(tmp_path, flexi):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": child_python_path()}
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
        f"--master_port={_free_port()}", "-m", "vit_explorer", "train", "--epochs", "2",
        "--out", str(tmp_path), *TINY, *flexi,
    ]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    # One report (rank 0 only) and one checkpoint.
    assert result.stdout.count("trained in") == 1 and result.stdout.count("epoch 2/2: train loss") == 1
    assert sorted(path.name for path in tmp_path.iterdir()) == ["vit_shapes.json", "vit_shapes.safetensors"]
    if flexi:
        assert result.stdout.count("at patch 2: test accuracy") == 1
    # 64 images in global batches of 2 x 16: two steps per epoch.
    assert load_history(tmp_path / "vit_shapes.safetensors")["total_steps"] == 4

    # Each step averages the gradients of the two halves of a global batch, so two processes
    # with 16 images each train as one process with the same 32 images, up to summation order
    # (which AdamW's normalisation amplifies for near-zero gradients, hence 5e-5).
    single = tmp_path / "single"
    assert main(["train", "--epochs", "2", "--out", str(single), *TINY, *flexi, "--batch-size", "32"]) == 0
    parallel, alone = (vx.load_model(path / "vit_shapes.safetensors") for path in (tmp_path, single))
    for (name, a), b in zip(parallel.state_dict().items(), alone.state_dict().values()):
        assert torch.allclose(a, b, atol=5e-5), name
