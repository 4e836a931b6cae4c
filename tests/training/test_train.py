"""The training engine: events, checkpoints, resume, the background TrainingRun."""
import json
import math
import threading

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import vit_explorer as vx
from vit_explorer.training import evaluation
from vit_explorer.training import train as training
from vit_explorer.training import run as training_run
from vit_explorer.model.config import TrainConfig
from vit_explorer.data.datasets import SHAPE_CLASSES, shapes_dataset
from helpers import SMALL_RUN_MODEL, small_run_config

SMALL_MODEL = SMALL_RUN_MODEL


def small_config(tmp_path, **changes) -> TrainConfig:
    return small_run_config(tmp_path, **{"epochs": 2, **changes})


def test_train_config_json_round_trip():
    config = TrainConfig(model=SMALL_MODEL, dataset="folder:/data/pets", epochs=3, lr=1e-3)
    again = TrainConfig.from_json(config.to_json())
    assert again == config and isinstance(again.model, vx.ViTConfig)
    assert TrainConfig.from_json(TrainConfig().to_json()) == TrainConfig()


def test_train_config_positions_round_trip_and_old_sidecars_are_learned():
    rotary = TrainConfig(model=SMALL_MODEL, positions="rotary")
    assert TrainConfig.from_json(rotary.to_json()) == rotary
    old = TrainConfig().to_dict()
    del old["positions"]  # a sidecar written before runs could choose
    assert TrainConfig.from_dict(old).positions == "learned"
    learned = training.model_config(TrainConfig())
    assert learned.abs_pos_embed and learned.rope_type is None
    model = training.model_config(rotary)
    assert not model.abs_pos_embed and model.rope_type == "dinov3"
    assert model.replace(abs_pos_embed=True, rope_type=None) == SMALL_MODEL  # nothing else changes


@pytest.mark.parametrize("changes, message", [
    (dict(model="huge"), "unknown model preset 'huge'"),
    (dict(epochs=0), "epochs must be at least 1, not 0"),
    (dict(lr=-1.0), "lr must be positive"),
    (dict(device="tpu"), "device must be auto, cpu, cuda or mps"),
    (dict(positions="sincos"), "positions must be learned or rotary, not 'sincos'"),
])
def test_train_config_rejects_bad_values(changes, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**changes)


def test_learning_rate_warms_up_then_decays_to_zero():
    config = TrainConfig(lr=1e-3, warmup_steps=10)
    rates = [training.learning_rate(step, 100, config) for step in range(100)]
    assert rates[0] == pytest.approx(1e-4) and rates[9] == pytest.approx(1e-3)
    assert all(a >= b for a, b in zip(rates[9:], rates[10:]))  # monotonic cosine decay
    assert rates[-1] < 1e-6


def test_event_stream(tmp_path):
    config = small_config(tmp_path)
    events = list(training.train(config))
    steps = [e for e in events if isinstance(e, training.StepEvent)]
    epochs = [e for e in events if isinstance(e, training.EpochEvent)]
    snapshots = [e for e in events if isinstance(e, training.SnapshotEvent)]
    done = events[-1]
    assert isinstance(done, training.DoneEvent) and not done.stopped
    assert [e.step for e in steps] == list(range(1, 9))  # 64 images / 16 per batch * 2 epochs
    assert all(e.total_steps == 8 and 0 <= e.accuracy <= 1 and e.images_per_s > 0 for e in steps)
    assert [e.epoch for e in steps] == [1] * 4 + [2] * 4
    assert [(e.epoch, e.epochs) for e in epochs] == [(1, 2), (2, 2)]
    assert done.test_accuracy == epochs[-1].test_accuracy

    # Snapshots before training, every 3 steps, and at the end.
    assert [s.step for s in snapshots] == [0, 3, 6, 8]
    snapshot = snapshots[-1]
    assert snapshot.image.shape == (16, 16, 3) and snapshot.image.dtype == np.uint8
    assert snapshot.attentions.shape == (1, 2, 4, 17, 17) and snapshot.attentions.dtype == torch.float32
    assert torch.allclose(snapshot.attentions.sum(-1), torch.ones(1, 2, 4, 17))
    assert snapshot.grid_size == (4, 4) and snapshot.num_prefix_tokens == 1
    assert snapshot.prediction in SHAPE_CLASSES and sum(snapshot.probabilities) == pytest.approx(1)

    # The checkpoint is the trained model, with the dataset's classes, and its history beside it.
    model = vx.load_model(done.checkpoint)
    assert model.config.class_names == SHAPE_CLASSES and model.config.std == (0.25, 0.25, 0.25)
    sidecar = training.load_history(done.checkpoint)
    assert sidecar["finished"] and TrainConfig.from_dict(sidecar["train_config"]) == config
    assert [e["epoch"] for e in sidecar["history"]["epochs"]] == [1, 2]
    assert not training.checkpoint_paths(config)["state"].exists()  # nothing left to resume


