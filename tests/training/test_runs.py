"""Runs of a shared server: training in a process of its own, admission, the queue, owners."""
import json
import logging
import os
import shutil
import signal

import pytest
import torch

import vit_explorer as vx
from vit_explorer.training import admission
from vit_explorer.training import runs
from vit_explorer.training import run as training_run
from vit_explorer.training import train as training
from vit_explorer.model.config import TrainConfig
from vit_explorer.features.train import SAETrainConfig
from helpers import SMALL_RUN_MODEL, randomize, small_run_config, tiny_config

SMALL_MODEL = SMALL_RUN_MODEL
PLENTY = admission.Limits(max_runs=1, queue_size=2, memory=64 * admission.GB, threads=1)


def small_config(tmp_path, **changes) -> TrainConfig:
    return small_run_config(tmp_path, **{"epochs": 1, **changes})


def wait_for_a_step(run: training_run.TrainingRun) -> None:
    while not run.history["steps"] and not run.join(0.05):
        pass
    assert run.status == "running", run.error


@pytest.mark.parametrize("changes", [
    dict(model="tiny", train_size=512, test_size=200, batch_size=64),  # the app's default model
    dict(  # 257 tokens: attention-heavy
        model=vx.ViTConfig(image_size=32, patch_size=2, embed_dim=64, depth=2, num_heads=4),
        train_size=256, test_size=500, batch_size=32,
    ),
])
def test_a_process_run_streams_its_events_and_stays_under_its_estimate(tmp_path, changes):
    config = small_config(tmp_path, image_size=None, **changes)
    run = training_run.TrainingRun(config, process=True, memory_limit=4 * admission.GB).start()
    assert run.join(120) and run.status == "finished", run.error
    assert run.pid != os.getpid()
    steps = run.history["steps"]
    assert steps[-1]["step"] == steps[-1]["total_steps"] and len(run.history["epochs"]) == 1
    snapshot = run.latest_snapshot
    assert isinstance(snapshot.attentions, torch.Tensor) and snapshot.attentions.dtype == torch.float32
    assert torch.allclose(snapshot.attentions.sum(-1), torch.ones(1))
    assert vx.load_model(run.checkpoint).config.num_classes == len(vx.SHAPE_CLASSES)
    # The estimate bounds the process's measured peak (VmHWM), and not absurdly loosely.
    estimate = admission.estimate_memory(config).total
    print(f"estimate {estimate / 2**20:.0f} MB, measured peak {run.peak_rss / 2**20:.0f} MB")
    assert run.peak_rss <= estimate <= 2 * run.peak_rss


OUT_OF_MEMORY = (
    "the run's process was ended by the operating system, most likely for lack of memory;"
    " lower the batch size, use a larger patch size (fewer tokens) or a smaller model"
)


def test_a_run_process_killed_from_outside_fails_alone_and_is_not_blamed_on_memory(tmp_path):
    run = training_run.TrainingRun(small_config(tmp_path, epochs=500), process=True, memory_limit=16 * admission.GB).start()
    wait_for_a_step(run)
    os.kill(run.pid, signal.SIGKILL)  # someone ends it, well within its memory
    assert run.join(60)
    assert run.status == "failed" and run.checkpoint is None
    assert run.error.startswith("the run's process was killed from outside after using ")
    assert run.error.endswith(" of the 16.0 GB it may use, not for lack of memory; it can be started again")


def test_a_run_process_killed_at_its_memory_limit_is_blamed_on_memory(tmp_path):
    limit = 100 * 2**20  # less than torch alone holds: the process outgrows it while it starts
    run = training_run.TrainingRun(small_config(tmp_path, epochs=500), process=True, memory_limit=limit).start()
    while (run.peak_rss or 0) < limit and not run.join(0.05):
        pass
    assert run.status == "running", run.error
    os.kill(run.pid, signal.SIGKILL)  # what the kernel's OOM killer does to a process beyond its memory
    assert run.join(60)
    assert run.status == "failed" and run.error == OUT_OF_MEMORY and run.peak_rss >= limit


