"""A training run in the background: on a thread, or in a process of its own that any server follows.

``TrainingRun`` runs ``train.train`` (a ViT's run, a TrainConfig) or ``features.train.train_sae``
(a sparse autoencoder's, an SAETrainConfig: the run's ``kind``) and keeps a thread-safe view of
its events. A run process
(``_train_in_child``) appends its events to files beside its checkpoint (``run_files``): every
process on the runs folder can follow them (``TrainingRun.follow``) and ask the run to stop (its
stop file). The process keeps to the memory admission granted it (``admission.limit_memory``).
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from ..features.train import SAECaptureEvent, SAEDoneEvent, SAEStepEvent, SAETrainConfig, train_sae
from ..model.config import TrainConfig
from ..model.devices import resolve_device
from ..resources import child_python_path
from .admission import limit_memory, memory_status
from .pace import Pace, time_left
from .priority import run_below_the_servers
from .train import (
    DoneEvent, EpochEvent, Event, SnapshotEvent, StepEvent, TrainingError, check_run_name, checkpoint_paths,
    saved_history, saved_run, train,
)


RunConfig = TrainConfig | SAETrainConfig
KINDS = {"vit": TrainConfig, "sae": SAETrainConfig}  # a run's kind, as its record and its process name it
# Events-file names of the events that are not a ViT run's snapshot
EVENT_NAMES = {StepEvent: "step", EpochEvent: "epoch", DoneEvent: "done", SAEStepEvent: "sae_step",
               SAECaptureEvent: "sae_capture", SAEDoneEvent: "sae_done"}


def run_kind(config: RunConfig) -> str:
    return "sae" if isinstance(config, SAETrainConfig) else "vit"


def run_config(kind: str, data: dict) -> RunConfig:
    """A run's config from its record or spec; ValueError for an unknown kind or field."""
    if kind not in KINDS:
        raise ValueError(f"unknown kind of run {kind!r}")
    return KINDS[kind].from_dict(data)


def _events(config: RunConfig, stop) -> Iterator[Event]:
    return train_sae(config, stop=stop) if isinstance(config, SAETrainConfig) else train(config, stop=stop)


def readable_error(error: BaseException) -> str:
    """One sentence for a person, whatever went wrong in a run."""
    if isinstance(error, torch.cuda.OutOfMemoryError):
        return "the GPU ran out of memory; lower the batch size or use a smaller model"
    if isinstance(error, MemoryError) or "can't allocate memory" in str(error):
        return (
            "the run needed more memory than it may use; lower the batch size, use a larger patch"
            " size (fewer tokens) or a smaller dim or depth"
        )
    if isinstance(error, (ValueError, OSError)):
        return str(error).splitlines()[0] if str(error) else type(error).__name__
    first_line = str(error).splitlines()[0] if str(error) else ""
    return f"training failed: {type(error).__name__}" + (f": {first_line}" if first_line else "")


# A killed run whose peak memory came this close to its limit is taken to have run out of it.
NEAR_MEMORY_LIMIT = 0.9


def exit_sentence(
    exitcode: int, *, peak_rss: int | None = None, memory_limit: int | None = None, oom_killed: bool | None = None,
) -> str:
    """Why a run's process ended without reporting, in one sentence. A SIGKILL is blamed on
    memory when the kernel counted an out-of-memory kill meanwhile (``oom_killed``; None: the
    count is unknown) or the process's peak memory came near its limit; else someone ended it."""
    if exitcode == -signal.SIGKILL:
        lower = "lower the batch size, use a larger patch size (fewer tokens) or a smaller model"
        near_limit = peak_rss is not None and memory_limit is not None and peak_rss >= NEAR_MEMORY_LIMIT * memory_limit
        if oom_killed or near_limit:
            return f"the run's process was ended by the operating system, most likely for lack of memory; {lower}"
        if oom_killed is None:
            return f"the run's process was killed, from outside or for lack of memory; if it was memory, {lower}"
        used = "" if peak_rss is None else f" after using {peak_rss / 2**30:.1f} GB" + (
            "" if memory_limit is None else f" of the {memory_limit / 2**30:.1f} GB it may use"
        )
        return f"the run's process was killed from outside{used}, not for lack of memory; it can be started again"
    if exitcode < 0:
        return f"the run's process was ended by signal {signal.Signals(-exitcode).name}"
    return f"the run's process exited unexpectedly (exit code {exitcode})"