def test_training_learns(tmp_path):
    # 320 steps on fresh shapes images (a new slice of the stream every epoch): the model does far
    # better than chance (ln 6, 1/6) on test images it never saw.
    config = small_config(
        tmp_path, train_size=2048, batch_size=64, epochs=10, lr=5e-3, test_size=500, snapshot_every=0
    )
    events = list(training.train(config))
    steps = [e for e in events if isinstance(e, training.StepEvent)]
    assert steps[0].loss == pytest.approx(math.log(6), abs=0.05)  # the small head starts near uniform
    assert steps[-1].loss < 1.3 and events[-1].test_accuracy > 0.5


def test_a_rotary_run_trains_and_its_checkpoint_loads(tmp_path):
    config = small_config(tmp_path, positions="rotary", epochs=1)
    events = list(training.train(config))
    done = events[-1]
    assert isinstance(done, training.DoneEvent) and 0 <= done.test_accuracy <= 1
    snapshot = [e for e in events if isinstance(e, training.SnapshotEvent)][-1]
    assert torch.allclose(snapshot.attentions.sum(-1), torch.ones(1, 2, 4, 17))
    with safe_open(done.checkpoint, "pt") as saved:
        assert "pos_embed" not in saved.keys()  # rotary positions have no parameters
    sidecar = training.load_history(done.checkpoint)
    assert TrainConfig.from_dict(sidecar["train_config"]).positions == "rotary"
    model = vx.load_model(done.checkpoint)
    assert model.pos_embed is None and model.config.rope_type == "dinov3"
    assert model.config.class_names == SHAPE_CLASSES


def _trained(config: TrainConfig) -> tuple[vx.ViT, float]:
    """A finished run's model (read straight from its file: load_model may not know rotary
    checkpoints yet) and its final test accuracy."""
    done = list(training.train(config))[-1]
    model = vx.ViT(training.model_config(config, shapes_dataset(1)))
    model.load_state_dict(load_file(done.checkpoint))
    return model.eval(), done.test_accuracy


@pytest.mark.parametrize("positions", ["learned", "rotary"])
def test_accuracy_by_image_size(tmp_path, positions):
    config = small_config(tmp_path, positions=positions, epochs=3, snapshot_every=0)
    model, accuracy = _trained(config)
    state = {name: value.clone() for name, value in model.state_dict().items()}
    by_size = evaluation.accuracy_by_image_size(model, "shapes", [16, (24, 24)], test_size=config.test_size)
    assert list(by_size) == [(16, 16), (24, 24)]
    assert by_size[16, 16] == accuracy  # its own size: the run's own test images and number
    assert 0 <= by_size[24, 24] <= 1 and by_size[24, 24] * 32 == round(by_size[24, 24] * 32)
    assert model.config.image_size == 16 and all(torch.equal(state[k], v) for k, v in model.state_dict().items())

    larger = evaluation.at_image_size(model, 24)
    assert larger.config.grid_size == (6, 6) and larger.config.rope_type == model.config.rope_type
    assert larger.patch_embed.proj.weight.data_ptr() == model.patch_embed.proj.weight.data_ptr()  # shared
    assert (larger.pos_embed is None) == (positions == "rotary")
    if positions == "learned":  # resampled to the 6x6 grid; rotary positions need nothing
        assert larger.pos_embed.shape == (1, 37, 32)


def test_scaled_image_sizes_are_whole_patches():
    config = vx.ViTConfig(image_size=(32, 48), patch_size=8)
    assert evaluation.scaled_image_sizes(config) == [(32, 48), (48, 72), (64, 96)]
    assert evaluation.scaled_image_sizes(config, (0.1, 1.2)) == [(8, 8), (40, 56)]


def test_resume_continues_exactly(tmp_path):
    straight = list(training.train(small_config(tmp_path / "straight")))[-1]

    config = small_config(tmp_path / "split")
    stop = threading.Event()
    for event in training.train(config, stop=stop):
        if isinstance(event, training.StepEvent) and event.step == 3:
            stop.set()  # mid-epoch 1
    assert event.stopped and training.checkpoint_paths(config)["state"].exists()
    events = list(training.train(config.replace(resume=True)))
    steps = [e.step for e in events if isinstance(e, training.StepEvent)]
    assert steps == list(range(5, 9))  # 4 was finished before the stop took effect
    resumed = events[-1]
    a, b = vx.load_model(straight.checkpoint), vx.load_model(resumed.checkpoint)
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.allclose(x, y, atol=1e-6), name
    history = training.load_history(resumed.checkpoint)["history"]
    assert [e["step"] for e in history["steps"]] == list(range(1, 9))