def test_a_kill_is_blamed_on_memory_when_the_kernel_counted_one_or_the_run_was_near_its_limit():
    killed, within = -signal.SIGKILL, dict(peak_rss=2**30, memory_limit=16 * 2**30)
    assert training_run.exit_sentence(killed, **within, oom_killed=True) == OUT_OF_MEMORY
    assert training_run.exit_sentence(killed, peak_rss=15 * 2**30, memory_limit=16 * 2**30, oom_killed=False) == OUT_OF_MEMORY
    assert training_run.exit_sentence(killed, **within, oom_killed=False) == (
        "the run's process was killed from outside after using 1.0 GB of the 16.0 GB it may use,"
        " not for lack of memory; it can be started again"
    )
    # Without the kernel's count (no /proc/vmstat), a kill well within the limit could be either.
    assert training_run.exit_sentence(killed, **within).startswith(
        "the run's process was killed, from outside or for lack of memory; if it was memory, lower the batch size"
    )


def test_a_run_beyond_its_memory_limit_fails_inside_its_process(tmp_path):
    config = small_config(tmp_path, model="tiny", image_size=None, batch_size=512, train_size=1024)
    run = training_run.TrainingRun(config, process=True, memory_limit=100 * 2**20).start()
    assert run.join(60)
    assert run.status == "failed"
    assert run.error.startswith("the run needed more memory than it may use; lower the batch size")


def test_stopping_a_process_run_writes_its_checkpoint(tmp_path):
    config = small_config(tmp_path, epochs=500)
    run = training_run.TrainingRun(config, process=True).start()
    wait_for_a_step(run)
    # Another server following the same process sees the stop asked through its file at once,
    # before the run has ended (a page says "stopping" rather than nothing).
    follower = training_run.TrainingRun(config).follow(run.pid, training_run.process_identity(run.pid)[1])
    assert not run.stop_requested and not follower.stop_requested
    run.stop()
    assert run.stop_requested and follower.stop_requested
    assert run.join(60) and run.status == "stopped", run.error
    assert follower.join(60) and follower.status == "stopped" and not follower.stop_requested
    assert vx.load_model(run.checkpoint).config.class_names == vx.SHAPE_CLASSES
    assert not training.load_history(run.checkpoint)["finished"]


def test_the_issue_config_is_refused_before_any_allocation(tmp_path, monkeypatch):
    def no_run(*args, **kwargs):
        raise AssertionError("a refused config must not get as far as a run")

    monkeypatch.setattr(runs, "TrainingRun", no_run)
    manager = runs.RunManager(tmp_path, admission.Limits(max_runs=1, queue_size=1, memory=8 * admission.GB, threads=1))
    huge = vx.ViTConfig(image_size=32, patch_size=1, embed_dim=1024, depth=24, num_heads=16)
    with pytest.raises(admission.RunRefused) as refusal:
        manager.launch(TrainConfig(model=huge, batch_size=4096, device="cpu"), owner="alice")
    sentence = str(refusal.value)
    assert sentence.startswith("This run would need about ") and "more than the 8.0 GB a run may use" in sentence
    assert "lower the batch size (4096), use a larger patch size (patch 1 gives 1025 tokens" in sentence
    assert sentence.endswith("or a smaller dim or depth (1024, 24).")
    assert manager.runs() == {}


def test_the_estimate_grows_with_what_costs_memory():
    base = TrainConfig(model=SMALL_MODEL, device="cpu")
    total = lambda **changes: admission.estimate_memory(base.replace(**changes)).total  # noqa: E731
    assert total(batch_size=256) > total(batch_size=64)
    assert total(model=SMALL_MODEL.replace(patch_size=2)) > total()
    assert total(model=SMALL_MODEL.replace(embed_dim=256)) > total()
    # A SwiGLU MLP (three matrices, four hidden-wide activations) costs more than a plain one of its width.
    assert total(model=SMALL_MODEL.replace(swiglu_mlp=True, swiglu_align_to=8)) > total()
    assert total(train_size=100_000) > total()