def _oom_kills() -> int | None:
    """How many processes the kernel has killed for lack of memory since boot (None: unknown)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/vmstat").read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == "oom_kill":
                return int(value)
    return None


FOLLOW_SECONDS = 0.25  # how often a run's events file and its process are looked at


def run_files(config: RunConfig) -> dict[str, Path]:
    """A run's shared files beside its checkpoint, which any process on the runs folder can
    follow: its events (JSON lines appended by the run), its latest attention snapshot (replaced
    whole) and the stop request anyone may leave."""
    folder, name = Path(config.out_dir).expanduser(), check_run_name(config.run_name)
    return {
        "events": folder / f"{name}.events.jsonl",
        "snapshot": folder / f"{name}.snapshot.npz",
        "stop": folder / f"{name}.stop",
    }


def has_ended(config: RunConfig) -> bool:
    """Whether a run's events file ends with its "end" line (its last few hundred bytes)."""
    try:
        with open(run_files(config)["events"], "rb") as file:
            file.seek(max(0, file.seek(0, os.SEEK_END) - 512))
            return b'"event": "end"' in file.read()
    except OSError:
        return False


class EventLog:
    """Writes a run's events to its files (see run_files): one whole line per event, flushed."""

    def __init__(self, config: RunConfig):
        self.files = run_files(config)
        self._file = open(self.files["events"], "a", encoding="utf-8")  # noqa: SIM115 (closed in close)

    def _append(self, line: dict) -> None:
        self._file.write(json.dumps(line) + "\n")
        self._file.flush()

    def write(self, event: Event) -> None:
        if isinstance(event, SnapshotEvent):
            path = self.files["snapshot"]
            temporary = path.with_name(f".{path.name}.tmp")
            with open(temporary, "wb") as file:
                np.savez(
                    file, image=event.image, attentions=np.asarray(event.attentions, dtype=np.float32),
                    grid_size=np.array(event.grid_size), num_prefix_tokens=np.array(event.num_prefix_tokens),
                    prediction=np.array(event.prediction), probabilities=np.array(event.probabilities),
                    step=np.array(event.step),
                )
            os.replace(temporary, path)  # a reader loads the old snapshot or the new, never half of one
            self._append({"event": "snapshot", "step": event.step})
        else:
            self._append({"event": EVENT_NAMES[type(event)], **asdict(event)})

    def end(self, error: str | None, peak_rss: int | None) -> None:
        """The last line: why the run failed (None: it did not) and its process's peak memory."""
        self._append({"event": "end", "error": error, "peak_rss": peak_rss})

    def close(self) -> None:
        self._file.close()


class EventReader:
    """Reads the lines a run has appended to its events file since the last call."""

    def __init__(self, path: Path):
        self.path = path
        self._offset = 0
        self._partial = b""  # a line the run is still writing

    def read(self) -> list[dict]:
        try:
            with open(self.path, "rb") as file:
                file.seek(self._offset)
                data = file.read()
        except FileNotFoundError:
            return []
        self._offset += len(data)
        *lines, self._partial = (self._partial + data).split(b"\n")
        records = []
        for line in lines:
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                if isinstance(record, dict):
                    records.append(record)
        return records


