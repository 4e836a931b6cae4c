"""How long is left (training/pace.py): a job and a run of known steps report a time left within
a factor of 2 of the real remaining time after their first tenth, on a clock the test drives, so
that nothing depends on how loaded the machine is; a job's worker writes its time left where
every server reads it."""
import itertools

import pytest

import vit_explorer as vx
from vit_explorer.serving.jobs import Cancelled, progress_reporter, read_progress
from vit_explorer.training import run as run_module
from vit_explorer.training.pace import Pace, time_left

from helpers import small_run_config


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("durations", [
    [1.5] * 40,  # even steps
    [1.0, 2.0] * 20,  # uneven steps
    [1.0 + step / 20 for step in range(40)],  # steps that slow down to twice as long
])
def test_a_job_of_known_steps_says_its_time_left_within_a_factor_of_2_after_its_first_tenth(durations):
    clock, pace = Clock(), None
    clock.now = 12.0  # loading the model: no step, and no part of the steps' pace
    pace = Pace(clock)
    pace.update(0.0)
    total, done, checked = len(durations), 0.0, 0
    for step, duration in enumerate(durations, 1):
        clock.now += duration
        done += duration
        pace.update(step / total)
        if step / total >= 0.1 and step < total:
            real = sum(durations[step:])
            assert 0.5 <= pace.seconds_left / real <= 2, (step, pace.seconds_left, real)
            checked += 1
    assert checked >= 30 and pace.seconds_left == 0.0


def test_a_run_of_known_steps_says_its_time_left_within_a_factor_of_2_after_its_first_tenth(tmp_path, monkeypatch):
    """A real run (a thread) of 16 steps, its clock a step a tick: what the Train page and the
    sidebar read (eta_seconds) against the steps that were still to come."""
    ticks = itertools.count()
    monkeypatch.setattr(run_module, "Pace", lambda: Pace(clock=lambda: float(next(ticks))))
    seen = []
    record = run_module.TrainingRun._record

    def recording(run, event):
        record(run, event)
        if isinstance(event, vx.StepEvent):
            seen.append((event.step, event.total_steps, run.eta_seconds, run.doing))

    monkeypatch.setattr(run_module.TrainingRun, "_record", recording)
    run = run_module.TrainingRun(small_run_config(tmp_path, epochs=4), process=False).start()
    assert run.join(timeout=300) and run.status == "finished", run.error
    total = seen[0][1]
    assert total == len(seen) == 16
    for step, _, left, doing in seen:
        assert doing == "training"
        if step / total >= 0.1 and step < total:
            assert 0.5 <= left / (total - step) <= 2, (step, left)
    assert run.eta_seconds == 0.0


def test_a_job_worker_writes_its_time_left_for_every_server_within_a_factor_of_2(tmp_path):
    """What a job's computation reports (20 steps of 3 clock seconds after 10 s of loading), as the
    board reads it back from the job's folder."""
    clock = Clock()
    report = progress_reporter(tmp_path, clock)
    clock.now = 10.0
    report(0.0)
    for step in range(1, 21):
        clock.now += 3.0
        report(step / 20)
        share, left = read_progress(tmp_path / "progress")
        assert share == step / 20
        if step >= 2 and step < 20:
            assert 0.5 <= left / (3.0 * (20 - step)) <= 2, (step, left)
    (tmp_path / "cancel").touch()
    with pytest.raises(Cancelled):
        report(1.0)


def test_the_time_left_in_words():
    assert [time_left(seconds) for seconds in (None, 0.2, 40, 200, 7200)] == [
        "", ", about 1 s left", ", about 40 s left", ", about 3 min left", ", about 2.0 h left",
    ]


def test_every_job_kind_says_what_it_is_doing():
    from vit_explorer.app import jobs
    from vit_explorer.serving.job_kinds import KINDS

    assert set(jobs.DOING) == set(KINDS)


def test_an_sae_run_says_how_far_its_capture_is_and_its_time_left_for_it(tmp_path, monkeypatch):
    """Before a dictionary's first step its run captures the layer's tokens (about 40 s on the
    shipped model's 2,000 images): the run says how many images are done and, after the first
    tenth, the time left for them within a factor of 2 (a clock a pass a tick)."""
    from vit_explorer.features.train import SAECaptureEvent, SAEStepEvent, SAETrainConfig

    ticks = itertools.count()
    monkeypatch.setattr(run_module, "Pace", lambda: Pace(clock=lambda: float(next(ticks))))
    run = run_module.TrainingRun(SAETrainConfig(weights="default", layer=2, out_dir=str(tmp_path)), process=False)
    run._status = "running"  # as its thread sets it: the events below are what that thread records
    assert run.doing == "capturing layer 2's tokens" and run.capturing is None
    total = 2000
    for done in range(0, total + 1, 100):
        run._record(SAECaptureEvent(images=done, total_images=total))
        doing = run.doing
        assert run.capturing == (done, total)  # the Train page's bar: images done of images
        assert doing.startswith(f"capturing layer 2's tokens: {done:,} of 2,000 images")
        assert doing.endswith(", then training" if done < total else ", training starts")
        if 0.1 <= done / total < 1:
            left = float(doing.split("about ")[1].split(" s left")[0])
            assert 0.5 <= left / ((total - done) / 100) <= 2, doing
    run._record(SAEStepEvent(step=1, total_steps=10, epoch=1, mse=1.0, explained_variance=0.5, l0=8.0, dead_share=0.0))
    assert run.capturing is None and run.doing == "training"  # the steps' own progress takes over
