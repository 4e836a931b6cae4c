"""The views' heavy computations as jobs: admitted from their cost, queued on a jobs folder every
server of a machine shares, each run in a worker process of its own, followed through files.

A job is a ``JobSpec``: what to compute (``kind``, one of ``KINDS``: the head sweep, a model's
capture of one image for the Compare page, the tokens of several images in one batch, the head
types and the register neurons over several images, the Patches page's comparison of every patch
size), the model (a checkpoint file
or a catalogue name, at a patch size and input size), what the input is (``identity``, with the
input tensor handed over at submission) and its settings. Its ``key`` hashes all of that, so a
second person asking for the same result joins the job instead of starting another.

``JobBoard`` keeps the jobs in a folder (one sub-folder per job: its record, input, progress,
result or error, cancel request), changed under an flock on the folder as ``runs.RunManager``
does, so that the limits are the folder's, not each server's: at most ``max_jobs`` run at once,
at most ``queue_size`` wait, at most one waits per owner. A worker (``_work``) runs at nice 15
with capped torch threads and the memory its estimate was granted (``admission.limit_memory``);
it reports its progress to a file, checks for a cancel file between steps, writes its result
whole and, ending, starts the oldest waiting job, so that the queue moves with nobody looking (a
worker killed cannot: whichever server looks next starts it). A worker that ends without a
result leaves its job failed with a sentence.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import resource
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..analysis import AnalysisError
from ..model.vit import ViT
from ..resources import child_python_path
from ..training.admission import GB, available_memory, environment_number, limit_memory
from ..training.priority import run_below_the_servers
from ..training.pace import Pace
from ..training.run import process_identity
from ..training.runs import ordinal
from .job_kinds import KINDS


LOCK_NAME = ".jobs.lock"
# An ended job's files stay this long, for the servers that follow it to load its result or say
# why it failed; then whichever server looks next removes them.
KEEP_SECONDS = 600.0


class JobRefused(Exception):
    """A job that cannot be admitted now; ``str()`` is the sentence to show."""


class Cancelled(Exception):
    """Raised in a worker when everybody who asked for its job has cancelled it."""


@dataclass(frozen=True)
class JobSpec:
    kind: str  # a key of KINDS
    model: dict  # {"path": checkpoint file} or {"pretrained": catalogue name}, + "mean", "std" if chosen
    patch_size: int
    image_size: tuple[int, int]
    identity: str  # what the input is (an image key): with the rest, what makes two asks the same
    settings: dict = field(default_factory=dict)

    @property
    def key(self) -> str:
        text = json.dumps(asdict(self), sort_keys=True, default=list)
        return hashlib.sha256(text.encode()).hexdigest()[:24]


@dataclass(frozen=True)
class JobStatus:
    state: str  # "queued", "running", "done" or "failed"
    owners: tuple[str, ...]  # who asked for it and has not cancelled
    place: int | None = None  # queued: 1 for the next to start
    progress: float = 0.0  # running: the share done
    error: str | None = None  # failed: why, in one sentence
    forwards: float = 0.0  # its estimate
    seconds_left: float | None = None  # running: at its pace so far (training.pace), once known
    kind: str = ""  # what it computes (job_kinds.KINDS)

    @property
    def waiting(self) -> str:
        """Where a queued job stands, in words."""
        return "next in line" if self.place == 1 else f"{ordinal(self.place)} in line"


@dataclass(frozen=True)
class JobLimits:
    max_jobs: int  # jobs running at once on the folder
    queue_size: int  # jobs that may wait for a slot
    memory: int  # bytes one worker may use
    threads: int  # torch threads of one worker

    @classmethod
    def from_environment(cls) -> JobLimits:
        """VIT_EXPLORER_MAX_JOBS (default 1: the rest of the machine serves the pages),
        VIT_EXPLORER_JOB_QUEUE (default 8), VIT_EXPLORER_JOB_MEMORY_LIMIT in GB (default: a
        quarter of the available memory, shared by the workers) and VIT_EXPLORER_JOB_THREADS
        (default: the cores but one, shared by the workers)."""
        cores = os.cpu_count() or 1
        max_jobs = int(environment_number("VIT_EXPLORER_MAX_JOBS", 1))
        queue_size = int(environment_number("VIT_EXPLORER_JOB_QUEUE", 8, minimum=0))
        memory_gb = environment_number(
            "VIT_EXPLORER_JOB_MEMORY_LIMIT", available_memory() / 4 / max_jobs / GB, float, minimum=0.1,
        )
        threads = int(environment_number("VIT_EXPLORER_JOB_THREADS", max(1, (cores - 1) // max_jobs)))
        return cls(max_jobs=max_jobs, queue_size=queue_size, memory=int(memory_gb * GB), threads=threads)


# --- the folder ---------------------------------------------------------------------------------


def _write_whole(path: Path, data: bytes) -> None:
    """A reader finds the old file or the new one, never half of one."""
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_bytes(data)
    os.replace(temporary, path)


class JobBoard:
    """The jobs on one folder, shared by every server (replica) on it; thread-safe."""

    def __init__(self, folder: str | Path, limits: JobLimits | None = None):
        self.folder = Path(folder)
        self.limits = limits or JobLimits.from_environment()
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def _locked(self):
        with self._lock:
            self.folder.mkdir(parents=True, exist_ok=True)
            with open(self.folder / LOCK_NAME, "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
                yield

    def _files(self, key: str) -> dict[str, Path]:
        job = self.folder / key
        names = ("record", "input", "progress", "result", "error", "cancel")
        files = ("record.json", "input.npy", "progress", "result.npz", "error", "cancel")
        return {"folder": job, **{name: job / file for name, file in zip(names, files)}}

    def _record(self, key: str) -> dict | None:
        try:
            return json.loads(self._files(key)["record"].read_text())
        except (OSError, ValueError):
            return None

    def _write_record(self, key: str, record: dict) -> None:
        _write_whole(self._files(key)["record"], json.dumps(record).encode())

    def _state(self, key: str, record: dict, ended: str | None = None) -> str:
        """"queued", "running", "done", "failed" or "cancelled"; a worker found dead without a
        result leaves its job failed, in a sentence every server reads. ``ended``: the job whose
        worker asks, ending (no longer running)."""
        files = self._files(key)
        if files["result"].exists():
            return "done"
        if files["error"].exists():
            return "failed"
        if record["pid"] is None:
            return "queued"
        alive = key != ended and (record["host"] != socket.gethostname() or process_identity(record["pid"]) == (
            record["pid"], record["started"]
        ))
        if alive:
            return "running"
        if files["cancel"].exists():
            return "cancelled"
        if not files["result"].exists():  # it may have written its result since the first look
            _write_whole(files["error"], (
                "The computation's process ended before it finished (it was stopped from outside or ran"
                " out of memory); run it again."
            ).encode())
            return "failed"
        return "done"

    def _jobs(self, ended: str | None = None) -> dict[str, tuple[dict, str]]:
        """key -> (record, state), oldest first; cancelled jobs and old ended ones removed."""
        jobs = []
        for record_file in self.folder.glob("*/record.json"):
            key = record_file.parent.name
            record = self._record(key)
            if record is None:
                continue
            state = self._state(key, record, ended)
            ended_long_ago = state in ("done", "failed") and time.time() - record_file.stat().st_mtime > KEEP_SECONDS
            if state == "cancelled" or ended_long_ago:
                shutil.rmtree(record_file.parent, ignore_errors=True)
                continue
            jobs.append((record["submitted"], key, record, state))
        return {key: (record, state) for _, key, record, state in sorted(jobs)}

    def _promote(self, jobs: dict[str, tuple[dict, str]]) -> None:
        """Start the oldest waiting jobs while slots are free (called with the folder locked)."""
        running = sum(state == "running" for _, state in jobs.values())
        for key, (record, state) in jobs.items():
            if running >= self.limits.max_jobs:
                return
            if state == "queued":
                process = self._spawn(key)
                identity = process_identity(process.pid)
                record.update(pid=process.pid, started=identity[1] if identity else 0, host=socket.gethostname())
                self._write_record(key, record)
                jobs[key] = (record, "running")
                running += 1

    def _spawn(self, key: str) -> subprocess.Popen:
        threads = str(self.limits.threads)
        process = subprocess.Popen(
            [sys.executable, "-c", "import sys; from vit_explorer.serving.jobs import _work; _work(sys.argv[1])",
             str(self._files(key)["folder"])],
            # OpenMP's pool is sized when torch loads: capped before it does.
            env={**os.environ, "PYTHONPATH": child_python_path(), "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads},
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True,  # neither a Ctrl-C meant for the server nor its end reaches the job
        )
        # Reaped when it ends, so that it does not linger as a zombie of this server.
        threading.Thread(target=process.wait, name=f"job-{key[:8]}", daemon=True).start()
        return process

    def _status(self, key: str, record: dict, state: str, jobs: dict) -> JobStatus:
        files = self._files(key)
        place = progress = error = left = None
        if state == "queued":
            place = [k for k, (_, s) in jobs.items() if s == "queued"].index(key) + 1
        elif state == "running":
            with contextlib.suppress(OSError, ValueError):
                progress, left = read_progress(files["progress"])
        elif state == "failed":
            with contextlib.suppress(OSError):
                error = files["error"].read_text()
        return JobStatus(
            state=state, owners=tuple(record["owners"]), place=place, progress=progress or 0.0,
            error=error, forwards=record["forwards"], seconds_left=left, kind=record["spec"]["kind"],
        )

    # --- what the servers ask -------------------------------------------------------------------

    def estimate(self, spec: JobSpec, config) -> tuple[float, int]:
        """(forward passes, peak bytes) of ``spec`` on a model of ``config``."""
        kind = KINDS[spec.kind]
        return kind.forwards(config, spec.settings), kind.memory(config, spec.settings)

    def submit(self, spec: JobSpec, x: torch.Tensor, config, owner: str) -> JobStatus:
        """Ask for ``spec`` on input ``x`` for ``owner``: joins the same job if there is one (a
        failed one is tried again), else admits it and starts or queues it. JobRefused says why not."""
        forwards, memory = self.estimate(spec, config)
        if memory > self.limits.memory:
            raise JobRefused(
                f"This would need about {memory / GB:.1f} GB of memory, more than the"
                f" {self.limits.memory / GB:.1f} GB a computation may use on this server; choose a"
                " larger patch size or a smaller input size."
            )
        key = spec.key
        with self._locked():
            jobs = self._jobs()
            if key in jobs and jobs[key][1] != "failed":
                record, state = jobs[key]
                if owner not in record["owners"]:
                    record["owners"].append(owner)
                    self._write_record(key, record)
                return self._status(key, record, state, jobs)
            waiting = [k for k, (record, state) in jobs.items() if state == "queued"]
            running = sum(state == "running" for _, state in jobs.values())
            if any(owner in jobs[k][0]["owners"] for k in waiting):
                raise JobRefused(
                    "You already have a computation waiting in the queue: cancel it, or wait until it"
                    " has started, to ask for another."
                )
            if running >= self.limits.max_jobs and len(waiting) >= self.limits.queue_size:
                raise JobRefused(
                    f"The server is busy: {running} computations are running and {len(waiting)} are"
                    " waiting, the most it takes; try again when one has ended."
                )
            files = self._files(key)
            shutil.rmtree(files["folder"], ignore_errors=True)  # a failed try's files
            files["folder"].mkdir(parents=True)
            with open(files["input"], "wb") as file:
                np.save(file, x.detach().cpu().float().numpy())
            record = {
                "spec": asdict(spec), "owners": [owner], "submitted": time.time(), "forwards": forwards,
                "memory": memory, "memory_limit": self.limits.memory, "threads": self.limits.threads,
                "max_jobs": self.limits.max_jobs,
                "pid": None, "started": None, "host": None,
            }
            self._write_record(key, record)
            jobs[key] = (record, "queued")
            self._promote(jobs)
            record, state = jobs[key]
            return self._status(key, record, state, jobs)

    def status(self, key: str) -> JobStatus | None:
        """Where job ``key`` stands (starting waiting jobs whose turn has come); None when there is
        no such job (never asked, cancelled, or ended long ago)."""
        with self._locked():
            jobs = self._jobs()
            self._promote(jobs)
            if key not in jobs:
                return None
            record, state = jobs[key]
            return self._status(key, record, state, jobs)

    def start_waiting(self, ended: str | None = None) -> None:
        """Start the oldest waiting jobs while slots are free; ``ended``: the job whose worker
        calls this as it ends, its slot free."""
        with self._locked():
            self._promote(self._jobs(ended))

    def result(self, key: str) -> tuple:
        """The values of a done job (its kind's ``decode``)."""
        record = self._record(key)
        with np.load(self._files(key)["result"], allow_pickle=False) as saved:
            arrays = {name: saved[name] for name in saved.files}
        return KINDS[record["spec"]["kind"]].decode(arrays)

    def cancel(self, key: str, owner: str) -> bool:
        """Withdraw ``owner``'s ask; the job stops once nobody else asks for it. Whether they had asked."""
        with self._locked():
            jobs = self._jobs()
            if key not in jobs or owner not in jobs[key][0]["owners"]:
                return False
            record, state = jobs[key]
            record["owners"].remove(owner)
            files = self._files(key)
            if record["owners"] or state in ("done", "failed"):
                self._write_record(key, record)
            elif state == "queued":
                shutil.rmtree(files["folder"], ignore_errors=True)
            else:  # running: its worker stops at its next step and the job is removed then
                self._write_record(key, record)
                files["cancel"].touch()
            return True


# --- the worker ---------------------------------------------------------------------------------


def _load(spec: dict) -> ViT:
    from ..weights import load_model, load_pretrained, resize_model
    from ..weights.normalization import renormalized

    model = load_pretrained(spec["model"]["pretrained"]) if "pretrained" in spec["model"] else load_model(
        spec["model"]["path"]
    )
    if "mean" in spec["model"]:  # a normalisation the person chose for a model whose own was assumed
        model = renormalized(model, spec["model"]["mean"], spec["model"]["std"])
    image_size = tuple(spec["image_size"])
    if (spec["patch_size"], image_size) != (model.config.patch_size, model.config.img_size):
        model = resize_model(model, patch_size=spec["patch_size"], image_size=image_size)
    return model.eval()


def _sentence(error: BaseException) -> str:
    if isinstance(error, AnalysisError):  # a sentence for the person already
        return str(error)
    if isinstance(error, MemoryError) or "can't allocate memory" in str(error):
        return "The computation needed more memory than it may use on this server; choose a larger patch size."
    first_line = str(error).splitlines()[0] if str(error) else ""
    return f"The computation failed ({type(error).__name__}{': ' + first_line if first_line else ''}); run it again."


def progress_reporter(folder: Path, clock: Callable[[], float] | None = None) -> Callable[[float], None]:
    """What a worker's computation calls with its share done: writes the share and the time left
    at its pace (training.pace, from its first report: loading the model is no step) to the job's
    progress file, and raises Cancelled once the job was cancelled."""
    pace, cancel = Pace(clock), folder / "cancel"

    def progress(share: float) -> None:
        if cancel.exists():
            raise Cancelled
        pace.update(share)
        left = pace.seconds_left
        _write_whole(folder / "progress", f"{share:.4f}{'' if left is None else f' {left:.1f}'}".encode())

    return progress


def read_progress(path: Path) -> tuple[float, float | None]:
    """(the share done, the seconds left or None) from a progress file (progress_reporter)."""
    share, _, seconds = path.read_text().partition(" ")
    return float(share), float(seconds) if seconds else None


def _work(folder: str) -> None:
    """A worker's whole life: load the model, compute, report progress, write the result or why
    not. Nothing it does reaches a server but its files."""
    folder = Path(folder)
    run_below_the_servers()
    inherited = resource.getrlimit(resource.RLIMIT_DATA)
    record = json.loads((folder / "record.json").read_text())
    torch.set_num_threads(record["threads"])
    spec = record["spec"]
    progress = progress_reporter(folder)
    try:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if device.type == "cpu":
            limit_memory(record["memory_limit"])
        model = _load(spec).to(device)
        x = torch.from_numpy(np.load(folder / "input.npy", allow_pickle=False))
        arrays = KINDS[spec["kind"]].compute(model, x, spec["settings"], progress)
        temporary = folder / ".result.tmp.npz"
        np.savez(temporary, **arrays)
        os.replace(temporary, folder / "result.npz")
    except Cancelled:
        pass  # the board removes a cancelled job once its worker has ended
    except BaseException as failure:  # whoever follows the job reads why
        _write_whole(folder / "error", _sentence(failure).encode())
    # This slot goes to the oldest waiting job (a board that only starts jobs: it admits none).
    resource.setrlimit(resource.RLIMIT_DATA, inherited)
    limits = JobLimits(record["max_jobs"], queue_size=0, memory=record["memory_limit"], threads=record["threads"])
    JobBoard(folder.parent, limits).start_waiting(ended=folder.name)