def _decoded(record: dict, snapshot: Path) -> Event | None:
    """The event an events-file line stands for; None for a line (or snapshot) that cannot be read."""
    kind = record.pop("event", None)
    try:
        if kind == "snapshot":
            with np.load(snapshot, allow_pickle=False) as saved:
                return SnapshotEvent(
                    step=int(saved["step"]), image=saved["image"],
                    attentions=torch.from_numpy(saved["attentions"]),
                    grid_size=tuple(int(size) for size in saved["grid_size"]),
                    num_prefix_tokens=int(saved["num_prefix_tokens"]), prediction=str(saved["prediction"]),
                    probabilities=[float(value) for value in saved["probabilities"]],
                )
        if kind == "done":
            by_patch = record.get("test_accuracy_by_patch_size")
            if by_patch is not None:
                record["test_accuracy_by_patch_size"] = {int(patch): value for patch, value in by_patch.items()}
        return {name: event for event, name in EVENT_NAMES.items()}[kind](**record)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def process_identity(pid: int) -> tuple[int, int] | None:
    """(pid, its start time in clock ticks since boot) while that process lives, else None: a
    recorded pid names the same process only while both match (pids are reused)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # after "pid (command) "
    if fields[0] in ("Z", "X"):  # a zombie has ended
        return None
    return pid, int(fields[19])


def _train_in_child(spec_json: str) -> None:
    """A run process's whole life: train, append every event to the run's events file, end with
    an "end" line. It reports to no one in particular, so it outlives the server that started it."""
    spec = json.loads(spec_json)
    run_below_the_servers()
    torch.set_num_threads(spec["threads"])
    config = run_config(spec["kind"], json.loads(spec["config"]))
    memory_limit = spec["memory_limit"]
    log = EventLog(config)
    stop = run_files(config)["stop"]
    error = None
    try:
        if memory_limit is not None and resolve_device(config.device).type == "cpu":
            limit_memory(memory_limit)
        for event in _events(config, _StopRequest(stop)):
            log.write(event)
    except BaseException as failure:  # whoever follows the run reads why; the process then ends normally
        error = readable_error(failure)
    log.end(error, memory_status("VmHWM"))
    log.close()


class _StopRequest:
    """``train``'s stop flag for a run process: set once someone has left the run's stop file."""

    def __init__(self, path: Path):
        self.path = path

    def is_set(self) -> bool:
        return self.path.exists()


class TrainingRun:
    """``train(config)`` in the background, with a thread-safe view of how it is going.

    By default it trains on a thread of this process. With ``process=True`` it trains in a
    process of its own (a session of its own too, so that it outlives this one) with ``threads``
    CPU threads and at most ``memory_limit`` bytes (CPU runs): a crash, an out-of-memory or a
    runaway config then ends that run only. Such a run appends its events to a file beside its
    checkpoint (``run_files``), which a thread here follows, as any other process may
    (``TrainingRun.follow``); ``publish=True`` writes that file from a thread run too. ``status``
    is "pending", "running", "stopped", "finished" or "failed" (then ``error`` says why in one
    sentence). Nothing ever raises into the caller or touches a UI. ``on_end`` is called (from
    the run's thread) once the run has ended.
    """

    def __init__(
        self, config: RunConfig, *, process: bool = False, threads: int = 1,
        memory_limit: int | None = None, on_end: Callable[[], None] | None = None, publish: bool = False,
    ):
        self.config = config
        self._lock = threading.Lock()
        self._process_mode = process
        self._publish = publish
        self._stop = threading.Event()
        self._threads = threads
        self._memory_limit = memory_limit
        self._on_end = on_end
        self._thread: threading.Thread | None = None
        self._process: subprocess.Popen | None = None
        self._followed: tuple[int, int] | None = None  # (pid, start time) of a process started elsewhere
        self._followed_here = True  # that process is on this machine, where its life can be watched
        self._status = "pending"
        self._error: str | None = None
        self._peak_rss: int | None = None
        self._steps: list[dict] = []
        self._epochs: list[dict] = []
        self._latest_snapshot: SnapshotEvent | None = None
        self._done: DoneEvent | SAEDoneEvent | None = None
        self._progress = 0.0
        self._pace = Pace()  # from the first step: loading and capturing before it are no step
        self._captured: SAECaptureEvent | None = None  # an SAE run's capture before its first step
        self._capture_pace = Pace()
        if isinstance(config, TrainConfig) and config.resume:
            with contextlib.suppress(TrainingError, OSError):
                self._steps, self._epochs = saved_history(checkpoint_paths(config)["checkpoint"])

    @classmethod
    def restored(cls, checkpoint: str | Path) -> "TrainingRun":
        """A run that ended earlier (in another server's life), rebuilt from its checkpoint's
        sidecar; a TrainingError says in one sentence why a sidecar cannot be one."""
        saved = saved_run(checkpoint)
        run = cls(saved.config)
        run._steps, run._epochs = saved.steps, saved.epochs
        run._status = "finished" if saved.finished else "stopped"
        run._progress = saved.progress
        run._done = DoneEvent(
            checkpoint=str(checkpoint), stopped=not saved.finished, test_accuracy=saved.test_accuracy,
            seconds=math.nan,
        )
        return run

    @classmethod
    def restored_sae(cls, config: SAETrainConfig) -> "TrainingRun | None":
        """A sparse autoencoder's run that ended earlier, rebuilt from its events file (its curves,
        its end); None unless it ended with its dictionary written and that file is still there."""
        run = cls(config)
        ended = None
        for record in EventReader(run_files(config)["events"]).read():
            if record.get("event") == "end":
                ended = record
            elif (event := _decoded(record, run_files(config)["snapshot"])) is not None:
                run._record(event)
        if ended is None or ended.get("error") is not None or not isinstance(run._done, SAEDoneEvent):
            return None
        if not Path(run._done.path).is_file():
            return None
        run._end(None)
        return run

    def follow(self, pid: int, started: int, host: str | None = None) -> "TrainingRun":
        """Follow this run's process, started elsewhere (another server, or this one before a
        restart) as process ``pid`` at ``started`` (see process_identity) on ``host`` (None: this
        machine), through its files. A process on another machine cannot be watched from here:
        its run is followed until its events end (whoever sees it die writes that end)."""
        with self._lock:
            if self._thread is not None or self._status != "pending":
                raise RuntimeError("this run has already been started")
            self._followed, self._status = (pid, started), "running"
            self._followed_here = host in (None, socket.gethostname())
            self._thread = threading.Thread(target=self._follow, name=f"follow-{self.config.run_name}", daemon=True)
            self._thread.start()
        return self

    def start(self) -> "TrainingRun":
        with self._lock:
            if self._thread is not None or self._status != "pending":
                raise RuntimeError("this run has already been started")
            self._status = "running"
            target = self._work
            if self._process_mode:
                target = self._follow
                try:
                    self._process = self._spawn()
                except BaseException as failure:  # could not start: this run fails alone
                    self._status, self._error = "failed", readable_error(failure)
                    target = None
            if target is not None:
                self._thread = threading.Thread(target=target, name=f"train-{self.config.run_name}", daemon=True)
                self._thread.start()
        if target is None and self._on_end is not None:
            self._on_end()
        return self

    def _spawn(self) -> subprocess.Popen:
        files = run_files(self.config)
        files["events"].parent.mkdir(parents=True, exist_ok=True)
        files["events"].write_bytes(b"")  # a run of the same name before: its events are not this one's
        files["stop"].unlink(missing_ok=True)
        spec = json.dumps({
            "kind": run_kind(self.config), "config": self.config.to_json(), "threads": self._threads,
            "memory_limit": self._memory_limit,
        })
        return subprocess.Popen(
            [sys.executable, "-c", "import sys; from vit_explorer.training.run import _train_in_child;"
             " _train_in_child(sys.argv[1])", spec],
            env={**os.environ, "PYTHONPATH": child_python_path()}, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            start_new_session=True,  # neither a Ctrl-C meant for the server nor its end reaches the run
        )

    def stop(self) -> None:
        """Ask the run to end after its current step; it still writes a checkpoint. A run process
        (here or elsewhere) is asked through its stop file, which any server may leave."""
        self._stop.set()
        if (stop_file := self._stop_file()) is not None:
            with contextlib.suppress(OSError):
                stop_file.touch()

    def _stop_file(self) -> Path | None:
        """The file that asks this run's process to stop (None: the run trains on a thread here)."""
        return run_files(self.config)["stop"] if self._process_mode or self._followed is not None else None

    @property
    def stop_requested(self) -> bool:
        """Whether a stop has been asked for a run still running (by anyone, for a run process:
        its stop file). Such a run still finishes its step, tests itself and writes its checkpoint,
        which at nice 15 on a busy machine can take a minute."""
        if self.status != "running":
            return False
        if self._stop.is_set():
            return True
        stop_file = self._stop_file()
        return stop_file is not None and stop_file.exists()

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the run to end; True if it has."""
        if self._thread is not None:
            self._thread.join(timeout)
        return self._thread is not None and not self._thread.is_alive()

    def _record(self, event: Event) -> None:
        with self._lock:
            if isinstance(event, (StepEvent, SAEStepEvent)):
                self._steps.append(asdict(event))
                self._progress = event.step / event.total_steps
                self._pace.update(self._progress)
            elif isinstance(event, SAECaptureEvent):
                self._captured = event
                self._capture_pace.update(event.images / max(event.total_images, 1))
            elif isinstance(event, EpochEvent):
                self._epochs.append(asdict(event))
            elif isinstance(event, SnapshotEvent):
                self._latest_snapshot = event
            else:
                self._done = event

    def _end(self, error: str | None) -> None:
        with self._lock:
            if error is not None:
                self._status, self._error = "failed", error
            else:
                self._status = "stopped" if self._done is not None and self._done.stopped else "finished"
                if self._status == "finished":
                    self._progress = 1.0
        if self._on_end is not None:
            self._on_end()

    def _work(self) -> None:
        error = None
        log = None
        try:
            if self._publish:
                run_files(self.config)["events"].parent.mkdir(parents=True, exist_ok=True)
                log = EventLog(self.config)
            for event in _events(self.config, self._stop):
                self._record(event)
                if log is not None:
                    log.write(event)
        except BaseException as failure:  # a failed run reports, it never takes the caller down
            error = readable_error(failure)
        if log is not None:
            with contextlib.suppress(OSError):
                log.end(error, None)
                log.close()
        self._end(error)

    def _follow(self) -> None:
        """Read the run's events as its process appends them, until it ends."""
        process, files = self._process, run_files(self.config)
        reader = EventReader(files["events"])
        ended = None
        # Should the process be killed before it reports, these tell whether memory was why: its
        # peak memory as seen from here (peak_rss), and the kernel's count of out-of-memory kills.
        oom_kills = _oom_kills()
        pid = process.pid if process is not None else self._followed[0]
        caught_up = False
        try:
            while ended is None:
                if process is not None:
                    alive = process.poll() is None
                else:
                    alive = process_identity(pid) == self._followed if self._followed_here else ended is None
                for record in reader.read():
                    if record.get("event") == "end":
                        ended = record
                    elif (event := _decoded(record, files["snapshot"])) is not None:
                        self._record(event)
                if not caught_up:  # the pace is measured from now, not from the steps read at once
                    caught_up = True
                    with self._lock:
                        self._pace = Pace()
                        if self._steps:
                            self._pace.update(self._progress)
                if alive and self._followed_here:
                    with contextlib.suppress(OSError, ValueError):  # gone meanwhile
                        peak = memory_status("VmHWM", pid)
                        with self._lock:
                            self._peak_rss = max(self._peak_rss or 0, peak)
                if not alive:
                    break
                if ended is None:
                    time.sleep(FOLLOW_SECONDS)
            if process is not None:
                process.wait()
        except BaseException as failure:  # could not follow the run: it fails alone
            if process is not None and process.poll() is None:
                process.kill()
                process.wait()
            ended = {"error": readable_error(failure)}
        if ended is not None:
            peak, error = ended.get("peak_rss"), ended.get("error")
            with self._lock:
                self._peak_rss = peak if isinstance(peak, int) and peak > 0 else self._peak_rss  # its own count: exact
            error = error if isinstance(error, str) or error is None else "the run ended with an unreadable report"
        elif process is not None:
            now = _oom_kills()
            error = exit_sentence(
                process.returncode or 0, peak_rss=self.peak_rss, memory_limit=self._memory_limit,
                oom_killed=None if None in (now, oom_kills) else now > oom_kills,
            )
        else:  # started elsewhere: its exit status went to that server
            error = (
                "the run's process ended without reporting why: it was killed, from outside or for lack of"
                " memory; it can be started again, smaller if it was memory"
            )
        if ended is None:  # the process ended without its end line: say why, for every follower
            with contextlib.suppress(OSError), open(files["events"], "a", encoding="utf-8") as events:
                events.write(json.dumps({"event": "end", "error": error, "peak_rss": self.peak_rss}) + "\n")
        self._end(error)

    @property
    def pid(self) -> int | None:
        """The training process's id (process mode, once started)."""
        if self._process is not None:
            return self._process.pid
        return self._followed[0] if self._followed is not None else None

    @property
    def peak_rss(self) -> int | None:
        """The training process's peak resident memory in bytes (process mode): so far while it
        runs (read every FOLLOW_SECONDS), then its own exact count once it has ended (a
        killed process's last reading)."""
        with self._lock:
            return self._peak_rss

    @property
    def status(self) -> str:
        with self._lock:
            return self._status

    @property
    def error(self) -> str | None:
        with self._lock:
            return self._error

    @property
    def progress(self) -> float:
        with self._lock:
            return self._progress

    @property
    def eta_seconds(self) -> float | None:
        """Seconds left at the pace since the first step; None until that pace is known."""
        with self._lock:
            if self._status == "finished":
                return 0.0
            return self._pace.seconds_left if self._status == "running" else None

    @property
    def doing(self) -> str:
        """What the run is doing, in words: before its first step, what takes that long."""
        with self._lock:
            if self._steps or self._status != "running":
                return "training"
            captured, seconds = self._captured, self._capture_pace.seconds_left
        if isinstance(self.config, SAETrainConfig):
            doing = f"capturing layer {self.config.layer}'s tokens"
            if captured is None:
                return doing
            if captured.images >= captured.total_images:  # until the first steps are logged
                return f"{doing}: {captured.images:,} of {captured.total_images:,} images, training starts"
            left = time_left(seconds)
            return f"{doing}: {captured.images:,} of {captured.total_images:,} images{left and left + ' for them'}, then training"
        return "preparing its data"

    @property
    def capturing(self) -> tuple[int, int] | None:
        """(images captured, of how many) while a sparse autoencoder's run captures the tokens of
        its first chunk, before its first step; else None."""
        with self._lock:
            if self._steps or self._status != "running" or self._captured is None:
                return None
            return self._captured.images, self._captured.total_images

    @property
    def history(self) -> dict[str, list[dict]]:
        with self._lock:
            return {"steps": list(self._steps), "epochs": list(self._epochs)}

    @property
    def latest_snapshot(self) -> SnapshotEvent | None:
        with self._lock:
            return self._latest_snapshot

    @property
    def checkpoint(self) -> str | None:
        """The checkpoint's path once the run has written its final one (a sparse autoencoder's
        dictionary)."""
        with self._lock:
            if isinstance(self._done, SAEDoneEvent):
                return self._done.path
            return self._done.checkpoint if self._done is not None else None

    @property
    def test_accuracy(self) -> float | None:
        """A ViT run's test accuracy once it has ended (None for a sparse autoencoder's)."""
        with self._lock:
            return self._done.test_accuracy if isinstance(self._done, DoneEvent) else None

    @property
    def metrics(self) -> dict | None:
        """A sparse autoencoder run's final metrics once it has ended (explained variance, L0, ...)."""
        with self._lock:
            return self._done.metrics if isinstance(self._done, SAEDoneEvent) else None
