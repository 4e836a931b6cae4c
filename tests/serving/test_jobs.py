"""Heavy views as jobs: admitted, queued with a cap, joined when identical, cancelled, and a
worker killed mid-job ends in a sentence; each with real worker processes."""
import os
import signal
import time
from dataclasses import astuple

import pytest
import torch

import vit_explorer as vx
from vit_explorer.analysis import patch_sizes
from vit_explorer.model.capture import layer_attentions
from vit_explorer.serving.jobs import JobBoard, JobLimits, JobRefused, JobSpec

from helpers import tiny_config


def wait_for(board: JobBoard, key: str, states: set, timeout: float = 120) -> vx.serving.jobs.JobStatus | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = board.status(key)
        if (status.state if status else None) in states:
            return status
        time.sleep(0.2)
    raise AssertionError(f"job {key} never reached {states}: {board.status(key)}")


@pytest.fixture
def slow_model(tmp_path):
    """A model whose sweep keeps a worker busy for a few seconds (ViT-S/16's shape, random)."""
    torch.manual_seed(0)
    model = vx.ViT(vx.ViTConfig(image_size=224, patch_size=16, embed_dim=384, depth=12, num_heads=6, num_classes=10))
    path = tmp_path / "slow.safetensors"
    vx.save_model(model, path)
    return model, path


@pytest.fixture
def tiny(tmp_path):
    """A tiny model, its checkpoint and an input: a job that ends in a moment."""
    torch.manual_seed(0)
    model = vx.ViT(tiny_config(num_classes=10)).eval()
    path = tmp_path / "tiny.safetensors"
    vx.save_model(model, path)
    return model, path, torch.randn(1, 3, *model.config.img_size)


def spec_of(path, model, identity="image a", mode="zero") -> JobSpec:
    config = model.config
    return JobSpec("head sweep", {"path": str(path)}, config.patch_size, config.img_size, identity, {"mode": mode})


def limits(**changes) -> JobLimits:
    return JobLimits(**{**dict(max_jobs=1, queue_size=1, memory=8 * 2**30, threads=1), **changes})


def test_a_sweep_job_gives_the_sweep_computed_in_the_server(tmp_path, tiny):
    model, path, x = tiny
    board = JobBoard(tmp_path / "jobs", limits())
    spec = spec_of(path, model, mode="mean")
    status = board.submit(spec, x, model.config, "ann")
    assert status.state == "running" and status.forwards == vx.sweep_cost(model.config)
    wait_for(board, spec.key, {"done"})
    (got,), expected = board.result(spec.key), vx.head_sweep(model, x, "mean")
    assert (got.target, got.mode) == (expected.target, "mean")
    torch.testing.assert_close(got.values, expected.values, rtol=1e-4, atol=1e-5)