def test_a_flexivit_run_is_estimated_and_admitted_at_its_smallest_patch_size():
    flexi = TrainConfig(model="small", patch_sizes=(1, 4), device="cpu")
    at_patch_1 = TrainConfig(model=vx.ViTConfig(image_size=32, **{**vx.model.config.PRESETS["small"], "patch_size": 1}),
                             device="cpu")
    assert admission.estimate_memory(flexi).activations == admission.estimate_memory(at_patch_1).activations
    limits = admission.Limits(max_runs=1, queue_size=1, memory=4 * admission.GB, threads=1)
    with pytest.raises(admission.RunRefused, match=r"use a larger patch size \(patch 1 gives 1025 tokens per image\)"):
        admission.admit(flexi, limits)
    # Patch sizes above the model's own cost no more than the model's own.
    own_only = admission.estimate_memory(flexi.replace(patch_sizes=None))
    assert admission.estimate_memory(flexi.replace(patch_sizes=(4, 8))) == own_only


def test_limits_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("VIT_EXPLORER_MAX_RUNS", "3")
    monkeypatch.setenv("VIT_EXPLORER_RUN_QUEUE", "0")
    monkeypatch.setenv("VIT_EXPLORER_RUN_MEMORY_LIMIT", "1.5")
    monkeypatch.setenv("VIT_EXPLORER_RUN_THREADS", "2")
    assert admission.Limits.from_environment() == admission.Limits(max_runs=3, queue_size=0, memory=int(1.5 * admission.GB), threads=2)
    monkeypatch.setenv("VIT_EXPLORER_MAX_RUNS", "many")
    with pytest.raises(ValueError, match="VIT_EXPLORER_MAX_RUNS must be a whole number of at least 1, not 'many'"):
        admission.Limits.from_environment()
    monkeypatch.delenv("VIT_EXPLORER_MAX_RUNS")
    monkeypatch.delenv("VIT_EXPLORER_RUN_MEMORY_LIMIT")
    defaults = admission.Limits.from_environment()
    assert defaults.max_runs == max(1, os.cpu_count() // 2)
    assert 0 < defaults.memory < admission.available_memory()


def test_queue_order_and_only_the_owner_stops(tmp_path):
    manager = runs.RunManager(tmp_path, PLENTY, process=False)
    long = small_config(tmp_path, epochs=500, snapshot_every=0)
    first = manager.launch(long, owner="alice")
    second = manager.launch(long, owner="bob")
    third = manager.launch(long, owner="alice")
    assert [first, second, third] == ["run 1", "run 2", "run 3"]
    with pytest.raises(admission.RunRefused, match="The server is busy: 1 runs are training and 2 are waiting"):
        manager.launch(long, owner="carol")
    assert list(manager.running()) == [first]
    assert [manager.place(run_id) for run_id in (first, second, third)] == [None, 1, 2]
    assert runs.ordinal(1) == "1st" and runs.ordinal(2) == "2nd" and runs.ordinal(12) == "12th"

    assert not manager.stop(first, owner="bob")  # not bob's
    wait_for_a_step(manager.runs()[first])
    assert manager.runs()[first].status == "running"
    assert manager.stop(first, owner="alice")
    assert manager.runs()[first].join(60) and manager.runs()[first].status == "stopped"
    assert list(manager.running()) == [second]  # it started by itself when the slot freed
    assert manager.place(third) == 1
    assert not manager.stop(third, owner="bob")
    assert manager.stop(third, owner="alice")  # withdrawn before it started
    assert third not in manager.runs() and manager.queued() == []
    manager.shutdown()
    assert manager.runs()[second].status == "stopped"


def test_a_fresh_manager_finds_the_runs_of_the_last_one(tmp_path):
    manager = runs.RunManager(tmp_path, PLENTY, process=False)
    finished = manager.launch(small_config(tmp_path), owner="alice")
    assert manager.runs()[finished].join(60)
    stopped = manager.launch(small_config(tmp_path, epochs=500), owner="alice")
    wait_for_a_step(manager.runs()[stopped])
    manager.shutdown()
    before = manager.runs()

    again = runs.RunManager(tmp_path, PLENTY, process=False)  # the server restarted
    after = again.runs()
    assert list(after) == [finished, stopped]
    assert [run.status for run in after.values()] == ["finished", "stopped"]
    for run_id, run in after.items():
        assert run.checkpoint == before[run_id].checkpoint
        assert run.history == before[run_id].history
    # A run stopped within its first epoch has no test accuracy on record.
    assert after[finished].test_accuracy == pytest.approx(before[finished].test_accuracy)
    assert after[finished].progress == 1.0 and 0 < after[stopped].progress < 1
    assert again.owner_of(finished) is None and not again.stop(stopped, owner="alice")
    assert again.launch(small_config(tmp_path), owner="bob") == "run 3"
    again.shutdown()


def _with(saved: dict, path: tuple, value) -> dict:
    """A deep copy of a sidecar with one value (at a path of keys) replaced."""
    copy = json.loads(json.dumps(saved))
    *parents, last = path
    target = copy
    for key in parents:
        target = target[key]
    target[last] = value
    return copy


def test_malformed_sidecars_are_skipped_and_logged_never_fatal(tmp_path, caplog):
    manager = runs.RunManager(tmp_path, PLENTY, process=False)
    good = manager.launch(small_config(tmp_path), owner="alice")
    assert manager.runs()[good].join(60) and manager.runs()[good].status == "finished"
    checkpoint = manager.runs()[good].checkpoint
    saved = training.load_history(checkpoint)
    malformed = {
        "a list": [1, 2],
        "null step": _with(saved, ("step",), None),
        "text epochs": _with(saved, ("train_config", "epochs"), "3"),
        "unknown field": _with(saved, ("train_config", "colour"), "red"),
        "no history": _with(saved, ("history",), None),
        "steps of numbers": _with(saved, ("history", "steps"), [1, 2]),
        "a step without its loss": _with(saved, ("history", "steps", 0, "loss"), None),
        "finished as text": _with(saved, ("finished",), "yes"),
        "no test accuracy": _with(saved, ("test_accuracy",), "high"),
    }
    raw = {"not json": b"{\"step\": ", "not utf-8": b"\xff\xfe{}", "nested too deep": b"[" * 100_000 + b"]" * 100_000}
    for number, content in enumerate([*(json.dumps(value).encode() for value in malformed.values()), *raw.values()], 7):
        shutil.copy(checkpoint, tmp_path / f"broken_{number}.safetensors")
        (tmp_path / f"broken_{number}.json").write_bytes(content)

    with caplog.at_level(logging.WARNING, logger="vit_explorer.training.runs"):
        again = runs.RunManager(tmp_path, PLENTY, process=False)  # the server restarts: it must not fail
    assert list(again.runs()) == [good]
    skipped = sorted(record.getMessage().split()[5] for record in caplog.records)
    numbers = range(7, 7 + len(malformed) + len(raw))
    assert skipped == sorted(str(tmp_path / f"broken_{number}.json") for number in numbers)
    assert again.launch(small_config(tmp_path), owner="bob") == "run 2"
    again.shutdown()


def test_an_ended_sae_run_is_listed_again_after_a_restart_and_stays_its_owners(tmp_path):
    weights = tmp_path / "tiny.safetensors"
    vx.save_model(randomize(vx.ViT(tiny_config())), weights)
    manager = runs.RunManager(tmp_path / "runs", PLENTY, process=False)
    config = SAETrainConfig(weights=str(weights), layer=1, images=20, epochs=1, batch_size=64, expansion=2, k=4,
                            device="cpu", log_every=2, index_top=2)
    run_id = manager.launch(config, owner="alice")
    run = manager.runs()[run_id]
    assert run.join(60) and run.status == "finished", run.error
    assert runs.run_record(run.checkpoint) == {"owner": "alice", "number": 1, "kept": False}
    assert not manager.keep(run_id, owner="bob") and manager.keep(run_id, owner="alice")  # only its owner keeps it
    assert runs.run_record(run.checkpoint)["kept"]

    again = runs.RunManager(tmp_path / "runs", PLENTY, process=False)  # the server restarted
    after = again.runs()
    assert list(after) == [run_id] and after[run_id].status == "finished" and after[run_id].progress == 1.0
    assert after[run_id].checkpoint == run.checkpoint and after[run_id].metrics == run.metrics
    assert after[run_id].history == run.history
    assert again.owner_of(run_id) == "alice" and runs.run_record(run.checkpoint)["kept"]
    assert again.launch(config, owner="bob") == "run 2"
    again.shutdown()
