"""An SAE run data-parallel under torchrun, two processes on the CPU (gloo): the ranks step together
on equal shares and end with the same dictionary; rank 0 writes one dictionary and one index of
every image."""
import json
import math
import os
import socket
import subprocess
import sys

import vit_explorer as vx
from vit_explorer.features.index import load_index
from vit_explorer.features.sae import load_sae
from vit_explorer.features.train import SAETrainConfig
from vit_explorer.resources import child_python_path

from helpers import randomize, tiny_config

# Each rank reports, in a file of its own, a checksum of its dictionary as the index starts and its metrics.
SCRIPT = """
import json, os, sys
from vit_explorer.features import train

build_index = train.build_index
report = {}

def reporting(sae, *args, **kwargs):
    report["weights"] = [sae.W_dec.sum().item(), sae.W_enc.sum().item()]
    return build_index(sae, *args, **kwargs)

train.build_index = reporting
for event in train.train_sae(train.SAETrainConfig.from_json(sys.argv[1])):
    if isinstance(event, train.SAEDoneEvent):
        report["metrics"] = event.metrics
with open(f"report{os.environ['RANK']}.json", "w") as file:
    json.dump(report, file)
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_two_processes_train_one_dictionary(tmp_path):
    weights = tmp_path / "tiny.safetensors"
    model = randomize(vx.ViT(tiny_config()))
    vx.save_model(model, weights)
    out = tmp_path / "out"
    config = SAETrainConfig(weights=str(weights), layer=1, images=33, epochs=2, batch_size=64, expansion=2, k=4,
                            device="cpu", out_dir=str(out), log_every=2)
    script = tmp_path / "run_sae.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": child_python_path()}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
               f"--master_port={_free_port()}", str(script), config.to_json()]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]

    reports = [json.loads((tmp_path / f"report{rank}.json").read_text()) for rank in (0, 1)]
    assert reports[0]["weights"] == reports[1]["weights"]  # averaged gradients: the same dictionary
    assert reports[0]["metrics"] == reports[1]["metrics"]  # metrics over both ranks' tokens
    assert sorted(path.name for path in out.iterdir()) == ["sae_tiny_layer1.index.npz", "sae_tiny_layer1.safetensors"]

    _, card = load_sae(out / "sae_tiny_layer1.safetensors", model, layer=1)
    assert card["metrics"] == reports[0]["metrics"]
    assert all(math.isfinite(value) for value in card["metrics"].values())
    assert 0 < card["metrics"]["explained_variance"] < 1 and card["metrics"]["l0"] <= 4
    index = load_index(out / "sae_tiny_layer1.index.npz")
    assert index.tokens_seen == 33 * 16  # every image, the one left out of training's equal shares too
    assert set(index.images[index.images >= 0].tolist()) <= set(range(33)) and index.images.max() >= 0