def test_rollout_and_head_statistics_jobs_give_what_the_server_computes(tmp_path, tiny):
    """The Attention page's heavy parts: a rollout at any fusion and discard, every head's distance
    and entropy, each from the layers computed again from the capture's tokens, as the server does."""
    model, path, x = tiny
    config = model.config
    board = JobBoard(tmp_path / "jobs", limits(max_jobs=2))
    rollout, statistics = (
        JobSpec(kind, {"path": str(path)}, config.patch_size, config.img_size, "image a", settings)
        for kind, settings in (("rollout", {"fusion": "max", "discard": 0.5}), ("head statistics", {}))
    )
    for spec in (rollout, statistics):
        board.submit(spec, x, config, "ann")
    captured = vx.capture(model, x, layers=())
    expected = vx.analysis.streamed_rollout(
        layer_attentions(model, captured), "max", 0.5, num_prefix_tokens=captured.num_prefix_tokens,
    )
    wait_for(board, rollout.key, {"done"})
    (got,) = board.result(rollout.key)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6)
    expected = vx.analysis.captured_head_statistics(model, captured)
    wait_for(board, statistics.key, {"done"})
    ((distances, entropies),) = board.result(statistics.key)
    torch.testing.assert_close(distances, expected[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(entropies, expected[1], rtol=1e-4, atol=1e-5)


def test_a_faithfulness_job_gives_the_outputs_the_server_scores_into_its_own_curves(tmp_path, tiny):
    """The curves' passes beside the server: the maps travel in the settings (as JSON), the worker
    runs curve_rows' sets, and the curves scored from its outputs are those computed in one call."""
    from vit_explorer.analysis import faithfulness as fa

    model, path, x = tiny
    grid = model.grid_size()
    maps = {"a": torch.rand(grid, dtype=torch.float64), "b": torch.rand(grid, dtype=torch.float64)}
    config = model.config
    settings = dict(
        maps=[[name, values.reshape(-1).tolist()] for name, values in maps.items()], steps=None,
        curves=["deletion", "insertion"], mode="drop", forwards=fa.planned_forwards(model, 2, intact_given=True),
        rows=len(fa.curve_rows(model, maps)),
    )
    spec = JobSpec("faithfulness", {"path": str(path)}, config.patch_size, config.img_size, "image a", settings)
    board = JobBoard(tmp_path / "jobs", limits())
    assert board.submit(spec, x, config, "ann").forwards == pytest.approx(settings["forwards"])
    wait_for(board, spec.key, {"done"})
    (outputs,) = board.result(spec.key)
    intact = model(x)[0].detach()
    expected = fa.faithfulness_curves(model, x, maps, intact=intact)
    got = fa.faithfulness_curves(model, x, maps, intact=intact, outputs=outputs)
    for curve in fa.CURVES:
        torch.testing.assert_close(got.curves[curve], expected.curves[curve], rtol=1e-4, atol=1e-5)


def test_a_patch_sizes_job_gives_the_comparison_computed_in_the_server(tmp_path, tiny):
    """Every patch size timed on the plan the server made, and the accuracy on a held-out batch:
    the rows as the server's comparison gives them (times aside: each pass is timed where it runs)."""
    model, path, x = tiny
    config = model.config
    plan = [patch_sizes.PlannedSize(patch, 2, 0, cost) for patch, cost in ((2, 4.0), (4, 1.0), (8, 0.5))]
    held_out_plan = [patch_sizes.PlannedSize(patch, 0, 16, 1.0) for patch in (2, 4, 8)]
    spec = JobSpec("patch sizes", {"path": str(path)}, config.patch_size, config.img_size, "image a", {
        "forwards": 40.0, "plan": [astuple(planned) for planned in plan], "forward_ms": None, "image_share": 0.5,
        "held_out": [16, 0], "held_out_plan": [astuple(planned) for planned in held_out_plan],
    })
    board = JobBoard(tmp_path / "jobs", limits())
    assert board.submit(spec, x, config, "ann").forwards == 40.0
    wait_for(board, spec.key, {"done"})
    rows, accuracy = board.result(spec.key)
    expected = patch_sizes.predictions(model, x, plan)
    assert [row.keys() for row in rows] == [row.keys() for row in expected]
    for row, reference in zip(rows, expected, strict=True):
        assert row["forward ms"] > 0 and type(row["forward ms"]) is float
        assert {**row, "forward ms": 0, "probability": 0} == {**reference, "forward ms": 0, "probability": 0}
        assert row["probability"] == pytest.approx(reference["probability"], abs=1e-5)
    dataset = patch_sizes.held_out_set(config, 16, 0)
    assert accuracy == pytest.approx(patch_sizes.held_out_accuracy(model, dataset, held_out_plan))


def test_the_cap_the_queue_and_one_waiting_per_owner(tmp_path, slow_model):
    model, path = slow_model
    x = torch.randn(1, 3, 224, 224)
    board = JobBoard(tmp_path / "jobs", limits(queue_size=2))
    first = spec_of(path, model, "image a")
    assert board.submit(first, x, model.config, "ann").state == "running"
    second = spec_of(path, model, "image b")
    status = board.submit(second, x, model.config, "bob")
    assert (status.state, status.place, status.waiting) == ("queued", 1, "next in line")  # the cap: one at once
    with pytest.raises(JobRefused, match="already have a computation waiting"):
        board.submit(spec_of(path, model, "image c"), x, model.config, "bob")
    assert board.submit(spec_of(path, model, "image c"), x, model.config, "cy").place == 2
    with pytest.raises(JobRefused, match="The server is busy: 1 computations are running and 2 are waiting"):
        board.submit(spec_of(path, model, "image d"), x, model.config, "dan")
    # A second board on the folder (another replica) counts the same jobs and starts the next one.
    replica = JobBoard(tmp_path / "jobs", limits(queue_size=2))
    assert replica.status(second.key).place == 1
    wait_for(replica, first.key, {"done"})
    assert wait_for(replica, second.key, {"running", "done"}) is not None
    assert board.status(spec_of(path, model, "image c").key).state == "queued"
    with pytest.raises(JobRefused, match="more than the 0.1 GB"):
        JobBoard(tmp_path / "small", limits(memory=2**30 // 10)).submit(first, x, model.config, "ann")


def test_a_waiting_job_starts_when_the_one_before_ends_with_nobody_looking(tmp_path, tiny):
    model, path, x = tiny
    board = JobBoard(tmp_path / "jobs", limits())
    first, second = spec_of(path, model, "image a"), spec_of(path, model, "image b")
    assert board.submit(first, x, model.config, "ann").state == "running"
    assert board.submit(second, x, model.config, "bob").state == "queued"
    # Nobody polls: the first worker, ending, starts the second, which finishes.
    result = board._files(second.key)["result"]
    deadline = time.monotonic() + 120
    while not result.exists():
        assert time.monotonic() < deadline, "the waiting job never ran"
        time.sleep(0.2)
    assert board.status(first.key).state == board.status(second.key).state == "done"
    torch.testing.assert_close(board.result(second.key)[0].values, vx.head_sweep(model, x).values, rtol=1e-4, atol=1e-5)


def test_an_identical_ask_joins_the_job_and_cancel_stops_it_only_when_nobody_wants_it(tmp_path, slow_model):
    model, path = slow_model
    x = torch.randn(1, 3, 224, 224)
    board = JobBoard(tmp_path / "jobs", limits())
    spec = spec_of(path, model)
    board.submit(spec, x, model.config, "ann")
    status = board.submit(spec_of(path, model), x, model.config, "bob")  # the same ask: no second worker
    assert status.state == "running" and status.owners == ("ann", "bob")
    assert len(list((tmp_path / "jobs").glob("*/record.json"))) == 1
    assert board.cancel(spec.key, "ann") and not board.cancel(spec.key, "cy")
    pid = board._record(spec.key)["pid"]
    time.sleep(1)
    assert board.status(spec.key).state == "running"  # bob still wants it
    assert board.cancel(spec.key, "bob")
    deadline = time.monotonic() + 120
    while vx.training.run.process_identity(pid) is not None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert vx.training.run.process_identity(pid) is None and board.status(spec.key) is None
    # A waiting job withdrawn by its only owner is gone at once.
    board.submit(spec, x, model.config, "ann")
    other = spec_of(path, model, mode="mean")
    assert board.submit(other, x, model.config, "bob").state == "queued"
    assert board.cancel(other.key, "bob") and board.status(other.key) is None
    board.cancel(spec.key, "ann")


def test_a_worker_killed_mid_job_leaves_a_sentence_and_can_be_asked_again(tmp_path, slow_model):
    model, path = slow_model
    x = torch.randn(1, 3, 224, 224)
    board = JobBoard(tmp_path / "jobs", limits())
    spec = spec_of(path, model)
    board.submit(spec, x, model.config, "ann")
    pid = board._record(spec.key)["pid"]
    os.kill(pid, signal.SIGKILL)
    status = wait_for(board, spec.key, {"failed"})
    assert status.error.startswith("The computation's process ended before it finished")
    assert "Traceback" not in status.error and str(tmp_path) not in status.error
    assert board.submit(spec, x, model.config, "ann").state == "running"  # tried again
    board.cancel(spec.key, "ann")


def test_a_worker_runs_below_the_servers_in_its_own_sessions_group_too(tmp_path, slow_model):
    # A worker begins a session of its own; where the kernel groups tasks by session (autogroup),
    # the CPU is shared between groups by the group's nice first: its own nice alone let a job take
    # a core's fair share from the server.
    model, path = slow_model
    board = JobBoard(tmp_path / "jobs", limits())
    spec = spec_of(path, model)
    board.submit(spec, torch.randn(1, 3, 224, 224), model.config, "ann")
    pid = board._record(spec.key)["pid"]

    def nice() -> int:
        stat = open(f"/proc/{pid}/stat").read()
        return int(stat[stat.rindex(")") + 2:].split()[16])

    deadline = time.monotonic() + 60
    while nice() != 15 and time.monotonic() < deadline:
        time.sleep(0.1)  # the worker lowers itself first thing
    assert nice() == 15
    assert os.getsid(pid) != os.getsid(0)
    if os.path.exists("/proc/self/autogroup"):
        assert open(f"/proc/{pid}/autogroup").read().split()[-1] == "15"
    board.cancel(spec.key, "ann")