def test_resume_errors(tmp_path):
    config = small_config(tmp_path, epochs=1, snapshot_every=0)
    with pytest.raises(training.TrainingError, match="no interrupted run to resume"):
        list(training.train(config.replace(resume=True)))
    list(training.train(config))
    with pytest.raises(training.TrainingError, match="is a finished run"):
        list(training.train(config.replace(resume=True)))


def test_training_run_stop_leaves_a_loadable_checkpoint(tmp_path):
    run = training_run.TrainingRun(small_config(tmp_path, epochs=200, snapshot_every=5))
    assert run.status == "pending"
    run.start()
    while not run.history["steps"] and run.join(0.05) is False:
        pass
    assert run.status == "running" and 0 < run.progress < 1
    run.stop()
    assert run.join(60)
    assert run.status == "stopped" and run.error is None
    model = vx.load_model(run.checkpoint)
    assert model.config.class_names == SHAPE_CLASSES
    assert run.latest_snapshot is not None and run.latest_snapshot.attentions.shape[1] == 2
    assert 0 <= run.test_accuracy <= 1


def test_training_run_failure_is_reported_not_raised(tmp_path):
    run = training_run.TrainingRun(small_config(tmp_path, dataset=f"folder:{tmp_path / 'nowhere'}"))
    run.start()
    assert run.join(60)
    assert run.status == "failed"
    assert run.error == f"image folder {tmp_path / 'nowhere'} does not exist"
    assert run.checkpoint is None


def test_diverging_loss_fails_with_a_sentence(tmp_path, monkeypatch):
    diverged = lambda self, x, patch_size=None: self.forward_head(self.forward_features(x)) * math.nan  # noqa: E731
    monkeypatch.setattr(vx.ViT, "forward", diverged)
    run = training_run.TrainingRun(small_config(tmp_path, snapshot_every=0)).start()
    assert run.join(60)
    assert run.status == "failed"
    assert run.error == "the loss became nan at step 1; lower the learning rate (now 0.002)"


def test_two_runs_side_by_side_share_nothing(tmp_path):
    runs = [
        training_run.TrainingRun(small_config(tmp_path / "a", seed=1)),
        training_run.TrainingRun(small_config(tmp_path / "b", seed=2, epochs=1)),
    ]
    for run in runs:
        run.start()
    assert all(run.join(120) for run in runs)
    assert [run.status for run in runs] == ["finished", "finished"]
    assert [len(run.history["epochs"]) for run in runs] == [2, 1]
    first, second = (vx.load_model(run.checkpoint) for run in runs)
    assert not torch.equal(first.head.weight, second.head.weight)
    # Each run's numbers are its own: the same as the sidecar it wrote.
    for run in runs:
        saved = json.loads(open(run.checkpoint.replace(".safetensors", ".json")).read())
        assert saved["history"]["epochs"] == run.history["epochs"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("compile_model", [False, True])
def test_cuda_bf16_and_compile(tmp_path, compile_model):
    config = small_config(tmp_path, device="cuda", compile=compile_model, precision="auto")
    events = list(training.train(config))
    done = events[-1]
    assert isinstance(done, training.DoneEvent) and 0 <= done.test_accuracy <= 1
    losses = [e.loss for e in events if isinstance(e, training.StepEvent)]
    assert all(math.isfinite(loss) for loss in losses)
    assert vx.load_model(done.checkpoint).config.class_names == SHAPE_CLASSES


def _record_training_patch_sizes(monkeypatch) -> list:
    """The patch_size of every training-mode forward from now on."""
    drawn, original = [], vx.ViT.forward

    def forward(self, x, patch_size=None):
        if self.training:
            drawn.append(patch_size)
        return original(self, x, patch_size)

    monkeypatch.setattr(vx.ViT, "forward", forward)
    return drawn


def test_flexivit_training_draws_a_patch_size_per_step(tmp_path, monkeypatch):
    drawn = _record_training_patch_sizes(monkeypatch)
    config = small_config(tmp_path, patch_sizes=(2, 4, 8), epochs=3, snapshot_every=0)
    events = list(training.train(config))
    assert len(drawn) == 12 and set(drawn) == {2, 4, 8}  # 4 steps per epoch, every size used
    done = events[-1]
    assert sorted(done.test_accuracy_by_patch_size) == [2, 4, 8]
    assert done.test_accuracy_by_patch_size[4] == done.test_accuracy  # 4 is the model's own size
    sidecar = training.load_history(done.checkpoint)
    assert sidecar["train_config"]["patch_sizes"] == [2, 4, 8]
    assert TrainConfig.from_dict(sidecar["train_config"]).patch_sizes == (2, 4, 8)
    assert vx.load_model(done.checkpoint).config.patch_size == 4  # the weights keep their own shape
    # The same seed draws the same sizes, as every DDP rank and a resumed run must.
    first, drawn[:] = list(drawn), []
    list(training.train(config.replace(out_dir=str(tmp_path / "again"))))
    assert drawn == first
